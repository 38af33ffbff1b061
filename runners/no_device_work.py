"""`no_device_work(device_type)`: run Python launchers for their side effects on the host only.

GraphRunner's precompile walks every width's launchers with Triton's launches diverted to a
compile: the kernels do not run, so every buffer they would have written holds whatever the arena
held (garbage). A launcher that also calls torch on its tensors (an embedding's `index_select`
over ids an argmax kernel would have written, a table `gather`, a router's `topk` feeding an
expert `index_select`) would then compute on that garbage, and on CUDA an out-of-range index is a
device-side assert that poisons the context for good (seen on the H200: the proposer's first
GraphRunner died in `vectorized_gather_kernel`). It could also write garbage into a state.

Inside this context, an aten op that touches a tensor on `device_type` does no device work:

- view and metadata ops (their returns alias an input without writing it) run as usual: they
  launch nothing, and a Triton launch after them needs their real addresses and strides;
- an op that writes its arguments (in-place, `out=`) returns those arguments, unwritten;
- any other op returns fresh uninitialised tensors of the shapes, strides and dtypes the op
  would return (worked out on the meta device), on the op's device;
- ops with no tensor on `device_type` (host tensors, factories) run as usual.

An op whose result the meta device cannot describe (a data-dependent shape such as `nonzero`, a
host read such as `item`) raises `DeviceWorkRefused` naming the op: a launcher that needs it
cannot be walked without running, and the caller falls back to compiling in the warm-ups.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only


class DeviceWorkRefused(RuntimeError):
    """An op inside `no_device_work` could not be answered without running it on the device."""


def _on(device_type: str, leaves: list[Any]) -> bool:
    return any(isinstance(t, torch.Tensor) and t.device.type == device_type for t in leaves)


def _written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[frozenset[str], Any]:
    """The arguments `func` writes, keyed by their alias set (what a return names to alias one)."""
    out: dict[frozenset[str], Any] = {}
    for i, a in enumerate(func._schema.arguments):
        info = a.alias_info
        if info is not None and info.is_write:
            out[frozenset(info.before_set)] = args[i] if i < len(args) else kwargs.get(a.name)
    return out


# noqa: N801 - a context manager, named like one; torch's mode is untyped
class no_device_work(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, device_type: str) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.device_type = device_type

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        if func.is_view or not _on(self.device_type, leaves):
            return func(*args, **kwargs)
        device = next(t.device for t in leaves
                      if isinstance(t, torch.Tensor) and t.device.type == self.device_type)
        try:
            meta_args, meta_kwargs = tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
            meta = func(*meta_args, **meta_kwargs)
        except Exception as e:  # noqa: BLE001 - re-raised as what it means here
            raise DeviceWorkRefused(f"{func} cannot run without device work: {type(e).__name__}: {e}"
                                    ) from e
        written = _written(func, args, kwargs)
        returns = func._schema.returns
        metas = list(meta) if isinstance(meta, (tuple, list)) else [meta]
        if len(returns) != len(metas) and not (len(returns) == 1 and isinstance(meta, list)):
            raise DeviceWorkRefused(f"{func}: {len(metas)} results for {len(returns)} returns")

        def answer(ret: Any, m: Any) -> Any:
            info = ret.alias_info
            if info is not None and frozenset(info.before_set) in written:
                return written[frozenset(info.before_set)]
            if not isinstance(m, torch.Tensor):
                raise DeviceWorkRefused(f"{func} returns a host value ({type(m).__name__})")
            return torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device)

        if len(returns) == 1 and isinstance(meta, list):  # one Tensor[] return
            return [answer(returns[0], m) for m in meta]
        outs = [answer(r, m) for r, m in zip(returns, metas)]
        return tuple(outs) if isinstance(meta, tuple) else outs[0]
