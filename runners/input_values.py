"""Runner inputs checked by value at the runner's entry, the CPU half of FAULTS 25 / issue 19 item 1.

Shape and dtype checks (circuit/binding.py) cannot see a `-1` block id at a live row (it would
overwrite the pool's last block), `live_rows` negative or past the table's end (a write into
another sequence's block), or a token outside the vocabulary (embedded as zeros, or an
unchecked gather on CUDA). For a draft chain (inputs tokens, block_tables, live_rows, active and
a paged k_cache state) `InputValueCheck` refuses each with `RunnerInputError` naming the row and
value, before anything runs. Reading values syncs the host with a GPU, so the ProgramRunner runs
it on CPU only; on every device the runners also run the in-graph guard (runners/input_guard.py),
which makes such a row inert on the device and raises the same error at `check_faults()`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from draft_circuit.circuit.ir import Circuit

__all__ = ["ChainBounds", "InputValueCheck", "RunnerInputError", "chain_bounds"]

_CHAIN_INPUTS = ("tokens", "block_tables", "live_rows", "active")


class RunnerInputError(ValueError):
    """A runner input whose value would write outside its row's own blocks or embed garbage:
    `row`, `input` (its name) and `value` say which (None where a message names no row)."""

    def __init__(self, message: str, *, row: int | None = None, input: str | None = None,
                 value: int | None = None) -> None:
        super().__init__(message)
        self.row, self.input, self.value = row, input, value


@dataclass(frozen=True)
class ChainBounds:
    """The static bounds a draft chain's runner inputs are checked against."""

    vocab: int | None   # None: the chain has no embedding table to bound its tokens
    num_blocks: int
    block_size: int
    steps: int          # KV rows the chain writes past live_rows (one per step)
    max_blocks: int     # block table entries per row


def chain_bounds(circuit: Circuit, states: Mapping[str, torch.Tensor],
                 params: Mapping[str, torch.Tensor]) -> ChainBounds | None:
    """The bounds of a draft chain (inputs tokens, block_tables, live_rows, active and a paged
    k_cache state); None for any other circuit (an engine target names its pools per layer)."""
    names = {v.name for v in circuit.values if v.kind == "input"}
    if not set(_CHAIN_INPUTS) <= names or "k_cache" not in states:
        return None
    # the chain writes KV rows live .. live + steps - 1, one per step scope (s0, s1, ...)
    steps = len({n.name.split(".", 1)[0] for n in circuit.nodes if n.op.endswith("kv_write")})
    pool = states["k_cache"]
    embed = params.get("embed_tokens.weight")
    return ChainBounds(int(embed.shape[0]) if embed is not None else None, int(pool.shape[0]),
                       int(pool.shape[1]), max(steps, 1),
                       int(circuit.value("block_tables").shape[1]))


class InputValueCheck:
    """The value checks a draft chain's inputs get; `for_circuit` gives None for other circuits."""

    def __init__(self, vocab: int | None, num_blocks: int, block_size: int, steps: int) -> None:
        self.vocab, self.num_blocks, self.block_size, self.steps = vocab, num_blocks, block_size, steps

    @classmethod
    def for_circuit(cls, circuit: Circuit, states: Mapping[str, torch.Tensor],
                    params: Mapping[str, torch.Tensor]) -> "InputValueCheck | None":
        b = chain_bounds(circuit, states, params)
        return None if b is None else cls(b.vocab, b.num_blocks, b.block_size, b.steps)

    def __call__(self, inputs: Mapping[str, torch.Tensor]) -> None:
        tokens, active = inputs["tokens"], inputs["active"]
        tables, live = inputs["block_tables"], inputs["live_rows"]
        if self.vocab is not None:
            bad = ((tokens < 0) | (tokens >= self.vocab)).nonzero().flatten()
            if len(bad):
                r = int(bad[0])
                raise RunnerInputError(f"row {r}: token {int(tokens[r])} is outside the "
                                       f"vocabulary [0, {self.vocab})", row=r, input="tokens",
                                       value=int(tokens[r]))
        capacity = tables.shape[1] * self.block_size
        for r in (active != 0).nonzero().flatten().tolist():
            rows = int(live[r])
            if rows < 0 or rows + self.steps > capacity:
                raise RunnerInputError(
                    f"row {r}: live_rows {rows} must be in 0..{capacity - self.steps} (the chain "
                    f"writes {self.steps} rows past it into a table of {capacity} rows)",
                    row=r, input="live_rows", value=rows)
            used = tables[r, :(rows + self.steps - 1) // self.block_size + 1]
            bad = ((used < 0) | (used >= self.num_blocks)).nonzero().flatten()
            if len(bad):
                j = int(bad[0])
                raise RunnerInputError(
                    f"row {r}: block id {int(used[j])} at table entry {j} (a block the row reads "
                    f"or writes) is outside the pool [0, {self.num_blocks})",
                    row=r, input="block_tables", value=int(used[j]))
