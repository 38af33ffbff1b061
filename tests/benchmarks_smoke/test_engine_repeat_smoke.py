"""CPU smoke test of benchmarks/engine_repeat.py: two engines in one process on the embedded
default, every target pass and proposer call timed under its phase, the wrappers undone after."""
import json

from benchmarks import engine_repeat as er
from draft_circuit.runners.proposer import MtpProposer
from examples.engine import model as target_model


def test_two_repeats_time_the_passes_and_undo_the_wrappers(tmp_path):
    forward, propose = target_model.TargetModel.forward, MtpProposer.propose_batch
    out = tmp_path / "r.json"
    got = er.main(["--repeats", "2", "--out", str(out), "--", "--max-new-tokens", "3", "--quiet"])
    assert [r["repeat"] for r in got] == [0, 1] and all(r["rc"] == 0 for r in got)
    for r in got:
        phases = {p["phase"]: p for p in r["phases"]}
        assert any(k.startswith("target.forward[") for k in phases)
        assert phases["proposer.propose_batch"]["calls"] > 0  # CPU: the host-returning path
        assert all(p["ms"] >= 0 and p["calls"] > 0 for p in r["phases"])
    assert json.loads(out.read_text())[1]["tokens_per_s"] == got[1]["tokens_per_s"]
    assert target_model.TargetModel.forward is forward and MtpProposer.propose_batch is propose
