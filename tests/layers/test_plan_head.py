"""`circuit plan --checkpoint` plans the head the checkpoint describes (heads.py): an MoE checkpoint
reports the MoE head's bytes and its notes (it used to plan the dense head), fp8 experts stay fp8,
and a checkpoint the loader refuses is one error line."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from draft_circuit.circuit.cli import main
from draft_circuit.circuit.layers.checkpoint import load_mtp_weights
from draft_circuit.circuit.layers.checkpoint_writer import write_random_checkpoint
from draft_circuit.circuit.layers.config import DEFAULT_CONFIG
from draft_circuit.circuit.layers.heads import describe_head, head_for, load_head
from draft_circuit.circuit.layers.moe import MoeConfig, MoeMtpHead, moe_plan_note, quantize_blocks
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.circuit.planner import CompileOptions, compile_draft

MOE = MoeConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_attention_heads=4,
                num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-6, rope_theta=10000.0,
                num_hidden_layers=2, tie_word_embeddings=False, max_position_embeddings=512,
                n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5)
WIDTHS, DRAFTS = (1, 4), 2
ARGS = ["--widths", "1,4", "--num-drafts", str(DRAFTS), "--device", "cpu"]


def plan(root: Path, tmp_path: Path, capsys) -> tuple[dict, str]:
    out = tmp_path / f"{root.name}.json"
    assert main(["plan", "--checkpoint", str(root), *ARGS, "--json", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def direct(head: MtpHead) -> dict:
    """The same plan compiled straight from the head (the CLI's KV layout and defaults)."""
    blocks = math.ceil(1024 / 16)
    kv = KvLayout(num_blocks=max(WIDTHS) * blocks + 1, block_size=16, max_blocks_per_seq=blocks)
    chain = emit_draft_chain(head, DRAFTS, max_width=max(WIDTHS), kv=kv)
    params = {v.name: torch.empty(v.shape, device="meta", dtype=getattr(torch, v.dtype))
              for v in chain.values if v.kind == "param"}
    report = compile_draft(chain, params, list(WIDTHS), device="cpu",
                           options=CompileOptions(kv_rows=100, bandwidth_gbps=4800.0)).report()
    return json.loads(report.to_json())


def moved(report: dict) -> list[int]:
    return [w["bytes_moved"] for w in report["widths"]]


def test_moe_checkpoint_plans_the_moe_head_with_its_notes(tmp_path: Path, capsys) -> None:
    root = write_random_checkpoint(tmp_path / "moe", MOE)
    report, out = plan(root, tmp_path, capsys)
    moe = direct(MoeMtpHead(MOE, "bfloat16"))
    dense = direct(MtpHead(MOE, "bfloat16"))  # what the command planned before
    assert moved(report) == moved(moe) != moved(dense)
    assert report["notes"]["moe"] == json.loads(json.dumps(moe_plan_note(MOE)))
    assert report["notes"]["head"].startswith("MoeMtpHead") and "bfloat16 experts" in report["notes"]["head"]
    assert {n["op"] for n in report["nodes"]} >= {"moe_route", "moe_experts"}
    assert out.splitlines()[0] == f"head: {report['notes']['head']}"


def test_fp8_experts_stay_fp8_in_the_plan(tmp_path: Path, capsys) -> None:
    root = write_random_checkpoint(tmp_path / "fp8", MOE, fp8_experts=True)
    report, _ = plan(root, tmp_path, capsys)
    fp8 = direct(MoeMtpHead(MOE, "bfloat16", fp8_experts=True))
    assert moved(report) == moved(fp8) and all(a < b for a, b in zip(moved(fp8), moved(direct(MoeMtpHead(MOE, "bfloat16")))))
    assert "fp8 e4m3 experts" in report["notes"]["head"]
    assert any(n["op"] == "moe_experts_fp8" for n in report["nodes"])


def test_dense_checkpoint_and_default_plan_the_dense_head(tmp_path: Path, capsys) -> None:
    root = write_random_checkpoint(tmp_path / "dense", DEFAULT_CONFIG)
    report, _ = plan(root, tmp_path, capsys)
    assert moved(report) == moved(direct(MtpHead(DEFAULT_CONFIG, "bfloat16")))
    assert set(report["notes"]) == {"head"} and report["notes"]["head"].startswith("MtpHead")
    assert main(["plan", *ARGS]) == 0
    assert capsys.readouterr().out.startswith("head: MtpHead")


def test_refused_checkpoint_is_one_error_line(tmp_path: Path, capsys) -> None:
    root = write_random_checkpoint(tmp_path / "moe", MOE)
    key = f"model.layers.{MOE.num_hidden_layers}.self_attn.q_proj.bias"
    save_file({key: torch.zeros(48)}, os.fspath(root / "bias.safetensors"))
    assert main(["plan", "--checkpoint", str(root), *ARGS]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error:" in err[0] and key in err[0] and "bias.safetensors" in err[0]


# ---- head selection itself -----------------------------------------------------------------------

def test_head_for_follows_the_config_and_the_stored_experts(tmp_path: Path) -> None:
    assert type(head_for(DEFAULT_CONFIG)) is MtpHead
    assert type(head_for(MOE)) is MoeMtpHead and not head_for(MOE).fp8_experts
    root = write_random_checkpoint(tmp_path / "fp8", MOE, fp8_experts=True)
    head, weights = load_head(root, "float32")
    assert head.fp8_experts and weights["mlp.experts.0.up_proj.weight"].dtype == torch.float8_e4m3fn
    head.bind(weights)  # the loaded weights are what the chosen head binds
    _, dense_weights = load_mtp_weights(root)
    partly = load_mtp_weights(root, keep_fp8=True)[1]
    partly["mlp.experts.3.down_proj.weight"] = dense_weights["mlp.experts.3.down_proj.weight"]
    assert not head_for(MOE, "float32", partly).fp8_experts  # one expert dequantised: no fp8 stack
    assert "4 experts, top-2, 1 shared, sigmoid" in describe_head(head)


def test_dense_head_gets_dequantised_weights(tmp_path: Path) -> None:
    # a dense MTP layer stored fp8 with block scales: the dense head's bind only casts
    root = write_random_checkpoint(tmp_path / "d", DEFAULT_CONFIG)
    tensors = load_file(os.fspath(root / "model.safetensors"))
    key = f"model.layers.{DEFAULT_CONFIG.num_hidden_layers}.self_attn.q_proj.weight"
    tensors[key], tensors[key + "_scale_inv"] = quantize_blocks(tensors[key])
    save_file(tensors, os.fspath(root / "model.safetensors"))
    head, weights = load_head(root, "float32")
    assert type(head) is MtpHead and weights["self_attn.q_proj.weight"].dtype == torch.float32
    assert torch.equal(weights["self_attn.q_proj.weight"], load_mtp_weights(root)[1]["self_attn.q_proj.weight"])
    head.bind(weights)
