"""The prologue / epilogue rows of the fusion table (issue 15 item 1) on a block built to hold each
of their patterns once: every row, after the rows it builds on, equals the unfused circuit's eager
run bitwise (CPU fp32, widths 1, 3 and 8: the fused eager run and the compiled program); the
default pipeline over the block too; its Triton kernels under the interpreter agree with the
eager oracle in fp32 and fp16; a norm with a second reader stays its own launch."""
import pytest
import torch

from draft_circuit.circuit import CircuitBuilder
from draft_circuit.circuit.passes import OPT_IN, run_passes
from draft_circuit.circuit.planner import CompileOptions, compile_draft
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.program import ProgramRunner

MAX_WIDTH, HIDDEN, VOCAB = 8, 24, 40
EPS = {"eps": 1e-5}
BS, BLOCKS_PER_ROW, D = 4, 2, 4  # the attention's paged caches: one kv head of 4, two q heads
NUM_BLOCKS = 1 + MAX_WIDTH * BLOCKS_PER_ROW


def block(dtype="float32", last=True):
    """embedding -> enorm, hnorm -> eh_proj; input norm -> q/k/v; o_proj + residual; an add whose
    second operand is no linear -> its norm; a norm into SwiGLU; two final norms into lm-heads
    (one with keep_if_active, last_kept unless `last` is False, and the confidence gate)."""
    b = CircuitBuilder("prologues", max_width=MAX_WIDTH)
    x = b.input("x", dtype, ("n", HIDDEN))
    ids = b.input("ids", "int32", ("n",))
    active = b.input("active", "int32", ("n",))
    mask = b.input("mask", "int32", ("n", 2))
    prev = b.input("prev", "int32", ("n",))  # the last kept draft before this step
    log_tau = b.input("log_tau", "float32", ("n",))
    pos = b.input("pos", "int32", ("n",))
    tables = b.input("tables", "int32", ("n", BLOCKS_PER_ROW))
    live = b.input("live", "int32", ("n",))
    kc = b.state("kc", dtype, (NUM_BLOCKS, BS, 1, D))
    vc = b.state("vc", dtype, (NUM_BLOCKS, BS, 1, D))
    p = {name: b.param(name, dtype, shape) for name, shape in (
        ("table", (VOCAB, HIDDEN)), ("we", (HIDDEN,)), ("wh", (HIDDEN,)), ("wc", (HIDDEN, 2 * HIDDEN)),
        ("wa", (HIDDEN,)), ("wq", (HIDDEN, HIDDEN)), ("wk", (HIDDEN, HIDDEN)), ("wv", (HIDDEN, HIDDEN)),
        ("wo", (HIDDEN, HIDDEN)), ("wm", (HIDDEN,)), ("wt", (HIDDEN,)), ("wgu", (2 * HIDDEN, HIDDEN)),
        ("wu", (HIDDEN,)), ("wz", (HIDDEN,)), ("head", (VOCAB, HIDDEN)), ("wa2", (HIDDEN,)),
        ("wq2", (2 * D, HIDDEN)), ("wk2", (D, HIDDEN)), ("wv2", (D, HIDDEN)))}
    e = b.op1("rmsnorm", [b.op1("embedding", [p["table"], ids], name="emb"), p["we"]], EPS, name="enorm")
    h = b.op1("rmsnorm", [x, p["wh"]], EPS, name="hnorm")
    y = b.op1("linear", [b.op1("concat", [e, h], name="cat"), p["wc"]], name="eh")
    a = b.op1("rmsnorm", [y, p["wa"]], EPS, name="anorm")
    q, k, v = (b.op1("linear", [a, p[w]], name=w[1]) for w in ("wq", "wk", "wv"))
    r = b.op1("add", [y, b.op1("linear", [q, p["wo"]], name="o")], name="res")
    s = b.op1("add", [v, r], name="mix")  # v at edge 0: no linear_add, an add_rmsnorm
    m = b.op1("rmsnorm", [s, p["wm"]], EPS, name="mnorm")
    t = b.op1("rmsnorm", [k, p["wt"]], EPS, name="tnorm")
    g = b.op1("silu_mul", [b.op1("linear", [t, p["wgu"]], name="gu")], name="act")
    u = b.op1("rmsnorm", [r, p["wu"]], EPS, name="unorm")
    logits = b.op1("linear", [u, p["head"]], {"out_dtype": "float32"}, name="lm")
    tok, lp = b.op("argmax_logprob", [logits, mask], name="top1")
    z = b.op1("rmsnorm", [s, p["wz"]], EPS, name="znorm")
    tok2, lp2 = b.op("argmax_logprob", [b.op1("linear", [z, p["head"]], {"out_dtype": "float32"},
                                              name="lm2")], name="top2")
    b.output(b.op1("keep_if_active", [tok, active], name="keep"), "kept")
    # last_kept reads the token before the gate: folding the gate alone would move the draft
    # after a reader of its token, so fuse_argmax_gate's own test runs on a block without it
    b.output(b.op1("keep_if_active", [tok, active, prev] if last else [prev, active, prev],
                   name="last_kept"), "last")
    b.output(b.op1("confidence_gate", [active, lp, log_tau], name="gate"), "active_next")
    # an attention input: its own norm, q/k/v, rope of q and k, the paged write, the attention
    a2 = b.op1("rmsnorm", [y, p["wa2"]], EPS, name="anorm2")
    q2, k2, v2 = (b.op1("linear", [a2, p[w]], name=f"{w[1]}2") for w in ("wq2", "wk2", "wv2"))
    rope = {"head_dim": D, "pos_offset": 1}
    rq = b.op1("rope", [q2, pos], rope, name="rq")
    kc, vc = b.op("kv_write", [kc, vc, b.op1("rope", [k2, pos], rope, name="rk"), v2, tables, live,
                               active], {"row_offset": 1}, name="kvw")
    b.output(b.op1("decode_attention", [rq, kc, vc, tables, live], {"row_offset": 1}, name="attn"),
             "attn")
    b.output(kc)
    b.output(vc)
    b.output(tok, "token")
    b.output(lp, "logprob")
    b.output(tok2, "token2")
    b.output(lp2, "logprob2")
    b.output(m, "mixed")
    b.output(g, "act")
    return b.build()


def values(c, width, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    params = {}
    for v in c.inputs_of_kind("param"):
        t = torch.randn(v.shape, generator=g)
        params[v.name] = (1 + 0.1 * t if len(v.shape) == 1 else t / v.shape[-1] ** 0.5).to(dtype)
    ids = torch.randint(0, VOCAB, (width,), generator=g, dtype=torch.int32)
    ids[width // 2] = -1  # an all-masked draft embeds as zeros
    inputs = {
        "x": torch.randn(width, HIDDEN, generator=g).to(dtype), "ids": ids,
        "active": torch.tensor([i % 3 != 2 for i in range(width)], dtype=torch.int32),
        "mask": torch.randint(-2**31, 2**31 - 1, (width, 2), generator=g, dtype=torch.int64).to(torch.int32),
        "prev": torch.randint(-1, VOCAB, (width,), generator=g, dtype=torch.int32),
        # a threshold that stops some rows, one that stops none (NaN never stops)
        "log_tau": torch.where(torch.arange(width) % 2 == 0, torch.tensor(-3.0), torch.tensor(float("nan"))),
        "pos": torch.randint(0, 50, (width,), generator=g, dtype=torch.int32),
        "tables": (1 + torch.arange(width * BLOCKS_PER_ROW, dtype=torch.int32)).view(width, -1),
        "live": torch.randint(0, BS * BLOCKS_PER_ROW - 1, (width,), generator=g, dtype=torch.int32),
    }
    states = {s: torch.randn(NUM_BLOCKS, BS, 1, D, generator=g).to(dtype) for s in ("kc", "vc")}
    return params, inputs, states


# each row after the rows whose fused op it consumes
PIPELINES = {
    "fuse_linear_add": ("fuse_linear_add",),
    "fuse_rmsnorm_qkv": ("fuse_qkv", "fuse_rmsnorm_qkv"),
    "fuse_rmsnorm_silu_mul": ("fuse_linear_silu_mul", "fuse_rmsnorm_silu_mul"),
    "fuse_rmsnorm_argmax_keep": ("fuse_lm_head_argmax", "fuse_argmax_keep", "fuse_rmsnorm_argmax_keep"),
    "fuse_rmsnorm_argmax": ("fuse_lm_head_argmax", "fuse_argmax_keep", "fuse_rmsnorm_argmax"),
    "fuse_embed_concat_linear": ("fuse_concat_linear", "fuse_embed_concat_linear"),
    "fuse_qkv_rope_kv_write": ("fuse_rope_kv_write", "fuse_qkv", "fuse_rmsnorm_qkv",
                               "fuse_qkv_rope_kv_write"),
    "fuse_argmax_last": ("fuse_lm_head_argmax", "fuse_argmax_keep", "fuse_rmsnorm_argmax_keep",
                         "fuse_argmax_last"),
    "fuse_argmax_gate": ("fuse_lm_head_argmax", "fuse_argmax_keep", "fuse_rmsnorm_argmax_keep",
                         "fuse_argmax_gate"),
    "fuse_argmax_last_gate": ("fuse_lm_head_argmax", "fuse_argmax_keep", "fuse_rmsnorm_argmax_keep",
                              "fuse_argmax_last", "fuse_argmax_last_gate"),
}
FUSED_OP = {"fuse_linear_add": "linear_add", "fuse_rmsnorm_qkv": "rmsnorm_linear_qkv",
            "fuse_rmsnorm_silu_mul": "rmsnorm_linear_silu_mul",
            "fuse_rmsnorm_argmax_keep": "rmsnorm_linear_argmax_keep",
            "fuse_rmsnorm_argmax": "rmsnorm_linear_argmax_logprob",
            "fuse_embed_concat_linear": "embed_rmsnorm_linear_concat",
            "fuse_qkv_rope_kv_write": "rmsnorm_linear_qkv_rope_kv_write",
            "fuse_argmax_last": "rmsnorm_linear_argmax_keep_last",
            "fuse_argmax_gate": "rmsnorm_linear_argmax_keep_gate",
            "fuse_argmax_last_gate": "rmsnorm_linear_argmax_keep_last_gate"}
# fused ops a later row folds further, so the default pipeline leaves none of them
CONSUMED = {"rmsnorm_linear_argmax_keep", "rmsnorm_linear_argmax_keep_last",
            "rmsnorm_linear_argmax_keep_gate"}
# the fused ops the default pipeline plans (opt-in rows, circuit.passes.OPT_IN, are tested alone)
DEFAULT_FUSED = {op for row, op in FUSED_OP.items() if row not in OPT_IN} - CONSUMED
MATCHES = {"fuse_rmsnorm_qkv": 2}  # both q/k/v triples; one match for every other row


def _eager(c, params, inputs, states):
    states = {k: t.clone() for k, t in states.items()}
    return EagerRunner(c, params, states).run(inputs), states


def _program(compiled, inputs, states):
    states = {k: t.clone() for k, t in states.items()}
    return ProgramRunner(compiled, states).run(inputs), states


def _pair(got, want):
    """((outputs, states), (outputs, states)) -> one dict each, states prefixed."""
    return ({**got[0], **{f"state {k}": v for k, v in got[1].items()}},
            {**want[0], **{f"state {k}": v for k, v in want[1].items()}})


def _equal(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("width", [1, 3, 8])
@pytest.mark.parametrize("row", sorted(PIPELINES))
def test_row_equals_the_unfused_eager_circuit(row, width):
    c = block(last=row != "fuse_argmax_gate")
    params, inputs, states = values(c, width, seed=width)
    fused = run_passes(c, PIPELINES[row])
    assert sum(n.op == FUSED_OP[row] for n in fused.nodes) == MATCHES.get(row, 1)  # the row matched
    want, want_states = _eager(c, params, inputs, states)
    _equal(*_pair(_eager(fused, params, inputs, states), (want, want_states)))
    compiled = compile_draft(c, params, [width], options=CompileOptions(pipeline=PIPELINES[row]))
    _equal(*_pair(_program(compiled, inputs, states), (want, want_states)))


@pytest.mark.parametrize("width", [1, 3, 8])
def test_default_pipeline_folds_every_prologue(width):
    c = block()
    params, inputs, states = values(c, width, seed=20 + width)
    compiled = compile_draft(c, params, [width])
    ops = {n.op for n in compiled.circuit.nodes}
    assert DEFAULT_FUSED | {"add_rmsnorm"} <= ops
    # every norm and linear folded, and the draft's bookkeeping into the lm-head's merge
    assert not {"embedding", "concat", "rmsnorm", "linear", "keep_if_active", "confidence_gate"} & ops
    _equal(*_pair(_program(compiled, inputs, states), _eager(c, params, inputs, states)))


TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("width", [1, 3])
def test_interpreted_kernels_agree_with_the_eager_oracle(dtype, width):
    """The Triton kernels of every prologue row (chosen under the interpreter) against the
    unfused eager circuit: tokens equal, values within the dtype's rounding."""
    name = str(dtype).removeprefix("torch.")
    c = block(name)
    params, inputs, states = values(c, width, seed=40 + width, dtype=dtype)
    compiled = compile_draft(c, params, [width], options=CompileOptions(interpret_kernels=True))
    kernels = {x.kernel for x in compiled.programs[width].launches}
    assert {f"triton_{op}" for op in DEFAULT_FUSED} <= kernels
    (got, got_states), (want, want_states) = _program(compiled, inputs, states), _eager(c, params, inputs, states)
    for k in want_states:
        torch.testing.assert_close(got_states[k], want_states[k], **TOL[dtype])
    for k in ("kept", "token", "token2", "last", "active_next"):
        assert torch.equal(got[k], want[k]), k
    for k in ("logprob", "logprob2", "mixed", "act", "attn"):
        torch.testing.assert_close(got[k], want[k], **TOL[dtype])


def test_a_norm_with_another_reader_stays_unfused():
    """anorm read by q/k/v and by an output too: the normed row must be stored, so no prologue."""
    b = CircuitBuilder("shared", max_width=2)
    x = b.input("x", "float32", ("n", 8))
    w = b.param("w", "float32", (8,))
    ws = [b.param(f"w{i}", "float32", (8, 8)) for i in range(3)]
    a = b.op1("rmsnorm", [x, w], name="norm")
    for i, wi in enumerate(ws):
        b.output(b.op1("linear", [a, wi], name=f"l{i}"), f"o{i}")
    b.output(a, "normed")
    fused = run_passes(b.build(), ("fuse_qkv", "fuse_rmsnorm_qkv"))
    assert [n.op for n in fused.nodes] == ["rmsnorm", "linear_qkv"]


def test_the_norm_as_a_launch_of_its_own_keeps_every_bit(monkeypatch, interpreted_launches):
    """kernels.prologue_norm's path (forced at width 3 by lowering the rule's thresholds) against
    the one-launch prologues: the interpreted program's outputs and states bitwise; the norm's
    kernel runs once for each of q/k/v (twice), SwiGLU and the MTP input, each with its buffer,
    and the plan counts those launches."""
    from draft_circuit.circuit.report import gpu_launches
    from draft_circuit.kernels import prologue_norm

    c = block("float16")
    params, inputs, states = values(c, 3, seed=60, dtype=torch.float16)
    monkeypatch.setattr(prologue_norm, "PRENORM_FROM_K", 1)
    monkeypatch.setattr(prologue_norm, "ALIGN", 1)  # HIDDEN 24: the interpreter's sums ignore it

    def run(threshold):
        monkeypatch.setattr(prologue_norm, "PRENORM_FROM_N", threshold)
        monkeypatch.setattr(prologue_norm, "QKV_PRENORM_FROM_N", threshold)
        compiled = compile_draft(c, params, [3], options=CompileOptions(interpret_kernels=True))
        launches = compiled.programs[3].launches
        interpreted_launches.clear()
        got = _program(compiled, inputs, states)
        return (sum(gpu_launches(x) or 0 for x in launches), sum(len(x.workspace) for x in launches),
                interpreted_launches.count("prologue_norm_kernel"), got)
    (one, ws_one, norms_one, narrow), (two, ws_two, norms_two, wide) = run(64), run(2)
    _equal(*_pair(wide, narrow))
    assert (norms_one, norms_two) == (0, 4)  # two q/k/v, gate_up, eh_proj
    assert two - one == 4 and ws_two - ws_one == 4
