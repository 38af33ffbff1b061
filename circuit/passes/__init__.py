"""Passes: pure `Circuit -> Circuit` functions, one per file, named verb_object, run as a list.

`run_passes` optionally verifies after each pass and names the pass that broke the circuit.
"""
from __future__ import annotations

from typing import Callable, Sequence

from draft_circuit.circuit.ir import Circuit, CircuitError
from draft_circuit.circuit.passes.eliminate_dead_nodes import eliminate_dead_nodes
from draft_circuit.circuit.passes.fuse_add_rmsnorm import fuse_add_rmsnorm
from draft_circuit.circuit.passes.fuse_lm_head_argmax import fuse_lm_head_argmax
from draft_circuit.circuit.passes.fuse_linear_silu_mul import fuse_linear_silu_mul
from draft_circuit.circuit.passes.fuse_rope_kv_write import fuse_rope_kv_write
from draft_circuit.circuit.verify import verify

Pass = Callable[[Circuit], Circuit]

PASSES: dict[str, Pass] = {p.__name__: p for p in (
    eliminate_dead_nodes, fuse_add_rmsnorm, fuse_lm_head_argmax, fuse_rope_kv_write,
    fuse_linear_silu_mul)}

DEFAULT_PIPELINE: tuple[str, ...] = (
    "eliminate_dead_nodes", "fuse_add_rmsnorm", "fuse_lm_head_argmax", "fuse_rope_kv_write",
    "fuse_linear_silu_mul")


class PassError(CircuitError):
    """A pass produced a circuit that does not verify."""


def run_passes(circuit: Circuit, names: Sequence[str] = DEFAULT_PIPELINE, *,
               check: bool = True) -> Circuit:
    for i, name in enumerate(names):
        if name not in PASSES:
            raise PassError(f"unknown pass {name!r}; known: {', '.join(sorted(PASSES))}")
        circuit = PASSES[name](circuit)
        if check:
            try:
                verify(circuit)
            except CircuitError as e:
                after = f" (after {names[i - 1]})" if i else ""
                raise PassError(f"pass {name!r}, #{i + 1} of the pipeline{after}, produced an "
                                f"invalid circuit: {e}") from e
    return circuit
