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
    # GPU kernels one call issues (a split kernel and its merge: 2; a torch binding: the aten
    # kernels it runs, which may depend on its optional inputs), so plan reports count what the
    # GPU runs, not nodes; tests/ops/test_launch_counts.py checks every declaration
    launches: "int | LaunchCount" = 1

    def launch_count(self, ins: Sequence[TensorSpec], attrs: Any) -> int:
        """The kernels one call of this binding issues for a node with these input specs."""
        count = self.launches(ins, attrs) if callable(self.launches) else self.launches
        if count < 1:
            raise ValueError(f"kernel {self.name!r}: launches must be >= 1, got {count}")
        return count


# (input specs, parsed attrs) -> kernels one call issues
LaunchCount = Callable[[Sequence[TensorSpec], Any], int]

# aten ops that only re-describe memory: they launch no kernel
_NO_KERNEL = frozenset({"view", "_unsafe_view", "alias", "unsqueeze", "squeeze", "expand", "t",
                        "transpose", "select", "slice", "permute", "as_strided", "detach"})


def aten_kernels(fn: Callable[[], Any]) -> int:
    """The aten ops `fn` runs that launch a kernel (views excluded): what a torch binding costs
    in launches on CUDA, one kernel an op (run it on meta tensors: nothing is computed)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = [0]

    class _Count(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's mode is untyped
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func.__name__.split(".")[0] not in _NO_KERNEL and not func.is_view:
                ops[0] += 1
            return func(*args, **(kwargs or {}))

    with _Count():  # type: ignore[no-untyped-call]
        fn()
    return ops[0]


def traced_launches(launch: "Launch", outputs: Callable[[list[TensorSpec], Any], list[TensorSpec]]
                    ) -> LaunchCount:
    """A torch binding's `launches`: `launch` run on meta tensors shaped like the node's inputs
    (rows = 2) and the outputs `outputs(ins, attrs)` infers, its kernels counted by aten_kernels.
    Counted once per (input specs, attrs)."""
    @cache
    def counted(ins: tuple[TensorSpec, ...], attrs: Any) -> int:
        env = {name: 2 for s in ins for name in s.shape if isinstance(name, str)}

        def meta(s: TensorSpec) -> torch.Tensor:
            return torch.empty(s.concrete(env), dtype=getattr(torch, s.dtype), device="meta")
        tin, tout = [meta(s) for s in ins], [meta(s) for s in outputs(list(ins), attrs)]
        return aten_kernels(lambda: launch(tin, tout, [], attrs))

    return lambda ins, attrs: counted(tuple(ins), attrs)
