"""Kernel bindings as data: what a binding is (`KernelBinding`), when it applies (`Applies`:
devices, float dtypes, shape and attr conditions), and the one lazy import of kernel modules.

Each op declares its bindings beside its `OpDef` (`kernels=`), in the order the planner tries
them; nothing else binds a kernel to an op. Triton kernels apply on CUDA and, when the planner is
asked to (tests), on CPU under the interpreter ("interpret"); the torch bindings are capturable
destination-passing versions of references that would sync the host. Bindings marked
`width_independent=False` (cuBLAS) are chosen only when the planner's option is off.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cache
from typing import Any, Callable, Sequence

import torch

from draft_circuit.circuit.types import DTYPES, TensorSpec

# Every float dtype of the IR, spelled out (tests check it against DTYPES and torch): a dtype is
# never judged float by its name.
FLOAT_DTYPES: frozenset[str] = frozenset({"float32", "float16", "bfloat16", "float8_e4m3fn"})
# The floats a kernel takes unless its binding says otherwise: fp8 is not one of them.
KERNEL_FLOATS: frozenset[str] = frozenset({"float32", "float16", "bfloat16"})
TRITON: frozenset[str] = frozenset({"cuda", "interpret"})
CUDA: frozenset[str] = frozenset({"cuda"})

assert FLOAT_DTYPES <= set(DTYPES) and KERNEL_FLOATS <= FLOAT_DTYPES  # internal invariant


def kernel(module: str, name: str) -> Callable[[], Any]:
    """A getter for draft_circuit.kernels.<module>.<name>, imported on first call (so importing the
    registry never imports triton). The one way op modules reach a kernel."""
    return cache(lambda: getattr(importlib.import_module(f"draft_circuit.kernels.{module}"), name))


@dataclass(frozen=True)
class Condition:
    """One requirement beyond device and dtypes, stated positively ("block_size a power of two
    >= 8"); `holds(in_specs, attrs)` tests it on the node's input specs and parsed attrs."""

    what: str
    holds: Callable[[Sequence[TensorSpec], Any], bool]


@dataclass(frozen=True)
class Applies:
    """When a kernel may be chosen: the device is one of `devices`, every float input is one of
    `floats`, and every condition holds. The planner checks this, so a kernel that would refuse
    a launch (a block size, a vocabulary too large) is never planned."""

    devices: frozenset[str]
    floats: frozenset[str] = KERNEL_FLOATS
    conditions: tuple[Condition, ...] = ()

    def why_not(self, device: str, ins: Sequence[TensorSpec], attrs: Any) -> str | None:
        """None if the kernel applies, else the first requirement that fails."""
        if device not in self.devices:
            return f"runs on {', '.join(sorted(self.devices))}, not {device}"
        for s in ins:
            if s.dtype in FLOAT_DTYPES and s.dtype not in self.floats:
                return f"takes floats {', '.join(sorted(self.floats))}; got {s}"
        return next((f"needs {c.what}" for c in self.conditions if not c.holds(ins, attrs)), None)

    def __call__(self, device: str, ins: Sequence[TensorSpec], attrs: Any) -> bool:
        return self.why_not(device, ins, attrs) is None


Tensors = list[torch.Tensor]
# (inputs, outputs, workspace, parsed attrs): writes the outputs (and mutated states) in place
Launch = Callable[[Tensors, Tensors, Tensors, Any], None]
Scratch = list[tuple[str, tuple[int, ...]]]  # (dtype, shape) of each workspace buffer
# (input specs, symbol values, parsed attrs) -> the scratch buffers a launch needs
WorkspaceRule = Callable[[Sequence[TensorSpec], dict[str, int], Any], Scratch]


@dataclass(frozen=True)
class KernelBinding:
    """A kernel for an op: `launch(inputs, outputs, workspace, attrs)` writes into preallocated
    outputs (destination passing; absent optional inputs are simply not in `inputs`).

    `applies(device, in_specs, attrs)` says when it may be chosen; `workspace(in_specs, env,
    attrs)` gives scratch buffers (dtype, shape) the planner preallocates, passed after outputs.
    """

    name: str
    launch: Launch
    applies: Applies
    workspace: WorkspaceRule | None = None
    width_independent: bool = True  # a row's bits never depend on the other rows in the launch
