"""benchmarks/engine_timeline.py: the idle-time attribution on a hand-made trace (exact numbers),
and a CPU run of the quick start's engine under the profiler with the wrappers undone after."""
import pytest

from benchmarks import engine_timeline as tl
from draft_circuit.runners.proposer import MtpProposer
from examples.engine.engine import Engine


def _x(name, ts, dur, cat="user_annotation"):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat}


def test_idle_gpu_time_is_charged_to_the_innermost_host_phase():
    events = [
        _x(tl.STEP, 0, 100), _x("engine._decode", 0, 60), _x("target.forward", 5, 40),
        _x("engine._end_step", 60, 40), _x("proposer.step_batch", 70, 30),
        _x("k1", 10, 30, "kernel"), _x("k2", 20, 10, "kernel"),   # busy 10..40 (union)
        _x("k3", 90, 20, "kernel"),                              # busy 90..100 inside the step
        _x("cudaGraphLaunch", 85, 4, "cuda_runtime"),
        _x("cudaMalloc", 120, 9, "cuda_runtime"), _x("setup", 130, 5, "kernel"),  # after the step
    ]
    got = tl.reduce_trace(events)
    assert got["steps"] == 1 and got["step_wall_us"] == 100
    assert got["step_gpu_busy_us"] == 40 and got["step_gpu_idle_us"] == 60
    # idle 0..10: forward covers 5..10 (innermost), _decode 0..5; 40..45 forward; 45..60
    # _decode; 60..70 _end_step; 70..90 step_batch
    assert got["idle_under_us_per_step"] == {"proposer.step_batch": 20.0, "engine._decode": 20.0,
                                            "target.forward": 10.0, "engine._end_step": 10.0}
    assert got["runtime_per_step"] == {"cudaGraphLaunch": {"calls": 1.0, "host_us": 4.0}}
    assert got["kernels_per_step"] == 3  # k1, k2, k3; not the kernel after the step


def test_gpu_time_is_charged_to_the_phase_that_launched_it():
    """A kernel's time goes to the innermost phase its launch (same correlation id) ran in,
    wherever the kernel itself runs (a graph's kernels after the host moved on)."""
    def corr(ev, c):
        ev["args"] = {"correlation": c}
        return ev
    events = [
        _x(tl.STEP, 0, 100), _x("target.launch_verify", 0, 20), _x("proposer.step_ahead", 20, 50),
        _x("ahead.catchup", 25, 10),
        corr(_x("cudaGraphLaunch", 5, 3, "cuda_runtime"), 1),
        corr(_x("cudaGraphLaunch", 27, 3, "cuda_runtime"), 2),
        corr(_x("cudaLaunchKernel", 50, 2, "cuda_runtime"), 3),
        corr(_x("verify_a", 10, 30, "kernel"), 1), corr(_x("verify_b", 40, 10, "kernel"), 1),
        corr(_x("catchup", 50, 8, "kernel"), 2), corr(_x("pack", 60, 4, "gpu_memcpy"), 3),
    ]
    reduced = tl.reduce_trace(events)
    got = reduced["gpu_us_per_step_by_phase"]
    assert got == {"target.launch_verify": 40.0, "ahead.catchup": 8.0, "proposer.step_ahead": 4.0}
    assert reduced["gpu_kernels_by_phase"] == {
        "target.launch_verify": {"verify_a": [30.0, 1.0], "verify_b": [10.0, 1.0]},
        "ahead.catchup": {"catchup": [8.0, 1.0]}, "proposer.step_ahead": {"pack": [4.0, 1.0]}}


def test_union_and_gaps():
    busy = tl.union([(5, 7), (1, 3), (2, 4)])
    assert busy == [(1, 4), (5, 7)]
    assert tl.idle_gaps(busy, [b[0] for b in busy], 0, 8) == [(0, 1), (4, 5), (7, 8)]
    assert tl.overlap(busy, [b[0] for b in busy], 3, 6) == 2


@pytest.mark.parametrize("warm_up", [[], ["--warm-up"]])
def test_cpu_run_reports_both_modes_and_undoes_the_wrappers(tmp_path, warm_up):
    """Each engine's run, once: with the warm-up on (CUDA's default; forced here) its dummy
    generate at construction is not one of them."""
    generate, step_batch, step = Engine.generate, MtpProposer.step_batch, Engine.step
    got = tl.main(["--out", str(tmp_path / "t.json"), "--", "--max-new-tokens", "4", "--quiet",
                   *warm_up])
    assert [g["mode"] for g in got] == ["speculation", "target-only"]
    for g in got:
        assert g["steps"] > 0 and g["step_wall_us"] > 0
        assert "target.forward" in g["phase_us_median"]
    assert Engine.generate is generate and MtpProposer.step_batch is step_batch
    assert Engine.step is step


def test_the_innermost_phase_is_found_however_many_phases_came_before():
    """A launch inside an outer phase that opened 100 short phases earlier is the outer's; a
    child that opens at its parent's instant is the innermost while it runs."""
    phases = [(0.0, 1000.0, "outer")] + [(1.0 + i, 1.5 + i, f"short{i}") for i in range(100)]
    phases += [(500.0, 600.0, "parent"), (500.0, 550.0, "child")]
    got = tl.innermost(phases, [0.5, 50.2, 200.0, 500.0, 560.0, 700.0, 2000.0])
    assert got == ["outer", "short49", "outer", "child", "parent", "outer", tl.STEP]
