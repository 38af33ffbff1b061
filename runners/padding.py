"""Neutral values for rows that carry no sequence (padding, warm-up, capture).

Each circuit input declares the value an inert row holds beside the layer that emits it
(`CircuitBuilder.input(..., neutral=)`); an input that declares none is zero. The layer picks
them so an inert row drafts nothing and writes no KV, and a block id it could follow is the
runner's scratch block (`SCRATCH_BLOCK`), so even a kernel that ignored `active` could only
touch scratch. This module only reads those declarations: it knows no input names."""
from __future__ import annotations

from typing import Mapping

import torch

from draft_circuit.circuit.ir import SCRATCH_BLOCK, Circuit


def neutral_value(circuit: Circuit, name: str, scratch_block: int) -> int | float:
    """What an inert row of input `name` holds, with the scratch block id filled in."""
    neutral = circuit.value(name).neutral
    if neutral is None:
        return 0
    if isinstance(neutral, str):  # the one symbolic neutral (verify admits no other string)
        assert neutral == SCRATCH_BLOCK, neutral
        return scratch_block
    return neutral


def fill_neutral(circuit: Circuit, inputs: Mapping[str, torch.Tensor], start: int,
                 scratch_block: int) -> None:
    """Make rows start.. of every (max-width) static input buffer of `circuit` inert."""
    for name, buf in inputs.items():
        buf[start:].fill_(neutral_value(circuit, name, scratch_block))
