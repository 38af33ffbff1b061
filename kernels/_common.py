"""Helpers shared by the kernel launchers: interpreter detection, PDL launch options, input checks.

Stable API: `interpreting()`, `pdl_supported(t)`, `launch_kwargs(t)`, `pdl_args(launch, rows)`,
`KernelInputError`, `check`, `describe`, `check_operand`, `unspecialized_jit(ints, pointers)`.
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


class KernelInputError(ValueError):
    """A launcher was handed a tensor of the wrong shape, dtype, layout or device."""


def check(cond: bool, message: Callable[[], str]) -> None:
    """Raise KernelInputError(message()) unless cond; the message is built only on failure."""
    if not cond:
        raise KernelInputError(message())


def describe(name: str, t: torch.Tensor) -> str:
    """'name: [3, 72] float16 stride (72, 1) on cpu', for error messages."""
    return f"{name}: {list(t.shape)} {str(t.dtype).removeprefix('torch.')} stride {t.stride()} on {t.device}"


def unspecialized_jit(ints: list[str], pointers: list[str]) -> Callable[..., object]:
    """`triton.jit` compiling one variant whatever the values of `ints` (no == 1 / % 16
    specialisation) and the alignment of `pointers`: a small per-step kernel launched on
    warm-up scratch and then on a step's views compiles once, at the warm-up. A Triton without
    the alignment option gets the int option alone (a layout may then compile once more)."""
    import triton

    try:
        return triton.jit(do_not_specialize=ints, do_not_specialize_on_alignment=pointers)
    except TypeError:
        return triton.jit(do_not_specialize=ints)


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def _device_is_hopper_plus(index: int) -> bool:
    try:
        return torch.cuda.get_device_capability(index)[0] >= 9
    except Exception:  # a CPU build or a broken driver: no PDL
        return False


def compiled_cuda_index(t: torch.Tensor) -> int | None:
    """The CUDA device index of t where kernels on it run compiled (not interpreted), else None
    (a CPU tensor, TRITON_INTERPRET, or a CUDA call that raises: a CPU build)."""
    if interpreting() or t.device.type != "cuda":
        return None
    index: int | None = t.device.index  # (None for "cuda": torch's stubs say int)
    if index is not None:
        return index
    try:
        return torch.cuda.current_device()
    except Exception:
        return None


def pdl_supported(t: torch.Tensor) -> bool:
    """Programmatic dependent launch needs a CUDA tensor on sm90+ and a compiled (not interpreted) kernel."""
    index = compiled_cuda_index(t)
    return index is not None and _device_is_hopper_plus(index)


def launch_kwargs(t: torch.Tensor) -> dict:
    """Extra kwargs for `kernel[grid](...)`: {"launch_pdl": True} only where PDL is supported.

    A kernel launched this way must call `tl.extra.cuda.gdc_wait()` before it reads anything a
    previous kernel wrote; launchers pass `**pdl_args(launch_kwargs(t), n)` for that.
    """
    return {"launch_pdl": True} if pdl_supported(t) else {}


#: the values of a kernel's `USE_PDL` constexpr (`pdl_args`): no PDL; or wait for the previous
#: launch (`gdc_wait`) before reading what it wrote, the next launch starting as this grid ends
#: unless the launch also releases it early (`pdl_release`, below)
PDL_OFF, PDL_WAIT = 0, 1
#: the widest row count a launch releases its successor early at: right after its wait
#: (`gdc_launch_dependents`), so the next launch and its weight prefetch overlap this grid's
#: whole run, not only its tail. Placed by two runs:
#: - the H100 with every kernel releasing early at every width (.gpu/run30.sh; benchmarks/
#:   RESULTS.md, "2026-12-07 (tenth session)"): the small head's 4-step chain -6.8% at n = 1,
#:   -5.6% at n = 8, +7.1% at n = 64; the 8B head within 0.3%;
#: - the H200 ("2026-12-07 (eleventh session)"), 960c88b / release at n <= 8 / at every width,
#:   two rounds each (the same code's rounds differ by up to ~1.5%): small -5% at n = 1 either
#:   way; at n = 9 / 16 / 32 the every-width tree -1.1 / -0.5 / -2.0% against n <= 8, at n = 64
#:   +12.9%; the 32k-vocabulary 8B chain -1.2 / -0.5 / -1.4% at n = 9 / 16 / 32, -1 to -2% at 64.
#: So up to 32 rows every launch releases early (what the every-width tree ran there); past 32
#: it only waits (what 960c88b ran): n = 64 loses 13% on the small head, and 33..63 are not
#: measured. Scheduling only: before its wait a kernel loads parameters only and stores
#: nothing (tests/kernels/test_pdl_level.py), so a launch released early meets nothing of the
#: one still running before it, and no row's bits move.
#: The release is a runtime kernel argument (`pdl_release`, in every such kernel's
#: `do_not_specialize`), not a constexpr level: a plan whose widths span both sides of 32 then
#: compiles each kernel once per PDL on/off, not twice (issue 15 item 5: with a constexpr
#: level the small head's 64-width plan compiled 54 kernels where 37 do, its cold capture
#: 4.79 s on the H200). The branch costs one scalar test, uniform across the launch: every
#: program takes the same side of it.
EARLY_RELEASE_MAX_ROWS = 32


def pdl_args(launch: dict, rows: int) -> dict[str, int]:
    """A launch's PDL arguments, `kernel[grid](..., **pdl_args(launch, n), **launch)`:
    `USE_PDL`, a constexpr, PDL_OFF without PDL (`launch` is `launch_kwargs`' empty dict) else
    PDL_WAIT; and `pdl_release`, a runtime int, 1 where PDL is on and `rows` is at most
    EARLY_RELEASE_MAX_ROWS, else 0. Kernels test `if USE_PDL:` before their wait and
    `if pdl_release != 0:` inside it, after the wait, before the release; as an argument no
    kernel specialises on (`do_not_specialize`), 0 and 1 run one compiled kernel. The
    prefetching prologue linear (kernels/linear_fused.py, PREFETCH) releases after its first K
    step whenever PDL is on, whatever `pdl_release` says, as it did before the early release."""
    if not launch:
        return {"USE_PDL": PDL_OFF, "pdl_release": 0}
    return {"USE_PDL": PDL_WAIT, "pdl_release": int(rows <= EARLY_RELEASE_MAX_ROWS)}


def check_operand(
    name: str,
    t: torch.Tensor,
    shape: tuple[int, ...],
    dtypes: tuple[torch.dtype, ...],
    device: torch.device,
) -> None:
    """Shape, dtype, device and unit innermost stride: what every launcher asks of a row operand."""
    check(tuple(t.shape) == tuple(shape), lambda: f"{describe(name, t)}: expected shape {list(shape)}")
    check(t.dtype in dtypes, lambda: f"{describe(name, t)}: expected dtype in {[str(d) for d in dtypes]}")
    check(t.device == device, lambda: f"{describe(name, t)}: expected device {device}")
    check(t.dim() == 0 or t.stride(-1) == 1 or t.shape[-1] == 1,
          lambda: f"{describe(name, t)}: the innermost dimension must be contiguous")


def fp32_workspace(workspace: torch.Tensor | None, shape: tuple[int, ...],
                   device: torch.device) -> torch.Tensor:
    """The launcher's fp32 scratch: the planner's preallocated buffer, checked, or (outside a
    plan, as tests call the launchers) a fresh one."""
    if workspace is None:
        return torch.empty(shape, dtype=torch.float32, device=device)
    check(tuple(workspace.shape) == tuple(shape) and workspace.dtype == torch.float32
          and workspace.is_contiguous() and workspace.device == device,
          lambda: f"workspace must be float32 {list(shape)} contiguous on {device}; "
                  f"got {describe('workspace', workspace)}")
    return workspace
