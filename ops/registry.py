"""The op registry: one `OpDef` per op (attrs model, shape rule, torch reference, cost, tags).

Kernels are bound to ops separately (`bind_kernel`), each with the condition under which it
applies; the planner picks the first that applies and falls back to the reference. Passes test
tags (`ELEMENTWISE`, `WRITES_STATE`, ...), never op names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from draft_circuit.circuit.types import DTYPE_BYTES, CircuitError, TensorSpec

# op groups, as declared tags
ELEMENTWISE = "elementwise"
REDUCTION = "reduction"
WRITES_STATE = "writes_state"
MATMUL = "matmul"
GATHER = "gather"
FUSED = "fused"


class NoAttrs(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ShapeError(Exception):
    """Raised by a shape rule; verify() wraps it in a CircuitError naming the node."""


@dataclass(frozen=True)
class Cost:
    bytes_read: int
    bytes_written: int
    flops: int

    @property
    def bytes_moved(self) -> int:
        return self.bytes_read + self.bytes_written


@dataclass(frozen=True)
class CostContext:
    """What a cost needs beyond shapes: the width and the live KV rows a sequence holds."""

    width: int
    kv_rows: int = 100


@dataclass(frozen=True)
class KernelBinding:
    """A kernel for an op: `launch(inputs, outputs, workspace, attrs)` writes into preallocated
    outputs (destination passing; absent optional inputs are simply not in `inputs`).

    `applies(device, in_specs, attrs)` says when it may be chosen; `workspace(in_specs, env,
    attrs)` gives scratch shapes (dtype, shape) the planner preallocates, passed after outputs.
    """

    name: str
    launch: Callable[..., None]
    applies: Callable[[str, Sequence[TensorSpec], Any], bool]
    workspace: Callable[..., list[tuple[str, tuple[int, ...]]]] | None = None
    width_independent: bool = True  # a row's bits never depend on the other rows in the launch


@dataclass
class OpDef:
    """Everything the project knows about one op.

    `reference(inputs, attrs) -> tuple[Tensor, ...]` is the oracle. State-writing ops mutate the
    state inputs named by `mutates` (output index -> input index) in place and return them.
    `inplace` (output index -> input index) marks outputs that may reuse an input's buffer.
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    infer: Callable[[list[TensorSpec], Any], list[TensorSpec]]
    reference: Callable[[list[torch.Tensor | None], Any], tuple[torch.Tensor, ...]]
    cost: Callable[[list[TensorSpec], list[TensorSpec], Any, CostContext, dict[str, int]], Cost] | None = None
    attrs: type[BaseModel] = NoAttrs
    tags: frozenset[str] = frozenset()
    num_required: int | None = None  # inputs after this many are optional (may be absent)
    variadic: bool = False  # one input name, repeated one or more times
    mutates: dict[int, int] = field(default_factory=dict)
    inplace: dict[int, int] = field(default_factory=dict)
    kernels: list[KernelBinding] = field(default_factory=list)

    def parse_attrs(self, attrs: dict[str, Any]) -> BaseModel:
        try:
            return self.attrs(**attrs)
        except ValidationError as e:
            raise CircuitError(f"invalid attrs {attrs}: {e.errors(include_url=False)}",
                               op=self.name) from None

    def check_arity(self, num_inputs: int, num_outputs: int) -> str | None:
        """None if the counts fit this op, else what is wrong."""
        if self.variadic:
            if num_inputs < 1:
                return f"takes one or more inputs, got {num_inputs}"
        else:
            lo = len(self.inputs) if self.num_required is None else self.num_required
            if not lo <= num_inputs <= len(self.inputs):
                want = f"{lo}" if lo == len(self.inputs) else f"{lo} to {len(self.inputs)}"
                return f"takes {want} inputs ({', '.join(self.inputs)}), got {num_inputs}"
        if num_outputs != len(self.outputs):
            return f"returns {len(self.outputs)} outputs ({', '.join(self.outputs)}), got {num_outputs}"
        return None

    def cost_at(self, ins: list[TensorSpec], outs: list[TensorSpec], attrs: Any,
                ctx: CostContext, env: dict[str, int]) -> Cost:
        if self.cost is not None:
            return self.cost(ins, outs, attrs, ctx, env)
        return default_cost(ins, outs, env, skip_in=set(self.mutates.values()),
                            skip_out=set(self.mutates))


def default_cost(ins: list[TensorSpec], outs: list[TensorSpec], env: dict[str, int], *,
                 skip_in: set[int] = frozenset(), skip_out: set[int] = frozenset(),
                 flops: int = 0) -> Cost:
    """Every input read once and every output written once (states excluded)."""
    read = sum(s.nbytes(env) for i, s in enumerate(ins) if i not in skip_in)
    written = sum(s.nbytes(env) for i, s in enumerate(outs) if i not in skip_out)
    return Cost(read, written, flops)


REGISTRY: dict[str, OpDef] = {}


def register(op: OpDef) -> OpDef:
    if op.name in REGISTRY:
        raise ValueError(f"op {op.name!r} registered twice")
    REGISTRY[op.name] = op
    return op


def get_op(name: str) -> OpDef:
    try:
        return REGISTRY[name]
    except KeyError:
        raise CircuitError(f"unknown op {name!r}; registered: {', '.join(sorted(REGISTRY))}",
                           op=name) from None


def bind_kernel(op_name: str, kernel: KernelBinding) -> None:
    REGISTRY[op_name].kernels.append(kernel)


# ---- small helpers the shape rules share ----
def check(cond: bool, msg: Callable[[], str]) -> None:
    """Raise ShapeError(msg()) unless cond; the message is built only on failure."""
    if not cond:
        raise ShapeError(msg())


def same_dtype(*specs: TensorSpec) -> None:
    dtypes = {s.dtype for s in specs}
    check(len(dtypes) == 1, lambda: f"dtypes differ ({', '.join(str(s) for s in specs)}); "
                                    "insert a cast op")


def rank(spec: TensorSpec, r: int, what: str) -> None:
    check(len(spec.shape) == r, lambda: f"{what} must have rank {r}, got {spec}")


def dim_eq(a: Any, b: Any, what: str) -> None:
    check(a == b, lambda: f"{what}: {a} != {b}")


def elt(dtype: str) -> int:
    return DTYPE_BYTES[dtype]


TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "int32": torch.int32, "int64": torch.int64, "uint8": torch.uint8, "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[name]
