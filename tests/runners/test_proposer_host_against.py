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


def test_against_path_runs_the_other_side_on_its_own_path(tmp_path):
    """--path step --against-path device: this side times step_batch, the other the separate
    calls it stands for (each side's calls are its own path's)."""
    root = Path(proposer_host.__file__).resolve().parents[1]
    out = tmp_path / "ab.json"
    assert proposer_host.main(["--n", "2", "--steps", "4", "--rounds", "1", "--path", "step",
                               "--against", str(root), "--against-path", "device",
                               "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["path"] == "step" and result["against_path"] == "device"
    this, other = result["widths"]["this"]["2"], result["widths"]["against"]["2"]
    assert "step_batch_us" in this and "catchup_us" not in this
    assert "catchup_us" in other and "step_batch_us" not in other
