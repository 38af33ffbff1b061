"""The command line's baseline (issue 20 item 2): a speculative run is followed by target-only
greedy on the same prompts in the same process; the summary carries both tokens/s and the
speedup, and outputs that differ are a loud error (exit 1), shown by injecting a wrong
acceptance."""
from __future__ import annotations

import json

import pytest
import torch

import examples.engine.engine as engine_module
from examples.engine.__main__ import main
from examples.engine.compare import OutputsDifferError, check_identical
from examples.engine.speculate import accept


def cli(tmp_path, *argv: str) -> tuple[int, dict | None]:
    path = tmp_path / "summary.json"
    code = main([*argv, "--summary-json", str(path), "--quiet", "--threads", str(torch.get_num_threads())])
    return code, json.loads(path.read_text()) if path.is_file() else None


def small_args(checkpoint) -> tuple[str, ...]:
    return ("--checkpoint", str(checkpoint), "--max-new-tokens", "12", "--max-batch", "3",
            "--widths", "1,2,4")


def test_summary_carries_the_baseline_and_the_speedup(tmp_path, small_checkpoint, capsys):
    code, info = cli(tmp_path, *small_args(small_checkpoint))
    out = capsys.readouterr().out
    assert code == 0 and info is not None
    base = info["baseline"]
    assert base["mode"] == "target only" and base["generated_tokens"] == info["generated_tokens"]
    assert base["tokens_per_s"] > 0 and info["outputs_identical"] is True
    assert info["speedup"] == pytest.approx(info["tokens_per_s"] / base["tokens_per_s"], rel=1e-2)
    # and in process CPU time (the steadier measure on a shared CPU)
    assert info["cpu_s"] > 0 and base["cpu_s"] > 0
    assert info["cpu_speedup"] == pytest.approx(base["cpu_s"] / info["cpu_s"], rel=1e-2)
    assert f"(in CPU time {info['cpu_speedup']:.2f}x)" in out
    assert "target only (same prompts, same process)" in out and "outputs identical; speedup" in out


def test_no_compare_and_no_speculation_run_once(tmp_path, small_checkpoint, capsys):
    for flag in ("--no-compare", "--no-speculation"):
        code, info = cli(tmp_path, *small_args(small_checkpoint), flag)
        assert code == 0 and info is not None
        assert "baseline" not in info and "speedup" not in info, flag
    assert "target only (same prompts" not in capsys.readouterr().out


def test_a_wrong_acceptance_is_a_loud_error(tmp_path, small_checkpoint, capsys, monkeypatch):
    """One draft more than the target agreed with, every verify: the speculative output is no
    longer the target's, and the command says so instead of printing a summary."""
    monkeypatch.setattr(engine_module, "accept", lambda d, t: min(len(d), accept(d, t) + 1))
    code, info = cli(tmp_path, *small_args(small_checkpoint))
    captured = capsys.readouterr()
    assert code == 1 and info is None, "nothing is saved"
    assert "error: request " in captured.err
    assert "differs from target-only greedy decoding at generated token" in captured.err
    assert "tokens/s" not in captured.out


def test_check_identical_names_the_first_difference():
    check_identical([[1, 2], [3]], [[1, 2], [3]])
    with pytest.raises(OutputsDifferError, match=r"request 1: .* at generated token 2: 9 where "
                                                 r"the target alone gives 5"):
        check_identical([[1], [4, 4, 9]], [[1], [4, 4, 5]])
    with pytest.raises(OutputsDifferError, match=r"request 0: .* token 1: the end where the target alone gives 2"):
        check_identical([[1]], [[1, 2]])
    with pytest.raises(OutputsDifferError, match="2 outputs, target-only greedy 1"):
        check_identical([[1], [2]], [[1]])
