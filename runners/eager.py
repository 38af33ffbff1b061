"""`EagerRunner`: the oracle. Interprets a circuit node by node with the ops' torch references,
at any width, on CPU or CUDA, freeing each value after its last use. A failing node is re-raised
as a `RunError` "while running node N (op, input shapes)". `EagerDraftRunner` puts it behind the
`DraftRunner` protocol, so callers run the oracle and compiled runners through one call."""
from __future__ import annotations

from typing import Any, Mapping, Sequence

import torch

from draft_circuit.circuit.ir import ROW, Circuit, Node
from draft_circuit.circuit.verify import verify
from draft_circuit.ops.registry import get_op
from draft_circuit.ops.collectives import eager_collective
from draft_circuit.circuit.binding import (WidthError, check_inputs, check_params, check_states,
                                           state_view)
from draft_circuit.runners.input_guard import InputGuard
from draft_circuit.runners.protocol import WidthPlan


class RunError(RuntimeError):
    """A node failed while running; the original error is the cause."""


def last_uses(order: tuple[Node, ...], keep: set[str]) -> dict[int, list[str]]:
    """Step index -> values whose last reader is that step (values in `keep` are never freed)."""
    last: dict[str, int] = {}
    for i, node in enumerate(order):
        for v in node.inputs:
            last[v] = i
        for v in node.outputs:
            last.setdefault(v, i)  # written but never read: free right after
    freed: dict[int, list[str]] = {}
    for v, i in last.items():
        if v not in keep:
            freed.setdefault(i, []).append(v)
    return freed


def describe(node: Node, tensors: Sequence[object]) -> str:
    shapes = ", ".join(f"{tuple(t.shape)}:{str(t.dtype).replace('torch.', '')}"
                       if isinstance(t, torch.Tensor) else repr(t) for t in tensors)
    return f"node {node.name!r} ({node.op}; inputs {shapes})"


class EagerRunner:
    """Binds params and states once; `run(inputs)` returns the circuit's non-state outputs.

    States are mutated in place (a state with a row dim is bound at max width; a call at
    width n touches its first n rows). Returned tensors are fresh: later calls never overwrite them.
    Collectives run on `group` (None: torch.distributed's default group where a node was emitted
    for several ranks); every other node, and a one-process collective, by its reference.
    A draft chain runs its input guard's reference first, as the compiled runners run its kernel
    (runners/input_guard.py): a bad row runs inert, and `run` raises `RunnerInputError` naming
    it after the run (`defer_faults=True`: at `check_faults()`, as on a GPU).
    """

    def __init__(self, circuit: Circuit, params: Mapping[str, torch.Tensor],
                 states: Mapping[str, torch.Tensor], group: Any = None, *,
                 scratch_block: int = 0) -> None:
        verify(circuit)  # the oracle refuses what the compiled runners refuse (a temp output)
        check_params(circuit, params)
        check_states(circuit, states)
        self.circuit, self.params, self.states = circuit, dict(params), dict(states)
        self.order = circuit.topo_order()
        keep = set(circuit.outputs)
        self._free = last_uses(self.order, keep)
        self._attrs = [get_op(n.op).parse_attrs(n.attrs) for n in self.order]
        self._refs = [eager_collective(get_op(n.op), a, group) or get_op(n.op).reference
                      for n, a in zip(self.order, self._attrs)]
        self.outputs = tuple(o for o in circuit.outputs if circuit.value(o).kind != "state")
        pool = self.states.get("k_cache")
        self.guard = InputGuard.for_circuit(
            circuit, self.states, self.params, scratch_block=scratch_block, select_for="cpu",
            device=pool.device if pool is not None else torch.device("cpu"))

    def run(self, inputs: Mapping[str, torch.Tensor], keep: tuple[str, ...] = (), *,
            defer_faults: bool = False) -> dict[str, torch.Tensor]:
        """`keep` names intermediates to return too (tests read logits to find near ties)."""
        width = check_inputs(self.circuit, inputs)
        if self.guard is not None:  # the nodes read the guarded copies, as in a program
            inputs = {**inputs, **self.guard.run(inputs)}
        env: dict[str, torch.Tensor] = {**self.params, **inputs}
        for name, t in self.states.items():
            env[name] = state_view(self.circuit, name, t, width)
        for i, (node, attrs) in enumerate(zip(self.order, self._attrs)):
            args = [env[x] for x in node.inputs]
            try:
                outs = self._refs[i](args, attrs)
            except Exception as e:
                raise RunError(f"while running {describe(node, args)} at width {width}: "
                               f"{type(e).__name__}: {e}") from e
            for name, t in zip(node.outputs, outs):
                self._check_out(node, name, t, width)
                env[name] = t
            for name in self._free.get(i, ()):
                if name not in keep:
                    env.pop(name, None)
        if not defer_faults:
            self.check_faults()
        return {o: env[o] for o in (*self.outputs, *keep)}

    def check_faults(self) -> None:
        """Raise `RunnerInputError` for the first bad row the guard found since the last check
        (and clear it); nothing for a circuit without a guard."""
        if self.guard is not None:
            self.guard.check()

    def _check_out(self, node: Node, name: str, t: torch.Tensor, width: int) -> None:
        want = self.circuit.value(name).spec.concrete({ROW: width})
        if tuple(t.shape) != want:  # an op whose reference disagrees with its own shape rule
            raise RunError(f"while running node {node.name!r} ({node.op}): output {name!r} has "
                           f"shape {tuple(t.shape)}, its shape rule says {want}")



class EagerDraftRunner:
    """The oracle behind the `DraftRunner` protocol: every width 1..circuit.max_width is served,
    each by interpreting the circuit at that width (plan kind "eager"). Outputs are fresh
    tensors, never overwritten by a later run."""

    def __init__(self, circuit: Circuit, params: Mapping[str, torch.Tensor],
                 states: Mapping[str, torch.Tensor]) -> None:
        self.eager = EagerRunner(circuit, params, states)
        self.circuit = circuit

    @property
    def max_width(self) -> int:
        return self.circuit.max_width

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(range(1, self.max_width + 1))

    def serves(self, n: int) -> bool:
        return isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= self.max_width

    def plan(self, n: int) -> WidthPlan:
        if not self.serves(n):
            raise WidthError(f"width {n!r} is not served (the eager runner serves 1..{self.max_width})")
        return WidthPlan("eager", ((n, n),), 0.0)

    def run(self, n: int, inputs: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.plan(n)
        if check_inputs(self.circuit, inputs) != n:
            raise WidthError(f"run({n}) was given inputs of another width")
        return self.eager.run(inputs)

    def check_faults(self) -> None:
        """Nothing is ever pending: `run` raises a bad row's `RunnerInputError` itself."""
        self.eager.check_faults()
