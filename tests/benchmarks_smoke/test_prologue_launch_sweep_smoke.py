"""CPU smoke test of benchmarks/prologue_launch_sweep.py: the dry run (interpreted kernels, tiny
shapes) compares each candidate's bits with the base Launch's and picks a best."""
import json
import subprocess
import sys


def test_dry_run_checks_bits_and_picks_a_best(tmp_path):
    out = tmp_path / "sweep.json"
    got = subprocess.run([sys.executable, "-m", "benchmarks.prologue_launch_sweep", "--dry-run",
                          "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stderr[-2000:]
    assert "best eh_proj:" in got.stdout
    data = json.loads(out.read_text())
    rows = data["eh_proj"]
    assert {"base", "plain"} <= set(rows) and data["errors"] == []
    # every Launch candidate, the committed one included, gives the base's bits, alone too
    cells = [c for name, row in rows.items() if name != "plain" for c in row.values()
             if isinstance(c, dict) and "same_bits" in c]
    assert cells and all(c["same_bits"] is True and c["row_alone"] is True for c in cells)
