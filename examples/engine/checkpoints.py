"""Checkpoints and prompts: the target and MTP weights of a Hugging Face-layout directory (the
embedded default when none is given), and prompts turned into checked token ids.

Every problem is an `EngineError` raised before anything is generated; its message says what
to change.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from draft_circuit.circuit.layers.checkpoint import (CheckpointError, MissingMtpLayerError, load_mtp_weights,
                                   load_target_weights, read_config)
from draft_circuit.circuit.layers.config import ConfigError, MtpConfig

EMBEDDED = Path(__file__).resolve().parents[1] / "data" / "tiny"
HELD_OUT_PROMPTS = Path(__file__).resolve().parents[1] / "data" / "heldout_prompts.json"


# dense decoders the target emits: Llama's block with the config's attention options (Qwen2's q/k/v
# biases, Qwen3's q/k norms; the family table refuses what they do not cover)
TARGET_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


class EngineError(ValueError):
    """A bad checkpoint, prompt or setting, found before any generation."""


@dataclass
class Checkpoint:
    path: Path
    config: MtpConfig
    target: dict[str, torch.Tensor]
    mtp: dict[str, torch.Tensor] | None  # canonical MTP names; None when not loaded
    mtp_config: MtpConfig | None          # the MTP layer's own config (a draft dir may differ)
    byte_level: bool                      # prompts may be strings: one token per byte
    eos_token_id: int | None


def _raw_config(path: Path) -> dict:
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}  # read_config has already named the problem, or will
    return raw if isinstance(raw, dict) else {}


def load_checkpoint(path: str | os.PathLike | None = None, *, draft_path: str | os.PathLike | None = None,
                    with_mtp: bool = True) -> Checkpoint:
    """The target from `path` (the embedded default if None) and, with_mtp, its MTP layer from
    `path` (at model.layers.{num_hidden_layers}) or from `draft_path` (an exported layer 0)."""
    root = Path(path) if path is not None else EMBEDDED
    _require_dir(root, "--checkpoint")
    if draft_path is not None and with_mtp:
        _require_dir(Path(draft_path), "--draft-checkpoint")
    raw = _raw_config(root)
    arch = raw.get("architectures") or ["LlamaForCausalLM"]
    if not set(arch) & set(TARGET_ARCHITECTURES):  # before its weights: a MoE target lacks dense MLPs
        raise EngineError(f"{root}/config.json: architectures {arch}; the engine's target is a "
                          f"dense Llama-like decoder ({', '.join(TARGET_ARCHITECTURES)})")
    try:
        config = read_config(root)
        target = load_target_weights(root, config)
    except (CheckpointError, ConfigError) as e:
        raise EngineError(f"target checkpoint {root}: {e}") from None
    mtp_config, mtp = _load_mtp(root, config, draft_path) if with_mtp else (None, None)
    eos = raw.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) and len(eos) == 1 else eos
    return Checkpoint(root, config, target, mtp, mtp_config,
                      byte_level=(raw.get("draft_circuit") or {}).get("tokenizer") == "bytes",
                      eos_token_id=eos if isinstance(eos, int) else None)


def _require_dir(path: Path, flag: str) -> None:
    """A checkpoint is a directory holding config.json: say so in the command line's terms (the
    loaders' own message suggests their Python `config=` argument, which the CLI has not)."""
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise EngineError(f"{flag} {path}: {what}; give a Hugging Face-layout checkpoint "
                          "directory (config.json and *.safetensors)")
    if not (path / "config.json").is_file():
        raise EngineError(f"{flag} {path}: no config.json in this directory; give a Hugging "
                          "Face-layout checkpoint directory (config.json and *.safetensors)")


def _load_mtp(root: Path, config: MtpConfig, draft_path) -> tuple[MtpConfig, dict[str, torch.Tensor]]:
    where = Path(draft_path) if draft_path is not None else root
    try:
        draft_config = read_config(where) if draft_path is not None else config
        for field in ("vocab_size", "hidden_size"):
            if getattr(draft_config, field) != getattr(config, field):
                raise EngineError(f"draft checkpoint {where}: {field} {getattr(draft_config, field)} "
                                  f"!= the target's {getattr(config, field)}")
        _, weights = load_mtp_weights(where, draft_config)
    except MissingMtpLayerError as e:
        hint = ("pass --draft-checkpoint DIR (an MTP layer exported at model.layers.0), or "
                "--no-speculation to run the target alone") if draft_path is None else \
            "point --draft-checkpoint at a directory holding the MTP layer"
        raise EngineError(f"no MTP layer to draft with: {e}; {hint}") from None
    except (CheckpointError, ConfigError) as e:
        raise EngineError(f"MTP layer from {where}: {e}") from None
    return draft_config, weights


def read_prompts(path: str | os.PathLike) -> list:
    try:
        items = json.loads(Path(path).read_text())
    except OSError as e:
        raise EngineError(f"--prompts {path}: cannot read: {e}") from None
    except ValueError as e:
        raise EngineError(f"--prompts {path}: not valid JSON: {e}") from None
    if not isinstance(items, list) or not items:
        raise EngineError(f"--prompts {path}: expected a non-empty JSON list of strings or of "
                          "token-id lists")
    return items


def default_prompts(checkpoint: Checkpoint, count: int = 12) -> list:
    """Held-out text for a byte-level model; otherwise deterministic token ids of varied lengths."""
    if checkpoint.byte_level and HELD_OUT_PROMPTS.is_file():
        return json.loads(HELD_OUT_PROMPTS.read_text())[:count]
    gen = torch.Generator().manual_seed(0)
    vocab = checkpoint.config.vocab_size
    return [torch.randint(0, vocab, (8 + 7 * i % 41,), generator=gen).tolist() for i in range(count)]


def encode_prompts(items: list, checkpoint: Checkpoint) -> list[list[int]]:
    """Strings (byte-level models only) and token-id lists -> checked token ids."""
    vocab = checkpoint.config.vocab_size
    out = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not checkpoint.byte_level:
                raise EngineError(
                    f"prompt {i} is a string, but {checkpoint.path} has no tokenizer the engine "
                    "can run (only the embedded byte-level model has one); give prompts as "
                    "lists of token ids, e.g. from your model's tokenizer")
            ids = list(item.encode("utf-8"))
        elif isinstance(item, list):
            ids = item
        else:
            raise EngineError(f"prompt {i}: expected a string or a list of token ids, got "
                              f"{type(item).__name__}")
        if not ids:
            raise EngineError(f"prompt {i} is empty: the target needs at least one token to "
                              "condition on")
        for j, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool):
                raise EngineError(f"prompt {i}: token {t!r} at index {j} is not an integer token "
                                  f"id (got {type(t).__name__})")
            if not 0 <= t < vocab:
                raise EngineError(f"prompt {i}: token {t!r} at index {j} is outside the "
                                  f"vocabulary [0, {vocab})")
        out.append(list(ids))
    return out


def decode_bytes(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")
