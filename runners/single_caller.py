"""Single-caller guard for runners and proposers (FAULTS 29).

A runner's static buffers and a proposer's sequences and deferred draft are one caller's at a
time: two threads inside one object would read each other's inputs and drafts. The contract is
single-caller (one thread per object; use one runner or proposer per thread, or serialise calls
yourself), and `single_caller(...)` enforces it: each named method first tries a non-blocking
acquire of the object's re-entrant lock (the same thread may nest calls: `run` -> `execute`,
`prefill_drafter` -> `catchup_drafter`) and, if another thread holds it, raises
`ConcurrentCallError` at once instead of waiting or interleaving. The cost is that one acquire
and release per call; nothing blocks.
"""
from __future__ import annotations

import functools
import threading
from typing import Any, Callable, TypeVar

__all__ = ["ConcurrentCallError", "single_caller"]

_T = TypeVar("_T", bound=type)
_LOCK = "_single_caller_lock"


class ConcurrentCallError(RuntimeError):
    """A second thread entered a runner or proposer while another thread was inside it."""


def _guard(cls_name: str, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        lock = self.__dict__[_LOCK]
        if not lock.acquire(blocking=False):
            raise ConcurrentCallError(
                f"{cls_name}.{name} was entered by thread {threading.current_thread().name!r} "
                f"while another thread is inside this {cls_name}: it is single-caller (one "
                f"thread per object; serialise calls or use one per thread)")
        try:
            return fn(self, *args, **kwargs)
        finally:
            lock.release()
    return guarded


def single_caller(*methods: str) -> Callable[[_T], _T]:
    """Class decorator: the object gets its lock before its own __init__ runs, and each of
    `methods` raises `ConcurrentCallError` when another thread is inside any of them."""
    def decorate(cls: _T) -> _T:
        init = cls.__init__  # type: ignore[misc]  # the class's own, wrapped below

        @functools.wraps(init)
        def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
            self.__dict__[_LOCK] = threading.RLock()
            init(self, *args, **kwargs)
        setattr(cls, "__init__", __init__)
        for name in methods:
            setattr(cls, name, _guard(cls.__name__, name, getattr(cls, name)))
        return cls
    return decorate
