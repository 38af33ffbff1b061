"""Load and write Hugging Face-layout checkpoints (config.json + safetensors) of an MTP draft head
and its Llama target. Only the tensors needed are read; every failure is a `CheckpointError`
subclass whose message names the tensor and the file (config faults are `ConfigError`).

The random writer the tests use (`write_random_checkpoint`) is circuit/layers/checkpoint_writer.py:
it writes the layout read here and imports from here, never the reverse.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from draft_circuit.circuit.layers.checkpoint_errors import (
    CheckpointError, CorruptFileError, MissingConfigError, MissingMtpLayerError, MissingTensorError,
    NonFiniteTensorError, TensorDtypeError, TensorShapeError, UnexpectedTensorError, UnsupportedTensorError)
from draft_circuit.circuit.layers.config import MTP_PARAM_SHAPES, TARGET_PARAM_SHAPES, ConfigError, MtpConfig
from draft_circuit.circuit.layers.families import (UnsupportedArchitectureError, UnsupportedConfigError,
                                                   check_family, family_label)
from draft_circuit.circuit.layers.tensor_checks import check_finite, check_stored_dtype, refuse_unimplemented
from draft_circuit.circuit.layers.moe import SCALE, MoeConfig, is_moe_hf_config, moe_checkpoint_shapes
from draft_circuit.circuit.layers.deepseek import mtp_checkpoint_shapes
from draft_circuit.circuit.layers.mla import MlaConfig, is_mla_hf_config
from draft_circuit.circuit.layers.qwen3_next import Qwen3NextMtpConfig
from draft_circuit.ops.moe import SCALE_BLOCK, dequantize_blocks

__all__ = [
    "CheckpointError", "MissingConfigError", "MissingMtpLayerError", "MissingTensorError",
    "TensorShapeError", "CorruptFileError", "UnexpectedTensorError", "UnsupportedTensorError",
    "TensorDtypeError", "NonFiniteTensorError", "ConfigError", "UnsupportedConfigError",
    "UnsupportedArchitectureError",
    "read_config", "load_mtp_weights", "load_target_weights",
]

CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class _Inventory:
    """Which file holds each tensor; built from headers (or the index) without reading data."""

    root: Path
    files: tuple[Path, ...]
    where: dict[str, Path]

    def describe(self) -> str:
        if not self.files:
            return f"no *.safetensors files in {self.root}"
        return f"{len(self.files)} safetensors file(s) in {self.root} ({', '.join(f.name for f in self.files)})"


def _open(path: Path) -> Any:  # safetensors' handle; its type is not exported
    try:
        return safe_open(os.fspath(path), framework="pt", device="cpu")
    except (SafetensorError, OSError) as e:
        raise CorruptFileError(f"{path}: not a readable safetensors file (truncated or corrupt?): {e}") from e


def _inventory(root: Path) -> _Inventory:
    index = root / INDEX_NAME
    if index.is_file():
        return _inventory_from_index(root, index)
    files = tuple(sorted(root.glob("*.safetensors")))
    where: dict[str, Path] = {}
    for path in files:
        with _open(path) as handle:
            keys = list(handle.keys())
        for key in keys:
            if key in where:
                raise CorruptFileError(f"tensor {key!r} is stored twice: in {where[key]} and in {path}")
            where[key] = path
    return _Inventory(root, files, where)


def _inventory_from_index(root: Path, index: Path) -> _Inventory:
    # Only the files the index names are read: a directory may hold stale shards beside it.
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError(f"'weight_map' is a {type(weight_map).__name__}")
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptFileError(f"{index}: not a safetensors index (needs a 'weight_map' object): {e!r}") from e
    where = {}
    for key, name in weight_map.items():
        path = root / str(name)
        # lexical, FAULT 31: "../x" and "/abs" are refused; a symlinked shard is not (the HF hub
        # cache links snapshots/<rev>/*.safetensors to blobs/ outside the snapshot directory)
        if os.path.isabs(str(name)) or os.path.normpath(str(name)).split(os.sep)[0] == "..":
            raise CorruptFileError(f"{index} maps tensor {key!r} to {name!r}, outside the checkpoint "
                                   f"directory {root}: shards must lie inside it")
        if not path.is_file():
            raise CorruptFileError(f"{index} maps tensor {key!r} to {path}, which does not exist")
        where[key] = path
    return _Inventory(root, tuple(sorted(set(where.values()))), where)


def _raw_config(root: Path) -> dict[str, Any]:
    file = root / CONFIG_NAME
    if not file.is_file():
        raise MissingConfigError(f"{file} not found: a checkpoint needs a config.json, or pass config=")
    try:
        d = json.loads(file.read_text())
    except ValueError as e:
        raise CorruptFileError(f"{file}: not valid JSON: {e}") from e
    if not isinstance(d, dict):
        raise ConfigError(f"{file}: expected a JSON object, got {type(d).__name__}")
    return d


def read_config(path: str | os.PathLike[str]) -> MtpConfig:
    """The config of a checkpoint directory's config.json: a `MoeConfig` when it names an expert
    count (the MTP layer's MLP is then a MoE), else an `MtpConfig`. Its family must be in the
    table and every field that changes the math set to what the head implements (families.py);
    the family sets the attention options (q/k/v bias, q/k norm, partial rotary)."""
    file = Path(path) / CONFIG_NAME
    d = _raw_config(Path(path))
    if is_mla_hf_config(d) or d.get("model_type") == "deepseek_v3":  # MLA layers: MlaConfig reads them
        check_family(d, source=os.fspath(file))
        return MlaConfig.from_hf(d, source=os.fspath(file))
    family = check_family(d, source=os.fspath(file))
    # Qwen3-Next: its own `mtp.*` layer (circuit/layers/qwen3_next.py), not a DeepSeek-named MoE one
    kind = Qwen3NextMtpConfig if family.model_type == "qwen3_next" else MoeConfig if is_moe_hf_config(d) else MtpConfig
    config = kind.from_hf(d, source=os.fspath(file))
    options = family.config_options(d, os.fspath(file))
    try:
        return dataclasses.replace(config, **options) if options else config
    except ConfigError as e:
        raise ConfigError(f"{file}: {e}") from None


def is_glm4_moe_checkpoint(root: Path) -> bool:
    """config.json names model_type glm4_moe (then its target layers are GLM-4.5's MoE layers)."""
    try:
        return _raw_config(root).get("model_type") == "glm4_moe"
    except CheckpointError:
        return False  # no readable config.json (config passed in): not one


def _label(root: Path) -> str:
    """The architecture a directory's config.json names, for tensor refusals."""
    try:
        return family_label(_raw_config(root))
    except CheckpointError:
        return "architecture unknown: no readable config.json, config passed in"


def _layer_shapes(config: MtpConfig) -> dict[str, tuple[int, ...]]:
    """The MTP layer's canonical tensors: a MoE layer stores its experts one by one."""
    if isinstance(config, MlaConfig):
        return mtp_checkpoint_shapes(config)
    return moe_checkpoint_shapes(config) if isinstance(config, MoeConfig) else MTP_PARAM_SHAPES(config)


def read_planned(inv: _Inventory, plan: dict[str, str], fp32: dict[str, str],
                 scales: dict[str, str], shapes: dict[str, tuple[int, ...]], dtype: torch.dtype,
                 device: str | torch.device, keep_fp8: bool) -> dict[str, torch.Tensor]:
    """Read `plan` in `dtype` and `fp32` in float32 (name -> stored name), then apply each
    weight's 128x128 `weight_scale_inv` from `scales`: kept beside an fp8 weight with `keep_fp8`,
    else dequantised into `dtype`. An fp8 weight with no scale is a corrupt checkpoint."""
    out = {**_read(inv, plan, shapes, dtype, device), **_read(inv, fp32, shapes, torch.float32, device)}
    stored = {**plan, **fp32}
    blocks = {s: tuple(math.ceil(d / SCALE_BLOCK) for d in shapes[s.removesuffix(SCALE)]) for s in scales}
    for s, scale in _read(inv, scales, blocks, torch.float32, device).items():
        w = s.removesuffix(SCALE)
        if keep_fp8 and out[w].dtype == torch.float8_e4m3fn:
            out[s] = scale
        else:
            out[w] = dequantize_blocks(out[w], scale).to(dtype)
            if dtype == torch.float16:  # a block scale may carry a weight past float16's range
                check_finite(inv.where[stored[w]], stored[w], out[w], converted_to=dtype)
    for name, t in out.items():
        if t.dtype == torch.float8_e4m3fn and name + SCALE not in out:
            raise CorruptFileError(f"{inv.where[stored[name]]}: tensor {stored[name]!r} is "
                                   f"float8_e4m3fn but {stored[name] + SCALE!r} is in no file")
    return out


def _read(inv: _Inventory, plan: dict[str, str], shapes: dict[str, tuple[int, ...]],
          dtype: torch.dtype, device: str | torch.device) -> dict[str, torch.Tensor]:
    """plan: result name -> stored name. A stored tensor serving two names is read once and shared."""
    by_file: dict[Path, dict[str, tuple[int, ...]]] = {}
    for name, key in plan.items():
        by_file.setdefault(inv.where[key], {})[key] = shapes[name]
    loaded: dict[str, torch.Tensor] = {}
    for path, expected in by_file.items():
        with _open(path) as handle:
            for key, shape in expected.items():
                t = _read_one(handle, path, key, shape)  # fp8 stays fp8: its scales make it real
                check_finite(path, key, t)
                out = t.to(device=device, dtype=t.dtype if t.dtype == torch.float8_e4m3fn else dtype)
                if out.dtype == torch.float16 != t.dtype:  # the one target dtype of smaller range
                    check_finite(path, key, out, converted_to=out.dtype)
                loaded[key] = out
    return {name: loaded[key] for name, key in plan.items()}


def _read_one(handle: Any, path: Path, key: str, shape: tuple[int, ...]) -> torch.Tensor:
    # The header gives the shape, so a wrong shape is refused before any data is read.
    try:
        header = handle.get_slice(key)
        actual = tuple(header.get_shape())
        if actual != shape:
            raise TensorShapeError(f"{path}: tensor {key!r} has shape {list(actual)}, expected {list(shape)}")
        check_stored_dtype(path, key, header.get_dtype())
        t: torch.Tensor = handle.get_tensor(key)
        return t
    except SafetensorError as e:
        raise CorruptFileError(f"{path}: cannot read tensor {key!r} (truncated or corrupt?): {e}") from e


def _first_present(inv: _Inventory, what: str, candidates: list[str]) -> str:
    for key in candidates:
        if key in inv.where:
            return key
    raise MissingTensorError(f"{what}: none of {candidates} found in {inv.describe()}")


def _mtp_prefix(inv: _Inventory, config: MtpConfig) -> str:
    """The MTP layer's key prefix: `model.layers.{L}.` (DeepSeek-V3 layout) if it holds `eh_proj`,
    else `model.layers.0.` (an exported draft holding only its own layer). A target layer never
    carries `eh_proj`, so the marker cannot mistake a decoder layer for the MTP layer."""
    if config.num_nextn_predict_layers < 1:
        raise MissingMtpLayerError(
            f"config declares num_nextn_predict_layers=0: no MTP layer to load from {inv.root}")
    looked = [f"model.layers.{config.num_hidden_layers}.eh_proj.weight", "model.layers.0.eh_proj.weight"]
    looked = list(dict.fromkeys(looked))  # one key when num_hidden_layers == 0
    for key in looked:
        if key in inv.where:
            return key.removesuffix("eh_proj.weight")
    raise MissingMtpLayerError(
        f"config declares num_nextn_predict_layers={config.num_nextn_predict_layers} but no MTP layer "
        f"was found: looked for {looked} in {inv.describe()}"
    )


def _reject_extras(inv: _Inventory, extras: list[str], where: str) -> None:
    if extras:
        shown = ", ".join(f"{k!r} ({inv.where[k].name})" for k in extras[:8])
        more = f" and {len(extras) - 8} more" if len(extras) > 8 else ""
        raise UnexpectedTensorError(
            f"strict load from {inv.root}: {len(extras)} unknown tensor(s) {where}: {shown}{more}")


def load_mtp_weights(
    path: str | os.PathLike[str], config: MtpConfig | None = None, *, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", strict: bool = False, keep_fp8: bool = False,
) -> tuple[MtpConfig, dict[str, torch.Tensor]]:
    """The first MTP layer's weights under their canonical names (see `MTP_PARAM_SHAPES`).

    `config` overrides config.json. Fallbacks: `embed_tokens` absent at the layer -> the target's
    `model.embed_tokens.weight`; `shared_head.head` absent -> `lm_head.weight`, or when tied the
    embedding resolved above. Refused always (`UnsupportedTensorError`): a tensor inside a module
    the head runs that it does not use (`self_attn.q_proj.bias`, `self_attn.q_norm.weight`, an
    MoE gate under a dense MLP); ignored: tensors of other layers and modules (the target's
    layers sit beside the MTP layer) and RoPE's saved `inv_freq`; strict=True also raises on any
    other tensor under the MTP prefix. Every weight read must be a finite float (TensorDtypeError,
    NonFiniteTensorError).
    A MoE config loads per-expert tensors (`moe_checkpoint_shapes`); the routing bias is read in
    fp32. A weight stored with `<name>_scale_inv` (DeepSeek-V3 fp8, 128x128 blocks) is dequantised
    to `dtype`, or with keep_fp8 an fp8 one comes back as stored with its fp32 scales beside it.
    """
    root = Path(path)
    config = config if config is not None else read_config(root)
    if isinstance(config, Qwen3NextMtpConfig):  # `mtp.*` names (qwen3_next_checkpoint.py)
        from draft_circuit.circuit.layers.qwen3_next_checkpoint import load_qwen3_next_mtp_weights
        return load_qwen3_next_mtp_weights(root, config, dtype=dtype, device=device, strict=strict)
    inv, shapes, plan, fp32, scales = mtp_read_plan(root, config, strict)
    return config, read_planned(inv, plan, fp32, scales, shapes, dtype, device, keep_fp8)


def mtp_read_plan(root: Path, config: MtpConfig, strict: bool
                  ) -> tuple[_Inventory, dict[str, tuple[int, ...]], dict[str, str], dict[str, str], dict[str, str]]:
    """What `load_mtp_weights` reads, every refusal applied, before any data is read: (inventory,
    canonical shapes, canonical -> stored name in the load dtype, the same in fp32, scale name ->
    stored scale). The tensor-parallel loader reads slices of the same plan (tp_checkpoint.py)."""
    inv = _inventory(root)
    prefix = _mtp_prefix(inv, config)
    shapes = _layer_shapes(config)
    fallbacks = {"embed_tokens.weight": ["model.embed_tokens.weight"], "shared_head.head.weight": ["lm_head.weight"]}
    plan: dict[str, str] = {}
    for name in shapes:
        if name == "shared_head.head.weight" and config.tie_word_embeddings and prefix + name not in inv.where:
            plan[name] = plan["embed_tokens.weight"]  # tied: the head is the embedding the layer uses
            continue
        plan[name] = _first_present(inv, f"MTP tensor {name!r}", [prefix + name, *fallbacks.get(name, [])])
    scales = {name + SCALE: key + SCALE for name, key in plan.items() if key + SCALE in inv.where}
    refuse_unimplemented(inv.where, {*plan.values(), *scales.values()}, [prefix], _label(root))
    if strict:
        known = {prefix + name for name in shapes} | set(scales.values())
        _reject_extras(inv, sorted(k for k in inv.where if k.startswith(prefix) and k not in known),
                       f"under the MTP layer prefix {prefix!r}")
    # read in fp32: the routing bias, and a gate the family keeps fp32 (GLM-4.5's, as transformers)
    fp32_gate = isinstance(config, MoeConfig) and config.fp32_gate
    fp32 = {n: plan.pop(n) for n in list(plan)
            if n.endswith("e_score_correction_bias") or (fp32_gate and n == "mlp.gate.weight")}
    return inv, shapes, plan, fp32, scales


def load_target_weights(
    path: str | os.PathLike[str], config: MtpConfig | None = None, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", *, strict: bool = False,
) -> dict[str, torch.Tensor]:
    """The Llama target's weights under their HF names (see `TARGET_PARAM_SHAPES`).

    Tied embeddings: `lm_head.weight` is the `model.embed_tokens.weight` tensor (a stored copy is
    not read). As for the MTP layer, a tensor inside a module the target runs that it does not
    use is refused (`model.layers.0.self_attn.q_proj.bias`); strict=True also raises on tensors
    that are neither target nor MTP-layer weights.
    """
    root = Path(path)
    config = config if config is not None else read_config(root)
    if isinstance(config, Qwen3NextMtpConfig):
        raise UnsupportedArchitectureError(f"{root}: {_label(root)} cannot be the target: its linear-attention "
                                           "(Gated DeltaNet) layers are not in the layer library; only its "
                                           "`mtp.*` drafter loads (load_mtp_weights)")
    if isinstance(config, MoeConfig) and not isinstance(config, MlaConfig) and is_glm4_moe_checkpoint(root):
        # GLM-4.5's MoE target layers (glm4_moe_target.py); a Llama-named MoE config keeps dense ones
        from draft_circuit.circuit.layers.glm4_moe_target import load_glm4_moe_target_weights
        return load_glm4_moe_target_weights(root, config, dtype, device, strict=strict)
    if isinstance(config, MlaConfig):  # DeepSeek-V3's layers (deepseek_checkpoint.py)
        from draft_circuit.circuit.layers.deepseek_checkpoint import load_deepseek_target_weights
        return load_deepseek_target_weights(root, config, dtype, device, strict=strict)
    inv, shapes, plan = target_read_plan(root, config, strict)
    return _read(inv, plan, shapes, dtype, device)


def target_read_plan(root: Path, config: MtpConfig, strict: bool
                     ) -> tuple[_Inventory, dict[str, tuple[int, ...]], dict[str, str]]:
    """What `load_target_weights` reads of a Llama-family dense target, every refusal applied,
    before any data is read: (inventory, HF shapes, HF name -> stored name). The tensor-parallel
    loader reads slices of the same plan (tp_checkpoint.py)."""
    inv = _inventory(root)
    for layer in range(config.num_hidden_layers):
        if (marker := f"model.layers.{layer}.eh_proj.weight") in inv.where:
            # An exported draft keeps its MTP layer at index 0; its decoder block is no target layer.
            raise MissingTensorError(f"target layer {layer}: {inv.where[marker]} holds {marker!r}, so "
                                     f"model.layers.{layer} is an MTP layer, not a target layer")
    shapes = TARGET_PARAM_SHAPES(config)
    plan = {name: _first_present(inv, f"target tensor {name!r}", [name])
            for name in shapes if not (name == "lm_head.weight" and config.tie_word_embeddings)}
    if config.tie_word_embeddings:
        plan["lm_head.weight"] = plan["model.embed_tokens.weight"]
    refuse_unimplemented(inv.where, plan.values(), [f"model.layers.{i}." for i in range(config.num_hidden_layers)],
                         _label(root))
    if strict:
        mtp = tuple(f"model.layers.{config.num_hidden_layers + i}." for i in range(config.num_nextn_predict_layers))
        _reject_extras(inv, sorted(k for k in inv.where if k not in shapes and not k.startswith(mtp)),
                       "outside the target and MTP layers")
    return inv, shapes, plan
