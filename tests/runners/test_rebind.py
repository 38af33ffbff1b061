"""FAULTS 11: a caller replacing an entry of `input_buffers(n)` (or swapping its storage) instead of
copying into it is caught under CIRCUIT_DEBUG=1 by the ProgramRunner and the GraphRunner
(`RebindError` naming the input); copying into the buffers is the supported path and works."""
import pytest
import torch

from draft_circuit.circuit.planner import compile_draft
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.program import ProgramRunner, RebindError
from draft_circuit.runners.testing import cuda, random_draft_batch, random_mtp_weights
from tests.runners.tiny_chain import tiny_config

CFG = tiny_config()
KV = KvLayout(num_blocks=40, block_size=8, max_blocks_per_seq=4)
K = 2


def _build(device: str = "cpu"):
    head = MtpHead(CFG)
    chain = emit_draft_chain(head, K, max_width=4, kv=KV)
    params = head.bind(random_mtp_weights(CFG, seed=3, device=device))
    return chain, params, compile_draft(chain, params, [1, 4], device=device)


def _rebinds(buffers: dict[str, torch.Tensor]):
    """The three ways a caller can rebind: replace an entry, remove it, swap its storage."""
    def replace():
        buffers["tokens"] = buffers["tokens"].clone()

    def remove():
        del buffers["positions"]

    def swap():
        buffers["hidden"].set_(buffers["hidden"].clone())
    return {"replace": (replace, "tokens"), "remove": (remove, "positions"),
            "swap": (swap, "hidden")}


@pytest.mark.parametrize("how", ["replace", "remove", "swap"])
def test_program_runner_catches_a_rebound_input_under_debug(monkeypatch, how):
    monkeypatch.setenv("CIRCUIT_DEBUG", "1")
    _, _, cd = _build()
    batch = random_draft_batch(CFG, KV, 4, seed=1, num_drafts=K)
    runner = ProgramRunner(cd, batch.clone_states())
    runner.run(batch.inputs)  # bound and fine
    rebind, name = _rebinds(runner.input_buffers(4))[how]
    rebind()
    with pytest.raises(RebindError, match=f"{name!r} of width 4 was rebound"):
        runner.execute(4)
    with pytest.raises(RebindError, match=repr(name)):
        runner.run(batch.inputs)
    runner.execute(1)  # another width's buffers are untouched and still run


def test_copying_into_the_buffers_matches_eager_under_debug(monkeypatch):
    monkeypatch.setenv("CIRCUIT_DEBUG", "1")
    chain, params, cd = _build()
    batch = random_draft_batch(CFG, KV, 4, seed=2, num_drafts=K)
    want_states = batch.clone_states()
    want = EagerRunner(chain, params, want_states).run(batch.inputs)
    runner = ProgramRunner(cd, batch.clone_states())
    for name, dst in runner.input_buffers(4).items():
        dst.copy_(batch.inputs[name])
    runner.execute(4)
    for k, v in runner.output_buffers(4).items():
        assert torch.equal(v, want[k]), k


def test_no_check_at_level_zero(monkeypatch):
    """Level 0 checks nothing (the hot path); run() still copies into the bound views, so a
    replaced entry cannot make run() read stale inputs."""
    monkeypatch.setenv("CIRCUIT_DEBUG", "0")
    chain, params, cd = _build()
    batch = random_draft_batch(CFG, KV, 4, seed=4, num_drafts=K)
    want = EagerRunner(chain, params, batch.clone_states()).run(batch.inputs)
    runner = ProgramRunner(cd, batch.clone_states())
    runner.input_buffers(4)["tokens"] = torch.zeros(4, dtype=torch.int32)
    got = runner.run(batch.inputs)
    assert torch.equal(got["drafts"], want["drafts"])


@cuda
@pytest.mark.parametrize("how", ["replace", "remove", "swap"])
def test_graph_runner_catches_a_rebound_input_under_debug(monkeypatch, how):
    from draft_circuit.runners.cudagraph import GraphRunner
    monkeypatch.setenv("CIRCUIT_DEBUG", "1")
    _, _, cd = _build("cuda")
    batch = random_draft_batch(CFG, KV, 4, seed=1, num_drafts=K, device="cuda")
    runner = GraphRunner(cd, batch.clone_states())
    runner.run(batch.inputs)
    rebind, name = _rebinds(runner.input_buffers(4))[how]
    rebind()
    with pytest.raises(RebindError, match=repr(name)):
        runner.execute(4)
    runner.execute(1)


@cuda
def test_graph_runner_catches_a_moved_max_width_buffer(monkeypatch):
    from draft_circuit.runners.cudagraph import GraphRunner
    monkeypatch.setenv("CIRCUIT_DEBUG", "1")
    _, _, cd = _build("cuda")
    batch = random_draft_batch(CFG, KV, 4, seed=1, num_drafts=K, device="cuda")
    runner = GraphRunner(cd, batch.clone_states())
    runner.static_inputs["active"] = runner.static_inputs["active"].clone()
    with pytest.raises(RebindError, match="'active'"):
        runner.execute(1)
