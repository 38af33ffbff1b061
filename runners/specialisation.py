"""`specialisation_key`: the compile a Triton launch `kernel[grid](*args, **kwargs)` needs, as a
hashable key at least as fine as Triton's own, by Triton 3.x's rules (a constexpr by value; a
tensor by dtype and 16-byte alignment; an int by width, whether it is 1 and whether a multiple of
16, unless the kernel's `do_not_specialize` names it; launch options by value). What GraphRunner's
precompile (runners/precompile.py) dedupes a 64-width plan's thousands of launches by, visiting
each launch without running it.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, Mapping, Sequence

import torch

_CONST, _ARG, _PLAIN = 0, 1, 2  # how a parameter enters a compile: by value, by class, by type


@functools.lru_cache(maxsize=None)
def _params(fn: Callable[..., Any], unspecialised: tuple[int | str, ...] = ()
            ) -> tuple[str, tuple[int, ...], dict[str, int]]:
    """A kernel's name and how each of its parameters enters a compile (in order, and by
    name): _CONST for a `tl.constexpr`, _PLAIN for one its `do_not_specialize` names (by name
    or index), _ARG otherwise."""
    kinds = {n: _CONST if "constexpr" in str(p.annotation)
             else _PLAIN if n in unspecialised or i in unspecialised else _ARG
             for i, (n, p) in enumerate(inspect.signature(fn).parameters.items())}
    return f"{fn.__module__}.{fn.__qualname__}", tuple(kinds.values()), kinds


def _arg_class(v: Any) -> Any:
    """What Triton (3.x) compiles a non-constexpr argument for: a tensor's dtype and 16-byte
    alignment; an int's width and whether it is 1 (a constant) or a multiple of 16; a bool, a
    float or None by type."""
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() & 15 == 0)
    if type(v) is int:
        return (*_int_width(v), v == 1, v & 15 == 0)
    return type(v) if type(v) in (bool, float, type(None)) else (type(v), v)


def _int_width(v: int) -> tuple[bool, bool]:
    """Which of Triton's int types an int binds as: i32, i64 or u64 (2**63 and past)."""
    return (-2**31 <= v < 2**31, v >= 2**63)


def _plain_class(v: Any) -> Any:
    """A `do_not_specialize` argument's class: an int's width only (Triton passes it as a
    plain i32 / i64 / u64, neither 1 nor its divisibility a constant); anything else as
    `_arg_class`."""
    return _int_width(v) if type(v) is int else _arg_class(v)


_CLASS: dict[int, Callable[[Any], Any]] = {_CONST: lambda v: v, _ARG: _arg_class,
                                           _PLAIN: _plain_class}


def specialisation_key(kernel: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
    """The compile `kernel[grid](*args, **kwargs)` needs, as a key at least as fine as Triton's
    own: the kernel, each constexpr's value, each other argument's `_arg_class` (a
    `do_not_specialize` one's `_plain_class`: the kernels' runtime `pdl_release`, 0 or 1 in
    one compile), the launch options (num_warps, launch_pdl, ...); not the grid. (An argument
    given by name where another launch gives it in place makes two keys for one compile: finer,
    never coarser.) What GraphRunner's precompile dedupes a 64-width plan's thousands of
    launches by."""
    # a JITFunction's, or (interpreted) the decorator arguments the InterpretedFunction keeps
    unspecialised = tuple(getattr(kernel, "do_not_specialize", None)
                          or (getattr(kernel, "kwargs", None) or {}).get("do_not_specialize")
                          or ())
    name, kinds, by_name = _params(getattr(kernel, "fn", kernel), unspecialised)
    parts = tuple([_CLASS[c](v) for v, c in zip(args, kinds)])
    named = tuple([(k, _CLASS[by_name[k]](v)) if k in by_name else (k, ("option", v))
                   for k, v in kwargs.items()])
    return (name, parts, named)
