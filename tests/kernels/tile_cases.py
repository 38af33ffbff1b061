"""The launches kernels.tiles' rule governs, as the draft chain makes them, for tests/kernels/
test_tiles.py: each case runs one launcher on the first n rows of shared inputs at a forced
kernels.tiles mode (or the rule's, mode None) and returns its result rows [n, cols].

KIND names the rule's kind of each case; LAUNCHED the kernel whose launch the rule sizes.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from triton.runtime import interpreter, jit

from draft_circuit.kernels import linear_fused as lf
from draft_circuit.kernels import linear_fused_splitk as lfs
from draft_circuit.kernels import linear_splitk as sk
from draft_circuit.kernels import tiles
from draft_circuit.kernels.linear import linear, linear_silu_mul


@dataclass
class Inputs:
    """Row operands [nmax, ...] (sliced to n per launch) and the weights, for one shape."""

    x: torch.Tensor          # [nmax, K]
    x1: torch.Tensor         # [nmax, K1], x2: [nmax, K - K1]
    x2: torch.Tensor
    table: torch.Tensor      # [V, K1] embedding
    ids: torch.Tensor        # [nmax] into table, one of them -1 (an all-masked draft: zeros)
    w: torch.Tensor          # [N, K]
    w2: torch.Tensor         # [2N, K]: SwiGLU's [Wg; Wu]
    wq: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # q/k/v [N, K], [N/2, K], [N/2, K]
    nw: torch.Tensor         # [K] norm weights
    nw1: torch.Tensor        # [K1], nw2: [K - K1]
    nw2: torch.Tensor
    res: torch.Tensor        # [nmax, N] residual
    split: sk.SplitKConfig


def make_inputs(nmax: int, n_out: int, k: int, k1: int, vocab: int, dtype: torch.dtype,
                device: str, split: sk.SplitKConfig, seed: int = 0) -> Inputs:
    gen = torch.Generator(device=device).manual_seed(seed)

    def r(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    ids = torch.randint(0, vocab, (nmax,), generator=gen, device=device)
    ids[nmax // 3] = -1
    w = k ** -0.5
    return Inputs(
        x=r(nmax, k), x1=r(nmax, k1), x2=r(nmax, k - k1), table=r(vocab, k1), ids=ids,
        w=r(n_out, k, scale=w), w2=r(2 * n_out, k, scale=w),
        wq=(r(n_out, k, scale=w), r(n_out // 2, k, scale=w), r(n_out // 2, k, scale=w)),
        nw=1 + r(k, scale=0.1), nw1=1 + r(k1, scale=0.1), nw2=1 + r(k - k1, scale=0.1),
        res=r(nmax, n_out), split=split)


def _new(n: int, cols: int, like: torch.Tensor) -> torch.Tensor:
    return torch.full((n, cols), float("nan"), dtype=like.dtype, device=like.device)


def _linear(i: Inputs, n: int, mode: str | None) -> torch.Tensor:
    out = _new(n, i.w.shape[0], i.x)
    linear(i.x[:n], i.w, out, tiles=mode)
    return out


def _silu_mul(i: Inputs, n: int, mode: str | None) -> torch.Tensor:
    out = _new(n, i.w.shape[0], i.x)
    linear_silu_mul(i.x[:n], i.w2, out, tiles=mode)
    return out


def _qkv(i: Inputs, n: int, mode: str | None) -> torch.Tensor:
    outs = [_new(n, w.shape[0], i.x) for w in i.wq]
    lf.rmsnorm_linear_qkv(i.x[:n], i.nw, 1e-6, i.wq, outs, tiles=mode)
    return torch.cat(outs, dim=1)


def _norm_silu(i: Inputs, n: int, mode: str | None) -> torch.Tensor:  # gate_up: norm + SwiGLU
    out = _new(n, i.w.shape[0], i.x)
    lf.linear_prologue(i.x[:n], i.w2, out, norm1=i.nw, silu_mul=True, tiles=mode)
    return out


def _concat(i: Inputs, n: int, mode: str | None) -> torch.Tensor:  # embed, two norms, concat
    out = _new(n, i.w.shape[0], i.x)
    lf.linear_prologue(i.table, i.w, out, ids=i.ids[:n], norm1=i.nw1, x2=i.x2[:n], norm2=i.nw2,
                       tiles=mode)
    return out


def _residual(i: Inputs, n: int, mode: str | None) -> torch.Tensor:  # o / down then the add
    out = _new(n, i.w.shape[0], i.x)
    lf.linear_prologue(i.x[:n], i.w, out, residual=i.res[:n], tiles=mode)
    return out


def _splitk_residual(i: Inputs, n: int, mode: str | None) -> torch.Tensor:
    out = _new(n, i.w.shape[0], i.x)
    sk.linear_splitk(i.x[:n], i.w, out, None, i.split, residual=i.res[:n], tiles=mode)
    return out


def _splitk_silu(i: Inputs, n: int, mode: str | None) -> torch.Tensor:
    out = _new(n, i.w.shape[0], i.x)
    sk.linear_silu_mul_splitk(i.x[:n], i.w2, out, None, i.split, tiles=mode)
    return out


def _pro_splitk_concat(i: Inputs, n: int, mode: str | None) -> torch.Tensor:  # eh_proj
    out = _new(n, i.w.shape[0], i.x)
    lfs.linear_prologue_splitk(i.table, i.w, out, ids=i.ids[:n], norm1=i.nw1, x2=i.x2[:n],
                               norm2=i.nw2, config=i.split, tiles=mode)
    return out


def _pro_splitk_norm_silu(i: Inputs, n: int, mode: str | None) -> torch.Tensor:
    out = _new(n, i.w.shape[0], i.x)
    lfs.linear_prologue_splitk(i.x[:n], i.w2, out, norm1=i.nw, silu_mul=True, config=i.split,
                               tiles=mode)
    return out


def _pro_splitk_residual(i: Inputs, n: int, mode: str | None) -> torch.Tensor:  # no prologue
    out = _new(n, i.w.shape[0], i.x)
    lfs.linear_prologue_splitk(i.x[:n], i.w, out, residual=i.res[:n], config=i.split, tiles=mode)
    return out


CASES: dict[str, Callable[[Inputs, int, str | None], torch.Tensor]] = {
    "linear": _linear, "linear_silu_mul": _silu_mul, "rmsnorm_linear_qkv": _qkv,
    "prologue_norm_silu": _norm_silu, "prologue_concat": _concat,
    "prologue_residual": _residual, "splitk_residual": _splitk_residual,
    "splitk_silu": _splitk_silu, "prologue_splitk_concat": _pro_splitk_concat,
    "prologue_splitk_norm_silu": _pro_splitk_norm_silu,
    "prologue_splitk_residual": _pro_splitk_residual}
KIND = {c: tiles.PROLOGUE_SPLITK if c.startswith("prologue_splitk") else tiles.SPLITK
        if "splitk" in c else tiles.LINEAR if c.startswith("linear") else tiles.PROLOGUE
        for c in CASES}
LAUNCHED = {"linear": "linear_kernel", "linear_silu_mul": "linear_kernel",
            "rmsnorm_linear_qkv": "rmsnorm_linear_qkv_kernel",
            "prologue_norm_silu": "linear_prologue_kernel",
            "prologue_concat": "linear_prologue_kernel",
            "prologue_residual": "linear_prologue_kernel",
            "splitk_residual": "_partial_kernel", "splitk_silu": "_partial_kernel",
            "prologue_splitk_concat": "_prologue_partial_kernel",
            "prologue_splitk_norm_silu": "_prologue_partial_kernel",
            "prologue_splitk_residual": "_prologue_partial_kernel"}
MLOOP_KERNEL = {"_partial_kernel": "linear_wide_kernel",
                "_prologue_partial_kernel": "_prologue_partial_mloop_kernel"}


class LaunchRecorder:
    """Records (kernel name, BLOCK_M, M_TILES, num_warps) of every Triton launch, compiled or
    interpreted, while installed (pytest's monkeypatch undoes it)."""

    def __init__(self, monkeypatch) -> None:
        self.seen: list[tuple[str, int | None, int | None, int | None]] = []
        for cls in (interpreter.InterpretedFunction, jit.JITFunction):
            monkeypatch.setattr(cls, "run", self._wrap(cls.run))

    def _wrap(self, run):
        def recorded(fn_self, *args, grid, warmup, **kwargs):
            if not warmup:
                self.seen.append((fn_self.fn.__name__, kwargs.get("BLOCK_M"),
                                  kwargs.get("M_TILES"), kwargs.get("num_warps")))
            return run(fn_self, *args, grid=grid, warmup=warmup, **kwargs)
        return recorded

    def first(self, name: str) -> tuple[str, int | None, int | None, int | None]:
        return next(s for s in self.seen if s[0] == name)
