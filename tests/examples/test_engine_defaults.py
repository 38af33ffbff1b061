"""The command line's draft length when --num-drafts is not given (issue 20): 3 on CPU, where a
verify's rows cost (the references' 8-row linear tiles and 4-row attention tiles), 4 on CUDA,
where they share one pass over the weights. The choice is measured, not asserted here
(`benchmarks/quickstart_cpu.py --versus "--num-drafts 4"`); this pins that the default reaches the
engine, that the flag still overrides it, and that the default's output is target-only greedy's
with both drafters."""
from __future__ import annotations

import json

import pytest
import torch

from examples.engine.__main__ import DEFAULT_NUM_DRAFTS, default_num_drafts, main, parser


def test_default_num_drafts_by_device():
    assert default_num_drafts("cpu") == DEFAULT_NUM_DRAFTS["cpu"] == 3
    assert default_num_drafts("cuda") == default_num_drafts("cuda:1") == DEFAULT_NUM_DRAFTS["cuda"] == 4
    assert parser().parse_args([]).num_drafts is None  # unset: chosen by --device in run()


def cli(tmp_path, *argv: str) -> dict:
    path = tmp_path / "summary.json"
    assert main([*argv, "--summary-json", str(path), "--quiet",
                 "--threads", str(torch.get_num_threads())]) == 0
    return json.loads(path.read_text())


@pytest.mark.parametrize("forward", ["circuit", "eager"])
def test_cpu_default_drafts_three_and_stays_exact(tmp_path, small_checkpoint, forward):
    base = ("--checkpoint", str(small_checkpoint), "--max-new-tokens", "10", "--max-batch", "3",
            "--widths", "1,2,4", "--forward", forward)
    info = cli(tmp_path, *base)
    assert info["num_drafts"] == 3
    assert info["outputs_identical"] is True  # the compare check ran and passed
    assert info["baseline"]["generated_tokens"] == info["generated_tokens"]
    assert cli(tmp_path, *base, "--num-drafts", "4")["num_drafts"] == 4
