"""Load the Qwen3-Next MTP drafter from a `Qwen3NextForCausalLM` checkpoint by the names vLLM's and
SGLang's qwen3_next_mtp loaders read: `mtp.fc`, `mtp.pre_fc_norm_embedding`, `mtp.pre_fc_norm_hidden`,
`mtp.layers.0.*`, `mtp.norm` (circuit/layers/qwen3_next.py lists them), plus the target's
`model.embed_tokens.weight` and `lm_head.weight` (the embedding when tied), which both engines
share with the drafter.

Refused by name: a missing tensor (MissingTensorError naming the `mtp.` key and the files looked
in), no `mtp.fc.weight` at all (MissingMtpLayerError: a checkpoint saved without its MTP layer,
as transformers' own save_pretrained writes it), and any other `mtp.*` tensor: every tensor there
belongs to the drafter, so one the head does not read (a bias, a second MTP layer, fp8
`weight_scale_inv` scales, a dedicated `mtp.embed_tokens`) would change its math
(UnsupportedTensorError). Tensors of the target's layers are ignored; strict=True also refuses
any tensor outside `mtp.`, `model.` and `lm_head.`. Every weight read must be a finite float.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from draft_circuit.circuit.layers.checkpoint import (_first_present, _inventory, _label, _read, _reject_extras,
                                                     read_config)
from draft_circuit.circuit.layers.checkpoint_errors import MissingMtpLayerError, UnsupportedTensorError
from draft_circuit.circuit.layers.qwen3_next import EMBED, LM_HEAD, MTP_PREFIX, Qwen3NextMtpConfig, qwen3_next_mtp_shapes
from draft_circuit.circuit.layers.tensor_checks import BENIGN_SUFFIXES

__all__ = ["load_qwen3_next_mtp_weights"]

_SHARED = {EMBED: "model.embed_tokens.weight", LM_HEAD: "lm_head.weight"}  # the target's, by vLLM's remap


def load_qwen3_next_mtp_weights(
    path: str | os.PathLike[str], config: Qwen3NextMtpConfig | None = None, *, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", strict: bool = False,
) -> tuple[Qwen3NextMtpConfig, dict[str, torch.Tensor]]:
    """The drafter's tensors under `qwen3_next_mtp_shapes`' names (the `Qwen3NextMtpHead.bind` input)."""
    root = Path(path)
    read = config if config is not None else read_config(root)
    if not isinstance(read, Qwen3NextMtpConfig):
        raise TypeError(f"{root}: not a Qwen3-Next config ({type(read).__name__})")
    config = read
    inv = _inventory(root)
    marker = f"{MTP_PREFIX}fc.weight"
    if marker not in inv.where:
        raise MissingMtpLayerError(f"no Qwen3-Next MTP layer: {marker!r} is in none of {inv.describe()} "
                                   "(transformers' Qwen3NextForCausalLM drops `mtp.*` on save; the released "
                                   "checkpoints carry it)")
    shapes = qwen3_next_mtp_shapes(config)
    plan: dict[str, str] = {}
    for name in shapes:
        if name == LM_HEAD and config.tie_word_embeddings and LM_HEAD not in inv.where:
            plan[name] = plan[EMBED]  # tied: the head is the embedding
            continue
        key = _SHARED.get(name, MTP_PREFIX + name)
        plan[name] = _first_present(inv, f"Qwen3-Next MTP tensor {name!r}", [key])
    used = set(plan.values())
    unread = sorted(k for k in inv.where if k.startswith(MTP_PREFIX) and k not in used
                    and not k.endswith(BENIGN_SUFFIXES))
    if unread:
        shown = "; ".join(f"{k!r} ({inv.where[k]})" for k in unread[:8])
        more = f" and {len(unread) - 8} more" if len(unread) > 8 else ""
        raise UnsupportedTensorError(
            f"{shown}{more}: {len(unread)} `mtp.*` tensor(s) the Qwen3-Next head does not implement "
            f"({_label(root)}); every `mtp.*` tensor is the drafter's, so loading without them would "
            "change its math")
    if strict:
        _reject_extras(inv, sorted(k for k in inv.where if k not in used
                                   and not k.startswith((MTP_PREFIX, "model.", "lm_head."))),
                       "outside the MTP layer and the target")
    return config, _read(inv, plan, shapes, dtype, device)
