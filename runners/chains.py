"""The proposer's chain runners: what a runner of one draft chain binds (`DraftBinding`), the
factories that build one (compiled programs, or the eager oracle), and `ChainRunners`, which
keeps one runner per chain with the host's installed runners (`set_circuit_draft`) first.

A chain is keyed by (num_drafts, bitmask). The one-step chain also writes catch-up rows, whose
rows of one sequence must run in row order: its binding says so (`row_order`), and a compiled
runner for it pads but never splits (a split runs its parts highest rows first).

Catch-up and prefill rows need only their K/V: they run on the KV-only chain (`KV_ONLY_KEY`),
the one-step circuit with only its state writes as outputs (planner.kv_only_circuit), which
writes bitwise the rows the one-step chain writes; its runner pads but never splits either. It
reaches past the proposer's widths (`kv_only_widths`): a step's catch-up rows are one run.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch

from draft_circuit.circuit.ir import Circuit
from draft_circuit.circuit.planner import CompiledDraft, compile_draft
from draft_circuit.runners.draft import CircuitDraftRunner, WidthPolicy
from draft_circuit.runners.eager import EagerDraftRunner
from draft_circuit.runners.protocol import DraftRunner

ChainKey = tuple[int, bool]  # (num_drafts, bitmask)
#: the KV-only one-step chain (catch-up and prefill rows): no drafts, no bitmask
KV_ONLY_KEY: ChainKey = (0, False)


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
    family: str | None = None           # KV_ONLY: a derived family of the one-step chain
    # the widths to compile it at when not the factory's: the KV-only chain's reach past the
    # proposer's widths (`kv_only_widths`)
    widths: tuple[int, ...] | None = None


def kv_only_widths(widths: Sequence[int], num_drafts: int) -> tuple[int, ...]:
    """The KV-only chain's widths: the proposer's, then doubling past the widest up to the
    catch-up rows of a whole step, (k + 1) x widest (a sequence's last token and k accepted
    drafts), so a step's catch-up is one run rather than one per `max(widths)` rows (every run
    has a fixed host cost: staging, the guard, a launch list or a graph replay; issue 14)."""
    ws = sorted(set(widths))
    top = ws[-1] * (max(num_drafts, 1) + 1)
    w = ws[-1] * 2
    while w < top:
        ws.append(w)
        w *= 2
    return (*ws, top) if ws[-1] < top else tuple(ws)


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
    one_step: list[CompiledDraft] = []  # the latest one-step chain compiled here

    def build(binding: DraftBinding) -> DraftRunner:
        runner = compile_chain(binding, binding.widths or widths, device=device)
        if binding.family is not None and one_step:
            one_step[-1].add_family(binding.family, runner.compiled)  # its report lists it
        elif binding.row_order:
            one_step.append(runner.compiled)
        return runner
    return build


class ChainRunners:
    """One runner per chain key: an installed runner if the host gave one, else the factory's,
    built on first use and kept."""

    def __init__(self, bind: Callable[[int, bool], DraftBinding], factory: RunnerFactory,
                 bind_kv_only: Callable[[], DraftBinding] | None = None) -> None:
        self._bind, self.factory, self._bind_kv_only = bind, factory, bind_kv_only
        self._built: dict[ChainKey, DraftRunner] = {}
        self._installed: dict[ChainKey, DraftRunner] = {}

    def get(self, num_drafts: int, bitmask: bool) -> DraftRunner:
        key = (num_drafts, bitmask)
        if key in self._installed:
            return self._installed[key]
        if key not in self._built:
            self._built[key] = self.factory(self._bind(num_drafts, bitmask))
        return self._built[key]

    def kv_only(self) -> tuple[DraftRunner, bool]:
        """The runner of catch-up rows and whether it is the KV-only chain: an installed KV-only
        runner, else the host's installed one-step runner (its compile, its choice; it writes
        the same rows), else the KV-only chain built on first use (without a KV-only binding,
        the one-step chain). Compiled beside a compiled one-step chain, it is listed in that
        chain's plan report as the `KV_ONLY` program family (`compiled_runners`)."""
        if KV_ONLY_KEY in self._installed:
            return self._installed[KV_ONLY_KEY], True
        if (1, False) in self._installed or self._bind_kv_only is None:
            return self.get(1, False), False
        if KV_ONLY_KEY not in self._built:
            self.get(1, False)  # built first: a compiling factory lists the family in its report
            self._built[KV_ONLY_KEY] = self.factory(self._bind_kv_only())
        return self._built[KV_ONLY_KEY], True

    def install(self, key: ChainKey, runner: DraftRunner) -> None:
        self._installed[key] = runner

    def uninstall(self, key: ChainKey) -> DraftRunner | None:
        """Remove the host's runner of one chain (the built one serves it again); returns it."""
        return self._installed.pop(key, None)

    def reset(self, factory: RunnerFactory) -> None:
        """Drop every runner (installed or built); later chains come from `factory`."""
        self.factory = factory
        self._built.clear()
        self._installed.clear()

    @property
    def installed(self) -> dict[ChainKey, DraftRunner]:
        return dict(self._installed)

    def runners(self) -> list[DraftRunner]:
        """Every runner held: installed ones, then those built (each once)."""
        seen: list[DraftRunner] = []
        for r in (*self._installed.values(), *self._built.values()):
            if not any(r is s for s in seen):
                seen.append(r)
        return seen
