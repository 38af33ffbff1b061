"""Every registered op: its shape rule agrees with its reference's output at widths 1, 3 and 8,
its tags are declared (writes_state derived from mutates), and every kernel it binds that
applies under the Triton interpreter computes what its reference does.

Each op needs an example here; a newly registered op without one fails `test_every_op_has_an_example`.
"""
from pathlib import Path

import pytest
import torch

from draft_circuit.circuit.ir import DTYPES, ROW, TensorSpec
from draft_circuit.ops.bindings import FLOAT_DTYPES, Applies, KernelBinding
from draft_circuit.ops.registry import REGISTRY, TAGS, WRITES_STATE, CostContext, OpDef, get_op, torch_dtype

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
    "head_rmsnorm": ([S("float32", ROW, 3 * D), S("float32", D)], {"eps": 1e-5}),
    "zero_centred_rmsnorm": ([S("float32", ROW, 6), S("float32", 6)], {"eps": 1e-5}),
    "zero_centred_head_rmsnorm": ([S("float32", ROW, 3 * D), S("float32", D)], {"eps": 1e-5}),
    "sigmoid_mul": ([S("float32", ROW, 6), S("float32", ROW, 1)], {}),
    "add_rmsnorm": ([S("float32", ROW, 6), S("float32", ROW, 6), S("float32", 6)], {}),
    "linear": ([S("float32", ROW, 6), S("float32", 5, 6)], {}),
    "linear_silu_mul": ([S("float32", ROW, 6), S("float32", 10, 6)], {}),
    "linear_argmax_keep": ([S("float32", ROW, 6), S("float32", 40, 6), S("int32", ROW), S("int32", ROW, 2)], {}),
    "linear_qkv": ([S("float32", ROW, 6), S("float32", 8, 6), S("float32", 4, 6), S("float32", 4, 6)], {}),
    "linear_concat": ([S("float32", ROW, 3), S("float32", ROW, 5), S("float32", 7, 8)], {}),
    # issue 15: the prologue / epilogue linears (ops/prologue_linear.py)
    "linear_add": ([S("float32", ROW, 6), S("float32", 5, 6), S("float32", ROW, 5)], {}),
    "rmsnorm_linear_qkv": ([S("float32", ROW, 6), S("float32", 6), S("float32", 8, 6), S("float32", 4, 6),
                            S("float32", 4, 6)], {"eps": 1e-5}),
    "rmsnorm_linear_silu_mul": ([S("float32", ROW, 6), S("float32", 6), S("float32", 10, 6)], {}),
    "rmsnorm_linear_argmax_logprob": ([S("float32", ROW, 6), S("float32", 6), S("float32", 70, 6),
                                       S("int32", ROW, 3)], {}),
    "rmsnorm_linear_argmax_keep": ([S("float32", ROW, 6), S("float32", 6), S("float32", 40, 6),
                                    S("int32", ROW), S("int32", ROW, 2)], {}),
    "rmsnorm_linear_argmax_keep_last": ([S("float32", ROW, 6), S("float32", 6), S("float32", 40, 6),
                                         S("int32", ROW), S("int32", ROW), S("int32", ROW, 2)], {}),
    "rmsnorm_linear_argmax_keep_gate": ([S("float32", ROW, 6), S("float32", 6), S("float32", 40, 6),
                                         S("int32", ROW), S("float32", ROW)], {}),
    "rmsnorm_linear_argmax_keep_last_gate": ([S("float32", ROW, 6), S("float32", 6), S("float32", 40, 6),
                                              S("int32", ROW), S("int32", ROW), S("float32", ROW),
                                              S("int32", ROW, 2)], {}),
    "rmsnorm_linear_qkv_rope_kv_write": ([S("float32", ROW, 6), S("float32", 6), S("float32", 2 * HKV * D, 6),
                                          S("float32", HKV * D, 6), S("float32", HKV * D, 6), S("int32", ROW),
                                          S("float32", NB, BS, HKV, D), S("float32", NB, BS, HKV, D),
                                          S("int32", ROW, 3), S("int32", ROW), S("int32", ROW)],
                                         {"head_dim": D, "row_offset": 1}),
    # issue 14: the KV-only catch-up's fused ops (ops/kv_only.py)
    "linear_kv": ([S("float32", ROW, 6), S("float32", HKV * D, 6), S("float32", HKV * D, 6)], {}),
    "rmsnorm_linear_kv": ([S("float32", ROW, 6), S("float32", 6), S("float32", HKV * D, 6),
                           S("float32", HKV * D, 6)], {"eps": 1e-5}),
    "rope_k_kv_write": ([S("float32", ROW, HKV * D), S("float32", ROW, HKV * D), S("int32", ROW),
                         S("float32", NB, BS, HKV, D), S("float32", NB, BS, HKV, D),
                         S("int32", ROW, 3), S("int32", ROW), S("int32", ROW)],
                        {"head_dim": D, "row_offset": 1, "pos_offset": 2}),
    "embed_rmsnorm_linear_concat": ([S("float32", 11, 3), S("int32", ROW), S("float32", 3),
                                     S("float32", ROW, 5), S("float32", 5), S("float32", 7, 8)], {}),
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
    "map_ids": ([S("int32", ROW), S("int32", 16)], {}),
    "remap_bitmask": ([S("int32", ROW, 3), S("int32", 37)], {}),
    "linear_argmax_logprob": ([S("float32", ROW, 6), S("float32", 70, 6), S("int32", ROW, 3)], {}),
    "rope_freqs": ([S("float32", ROW, 2 * D), S("int32", ROW), S("float32", D // 2)],
                   {"head_dim": D, "attention_factor": 1.2, "pos_offset": 1}),
    "head_linear": ([S("float32", ROW, 3 * 5), S("float32", 3, 4, 5)], {}),
    "linear_fp8": ([S("float32", ROW, 130), S("float8_e4m3fn", 5, 130), S("float32", 5, 2)], {}),
    "mla_kv_write": ([S("float32", NB, BS, 1, 4), S("float32", NB, BS, 1, 6), S("float32", ROW, 6),
                      S("float32", ROW, 4), S("int32", ROW, 3), S("int32", ROW), S("int32", ROW)],
                     {"row_offset": 1}),
    "mla_decode_attention": ([S("float32", ROW, 3 * 6), S("float32", ROW, 3 * 4), S("float32", NB, BS, 1, 4),
                              S("float32", NB, BS, 1, 6), S("int32", ROW, 3), S("int32", ROW)],
                             {"scale": 0.3, "row_offset": 1}),
    "input_guard": ([S("int32", ROW), S("int32", ROW, 3), S("int32", ROW), S("int32", ROW), S("int32", 8)],
                    {"vocab": 11, "num_blocks": NB, "block_size": BS, "steps": 2, "scratch_block": 0}),
    "moe_route": ([S("float32", ROW, 6), S("float32", 8, 6), S("float32", 8)],
                  {"top_k": 2, "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5}),
    "moe_experts": ([S("float32", ROW, 6), S("int32", ROW, 2), S("float32", ROW, 2),
                     S("float32", 4, 10, 6), S("float32", 4, 6, 5), S("float32", 8, 6),
                     S("float32", 6, 4)], {}),
    "moe_experts_fp8": ([S("float32", ROW, 6), S("int32", ROW, 2), S("float32", ROW, 2),
                         S("float8_e4m3fn", 4, 10, 6), S("float32", 4, 1, 1),
                         S("float8_e4m3fn", 4, 6, 5), S("float32", 4, 1, 1)], {}),
    # collectives at world size 1, the only one a single process runs (tests/distributed: more)
    "all_reduce": ([S("float32", ROW, 6)], {}),
    "all_gather": ([S("float32", ROW, 6)], {}),
    "vocab_parallel_argmax": ([S("float32", ROW, 70), S("int32", ROW, 3)], {"vocab_size": 70}),
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


# ---- tags: declared on each op, writes_state derived ----
def test_writes_state_is_derived_from_mutates():
    writers = {name for name, op in REGISTRY.items() if op.mutates}
    assert writers == {"embed_write", "kv_write", "rope_kv_write", "mla_kv_write", "input_guard",
                       "rmsnorm_linear_qkv_rope_kv_write", "rope_k_kv_write"}
    for name, op in REGISTRY.items():
        assert op.writes_state == op.has(WRITES_STATE) == (name in writers), name


def _op(**kw):
    return OpDef(name="t", inputs=("x",), outputs=("x",), infer=lambda i, a: i,
                 reference=lambda t, a: (t[0],), **kw)


def test_tags_are_checked_where_an_op_is_declared():
    with pytest.raises(ValueError, match="'writes_state' is derived from `mutates`"):
        _op(tags=frozenset({WRITES_STATE}), mutates={0: 0})
    with pytest.raises(ValueError, match=r"unknown tags \['elementwize'\]"):
        _op(tags=frozenset({"elementwize"}))
    with pytest.raises(ValueError, match="unknown tag"):
        get_op("add").has("elementwize")
    assert _op(mutates={0: 0}).tags == {WRITES_STATE}
    assert _op().tags == frozenset()
    binding = KernelBinding("k", lambda *a: None, Applies(frozenset({"cuda"})))
    with pytest.raises(ValueError, match="kernel names repeat"):
        _op(kernels=(binding, binding))


def test_every_op_is_in_a_plan_page_group():
    from draft_circuit.circuit.viz.graph import op_group
    assert all(REGISTRY[name].tags <= TAGS for name in REGISTRY)
    assert {name: op_group(name) for name in REGISTRY if op_group(name) == "other"} == {}
    assert op_group("not_an_op") == "other"  # a report from another build still renders


def test_float_dtypes_are_the_irs_floating_dtypes():
    assert FLOAT_DTYPES == {d for d in DTYPES if torch_dtype(d).is_floating_point}


def test_kernels_are_bound_only_beside_their_ops():
    """One mechanism: a binding is declared in the op module that registers its op (kernels= of
    the OpDef), nowhere else in the packages."""
    root = Path(__file__).resolve().parents[2]
    texts = {p.relative_to(root).as_posix(): p.read_text() for folder in ("circuit", "ops", "runners")
             for p in (root / folder).rglob("*.py")}
    binders = {name for name, text in texts.items() if "KernelBinding(" in text}
    assert {"ops/basic.py", "ops/tokens.py", "ops/attention.py", "ops/sampling.py", "ops/moe.py"} <= binders
    assert {name for name in binders if not name.startswith("ops/") or "register(OpDef(" not in texts[name]} == set()
    assert not any("bind_kernel" in text or ".kernels.append" in text for text in texts.values())


# ---- every binding the interpreter can run equals the reference on the op's example ----
def _launch_outputs(op, outs, tensors, env):
    return [tensors[op.mutates[i]] if i in op.mutates else
            torch.empty(spec.concrete(env), dtype=torch_dtype(spec.dtype)) for i, spec in enumerate(outs)]


def test_interpretable_bindings_match_their_references():
    ran = set()
    for name in sorted(EXAMPLES):
        op = REGISTRY[name]
        specs, attrs = EXAMPLES[name]
        parsed = op.parse_attrs(attrs)
        for binding in op.kernels:
            if not binding.applies("interpret", specs, parsed):
                continue
            width = 3
            env = {ROW: width}
            g = torch.Generator().manual_seed(5)
            tensors = [make_input(op, i, s, width, g) for i, s in enumerate(specs)]
            clones = [t.clone() for t in tensors]
            want = op.reference(clones, parsed)
            outs = _launch_outputs(op, op.infer(specs, parsed), tensors, env)
            ws = [torch.empty(shape, dtype=torch_dtype(dt))
                  for dt, shape in (binding.workspace(specs, env, parsed) if binding.workspace else ())]
            binding.launch(tensors, outs, ws, parsed)
            for got, exp in zip(outs, want):
                torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-5, msg=lambda m: f"{binding.name}: {m}")
            ran.add(binding.name)
    assert {"triton_rmsnorm", "triton_add_rmsnorm", "triton_silu_mul", "triton_linear",
            "triton_linear_silu_mul", "triton_rope_kv_write", "triton_argmax_logprob",
            "triton_linear_argmax_logprob", "triton_moe_route", "triton_moe_grouped",
            "triton_rope_freqs", "triton_head_linear", "triton_mla_kv_write", "triton_mla_decode",
            "triton_linear_fp8", "triton_linear_qkv", "triton_linear_concat",
            "triton_linear_argmax_keep", "triton_input_guard", "triton_zero_centred_rmsnorm",
            "triton_zero_centred_head_rmsnorm", "triton_linear_kv", "triton_rmsnorm_linear_kv",
            "triton_rope_k_kv_write"} <= ran
