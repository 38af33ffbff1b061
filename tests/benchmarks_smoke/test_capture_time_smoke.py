"""CPU smoke test of benchmarks/capture_time.py: `--dry-run` walks the tiny chain's precompile
under the interpreter and writes the precompile's phase timings; the parent's plan runs the warm
variants on the cache dir their config's cold "after" run filled (and every other group on a
fresh one), and its report line prints the phases (children stubbed: the numbers are the
H200 run's)."""
import json

from benchmarks import capture_time as ct

PHASES = {"key_s", "visit_s", "probe_s", "fork_s", "complete_s", "load_s"}


def test_dry_run_writes_the_precompile_phases(tmp_path):
    out = tmp_path / "ct.json"
    ct.main(["--dry-run", "--out", str(out)])
    got = json.loads(out.read_text())
    assert got["precompile_keys"] > 0 and got["precompile_launches"] > got["precompile_keys"]
    assert set(got["precompile_phases"]) == PHASES and got["precompile_phases"]["visit_s"] > 0


def test_plan_runs_warm_variants_on_the_cold_runs_cache():
    assert ct.plan(["small", "8b"], ["before", "after"], warm=False) == [
        ("small", ["before"]), ("small", ["after"]), ("8b", ["after"]), ("8b", ["before"])]
    assert ct.plan(["small", "8b"], ["after"], warm=True) == [
        ("small", ["after", "warm", "warm-unprobed"]), ("8b", ["after", "warm-unprobed", "warm"])]
    # warm without "after" asked for still runs it first: it fills the cache
    assert ct.plan(["small"], ["before"], warm=True) == [
        ("small", ["before"]), ("small", ["after", "warm", "warm-unprobed"])]


def _result(config, variant):
    return {"config": config, "variant": variant, "compile_s": 0.5, "precompile_s": 0.4,
            "precompile_kernels": 40, "precompile_keys": 55, "precompile_jobs": 40,
            "precompile_cached": 40 if variant == "warm" else 0, "precompile_children": 0,
            "precompile_threads": 16, "precompile_forked": True, "precompile_children_failed": 0,
            "precompile_phases": dict.fromkeys(PHASES, 0.05), "capture_wall_s": 0.7,
            "compile_plus_capture_s": 1.2, "capture_ms_sum": 250.0, "capture_ms": {1: 4.0},
            "pool_bytes_sum": 2**22, "arena_bytes": 2**23, "warmed_widths": [1], "failures": {},
            "replay_equals_program": {1: True}}


def test_main_shares_a_cache_dir_only_within_a_warm_group(tmp_path, monkeypatch, capsys):
    calls = []

    def child(config, variant, widths, timeout_s, cache):
        calls.append((config, variant, cache))
        return _result(config, variant)
    monkeypatch.setattr(ct, "_run_child", child)
    out = tmp_path / "ct.json"
    ct.main(["--configs", "small,8b", "--variants", "after", "--warm", "--out", str(out)])
    assert [(c, v) for c, v, _ in calls] == [
        ("small", "after"), ("small", "warm"), ("small", "warm-unprobed"),
        ("8b", "after"), ("8b", "warm-unprobed"), ("8b", "warm")]
    dirs = [d for _, _, d in calls]
    assert len(set(dirs[:3])) == 1 and len(set(dirs[3:])) == 1 and dirs[0] != dirs[3]
    assert len(json.loads(out.read_text())["results"]) == 6
    printed = capsys.readouterr().out
    assert "40 in the file cache" in printed and "fork 0.05" in printed and "visit 0.05" in printed
