"""`CircuitBuilder`: the API layers emit circuits through.

It declares inputs (with the neutral value an inert row gets), params and states, applies ops
(checking arity, inferring output specs with the op's shape rule, naming each node under the
current scope and each new state version `root@k`, recording the layer line that asked for it),
marks outputs, and `build()`s a verified, immutable `Circuit`.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator, Sequence

from draft_circuit.circuit.ir import (FUSED_SEP, ROW, Circuit, CircuitError, Dim, Kind, Neutral,
                                      Node, Origin, TensorSpec, Value)
from draft_circuit.circuit.verify import verify
from draft_circuit.ops.registry import ShapeError, get_op

_HERE = os.path.abspath(__file__)
_ROOT = Path(_HERE).parents[1]  # the checkout (or the installed draft_circuit package)


@lru_cache(maxsize=None)
def _relative(filename: str) -> str:
    """A frame's file relative to the repo root (posix); a file outside it keeps its path."""
    path = Path(os.path.abspath(filename))
    try:
        return path.relative_to(_ROOT).as_posix()
    except ValueError:
        return path.as_posix()


def _caller_line() -> tuple[str, int]:
    """The file and line of the first frame outside this module: the layer that emitted a node."""
    frame = sys._getframe(1)
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename) == _HERE:
        frame = frame.f_back
    return _relative(frame.f_code.co_filename), frame.f_lineno


class CircuitBuilder:
    def __init__(self, name: str, *, max_width: int, min_width: int = 1) -> None:
        self.name = name
        self.symbols = {ROW: (min_width, max_width)}
        self._values: dict[str, Value] = {}
        self._nodes: list[Node] = []
        self._outputs: list[str] = []
        self._renames: dict[str, str] = {}
        self._scope: list[str] = []
        self._node_names: set[str] = set()

    # ---- declarations ----
    def _declare(self, name: str, dtype: str, shape: Sequence[Dim], kind: Kind, **kw: Any) -> str:
        if name in self._values:
            raise CircuitError(f"value {name!r} is declared twice")
        self._values[name] = Value(name=name, dtype=dtype, shape=tuple(shape), kind=kind, **kw)
        return name

    def input(self, name: str, dtype: str, shape: Sequence[Dim], *,
              neutral: Neutral = None) -> str:
        """A per-call input. `neutral`: what an inert (padded) row holds, declared beside the
        layer so runners need not know input names (None: zero; `SCRATCH_BLOCK`: the runner's
        scratch block, for block tables)."""
        return self._declare(name, dtype, shape, "input", neutral=neutral)

    def param(self, name: str, dtype: str, shape: Sequence[Dim]) -> str:
        return self._declare(name, dtype, shape, "param")

    def state(self, name: str, dtype: str, shape: Sequence[Dim]) -> str:
        return self._declare(name, dtype, shape, "state", storage=name, version=0)

    def spec(self, value: str) -> TensorSpec:
        return self._values[value].spec

    @contextmanager
    def scope(self, prefix: str) -> Iterator[None]:
        """Prefix the names of nodes and temps made inside (e.g. the draft step `s2`)."""
        self._scope.append(prefix)
        try:
            yield
        finally:
            self._scope.pop()

    def _scoped(self, name: str) -> str:
        return ".".join([*self._scope, name])

    def _origin(self) -> Origin:
        file, line = _caller_line()
        return Origin(file=file, line=line, scope=".".join(self._scope))

    # ---- ops ----
    def op(self, op_name: str, inputs: Sequence[str | None], attrs: dict[str, Any] | None = None,
           name: str | None = None) -> tuple[str, ...]:
        """Apply `op_name`; trailing None inputs are absent optionals. Returns the output names."""
        origin = self._origin()
        node_name = self._scoped(name or op_name)
        where = {"node": node_name, "op": op_name, "origin": str(origin)}
        try:
            op = get_op(op_name)
        except CircuitError as e:
            raise CircuitError(e.detail, **where) from None
        given = list(inputs)
        while given and given[-1] is None:
            given.pop()
        if FUSED_SEP in node_name:
            raise CircuitError(f"node names may not contain {FUSED_SEP!r}: fusion passes name "
                               "their nodes part+part, and two nodes of one name collide", **where)
        if node_name in self._node_names:
            raise CircuitError("node name used twice", **where)
        if None in given:
            raise CircuitError("only trailing optional inputs may be absent", **where)
        ins = [x for x in given if x is not None]
        for x in ins:
            if x not in self._values:
                raise CircuitError(f"input {x!r} names no value", **where)
        shapes = ", ".join(f"{x}: {self._values[x].spec}" for x in ins)
        bad = op.check_arity(len(ins), len(op.outputs))
        if bad:
            raise CircuitError(bad, shapes=shapes, **where)
        attrs = dict(attrs or {})
        try:
            parsed = op.parse_attrs(attrs)
        except CircuitError as e:
            raise CircuitError(e.detail, **where) from None
        try:
            specs = op.infer([self._values[x].spec for x in ins], parsed)
        except ShapeError as e:
            raise CircuitError(str(e), shapes=shapes, **where) from None
        except Exception as e:  # a shape rule that trips on an input it does not expect
            raise CircuitError(f"shape rule failed: {type(e).__name__}: {e}", shapes=shapes,
                               **where) from None
        outs = []
        for i, spec in enumerate(specs):
            if i in op.mutates:
                prev = self._values[ins[op.mutates[i]]]
                out = self._declare(f"{prev.storage}@{prev.version + 1}", spec.dtype, spec.shape,
                                    "state", storage=prev.storage, version=prev.version + 1)
            else:
                suffix = "" if len(specs) == 1 else f".{op.outputs[i]}"
                out = self._declare(node_name + suffix, spec.dtype, spec.shape, "temp")
            outs.append(out)
        self._nodes.append(Node(name=node_name, op=op_name, inputs=tuple(ins),
                                outputs=tuple(outs), attrs=attrs, origin=(origin,)))
        self._node_names.add(node_name)
        return tuple(outs)

    def op1(self, op_name: str, inputs: Sequence[str | None], attrs: dict[str, Any] | None = None,
            name: str | None = None) -> str:
        """`op` for single-output ops."""
        (out,) = self.op(op_name, inputs, attrs, name)
        return out

    def output(self, value: str, name: str | None = None) -> str:
        """Mark `value` as a circuit output, renamed to `name` if given."""
        if value not in self._values:
            raise CircuitError(f"output {value!r} names no value")
        v = self._values[value]
        if value in self._outputs or value in self._renames:
            raise CircuitError(f"value {value!r} is already an output")
        if v.kind == "state":
            self._outputs.append(value)  # a final state version: returned under its own name
            return value
        name = name or value
        if name != value:
            if name in self._values:
                raise CircuitError(f"output name {name!r} is already a value")
            self._renames[value] = name
        self._values[value] = v.model_copy(update={"kind": "output"})
        self._outputs.append(name)
        return name

    def build(self, check: bool = True) -> Circuit:
        def r(x: str) -> str:
            return self._renames.get(x, x)
        values = tuple(v.model_copy(update={"name": r(v.name)}) for v in self._values.values())
        nodes = tuple(n.model_copy(update={"inputs": tuple(map(r, n.inputs)),
                                           "outputs": tuple(map(r, n.outputs))})
                      for n in self._nodes)
        circuit = Circuit(name=self.name, symbols=self.symbols, values=values, nodes=nodes,
                          outputs=tuple(self._outputs))
        if check:
            verify(circuit)
        return circuit
