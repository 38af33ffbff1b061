"""Device probes the runtime may call on any torch build (a CPU build raises on CUDA queries)."""
from __future__ import annotations

import torch


def cuda_available() -> bool:
    """True where a CUDA device can be used; False (never an exception) on a CPU-only build."""
    try:
        return torch.cuda.is_available()
    except Exception:  # a CPU build may raise on CUDA queries
        return False


class CurrentStream:
    """`torch.cuda.current_stream(device)` for the proposer's per-step event records: the same
    stream, without torch's Python device-index resolution and a new `Stream` object a call
    (tens of microseconds of host time per record on the H200's host, three records a decode
    step). One C call reads the device's current stream; its `Stream` object is kept while the
    stream stays the same, and made again when a host switches streams (`torch.cuda.stream`)."""

    def __init__(self, device: torch.device) -> None:
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self._key: tuple[int, int, int] | None = None
        self._stream: torch.cuda.Stream | None = None
        self._fast = hasattr(torch._C, "_cuda_getCurrentStream")

    def __call__(self) -> torch.cuda.Stream:
        if not self._fast:
            return torch.cuda.current_stream(self.index)
        key = torch._C._cuda_getCurrentStream(self.index)
        if key != self._key or self._stream is None:
            self._stream = torch.cuda.Stream(  # type: ignore[no-untyped-call]  # torch stub
                stream_id=key[0], device_index=key[1], device_type=key[2])
            self._key = key
        return self._stream

    def record(self, event: torch.cuda.Event) -> None:
        """`event.record()` on the device's current stream."""
        event.record(self())


class HostCopy:
    """Device-to-pinned-host copies read later without a sync of their own: `copy` enqueues one
    (non_blocking) on the device's current stream and records an event after it; `wait`
    returns once the latest has landed (an event query first: free when it has, as it has
    whenever the host synced on later work). The pattern of every per-step read-back (device
    drafts, accepted counts, a verify's greedy tokens; the host-returning read waits at once)."""

    def __init__(self, device: torch.device) -> None:
        self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        self.stream = CurrentStream(device)

    def copy(self, host: torch.Tensor, dev: torch.Tensor) -> None:
        host.copy_(dev, non_blocking=True)
        self.record()

    def record(self) -> None:
        """The event after a copy enqueued otherwise (inside a replayed graph,
        runners/launch_graphs.py): `wait` then waits for it."""
        self.stream.record(self.event)

    def wait(self) -> None:
        if not self.event.query():  # type: ignore[no-untyped-call]
            self.event.synchronize()
