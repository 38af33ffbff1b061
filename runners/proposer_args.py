"""`MtpProposer`'s constructor arguments, checked before anything is built (issue 19 item 13).

A bad argument is a `ProposerArgumentError` naming it and the value, raised up front, instead of
a failure later in a compile, an allocation or the first propose. Widths above `max_width` are
dropped (the proposer's documented rule), so they are not errors; anything that is not a width
at all is.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from draft_circuit.runners.device import cuda_available
from draft_circuit.runners.proposer_state import ProposerError

__all__ = ["ProposerArgumentError", "check_proposer_args"]


class ProposerArgumentError(ProposerError):
    """A constructor argument of the proposer is of the wrong type or out of range."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"MtpProposer({argument}=...): {message}")
        self.argument = argument


def _int(name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProposerArgumentError(name, f"must be an int, got {value!r} "
                                          f"({type(value).__name__})")
    if value < lo:
        raise ProposerArgumentError(name, f"must be >= {lo}, got {value}")
    return value


def _bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ProposerArgumentError(name, f"must be True or False, got {value!r}")


def check_proposer_args(head: Any, params: object, *, num_drafts: object, num_blocks: object,
                        block_size: object, max_blocks_per_seq: object, max_width: object,
                        widths: object, device: object, kv_exact: object, refeed: object,
                        draft_confidence_stop: object, factory: object) -> None:
    """Every check on the constructor's arguments (forward is checked by the constructor)."""
    if not hasattr(head, "config") or not hasattr(head, "emit_step"):
        raise ProposerArgumentError("head", f"must be a draft head (MtpHead or a family's head), "
                                            f"got {type(head).__name__}")
    if not isinstance(params, Mapping):
        raise ProposerArgumentError("params", f"must be a mapping of name -> tensor (head.bind's), "
                                              f"got {type(params).__name__}")
    for name, value in params.items():
        if not isinstance(value, torch.Tensor):
            raise ProposerArgumentError("params", f"{name!r} is a {type(value).__name__}, not a "
                                                  "tensor")
    k = _int("num_drafts", num_drafts, 1)
    _int("num_blocks", num_blocks, 2)  # block 0 is the scratch block: one more to hold anything
    rows = _int("block_size", block_size, 1) * _int("max_blocks_per_seq", max_blocks_per_seq, 1)
    if rows <= k:
        raise ProposerArgumentError(
            "max_blocks_per_seq", f"{max_blocks_per_seq} blocks of {block_size} rows hold {rows} "
                                  f"drafter rows per sequence; a chain of num_drafts={k} needs "
                                  f"more than {k}")
    _int("max_width", max_width, 1)
    if isinstance(widths, (str, bytes)) or not hasattr(widths, "__iter__"):
        raise ProposerArgumentError("widths", f"must be a sequence of ints, got {widths!r}")
    for w in widths:
        _int("widths", w, 1)
    try:
        where = torch.device(device)  # type: ignore[call-overload]  # any object: checked here
    except (RuntimeError, TypeError) as e:
        raise ProposerArgumentError("device", f"{device!r} is not a torch device ({e})") from None
    if where.type == "cuda" and not cuda_available():
        raise ProposerArgumentError("device", f"{device!r}: this torch has no usable CUDA device")
    _bool("kv_exact", kv_exact)
    _bool("refeed", refeed)
    tau = draft_confidence_stop
    if tau is not None and (isinstance(tau, bool) or not isinstance(tau, (int, float))
                            or not math.isfinite(tau) or not 0 < tau < 1):
        raise ProposerArgumentError("draft_confidence_stop",
                                    f"must be None or a number in (0, 1) exclusive, got {tau!r}")
    if factory is not None and not callable(factory):
        raise ProposerArgumentError("factory", f"must be callable (a RunnerFactory) or None, got "
                                               f"{type(factory).__name__}")
