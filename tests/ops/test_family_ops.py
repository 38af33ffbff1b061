"""The ops the checkpoint families need, against transformers' own modules (fp32, bitwise where
the arithmetic is the same): `linear` with a bias (nn.Linear), `head_rmsnorm` (Qwen3RMSNorm over
each head), `rope` / `rope_kv_write` with a partial `rotary_dim` (GLM-4.5's apply_rotary_pos_emb).
Shape rules name what is wrong; costs count the bias; the planner picks the kernels that apply; a
biased linear never fuses into an op that has no bias input; a whole-head rotary_dim is the
default's bits.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from draft_circuit.circuit import CircuitBuilder
from draft_circuit.circuit.ir import ROW, CircuitError, TensorSpec
from draft_circuit.circuit.passes import run_passes
from draft_circuit.circuit.planner import CompileOptions, compile_draft
from draft_circuit.ops.attention import rope_ref
from draft_circuit.ops.registry import MATMUL, NORM, REDUCTION, CostContext, ShapeError, get_op
from draft_circuit.runners.testing import assert_program_matches_eager, run_side_by_side

transformers = pytest.importorskip("transformers")


def S(dtype, *shape):
    return TensorSpec(dtype=dtype, shape=shape)


def run(name: str, tensors: list[torch.Tensor], attrs: dict) -> torch.Tensor:
    op = get_op(name)
    return op.reference(tensors, op.parse_attrs(attrs))[0]


# ---- linear with a bias ----
def test_linear_bias_is_nn_linear():
    g = torch.Generator().manual_seed(0)
    x, w, bias = torch.randn(5, 12, generator=g), torch.randn(7, 12, generator=g), torch.randn(7, generator=g)
    torch.testing.assert_close(run("linear", [x, w, bias], {}), F.linear(x, w, bias), atol=1e-6, rtol=1e-6)
    # the bias after the fp32 product when the output widens (bf16 weights, fp32 logits)
    xb, wb, bb = x.bfloat16(), w.bfloat16(), bias.bfloat16()
    got = run("linear", [xb, wb, bb], {"out_dtype": "float32"})
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, xb.float() @ wb.float().T + bb.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bias, match", [
    (S("float32", 6), r"linear bias must be \[5\]"),
    (S("float32", ROW, 5), r"linear bias must be \[5\]"),
    (S("float16", 5), "dtypes differ"),
])
def test_linear_bias_shape_rule(bias, match):
    op = get_op("linear")
    with pytest.raises(ShapeError, match=match):
        op.infer([S("float32", ROW, 6), S("float32", 5, 6), bias], op.parse_attrs({}))


def test_linear_cost_reads_the_bias():
    op = get_op("linear")
    ins, outs = [S("float32", ROW, 6), S("float32", 5, 6)], [S("float32", ROW, 5)]
    plain = op.cost_at(ins, outs, op.parse_attrs({}), CostContext(width=3), {ROW: 3})
    biased = op.cost_at([*ins, S("float32", 5)], outs, op.parse_attrs({}), CostContext(width=3), {ROW: 3})
    assert biased.bytes_read == plain.bytes_read + 5 * 4 and biased.flops == plain.flops
    assert op.has(MATMUL)


def test_split_k_never_takes_a_bias():
    """split-K's reduction has no epilogue: a biased linear whose K would split takes the plain kernel."""
    op = get_op("linear")
    splitk = next(k for k in op.kernels if k.name == "triton_linear_splitk")
    big = [S("bfloat16", ROW, 8192), S("bfloat16", 64, 8192)]
    attrs = op.parse_attrs({})
    assert splitk.applies("cuda", big, attrs)
    assert splitk.applies.why_not("cuda", [*big, S("bfloat16", 64)], attrs) == \
        "needs no bias (its reduction has no epilogue)"


# ---- head_rmsnorm ----
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_head_rmsnorm_is_qwen3_rmsnorm_over_each_head(dtype):
    heads, d, eps = 3, 16, 1e-6
    g = torch.Generator().manual_seed(1)
    x = (4 * torch.randn(5, heads * d, generator=g)).to(dtype)
    norm = transformers.models.qwen3.modeling_qwen3.Qwen3RMSNorm(d, eps=eps)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(d, generator=g))
    norm = norm.to(dtype)
    with torch.no_grad():
        want = norm(x.view(5, heads, d)).reshape(5, -1)
    assert torch.equal(run("head_rmsnorm", [x, norm.weight.detach()], {"eps": eps}), want)


@pytest.mark.parametrize("ins, match", [
    ([S("float32", ROW, 20), S("float32", 8)], r"weight f32\[8\] \(one head\) must divide the row"),
    ([S("float32", ROW, 16), S("float32", 4, 4)], "rank 1"),
    ([S("float32", ROW, 2, 8), S("float32", 8)], "rank 2"),
    ([S("float32", ROW, 16), S("float16", 8)], "dtypes differ"),
])
def test_head_rmsnorm_shape_rule(ins, match):
    op = get_op("head_rmsnorm")
    with pytest.raises(ShapeError, match=match):
        op.infer(ins, op.parse_attrs({"eps": 1e-6}))


def test_head_rmsnorm_tags_and_eps():
    op = get_op("head_rmsnorm")
    assert op.has(NORM) and op.has(REDUCTION) and not op.writes_state
    with pytest.raises(CircuitError, match="eps must be finite and > 0"):
        op.parse_attrs({"eps": 0.0})


# ---- partial rotary ----
def glm_rope(q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor, head_dim: int, factor: float, theta: float):
    """transformers' GLM-4.5 rotary: Glm4MoeRotaryEmbedding's cos/sin and apply_rotary_pos_emb."""
    from transformers.models.glm4_moe import modeling_glm4_moe as glm
    config = transformers.Glm4MoeConfig(hidden_size=64, num_attention_heads=4, head_dim=head_dim,
                                        rope_parameters={"rope_type": "default", "rope_theta": theta,
                                                         "partial_rotary_factor": factor})
    cos, sin = glm.Glm4MoeRotaryEmbedding(config)(q, pos[None].long())
    n = q.shape[0]
    q4 = q.view(1, n, -1, head_dim).transpose(1, 2)
    k4 = k.view(1, n, -1, head_dim).transpose(1, 2)
    qe, ke = glm.apply_rotary_pos_emb(q4, k4, cos, sin)
    return qe.transpose(1, 2).reshape(n, -1), ke.transpose(1, 2).reshape(n, -1)


@pytest.mark.parametrize("head_dim, factor", [(16, 0.5), (24, 0.5), (16, 0.25), (16, 1.0)])
def test_partial_rope_is_glm_rotary_bitwise(head_dim, factor):
    g = torch.Generator().manual_seed(head_dim)
    q, k = torch.randn(6, 4 * head_dim, generator=g), torch.randn(6, 2 * head_dim, generator=g)
    pos = torch.tensor([0, 1, 7, 100, 2047, 31000], dtype=torch.int32)
    rotary_dim = int(head_dim * factor)
    want_q, want_k = glm_rope(q, k, pos, head_dim, factor, 10000.0)
    attrs = {"head_dim": head_dim, "theta": 10000.0, "rotary_dim": rotary_dim}
    assert torch.equal(run("rope", [q, pos], attrs), want_q)
    assert torch.equal(run("rope", [k, pos], attrs), want_k)


def test_whole_head_rotary_dim_is_the_default_bitwise():
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        x, pos = torch.randn(4, 48, generator=g).to(dtype), torch.tensor([3, 9, 500, 1], dtype=torch.int32)
        assert torch.equal(rope_ref(x, pos, 16, 1e4, 2, rotary_dim=16), rope_ref(x, pos, 16, 1e4, 2))


@pytest.mark.parametrize("op_name", ["rope", "rope_kv_write"])
@pytest.mark.parametrize("rotary_dim", [0, 5, 18])
def test_rotary_dim_is_refused_at_verify(op_name, rotary_dim):
    with pytest.raises(CircuitError, match=rf"rotary_dim must be even and in \(0, head_dim = 16\], got {rotary_dim}"):
        get_op(op_name).parse_attrs({"head_dim": 16, "rotary_dim": rotary_dim})


# ---- a block using all three, planned ----
HEADS, KV_HEADS, D, R, HIDDEN, NB, BS = 2, 1, 8, 4, 16, 9, 4


def attention_block():
    b = CircuitBuilder("family_block", max_width=8)
    x = b.input("x", "float32", (ROW, HIDDEN))
    pos = b.input("pos", "int32", (ROW,))
    tables = b.input("tables", "int32", (ROW, 2))
    live = b.input("live", "int32", (ROW,))
    kc, vc = (b.state(s, "float32", (NB, BS, KV_HEADS, D)) for s in ("kc", "vc"))
    p = {n: b.param(n, "float32", s) for n, s in (
        ("wq", (HEADS * D, HIDDEN)), ("bq", (HEADS * D,)), ("wk", (KV_HEADS * D, HIDDEN)), ("bk", (KV_HEADS * D,)),
        ("wv", (KV_HEADS * D, HIDDEN)), ("bv", (KV_HEADS * D,)), ("qn", (D,)), ("kn", (D,)),
        ("wgu", (2 * HIDDEN, HIDDEN)), ("bgu", (2 * HIDDEN,)))}
    rope = {"head_dim": D, "rotary_dim": R, "pos_offset": 1}
    q = b.op1("head_rmsnorm", [b.op1("linear", [x, p["wq"], p["bq"]], name="q"), p["qn"]], {"eps": 1e-6}, name="q_norm")
    k = b.op1("head_rmsnorm", [b.op1("linear", [x, p["wk"], p["bk"]], name="k"), p["kn"]], {"eps": 1e-6}, name="k_norm")
    v = b.op1("linear", [x, p["wv"], p["bv"]], name="v")
    q, k = b.op1("rope", [q, pos], rope, name="rq"), b.op1("rope", [k, pos], rope, name="rk")
    kc, vc = b.op("kv_write", [kc, vc, k, v, tables, live], {"row_offset": 1})
    o = b.op1("decode_attention", [q, kc, vc, tables, live], {"row_offset": 1})
    g = b.op1("silu_mul", [b.op1("linear", [x, p["wgu"], p["bgu"]], name="gu")])  # biased: stays unfused
    b.output(o, "o")
    b.output(g, "g")
    b.output(kc)
    b.output(vc)
    return b.build()


def block_values(c, width: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    params = {v.name: torch.randn(v.shape, generator=g) for v in c.inputs_of_kind("param")}
    inputs = {"x": torch.randn(width, HIDDEN, generator=g),
              "pos": torch.randint(0, 50, (width,), generator=g, dtype=torch.int32),
              "tables": torch.arange(width * 2, dtype=torch.int32).view(width, 2) % (NB - 1) + 1,
              "live": torch.randint(0, 2 * BS - 1, (width,), generator=g, dtype=torch.int32)}
    states = {s: torch.randn(NB, BS, KV_HEADS, D, generator=g) for s in ("kc", "vc")}
    return params, inputs, states


def test_biased_linear_fuses_into_nothing_that_drops_its_bias():
    c = attention_block()
    fused = run_passes(c)
    ops = [n.op for n in fused.nodes]
    assert "linear_silu_mul" not in ops and ops.count("linear") == 4
    (node,) = [n for n in fused.nodes if n.op == "rope_kv_write"]  # partial rope still fuses
    assert node.attrs["rotary_dim"] == R
    b = CircuitBuilder("head", max_width=2)
    x, w, bias = b.input("x", "float32", (ROW, 4)), b.param("w", "float32", (40, 4)), b.param("b", "float32", (40,))
    b.output(b.op("argmax_logprob", [b.op1("linear", [x, w, bias])])[0], "t")
    assert all(n.op != "linear_argmax_logprob" for n in run_passes(b.build()).nodes)


@pytest.mark.parametrize("width", [1, 3, 8])
def test_family_block_program_equals_eager_bitwise(width):
    c = attention_block()
    params, inputs, states = block_values(c, width, seed=width)
    assert_program_matches_eager(c, params, [width], lambda _: (inputs, states))


def test_family_block_with_interpreted_kernels():
    c = attention_block()
    params, inputs, states = block_values(c, 3, seed=11)
    compiled = compile_draft(c, params, [3], options=CompileOptions(interpret_kernels=True))
    kernels = {(x.op, x.kernel) for x in compiled.programs[3].launches}
    assert {("linear", "triton_linear"), ("head_rmsnorm", "triton_head_rmsnorm"),
            ("rope_kv_write", "triton_rope_kv_write")} <= kernels
    r = run_side_by_side(c, params, compiled, inputs, states)
    for k in r.want:
        torch.testing.assert_close(r.got[k], r.want[k], atol=1e-4, rtol=1e-4)
    for k in r.want_states:
        torch.testing.assert_close(r.got_states[k], r.want_states[k], atol=1e-4, rtol=1e-4)
