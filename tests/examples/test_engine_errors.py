"""Bad input through the command line: each is a clear error (exit status 2, one `error: ...`
line on stderr) before any generation; nothing is printed as a result and no summary is written.
Flags are refused by argparse (its usage lines, then the one error line) before anything loads."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from examples.engine.__main__ import main
from draft_circuit.circuit.layers.checkpoint_writer import write_random_checkpoint
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
    # --threads at torch's current count: the test leaves the process's threads as they are
    try:
        code = main(["--summary-json", str(summary), "--threads", str(torch.get_num_threads()),
                     *argv])
    except SystemExit as e:  # argparse refused a flag (it exits 2 itself)
        code = e.code
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
    (["--checkpoint", "/nonexistent/dir"], "--checkpoint /nonexistent/dir: does not exist"),
])
def test_bad_settings(capsys, tmp_path, small_checkpoint, argv, message):
    argv = argv if "--checkpoint" in argv else ["--checkpoint", str(small_checkpoint), *argv]
    code, out, err = run_cli(capsys, tmp_path, argv, [[1, 2, 3]])
    assert code == 2 and out == "" and message in err
    assert "config=" not in err  # the Python loader's argument is not a flag


def _error_lines(err: str) -> list[str]:
    return [line for line in err.splitlines() if "error:" in line]


@pytest.mark.parametrize("argv,message", [
    (["--device", "banana"], "device must be one of cpu, cuda (or cuda:N), got 'banana'"),
    (["--device", "cuda:x"], "device must be one of cpu, cuda"),
    (["--kv-blocks", "0"], "--kv-blocks must be >= 2, got 0"),
    (["--max-rows", "0"], "--max-rows must be >= 1, got 0"),
    (["--max-batch", "0"], "--max-batch must be >= 1, got 0"),
    (["--threads", "0"], "--threads must be >= 1, got 0"),
    (["--max-new-tokens", "1.5"], "--max-new-tokens must be an integer, got '1.5'"),
    (["--num-drafts", "10000"], "--num-drafts must be <= 64, got 10000: the draft chain unrolls"),
    (["--widths", "1,2,500"], "--widths: width 500 is past 64: the engine drafts at most "
                              "--max-batch 4 sequences at once"),
    (["--widths", "1,0"], "each width must be in 1..1024, got 0"),
    (["--summary-json", "/nonexistent/dir/s.json"], "cannot write '/nonexistent/dir/s.json'"),
])
def test_bad_flags_are_one_error_line_before_any_work(capsys, tmp_path, monkeypatch, argv, message):
    import examples.engine.__main__ as cli

    def no_work(*args, **kwargs):
        raise AssertionError("a bad flag must be refused before the checkpoint loads")
    monkeypatch.setattr(cli, "load_checkpoint", no_work)
    code, out, err = run_cli(capsys, tmp_path, argv)
    assert code == 2 and out == ""
    assert len(_error_lines(err)) == 1 and message in _error_lines(err)[0], err


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a torch without a usable CUDA device")
def test_cuda_on_a_cpu_only_torch(capsys, tmp_path, monkeypatch):
    import examples.engine.__main__ as cli
    monkeypatch.setattr(cli, "load_checkpoint", lambda *a, **k: pytest.fail("loaded a checkpoint"))
    code, out, err = run_cli(capsys, tmp_path, ["--device", "cuda"])
    assert code == 2 and out == "" and len(_error_lines(err)) == 1
    assert "--device cuda: this torch build has no usable CUDA device" in err


def test_wide_widths_follow_a_wide_batch():
    """The width bound is max(64, --max-batch): a batch of 100 may draft at width 100."""
    import examples.engine.__main__ as cli
    args = cli.parser().parse_args(["--widths", "1,100", "--max-batch", "100"])
    cli.check_args(cli.parser(), args)  # no error
    assert args.widths == (1, 100)


def test_float_token_id_is_not_an_integer(capsys, tmp_path, small_checkpoint):
    code, out, err = run_cli(capsys, tmp_path, ["--checkpoint", str(small_checkpoint)],
                             [[1, 2, 3], [4, 5.0]])
    assert code == 2 and out == ""
    assert "prompt 1: token 5.0 at index 1 is not an integer token id (got float)" in err
    assert "outside the vocabulary" not in err


def test_checkpoint_path_that_is_a_file_or_has_no_config(capsys, tmp_path):
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty").mkdir()
    for path, message in ((tmp_path / "file", "is not a directory"),
                          (tmp_path / "empty", "no config.json in this directory")):
        code, out, err = run_cli(capsys, tmp_path, ["--checkpoint", str(path)], [[1]])
        assert code == 2 and message in err and "config=" not in err


def test_nothing_drafted_still_prints_and_writes_the_summary(capsys, tmp_path, small_checkpoint,
                                                           monkeypatch):
    """Item 10: verifies happened but no draft was made (every chain empty): the rates are None;
    the summary prints them as n/a and the JSON is written."""
    import examples.engine.engine as engine_module
    monkeypatch.setattr(engine_module, "draft", lambda proposer, seqs, k, stats: [[] for _ in seqs])
    code, out, err = run_cli(capsys, tmp_path, ["--checkpoint", str(small_checkpoint),
                                                "--max-new-tokens", "4", "--widths", "1,2"],
                             [[5, 6, 7], [8]])
    assert code == 0, err
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["verifies"] > 0 and summary["acceptance_rate"] is None
    assert summary["generated_tokens"] == 8
    assert "acceptance rate n/a" in out


def test_format_summary_with_every_rate_none():
    from examples.engine.report import format_summary
    d = {"mode": "speculative (circuit drafting)", "requests": 1, "generated_tokens": 0,
         "wall_s": 0.0, "tokens_per_s": None, "max_batch": 1, "verifies": 2, "num_drafts": 4,
         "mean_accepted_per_verify": None, "acceptance_rate": None, "decode_steps": 2,
         "draft_time_share": None, "target_time_share": None, "draft_batches": {}}
    text = format_summary(d)
    assert "n/a tokens/s" in text and "acceptance rate n/a" in text and "n/a%" in text


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


def test_draft_before_read_is_a_flag(capsys, tmp_path, small_checkpoint, monkeypatch):
    """`--draft-before-read` sets the engine's default (the device path's; on CPU the host path
    runs and the output is the same), `--no-draft-before-read` clears it, and no flag keeps
    the default (on)."""
    from examples.engine import engine as engine_module
    seen = []
    real = engine_module.Engine.generate

    def generate(self, requests, on_step=None):
        seen.append(self.draft_before_read)
        return real(self, requests, on_step)
    monkeypatch.setattr(engine_module.Engine, "generate", generate)
    outs = []
    for flag in (["--draft-before-read"], ["--no-draft-before-read"], []):
        code, out, err = run_cli(capsys, tmp_path, ["--checkpoint", str(small_checkpoint),
                                                    "--max-new-tokens", "4", "--widths", "1,2",
                                                    "--no-compare", *flag], [[5, 6, 7], [8]])
        assert code == 0, err
        outs.append(json.loads((tmp_path / "summary.json").read_text())["requests_ids"])
    assert seen == [True, False, True] and outs[0] == outs[1] == outs[2]
