"""The EAGLE-3 head: its eager chain against the independent reference of eagle3_reference.py
(plain torch from the published architecture, no registry), programs equal to the eager chain
bitwise on CPU at widths 1..8, the head over a further reduced vocabulary, and its config."""
from __future__ import annotations

import math

import pytest
import torch

from draft_circuit.circuit.layers.config import ConfigError
from draft_circuit.circuit.layers.draft_vocab import DraftVocab, bind_draft_vocab
from draft_circuit.circuit.layers.eagle3 import Eagle3Config, Eagle3Head
from draft_circuit.circuit.layers.mtp import emit_draft_chain
from draft_circuit.circuit.planner import CompileOptions, compile_draft
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.testing import assert_program_matches_eager, run_draft_runner, run_side_by_side

from tests.layers.eagle3_reference import CFG, KV, K, checkpoint, eager_inputs, paged_rows, reference_chain


@pytest.mark.parametrize("norm_before_residual", [False, True])
@pytest.mark.parametrize("width", [1, 3, 8])
def test_eager_chain_matches_the_published_architecture(width, norm_before_residual):
    cfg = Eagle3Config(**{**CFG.__dict__, "norm_before_residual": norm_before_residual})
    head, w = Eagle3Head(cfg), checkpoint(cfg)
    chain = emit_draft_chain(head, K, max_width=8, kv=KV)
    batch = eager_inputs(width, seed=width)
    states = batch.clone_states()
    out = EagerRunner(chain, head.bind(w), states).run(batch.inputs)
    for i in range(width):
        keys, vals = paged_rows(batch, i, batch.lives[i])
        drafts, confs, hidden = reference_chain(w, cfg, K, int(batch.inputs["tokens"][i]), batch.inputs["hidden"][i],
                                                int(batch.inputs["positions"][i]), keys, vals)
        assert out["drafts"][i].tolist() == drafts, f"row {i}"
        torch.testing.assert_close(out["confidences"][i], torch.tensor(confs), atol=1e-5, rtol=0)
        torch.testing.assert_close(out["hidden_out"][i], hidden, atol=1e-5, rtol=1e-5)
        tables = batch.inputs["block_tables"][i]
        for r in range(batch.lives[i], batch.lives[i] + K):  # its k KV rows, as the reference wrote them
            blk, off = tables[r // KV.block_size], r % KV.block_size
            torch.testing.assert_close(states["k_cache"][blk, off], keys[r].view_as(states["k_cache"][blk, off]),
                                       atol=1e-5, rtol=1e-5)
    assert set(out["drafts"].flatten().tolist()) <= set((torch.arange(70) + w["d2t"]).tolist())


def test_bound_lm_head_rows_ascend_whatever_order_d2t_has():
    head, w = Eagle3Head(CFG), checkpoint()
    params = head.bind(w)
    targets = torch.arange(CFG.draft_vocab_size) + w["d2t"]
    ids = params["draft_vocab.ids"]
    assert ids.tolist() == sorted(targets.tolist())
    order = torch.argsort(targets)
    assert torch.equal(params["lm_head.weight"], w["lm_head.weight"][order])
    assert head.param_shapes()["self_attn.q_proj.weight"] == (32, 64)  # q/k/v take 2H
    assert head.param_shapes()["fc.weight"] == (32, 72)  # 3 x target_hidden_size


@pytest.mark.parametrize("masked", [False, True])
def test_programs_equal_the_eager_chain_bitwise_at_widths_1_to_8(masked):
    head = Eagle3Head(CFG)
    params = head.bind(checkpoint())
    chain = emit_draft_chain(head, K, max_width=8, kv=KV, bitmask=masked, embed_target=True,
                             confidence_stop=True)

    def batch_for(n: int) -> tuple[dict, dict]:
        batch = eager_inputs(n, seed=30 + n)
        if masked:
            g = torch.Generator().manual_seed(n)
            batch.inputs["bitmask"] = torch.randint(-2**31, 2**31 - 1, (n, 5), generator=g,
                                                    dtype=torch.int64).to(torch.int32)
        batch.inputs["log_tau"] = torch.full((n,), math.log(0.05))
        return batch.inputs, {**batch.states(), "embed_target": torch.zeros(8, CFG.hidden_size)}

    assert_program_matches_eager(chain, params, range(1, 9), batch_for, run_program=run_draft_runner)


@pytest.mark.parametrize("width", [1, 3])
def test_triton_program_matches_eager(width):
    head = Eagle3Head(CFG)
    params = head.bind(checkpoint())
    chain = emit_draft_chain(head, K, max_width=4, kv=KV, embed_target=True)
    compiled = compile_draft(chain, params, [width], options=CompileOptions(interpret_kernels=True))
    kernels = {x.kernel for x in compiled.programs[width].launches}
    # the final norm rides in the fused lm-head (issue 15: fuse_rmsnorm_argmax), and with the
    # draft vocabulary map_ids and keep_if_active fold into it too (issue 18)
    assert {"triton_rmsnorm_linear_argmax_keep", "triton_rope_kv_write", "triton_decode_attention"} <= kernels
    batch = eager_inputs(width, seed=50 + width)
    states = {**batch.states(), "embed_target": torch.zeros(4, CFG.hidden_size)}
    r = run_side_by_side(chain, params, compiled, batch.inputs, states)
    assert torch.equal(r.got["drafts"], r.want["drafts"])
    torch.testing.assert_close(r.got["confidences"], r.want["confidences"], atol=1e-5, rtol=1e-5)


def test_a_further_reduced_vocabulary_lies_inside_the_drafters_own():
    head, w = Eagle3Head(CFG), checkpoint()
    own = (torch.arange(CFG.draft_vocab_size) + w["d2t"]).tolist()
    vocab = DraftVocab(tuple(own[:30]), CFG.vocab_size)
    params = bind_draft_vocab(head.bind(w), head, vocab)
    chain = emit_draft_chain(head, K, max_width=8, kv=KV, draft_vocab=30)
    batch = eager_inputs(5, seed=7)
    out = EagerRunner(chain, params, batch.clone_states()).run(batch.inputs)
    assert set(out["drafts"].flatten().tolist()) <= set(vocab.ids)
    with pytest.raises(ValueError, match="must be an int in \\[1, 70\\]"):
        emit_draft_chain(head, K, max_width=8, kv=KV, draft_vocab=71)


# ---- config ----
def test_config_reads_the_published_fields_and_their_defaults():
    d = {k: v for k, v in CFG.to_hf().items() if k not in ("draft_vocab_size", "target_hidden_size",
                                                          "norm_before_residual")}
    c = Eagle3Config.from_hf(d)
    assert c.draft_vocab_size == c.vocab_size and c.target_hidden_size == c.hidden_size
    assert not c.norm_before_residual and c.aux_layer_ids is None
    assert Eagle3Config.from_hf(CFG.to_hf()) == CFG
    assert CFG.tapped_layers(32) == (1, 15, 28)  # the inputs of layers 2, L/2, L-3
    named = Eagle3Config.from_hf({**d, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}})
    assert named.tapped_layers(61) == (1, 29, 57)
    with pytest.raises(ConfigError, match="has no such layer"):
        named.tapped_layers(40)


@pytest.mark.parametrize("fields, match", [
    ({"draft_vocab_size": 200}, "more than 'vocab_size'"),
    ({"draft_vocab_size": 0}, "'draft_vocab_size' = 0"),
    ({"num_hidden_layers": 2}, "runs one decoder layer"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2]}}, "three layer ids"),
    ({"eagle_aux_hidden_state_layer_ids": [1, 2, 3], "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 4]}},
     "aliases disagree"),
])
def test_bad_configs_are_refused_by_field(fields, match):
    with pytest.raises(ConfigError, match=match):
        Eagle3Config.from_hf({**CFG.to_hf(), **fields}, source="x/config.json")
