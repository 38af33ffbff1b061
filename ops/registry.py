"""The op registry: one `OpDef` per op holds every fact about it, reached from `get_op(name)`:
attrs model, shape rule, torch reference, cost, tags, the inputs it mutates, and its kernel
bindings with the condition each applies under (the planner picks the first that applies and
falls back to the reference). Dead-node elimination and the plan page test tags (never op-name
substrings); `writes_state` is derived from `mutates`, so the two cannot disagree.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable

import torch
from pydantic import BaseModel, ConfigDict, ValidationError

from draft_circuit.circuit.types import DTYPE_BYTES, CircuitError, TensorSpec
from draft_circuit.ops.bindings import KernelBinding as KernelBinding  # re-exported: part of an OpDef

# op groups, as declared tags
ELEMENTWISE = "elementwise"  # each output element from the same-index input elements
REDUCTION = "reduction"      # reduces over a row (norms, the vocabulary argmax, routing)
MATMUL = "matmul"            # a product with a weight matrix
GATHER = "gather"            # reads rows of a table by index
LAYOUT = "layout"            # moves data without arithmetic (concat, stack)
NORM = "norm"                # a normalisation
ATTENTION = "attention"      # the attention block: rope, the paged KV write, decode attention
SAMPLING = "sampling"        # picks, gates or keeps draft tokens
FUSED = "fused"              # stands for several ops a fusion pass replaced
WRITES_STATE = "writes_state"  # derived: the op mutates a state input (never declared)
TAGS: frozenset[str] = frozenset({ELEMENTWISE, REDUCTION, MATMUL, GATHER, LAYOUT, NORM, ATTENTION,
                                  SAMPLING, FUSED, WRITES_STATE})


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


Specs = list[TensorSpec]
Env = dict[str, int]  # symbol -> value (the row symbol -> the width)
# (input specs, parsed attrs) -> output specs; raises ShapeError
ShapeRule = Callable[[list[TensorSpec], Any], list[TensorSpec]]
# (input tensors, parsed attrs) -> outputs; absent optional inputs are not in the list
Reference = Callable[[list[torch.Tensor], Any], tuple[torch.Tensor, ...]]
# (input specs, output specs, parsed attrs, context, symbol values) -> the launch's cost
CostRule = Callable[[list[TensorSpec], list[TensorSpec], Any, CostContext, dict[str, int]], Cost]


@dataclass(frozen=True, eq=False)
class OpDef:
    """Everything the project knows about one op.

    `reference(inputs, attrs) -> tuple[Tensor, ...]` is the oracle. State-writing ops mutate the
    state inputs named by `mutates` (output index -> input index) in place and return them.
    `inplace` (output index -> input index) marks outputs that may reuse an input's buffer.
    `tags` are declared (from TAGS); WRITES_STATE is added exactly when `mutates` is non-empty.
    `kernels` are tried in order; the first that applies is chosen.
    """

    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    infer: ShapeRule
    reference: Reference
    cost: CostRule | None = None
    attrs: type[BaseModel] = NoAttrs
    tags: frozenset[str] = frozenset()
    num_required: int | None = None  # inputs after this many are optional (may be absent)
    variadic: bool = False  # one input name, repeated one or more times
    mutates: dict[int, int] = field(default_factory=dict)
    inplace: dict[int, int] = field(default_factory=dict)
    kernels: tuple[KernelBinding, ...] = ()

    def __post_init__(self) -> None:
        unknown = set(self.tags) - TAGS
        if unknown:
            raise ValueError(f"op {self.name!r}: unknown tags {sorted(unknown)}; known: {sorted(TAGS)}")
        if WRITES_STATE in self.tags:
            raise ValueError(f"op {self.name!r}: {WRITES_STATE!r} is derived from `mutates`, "
                             "never declared")
        derived = {WRITES_STATE} if self.mutates else set()
        object.__setattr__(self, "tags", frozenset(self.tags) | derived)
        object.__setattr__(self, "kernels", tuple(self.kernels))
        names = [k.name for k in self.kernels]
        if len(set(names)) != len(names):
            raise ValueError(f"op {self.name!r}: kernel names repeat: {names}")

    @property
    def writes_state(self) -> bool:
        """The op mutates a state input in place: a node of it is never dead."""
        return bool(self.mutates)

    def has(self, tag: str) -> bool:
        if tag not in TAGS:
            raise ValueError(f"unknown tag {tag!r}; known: {sorted(TAGS)}")
        return tag in self.tags

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
                 skip_in: AbstractSet[int] = frozenset(), skip_out: AbstractSet[int] = frozenset(),
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


INDEX_DTYPES = ("int32", "int64")


def index_dtype(spec: TensorSpec, what: str) -> None:
    check(spec.dtype in INDEX_DTYPES, lambda: f"{what} must be int32 or int64, got {spec}")


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
