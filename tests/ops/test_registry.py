"""Every registered op: its shape rule agrees with its reference's output at widths 1, 3 and 8.

Each op needs an example here; a newly registered op without one fails `test_every_op_has_an_example`.
"""
import pytest
import torch

from draft_circuit.circuit.ir import ROW, TensorSpec
from draft_circuit.ops.registry import REGISTRY, CostContext, torch_dtype

NB, BS, HKV, D = 12, 4, 2, 8


def S(dtype, *shape):
    return TensorSpec(dtype=dtype, shape=shape)


def _tables(n, g):
    return torch.randperm(NB, generator=g)[: n * 3].view(n, 3).int() if n * 3 <= NB else \
        torch.randint(0, NB, (n, 3), generator=g, dtype=torch.int32)


# op -> (input specs, attrs, special input makers by index)
EXAMPLES = {
    "add": ([S("float32", ROW, 6), S("float32", ROW, 6)], {}),
    "cast": ([S("float32", ROW, 6)], {"dtype": "float16"}),
    "silu_mul": ([S("float32", ROW, 10)], {}),
    "concat": ([S("float32", ROW, 3), S("float32", ROW, 5)], {}),
    "stack": ([S("int32", ROW), S("int32", ROW), S("int32", ROW)], {}),
    "rmsnorm": ([S("float32", ROW, 6), S("float32", 6)], {"eps": 1e-5}),
    "add_rmsnorm": ([S("float32", ROW, 6), S("float32", ROW, 6), S("float32", 6)], {}),
    "linear": ([S("float32", ROW, 6), S("float32", 5, 6)], {}),
    "linear_silu_mul": ([S("float32", ROW, 6), S("float32", 10, 6)], {}),
    "embedding": ([S("float32", 11, 6), S("int32", ROW)], {}),
    "embed_write": ([S("float32", ROW, 6), S("float32", 11, 6), S("int32", ROW), S("int32", ROW)], {}),
    "rope": ([S("float32", ROW, 2 * D), S("int32", ROW)], {"head_dim": D, "pos_offset": 1}),
    "kv_write": ([S("float32", NB, BS, HKV, D), S("float32", NB, BS, HKV, D),
                  S("float32", ROW, HKV * D), S("float32", ROW, HKV * D), S("int32", ROW, 3),
                  S("int32", ROW)], {"row_offset": 1}),
    "rope_kv_write": ([S("float32", ROW, 2 * HKV * D), S("float32", ROW, HKV * D),
                       S("float32", ROW, HKV * D), S("int32", ROW),
                       S("float32", NB, BS, HKV, D), S("float32", NB, BS, HKV, D),
                       S("int32", ROW, 3), S("int32", ROW)], {"head_dim": D, "row_offset": 1}),
    "decode_attention": ([S("float32", ROW, 2 * HKV * D), S("float32", NB, BS, HKV, D),
                          S("float32", NB, BS, HKV, D), S("int32", ROW, 3), S("int32", ROW)],
                         {"row_offset": 1}),
    "confidence_gate": ([S("int32", ROW), S("float32", ROW), S("float32", ROW)], {}),
    "keep_if_active": ([S("int32", ROW), S("int32", ROW), S("int32", ROW)], {}),
    "argmax_logprob": ([S("float32", ROW, 70), S("int32", ROW, 3)], {}),
    "linear_argmax_logprob": ([S("float32", ROW, 6), S("float32", 70, 6), S("int32", ROW, 3)], {}),
    "moe_route": ([S("float32", ROW, 6), S("float32", 8, 6), S("float32", 8)],
                  {"top_k": 2, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5}),
    "moe_experts": ([S("float32", ROW, 6), S("int32", ROW, 2), S("float32", ROW, 2),
                     S("float32", 4, 10, 6), S("float32", 4, 6, 5), S("float32", 8, 6),
                     S("float32", 6, 4)], {}),
    "moe_experts_fp8": ([S("float32", ROW, 6), S("int32", ROW, 2), S("float32", ROW, 2),
                         S("float8_e4m3fn", 4, 10, 6), S("float32", 4, 1, 1),
                         S("float8_e4m3fn", 4, 6, 5), S("float32", 4, 1, 1)], {}),
}
# inputs that must hold valid values, by (op, input name)
INDEX_INPUTS = {"ids": 11, "positions": 50, "live_rows": 5, "active": 2}


def make_input(op, i, spec, n, g):
    name = op.inputs[0] if op.variadic else op.inputs[i]
    shape = spec.concrete({ROW: n})
    if name == "block_tables":
        return _tables(n, g)
    if name in INDEX_INPUTS:
        return torch.randint(0, INDEX_INPUTS[name], shape, generator=g, dtype=torch_dtype(spec.dtype))
    if spec.dtype.startswith("int"):
        return torch.randint(-2**31, 2**31 - 1, shape, generator=g, dtype=torch.int64).to(torch_dtype(spec.dtype))
    return torch.randn(shape, generator=g).to(torch_dtype(spec.dtype))


def test_every_op_has_an_example():
    assert set(REGISTRY) <= set(EXAMPLES), f"ops without an example: {set(REGISTRY) - set(EXAMPLES)}"


@pytest.mark.parametrize("width", [1, 3, 8])
@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_shape_rule_matches_reference(name, width):
    op = REGISTRY[name]
    specs, attrs = EXAMPLES[name]
    parsed = op.parse_attrs(attrs)
    out_specs = op.infer(specs, parsed)
    assert len(out_specs) == len(op.outputs)
    g = torch.Generator().manual_seed(width)
    tensors = [make_input(op, i, s, width, g) for i, s in enumerate(specs)]
    outs = op.reference(tensors, parsed)
    env = {ROW: width}
    for spec, t in zip(out_specs, outs):
        assert tuple(t.shape) == spec.concrete(env), (name, spec, t.shape)
        assert t.dtype == torch_dtype(spec.dtype), (name, spec, t.dtype)
    for out_i, in_i in op.mutates.items():  # state writers return the very storage they were given
        assert outs[out_i] is tensors[in_i]
    cost = op.cost_at(specs, out_specs, parsed, CostContext(width=width), env)
    assert cost.bytes_read > 0 and cost.bytes_written > 0 and cost.flops >= 0
