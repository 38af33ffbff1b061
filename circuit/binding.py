"""Checks at the runner edge: params, states and per-call inputs against the circuit's values.

Every mismatch is a `BindingError` naming the value, its expected spec, what was given and the
width, raised before anything runs.
"""
from __future__ import annotations

from typing import Mapping

import torch

from draft_circuit.circuit.ir import ROW, Circuit, Value
from draft_circuit.ops.registry import DTYPE_NAMES


class BindingError(ValueError):
    """A tensor given to a runner does not fit the circuit value it binds."""


class WidthError(BindingError):
    """A width outside the circuit's declared bounds (or not served)."""


def check_width(circuit: Circuit, width: int) -> None:
    lo, hi = circuit.symbols[ROW]
    if not isinstance(width, int) or not lo <= width <= hi:
        raise WidthError(f"width {width!r} is outside the circuit's bounds {lo} <= n <= {hi}")


def _check_tensor(v: Value, t: object, env: dict[str, int], what: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise BindingError(f"{what} {v.name!r} must be a tensor, got {type(t).__name__}")
    want = v.spec.concrete(env)
    got_dtype = DTYPE_NAMES.get(t.dtype, str(t.dtype))
    if tuple(t.shape) != want or got_dtype != v.dtype:
        raise BindingError(f"{what} {v.name!r} must be {v.dtype}{list(want)} (spec {v.spec}) at "
                           f"width {env.get(ROW)}, got {got_dtype}{list(t.shape)}")


def _same_names(wanted: Mapping[str, Value], given: Mapping[str, object], kind: str) -> None:
    """Every declared value given, nothing undeclared: the message lists the names."""
    missing = sorted(set(wanted) - set(given))
    if missing:
        raise BindingError(f"missing {kind}: {', '.join(missing)}")
    extra = sorted(set(given) - set(wanted))
    if extra:
        raise BindingError(f"{kind} the circuit does not declare: {', '.join(extra)}")


def check_params(circuit: Circuit, params: Mapping[str, torch.Tensor]) -> None:
    wanted = {v.name: v for v in circuit.inputs_of_kind("param")}
    _same_names(wanted, params, "params")
    for name, v in wanted.items():
        _check_tensor(v, params[name], {}, "param")


def root_states(circuit: Circuit) -> dict[str, Value]:
    return {v.name: v for v in circuit.values if v.kind == "state" and v.version == 0}


def check_states(circuit: Circuit, states: Mapping[str, torch.Tensor]) -> None:
    """States are bound once; a state with a row dim is given at the circuit's max width."""
    wanted = root_states(circuit)
    _same_names(wanted, states, "states")
    for name, v in wanted.items():
        _check_tensor(v, states[name], {ROW: circuit.max_width}, "state")


def check_inputs(circuit: Circuit, inputs: Mapping[str, torch.Tensor]) -> int:
    """Validate one call's inputs; returns the width they share."""
    wanted = {v.name: v for v in circuit.inputs_of_kind("input")}
    _same_names(wanted, inputs, "inputs")
    first = next(v for v in wanted.values() if v.shape and v.shape[0] == ROW)
    width = int(inputs[first.name].shape[0]) if inputs[first.name].dim() else -1
    check_width(circuit, width)
    for name, v in wanted.items():
        _check_tensor(v, inputs[name], {ROW: width}, "input")
    return width


def state_view(circuit: Circuit, name: str, tensor: torch.Tensor, width: int) -> torch.Tensor:
    """The rows of a bound state that a width-`width` call sees."""
    v = root_states(circuit)[name]
    return tensor[:width] if v.shape and v.shape[0] == ROW else tensor
