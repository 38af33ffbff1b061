"""Argument types and shared defaults for the project's command lines (`circuit plan|viz` and the
example engine): every bad value is one `error:` line from argparse (exit 2) before any work.

Defaults the two commands share live here. Where they differ it is on purpose: `circuit plan`
describes a deployment (the GPU, bf16) and needs no GPU to do it (shape-only params), while the
engine runs where it is started (CPU, fp32 unless told otherwise).
"""
from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Callable

DEFAULT_WIDTHS = (1, 2, 4, 8, 16, 32, 64)
MAX_WIDTH = 1024        # one program per width, one arena sized for the widest: past this, memory
MAX_NUM_DRAFTS = 64     # the chain unrolls a step per draft; compile time and arena grow linearly
DEVICES = ("cpu", "cuda")


def _int(text: str, what: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be an integer, got {text!r}") from None
    if not math.isfinite(value) or value != int(value):
        raise argparse.ArgumentTypeError(f"{what} must be an integer, got {text!r}")
    return int(value)


def int_in(lo: int, hi: int | None = None, what: str = "value") -> Callable[[str], int]:
    """An argparse type: an integer in [lo, hi] (hi None: no upper bound)."""
    def parse(text: str) -> int:
        value = _int(text, what)
        if value < lo or (hi is not None and value > hi):
            bound = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise argparse.ArgumentTypeError(f"{what} must be {bound}, got {value}")
        return value
    parse.__name__ = what  # argparse names the type in its messages
    return parse


def positive_float(what: str) -> Callable[[str], float]:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a number, got {text!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"{what} must be a finite number > 0, got {text!r}")
        return value
    parse.__name__ = what
    return parse


def widths(text: str) -> tuple[int, ...]:
    """Comma-separated widths, each in 1..MAX_WIDTH; sorted, duplicates dropped."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"widths must be comma-separated ints, got {text!r}")
    out = sorted({int_in(1, MAX_WIDTH, "each width")(p) for p in parts})
    return tuple(out)


def device(text: str) -> str:
    """`cpu`, `cuda` or `cuda:N`; the torch build must be able to use it where it will run."""
    kind = text.split(":", 1)[0]
    if kind not in DEVICES or (":" in text and not text.split(":", 1)[1].isdigit()):
        raise argparse.ArgumentTypeError(f"device must be one of {', '.join(DEVICES)} (or cuda:N), "
                                         f"got {text!r}")
    return text


def require_usable_device(name: str) -> None:
    """For commands that run on the device: `cuda` on a torch without CUDA is refused up front."""
    if not name.startswith("cuda"):
        return
    from draft_circuit.runners.device import cuda_available  # a probe only: no runner is built

    if not cuda_available():
        raise argparse.ArgumentTypeError(f"--device {name}: this torch build has no usable CUDA "
                                         "device (CPU-only build or no GPU); use --device cpu")


def writable_file(text: str) -> Path:
    """A file path whose folder exists and is writable, checked before any work is done."""
    path = Path(text)
    folder = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; give a file path")
    if not folder.is_dir() or not os.access(folder, os.W_OK) or (path.exists()
                                                                and not os.access(path, os.W_OK)):
        raise argparse.ArgumentTypeError(f"cannot write {text!r}: its folder does not exist or is "
                                         "not writable")
    return path
