"""Load and write EAGLE-3 drafter checkpoints in the published layout (config.json naming
`LlamaForCausalLMEagle3` + safetensors), by the names vLLM's and SGLang's loaders read:
`fc.weight`, `midlayer.*`, `norm.weight`, `lm_head.weight`, `d2t` (int64 offsets, target id =
draft id + d2t[draft id]), `t2d` (bool [vocab_size], ignored by both engines: checked here
against d2t when present) and an optional `embed_tokens.weight` (absent: the target's).

Refused by name: a config of another family; `lm_head` rows other than `draft_vocab_size`; `d2t`
missing while `draft_vocab_size` < `vocab_size` (with the full vocabulary and no d2t the ids are
the target's, as both engines read it), of another length, or mapping outside the target
vocabulary or two drafts to one target; a `t2d` that disagrees with it; tensors inside the
modules the head runs that it does not implement (`fc.bias`, `midlayer.self_attn.q_proj.bias`).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from draft_circuit.circuit.layers.checkpoint import (CONFIG_NAME, _first_present, _inventory, _Inventory,
                                                     _label, _open, _raw_config, _read, _reject_extras)
from draft_circuit.circuit.layers.checkpoint_errors import (CorruptFileError, MissingTensorError,
                                                            TensorDtypeError, TensorShapeError)
from draft_circuit.circuit.layers.eagle3 import (EAGLE3_ARCHITECTURES, LAYER, Eagle3Config, draft_targets,
                                                 eagle3_checkpoint_shapes)
from draft_circuit.circuit.layers.families import UnsupportedArchitectureError, check_family, family_label
from draft_circuit.circuit.layers.tensor_checks import refuse_unimplemented

__all__ = ["read_eagle3_config", "is_eagle3_checkpoint", "load_eagle3_weights",
           "write_random_eagle3_checkpoint"]

_INT_DTYPES = (torch.int64, torch.int32)


def is_eagle3_checkpoint(path: str | os.PathLike[str]) -> bool:
    """config.json names an EAGLE-3 architecture (its family is then checked on read)."""
    archs = _raw_config(Path(path)).get("architectures")
    return isinstance(archs, list) and any(a in EAGLE3_ARCHITECTURES for a in archs)


def read_eagle3_config(path: str | os.PathLike[str]) -> Eagle3Config:
    """The EAGLE-3 config of a checkpoint directory, after every family rule passed."""
    file = os.fspath(Path(path) / CONFIG_NAME)
    d = _raw_config(Path(path))
    family = check_family(d, source=file)
    if not set(family.architectures) & set(EAGLE3_ARCHITECTURES):
        raise UnsupportedArchitectureError(f"{file}: {family_label(d)} is not an EAGLE-3 drafter "
                                           f"({' or '.join(EAGLE3_ARCHITECTURES)})")
    return Eagle3Config.from_hf(d, source=file)


def _read_int(inv: _Inventory, key: str, shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> torch.Tensor:
    path = inv.where[key]
    with _open(path) as handle:
        header = handle.get_slice(key)
        actual = tuple(header.get_shape())
        if actual != shape:
            raise TensorShapeError(f"{path}: tensor {key!r} has shape {list(actual)}, expected {list(shape)}")
        t: torch.Tensor = handle.get_tensor(key)
    if t.dtype not in dtypes:
        raise TensorDtypeError(f"{path}: tensor {key!r} is stored as {t.dtype}, expected "
                               f"{' or '.join(str(d) for d in dtypes)}")
    return t


def _draft_map(inv: _Inventory, config: Eagle3Config) -> torch.Tensor:
    """d2t, checked (and t2d against it); the identity when d2t is absent over the full vocabulary."""
    s, v = config.draft_vocab_size, config.vocab_size
    if "d2t" not in inv.where:
        if s < v:
            raise MissingTensorError(f"EAGLE-3 tensor 'd2t' (draft id -> target id offsets) is in no "
                                     f"file, and draft_vocab_size = {s} < vocab_size = {v}: without it "
                                     f"the drafts cannot be mapped to target ids ({inv.describe()})")
        return torch.zeros(s, dtype=torch.int64)
    d2t = _read_int(inv, "d2t", (s,), _INT_DTYPES).long()
    try:
        targets = draft_targets(d2t, v)
    except ValueError as e:
        raise CorruptFileError(f"{inv.where['d2t']}: tensor 'd2t': {e}") from None
    if "t2d" in inv.where:
        t2d = _read_int(inv, "t2d", (v,), (torch.bool,))
        want = torch.zeros(v, dtype=torch.bool)
        want[targets] = True
        if not torch.equal(t2d, want):
            raise CorruptFileError(f"{inv.where['t2d']}: tensor 't2d' marks {int(t2d.sum())} target ids, "
                                   f"not exactly the {s} that 'd2t' maps to")
    return d2t


def _check_lm_head(inv: _Inventory, config: Eagle3Config) -> None:
    """The lm-head's rows are the draft vocabulary: a disagreement names draft_vocab_size."""
    key = _first_present(inv, "EAGLE-3 tensor 'lm_head.weight'", ["lm_head.weight"])
    with _open(inv.where[key]) as handle:
        shape = tuple(handle.get_slice(key).get_shape())
    want = (config.draft_vocab_size, config.hidden_size)
    if shape != want:
        raise TensorShapeError(f"{inv.where[key]}: tensor 'lm_head.weight' has shape {list(shape)}, but "
                               f"config field 'draft_vocab_size' = {config.draft_vocab_size} and "
                               f"'hidden_size' = {config.hidden_size} make it {list(want)}")


def load_eagle3_weights(
    path: str | os.PathLike[str], config: Eagle3Config | None = None, *, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", strict: bool = False, target_embed: torch.Tensor | None = None,
) -> tuple[Eagle3Config, dict[str, torch.Tensor]]:
    """The drafter's tensors under their stored names (`eagle3_checkpoint_shapes`) plus `d2t`
    (int64), the `Eagle3Head.bind` input. `target_embed` ([vocab_size, hidden_size], the
    target's `model.embed_tokens.weight`) serves when the checkpoint holds no `embed_tokens`.
    strict=True also refuses any tensor no param uses."""
    root = Path(path)
    config = config if config is not None else read_eagle3_config(root)
    inv = _inventory(root)
    _check_lm_head(inv, config)
    shapes = eagle3_checkpoint_shapes(config)
    embed_shape = shapes.pop("embed_tokens.weight")
    plan = {name: _first_present(inv, f"EAGLE-3 tensor {name!r}", [name]) for name in shapes}
    if "embed_tokens.weight" in inv.where:
        plan["embed_tokens.weight"] = "embed_tokens.weight"
        shapes["embed_tokens.weight"] = embed_shape
    elif target_embed is None:
        raise MissingTensorError(f"EAGLE-3 tensor 'embed_tokens.weight' is in no file and no target "
                                 f"embedding was given ({inv.describe()})")
    elif tuple(target_embed.shape) != embed_shape:
        raise TensorShapeError(f"the target embedding is {list(target_embed.shape)}; the drafter "
                               f"({root}) embeds into {list(embed_shape)}: it needs its own embed_tokens")
    d2t = _draft_map(inv, config)
    used = {*plan.values(), *(k for k in ("d2t", "t2d") if k in inv.where)}
    refuse_unimplemented(inv.where, used, [LAYER], _label(root))
    if strict:
        _reject_extras(inv, sorted(k for k in inv.where if k not in used), "in the EAGLE-3 checkpoint")
    out = _read(inv, plan, shapes, dtype, device)
    if "embed_tokens.weight" not in out:
        assert target_embed is not None  # refused above otherwise
        out["embed_tokens.weight"] = target_embed.to(device=device, dtype=dtype)
    out["d2t"] = d2t.to(device)
    return config, out


def _random_targets(c: Eagle3Config, gen: torch.Generator) -> torch.Tensor:
    """Ascending distinct target ids, as SpecForge writes them (its most frequent ids, sorted)."""
    return torch.randperm(c.vocab_size, generator=gen)[:c.draft_vocab_size].sort().values


def write_random_eagle3_checkpoint(
    path: str | os.PathLike[str], config: Eagle3Config, *, seed: int = 0, dtype: torch.dtype = torch.float32,
    include_embed: bool = True, include_d2t: bool = True, include_t2d: bool = True,
    extra: dict[str, torch.Tensor] | None = None, config_overrides: dict[str, Any] | None = None,
) -> Path:
    """config.json and one safetensors file in the published layout, random but well scaled
    (norm gains near 1, projections 1/sqrt(fan-in)); `extra` tensors are added as given."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in eagle3_checkpoint_shapes(config).items():
        if name == "embed_tokens.weight" and not include_embed:
            continue
        t = torch.randn(shape, generator=gen)
        t = 1 + 0.1 * t if len(shape) == 1 else t if "embed" in name else t / math.sqrt(shape[-1])
        tensors[name] = t.to(dtype)
    targets = _random_targets(config, gen)
    if include_d2t:
        tensors["d2t"] = targets - torch.arange(config.draft_vocab_size)
    if include_t2d:
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[targets] = True
        tensors["t2d"] = t2d
    tensors.update(extra or {})
    (root / CONFIG_NAME).write_text(json.dumps({**config.to_hf(), **(config_overrides or {})}, indent=2) + "\n")
    save_file(tensors, os.fspath(root / "model.safetensors"), metadata={"format": "pt"})
    return root
