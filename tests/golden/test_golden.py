"""Golden files: the default MTP chain that `circuit plan` compiles, printed before and after the
pass pipeline, and its plan report JSON at widths 1 and 8 on CPU. A change to any of them shows
in review as a diff of these files.

Regenerate them (then read the diff before committing) with the one command:

    python3 -m pytest -q -p no:cacheprovider tests/golden --regen-golden

The report carries each node's origin (its layer file:line), so moving a line of
circuit/layers/mtp.py changes plan_cpu_w1_w8.json; the fingerprint and printed circuits do not.
"""
import argparse
import difflib
from pathlib import Path

import pytest

from draft_circuit.circuit.cli import CHAIN_DEFAULTS, compile_chain, fill_chain_defaults, main

HERE = Path(__file__).parent
WIDTHS = [1, 8]
REGEN = "python3 -m pytest -q -p no:cacheprovider tests/golden --regen-golden"


@pytest.fixture(scope="module")
def texts(tmp_path_factory) -> dict[str, str]:
    """Golden file name -> the text the code makes today."""
    report = tmp_path_factory.mktemp("golden") / "plan.json"
    argv = ["plan", "--widths", ",".join(map(str, WIDTHS)), "--device", "cpu",
            "--json", str(report)]
    assert main(argv) == 0
    # the same defaults the command fills in, for the circuits it compiled
    args = argparse.Namespace(checkpoint=None, report=None,
                              **{k: None for k in CHAIN_DEFAULTS})
    args.widths, args.device = WIDTHS, "cpu"
    fill_chain_defaults(argparse.ArgumentParser(), args)
    compiled = compile_chain(args)
    assert compiled.report().to_json() == report.read_text()  # it is the command's chain
    return {"mtp_chain.txt": str(compiled.source) + "\n",
            "mtp_chain_after_passes.txt": str(compiled.circuit) + "\n",
            "plan_cpu_w1_w8.json": report.read_text()}


@pytest.mark.parametrize("name", ["mtp_chain.txt", "mtp_chain_after_passes.txt",
                                  "plan_cpu_w1_w8.json"])
def test_matches_golden(texts, name, request):
    path = HERE / name
    if request.config.getoption("--regen-golden"):
        path.write_text(texts[name], encoding="utf-8")
        return
    assert path.is_file(), f"{path} is missing; run: {REGEN}"
    want = path.read_text(encoding="utf-8")
    if texts[name] != want:
        diff = "".join(list(difflib.unified_diff(
            want.splitlines(keepends=True), texts[name].splitlines(keepends=True),
            f"golden/{name}", "today"))[:80])
        pytest.fail(f"{name} differs from the golden file (if intended, run: {REGEN}):\n{diff}")


def test_report_is_byte_identical_across_hash_seeds(tmp_path):
    """Regression: an arena buffer's values were listed in set order, which moves with
    PYTHONHASHSEED, so the same plan gave different JSON in different processes."""
    import os
    import subprocess
    import sys

    code = ("import sys; from draft_circuit.circuit.cli import main; "
            "sys.exit(main(['plan', '--widths', '1,8', '--device', 'cpu', '--json', sys.argv[1]]))")
    texts = []
    for seed in ("1", "2"):
        out = tmp_path / f"plan{seed}.json"
        env = dict(os.environ, PYTHONHASHSEED=seed)
        subprocess.run([sys.executable, "-c", code, str(out)], check=True, env=env,
                       cwd=HERE.parents[1], capture_output=True)
        texts.append(out.read_text())
    assert texts[0] == texts[1]
