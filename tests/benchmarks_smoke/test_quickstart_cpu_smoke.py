"""CPU smoke test of benchmarks/quickstart_cpu.py: two short repeats of the quick start run end to
end, each with its baseline, and the JSON carries every repeat's speedups and their medians (how
fast anything is, is the benchmark's business, not this test's)."""
import json

import pytest
import torch

from benchmarks import quickstart_cpu as qs


def test_two_short_repeats_write_their_speedups_and_medians(tmp_path):
    threads = torch.get_num_threads()
    out = tmp_path / "qs.json"
    try:
        assert qs.main(["--repeats", "2", "--out", str(out), "--", "--max-new-tokens", "3"]) == 0
    finally:
        torch.set_num_threads(threads)  # the engine sets its own thread count
    got = json.loads(out.read_text())
    assert got["engine_args"] == ["--forward", "circuit", "--max-new-tokens", "3"]
    assert len(got["repeats"]) == 2
    for r in got["repeats"]:
        assert r["cpu_speedup"] == pytest.approx(r["baseline_cpu_s"] / r["cpu_s"], rel=2e-2)
        assert r["speedup"] > 0 and r["tokens_per_s"] > 0 and r["baseline_tokens_per_s"] > 0
    for key, field in (("median_speedup", "speedup"), ("median_cpu_speedup", "cpu_speedup")):
        values = [r[field] for r in got["repeats"]]
        assert min(values) <= got[key] <= max(values)
