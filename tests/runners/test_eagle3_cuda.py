"""On the GPU (`-m cuda`): the EAGLE-3 chain and an MTP chain over a reduced vocabulary (mask
remapped on the device) captured into CUDA graphs: each replay equals the same program run
uncaptured bitwise, the fp32 eager oracle under the near-tie rule, and replay allocates nothing."""
import pytest
import torch

from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.draft_vocab import DraftVocab, bind_draft_vocab
from draft_circuit.circuit.layers.eagle3 import Eagle3Config, Eagle3Head
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.circuit.planner import compile_draft
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.testing import (assert_no_allocation, compare_drafts, cuda, random_draft_batch,
                                           random_mtp_weights)

from tests.layers.eagle3_reference import checkpoint

pytestmark = cuda.marks
E3 = Eagle3Config(vocab_size=3000, hidden_size=256, intermediate_size=704, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=500000.0,
                  num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=4096,
                  draft_vocab_size=1000, target_hidden_size=192)
MTP = MtpConfig(vocab_size=3000, hidden_size=256, intermediate_size=704, num_attention_heads=8,
                num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=4096)
KV = KvLayout(num_blocks=8 * 16 + 1, block_size=16, max_blocks_per_seq=16)
K, WIDTHS = 4, list(range(1, 9))


def _eagle3():
    head = Eagle3Head(E3)
    chain = emit_draft_chain(head, K, max_width=8, kv=KV, bitmask=True)
    params = {k: v.cuda() for k, v in head.bind(checkpoint(E3, seed=1)).items()}
    return chain, params, E3.target_hidden_size * 3


def _subset():
    head = MtpHead(MTP)
    vocab = DraftVocab(tuple(torch.randperm(MTP.vocab_size, generator=torch.Generator().manual_seed(0))[:700].tolist()),
                       MTP.vocab_size)
    chain = emit_draft_chain(head, K, max_width=8, kv=KV, bitmask=True, draft_vocab=vocab.size)
    params = {k: v.cuda() for k, v in bind_draft_vocab(head.bind(random_mtp_weights(MTP, seed=1)), head, vocab).items()}
    return chain, params, MTP.hidden_size


def _batch(n, hidden, seed):
    b = random_draft_batch(MTP, KV, n, seed=seed, num_drafts=K, device="cuda", bitmask=True)
    g = torch.Generator().manual_seed(seed)
    b.inputs["hidden"] = torch.randn(n, hidden, generator=g).cuda()
    b.inputs["bitmask"][:, :] = -1  # everything allowed in half the rows, a random mask in the rest
    b.inputs["bitmask"][::2] = torch.randint(-2**31, 2**31 - 1, b.inputs["bitmask"][::2].shape,
                                             generator=g, dtype=torch.int64).to(torch.int32).cuda()
    return b


@pytest.mark.parametrize("build", [_eagle3, _subset], ids=["eagle3", "subset"])
def test_captured_chain_equals_program_and_eager(build):
    from draft_circuit.runners.cudagraph import GraphRunner
    from draft_circuit.runners.program import ProgramRunner
    chain, params, hidden = build()
    compiled = compile_draft(chain, params, WIDTHS, device="cuda")
    runner = GraphRunner(compiled, _batch(1, hidden, 0).clone_states())
    assert runner.widths == tuple(WIDTHS), runner.stats.failures
    compared = 0
    for n in WIDTHS:
        batch = _batch(n, hidden, seed=10 + n)
        states = batch.clone_states()
        keep = tuple(f"s{j}.lm_head" for j in range(K))
        want = EagerRunner(chain, params, states).run(batch.inputs, keep=keep)
        gaps = torch.stack([(lambda t: t[:, 0] - t[:, 1])(want[k].log_softmax(-1).topk(2, dim=-1).values)
                            for k in keep], dim=1)
        plain = ProgramRunner(compiled, batch.clone_states()).run(batch.inputs)
        for name, t in batch.clone_states().items():
            runner.program.states[name].copy_(t)
        got = runner.run(batch.inputs)
        for k in ("drafts", "confidences", "hidden_out"):
            assert torch.equal(got[k], plain[k]), (n, k)
        compared += compare_drafts(got, want, gaps, conf_atol=1e-3)[0]
        for name, dst in runner.input_buffers(n).items():
            dst.copy_(batch.inputs[name])
        assert_no_allocation(runner.execute, n)
    assert compared > 0.8 * K * sum(WIDTHS)
