"""Neutral values for rows that carry no sequence (padding, warm-up, capture).

An inert row drafts nothing and writes no drafter KV (`active` 0), and every index it could
follow points at the runner's scratch block, so even a kernel that ignored `active` could only
touch scratch. Every other input is zero (a valid token, position and live-row count)."""
from __future__ import annotations

from typing import Mapping

import torch

# input name -> value for inert rows; the block tables get the scratch block instead
_NEUTRAL = {"active": 0, "bitmask": -1, "log_tau": float("-inf")}


def fill_neutral(inputs: Mapping[str, torch.Tensor], start: int, scratch_block: int) -> None:
    """Make rows start.. of every (max-width) static input buffer inert."""
    for name, buf in inputs.items():
        rows = buf[start:]
        if name == "block_tables":
            rows.fill_(scratch_block)
        else:
            rows.fill_(_NEUTRAL.get(name, 0))
