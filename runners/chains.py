"""The proposer's chain runners: what a runner of one draft chain binds (`DraftBinding`), the
factories that build one (compiled programs, or the eager oracle), and `ChainRunners`, which
keeps one runner per chain with the host's installed runners (`set_circuit_draft`) first.

A chain is keyed by (num_drafts, bitmask). The one-step chain also writes catch-up rows, whose
rows of one sequence must run in row order: its binding says so (`row_order`), and a compiled
runner for it pads but never splits (a split runs its parts highest rows first).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from draft_circuit.circuit.ir import Circuit
from draft_circuit.circuit.planner import compile_draft
from draft_circuit.runners.draft import CircuitDraftRunner, WidthPolicy
from draft_circuit.runners.eager import EagerDraftRunner
from draft_circuit.runners.protocol import DraftRunner

ChainKey = tuple[int, bool]  # (num_drafts, bitmask)


@dataclass(frozen=True)
class DraftBinding:
    """A draft chain and everything a runner of it binds: what a host compiles for `--forward
    circuit`. `states` are the proposer's pools (drafter KV, embed target): a runner must be
    bound to these very tensors, or the proposer's rows would live elsewhere."""

    circuit: Circuit
    params: Mapping[str, torch.Tensor]
    states: Mapping[str, torch.Tensor]
    scratch_block: int
    row_order: bool                     # rows of one sequence run in row order: pad, never split
    notes: dict[str, Any] = field(default_factory=dict)  # the layer's plan-report notes


class RunnerFactory(Protocol):
    def __call__(self, binding: DraftBinding) -> DraftRunner: ...


def eager_runner(binding: DraftBinding) -> DraftRunner:
    """The oracle for a chain (`--forward eager`)."""
    return EagerDraftRunner(binding.circuit, binding.params, binding.states)


def compile_chain(binding: DraftBinding, widths: Sequence[int], *, device: str) -> CircuitDraftRunner:
    """Compile a chain for `widths` and run it behind the width policy its binding allows (CUDA
    graphs on a GPU, programs on CPU): what a host installs with `set_circuit_draft`."""
    compiled = compile_draft(binding.circuit, binding.params, widths, device=device,
                             notes=binding.notes)
    return CircuitDraftRunner(compiled, binding.states, scratch_block=binding.scratch_block,
                              policy=WidthPolicy(allow_split=not binding.row_order))


def compiled_runners(widths: Sequence[int], *, device: str) -> RunnerFactory:
    """A factory compiling every chain it is asked for at `widths` (`--forward circuit`)."""
    def build(binding: DraftBinding) -> DraftRunner:
        return compile_chain(binding, widths, device=device)
    return build


class ChainRunners:
    """One runner per chain key: an installed runner if the host gave one, else the factory's,
    built on first use and kept."""

    def __init__(self, bind: Callable[[int, bool], DraftBinding], factory: RunnerFactory) -> None:
        self._bind, self.factory = bind, factory
        self._built: dict[ChainKey, DraftRunner] = {}
        self._installed: dict[ChainKey, DraftRunner] = {}

    def get(self, num_drafts: int, bitmask: bool) -> DraftRunner:
        key = (num_drafts, bitmask)
        if key in self._installed:
            return self._installed[key]
        if key not in self._built:
            self._built[key] = self.factory(self._bind(num_drafts, bitmask))
        return self._built[key]

    def install(self, key: ChainKey, runner: DraftRunner) -> None:
        self._installed[key] = runner

    def reset(self, factory: RunnerFactory) -> None:
        """Drop every runner (installed or built); later chains come from `factory`."""
        self.factory = factory
        self._built.clear()
        self._installed.clear()

    @property
    def installed(self) -> dict[ChainKey, DraftRunner]:
        return dict(self._installed)
