"""Nodes know where they came from: the repo-relative layer line and builder scope that built
them, kept through fusion and JSON, named by builder and verify errors, CIRCUIT_DEBUG messages
and the plan report; never printed and never part of the fingerprint."""
import sys
from pathlib import Path

import pytest
import torch

from draft_circuit.circuit import CircuitBuilder, CircuitError, verify
from draft_circuit.circuit.ir import Circuit, Origin
from draft_circuit.circuit.layers.config import DEFAULT_CONFIG
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.circuit.passes import run_passes
from draft_circuit.circuit.planner import compile_draft
from draft_circuit.runners.program import ProgramRunner
from draft_circuit.runners.testing import random_draft_batch, random_mtp_weights

ROOT = Path(__file__).resolve().parents[2]
MTP = "circuit/layers/mtp.py"
HERE = "tests/circuit/test_origin.py"
KV = KvLayout(num_blocks=32, block_size=16, max_blocks_per_seq=4)


def chain(**kw) -> Circuit:
    return emit_draft_chain(MtpHead(DEFAULT_CONFIG), 2, max_width=8, kv=KV, **kw)


def line_of(fragment: str, path: str = MTP) -> int:
    """The one line of `path` that holds `fragment` (1-based)."""
    lines = (ROOT / path).read_text().splitlines()
    (i,) = [i for i, text in enumerate(lines) if fragment in text]
    return i + 1


def strip_origins(c: Circuit) -> Circuit:
    return c.replace(nodes=[n.model_copy(update={"origin": ()}) for n in c.nodes])


def test_chain_nodes_name_their_layer_line_and_scope():
    c = chain()
    assert c.node("s1.enorm").origin == (Origin(file=MTP, line=line_of('name="enorm"'),
                                                scope="s1"),)
    assert c.node("s0.kv_write").origin[0].line == line_of('b.op("kv_write"')
    assert c.node("drafts").origin == (Origin(file=MTP, line=line_of('name="drafts"')),)
    for n in c.nodes:  # every node has one, repo-relative: no machine's path is recorded
        (o,) = n.origin
        assert o.file == MTP and not Path(o.file).is_absolute()


def test_a_node_built_here_names_this_file_and_the_nested_scope():
    b = CircuitBuilder("here", max_width=2)
    x = b.input("x", "float32", ("n", 4))
    with b.scope("outer"), b.scope("inner"):
        line = sys._getframe().f_lineno + 1
        y = b.op1("add", [x, x])
    b.output(y, "y")
    (o,) = b.build().node("outer.inner.add").origin
    assert o == Origin(file=HERE, line=line, scope="outer.inner")
    assert str(o) == f"{HERE}:{line} in scope outer.inner"


def test_fused_nodes_keep_the_origins_of_their_parts():
    c = chain()
    fused = run_passes(c)
    node = next(n for n in fused.nodes if n.op == "linear_add" and n.name.startswith("s1."))
    assert node.origin == tuple(c.node(p).origin[0] for p in node.fused)
    assert len(set(node.origin)) == 2  # the o_proj linear and its add sit on different lines
    mtp_input = next(n for n in fused.nodes if n.op == "embed_rmsnorm_linear_concat")
    assert mtp_input.origin == tuple(c.node(p).origin[0] for p in mtp_input.fused)
    assert len(mtp_input.fused) == 5  # embedding, enorm, hnorm, concat, eh_proj
    assert all(n.origin for n in fused.nodes)


def test_origins_are_not_printed_and_not_fingerprinted_but_travel_in_json():
    c = chain(bitmask=True)
    bare = strip_origins(c)
    assert str(c) == str(bare) and MTP not in str(c)
    assert c.fingerprint() == bare.fingerprint()
    moved = c.replace(nodes=[n.model_copy(update={"origin": tuple(
        o.model_copy(update={"line": o.line + 7}) for o in n.origin)}) for n in c.nodes])
    assert moved.fingerprint() == c.fingerprint()  # a layer edit that moves lines keeps the cache
    back = Circuit.from_json(c.to_json())
    assert back == c and back.node("s0.enorm").origin == c.node("s0.enorm").origin
    assert '"origin"' in c.to_json()


def test_verify_errors_name_the_origin():
    c = chain()
    bad = c.replace(values=[v.model_copy(update={"shape": ("n", 7)}) if v.name == "s1.q_proj" else v
                            for v in c.values])
    with pytest.raises(CircuitError) as e:
        verify(bad)
    q_line = line_of('name="q_proj"')
    where = f"{MTP}:{q_line} in scope s1"
    assert e.value.origin == where and f"(built at {where})" in str(e.value)
    assert e.value.node == "s1.q_proj" and "f32[n,7]" in str(e.value)


def test_builder_errors_name_the_calling_line():
    b = CircuitBuilder("b", max_width=2)
    x = b.input("x", "float32", ("n", 4))
    line = sys._getframe().f_lineno + 2
    with pytest.raises(CircuitError) as e:
        b.op1("add", [x], name="lonely")
    assert e.value.origin == f"{HERE}:{line}" and f"built at {HERE}:{line}" in str(e.value)


def test_debug_messages_name_the_launch_origin(monkeypatch):
    head = MtpHead(DEFAULT_CONFIG)
    circuit = emit_draft_chain(head, 1, max_width=2, kv=KV)
    params = head.bind(random_mtp_weights(DEFAULT_CONFIG, seed=1))
    compiled = compile_draft(circuit, params, [2], device="cpu")
    monkeypatch.setenv("CIRCUIT_DEBUG", "2")
    batch = random_draft_batch(DEFAULT_CONFIG, KV, 2, seed=3, num_drafts=1)
    bad = dict(batch.inputs, hidden=batch.inputs["hidden"].clone())
    bad["hidden"][0, 5] = float("nan")
    runner = ProgramRunner(compiled, batch.clone_states())
    hnorm_line = line_of('name="hnorm"')
    where = f"{MTP}:{hnorm_line} in scope s0"
    # hnorm rides in eh_proj's prologue (fuse_embed_concat_linear): the launch names every part,
    # and its origins list the hnorm line among the parts'
    with pytest.raises(FloatingPointError, match=rf"launch 's0.embedding\+s0.enorm\+s0.hnorm\+s0.concat"
                                                 rf"\+s0.eh_proj' .*\(built at .*{where}.*\)"):
        runner.run(bad)


def test_plan_report_carries_origins_for_the_details_panel():
    head = MtpHead(DEFAULT_CONFIG)
    circuit = emit_draft_chain(head, 2, max_width=2, kv=KV)
    params = {k: torch.empty(s, device="meta") for k, s in head.param_shapes().items()}
    report = compile_draft(circuit, params, [1, 2], device="cpu").report()
    infos = {n.name: n for n in report.nodes}
    fused = next(n for n in report.nodes if n.op == "rmsnorm_linear_silu_mul")
    assert [o.line for o in fused.origin] == [circuit.node(p).origin[0].line for p in fused.fused]
    assert infos["s0.attention"].origin == list(circuit.node("s0.attention").origin)
    assert '"origin"' in report.to_json()


def test_moe_nodes_name_the_moe_layer():
    from draft_circuit.circuit.layers.moe import MoeConfig, MoeMtpHead
    cfg = MoeConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-6, rope_theta=10000.0,
                    num_hidden_layers=2, tie_word_embeddings=False, max_position_embeddings=512,
                    n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
                    n_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5)
    c = emit_draft_chain(MoeMtpHead(cfg), 1, max_width=2, kv=KV)
    moe = "circuit/layers/moe.py"
    assert c.node("s0.router").origin == (Origin(file=moe, line=line_of('name="router"', moe),
                                                 scope="s0"),)
    assert c.node("s0.attention").origin[0].file == MTP  # the shared decoder block
