"""The circuit IR: typed values, op nodes, and the immutable `Circuit` DAG that layers emit.

A `Circuit` is plain data (frozen pydantic models) that prints as a program, round-trips through
versioned JSON and has a stable `fingerprint()`. Passes reach its graph only through
`topo_order()`, `users()` and `producer()`; the networkx graph behind them is built once, lazily.
Each node records its `origin` (the layer line that built it): carried in JSON, shown in errors,
never printed and never part of the fingerprint. An input may declare its `neutral` value: what
an inert (padded) row holds.
"""
from __future__ import annotations

import hashlib
import json
from functools import cached_property, lru_cache
from typing import Any, Final, Literal, Union

import networkx as nx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from draft_circuit.circuit.types import (DTYPE_BYTES, DTYPES, ROW, CircuitError, Dim,  # noqa: F401
                                         TensorSpec)

__all__ = ["DTYPE_BYTES", "DTYPES", "FUSED_SEP", "MAX_JSON_DEPTH", "ROW", "SCHEMA_VERSION",
           "SCRATCH_BLOCK", "Circuit", "CircuitError", "Dim", "Kind", "Neutral", "Node", "Origin",
           "TensorSpec", "Value"]

SCHEMA_VERSION = 1
Kind = Literal["input", "param", "state", "temp", "output"]
FUSED_SEP = "+"  # fusion passes name a fused node part+part: no other node may use it
SCRATCH_BLOCK: Final = "scratch_block"  # a neutral that stands for the runner's scratch block id
Neutral = Union[int, float, Literal["scratch_block"], None]
MAX_JSON_DEPTH = 64  # circuit JSON is shallow (attrs are numbers and short lists)


@lru_cache(maxsize=4096)
def _spec(dtype: str, shape: tuple[Dim, ...]) -> TensorSpec:
    """One frozen TensorSpec per (dtype, shape): a plan asks every value's spec at every width
    (tens of thousands of times for 64 widths), and building a pydantic model each time was a
    tenth of the planner's time."""
    return TensorSpec(dtype=dtype, shape=shape)


class Value(BaseModel):
    """A named tensor of the circuit. A state value is one version of a storage owned outside."""

    model_config = ConfigDict(frozen=True, ser_json_inf_nan="constants")
    name: str
    dtype: str
    shape: tuple[Dim, ...]
    kind: Kind
    storage: str | None = None  # state values: the root state all versions share
    version: int = 0
    # inputs: what an inert row holds (None: zero); "scratch_block": the runner's scratch block
    neutral: Neutral = None

    @property
    def spec(self) -> TensorSpec:
        return _spec(self.dtype, self.shape)


class Origin(BaseModel):
    """Where a node was built: the repo-relative file and line that called the builder, and the
    builder scope it was in ("" outside any)."""

    model_config = ConfigDict(frozen=True)
    file: str
    line: int
    scope: str = ""

    def __str__(self) -> str:
        return f"{self.file}:{self.line}" + (f" in scope {self.scope}" if self.scope else "")


class Node(BaseModel):
    """One op application: input and output value names, and attrs its op's attrs model checks."""

    model_config = ConfigDict(frozen=True)
    name: str
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any] = Field(default_factory=dict)
    fused: tuple[str, ...] = ()  # the original nodes a fusion pass replaced with this one
    # one entry per original node (a fused node keeps its parts' origins, in `fused` order)
    origin: tuple[Origin, ...] = ()

    @property
    def where(self) -> str | None:
        """The origin as one line for messages (None when the node records none)."""
        return "; ".join(dict.fromkeys(str(o) for o in self.origin)) or None


class Circuit(BaseModel):
    """An immutable DAG of nodes over values, with row-symbol bounds and named outputs."""

    model_config = ConfigDict(frozen=True, ser_json_inf_nan="constants")
    schema_version: int = SCHEMA_VERSION
    name: str
    symbols: dict[str, tuple[int, int]]  # symbol -> inclusive (low, high) bounds
    values: tuple[Value, ...]
    nodes: tuple[Node, ...]
    outputs: tuple[str, ...]

    # ---- lookups (built once; the model is frozen so they never go stale) ----
    @cached_property
    def _values(self) -> dict[str, Value]:
        return {v.name: v for v in self.values}

    @cached_property
    def _nodes(self) -> dict[str, Node]:
        return {n.name: n for n in self.nodes}

    @cached_property
    def _producers(self) -> dict[str, str]:
        return {out: n.name for n in self.nodes for out in n.outputs}

    @cached_property
    def _users(self) -> dict[str, tuple[str, ...]]:
        users: dict[str, list[str]] = {}
        for n in self.nodes:
            for v in dict.fromkeys(n.inputs):
                users.setdefault(v, []).append(n.name)
        return {v: tuple(u) for v, u in users.items()}

    @cached_property
    def graph(self) -> nx.DiGraph:
        """Node-level DAG: data edges, plus anti-edges that order each state read before the
        write of that state's next version (so topological order respects in-place mutation)."""
        g = nx.DiGraph()
        g.add_nodes_from(n.name for n in self.nodes)
        for n in self.nodes:
            for v in n.inputs:
                p = self._producers.get(v)
                if p is not None:
                    g.add_edge(p, n.name, kind="data", value=v)
        for writer, version in self.state_writes():
            for reader in self._users.get(version, ()):
                if reader != writer:
                    g.add_edge(reader, writer, kind="anti", value=version)
        return g

    def value(self, name: str) -> Value:
        try:
            return self._values[name]
        except KeyError:
            raise CircuitError(f"no value named {name!r}") from None

    def has_value(self, name: str) -> bool:
        return name in self._values

    def node(self, name: str) -> Node:
        try:
            return self._nodes[name]
        except KeyError:
            raise CircuitError(f"no node named {name!r}") from None

    def producer(self, value: str) -> Node | None:
        """The node that writes `value`, or None for inputs, params and root states."""
        p = self._producers.get(value)
        return self._nodes[p] if p is not None else None

    def users(self, value: str) -> tuple[Node, ...]:
        """The nodes that read `value`, in circuit order."""
        return tuple(self._nodes[u] for u in self._users.get(value, ()))

    def topo_order(self) -> tuple[Node, ...]:
        """Nodes in a deterministic topological order (ties broken by circuit order)."""
        index = {n.name: i for i, n in enumerate(self.nodes)}
        order = nx.lexicographical_topological_sort(self.graph, key=lambda name: index[name])
        return tuple(self._nodes[name] for name in order)

    def state_writes(self) -> list[tuple[str, str]]:
        """(writer node, state version it consumes) for each node that writes a new version."""
        writes = []
        for n in self.nodes:
            for out in n.outputs:
                v = self._values.get(out)
                if v is None or v.kind != "state" or v.version == 0:
                    continue
                prev = next((i for i in n.inputs if (iv := self._values.get(i)) is not None
                             and iv.kind == "state" and iv.storage == v.storage), None)
                if prev is not None:
                    writes.append((n.name, prev))
        return writes

    def inputs_of_kind(self, kind: Kind) -> tuple[Value, ...]:
        return tuple(v for v in self.values if v.kind == kind)

    @property
    def max_width(self) -> int:
        return self.symbols[ROW][1]

    # ---- printing and serialisation ----
    def __str__(self) -> str:
        bounds = ", ".join(f"{lo} <= {s} <= {hi}" for s, (lo, hi) in self.symbols.items())
        lines = [f"circuit {self.name} ({bounds})"]
        for kind in ("input", "param", "state"):
            for v in self.values:
                if v.kind == kind and (kind != "state" or v.version == 0):
                    lines.append(f"  {kind} {v.name}: {v.spec}")
        for n in self.nodes:
            outs = ", ".join(f"{o}: {self._values[o].spec}" if o in self._values else o
                             for o in n.outputs)
            attrs = ", ".join(f"{k}={_fmt_attr(v)}" for k, v in sorted(n.attrs.items()))
            attrs = f" {{{attrs}}}" if attrs else ""
            if n.fused:
                label = f"  # fused {' + '.join(n.fused)}"
            else:
                label = "" if n.outputs and n.outputs[0].startswith(n.name) else f"  # {n.name}"
            lines.append(f"  {outs} = {n.op}({', '.join(n.inputs)}){attrs}{label}")
        lines.append(f"  return {', '.join(self.outputs)}")
        return "\n".join(lines)

    def to_json(self, indent: int | None = None) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> "Circuit":
        """The circuit a `to_json()` text holds; anything else is a CircuitError saying why."""
        try:
            data = json.loads(text)
        except RecursionError:
            raise CircuitError(f"circuit JSON nests deeper than {MAX_JSON_DEPTH} levels") from None
        except (TypeError, ValueError) as e:  # JSONDecodeError and undecodable bytes
            raise CircuitError(f"circuit JSON does not parse: {e}") from None
        if not isinstance(data, dict):
            raise CircuitError(f"circuit JSON must be an object, got {type(data).__name__}")
        if _depth(data) > MAX_JSON_DEPTH:
            raise CircuitError(f"circuit JSON nests deeper than {MAX_JSON_DEPTH} levels")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise CircuitError(f"circuit JSON schema_version {version!r}; this build reads "
                               f"{SCHEMA_VERSION}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise CircuitError(f"circuit JSON does not fit the schema: "
                               f"{e.errors(include_url=False)}") from None

    def fingerprint(self) -> str:
        """sha256 of the canonical JSON: stable across processes, the compiled-program cache key.
        Origins are left out: moving a layer's line must not invalidate compiled programs."""
        data = self.model_dump(mode="json", exclude={"nodes": {"__all__": {"origin"}}})
        canonical = json.dumps(data, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()

    def replace(self, *, nodes: tuple[Node, ...] | list[Node] | None = None,
                values: tuple[Value, ...] | list[Value] | None = None,
                outputs: tuple[str, ...] | None = None) -> "Circuit":
        """A new circuit with some fields replaced (passes build their results with this)."""
        return Circuit(name=self.name, symbols=dict(self.symbols),
                       values=tuple(self.values if values is None else values),
                       nodes=tuple(self.nodes if nodes is None else nodes),
                       outputs=tuple(self.outputs if outputs is None else outputs))


def _depth(data: Any) -> int:
    """How deep lists and objects nest in loaded JSON (iterative: no recursion to exhaust)."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list)):
            deepest = max(deepest, d)
            if d <= MAX_JSON_DEPTH:
                stack.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))
    return deepest


def _fmt_attr(v: Any) -> str:
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_fmt_attr(x) for x in v) + "]"
    return str(v)
