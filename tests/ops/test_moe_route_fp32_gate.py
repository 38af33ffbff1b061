"""moe_route's Triton binding for an fp32 gate over 16-bit rows (GLM-4.5's router, which
transformers keeps fp32; before it, such a gate sent moe_route to its reference on the GPU: one
small product a row): it applies only then, computes what the reference does (the rows widened to
fp32 exactly, the fp32 linear, route_select), a row's result never depends on the rows beside it,
it launches what it declares (one Triton linear plus torch ops), and a 16-bit GLM-4.5 MTP chain is
planned with it and drafts what the eager chain drafts."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from draft_circuit.circuit.ir import ROW, TensorSpec
from draft_circuit.circuit.layers.moe import MoeConfig, MoeMtpHead, random_moe_weights
from draft_circuit.circuit.layers.mtp import KvLayout, emit_draft_chain
from draft_circuit.circuit.planner import CompileOptions, compile_draft
from draft_circuit.ops import get_op
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.program import ProgramRunner
from draft_circuit.circuit.layers.config import DEFAULT_CONFIG
from draft_circuit.runners.testing import random_draft_batch

OP = get_op("moe_route")
ATTRS = OP.parse_attrs({"top_k": 2, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "norm_top1": True})
BINDING = next(k for k in OP.kernels if k.name == "triton_moe_route_fp32_gate")


def specs(x_dtype: str, gate_dtype: str) -> list[TensorSpec]:
    return [TensorSpec(dtype=x_dtype, shape=(ROW, 32)), TensorSpec(dtype=gate_dtype, shape=(8, 32)),
            TensorSpec(dtype="float32", shape=(8,))]


@pytest.mark.parametrize("x, gate, applies", [("bfloat16", "float32", True), ("float16", "float32", True),
                                              ("float32", "float32", False), ("bfloat16", "bfloat16", False)])
def test_applies_to_an_fp32_gate_over_16_bit_rows_only(x, gate, applies):
    assert BINDING.applies("interpret", specs(x, gate), ATTRS) == applies
    chosen = [k.name for k in OP.kernels if k.applies("interpret", specs(x, gate), ATTRS)]
    assert len(chosen) == 1  # exactly one Triton binding for each pairing


def _run(x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor) -> list[torch.Tensor]:
    n = x.shape[0]
    outs = [torch.empty(n, 2, dtype=torch.int32), torch.empty(n, 2)]
    BINDING.launch([x, gate, bias], outs, [torch.empty(n, 8), torch.empty(n, 32)], ATTRS)
    return outs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_matches_the_reference_and_rows_are_independent(dtype):
    g = torch.Generator().manual_seed(3)
    x, gate, bias = torch.randn(9, 32, generator=g).to(dtype), torch.randn(8, 32, generator=g), 0.1 * torch.randn(8, generator=g)
    ids, weights = _run(x, gate, bias)
    want_ids, want_weights = OP.reference([x, gate, bias], ATTRS)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-6)
    for i in (0, 4, 8):  # a row alone gives the bits it gives in the batch
        alone = _run(x[i:i + 1].contiguous(), gate, bias)
        assert torch.equal(alone[0], ids[i:i + 1]) and torch.equal(alone[1], weights[i:i + 1])


def test_launches_what_it_declares(interpreted_launches):
    seen = interpreted_launches
    g = torch.Generator().manual_seed(1)
    _run(torch.randn(3, 32, generator=g).bfloat16(), torch.randn(8, 32, generator=g), torch.zeros(8))
    assert len(seen) == 1  # the Triton linear; the widening copy and route_select are torch ops
    same = next(k for k in OP.kernels if k.name == "triton_moe_route")
    assert BINDING.launch_count(specs("bfloat16", "float32"), ATTRS) == \
        same.launch_count(specs("float32", "float32"), ATTRS) + 1  # + the widening copy


def test_a_16_bit_glm_chain_is_planned_with_it_and_drafts_as_eager():
    config = MoeConfig(**{**dataclasses.asdict(DEFAULT_CONFIG), "hidden_size": 64, "head_dim": 16},
                       n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                       n_group=2, topk_group=1, routed_scaling_factor=2.5, fp32_gate=True, norm_top1=True)
    head = MoeMtpHead(config, "float16")  # the interpreter runs fp16 kernels (numpy has no bf16)
    params = head.bind(random_moe_weights(config, seed=2))
    assert params["mlp.gate.weight"].dtype == torch.float32
    kv = KvLayout(num_blocks=24, block_size=4, max_blocks_per_seq=6)
    chain = emit_draft_chain(head, 2, max_width=4, kv=kv)
    compiled = compile_draft(chain, params, [3], options=CompileOptions(interpret_kernels=True))
    assert ("moe_route", "triton_moe_route_fp32_gate") in {(x.op, x.kernel) for x in compiled.programs[3].launches}
    b = random_draft_batch(config, kv, 3, seed=4, num_drafts=2, dtype=torch.float16)
    want = EagerRunner(chain, params, b.clone_states()).run(b.inputs)
    got = ProgramRunner(compiled, b.clone_states()).run(b.inputs)
    assert torch.equal(got["drafts"], want["drafts"])
