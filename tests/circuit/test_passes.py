"""Each pass, text in and text out on a small example; the pipeline verifies after every pass.
The fusion rows' eager-equality and regression tests are in test_fusions.py."""
import pytest

from draft_circuit.circuit import CircuitBuilder, CircuitError
from draft_circuit.circuit.passes import DEFAULT_PIPELINE, OPT_IN, PASSES, PassError, run_passes
from draft_circuit.circuit.passes.eliminate_dead_nodes import eliminate_dead_nodes

fuse_add_rmsnorm, fuse_lm_head_argmax = PASSES["fuse_add_rmsnorm"], PASSES["fuse_lm_head_argmax"]
fuse_rope_kv_write, fuse_linear_silu_mul = PASSES["fuse_rope_kv_write"], PASSES["fuse_linear_silu_mul"]


def body(c) -> str:
    """The printed circuit without its declarations."""
    return "\n".join(l for l in str(c).splitlines() if " = " in l or l.lstrip().startswith("return"))


def block():
    b = CircuitBuilder("block", max_width=4)
    x = b.input("x", "float32", ("n", 8))
    pos = b.input("pos", "int32", ("n",))
    tables, live = b.input("tables", "int32", ("n", 2)), b.input("live", "int32", ("n",))
    kc, vc = b.state("kc", "float32", (4, 4, 1, 4)), b.state("vc", "float32", (4, 4, 1, 4))
    w, wn = b.param("w", "float32", (8, 8)), b.param("wn", "float32", (8,))
    wq, wk = b.param("wq", "float32", (8, 8)), b.param("wk", "float32", (4, 8))
    wgu, head = b.param("wgu", "float32", (8, 8)), b.param("head", "float32", (40, 8))
    wv = b.param("wv", "float32", (4, 8))
    h = b.op1("add", [x, b.op1("linear", [x, w], name="proj")], name="res")
    m = b.op1("rmsnorm", [h, wn], name="norm")
    q = b.op1("rope", [b.op1("linear", [m, wq], name="q"), pos], {"head_dim": 4}, name="rq")
    k = b.op1("rope", [b.op1("linear", [m, wk], name="k"), pos], {"head_dim": 4}, name="rk")
    v = b.op1("linear", [m, wv], name="v")
    kc, vc = b.op("kv_write", [kc, vc, k, v, tables, live], name="kvw")
    o = b.op1("decode_attention", [q, kc, vc, tables, live], name="attn")
    g = b.op1("silu_mul", [b.op1("linear", [m, wgu], name="gu")], name="act")
    b.op1("add", [g, g], name="unused")
    tok, lp = b.op("argmax_logprob", [b.op1("linear", [o, head], name="logits")], name="top1")
    b.output(tok, "token")
    b.output(lp, "logprob")
    b.output(kc)
    b.output(vc)
    return b.build()


def test_eliminate_dead_nodes():
    out = eliminate_dead_nodes(block())
    assert "unused" not in body(out) and "act" not in body(out) and "gu" not in body(out)
    assert "kvw" in body(out)  # a state write feeding an output is live


def test_fuse_add_rmsnorm():
    out = fuse_add_rmsnorm(block())
    assert ("  res: f32[n,8], norm: f32[n,8] = add_rmsnorm(x, proj, wn)  "
            "# fused res + norm") in body(out)
    assert " = rmsnorm(" not in body(out)


def test_fuse_lm_head_argmax():
    out = fuse_lm_head_argmax(block())
    assert ("  token: i32[n], logprob: f32[n] = linear_argmax_logprob(attn, head)  "
            "# fused logits + top1") in body(out)
    assert "logits:" not in body(out)


def test_fuse_rope_kv_write():
    out = fuse_rope_kv_write(block())
    assert ("  rq: f32[n,8], kc@1: f32[4,4,1,4], vc@1: f32[4,4,1,4] = rope_kv_write(q, k, v, pos, "
            "kc, vc, tables, live) {head_dim=4}  "
            "# fused rq + rk + kvw") in body(out)
    assert " = rope(" not in body(out)


def test_rope_kv_write_not_fused_when_rotated_k_is_also_v():
    b = CircuitBuilder("kk", max_width=2)
    x, pos = b.input("x", "float32", ("n", 4)), b.input("pos", "int32", ("n",))
    t, live = b.input("t", "int32", ("n", 1)), b.input("live", "int32", ("n",))
    kc, vc = b.state("kc", "float32", (2, 4, 1, 4)), b.state("vc", "float32", (2, 4, 1, 4))
    q = b.op1("rope", [x, pos], {"head_dim": 4}, name="rq")
    k = b.op1("rope", [x, pos], {"head_dim": 4}, name="rk")
    kc, vc = b.op("kv_write", [kc, vc, k, k, t, live], name="kvw")
    b.output(b.op1("decode_attention", [q, kc, vc, t, live]), "o")
    c = b.build()
    assert run_passes(c, ["fuse_rope_kv_write"]) == c


def test_fuse_linear_silu_mul():
    before = body(block())
    out = fuse_linear_silu_mul(block())
    assert "  gu: f32[n,8] = linear(norm, wgu)" in before and " = silu_mul(gu)" in before
    # the [n, 2I] gate_up activations are gone: neither their linear nor silu_mul remains
    assert "gu:" not in body(out) and " = silu_mul(" not in body(out)
    assert "  act: f32[n,4] = linear_silu_mul(norm, wgu)  # fused gu + act" in body(out)


def test_pipeline_names_are_the_passes():
    assert set(DEFAULT_PIPELINE) <= set(PASSES)
    assert all(PASSES[name].__name__ == name for name in PASSES)


def test_whole_pipeline_text():
    out = run_passes(block())
    assert body(out) == "\n".join([
        "  res: f32[n,8] = linear_add(x, w, x)  # fused proj + res",
        "  q: f32[n,8], k: f32[n,4], v: f32[n,4] = rmsnorm_linear_qkv(res, wn, wq, wk, wv)  # fused norm + q + k + v",
        "  rq: f32[n,8], kc@1: f32[4,4,1,4], vc@1: f32[4,4,1,4] = rope_kv_write(q, k, v, pos, kc, vc, tables, "
        "live) {head_dim=4}  # fused rq + rk + kvw",
        "  attn: f32[n,8] = decode_attention(rq, kc@1, vc@1, tables, live)",
        "  token: i32[n], logprob: f32[n] = linear_argmax_logprob(attn, head)  # fused logits + top1",
        "  return token, logprob, kc@1, vc@1",
    ])
    # the opt-in row (circuit.passes.OPT_IN) folds the rope and the paged write into q/k/v
    opted = run_passes(block(), (*DEFAULT_PIPELINE, *OPT_IN))
    assert body(opted).splitlines()[1] == (
        "  rq: f32[n,8], kc@1: f32[4,4,1,4], vc@1: f32[4,4,1,4] = rmsnorm_linear_qkv_rope_kv_write(res, wn, "
        "wq, wk, wv, pos, kc, vc, tables, live) {head_dim=4}  # fused norm + q + k + v + rq + rk + kvw")


def test_pipeline_names_the_failing_pass(monkeypatch):
    import draft_circuit.circuit.passes as passes

    def break_it(c):
        return c.replace(outputs=("nothing",))
    monkeypatch.setitem(passes.PASSES, "break_it", break_it)
    with pytest.raises(PassError, match=r"pass 'break_it', #2 of the pipeline \(after "
                                        r"eliminate_dead_nodes\)"):
        run_passes(block(), ["eliminate_dead_nodes", "break_it"])
    with pytest.raises(CircuitError, match="unknown pass"):
        run_passes(block(), ["no_such_pass"])


def unread_kv_write():
    """A kv_write whose new caches nobody reads and the circuit does not return."""
    b = CircuitBuilder("unread_kv", max_width=4)
    x, w = b.input("x", "float32", ("n", 4)), b.param("w", "float32", (4, 4))
    tables, live = b.input("tables", "int32", ("n", 2)), b.input("live", "int32", ("n",))
    kc, vc = b.state("kc", "float32", (9, 4, 1, 4)), b.state("vc", "float32", (9, 4, 1, 4))
    k = b.op1("linear", [x, w], name="k")
    b.op("kv_write", [kc, vc, k, x, tables, live], name="kvw")
    b.op1("add", [x, x], name="dead")
    b.output(b.op1("add", [x, k], name="y"), "y")
    return b.build()


def test_dead_node_elimination_keeps_every_state_write():
    c = unread_kv_write()
    assert not c.users("kc@1") and "kc@1" not in c.outputs  # nothing downstream, not returned
    out = eliminate_dead_nodes(c)
    assert [n.name for n in out.nodes] == ["k", "kvw", "y"]  # the write and what it reads stay
    assert run_passes(c) == out  # no fusion applies; the write survives the whole pipeline


def test_a_compiled_program_performs_an_unread_state_write():
    """Planned with the default pipeline, the program writes the caches the eager oracle does."""
    import torch

    from draft_circuit.circuit.planner import compile_draft
    from draft_circuit.runners.eager import EagerRunner
    from draft_circuit.runners.program import ProgramRunner

    c = unread_kv_write()
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(4, 4, generator=g)}
    inputs = {"x": torch.randn(3, 4, generator=g), "live": torch.tensor([0, 3, 6], dtype=torch.int32),
              "tables": torch.tensor([[1, 2], [3, 4], [5, 6]], dtype=torch.int32)}
    want = {"kc": torch.zeros(9, 4, 1, 4), "vc": torch.zeros(9, 4, 1, 4)}
    got = {k: v.clone() for k, v in want.items()}
    EagerRunner(c, params, want).run(inputs)
    ProgramRunner(compile_draft(c, params, [3]), got).run(inputs)
    assert want["kc"].abs().sum() > 0  # the eager oracle wrote the rows
    for k in want:
        assert torch.equal(got[k], want[k]), k
