"""The IR: printing, JSON round trip, fingerprint stability, graph queries, builder rules."""
import subprocess
import sys

import pytest

from draft_circuit.circuit import CircuitBuilder, CircuitError
from draft_circuit.circuit.ir import SCHEMA_VERSION, Circuit
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
    code = ("from circuit.layers.config import DEFAULT_CONFIG as C;"
            "from circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain;"
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
