"""Passes: pure `Circuit -> Circuit` functions named verb_object, run as a list. Dead-node
elimination is its own file; every fusion is a row of the table in `fusions.py`, run by the one
driver in `fuse.py` and listed here under the row's name.

`run_passes` optionally verifies after each pass and names the pass that broke the circuit.
"""
from __future__ import annotations

from typing import Callable, Sequence

from draft_circuit.circuit.ir import Circuit, CircuitError
from draft_circuit.circuit.passes.eliminate_dead_nodes import eliminate_dead_nodes
from draft_circuit.circuit.passes.fusions import FUSIONS
from draft_circuit.circuit.verify import verify

Pass = Callable[[Circuit], Circuit]

PASSES: dict[str, Pass] = {"eliminate_dead_nodes": eliminate_dead_nodes,
                           **{row.name: row.as_pass() for row in FUSIONS}}

DEFAULT_PIPELINE: tuple[str, ...] = (
    "eliminate_dead_nodes", "fuse_linear_add", "fuse_add_rmsnorm", "fuse_lm_head_argmax",
    "fuse_rope_kv_write", "fuse_rope_k_kv_write", "fuse_linear_silu_mul", "fuse_qkv", "fuse_kv",
    "fuse_concat_linear", "fuse_argmax_keep", "fuse_rmsnorm_qkv", "fuse_rmsnorm_kv",
    "fuse_rmsnorm_silu_mul", "fuse_rmsnorm_argmax_keep",
    "fuse_rmsnorm_argmax", "fuse_argmax_last", "fuse_argmax_gate", "fuse_argmax_last_gate",
    "fuse_embed_concat_linear")

# rows of the table that are passes but not in the default pipeline; a plan opts in by naming
# them in CompileOptions.pipeline. fuse_qkv_rope_kv_write: kernels.qkv_rope is bitwise equal to
# the two launches it replaces under the interpreter, but on the H200 (Triton 3.6) it failed to
# compile when q_out and the caches differ in dtype and gave wrong values at 8B shapes (GPU run of
# 2026-12-02), so the default keeps rmsnorm_linear_qkv + rope_kv_write until it is fixed there.
OPT_IN: tuple[str, ...] = ("fuse_qkv_rope_kv_write",)


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
