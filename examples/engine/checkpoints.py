"""Checkpoints and prompts: the target and drafter weights of a Hugging Face-layout directory (the
embedded default when none is given), and prompts turned into checked token ids.

The target is a dense Llama-like decoder (Llama, Qwen2, Qwen3) or DeepSeek-V3's (MLA + MoE). The
drafter is the target's MTP layer (model.layers.{num_hidden_layers}), or `--draft-checkpoint DIR`:
an exported MTP layer (model.layers.0) or an EAGLE-3 drafter, told apart by its config.json's
architectures (LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM). fp8 e4m3 weights stay fp8 beside
their block scales where the head chosen for them runs fp8 (heads.head_for), else are dequantised.

Under `--tp N` each rank loads its shards of both, reading only its slices (tp_checkpoint.py).
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
from draft_circuit.circuit.layers.deepseek_checkpoint import load_deepseek_target_weights
from draft_circuit.circuit.layers.draft_vocab import (DraftVocab, DraftVocabError, build_draft_vocab,
                                                      load_draft_vocab, read_token_ids)
from draft_circuit.circuit.layers.eagle3 import Eagle3Config
from draft_circuit.circuit.layers.eagle3_checkpoint import is_eagle3_checkpoint, load_eagle3_weights
from draft_circuit.circuit.layers.heads import head_for
from draft_circuit.circuit.layers.mla import MlaConfig
from draft_circuit.circuit.layers.moe import MoeMtpHead
from draft_circuit.circuit.layers.tp import TpPlan
from draft_circuit.circuit.layers.tp_checkpoint import load_mtp_shard, load_target_shard

# the embedded default (examples/train_tiny.py trains it; its log and held-out prompts beside it)
EMBEDDED = Path(__file__).resolve().parents[1] / "data" / "pystdlib_12l"
HELD_OUT_PROMPTS = EMBEDDED / "heldout_prompts.json"


# dense decoders the target emits: Llama's block with the config's attention options (Qwen2's q/k/v
# biases, Qwen3's q/k norms; the family table refuses what they do not cover); and DeepSeek-V3's
# MLA + MoE decoder (examples/engine/deepseek_target.py)
TARGET_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "DeepseekV3ForCausalLM",
                        "Glm4MoeForCausalLM")  # GLM-4.5: dense first layers, then MoE (glm_target.py)


class EngineError(ValueError):
    """A bad checkpoint, prompt or setting, found before any generation."""


@dataclass
class Checkpoint:
    path: Path
    config: MtpConfig
    target: dict[str, torch.Tensor]
    mtp: dict[str, torch.Tensor] | None  # the drafter's weights, its head's bind input; None: not loaded
    mtp_config: MtpConfig | None          # the drafter's own config (an Eagle3Config for EAGLE-3)
    byte_level: bool                      # prompts may be strings: one token per byte
    eos_token_id: int | None


def _raw_config(path: Path) -> dict:
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return {}  # read_config has already named the problem, or will
    return raw if isinstance(raw, dict) else {}


def load_checkpoint(path: str | os.PathLike | None = None, *, draft_path: str | os.PathLike | None = None,
                    with_mtp: bool = True, tp: int = 1) -> Checkpoint:
    """The target from `path` (the embedded default if None) and, with_mtp, its drafter: the MTP
    layer of `path` (at model.layers.{num_hidden_layers}), or `draft_path`'s (an exported layer 0,
    or an EAGLE-3 drafter, which borrows the target's embedding when it stores none).

    `tp` > 1 (under torchrun, its group joined: tp.start): this rank's shards of the target and
    the drafter, each rank reading only its slices (circuit/layers/tp_checkpoint.py); the engine
    binds them as they are. A failure on any rank is an EngineError on every rank (tp.agreed)."""
    if tp > 1:
        from examples.engine.tp import agreed  # tp.py imports EngineError from here
        return agreed(tp, lambda: _load(path, draft_path, with_mtp, tp))
    return _load(path, draft_path, with_mtp, tp)


def _load(path: str | os.PathLike | None, draft_path: str | os.PathLike | None, with_mtp: bool,
          tp: int) -> Checkpoint:
    root = Path(path) if path is not None else EMBEDDED
    _require_dir(root, "--checkpoint")
    if draft_path is not None and with_mtp:
        _require_dir(Path(draft_path), "--draft-checkpoint")
    raw = _raw_config(root)
    arch = raw.get("architectures") or ["LlamaForCausalLM"]
    if not set(arch) & set(TARGET_ARCHITECTURES):  # before its weights: a MoE target lacks dense MLPs
        raise EngineError(f"{root}/config.json: architectures {arch}; the engine's target is a "
                          f"dense Llama-like decoder, DeepSeek-V3's or GLM-4.5's ({', '.join(TARGET_ARCHITECTURES)})")
    try:
        config = read_config(root)
        shard = None
        if tp > 1:  # this rank's slices alone; MoE / MLA targets refused by plan_for
            from examples.engine.tp import plan_for
            shard = plan_for(config, tp)
            assert shard is not None  # tp > 1
            target: dict[str, torch.Tensor] = load_target_shard(root, shard.rank, tp, config)
        else:  # DeepSeek-V3: fp8 projections and experts kept as stored (its target model runs them fp8)
            target = (load_deepseek_target_weights(root, config, keep_fp8=True) if isinstance(config, MlaConfig)
                      else load_target_weights(root, config))
    except (CheckpointError, ConfigError) as e:
        raise EngineError(f"target checkpoint {root}: {e}") from None
    mtp_config, mtp = _load_mtp(root, config, target, draft_path, shard) if with_mtp else (None, None)
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


def _load_mtp(root: Path, config: MtpConfig, target: dict[str, torch.Tensor],
              draft_path, shard: TpPlan | None = None) -> tuple[MtpConfig, dict[str, torch.Tensor]]:
    """The drafter's config and weights: whole, or (`shard`: the target's plan) its rank's slices."""
    where = Path(draft_path) if draft_path is not None else root
    try:
        if draft_path is not None and is_eagle3_checkpoint(where):
            if shard is not None:
                raise EngineError(f"--tp {shard.world_size}: the EAGLE-3 drafter {where} does not shard yet; the dense "
                                  "and MoE MTP layers do")
            return _load_eagle3(where, config, target)
        draft_config = read_config(where) if draft_path is not None else config
        for field in ("vocab_size", "hidden_size"):
            if getattr(draft_config, field) != getattr(config, field):
                raise EngineError(f"draft checkpoint {where}: {field} {getattr(draft_config, field)} "
                                  f"!= the target's {getattr(config, field)}")
        if shard is not None:  # this rank's slices alone; fp8 block-scaled weights come dequantised
            return draft_config, load_mtp_shard(where, shard.rank, shard.world_size, draft_config)[1]
        _, weights = load_mtp_weights(where, draft_config, keep_fp8=True)
        if not isinstance(head_for(draft_config, "float32", weights), MoeMtpHead) and \
                any(w.dtype == torch.float8_e4m3fn for w in weights.values()):
            # a dense head's bind only casts: it needs the fp8 weights dequantised at load
            _, weights = load_mtp_weights(where, draft_config)
    except MissingMtpLayerError as e:
        hint = ("pass --draft-checkpoint DIR (an MTP layer exported at model.layers.0), or "
                "--no-speculation to run the target alone") if draft_path is None else \
            "point --draft-checkpoint at a directory holding the MTP layer"
        raise EngineError(f"no MTP layer to draft with: {e}; {hint}") from None
    except (CheckpointError, ConfigError) as e:
        raise EngineError(f"MTP layer from {where}: {e}") from None
    return draft_config, weights


def _load_eagle3(where: Path, config: MtpConfig,
                 target: dict[str, torch.Tensor]) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """An EAGLE-3 drafter over this target: the same vocabulary, tapped hiddens as wide as the
    target's, three tapped layers the target has (the engine taps them: Eagle3Config.tapped_layers)."""
    draft_config, weights = load_eagle3_weights(where, target_embed=target["model.embed_tokens.weight"])
    for mine, theirs in (("vocab_size", "vocab_size"), ("target_hidden_size", "hidden_size")):
        if getattr(draft_config, mine) != getattr(config, theirs):
            raise EngineError(f"EAGLE-3 drafter {where}: {mine} {getattr(draft_config, mine)} != the "
                              f"target's {theirs} {getattr(config, theirs)}")
    if isinstance(config, MlaConfig):
        raise EngineError(f"EAGLE-3 drafter {where} over a DeepSeek-V3 target: the engine taps layers of "
                          "its Llama-like targets only; use the target's MTP layer")
    try:
        draft_config.tapped_layers(config.num_hidden_layers)
    except ConfigError as e:
        raise EngineError(f"EAGLE-3 drafter {where}: {e}") from None
    return draft_config, weights


def draft_vocab_for(spec: str, checkpoint: Checkpoint, corpus: str | os.PathLike | None = None) -> DraftVocab:
    """`--draft-vocab FILE|N`: a token list file (.json/.pt/.npy, most frequent first, as
    draft_vocab.py reads them), or N: the N most frequent ids of `corpus` (a file of token ids in
    the same formats), which for the byte-level default may be left out: its corpus is then the
    Python standard library's sources it was trained on (examples/train_tiny.py's training split,
    never the held-out files the default prompts come from)."""
    vocab = checkpoint.config.vocab_size
    try:
        if not spec.isdigit():
            return load_draft_vocab(Path(spec), vocab)
        size = int(spec)
        if corpus is not None:
            ids = read_token_ids(corpus)
        elif checkpoint.byte_level:
            from examples.stdlib_corpus import read_bytes, stdlib_files  # the default's training text
            ids = read_bytes(stdlib_files()[0]).tolist()
        else:
            raise EngineError(f"--draft-vocab {spec}: building {size} ids needs a corpus of token ids "
                              f"for {checkpoint.path} (--draft-vocab-corpus FILE), or give a token list file")
        return build_draft_vocab(ids, vocab, size)
    except DraftVocabError as e:
        raise EngineError(f"--draft-vocab {spec}: {e}") from None


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
