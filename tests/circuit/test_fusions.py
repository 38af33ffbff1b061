"""The fusion table: every row against the eager oracle (the fused circuit's eager run and its
compiled program equal the unfused circuit's eager run, bitwise on CPU fp32, at widths 1, 3 and
8), the driver's cycle guard, and the two-layer circuit fuse_rope_kv_write used to break
(issue 19 item 8)."""
import pytest
import torch

from draft_circuit.circuit import CircuitBuilder
from draft_circuit.circuit.passes import DEFAULT_PIPELINE, OPT_IN, PASSES, run_passes
from draft_circuit.circuit.passes.fuse import Fusion, Siblings, Taken, fuse
from draft_circuit.circuit.passes.fusions import FUSIONS
from draft_circuit.circuit.planner import CompileOptions, compile_draft
from draft_circuit.ops.registry import FUSED, get_op
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.program import ProgramRunner

MAX_WIDTH, BS, BLOCKS_PER_ROW, HIDDEN, VOCAB = 8, 4, 2, 8, 40
NUM_BLOCKS = 1 + MAX_WIDTH * BLOCKS_PER_ROW  # block 0 unused: each row owns its own blocks


def block():
    """One decoder block with every fusion's pattern in it, over distinct blocks per row."""
    b = CircuitBuilder("block", max_width=MAX_WIDTH)
    x = b.input("x", "float32", ("n", HIDDEN))
    pos = b.input("pos", "int32", ("n",))
    tables = b.input("tables", "int32", ("n", BLOCKS_PER_ROW))
    live, active = b.input("live", "int32", ("n",)), b.input("active", "int32", ("n",))
    mask = b.input("mask", "int32", ("n", 2))
    cache = (NUM_BLOCKS, BS, 1, 4)
    kc, vc = b.state("kc", "float32", cache), b.state("vc", "float32", cache)
    p = {name: b.param(name, "float32", shape) for name, shape in (
        ("w", (HIDDEN, HIDDEN)), ("wn", (HIDDEN,)), ("wq", (8, HIDDEN)), ("wk", (4, HIDDEN)),
        ("wv", (4, HIDDEN)), ("wgu", (2 * HIDDEN, HIDDEN)), ("wd", (HIDDEN, HIDDEN)),
        ("head", (VOCAB, 8)), ("wc", (4, 2 * HIDDEN)))}
    h = b.op1("add", [x, b.op1("linear", [x, p["w"]], name="proj")], name="res")
    m = b.op1("rmsnorm", [h, p["wn"]], name="norm")
    rope = {"head_dim": 4, "pos_offset": 1}
    q = b.op1("rope", [b.op1("linear", [m, p["wq"]], name="q"), pos], rope, name="rq")
    k = b.op1("rope", [b.op1("linear", [m, p["wk"]], name="k"), pos], rope, name="rk")
    v = b.op1("linear", [m, p["wv"]], name="v")
    kc, vc = b.op("kv_write", [kc, vc, k, v, tables, live, active], {"row_offset": 1}, name="kvw")
    o = b.op1("decode_attention", [q, kc, vc, tables, live], {"row_offset": 1}, name="attn")
    g = b.op1("silu_mul", [b.op1("linear", [m, p["wgu"]], name="gu")], name="act")
    y = b.op1("add", [b.op1("linear", [g, p["wd"]], name="down"), o], name="mix")
    tok, lp = b.op("argmax_logprob", [b.op1("linear", [y, p["head"]], name="logits"), mask],
                   name="top1")
    b.output(tok, "token")
    b.output(lp, "logprob")
    b.output(b.op1("keep_if_active", [tok, active], name="keep"), "kept")
    b.output(h, "residual")
    b.output(b.op1("linear", [b.op1("concat", [x, m], name="cat"), p["wc"]], name="eh"), "eh")
    b.output(kc)
    b.output(vc)
    return b.build()


def values(c, width, seed):
    g = torch.Generator().manual_seed(seed)
    params = {v.name: torch.randn(v.shape, generator=g) for v in c.inputs_of_kind("param")}
    max_rows = BS * BLOCKS_PER_ROW
    inputs = {
        "x": torch.randn(width, HIDDEN, generator=g),
        "pos": torch.randint(0, 50, (width,), generator=g, dtype=torch.int32),
        "tables": (1 + torch.arange(width * BLOCKS_PER_ROW, dtype=torch.int32)).view(width, -1),
        "live": torch.randint(0, max_rows - 1, (width,), generator=g, dtype=torch.int32),
        "active": torch.tensor([i % 3 != 2 for i in range(width)], dtype=torch.int32),
        "mask": torch.randint(-2**31, 2**31 - 1, (width, 2), generator=g, dtype=torch.int64).to(torch.int32),
    }
    states = {s: torch.randn(NUM_BLOCKS, BS, 1, 4, generator=g) for s in ("kc", "vc")}
    return params, inputs, states


def run_eager(c, params, inputs, states):
    states = {k: t.clone() for k, t in states.items()}
    return EagerRunner(c, params, states).run(inputs), states


def assert_same(got, want):
    assert got.keys() == want.keys()
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs"


# rows whose producer is another row's fused op run after it
PREREQUISITES = {"fuse_argmax_keep": ("fuse_lm_head_argmax",)}
CONSUMED = {"linear_argmax_logprob"}  # fused ops a later row of the pipeline fuses further
# the prologue rows (norms and the MTP input into the next linear) and their fused ops: tested on
# their own block in tests/circuit/test_prologue_fusions.py (this block's norm has many readers)
PROLOGUE_ROWS = ("fuse_rmsnorm_qkv", "fuse_rmsnorm_silu_mul", "fuse_rmsnorm_argmax_keep",
                 "fuse_rmsnorm_argmax", "fuse_argmax_last", "fuse_argmax_gate", "fuse_argmax_last_gate",
                 "fuse_qkv_rope_kv_write",
                 "fuse_embed_concat_linear")
# the KV-only catch-up's rows (ops/kv_only.py): a step without q, tested on kv_block() below
KV_ROWS = ("fuse_rope_k_kv_write", "fuse_kv", "fuse_rmsnorm_kv")
KV_PREREQUISITES = {"fuse_kv": ("fuse_rope_k_kv_write",),
                    "fuse_rmsnorm_kv": ("fuse_rope_k_kv_write", "fuse_kv")}
BLOCK_ROWS = [row for row in FUSIONS if row.name not in PROLOGUE_ROWS + KV_ROWS]
ONLY_IN_PROLOGUE_BLOCK = {"add_rmsnorm", *(row.fused_op for row in FUSIONS
                                          if row.name in PROLOGUE_ROWS + KV_ROWS)}


@pytest.mark.parametrize("width", [1, 3, 8])
@pytest.mark.parametrize("row", BLOCK_ROWS, ids=lambda r: r.name)
def test_row_equals_the_unfused_eager_circuit(row, width):
    c = block()
    params, inputs, states = values(c, width, seed=width)
    pipeline = (*PREREQUISITES.get(row.name, ()), row.name)
    fused = run_passes(c, pipeline)
    assert sum(n.op == row.fused_op for n in fused.nodes) == 1  # the row matched here
    want, want_states = run_eager(c, params, inputs, states)
    got, got_states = run_eager(fused, params, inputs, states)
    assert_same(got, want)
    assert_same(got_states, want_states)
    compiled = compile_draft(c, params, [width], options=CompileOptions(pipeline=pipeline))
    assert compiled.circuit == fused
    prog_states = {k: t.clone() for k, t in states.items()}
    assert_same(ProgramRunner(compiled, prog_states).run(inputs), want)
    assert_same(prog_states, want_states)


def kv_block():
    """What the KV-only catch-up keeps of a step: input norm -> k and v -> rope(k) -> the paged
    write, the caches the only outputs (no q, no attention)."""
    b = CircuitBuilder("kv_block", max_width=MAX_WIDTH)
    x = b.input("x", "float32", ("n", HIDDEN))
    pos = b.input("pos", "int32", ("n",))
    tables = b.input("tables", "int32", ("n", BLOCKS_PER_ROW))
    live, active = b.input("live", "int32", ("n",)), b.input("active", "int32", ("n",))
    cache = (NUM_BLOCKS, BS, 1, 4)
    kc, vc = b.state("kc", "float32", cache), b.state("vc", "float32", cache)
    p = {name: b.param(name, "float32", shape) for name, shape in (
        ("wn", (HIDDEN,)), ("wk", (4, HIDDEN)), ("wv", (4, HIDDEN)))}
    m = b.op1("rmsnorm", [x, p["wn"]], {"eps": 1e-5}, name="norm")
    k = b.op1("rope", [b.op1("linear", [m, p["wk"]], name="k"), pos], {"head_dim": 4, "pos_offset": 1},
              name="rk")
    v = b.op1("linear", [m, p["wv"]], name="v")
    kc, vc = b.op("kv_write", [kc, vc, k, v, tables, live, active], {"row_offset": 1}, name="kvw")
    b.output(kc)
    b.output(vc)
    return b.build()


@pytest.mark.parametrize("width", [1, 3, 8])
@pytest.mark.parametrize("name", [*KV_ROWS, "default"])
def test_kv_rows_equal_the_unfused_eager_circuit(name, width):
    """Each KV-only row after the rows it builds on, and the default pipeline, on kv_block():
    the eager run and the compiled program write the unfused circuit's caches bitwise; the
    default pipeline leaves two nodes (rmsnorm_linear_kv, rope_k_kv_write)."""
    c = kv_block()
    params, inputs, states = values(c, width, seed=20 + width)
    inputs = {k: v for k, v in inputs.items() if k in {"x", "pos", "tables", "live", "active"}}
    pipeline = DEFAULT_PIPELINE if name == "default" else (*KV_PREREQUISITES.get(name, ()), name)
    fused = run_passes(c, pipeline)
    if name == "default":
        assert [n.op for n in fused.nodes] == ["rmsnorm_linear_kv", "rope_k_kv_write"]
    else:
        row = next(r for r in FUSIONS if r.name == name)
        assert sum(n.op == row.fused_op for n in fused.nodes) == 1
    want, want_states = run_eager(c, params, inputs, states)
    got, got_states = run_eager(fused, params, inputs, states)
    assert_same(got, want)
    assert_same(got_states, want_states)
    compiled = compile_draft(c, params, [width], options=CompileOptions(pipeline=pipeline))
    prog_states = {k: t.clone() for k, t in states.items()}
    assert_same(ProgramRunner(compiled, prog_states).run(inputs), want)
    assert_same(prog_states, want_states)


def test_a_k_rope_beside_its_q_rope_still_fuses_as_rope_kv_write():
    """fuse_rope_k_kv_write runs after fuse_rope_kv_write: a full step's k rope goes with its q
    rope (one rope_kv_write), never into the KV-only op."""
    ops = {n.op for n in run_passes(block(), DEFAULT_PIPELINE).nodes}
    assert "rope_kv_write" in ops and not ops & {"rope_k_kv_write", "linear_kv", "rmsnorm_linear_kv"}


@pytest.mark.parametrize("width", [1, 3, 8])
def test_default_pipeline_equals_the_unfused_eager_circuit(width):
    c = block()
    params, inputs, states = values(c, width, seed=10 + width)
    compiled = compile_draft(c, params, [width])
    # fuse_linear_add runs first and takes the add fuse_add_rmsnorm would pair here
    assert ({row.fused_op for row in FUSIONS} - CONSUMED - ONLY_IN_PROLOGUE_BLOCK
            <= {n.op for n in compiled.circuit.nodes})
    want, want_states = run_eager(c, params, inputs, states)
    prog_states = {k: t.clone() for k, t in states.items()}
    assert_same(ProgramRunner(compiled, prog_states).run(inputs), want)
    assert_same(prog_states, want_states)


def test_rows_name_registered_ops_and_are_the_pipeline():
    assert ([row.name for row in FUSIONS if row.name not in OPT_IN]
            == [p for p in DEFAULT_PIPELINE if p.startswith("fuse_")])
    assert not set(OPT_IN) & set(DEFAULT_PIPELINE) and set(OPT_IN) <= set(PASSES)
    for row in FUSIONS:
        assert PASSES[row.name].__name__ == row.name and row.doc
        assert get_op(row.fused_op).has(FUSED)
        if isinstance(row, Siblings):
            assert get_op(row.op) and len(get_op(row.fused_op).outputs) == row.count
            continue
        get_op(row.producer), get_op(row.consumer)  # CircuitError if unregistered
        assert 0 <= row.edge < len(get_op(row.consumer).inputs)


def test_linear_silu_mul_keeps_a_linear_with_its_own_out_dtype():
    """linear_silu_mul has no out_dtype: a linear that widens its output must stay unfused."""
    b = CircuitBuilder("wide", max_width=2)
    x, w = b.input("x", "float16", ("n", 4)), b.param("w", "float16", (8, 4))
    b.output(b.op1("silu_mul", [b.op1("linear", [x, w], {"out_dtype": "float32"})]), "y")
    c = b.build()
    assert run_passes(c, ["fuse_linear_silu_mul"]) == c


# ---- two layers at one position: fuse_rope_kv_write must pair each kv_write with its own q ----
def two_layers(rope_q: bool, return_q0: bool = False):
    """Two attention layers over their own KV pools, same positions and rope attrs. With
    rope_q False only k is rotated: each layer is one rope/kv_write pair and nothing fuses."""
    b = CircuitBuilder("two_layers", max_width=MAX_WIDTH)
    h = b.input("x", "float32", ("n", HIDDEN))
    pos = b.input("pos", "int32", ("n",))
    tables = b.input("tables", "int32", ("n", BLOCKS_PER_ROW))
    live = b.input("live", "int32", ("n",))
    for layer in (0, 1):
        with b.scope(f"l{layer}"):
            kc = b.state(f"kc{layer}", "float32", (NUM_BLOCKS, BS, 1, 4))
            vc = b.state(f"vc{layer}", "float32", (NUM_BLOCKS, BS, 1, 4))
            wq, wk, wv, wo = (b.param(f"l{layer}.{w}", "float32", shape) for w, shape in (
                ("wq", (8, HIDDEN)), ("wk", (4, HIDDEN)), ("wv", (4, HIDDEN)), ("wo", (HIDDEN, 8))))
            q = b.op1("linear", [h, wq], name="q")
            if rope_q:
                q = b.op1("rope", [q, pos], {"head_dim": 4}, name="rq")
                if return_q0 and layer == 0:
                    b.output(b.op1("add", [q, q], name="q_twice"), "q0_twice")
            k = b.op1("rope", [b.op1("linear", [h, wk], name="k"), pos], {"head_dim": 4}, name="rk")
            kc, vc = b.op("kv_write", [kc, vc, k, b.op1("linear", [h, wv], name="v"), tables, live],
                          name="kvw")
            o = b.op1("decode_attention", [q, kc, vc, tables, live], name="attn")
            h = b.op1("add", [h, b.op1("linear", [o, wo], name="o")], name="res")
            b.output(kc)
            b.output(vc)
    b.output(h, "y")
    return b.build()


def two_layer_values(c, width):
    g = torch.Generator().manual_seed(width)
    params = {v.name: torch.randn(v.shape, generator=g) for v in c.inputs_of_kind("param")}
    inputs = {"x": torch.randn(width, HIDDEN, generator=g),
              "pos": torch.randint(0, 50, (width,), generator=g, dtype=torch.int32),
              "tables": (1 + torch.arange(width * BLOCKS_PER_ROW, dtype=torch.int32)).view(width, -1),
              "live": torch.randint(0, BS * BLOCKS_PER_ROW, (width,), generator=g, dtype=torch.int32)}
    states = {s.name: torch.randn(s.shape, generator=g) for s in c.values
              if s.kind == "state" and s.version == 0}
    return params, inputs, states


@pytest.mark.parametrize("width", [1, 3, 8])
@pytest.mark.parametrize("rope_q, return_q0, fused_names", [
    (False, False, []),  # another layer's k rope is no q rope (it used to close a cycle)
    (True, True, ["l1.rq+l1.rk+l1.kvw"]),  # layer 0's q has a second reader: layer 1's is not its q
    (True, False, ["l0.rq+l0.rk+l0.kvw", "l1.rq+l1.rk+l1.kvw"]),
])
def test_rope_kv_write_pairs_each_kv_write_with_its_own_q(rope_q, return_q0, fused_names, width):
    c = two_layers(rope_q, return_q0)
    fused = run_passes(c, ["fuse_rope_kv_write"])  # verified: a cycle would be a PassError
    assert [n.name for n in fused.nodes if n.op == "rope_kv_write"] == fused_names
    params, inputs, states = two_layer_values(c, width)
    want, want_states = run_eager(c, params, inputs, states)
    compiled = compile_draft(c, params, [width])
    prog_states = {k: t.clone() for k, t in states.items()}
    assert_same(ProgramRunner(compiled, prog_states).run(inputs), want)
    assert_same(prog_states, want_states)


# ---- the driver: no match that would close a cycle is ever taken ----
def diamond():
    """a = add(x, x); c = linear(a); d = add(a, c): fusing a with d would put the path
    a -> c -> d inside one node's inputs (a cycle)."""
    b = CircuitBuilder("diamond", max_width=2)
    x, w = b.input("x", "float32", ("n", 4)), b.param("w", "float32", (4, 4))
    a = b.op1("add", [x, x], name="a")
    d = b.op1("add", [a, b.op1("linear", [a, w], name="c")], name="d")
    b.output(d, "y")
    return b.build()


def test_driver_never_takes_a_match_that_closes_a_cycle():
    c = diamond()
    taken = Taken(c)
    assert taken.closes_cycle({"a", "d"}) and not taken.closes_cycle({"a", "c"})
    seen = []
    row = Fusion("fuse_add_add", "test row", producer="add", consumer="add", edge=0,
                 sole_reader=False, fused_op="add",
                 rewrite=lambda m: seen.append(m) or ((m.producer, m.consumer), (), (), {}))
    assert fuse(c, row) == c and seen == []


def test_taken_groups_count_as_one_node():
    """After b and c fuse, a -> b ... c -> d is one path through the group: fusing a with d
    would be a cycle although no original path from a to d leaves {a, d} and returns."""
    bld = CircuitBuilder("chain", max_width=2)
    x = bld.input("x", "float32", ("n", 4))
    a = bld.op1("add", [x, x], name="a")
    bb = bld.op1("add", [a, a], name="b")
    cc = bld.op1("add", [x, x], name="c")
    d = bld.op1("add", [a, cc], name="d")
    bld.output(bld.op1("add", [bb, d], name="e"), "y")
    c = bld.build()
    taken = Taken(c)
    assert not taken.closes_cycle({"a", "d"})
    taken.take({"b", "c"})  # b reads a, d reads c: a -> {b, c} -> d
    assert taken.closes_cycle({"a", "d"})


def random_dag(seed: int, size: int = 24):
    """A random DAG of adds over two inputs (each node reads two earlier values)."""
    import random
    rng = random.Random(seed)
    b = CircuitBuilder("dag", max_width=2)
    vals = [b.input("x", "float32", ("n", 4)), b.input("y", "float32", ("n", 4))]
    for i in range(size):
        vals.append(b.op1("add", [rng.choice(vals[-6:]), rng.choice(vals)], name=f"a{i}"))
    b.output(vals[-1], "out")
    return b.build(), rng


def contracted_has_cycle(c, groups) -> bool:
    import networkx as nx
    rep = {n: min(g) for g in groups for n in g}
    g = nx.DiGraph()
    g.add_nodes_from({rep.get(n, n) for n in c.graph.nodes})
    g.add_edges_from((rep.get(u, u), rep.get(v, v)) for u, v in c.graph.edges
                     if rep.get(u, u) != rep.get(v, v))
    return not nx.is_directed_acyclic_graph(g)


def test_taken_finds_exactly_the_cycles_contraction_would_make():
    """Against brute force on 40 random DAGs: contract every taken group and the candidate,
    look for a cycle. Both answers occur, so the comparison is not vacuous."""
    outcomes = []
    for seed in range(40):
        c, rng = random_dag(seed)
        taken, groups, free = Taken(c), [], [n.name for n in c.nodes]
        while len(free) >= 2 and len(outcomes) < 30 * (seed + 1):
            cand = set(rng.sample(free, min(len(free), rng.choice((2, 2, 3)))))
            want = contracted_has_cycle(c, [*groups, cand])
            assert taken.closes_cycle(cand) == want, (seed, sorted(cand), groups)
            outcomes.append(want)
            if not want:
                taken.take(cand)
                groups.append(cand)
                free = [n for n in free if n not in cand]
    assert any(outcomes) and not all(outcomes)


# ---- fuse_qkv and fuse_concat_linear: what stays unfused ----
def siblings(bias: bool = False, computed_weight: bool = False, readers: int = 3):
    b = CircuitBuilder("siblings", max_width=2)
    x = b.input("x", "float32", ("n", 4))
    ws = [b.param(f"w{i}", "float32", (4, 4)) for i in range(readers)]
    if computed_weight:
        ws[1] = b.op1("add", [ws[1], ws[1]], name="w1x2")
    bias_in = [b.param("bias", "float32", (4,))] if bias else []
    for i, w in enumerate(ws):
        b.output(b.op1("linear", [x, w, *(bias_in if i == 0 else [])], name=f"l{i}"), f"y{i}")
    return b.build()


@pytest.mark.parametrize("kwargs, fused", [
    ({}, ["l0+l1+l2"]),
    ({"readers": 4}, ["l0+l1+l2"]),  # a fourth sibling stays a linear
    ({"readers": 6}, ["l0+l1+l2", "l3+l4+l5"]),
    ({"bias": True}, []),  # linear_qkv has no bias: l0 is no sibling, two are left
    ({"computed_weight": True}, []),  # a weight computed in the circuit may not exist at l0
    ({"readers": 2}, []),
])
def test_fuse_qkv_groups_three_plain_linears_over_param_weights(kwargs, fused):
    c = siblings(**kwargs)
    got = run_passes(c, ["fuse_qkv"])
    assert [n.name for n in got.nodes if n.op == "linear_qkv"] == fused
    params = {v.name: torch.randn(v.shape) for v in c.inputs_of_kind("param")}
    inputs = {"x": torch.randn(2, 4)}
    assert_same(EagerRunner(got, params, {}).run(inputs), EagerRunner(c, params, {}).run(inputs))


def test_fuse_concat_linear_keeps_a_concat_with_another_reader():
    b = CircuitBuilder("cat", max_width=2)
    x, y = b.input("x", "float32", ("n", 4)), b.input("y", "float32", ("n", 4))
    cat = b.op1("concat", [x, y])
    b.output(b.op1("linear", [cat, b.param("w", "float32", (4, 8))]), "z")
    b.output(cat, "cat")
    c = b.build()
    assert run_passes(c, ["fuse_concat_linear"]) == c
