"""On the GPU (`-m cuda`): the Qwen3-Next MTP chain in bf16 (gated attention, zero-centred norms with
the gain 1 + weight formed in fp32, partial rotary 0.25, softmax top-2 MoE, sigmoid-gated shared
expert), planned with the Triton kernels (sigmoid_mul, zero_centred_rmsnorm and
zero_centred_head_rmsnorm, rope_kv_write, the grouped MoE) and captured into CUDA
graphs: each replay equals the program run uncaptured bitwise and the fp32 eager oracle under the
near-tie rule, and replay allocates nothing.

The near-tie rule here has two parts (`oracle_gaps`): the lm-head's top-2 log-prob gap, as every
family's, and the router's: a softmax top-k router whose k-th and (k+1)-th experts are near tied
in the oracle is a coin any bf16 rounding may flip, and a flipped expert changes the step's
output wholesale (the 2026-12-02 H200 failure, "row 0 step 3: confidence off by 0.087", was
such a flip: width 2, row 0, step 3 routes to expert 1 where the oracle picks expert 4, their
router logits 0.0028 apart; the bf16 eager chain on CPU flips the same expert, 0.078 off,
tests/layers/test_qwen3_next_bf16.py)."""
import math

import pytest
import torch

from draft_circuit.circuit.layers.mtp import KvLayout, emit_draft_chain
from draft_circuit.circuit.layers.qwen3_next import (ROUTER, ZERO_CENTRED_NORMS, Qwen3NextMtpConfig,
                                                     Qwen3NextMtpHead, qwen3_next_mtp_shapes)
from draft_circuit.circuit.planner import compile_draft
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.testing import assert_no_allocation, compare_drafts, cuda, random_draft_batch

pytestmark = cuda.marks
CONFIG = Qwen3NextMtpConfig(vocab_size=3000, hidden_size=256, intermediate_size=512, num_attention_heads=8,
                            num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e7,
                            num_hidden_layers=4, tie_word_embeddings=False, max_position_embeddings=4096,
                            qk_norm=True, partial_rotary_factor=0.25, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=128, shared_expert_intermediate_size=256)
KV = KvLayout(num_blocks=8 * 16 + 1, block_size=16, max_blocks_per_seq=16)
K, WIDTHS = 4, list(range(1, 9))
TIE_GAP = 5e-2  # bf16 against fp32: log-prob gaps below this may flip (lm-head token or routed expert)
# the oracle's values `oracle_gaps` reads, per step
GAP_KEEP = tuple(f"s{j}.{v}" for j in range(K) for v in ("lm_head", "post_attention_layernorm"))


def oracle_gaps(want: dict[str, torch.Tensor], fp32_params: dict[str, torch.Tensor], top_k: int) -> torch.Tensor:
    """[n, K]: per row and step, the smaller of the oracle's lm-head top-2 log-prob gap and its
    routing margin, the log-prob gap between the k-th and (k+1)-th expert of the softmax router
    (= the gap of their router logits, the softmax's normaliser cancelling). `want` is the fp32
    eager run with `keep=GAP_KEEP`."""
    gaps = []
    for j in range(K):
        top2 = want[f"s{j}.lm_head"].float().log_softmax(-1).topk(2, dim=-1).values
        logits = want[f"s{j}.post_attention_layernorm"].float() @ fp32_params[ROUTER].float().T
        ranked = logits.topk(top_k + 1, dim=-1).values
        gaps.append(torch.minimum(top2[:, 0] - top2[:, 1], ranked[:, top_k - 1] - ranked[:, top_k]))
    return torch.stack(gaps, dim=1)


def random_weights(c: Qwen3NextMtpConfig, seed: int) -> dict[str, torch.Tensor]:
    """Stored-name weights: zero-centred norms 0.1 N (gains 1 + weight near 1), embeddings N, the rest
    N / sqrt(fan-in)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in qwen3_next_mtp_shapes(c).items():
        t = torch.randn(shape, generator=g)
        out[name] = 0.1 * t if name in ZERO_CENTRED_NORMS else t if "embed" in name else t / math.sqrt(shape[-1])
    return out


def test_captured_qwen3_next_chain_equals_program_and_eager():
    from draft_circuit.runners.cudagraph import GraphRunner
    from draft_circuit.runners.program import ProgramRunner
    weights = random_weights(CONFIG, seed=1)
    oracle, fast = Qwen3NextMtpHead(CONFIG), Qwen3NextMtpHead(CONFIG, "bfloat16")
    chain, fp32_chain = (emit_draft_chain(h, K, max_width=8, kv=KV) for h in (fast, oracle))
    params = {k: v.cuda() for k, v in fast.bind(weights).items()}
    fp32_params = {k: v.cuda() for k, v in oracle.bind(weights).items()}
    compiled = compile_draft(chain, params, WIDTHS, device="cuda")
    kernels = {(x.op, x.kernel) for x in compiled.programs[4].launches}
    assert {("sigmoid_mul", "triton_sigmoid_mul"), ("zero_centred_head_rmsnorm", "triton_zero_centred_head_rmsnorm"),
            ("zero_centred_rmsnorm", "triton_zero_centred_rmsnorm"), ("rope_kv_write", "triton_rope_kv_write"),
            ("moe_experts", "triton_moe_grouped")} <= kernels
    batch0 = random_draft_batch(CONFIG, KV, 1, seed=0, num_drafts=K, device="cuda", dtype=torch.bfloat16)
    runner = GraphRunner(compiled, batch0.clone_states())
    assert runner.widths == tuple(WIDTHS), runner.stats.failures
    compared = mismatched = 0
    for n in WIDTHS:
        batch = random_draft_batch(CONFIG, KV, n, seed=10 + n, num_drafts=K, device="cuda", dtype=torch.bfloat16)
        plain = ProgramRunner(compiled, batch.clone_states()).run(batch.inputs)
        for name, t in batch.clone_states().items():
            runner.program.states[name].copy_(t)
        got = runner.run(batch.inputs)
        for k in ("drafts", "confidences", "hidden_out"):
            assert torch.equal(got[k], plain[k]), (n, k)
        fp32_inputs = {k: v.float() if v.is_floating_point() else v for k, v in batch.inputs.items()}
        fp32_states = {k: v.float() for k, v in batch.clone_states().items()}
        want = EagerRunner(fp32_chain, fp32_params, fp32_states).run(fp32_inputs, keep=GAP_KEEP)
        gaps = oracle_gaps(want, fp32_params, CONFIG.num_experts_per_tok)
        # bf16 against the fp32 oracle: a row is compared until its first near tie (token or
        # routed expert) or mismatch
        c, m = compare_drafts(got, want, gaps, conf_atol=5e-2, tie_gap=TIE_GAP, strict=False)
        compared, mismatched = compared + c, mismatched + m
        for name, dst in runner.input_buffers(n).items():
            dst.copy_(batch.inputs[name])
        assert_no_allocation(runner.execute, n)
    assert compared > 0.5 * K * sum(WIDTHS) and mismatched <= 0.1 * compared, (compared, mismatched)
