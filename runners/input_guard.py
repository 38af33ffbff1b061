"""The runners' side of the in-graph input guard (issue 19 item 1; FAULTS 20, 25).

A draft chain's runner inputs are checked by value without a host sync: every run of a chain
circuit starts with one `input_guard` launch (ops/input_guard.py, a Triton kernel on CUDA and
under the interpreter, its torch reference elsewhere). It writes guarded copies of tokens,
block_tables, live_rows and active, which every other launch reads instead of the inputs, and in
which a bad row is inert: token 0, live 0, active 0, and every table entry the runner's scratch
block. So a bad value never writes outside its row's own blocks (it writes nothing at all) and
never reaches a gather: the row drafts -1 at every step and its KV rows are untouched. Its
confidences and hidden_out are those of an inert row, as for padding: meaningless, not zero.

The first fault is kept in a sticky int32[8] record on the device. `check_faults()` reads it (a
small device-to-host copy: call it where the host syncs anyway), clears it, and raises
`RunnerInputError` naming the row, the input and the value. The guard is always on for chain
circuits (inputs tokens, block_tables, live_rows, active and a k_cache state): one launch per
run, not per draft step; `guard=False` on a runner turns it off (benchmarks/guard_cost.py).
"""
from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence, runtime_checkable

import torch

from draft_circuit.circuit.ir import Circuit
from draft_circuit.ops.input_guard import FAULT_INPUTS, FAULT_WORDS, GuardAttrs
from draft_circuit.ops.registry import get_op
from draft_circuit.runners.input_values import RunnerInputError, chain_bounds

__all__ = ["GUARDED", "FaultChecking", "InputGuard", "check_copied_faults", "check_runner_faults",
           "fault_record"]

#: the inputs the guard copies; launches read the guarded copies of these
GUARDED = ("tokens", "block_tables", "live_rows", "active")
OP = "input_guard"


@runtime_checkable
class FaultChecking(Protocol):
    """A runner whose device-side guard may hold a fault the host has not read yet."""

    def check_faults(self) -> None:
        """Raise `RunnerInputError` for the first fault since the last check, and clear it."""
        ...


def check_runner_faults(runner: object) -> None:
    """`runner.check_faults()` for a runner that has a guard (any other has nothing to check)."""
    # what isinstance(runner, FaultChecking) tests, without a runtime Protocol check's cost
    # (microseconds: this runs once a propose)
    check = getattr(runner, "check_faults", None)
    if callable(check):
        check()


def _reference_launch(ins: list[torch.Tensor], outs: list[torch.Tensor], ws: list[torch.Tensor],
                      attrs: Any) -> None:
    for dst, src in zip(outs, get_op(OP).reference(ins, attrs)):
        if dst is not src:
            dst.copy_(src)


class InputGuard:
    """One runner's guard: its bounds (`attrs`), its fault record, and the launch that runs it."""

    def __init__(self, attrs: GuardAttrs, capacity: int, device: torch.device,
                 select_for: str) -> None:
        """`capacity`: KV rows a table holds (max_blocks * block_size); `select_for`: the
        planner's kernel target ("cuda", "interpret" or "cpu")."""
        self.attrs, self.capacity = attrs, capacity
        self.faults = torch.zeros(FAULT_WORDS, dtype=torch.int32, device=device)
        # on CPU the record's numpy view: a clear record is told by one scalar read, not a
        # tolist (a torch call, a microsecond or more, twice a decode step)
        self._word = self.faults.numpy() if self.faults.device.type == "cpu" else None
        binding = get_op(OP).kernels[0]
        use_kernel = binding.applies(select_for, [], attrs)
        self.kernel = binding.name if use_kernel else "reference"
        self.launch = binding.launch if use_kernel else _reference_launch

    @classmethod
    def for_circuit(cls, circuit: Circuit, states: Mapping[str, torch.Tensor],
                    params: Mapping[str, torch.Tensor], *, scratch_block: int, device: torch.device,
                    select_for: str) -> "InputGuard | None":
        """The guard of a draft chain (None for any other circuit); `ValueError` when the scratch
        block is not a block of the chain's pool."""
        bounds = chain_bounds(circuit, states, params)
        if bounds is None:
            return None
        attrs = GuardAttrs(vocab=bounds.vocab or 0, num_blocks=bounds.num_blocks,
                           block_size=bounds.block_size, steps=bounds.steps,
                           scratch_block=scratch_block)
        return cls(attrs, bounds.max_blocks * bounds.block_size, device, select_for)

    def run(self, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The guarded copies of `inputs`' four guarded entries (fresh tensors; the eager path)."""
        ins = [inputs[k] for k in GUARDED]
        outs = [torch.empty_like(t) for t in ins]
        self.launch([*ins, self.faults], [*outs, self.faults], [], self.attrs)
        return dict(zip(GUARDED, outs))

    def check(self) -> None:
        """Read the record (one small device-to-host copy), clear it, raise for a fault."""
        if self._word is not None and not self._word[0]:
            return  # CPU: no fault recorded
        record = self.faults.tolist()
        if record[0]:
            self.faults.zero_()
            raise self.error(record)

    def error(self, record: list[int]) -> RunnerInputError:
        """The typed error of a record whose word 0 is a fault code."""
        code, row, value, entry, width, bad, runs = record[:7]
        a = self.attrs
        if code == 1:
            what = f"token {value} is outside the vocabulary [0, {a.vocab})"
        elif code == 2:
            what = (f"live_rows {value} must be in 0..{self.capacity - a.steps} (the chain writes "
                    f"{a.steps} rows past it into a table of {self.capacity} rows)")
        else:
            what = (f"block id {value} at table entry {entry} (a block the row reads or writes) "
                    f"is outside the pool [0, {a.num_blocks})")
        return RunnerInputError(
            f"row {row}: {what}; found on the device by the input guard in a {width}-row run, "
            f"where that row ran inert (drafts -1, no KV written; {bad} bad row(s) in that run, "
            f"{runs} faulted run(s) since the last check)",
            row=row, input=FAULT_INPUTS[code], value=value)


def fault_record(runner: object) -> torch.Tensor | None:
    """A runner's device fault record (`CircuitDraftRunner.fault_record`), None for a runner
    that keeps none (the eager oracle raises in its run; a host's own runner is asked with
    `check_faults` instead)."""
    get = getattr(runner, "fault_record", None)
    record = get() if callable(get) else None
    return record if isinstance(record, torch.Tensor) else None


def check_copied_faults(runners: Sequence[object], host: torch.Tensor) -> None:
    """After a read that brought each runner's fault record to `host` (row i runner i's, for
    the runners with a record, in order): a runner whose copy shows a fault raises it through
    its own `check_faults` (which reads, clears and names it); a runner without a record is
    asked directly."""
    i = 0
    for r in runners:
        if fault_record(r) is None:
            check_runner_faults(r)
            continue
        if int(host[i, 0]):
            check_runner_faults(r)
        i += 1
