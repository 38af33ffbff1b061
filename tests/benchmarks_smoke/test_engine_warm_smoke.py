"""benchmarks/engine_warm.py on CPU: both engines run generate twice on the same prompts, every
run timed and its outputs checked against target-only's; a run without speculation is refused."""
import pytest

from benchmarks import engine_warm
from examples.engine.engine import Engine


def test_each_engine_runs_twice_and_every_run_equals_target_only():
    step, generate = Engine.step, Engine.generate
    got = engine_warm.measure(["--quiet", "--max-new-tokens", "3"], runs=2)
    assert Engine.step is step and Engine.generate is generate  # the step timers are undone
    assert got["outputs_identical"] is True
    for name in ("speculation", "baseline"):
        assert len(got[name]) == 2
        for run in got[name]:
            assert run["tokens"] == 12 * 3  # the 12 default prompts, 3 tokens each
            assert run["steps"] >= 1 and run["first_step_ms"] > 0 and run["wall_ms"] > 0
    assert got["speedup"] == [pytest.approx(s["tokens_per_s"] / b["tokens_per_s"], rel=1e-2)
                              for s, b in zip(got["speculation"], got["baseline"])]


def test_a_run_without_speculation_or_a_single_run_is_refused():
    with pytest.raises(SystemExit, match="no-speculation"):
        engine_warm.measure(["--quiet", "--no-speculation"], runs=2)
    with pytest.raises(SystemExit):
        engine_warm.main(["--runs", "1", "--", "--quiet"])
