"""`circuit plan|viz`: every bad value is one `error:` line and exit 2 before any work (FAULTS 32),
and a bad report file is named in the one line (FAULTS 14 of issue 19's list)."""
from __future__ import annotations

import json

import pytest

from draft_circuit.circuit.cli import main
from draft_circuit.circuit.report import PlanReport, ReportError


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str], *words: str) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("circuit ") and "error:" in err[-1], err
    for w in words:
        assert w in err[-1], (w, err[-1])
    return err[-1]


@pytest.mark.parametrize("flags,words", [
    (["--block-size", "0"], ["--block-size", "got 0"]),
    (["--bandwidth-gbps", "0"], ["--bandwidth-gbps"]),
    (["--bandwidth-gbps", "nan"], ["--bandwidth-gbps"]),
    (["--device", "tpu"], ["device", "'tpu'"]),
    (["--device", "cuda:x"], ["device"]),
    (["--kv-rows", "-5"], ["--kv-rows", "-5"]),
    (["--max-kv-rows", "0"], ["--max-kv-rows"]),
    (["--num-drafts", "10000"], ["--num-drafts", "1..64"]),
    (["--num-drafts", "0"], ["--num-drafts"]),
    (["--num-drafts", "2.5"], ["--num-drafts", "integer"]),
    (["--widths", "1,2,5000"], ["width", "5000"]),
    (["--widths", "0"], ["width"]),
    (["--widths", ","], ["widths"]),
    (["--num-drafts", "8", "--max-kv-rows", "4"], ["--num-drafts 8", "--max-kv-rows 4"]),
])
def test_plan_refuses_bad_values_in_one_line(flags, words, capsys):
    _fails(["plan", *flags], capsys, *words)


def test_plan_refuses_an_unwritable_json_path_before_compiling(tmp_path, capsys):
    _fails(["plan", "--json", str(tmp_path / "missing" / "plan.json")], capsys, "cannot write")
    _fails(["plan", "--json", str(tmp_path)], capsys, "directory")


def test_viz_report_refuses_compile_flags(tmp_path, capsys):
    _fails(["viz", "--report", str(tmp_path / "r.json"), "--widths", "1,2", "--num-drafts", "3",
            "--out", str(tmp_path / "o")], capsys, "--widths", "--num-drafts")


@pytest.mark.parametrize("text,words", [
    ('{"schema_version": 1, "circuit": 3', ["not a readable JSON"]),
    ("[1, 2]", ["JSON object", "list"]),
    ('"plan"', ["JSON object", "str"]),
    ("null", ["JSON object", "NoneType"]),
    ('{"schema_version": 7}', ["schema_version 7"]),
    ('{"schema_version": 1}', ["invalid plan report", "Field required"]),
    ("[" * 100000 + "]" * 100000, ["not a readable JSON"]),
])
def test_viz_names_the_bad_report_file(tmp_path, capsys, text, words):
    path = tmp_path / "broken.json"
    path.write_text(text)
    assert main(["viz", "--report", str(path), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "broken.json" in err, err
    for w in words:
        assert w in err, (w, err)


def test_viz_names_a_missing_report_file(tmp_path, capsys):
    assert main(["viz", "--report", str(tmp_path / "nope.json"), "--out", str(tmp_path)]) == 2
    assert "nope.json" in capsys.readouterr().err


def test_inconsistent_report_is_one_line_not_a_traceback(tmp_path, capsys):
    good = tmp_path / "plan.json"
    assert main(["plan", "--widths", "1", "--num-drafts", "1", "--json", str(good)]) == 0
    data = json.loads(good.read_text())
    data["widths"][0]["schedule"][0]["node"] = "no-such-node"
    data["nodes"] = data["nodes"][1:]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    capsys.readouterr()
    code = main(["viz", "--report", str(bad), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    if code == 0:  # the page may render a report with a node missing; then it must say nothing
        assert err == ""
    else:
        assert code == 2 and "bad.json" in err and "Traceback" not in err


def test_report_width_lookup_is_a_typed_error():
    report = PlanReport.from_json(_small_report())
    with pytest.raises(ReportError, match="no width 3"):
        report.width(3)


def _small_report() -> str:
    import io
    import contextlib
    import tempfile
    from pathlib import Path
    with tempfile.TemporaryDirectory() as d, contextlib.redirect_stdout(io.StringIO()):
        path = Path(d) / "p.json"
        assert main(["plan", "--widths", "1,2", "--num-drafts", "1", "--json", str(path)]) == 0
        return path.read_text()
