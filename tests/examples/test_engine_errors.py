"""Bad input through the command line: each is a clear error (exit status 2, `error: ...` on
stderr) before any generation; nothing is printed as a result and no summary is written."""
from __future__ import annotations

import dataclasses
import json

import pytest

from examples.engine.__main__ import main
from draft_circuit.circuit.layers.checkpoint import write_random_checkpoint
from tests.examples.helpers import SMALL


@pytest.fixture(scope="module")
def no_mtp_checkpoint(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp("nomtp") / "ck",
                                   dataclasses.replace(SMALL, num_nextn_predict_layers=0), seed=4)


def run_cli(capsys, tmp_path, argv: list[str], prompts=None) -> tuple[int, str, str]:
    if prompts is not None:
        (tmp_path / "prompts.json").write_text(json.dumps(prompts))
        argv = [*argv, "--prompts", str(tmp_path / "prompts.json")]
    summary = tmp_path / "summary.json"
    code = main([*argv, "--summary-json", str(summary), "--threads", "0"])
    out, err = capsys.readouterr()
    if code != 0:
        assert not summary.exists(), "a failed run must not leave a summary behind"
    return code, out, err


@pytest.mark.parametrize("prompts,message", [
    ([[1, 2, 3], [4, 256, 5]], "token 256 at index 1 is outside the vocabulary [0, 256)"),
    ([[1, 2, 3], [-1]], "token -1 at index 0 is outside the vocabulary"),
    ([[1, 2], []], "prompt 1 is empty"),
    ([[1, 2], "hello"], "has no tokenizer the engine can run"),
    ([[1, 2], {"ids": [1]}], "expected a string or a list of token ids"),
    ([], "expected a non-empty JSON list"),
])
def test_bad_prompts(capsys, tmp_path, small_checkpoint, prompts, message):
    code, out, err = run_cli(capsys, tmp_path, ["--checkpoint", str(small_checkpoint)], prompts)
    assert code == 2 and out == ""
    assert message in err and err.startswith("error: ")


def test_max_batch_beyond_the_kv_pool(capsys, tmp_path, small_checkpoint):
    # each request needs ceil((30 + 40 + 4) / 16) = 5 blocks; 31 usable blocks hold 6 of them
    code, out, err = run_cli(capsys, tmp_path, ["--checkpoint", str(small_checkpoint),
                                                "--kv-blocks", "32", "--max-batch", "8",
                                                "--max-new-tokens", "40"], [[7] * 30, [1, 2]])
    assert code == 2 and out == ""
    assert "--max-batch 8 needs 8 x 5 KV blocks" in err and "at most 6 such sequences fit" in err


def test_checkpoint_without_mtp_layer(capsys, tmp_path, no_mtp_checkpoint):
    code, out, err = run_cli(capsys, tmp_path, ["--checkpoint", str(no_mtp_checkpoint)], [[1, 2, 3]])
    assert code == 2 and out == ""
    assert "no MTP layer to draft with" in err and "--draft-checkpoint" in err
    # the same checkpoint runs target-only
    code, out, err = run_cli(capsys, tmp_path, ["--checkpoint", str(no_mtp_checkpoint),
                                                "--no-speculation", "--max-new-tokens", "3"],
                             [[1, 2, 3]])
    assert code == 0 and "target only" in out


@pytest.mark.parametrize("argv,message", [
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--draft-confidence-stop", "1.5"], "--draft-confidence-stop must be in (0, 1) exclusive"),
    (["--draft-confidence-stop", "1"], "--draft-confidence-stop must be in (0, 1) exclusive"),
    (["--draft-confidence-stop", "0"], "--draft-confidence-stop must be in (0, 1) exclusive"),
    (["--draft-confidence-stop", "nan"], "--draft-confidence-stop must be in (0, 1) exclusive"),
    (["--num-drafts", "0"], "--num-drafts must be >= 1"),
    (["--checkpoint", "/nonexistent/dir"], "config.json not found"),
])
def test_bad_settings(capsys, tmp_path, small_checkpoint, argv, message):
    argv = argv if "--checkpoint" in argv else ["--checkpoint", str(small_checkpoint), *argv]
    code, out, err = run_cli(capsys, tmp_path, argv, [[1, 2, 3]])
    assert code == 2 and out == "" and message in err


def test_summary_json_holds_every_request(capsys, tmp_path, small_checkpoint):
    prompts = [[5, 6, 7, 8], [9], [10, 11]]
    code, out, err = run_cli(capsys, tmp_path, ["--checkpoint", str(small_checkpoint),
                                                "--max-new-tokens", "5", "--widths", "1,2"], prompts)
    assert code == 0, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["prompt"] for r in summary["requests_ids"]] == prompts
    assert all(len(r["generated"]) == 5 for r in summary["requests_ids"])
    assert summary["generated_tokens"] == 15 and summary["mean_accepted_per_verify"] is not None
    assert "tokens/s" in out and "mean accepted drafts per verify" in out
