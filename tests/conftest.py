"""Test-wide setup: Triton runs in its interpreter when no GPU is present.

TRITON_INTERPRET must be set before triton is first imported, so it is set here,
before any test module imports the packages.
"""
import os

import torch

try:
    _HAS_CUDA = torch.cuda.is_available()
except Exception:  # a CPU build may raise on CUDA queries
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
