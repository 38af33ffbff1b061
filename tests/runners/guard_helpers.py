"""What the input-guard tests share (the CPU and CUDA guard tests, the proposer's staging tests):
a batch's inputs with one value set (`edited`), the same batch with a row made inert by hand the
way the guard makes it (`inert`: padding's neutral fill onto the scratch block), the checks that a
bad row ran inert (`assert_ran_inert`) and was reported once (`assert_reported_once`), and
`PendingFault`, a DraftRunner that runs the real one and then holds a fault until its
check_faults() is asked, as a GPU runner whose guard fired would."""
from __future__ import annotations

from typing import Mapping

import pytest
import torch

from draft_circuit.circuit.layers.mtp import KvLayout
from draft_circuit.runners.input_values import RunnerInputError
from draft_circuit.runners.testing import DraftBatch

SCRATCH = 0  # the scratch block every guard test hands its runners


def edited(batch: DraftBatch, name: str, row: int, col: int | None, value: int) -> dict[str, torch.Tensor]:
    """A copy of the batch's inputs with `name[row]` (or `name[row, col]`) set to `value`."""
    inputs = {k: v.clone() for k, v in batch.inputs.items()}
    if col is None:
        inputs[name][row] = value
    else:
        inputs[name][row, col] = value
    return inputs


def inert(batch: DraftBatch, row: int) -> dict[str, torch.Tensor]:
    """What the guard makes of a bad row, by hand: the neutral fill of padding (token 0, no
    live rows, inactive, every table entry the scratch block)."""
    inputs = {k: v.clone() for k, v in batch.inputs.items()}
    inputs["tokens"][row], inputs["live_rows"][row], inputs["active"][row] = 0, 0, 0
    inputs["block_tables"][row] = SCRATCH
    return inputs


def assert_ran_inert(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor],
                     states: Mapping[str, torch.Tensor], want_states: Mapping[str, torch.Tensor],
                     before: Mapping[str, torch.Tensor], batch: DraftBatch, row: int, *, kv: KvLayout,
                     num_drafts: int) -> None:
    """The run with bad `row` (outputs `got`, pool `states`, which held `before`) is the run with
    that row made inert by hand (`want`, `want_states`): the row drafts nothing (-1s), every
    output and the whole pool are bitwise the same, and no block outside the good rows' own
    (their live rows and drafts) changed."""
    assert got["drafts"][row].eq(-1).all()
    for k in want:
        assert torch.equal(got[k], want[k]), k
    own: set[int] = set()
    for r in (r for r in range(len(batch.lives)) if r != row):
        used = (batch.lives[r] + num_drafts - 1) // kv.block_size + 1
        own |= set(batch.inputs["block_tables"][r, :used].tolist())
    for k in states:
        untouched = torch.tensor([b for b in range(kv.num_blocks) if b not in own], device=states[k].device)
        assert torch.equal(states[k], want_states[k]), k
        assert torch.equal(states[k][untouched], before[k][untouched]), k


def assert_reported_once(runner, message: str, row: int, name: str, value: int) -> RunnerInputError:
    """runner.check_faults() raises RunnerInputError matching `message` with its row, input and
    value, then nothing (the record is cleared); returns the error for further checks."""
    with pytest.raises(RunnerInputError, match=message) as err:
        runner.check_faults()
    assert (err.value.row, err.value.input, err.value.value) == (row, name, value)
    runner.check_faults()  # cleared: nothing pending
    return err.value


class PendingFault:
    """A DraftRunner that runs the real one and then holds a fault, RunnerInputError(message,
    row=, input=, value=), raised by the next check_faults() only, as a GPU runner whose guard
    fired would until the host reads its record (it keeps no device record: it is asked);
    `checks` counts the check_faults() calls."""

    def __init__(self, runner, message: str, *, row: int, input: str, value: int):
        self.runner, self.pending, self.checks = runner, False, 0
        self.fault = dict(message=message, row=row, input=input, value=value)
        self.widths, self.max_width = runner.widths, runner.max_width
        self.serves, self.plan = runner.serves, runner.plan

    def run(self, n, inputs):
        self.pending = True
        return self.runner.run(n, inputs)

    def check_faults(self):
        self.checks += 1
        if self.pending:
            self.pending = False
            f = self.fault
            raise RunnerInputError(f["message"], row=f["row"], input=f["input"], value=f["value"])
