"""One test per verifier failure class; each error names the node, the op and the shapes."""
import pytest

from draft_circuit.circuit import CircuitBuilder, CircuitError, Node, Value, verify
from draft_circuit.circuit.ir import Circuit


def small() -> Circuit:
    b = CircuitBuilder("small", max_width=8)
    x = b.input("x", "float32", ("n", 4))
    w = b.param("w", "float32", (3, 4))
    kc = b.state("kc", "float32", (5, 2, 1, 3))
    t = b.input("tables", "int32", ("n", 2))
    live = b.input("live", "int32", ("n",))
    y = b.op1("linear", [x, w], name="proj")
    z = b.op1("add", [y, y], name="double")
    kc1, vc1 = b.op("kv_write", [kc, b.state("vc", "float32", (5, 2, 1, 3)), z, z, t, live])
    b.output(z, "z")
    b.output(kc1)
    b.output(vc1)
    return b.build()


def edit_node(c: Circuit, name: str, **update) -> Circuit:
    return c.replace(nodes=[n.model_copy(update=update) if n.name == name else n for n in c.nodes])


def edit_value(c: Circuit, name: str, **update) -> Circuit:
    return c.replace(values=[v.model_copy(update=update) if v.name == name else v for v in c.values])


def test_small_is_valid():
    verify(small())


def fails(c: Circuit, *fragments: str) -> CircuitError:
    with pytest.raises(CircuitError) as e:
        verify(c)
    for f in fragments:
        assert f in str(e.value), (f, str(e.value))
    return e.value


def test_cycle_is_named():
    c = small()
    # proj reads double's output: proj -> double -> proj
    c = edit_node(c, "proj", inputs=("z", "w"))
    c = edit_value(c, "x", shape=("n", 4))
    c2 = edit_value(c, "proj", shape=("n", 3))
    # make shapes consistent so only the cycle is wrong: z is [n,3], linear needs [n,4] -> widen w
    c2 = edit_value(c2, "w", shape=(3, 3))
    e = fails(c2, "cycle", "proj", "double")
    assert e.node in ("proj", "double")


def test_undefined_input():
    fails(edit_node(small(), "double", inputs=("proj", "nope")), "'nope'", "double", "add")


def test_temp_read_but_never_produced():
    c = small()
    c = c.replace(nodes=[n for n in c.nodes if n.name != "proj"])
    fails(c, "'proj'", "never produced", "double")


def test_value_defined_twice():
    c = small()
    c = c.replace(nodes=list(c.nodes) + [Node(name="again", op="add", inputs=("proj", "proj"),
                                             outputs=("z",))])
    fails(c, "defined twice", "again")


def test_value_declared_twice():
    c = small()
    fails(c.replace(values=list(c.values) + [c.value("proj")]), "declared twice", "proj")


def test_unknown_op():
    fails(edit_node(small(), "double", op="frobnicate"), "unknown op 'frobnicate'", "double")


def test_wrong_arity():
    fails(edit_node(small(), "double", inputs=("proj",)), "takes 2 inputs", "double", "add")


def test_invalid_attrs():
    fails(edit_node(small(), "double", attrs={"alpha": 2}), "invalid attrs", "double", "add")
    fails(edit_node(small(), "kv_write", attrs={"row_offset": "x"}), "invalid attrs", "kv_write")


def test_shape_mismatch_names_shapes():
    e = fails(edit_value(small(), "w", shape=(3, 5)), "linear in-features", "proj", "f32[n,4]",
              "f32[3,5]")
    assert e.op == "linear"


def test_row_symbol_against_fixed_dim():
    fails(edit_value(small(), "x", shape=(8, 4)), "recorded as f32[n,3]", "f32[8,3]")


def test_recorded_shape_differs_from_rule():
    fails(edit_value(small(), "proj", shape=("n", 7)), "recorded as f32[n,7]", "gives f32[n,3]")


def test_dtype_mismatch_asks_for_cast():
    fails(edit_value(small(), "w", dtype="bfloat16"), "dtypes differ", "cast", "bf16[3,4]")


def test_unbound_symbol():
    fails(edit_value(small(), "x", shape=("m", 4)), "unbound symbol 'm'")


def test_output_not_produced():
    c = small()
    c = c.replace(values=list(c.values) + [Value(name="ghost", dtype="float32", shape=("n",),
                                                  kind="output")],
                  outputs=c.outputs + ("ghost",))
    fails(c, "'ghost'", "not produced")


def test_output_names_no_value():
    fails(small().replace(outputs=("z", "nowhere")), "'nowhere'", "names no value")


def test_state_read_after_later_version_written():
    b = CircuitBuilder("stale", max_width=4)
    kc, vc = b.state("kc", "float32", (5, 2, 1, 3)), b.state("vc", "float32", (5, 2, 1, 3))
    x = b.input("x", "float32", ("n", 3))
    t, live = b.input("t", "int32", ("n", 2)), b.input("live", "int32", ("n",))
    kc1, vc1 = b.op("kv_write", [kc, vc, x, x, t, live], name="w1")
    b.output(kc1)
    b.output(vc1)
    c = b.build()
    # a reader of version 0 that also depends on the write of version 1 must run both before and
    # after it
    c = c.replace(
        values=list(c.values) + [Value(name="q", dtype="float32", shape=("n", 3), kind="temp"),
                                 Value(name="o", dtype="float32", shape=("n", 3), kind="output")],
        nodes=list(c.nodes) + [
            Node(name="after", op="decode_attention", inputs=("x", "kc@1", "vc@1", "t", "live"),
                 outputs=("q",)),
            Node(name="stale", op="decode_attention", inputs=("q", "kc", "vc", "t", "live"),
                 outputs=("o",))],
        outputs=c.outputs + ("o",))
    e = fails(c, "reads state version", "stale", "'w1' wrote its next version")
    assert e.node == "stale"


def test_state_versions_must_form_a_line():
    c = small()
    kv = c.node("kv_write")
    c = c.replace(values=list(c.values) + [
        Value(name="kc@1b", dtype="float32", shape=(5, 2, 1, 3), kind="state", storage="kc", version=1),
        Value(name="vc@1b", dtype="float32", shape=(5, 2, 1, 3), kind="state", storage="vc", version=1)],
        nodes=list(c.nodes) + [kv.model_copy(update={"name": "fork", "outputs": ("kc@1b", "vc@1b")})])
    fails(c, "written by two nodes")


def test_in_place_write_of_an_input_is_refused():
    c = small()
    fails(edit_node(c, "double", outputs=("x",)), "writes input 'x'", "clobber")


def test_eh_proj_input_must_be_twice_hidden():
    b = CircuitBuilder("eh", max_width=4)
    e, h = b.input("e", "float32", ("n", 8)), b.input("h", "float32", ("n", 8))
    w = b.param("eh_proj.weight", "float32", (8, 12))  # should be [8, 16]
    cat = b.op1("concat", [e, h])
    with pytest.raises(CircuitError, match=r"eh_proj.*linear in-features.*16 != 12"):
        b.op1("linear", [cat, w], name="eh_proj")


def test_bad_symbol_bounds():
    c = small()
    fails(Circuit(name="c", symbols={"n": (0, 8)}, values=c.values, nodes=c.nodes,
                  outputs=c.outputs), "bounds [0, 8]")


# ---- node names (issue 19 item 2): the program keys launches by name, so two alike lose one
def test_two_nodes_of_one_name_are_refused():
    c = small()
    twin = c.node("double").model_copy(update={"outputs": ("z2",)})
    c = c.replace(values=list(c.values) + [Value(name="z2", dtype="float32", shape=("n", 3),
                                                 kind="output")],
                  nodes=list(c.nodes) + [twin], outputs=c.outputs + ("z2",))
    e = fails(c, "node name used twice", "'double'", "add")
    assert e.node == "double"


def residual_norm(name: str):
    """add then rmsnorm, plus a third node named `name`: the fused add+rmsnorm is `res+norm`."""
    b = CircuitBuilder("fusable", max_width=4)
    x, w = b.input("x", "float32", ("n", 4)), b.param("w", "float32", (4,))
    s = b.op1("add", [x, x], name="res")
    y = b.op1("rmsnorm", [s, w], name="norm")
    b.output(b.op1("add", [y, s], name=name), "y")
    return b


def test_builder_refuses_a_node_named_like_a_fused_node():
    with pytest.raises(CircuitError, match=r"node 'res\+norm' \(op add\).*may not contain '\+'"):
        residual_norm("res+norm")


def test_a_circuit_naming_a_node_like_a_fused_one_never_compiles():
    """The same circuit arriving as JSON (no builder on the way): refused by verify, so the
    fusion pass can never make a second `res+norm` that the program would silently drop."""
    import torch

    from draft_circuit.circuit.planner import compile_draft
    c = residual_norm("last").build()
    c = c.replace(nodes=[n.model_copy(update={"name": "res+norm"}) if n.name == "last" else n
                         for n in c.nodes])
    back = Circuit.from_json(c.to_json())
    fails(back, "only fused nodes may have '+'", "res+norm")
    with pytest.raises(CircuitError, match=r"res\+norm"):
        compile_draft(back, {"w": torch.ones(4)}, [1], device="cpu")


# ---- outputs recorded as temps (issue 19 item 7): refused before any runner sees them
def temp_output() -> Circuit:
    c = small()
    return c.replace(values=[v.model_copy(update={"kind": "temp"}) if v.name == "z" else v
                             for v in c.values])


def test_an_output_recorded_as_a_temp_is_refused():
    e = fails(temp_output(), "circuit output 'z' is recorded as a temp", "kind 'output'")
    assert e.node == "double" and e.op == "add"


def test_eager_and_program_runners_both_refuse_a_temp_output():
    """Eager used to return it and the program runners to drop it; now neither runs it."""
    import torch

    from draft_circuit.circuit.planner import compile_draft
    from draft_circuit.runners.eager import EagerRunner
    c = temp_output()
    params = {"w": torch.ones(3, 4)}
    states = {"kc": torch.zeros(5, 2, 1, 3), "vc": torch.zeros(5, 2, 1, 3)}
    with pytest.raises(CircuitError, match="recorded as a temp"):
        EagerRunner(c, params, states)
    with pytest.raises(CircuitError, match="recorded as a temp"):
        compile_draft(c, params, [2], device="cpu")  # what a ProgramRunner is built from
    EagerRunner(small(), params, states)  # the same circuit with its output kind is run


# ---- what passed verify and failed only at run time (issue 19 item 11)
def test_a_param_may_not_use_the_row_symbol():
    fails(edit_value(small(), "w", shape=("n", 4)), "param 'w'", "uses a symbol", "f32[n,4]")


def test_a_shape_rule_that_raises_is_a_circuit_error(monkeypatch):
    """Whatever a shape rule trips on (here a division by zero) is reported as a CircuitError
    naming the node, the op and the shapes, never raised raw."""
    from draft_circuit.ops import registry

    def infer(ins, attrs):
        return [ins[0]] * (1 // (len(ins[0].shape) - 2))  # rank 2: ZeroDivisionError

    op = registry.OpDef(name="test_divides", inputs=("x",), outputs=("out",), infer=infer,
                        reference=lambda t, a: (t[0],))
    monkeypatch.setitem(registry.REGISTRY, "test_divides", op)
    c = edit_node(small(), "double", op="test_divides", inputs=("proj",))
    e = fails(c, "shape rule failed: ZeroDivisionError", "'double'", "test_divides", "f32[n,3]")
    assert e.op == "test_divides"
    b = CircuitBuilder("b", max_width=2)
    x = b.input("x", "float32", ("n", 4))
    with pytest.raises(CircuitError, match=r"node 'test_divides'.*ZeroDivisionError.*f32\[n,4\]"):
        b.op1("test_divides", [x])


def test_rope_head_dim_zero_is_a_circuit_error():
    b = CircuitBuilder("b", max_width=2)
    x, pos = b.input("x", "float32", ("n", 8)), b.input("pos", "int32", ("n",))
    with pytest.raises(CircuitError, match=r"node 'rope' \(op rope\)"):
        b.op1("rope", [x, pos], {"head_dim": 0})
    ok = b.op1("rope", [x, pos], {"head_dim": 4}, name="ok")
    b.output(ok, "y")
    c = b.build()
    with pytest.raises(CircuitError, match=r"node 'ok' \(op rope\)"):
        verify(edit_node(c, "ok", attrs={"head_dim": 0}))


def test_builder_checks_an_ops_input_count():
    b = CircuitBuilder("b", max_width=2)
    x = b.input("x", "float32", ("n", 4))
    with pytest.raises(CircuitError, match=r"node 'add' \(op add\).*takes 2 inputs.*got 1.*x: f32"):
        b.op1("add", [x])
    w = b.param("w", "float32", (4,))
    with pytest.raises(CircuitError, match=r"takes 2 inputs .*got 3"):
        b.op1("rmsnorm", [x, w, w])
    with pytest.raises(CircuitError, match="takes one or more inputs, got 0"):
        b.op1("concat", [])


# ---- neutral values of inputs
@pytest.mark.parametrize("kind,dtype,neutral,why", [
    ("param", "float32", 0.0, "only inputs have one"),
    ("input", "float32", "scratch_block", "block id"),
    ("input", "int32", float("-inf"), "not an integer"),
    ("input", "int32", 0.5, "not an integer"),
])
def test_a_neutral_must_fit_its_input(kind, dtype, neutral, why):
    c = small()
    c = c.replace(values=list(c.values) + [Value(name="extra", dtype=dtype, shape=(3,),
                                                 kind=kind, neutral=neutral)])
    fails(c, "'extra'", why)


def test_neutrals_that_fit_pass():
    c = small()
    c = c.replace(values=list(c.values) + [
        Value(name="tau", dtype="float32", shape=("n",), kind="input", neutral=float("-inf")),
        Value(name="tab", dtype="int32", shape=("n", 2), kind="input", neutral="scratch_block"),
        Value(name="mask", dtype="int32", shape=("n", 3), kind="input", neutral=-1)])
    verify(c)


@pytest.mark.parametrize("op,attrs,why", [
    ("rope", {"head_dim": -2}, "head_dim and theta must be > 0"),   # ran, then failed in view()
    ("rope", {"head_dim": 4, "theta": 0.0}, "head_dim and theta must be > 0"),
    ("rmsnorm", {"eps": -1e-6}, "eps must be finite and > 0"),     # NaN rows at run time
    ("rmsnorm", {"eps": 0.0}, "eps must be finite and > 0"),
    ("concat", {"dim": 5}, "concat dim 5 is out of range for rank 2"),  # torch.cat failed
    ("concat", {"dim": -3}, "concat dim -3 is out of range for rank 2"),
])
def test_attrs_that_failed_only_at_run_time_are_refused(op, attrs, why):
    b = CircuitBuilder("b", max_width=2)
    x, w = b.input("x", "float32", ("n", 8)), b.param("w", "float32", (8,))
    pos = b.input("pos", "int32", ("n",))
    args = {"rope": [x, pos], "rmsnorm": [x, w], "concat": [x, x]}[op]
    with pytest.raises(CircuitError, match=rf"node '{op}' \(op {op}\).*{why}"):
        b.op1(op, args, attrs)
    good = {"rope": {"head_dim": 4}}.get(op, {})
    ok = b.op1(op, args, good, name="ok")  # good attrs build; the same node edited is refused
    b.output(ok, "y")
    fails(edit_node(b.build(), "ok", attrs=attrs), why, "'ok'", op)
