"""benchmarks/proposer_host.py --against: the side-by-side mode runs this checkout's measure and
another checkout's (here the same one, in its worker process) in turn and reports both sides'
median and best round a width (the numbers themselves are never asserted)."""
import json
from pathlib import Path

from benchmarks import proposer_host


def test_against_measures_both_sides_in_turn(tmp_path):
    root = Path(proposer_host.__file__).resolve().parents[1]
    out = tmp_path / "ab.json"
    assert proposer_host.main(["--n", "1", "3", "--steps", "4", "--rounds", "2",
                               "--against", str(root), "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["against"] == str(root) and set(result["widths"]) == {"this", "against"}
    for side in result["widths"].values():
        assert set(side) == {"1", "3"}
        for r in side.values():
            assert 0 < r["best_us"] <= r["step_us"]
