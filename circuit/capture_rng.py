"""`release_rng_capture`: the device's default RNG generator out of capture mode after a CUDA
graph capture failed. Used by every capture site (runners/cudagraph.py's widths, circuit/tuning.py's
kernel timings); every CUDA call is behind the caller's own device checks.
"""
from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)


def release_rng_capture(stream: Any) -> None:
    """Leave the device's default RNG generator out of capture mode after a failed capture.

    A capture that fails at its end (a sync inside it, an invalidated stream) never runs the
    generator's capture epilogue on torch 2.11, so the generator stays "capturing" and every
    later eager random op on the device (`torch.randn`, a sampler's `multinomial`) raises
    "Offset increment outside graph capture encountered unexpectedly": one unserved width
    would break the host engine's sampling for the rest of the process. A capture that
    succeeds runs the epilogue, so one trivial capture (a one-element add, into its own pool,
    freed at once) puts the generator back. Best effort: if even that cannot capture, log it.
    """
    try:
        scratch = torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            graph.capture_begin()
            scratch.add_(0)
            graph.capture_end()
        torch.cuda.synchronize()
        del graph
    except Exception as e:  # noqa: BLE001 - only the RNG's state is at stake; say so
        log.warning("could not release the RNG generator after a failed capture: %s", e)
