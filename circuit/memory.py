"""Static arena planning: give each buffer an aligned offset in one arena such that no two buffers
live at a common schedule step share a byte. Pure functions over plain data; no torch.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


class MemoryPlanError(ValueError):
    """A malformed buffer set or an unsound placement; the message names the buffers involved."""


@dataclass(frozen=True)
class Buffer:
    """An intermediate written at step `first` and last read at step `last` (inclusive)."""

    name: str
    size_bytes: int
    first: int
    last: int

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise MemoryPlanError(f"buffer name must be a non-empty str, got {self.name!r}")
        for attr in ("size_bytes", "first", "last"):
            value = getattr(self, attr)
            if not isinstance(value, int) or isinstance(value, bool):
                raise MemoryPlanError(f"buffer {self.name!r}: {attr} must be an int, got {value!r}")
        if self.size_bytes < 0:
            raise MemoryPlanError(f"buffer {self.name!r}: size_bytes {self.size_bytes} < 0")
        if self.first > self.last:
            raise MemoryPlanError(
                f"buffer {self.name!r}: first step {self.first} > last step {self.last}")


@dataclass(frozen=True)
class Placement:
    """A plan as plain data: offsets by buffer name (sorted by name) and the arena it needs.

    `naive_bytes` is one slot per buffer, i.e. the sum of aligned sizes, so it is the arena a
    planner without reuse would need at the same alignment.
    """

    offsets: dict[str, int] = field(hash=False)
    arena_bytes: int
    lower_bound_bytes: int
    naive_bytes: int
    strategy: str
    alignment: int

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "offsets": dict(self.offsets)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Placement:
        return cls(**{**data, "offsets": dict(data["offsets"])})


def lower_bound(buffers: Iterable[Buffer], alignment: int = 256) -> int:
    """The peak, over steps, of the aligned bytes live at that step: no placement needs less."""
    events: list[tuple[int, int]] = []
    for buf in _validated(buffers, alignment):
        size = _align_up(buf.size_bytes, alignment)
        events += [(buf.first, size), (buf.last + 1, -size)]
    # at equal steps the negative (ending) deltas sort first: a buffer is dead the step after `last`
    live = peak = 0
    for _, delta in sorted(events):
        live += delta
        peak = max(peak, live)
    return peak


def place_greedy_by_size(buffers: Iterable[Buffer], alignment: int) -> dict[str, int]:
    """Largest first, each at the best-fit gap among already placed buffers it lives alongside."""
    order = sorted(_validated(buffers, alignment),
                   key=lambda b: (-b.size_bytes, b.first, b.last, b.name))
    return _place_in_order(order, alignment)


def place_by_lifetime(buffers: Iterable[Buffer], alignment: int) -> dict[str, int]:
    """In order of first use (larger first on ties), each at the best-fit gap likewise."""
    order = sorted(_validated(buffers, alignment),
                   key=lambda b: (b.first, -b.size_bytes, b.last, b.name))
    return _place_in_order(order, alignment)


# Tried in this order; on equal arenas the earlier one wins.
STRATEGIES: dict[str, Callable[[Iterable[Buffer], int], dict[str, int]]] = {
    "greedy_by_size": place_greedy_by_size,
    "by_lifetime": place_by_lifetime,
}


def plan_memory(buffers: Iterable[Buffer], alignment: int = 256) -> Placement:
    """Run every strategy and keep the smallest arena; depends only on the set of buffers."""
    bufs = _validated(buffers, alignment)
    best: tuple[int, str, dict[str, int]] | None = None
    for name, place in STRATEGIES.items():
        offsets = place(bufs, alignment)
        arena = max((offsets[b.name] + _align_up(b.size_bytes, alignment) for b in bufs), default=0)
        if best is None or arena < best[0]:
            best = (arena, name, offsets)
    assert best is not None  # STRATEGIES is never empty
    arena, name, offsets = best
    placement = Placement(
        offsets=offsets, arena_bytes=arena, lower_bound_bytes=lower_bound(bufs, alignment),
        naive_bytes=sum(_align_up(b.size_bytes, alignment) for b in bufs), strategy=name,
        alignment=alignment)
    check_placement(bufs, placement)  # a planner bug must surface here, not as corrupted tensors
    return placement


def check_placement(buffers: Iterable[Buffer], placement: Placement) -> None:
    """Raise MemoryPlanError unless every buffer has an aligned offset inside the arena and no two
    buffers live at a common step overlap in bytes."""
    bufs = _validated(buffers, placement.alignment)
    align, offsets = placement.alignment, placement.offsets
    if placement.arena_bytes % align:
        raise MemoryPlanError(f"arena_bytes {placement.arena_bytes} is not a multiple of {align}")
    unknown = sorted(set(offsets) - {b.name for b in bufs})
    if unknown:
        raise MemoryPlanError(f"offsets given for unknown buffers {unknown}")
    for buf in bufs:
        off = offsets.get(buf.name)
        if not isinstance(off, int) or isinstance(off, bool):
            raise MemoryPlanError(f"buffer {buf.name!r} has no integer offset (got {off!r})")
        if off < 0 or off % align:
            raise MemoryPlanError(
                f"buffer {buf.name!r}: offset {off} is not a non-negative multiple of {align}")
        if off + buf.size_bytes > placement.arena_bytes:
            raise MemoryPlanError(f"buffer {buf.name!r}: bytes [{off}, {off + buf.size_bytes}) "
                                  f"run past the arena of {placement.arena_bytes}")
    _check_no_live_overlap(bufs, offsets)


def _check_no_live_overlap(bufs: Sequence[Buffer], offsets: dict[str, int]) -> None:
    # sweep in order of first use; `active` holds the buffers still live at the current step
    active: list[Buffer] = []
    for buf in sorted(bufs, key=lambda b: (b.first, b.name)):
        active = [a for a in active if a.last >= buf.first]
        lo, hi = offsets[buf.name], offsets[buf.name] + buf.size_bytes
        for other in active:
            o_lo, o_hi = offsets[other.name], offsets[other.name] + other.size_bytes
            if lo < o_hi and o_lo < hi:  # empty ranges (size 0) never satisfy this
                raise MemoryPlanError(
                    f"buffers {other.name!r} (bytes [{o_lo}, {o_hi}), steps "
                    f"{other.first}..{other.last}) and {buf.name!r} (bytes [{lo}, {hi}), steps "
                    f"{buf.first}..{buf.last}) are both live at step {buf.first} and overlap "
                    f"in the arena")
        active.append(buf)


def _place_in_order(order: Sequence[Buffer], alignment: int) -> dict[str, int]:
    # (first, last, start, end) of each sized buffer placed: plain ints, since this scan is the
    # planner's inner loop (every buffer against every placed one, two strategies, each width)
    placed: list[tuple[int, int, int, int]] = []
    offsets: dict[str, int] = {}
    for buf in order:
        size = _align_up(buf.size_bytes, alignment)
        if size == 0:
            offsets[buf.name] = 0  # it occupies no bytes, so any aligned offset is sound
            continue
        lo, hi = buf.first, buf.last
        busy = sorted([(start, end) for first, last, start, end in placed
                       if first <= hi and lo <= last])
        at = offsets[buf.name] = _best_fit(busy, size)
        placed.append((lo, hi, at, at + size))
    return dict(sorted(offsets.items()))


def _best_fit(busy: Sequence[tuple[int, int]], size: int) -> int:
    """The start of the smallest free gap below `busy`'s top that holds `size` (lowest on ties),
    else the top. `busy` is sorted by start; its ranges may overlap one another."""
    best_waste, best_start = None, None
    cursor = 0
    for start, end in busy:
        gap = start - cursor
        if gap >= size and (best_waste is None or gap - size < best_waste):
            best_waste, best_start = gap - size, cursor
        cursor = max(cursor, end)
    return cursor if best_start is None else best_start


def _validated(buffers: Iterable[Buffer], alignment: int) -> list[Buffer]:
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1:
        raise MemoryPlanError(f"alignment must be an int >= 1, got {alignment!r}")
    bufs = list(buffers)
    seen: set[str] = set()
    for buf in bufs:
        if not isinstance(buf, Buffer):
            raise MemoryPlanError(f"expected a Buffer, got {buf!r}")
        if buf.name in seen:
            raise MemoryPlanError(f"buffer {buf.name!r} is defined twice")
        seen.add(buf.name)
    return bufs


def _align_up(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment
