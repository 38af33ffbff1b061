"""CPU smoke test of benchmarks/engine_repeat.py: two engines in one process on the embedded
default, every target pass and proposer call timed under its phase, the wrappers undone after."""
import json
import threading
import time

from benchmarks import engine_repeat as er
from draft_circuit.runners.proposer import MtpProposer
from examples.engine import model as target_model
from examples.engine.engine import Engine


def test_two_repeats_time_the_passes_and_undo_the_wrappers(tmp_path):
    forward, propose = target_model.TargetModel.forward, MtpProposer.propose_batch
    generate = Engine.generate
    out = tmp_path / "r.json"
    got = er.main(["--repeats", "2", "--out", str(out), "--", "--max-new-tokens", "3", "--quiet"])
    assert [r["repeat"] for r in got] == [0, 1] and all(r["rc"] == 0 for r in got)
    for r in got:
        phases = {p["phase"]: p for p in r["phases"]}
        assert any(k.startswith("target.forward[") for k in phases)
        assert phases["proposer.propose_batch"]["calls"] > 0  # CPU: the host-returning path
        assert all(p["ms"] >= 0 and p["calls"] > 0 and p["cpu_ms"] >= 0 for p in r["phases"])
        # the threads' CPU during generate: on Linux the main thread is among them, and busy
        [g] = r["generate"]
        main = threading.main_thread().native_id
        assert [t["python"] for t in g["threads"] if t["tid"] == main] == ["MainThread"]
        assert next(t for t in g["threads"] if t["tid"] == main)["cpu_s"] > 0
    assert json.loads(out.read_text())[1]["tokens_per_s"] == got[1]["tokens_per_s"]
    assert target_model.TargetModel.forward is forward and MtpProposer.propose_batch is propose
    assert Engine.generate is generate


def test_busy_threads_names_a_spinning_thread():
    """A Python thread that spins between two readings is listed by its name, with CPU time."""
    stop = threading.Event()
    spinner = threading.Thread(target=lambda: [None for _ in iter(lambda: stop.is_set(), True)],
                               name="spinner")
    before = er.thread_cpu()
    spinner.start()
    try:
        time.sleep(0.3)
        rows = er.busy_threads(before, er.thread_cpu(), 0.3)  # read while it spins
    finally:
        stop.set()
        spinner.join()
    assert rows[0]["python"] == "spinner" and rows[0]["cpu_s"] >= 0.05


def test_profile_mode_records_the_profiled_ops_and_undoes_the_wrapper():
    """--profile: no timers, each generate under torch.profiler; its busiest ops are listed (on
    CPU there are no CUDA runtime calls, so `runtime` is empty), and generate is restored."""
    generate = Engine.generate
    got = er.main(["--repeats", "1", "--profile", "--", "--max-new-tokens", "2", "--quiet"])
    [r] = got
    assert r["rc"] == 0 and r["phases"] == []
    [g] = r["generate"]
    assert g["wall_s"] > 0 and g["runtime"] == {}
    assert g["top_self_cpu"] and all(calls > 0 for _, calls, _ in g["top_self_cpu"])
    assert Engine.generate is generate


def test_a_warm_up_adds_no_phase_calls():
    """With the warm-up on (CUDA's default; forced here) the repeat's phases count its own run
    only: the same calls as without it."""
    def calls(extra):
        [r] = er.main(["--repeats", "1", "--", "--max-new-tokens", "3", "--quiet", *extra])
        return {p["phase"]: p["calls"] for p in r["phases"]}, len(r["generate"])
    assert calls(["--warm-up"]) == calls([])
