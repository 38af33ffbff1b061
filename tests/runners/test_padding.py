"""Inert rows get the neutral values their circuit declares (beside the layer), not a table of
input names in the runners: the chain's mask allows every token, its confidence stop never
fires, its block tables point at the scratch block; an undeclared neutral is zero."""
import torch

from draft_circuit.circuit import CircuitBuilder
from draft_circuit.circuit.layers.config import DEFAULT_CONFIG
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.circuit.passes import run_passes
from draft_circuit.runners.padding import fill_neutral, neutral_value

KV = KvLayout(num_blocks=32, block_size=16, max_blocks_per_seq=4)


def buffers(circuit) -> dict[str, torch.Tensor]:
    """Max-width static input buffers full of a value no neutral equals."""
    out = {}
    for v in circuit.inputs_of_kind("input"):
        shape = tuple(circuit.max_width if d == "n" else d for d in v.shape)
        out[v.name] = torch.full(shape, 7, dtype=getattr(torch, v.dtype))
    return out


def test_chain_rows_past_start_get_the_declared_neutrals():
    chain = emit_draft_chain(MtpHead(DEFAULT_CONFIG), 2, max_width=4, kv=KV, bitmask=True,
                             confidence_stop=True)
    bufs = buffers(chain)
    fill_neutral(chain, bufs, 1, scratch_block=5)
    for name, buf in bufs.items():
        assert (buf[:1] == 7).all(), name  # live rows untouched
    assert (bufs["block_tables"][1:] == 5).all()
    assert (bufs["bitmask"][1:] == -1).all()  # every token allowed: the argmax stays defined
    assert torch.isneginf(bufs["log_tau"][1:]).all()  # log-probabilities are never below -inf
    for name in ("active", "tokens", "positions", "live_rows", "hidden"):
        assert (bufs[name][1:] == 0).all(), name


def test_neutrals_survive_the_pass_pipeline():
    """Runners read them from the compiled (fused) circuit."""
    chain = emit_draft_chain(MtpHead(DEFAULT_CONFIG), 2, max_width=4, kv=KV, bitmask=True)
    fused = run_passes(chain)
    assert {v.name: v.neutral for v in fused.inputs_of_kind("input")} == \
        {v.name: v.neutral for v in chain.inputs_of_kind("input")}
    assert neutral_value(fused, "block_tables", 9) == 9 and neutral_value(fused, "bitmask", 9) == -1


def test_any_input_can_declare_a_neutral_and_undeclared_is_zero():
    b = CircuitBuilder("custom", max_width=3)
    x = b.input("x", "float32", ("n", 2), neutral=0.25)
    tables = b.input("block_tables", "int32", ("n", 2))  # the name alone means nothing now
    ids = b.input("ids", "int32", ("n",), neutral="scratch_block")
    b.output(b.op1("add", [x, x], name="y2"), "y")
    b.output(b.op1("add", [tables, tables], name="t2"), "t")
    b.output(b.op1("add", [ids, ids], name="i2"), "i")
    c = b.build()
    bufs = buffers(c)
    fill_neutral(c, bufs, 2, scratch_block=3)
    assert (bufs["x"][2:] == 0.25).all() and (bufs["x"][:2] == 7).all()
    assert (bufs["block_tables"][2:] == 0).all()
    assert (bufs["ids"][2:] == 3).all()
