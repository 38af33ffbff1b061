"""A compiled runner's int32 inputs as one region, and a host mirror that stages them in one copy.

`runners/program.py` lays a program's int32 inputs out as views of ONE contiguous device buffer
at the max width, in the circuit's order (every width's views are its leading elements). A host
that keeps a mirror of that buffer laid out the same way, with every row past a run's n at its
input's neutral value, stages a whole run (padding included) with one host-to-device copy and
hands the runner its own `staged_inputs(n)` back: no check, copy or fill of the runner's own.
The proposer's chain staging (runners/staging.py) and the engine's target passes
(examples/engine/target_staging.py) are the two users.

`int_region` finds such a region for a runner (or says it has none of the layout asked for);
`IntMirror` is numpy views of one host mirror and the bookkeeping of which rows are neutral.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from draft_circuit.runners.padding import neutral_value

#: the int32 inputs of a draft chain and of the target's pass, in the circuit's order
INTS = ("tokens", "positions", "block_tables", "live_rows", "active")
ROWS = ("tokens", "positions", "live_rows", "active")  # one int a row


@dataclass(frozen=True)
class IntRegion:
    """A runner's packed int32 inputs: `flat` the device span, `offsets` each input's start in
    it, `width` its rows (the runner's widest program), `neutral` each input's inert value."""

    flat: torch.Tensor
    offsets: Mapping[str, int]
    width: int
    neutral: Mapping[str, int | float]


def int_region(runner: object, *, max_w: int, m: int, device: torch.device, scratch: int,
               extra: Sequence[str] = (), optional: Sequence[str] = ()) -> IntRegion | None:
    """The region of `runner`'s own static int inputs when its inputs are exactly INTS, `extra`
    and any of `optional`, the INTS one contiguous int32 span of width <= max_w rows with block
    tables [width, m] on `device`; None otherwise (a runner without staged inputs, another
    chain, a masked chain)."""
    if not hasattr(runner, "staged_inputs"):
        return None
    backend = getattr(runner, "backend", None)
    static = getattr(backend, "static_inputs", None)
    circuit = getattr(getattr(runner, "compiled", None), "circuit", None)
    if not isinstance(static, dict) or circuit is None:
        return None
    names = set(static)
    if not {*INTS, *extra} <= names or names - {*INTS, *extra, *optional}:
        return None
    ints = [static[k] for k in INTS]
    if any(t.dtype != torch.int32 or t.device != device or not t.is_contiguous() for t in ints):
        return None
    w = static["tokens"].shape[0] if static["tokens"].dim() == 1 else -1
    if not 0 < w <= max_w or tuple(static["block_tables"].shape) != (w, m):
        return None
    if any(t.untyped_storage().data_ptr() != ints[0].untyped_storage().data_ptr() for t in ints):
        return None
    lo = min(t.storage_offset() for t in ints)
    hi = max(t.storage_offset() + t.numel() for t in ints)
    if hi - lo != sum(t.numel() for t in ints):
        return None  # not one contiguous span of exactly these inputs
    flat = ints[0].as_strided((hi - lo,), (1,), lo)
    offsets = {k: t.storage_offset() - lo for k, t in zip(INTS, ints)}
    neutral = {k: neutral_value(circuit, k, scratch) for k in (*INTS, *extra, *optional)
               if k in names}
    return IntRegion(flat, offsets, w, neutral)


class IntMirror:
    """numpy views of one host mirror of a region: one [W] array per one-int input and the
    block tables [W, M]."""

    def __init__(self, flat: np.ndarray, offsets: Mapping[str, int], w: int, m: int) -> None:
        self.rows = {k: flat[offsets[k]:offsets[k] + w] for k in ROWS}
        self.values = tuple(self.rows[k] for k in ("tokens", "positions", "live_rows"))
        self.active = self.rows["active"]
        self.tables = flat[offsets["block_tables"]:offsets["block_tables"] + w * m].reshape(w, m)
        #: the n of the latest fill: rows [filled:] hold their neutral values and active[:filled]
        #: is 1 (None: unknown, every row is rewritten); a fill at the same n writes values only
        self.filled: int | None = None

    def fill(self, n: int, values: tuple[object, object, object], tables: np.ndarray,
             slots: np.ndarray | None, nz: Mapping[str, int | float]) -> None:
        """Rows [:n] of tokens, positions and live rows, active[:n] 1, each row's block table
        (`tables[slots[i]]`, or `tables[i]` with slots None), every row past n neutral: only
        what differs from the latest fill (a numpy call costs about a microsecond whatever it
        writes)."""
        if n == 1 and slots is not None:  # one row (a decode step at n = 1): scalar writes
            # and one row copy, a fraction of the slice writes' and take's call costs
            for dst, v in zip(self.values, values):
                dst[0] = v[0]  # type: ignore[index]
            self.tables[0] = tables[slots[0]]
        else:
            for dst, v in zip(self.values, values):
                dst[:n] = v
            if slots is None:
                self.tables[:n] = tables
            else:
                tables.take(slots, axis=0, out=self.tables[:n])
        filled = self.filled
        if filled == n:
            return
        if filled is None or filled > n:  # rows past n may hold a wider fill's values
            end = None if filled is None else filled
            for k, dst in self.rows.items():
                dst[n:end] = nz[k]
            self.tables[n:end] = nz["block_tables"]
        if filled is None or filled < n:
            self.active[:n] = 1
        self.filled = n
