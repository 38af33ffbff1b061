"""Spawning a gloo group from pytest: `spawn(fn, world_size, *args)` runs fn(rank, world_size,
group, *args) in world_size fresh processes joined over a file rendezvous, and fails the test
(after killing its own children) if they do not finish within the timeout: nothing hangs.

All spawns of one pytest process share BUDGET_S, so the spawned tests together stay under two
minutes even when every one of them hangs. fn must be a module-level function (the spawn start method pickles it by name); an exception in
any rank fails the test with that rank's traceback."""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import pytest
import torch.multiprocessing as mp

BUDGET_S = 110.0  # every spawn of this process together (issue 21: the gloo tests take < 2 min)
_spent = [0.0]


def _entry(rank: int, fn: Callable[..., None], world_size: int, rendezvous: str, timeout_s: float,
           args: tuple[Any, ...]) -> None:
    import torch
    import torch.distributed as dist

    from draft_circuit.runners.distributed import init_group

    torch.set_num_threads(1)  # the test machine's cores are shared
    if os.environ.get("TRITON_INTERPRET") == "1":  # as conftest does in the parent
        from tests.interpreter_dot import row_independent_interpreter_dot

        row_independent_interpreter_dot()
    group = init_group("cpu", rank=rank, world_size=world_size, init_method=f"file://{rendezvous}",
                       timeout_s=timeout_s)
    try:
        fn(rank, world_size, group, *args)
    finally:
        dist.destroy_process_group()


def spawn(fn: Callable[..., None], world_size: int, tmp: Path, *args: Any, timeout_s: float = 60.0,
          collective_timeout_s: float = 30.0) -> None:
    if _spent[0] >= BUDGET_S:
        pytest.fail(f"the spawned tests' budget of {BUDGET_S} s is spent; {fn.__name__} not started")
    timeout_s = min(timeout_s, BUDGET_S - _spent[0])
    start = time.monotonic()
    rendezvous = os.fspath(tmp / f"rendezvous_{fn.__name__}_{world_size}")
    ctx = mp.start_processes(_entry, args=(fn, world_size, rendezvous, collective_timeout_s, args),
                             nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                pytest.fail(f"{fn.__name__} over {world_size} ranks did not finish within {timeout_s} s")
    finally:
        for p in ctx.processes:  # only the children this call started
            if p.is_alive():
                p.kill()
                p.join(5)
        _spent[0] += time.monotonic() - start


class ReadSpy:
    """Stands in for tp_checkpoint._open_file (monkeypatch it): counts, per stored name, the bytes
    each get_slice read returns; get_tensor (a whole read) is absent, so using it fails."""

    def __init__(self, counts):
        self.counts = counts

    def __call__(self, path):
        from draft_circuit.circuit.layers.checkpoint import _open

        counts, handle = self.counts, _open(path)

        class Slice:
            def __init__(self, key):
                self.sl, self.key = handle.get_slice(key), key

            def get_shape(self):
                return self.sl.get_shape()

            def get_dtype(self):
                return self.sl.get_dtype()

            def __getitem__(self, index):
                t = self.sl[index]
                counts[self.key] = counts.get(self.key, 0) + t.numel() * t.element_size()
                return t

        class Handle:
            def __enter__(self):
                handle.__enter__()
                return self

            def __exit__(self, *exc):
                return handle.__exit__(*exc)

            def get_slice(self, key):
                return Slice(key)
        return Handle()
