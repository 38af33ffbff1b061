"""On the GPU (`-m cuda`): the Qwen2 (q/k/v bias), Qwen3 (q/k norm) and GLM-4.5 (partial rotary,
bias, q/k norm, fp32 gate, top-1 normalised) MTP chains in bf16, planned with the Triton kernels
(biased linear, head_rmsnorm, partial rope_kv_write, GLM's fp32-gate router) and captured into CUDA graphs: each replay
equals the program run uncaptured bitwise, the fp32 eager oracle under the near-tie rule, and
replay allocates nothing."""
import dataclasses

import pytest
import torch

from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.moe import MoeConfig, MoeMtpHead, random_moe_weights
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.circuit.planner import compile_draft
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.testing import (assert_no_allocation, compare_drafts, cuda, random_draft_batch,
                                           random_mtp_weights)

pytestmark = cuda.marks
BASE = MtpConfig(vocab_size=3000, hidden_size=256, intermediate_size=704, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=1e6,
                 num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=4096)
GLM = MoeConfig(**dataclasses.asdict(BASE), n_routed_experts=8, num_experts_per_tok=1, moe_intermediate_size=128,
                n_shared_experts=1, routed_scaling_factor=2.5, fp32_gate=True, norm_top1=True)
HEADS = {
    "qwen2": (MtpHead, dataclasses.replace(BASE, qkv_bias=True)),
    "qwen3": (MtpHead, dataclasses.replace(BASE, qk_norm=True)),
    "glm4_moe": (MoeMtpHead, dataclasses.replace(GLM, qkv_bias=True, qk_norm=True, partial_rotary_factor=0.5)),
}
KV = KvLayout(num_blocks=8 * 16 + 1, block_size=16, max_blocks_per_seq=16)
K, WIDTHS = 4, list(range(1, 9))


def build(family: str, device: str):
    """(config, bf16 chain, fp32 oracle chain, bf16 params, fp32 params) of a family's head on
    `device`, from the same stored-name weights."""
    head_type, config = HEADS[family]
    weights = random_moe_weights(config, seed=1) if isinstance(config, MoeConfig) else random_mtp_weights(config, seed=1)
    oracle = head_type(config)  # fp32 references
    fast = head_type(config, "bfloat16")
    chain, fp32_chain = (emit_draft_chain(h, K, max_width=8, kv=KV) for h in (fast, oracle))
    params = {k: v.to(device) for k, v in fast.bind(weights).items()}
    fp32_params = {k: v.to(device) for k, v in oracle.bind(weights).items()}
    return config, chain, fp32_chain, params, fp32_params


def against_oracle(got, batch, fp32_chain, fp32_params) -> tuple[int, int]:
    """bf16 drafts against the fp32 eager oracle on the same batch: a row is compared until its
    first near tie (lm-head top-2 log-prob gap < 5e-2) or mismatch; (compared, mismatched)."""
    fp32_inputs = {k: v.float() if v.is_floating_point() else v for k, v in batch.inputs.items()}
    fp32_states = {k: v.float() for k, v in batch.clone_states().items()}
    keep = tuple(f"s{j}.lm_head" for j in range(K))
    want = EagerRunner(fp32_chain, fp32_params, fp32_states).run(fp32_inputs, keep=keep)
    gaps = torch.stack([(lambda t: t[:, 0] - t[:, 1])(want[k].log_softmax(-1).topk(2, dim=-1).values)
                        for k in keep], dim=1)
    return compare_drafts(got, want, gaps, conf_atol=5e-2, tie_gap=5e-2, strict=False)


def enough(compared: int, mismatched: int) -> bool:
    """Most steps compared (near ties stop a row), and at most a tenth of them mismatched."""
    return compared > 0.5 * K * sum(WIDTHS) and mismatched <= 0.1 * compared


@pytest.mark.parametrize("family", sorted(HEADS))
def test_captured_family_chain_equals_program_and_eager(family):
    from draft_circuit.runners.cudagraph import GraphRunner
    from draft_circuit.runners.program import ProgramRunner
    config, chain, fp32_chain, params, fp32_params = build(family, "cuda")
    compiled = compile_draft(chain, params, WIDTHS, device="cuda")
    kernels = {(x.op, x.kernel) for x in compiled.programs[4].launches}
    assert ("rope_kv_write", "triton_rope_kv_write") in kernels
    assert (("head_rmsnorm", "triton_head_rmsnorm") in kernels) == config.qk_norm
    if isinstance(config, MoeConfig):  # GLM-4.5's fp32 gate over the bf16 rows: its own Triton binding
        assert ("moe_route", "triton_moe_route_fp32_gate") in kernels
    if config.qkv_bias:
        assert any(x.op == "linear" and x.kernel == "triton_linear" and len(x.inputs) == 3
                   for x in compiled.programs[4].launches)
    batch0 = random_draft_batch(config, KV, 1, seed=0, num_drafts=K, device="cuda", dtype=torch.bfloat16)
    runner = GraphRunner(compiled, batch0.clone_states())
    assert runner.widths == tuple(WIDTHS), runner.stats.failures
    compared = mismatched = 0
    for n in WIDTHS:
        batch = random_draft_batch(config, KV, n, seed=10 + n, num_drafts=K, device="cuda", dtype=torch.bfloat16)
        plain = ProgramRunner(compiled, batch.clone_states()).run(batch.inputs)
        for name, t in batch.clone_states().items():
            runner.program.states[name].copy_(t)
        got = runner.run(batch.inputs)
        for k in ("drafts", "confidences", "hidden_out"):
            assert torch.equal(got[k], plain[k]), (family, n, k)
        c, m = against_oracle(got, batch, fp32_chain, fp32_params)
        compared, mismatched = compared + c, mismatched + m
        for name, dst in runner.input_buffers(n).items():
            dst.copy_(batch.inputs[name])
        assert_no_allocation(runner.execute, n)
    assert enough(compared, mismatched), (compared, mismatched)
