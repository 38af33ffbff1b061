"""The engine under torchrun (issue 21 step 5): `torchrun --nproc-per-node 2 -m examples.engine --tp 2`
on CPU (gloo), target and drafter sharded, is token-exact with the TP = 1 run on the same prompts
(the trained embedded default, so drafts are accepted and every speculative path runs), rank 0
alone reports; refusals are one `error:` line."""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from examples.engine.__main__ import main
from examples.engine.checkpoints import EMBEDDED

PROMPTS = ["def main(", "import os\nimport ", "class Foo:\n    def "]
ARGS = ["--max-new-tokens", "16", "--no-compare", "--quiet"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _torchrun(tmp: Path, *argv: str, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "examples.engine", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        return subprocess.run(cmd, cwd=Path(__file__).resolve().parents[2], env=env, capture_output=True,
                              text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:  # subprocess.run kills its child on the timeout
        pytest.fail(f"torchrun did not finish within {timeout_s} s: {e.stderr}")


def test_engine_tp2_under_torchrun_is_token_exact_with_tp1(tmp_path):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    one, two = tmp_path / "tp1.json", tmp_path / "tp2.json"
    assert main(["--prompts", str(prompts), "--summary-json", str(one), *ARGS]) == 0
    done = _torchrun(tmp_path, "--tp", "2", "--prompts", str(prompts), "--summary-json", str(two), *ARGS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("mean accepted drafts per verify") == 1, done.stdout  # rank 0 alone
    want, got = json.loads(one.read_text()), json.loads(two.read_text())
    assert got["requests_ids"] == want["requests_ids"]
    assert got["mean_accepted_per_verify"] == want["mean_accepted_per_verify"] > 0.5


def test_tp_outside_torchrun_is_refused(capsys):
    assert main(["--tp", "2", *ARGS]) == 2
    assert "error: --tp 2: run under torchrun --nproc-per-node 2" in capsys.readouterr().err


def test_a_checkpoint_no_rank_can_load_is_refused_on_every_rank(tmp_path):
    """Each rank reads only its slices (load_checkpoint(tp=2)); a truncated safetensors file makes
    both ranks fail, and each reports the agreement's refusal as its one error line."""
    bad = tmp_path / "truncated"
    shutil.copytree(EMBEDDED, bad)
    data = bad / "model.safetensors"
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])
    done = _torchrun(tmp_path, "--tp", "2", "--checkpoint", str(bad), *ARGS)
    assert done.returncode != 0
    line = "error: --tp 2: loading this rank's shards of the checkpoint failed on 2 of 2 ranks: rank 0: "
    assert done.stderr.count(line) == 2, done.stderr[-3000:]  # both ranks, each naming both
    assert done.stderr.count("rank 1: EngineError: target checkpoint") == 2 and "truncated or corrupt" in done.stderr
