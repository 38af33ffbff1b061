"""CPU smoke test of benchmarks/guard_cost.py: `--dry-run` builds the guarded and unguarded
program runners on a tiny chain, runs both and writes its JSON; without a GPU and without
`--dry-run` it refuses with one error line and exit 2 (the numbers are the H200 run's)."""
import json

import torch

from benchmarks import guard_cost


def test_dry_run_writes_both_variants(tmp_path):
    out = tmp_path / "guard.json"
    assert guard_cost.main(["--dry-run", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["goal_us"] == guard_cost.GOAL_US == 2.0
    host = result["configs"]["dry"]["widths"]["2"]["host_us"]
    assert set(host) == {"guard", "no_guard"} and all(v > 0 for v in host.values())


def test_without_a_gpu_it_refuses_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert guard_cost.main(["--out", str(tmp_path / "g.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:") and not (tmp_path / "g.json").exists()
