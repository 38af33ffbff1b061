"""The IR: printing, JSON round trip, fingerprint stability, graph queries, builder rules."""
import json
import subprocess
import sys

import pytest

from draft_circuit.circuit import CircuitBuilder, CircuitError
from draft_circuit.circuit.ir import SCHEMA_VERSION, SCRATCH_BLOCK, Circuit
from draft_circuit.circuit.layers.config import DEFAULT_CONFIG
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain

KV = KvLayout(num_blocks=32, block_size=16, max_blocks_per_seq=4)


def chain(**kw) -> Circuit:
    return emit_draft_chain(MtpHead(DEFAULT_CONFIG), 2, max_width=8, kv=KV, **kw)


def test_prints_one_line_per_node():
    c = chain()
    text = str(c)
    body = [line for line in text.splitlines() if " = " in line]
    assert len(body) == len(c.nodes)
    assert "  s0.embedding: f32[n,128] = embedding(embed_tokens.weight, tokens)" in text
    assert ("k_cache@1: f32[32,16,2,32], v_cache@1: f32[32,16,2,32] = kv_write(k_cache, v_cache, "
            "s0.rope_k, s0.v_proj, block_tables, live_rows, active) {row_offset=0}") in text
    assert text.splitlines()[0] == "circuit mtp_draft_chain (1 <= n <= 8)"


def test_json_round_trip_and_schema_version():
    c = chain(bitmask=True, embed_target=True)
    back = Circuit.from_json(c.to_json())
    assert back == c and str(back) == str(c) and back.fingerprint() == c.fingerprint()
    bad = c.to_json().replace(f'"schema_version":{SCHEMA_VERSION}', '"schema_version":99')
    with pytest.raises(CircuitError, match="schema_version 99"):
        Circuit.from_json(bad)


def test_fingerprint_is_stable_across_processes():
    # the package's own import root (draft_circuit.*): the bare `circuit` root is gone
    code = ("from draft_circuit.circuit.layers.config import DEFAULT_CONFIG as C;"
            "from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain;"
            "print(emit_draft_chain(MtpHead(C), 2, max_width=8, kv=KvLayout(32, 16, 4)).fingerprint())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}, cwd=".")
    assert out.stdout.strip() == chain().fingerprint()


def test_fingerprint_changes_with_content():
    assert chain().fingerprint() != chain(bitmask=True).fingerprint()


def test_graph_queries():
    c = chain()
    assert c.producer("tokens") is None
    assert c.producer("s0.q_proj").op == "linear"
    assert [n.name for n in c.users("s0.input_layernorm")] == ["s0.q_proj", "s0.k_proj", "s0.v_proj"]
    order = [n.name for n in c.topo_order()]
    assert order.index("s0.kv_write") < order.index("s0.attention") < order.index("s1.kv_write")
    assert len(order) == len(c.nodes)


def test_state_versions_are_chained():
    c = chain()
    versions = sorted((v.version, v.name) for v in c.values if v.storage == "k_cache")
    assert versions == [(0, "k_cache"), (1, "k_cache@1"), (2, "k_cache@2")]
    assert "k_cache@2" in c.outputs


def test_builder_names_and_checks():
    b = CircuitBuilder("b", max_width=4)
    x = b.input("x", "float32", ("n", 4))
    with pytest.raises(CircuitError, match="declared twice"):
        b.input("x", "float32", ("n", 4))
    with b.scope("s0"):
        y = b.op1("add", [x, x])
    assert y == "s0.add"
    with pytest.raises(CircuitError, match="node name used twice"):
        with b.scope("s0"):
            b.op1("add", [x, x])
    with pytest.raises(CircuitError, match="names no value"):
        b.op1("add", [x, "missing"], name="bad")
    b.output(y, "y")
    c = b.build()
    assert c.outputs == ("y",) and c.value("y").kind == "output"


# ---- Circuit.from_json on what is not a circuit (issue 19 item 12): a CircuitError, never a
# raw AttributeError, RecursionError or pydantic error
@pytest.mark.parametrize("text,why", [
    ("[]", "must be an object, got list"),
    ('"circuit"', "must be an object, got str"),
    ("null", "must be an object, got NoneType"),
    ("3", "must be an object, got int"),
    ("{", "does not parse"),
    ("", "does not parse"),
    (b"\xff\xfe{", "does not parse"),
    ("[" * 100_000 + "]" * 100_000, "nests deeper than"),
    ('{"schema_version": 1, "x": ' + "[" * 200 + "]" * 200 + "}", "nests deeper than"),
    ('{"schema_version": 1}', "does not fit the schema"),
    ('{"schema_version": 1, "name": 3, "symbols": {}, "values": 5, "nodes": [], "outputs": []}',
     "does not fit the schema"),
])
def test_from_json_refuses_what_is_not_a_circuit(text, why):
    with pytest.raises(CircuitError, match=why):
        Circuit.from_json(text)


def test_deep_attrs_are_refused_not_recursed():
    data = json.loads(chain().to_json())
    nested: list = []
    for _ in range(500):
        nested = [nested]
    data["nodes"][0]["attrs"] = {"deep": nested}
    with pytest.raises(CircuitError, match="nests deeper than 64 levels"):
        Circuit.from_json(json.dumps(data))


# ---- neutral values: declared beside the layer, carried in JSON, not printed
def test_chain_inputs_declare_their_neutrals():
    c = chain(bitmask=True, confidence_stop=True)
    neutral = {v.name: v.neutral for v in c.inputs_of_kind("input")}
    assert neutral == {"tokens": 0, "hidden": 0, "positions": 0, "block_tables": SCRATCH_BLOCK,
                       "live_rows": 0, "active": 0, "bitmask": -1, "log_tau": float("-inf")}
    back = Circuit.from_json(c.to_json())  # -inf survives JSON (as -Infinity)
    assert back.value("log_tau").neutral == float("-inf") and back == c
    assert back.fingerprint() == c.fingerprint()
    assert "neutral" not in str(c) and "inf" not in str(c)


def test_an_undeclared_neutral_is_none_and_changes_the_fingerprint_when_declared():
    b = CircuitBuilder("b", max_width=2)
    x = b.input("x", "float32", ("n", 4))
    b.output(b.op1("add", [x, x]), "y")
    plain = b.build()
    assert plain.value("x").neutral is None
    b = CircuitBuilder("b", max_width=2)
    x = b.input("x", "float32", ("n", 4), neutral=1.0)
    b.output(b.op1("add", [x, x]), "y")
    assert b.build().fingerprint() != plain.fingerprint()  # runners read it: part of the key


def test_builder_output_refuses_unknown_and_repeated_values():
    b = CircuitBuilder("b", max_width=2)
    x = b.input("x", "float32", ("n", 4))
    y = b.op1("add", [x, x])
    with pytest.raises(CircuitError, match="output 'nope' names no value"):
        b.output("nope")
    b.output(y, "y")
    with pytest.raises(CircuitError, match="'add' is already an output"):
        b.output(y, "y2")
