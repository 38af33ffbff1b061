"""The embedded default (examples/data/pystdlib_12l, trained by examples/train_tiny.py): its shape
(a 12-layer target beside one MTP layer), real acceptance on held-out text, the command line's
modes giving the same tokens, and those tokens equal to transformers' greedy decoding."""
from __future__ import annotations

import json

import pytest
import torch

from examples.engine.__main__ import main
from examples.engine.checkpoints import EMBEDDED, HELD_OUT_PROMPTS, load_checkpoint

pytestmark = pytest.mark.skipif(not (EMBEDDED / "model.safetensors").is_file(),
                                reason="the embedded checkpoint is not in this checkout")


def cli(tmp_path, capsys, *argv: str) -> dict:
    path = tmp_path / "summary.json"
    assert main([*argv, "--summary-json", str(path), "--threads", str(torch.get_num_threads())]) == 0
    out, _ = capsys.readouterr()
    summary = json.loads(path.read_text())
    summary["stdout"] = out
    return summary


def test_the_default_is_a_deep_target_beside_one_mtp_layer():
    ck = load_checkpoint()
    assert ck.byte_level and ck.config.num_hidden_layers >= 8 and ck.mtp is not None
    assert ck.mtp_config.hidden_size == ck.config.hidden_size
    assert (EMBEDDED / "model.safetensors").stat().st_size <= 16_000_000
    log = (EMBEDDED / "train_log.txt").read_text()
    assert "teacher_forced_accepted_per_verify" in log and "NVIDIA" in log  # trained on the GPU


def test_held_out_run_circuit_eager_and_target_only_agree(tmp_path, capsys):
    prompts = json.loads(HELD_OUT_PROMPTS.read_text())[:5]
    (tmp_path / "p.json").write_text(json.dumps(prompts))
    base = ("--prompts", str(tmp_path / "p.json"), "--max-new-tokens", "24", "--max-batch", "3")
    circuit = cli(tmp_path, capsys, *base, "--forward", "circuit", "--widths", "1,2,4")  # + target only
    eager = cli(tmp_path, capsys, *base, "--forward", "eager", "--no-compare")
    assert circuit["outputs_identical"] and circuit["baseline"]["generated_tokens"] == 5 * 24
    assert [r["generated"] for r in eager["requests_ids"]] == [r["generated"] for r in circuit["requests_ids"]]
    assert [r["prompt"] for r in circuit["requests_ids"]] == [list(p.encode()) for p in prompts]
    # held-out text, k = 3 (the CPU default): real acceptance (train_tiny.py's log has the teacher-forced figure)
    assert circuit["mean_accepted_per_verify"] >= 1.5
    assert circuit["mean_accepted_per_verify"] == eager["mean_accepted_per_verify"]
    assert "mean accepted drafts per verify" in circuit["stdout"] and "speedup" in circuit["stdout"]
    assert "n=  3: " in circuit["stdout"] and "pad" in circuit["stdout"]  # 3 pads to 4


def test_engine_greedy_equals_transformers_greedy(tmp_path, capsys):
    """The engine's tokens (speculating; its own check makes them the target-only tokens) are
    transformers' LlamaForCausalLM greedy tokens for the same checkpoint (fp32, near-tie rule)."""
    pytest.importorskip("transformers")
    from tests.examples.greedy_reference import assert_same_greedy
    from tests.examples.test_engine_hf import hf_greedy

    prompts = json.loads(HELD_OUT_PROMPTS.read_text())[5:8]
    (tmp_path / "p.json").write_text(json.dumps(prompts))
    ours = cli(tmp_path, capsys, "--prompts", str(tmp_path / "p.json"), "--max-new-tokens", "20")
    assert ours["outputs_identical"]
    for req in ours["requests_ids"]:
        theirs, gaps = hf_greedy(EMBEDDED, req["prompt"], 20)
        assert_same_greedy(req["generated"], theirs, gaps)


def test_empty_string_prompt_is_an_error(tmp_path, capsys):
    (tmp_path / "p.json").write_text(json.dumps(["def f(x):", ""]))
    assert main(["--prompts", str(tmp_path / "p.json"), "--threads", str(torch.get_num_threads())]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "prompt 1 is empty" in err
