"""benchmarks/engine_steps.py on CPU: the quick start's two engines at a few tokens, every step
timed and counted once, the summary's sums consistent, and the wrappers undone after."""
import pytest

from benchmarks import engine_steps
from examples.engine.engine import Engine


def test_steps_of_both_engines_are_timed_and_the_wrappers_undone():
    step, generate = Engine.step, Engine.generate
    got = engine_steps.measure(["--quiet", "--max-new-tokens", "4"])
    assert Engine.step is step and Engine.generate is generate
    assert got["outputs_identical"] is True
    for name in ("speculation", "baseline"):
        d = got[name]
        assert d["steps"] == sum(w["steps"] for w in d["by_width"].values()) > 0
        assert d["steps_ms"] == pytest.approx(sum(w["ms"] for w in d["by_width"].values()), abs=0.1)
        assert d["steps_ms"] <= d["wall_ms"] + 1.0  # inside generate's wall (rounded to the ms)
        assert d["tokens"] == 12 * 4  # the 12 default prompts, 4 tokens each
        assert all(s["ms"] > engine_steps.SLOW * d["median_step_ms"] for s in d["slow_steps"])
    spec, base = got["speculation"], got["baseline"]
    rate = ((spec["tokens_per_step"] / spec["median_step_ms"])
            / (base["tokens_per_step"] / base["median_step_ms"]))
    assert got["median_speedup"] == pytest.approx(rate, rel=1e-2)


def test_a_run_without_its_baseline_is_refused():
    with pytest.raises(SystemExit, match="baseline"):
        engine_steps.measure(["--quiet", "--max-new-tokens", "2", "--no-compare"])
    assert Engine.step.__name__ == "step"


def test_an_engines_warm_up_is_not_one_of_its_runs():
    """With the warm-up on (CUDA's default; forced here), each engine's dummy generate at
    construction is not recorded: two runs, each stepping as without it."""
    got = engine_steps.measure(["--quiet", "--max-new-tokens", "4", "--warm-up"])
    cold = engine_steps.measure(["--quiet", "--max-new-tokens", "4"])
    for name in ("speculation", "baseline"):
        assert got[name]["steps"] == cold[name]["steps"]
        assert got[name]["tokens"] == cold[name]["tokens"] == 12 * 4
