"""CPU smoke test of benchmarks/proposer_host.py: every path runs a few steps at two widths and
write positive per-step and per-propose medians (the numbers themselves are never asserted)."""
import json

import pytest

from benchmarks import proposer_host


@pytest.mark.parametrize("path", proposer_host.PATHS)
def test_it_times_both_paths(tmp_path, path):
    out = tmp_path / "host.json"
    assert proposer_host.main(["--n", "1", "3", "--path", path, "--steps", "4", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["path"] == path and set(result["widths"]) == {"1", "3"}
    for r in result["widths"].values():
        assert 0 < r["propose_us"] <= r["step_us"]
        assert set(r["calls"]) == set(proposer_host.PATH_CALLS[path])
