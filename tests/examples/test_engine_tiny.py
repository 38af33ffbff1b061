"""The embedded default (examples/data/tiny, trained by examples/train_tiny.py): real acceptance
on held-out text, and the command line's three modes give the same tokens."""
from __future__ import annotations

import json

import pytest
import torch

from examples.engine.__main__ import main
from examples.engine.checkpoints import EMBEDDED, HELD_OUT_PROMPTS

pytestmark = pytest.mark.skipif(not (EMBEDDED / "model.safetensors").is_file(),
                                reason="the embedded checkpoint is not in this checkout")


def cli(tmp_path, capsys, *argv: str) -> dict:
    path = tmp_path / "summary.json"
    assert main([*argv, "--summary-json", str(path), "--threads", str(torch.get_num_threads())]) == 0
    out, _ = capsys.readouterr()
    summary = json.loads(path.read_text())
    summary["stdout"] = out
    return summary


def test_held_out_run_circuit_eager_and_target_only_agree(tmp_path, capsys):
    prompts = json.loads(HELD_OUT_PROMPTS.read_text())[:7]
    (tmp_path / "p.json").write_text(json.dumps(prompts))
    base = ("--prompts", str(tmp_path / "p.json"), "--max-new-tokens", "24", "--max-batch", "3")
    circuit = cli(tmp_path, capsys, *base, "--forward", "circuit", "--widths", "1,2,4")
    eager = cli(tmp_path, capsys, *base, "--forward", "eager")
    plain = cli(tmp_path, capsys, *base, "--no-speculation")
    ids = [r["generated"] for r in plain["requests_ids"]]
    assert [r["generated"] for r in circuit["requests_ids"]] == ids
    assert [r["generated"] for r in eager["requests_ids"]] == ids
    assert [r["prompt"] for r in plain["requests_ids"]] == [list(p.encode()) for p in prompts]
    # held-out text, k = 4: real acceptance (train_tiny.py reports the full measurement)
    assert circuit["mean_accepted_per_verify"] >= 1.5
    assert circuit["mean_accepted_per_verify"] == eager["mean_accepted_per_verify"]
    assert "mean accepted drafts per verify" in circuit["stdout"]
    assert "n=  3: " in circuit["stdout"] and "pad" in circuit["stdout"]  # 3 pads to 4


def test_empty_string_prompt_is_an_error(tmp_path, capsys):
    (tmp_path / "p.json").write_text(json.dumps(["def f(x):", ""]))
    assert main(["--prompts", str(tmp_path / "p.json"), "--threads", str(torch.get_num_threads())]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "prompt 1 is empty" in err
