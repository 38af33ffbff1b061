"""Checks on stored tensors that need no data, or one cheap pass over it: tensors inside a module
the head runs that it does not implement (refused by default, FAULT 31), stored dtypes (floats
only), and finiteness. Each raises a `CheckpointError` naming the tensor and its file.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterable, Mapping, Sequence

import torch

from draft_circuit.circuit.layers.checkpoint_errors import (NonFiniteTensorError, TensorDtypeError,
                                                            UnsupportedTensorError)

__all__ = ["unimplemented_tensors", "refuse_unimplemented", "check_stored_dtype", "check_finite",
           "FLOAT_DTYPES"]

# RoPE's frequencies, a buffer older checkpoints saved: recomputed from rope_theta, so harmless.
BENIGN_SUFFIXES = ("rotary_emb.inv_freq",)
# safetensors' dtype names the loader converts; fp8 e4m3 only with its block scales beside it.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16", "F8_E4M3")


def _blocks(used: Iterable[str], layer_prefixes: Sequence[str]) -> set[str]:
    """The module prefixes (`...q_proj.`) of used keys, and for keys under a layer prefix the
    block they belong to (`model.layers.2.self_attn.`): what the head runs."""
    blocks = set()
    for key in used:
        blocks.add(key.rsplit(".", 1)[0] + ".")
        for p in layer_prefixes:
            if key.startswith(p) and "." in key[len(p):]:
                blocks.add(p + key[len(p):].split(".", 1)[0] + ".")
    return blocks


def _prefixes(key: str) -> Iterable[str]:
    parts = key.split(".")
    return (".".join(parts[:i]) + "." for i in range(1, len(parts)))


def unimplemented_tensors(keys: Iterable[str], used: Iterable[str],
                          layer_prefixes: Sequence[str]) -> dict[str, str]:
    """Stored key -> the run module it sits in, for every key that sits in a module the head
    runs but is not itself loaded. Tensors of other layers and modules are not listed."""
    used = set(used)
    blocks = _blocks(used, layer_prefixes)
    out = {}
    for key in keys:
        if key in used or key.endswith(BENIGN_SUFFIXES):
            continue
        hit = next((p for p in _prefixes(key) if p in blocks), None)
        if hit is not None:
            out[key] = hit.removesuffix(".")
    return dict(sorted(out.items()))


def refuse_unimplemented(where: Mapping[str, Path], used: Iterable[str], layer_prefixes: Sequence[str],
                         label: str) -> None:
    """Raise `UnsupportedTensorError` naming each such tensor, its module and file."""
    found = unimplemented_tensors(where, used, layer_prefixes)
    if found:
        shown = "; ".join(f"{k!r} in module {m!r} ({where[k]})" for k, m in list(found.items())[:8])
        more = f" and {len(found) - 8} more" if len(found) > 8 else ""
        raise UnsupportedTensorError(
            f"{shown}{more}: {len(found)} tensor(s) inside modules the head runs that it does not "
            f"implement ({label}); loading without them would change the math (a bias, a q/k norm, "
            "an MoE gate under a dense MLP). Only tensors of other layers and modules are ignored.")


def check_stored_dtype(path: Path, key: str, dtype: str) -> None:
    if dtype not in FLOAT_DTYPES:
        kind = "an integer or bool" if dtype[0] in "IUB" else "an unsupported"
        raise TensorDtypeError(f"{path}: tensor {key!r} is stored as {dtype}, {kind} dtype: weights "
                               f"must be one of {', '.join(FLOAT_DTYPES)}")


def _has_nonfinite(t: torch.Tensor) -> bool:
    if t.dtype == torch.float8_e4m3fn:  # no inf in e4m3fn; NaN is s.1111.111
        return bool(((t.view(torch.uint8) & 0x7F) == 0x7F).any())
    return not bool(torch.isfinite(t).all())


def check_finite(path: Path, key: str, t: torch.Tensor, converted_to: torch.dtype | None = None) -> None:
    """`converted_to`: the tensor is the stored one after conversion to that dtype."""
    if _has_nonfinite(t):
        bad = int((~torch.isfinite(t.float())).sum()) if t.dtype != torch.float8_e4m3fn else "some"
        how = f" after conversion to {str(converted_to).removeprefix('torch.')} (out of its range)" \
            if converted_to is not None else ""
        raise NonFiniteTensorError(f"{path}: tensor {key!r} holds {bad} NaN or Inf value(s){how}")
