"""Device probes the runtime may call on any torch build (a CPU build raises on CUDA queries)."""
from __future__ import annotations

import torch


def cuda_available() -> bool:
    """True where a CUDA device can be used; False (never an exception) on a CPU-only build."""
    try:
        return torch.cuda.is_available()
    except Exception:  # a CPU build may raise on CUDA queries
        return False
