"""runners.device.CurrentStream on the GPU (`pytest -m cuda`): the stream it gives is
`torch.cuda.current_stream()`'s on the default stream and inside `torch.cuda.stream(s)`, and
an event it records orders work on that stream (the proposer's staging and read-back record
their copies' events through it)."""
from __future__ import annotations

import torch

from draft_circuit.runners.device import CurrentStream
from draft_circuit.runners.testing import cuda


@cuda
def test_current_stream_follows_the_host_stream() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    current = CurrentStream(dev)
    assert current() == torch.cuda.current_stream()
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current() == side == torch.cuda.current_stream()
    assert current() == torch.cuda.current_stream() != side


@cuda
def test_recorded_event_waits_for_the_stream_s_work() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    current, event = CurrentStream(dev), torch.cuda.Event()
    side = torch.cuda.Stream()
    x = torch.randn(2048, 2048, device=dev)
    with torch.cuda.stream(side):
        host = torch.empty(x.shape, pin_memory=True)
        for _ in range(8):
            x = x @ x / 2048.0  # work long enough to be pending at the record
        host.copy_(x, non_blocking=True)
        current.record(event)
    event.synchronize()
    assert torch.equal(host, x.cpu())
