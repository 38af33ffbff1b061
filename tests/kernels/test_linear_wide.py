"""kernels.linear_wide against the pinned kernels (CPU, Triton interpreter, fp32), and the CPU
smoke path of benchmarks/wide_sweep.py.

The M-tile loop (`linear_wide`, `linear_wide_splitk`) promises every row the bits of
kernels.linear / kernels.linear_splitk at every n and every m_tiles: checked bitwise here at
n = 1..64 (and past 64, where programs repeat along M). `linear_tiles` (the pinned kernel at other
tiles) promises no bits: checked against it to fp32 tolerance. The GPU verdicts are the sweep's.
"""
from __future__ import annotations

import json

import pytest
import torch

from draft_circuit.kernels import linear_splitk as sk
from draft_circuit.kernels import linear_wide as lw
from draft_circuit.kernels._common import KernelInputError
from draft_circuit.kernels.linear import linear, linear_silu_mul

SMALL_SPLIT = sk.SplitKConfig(block_n=16, split_k=64, block_k=32, num_warps=4, num_stages=2)
N_OUT, K = 40, 96  # N off the 32-column tile, K off the 128-column step


def _inputs(n: int, rows: int, k: int = K, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, k, generator=gen)
    w = torch.randn(rows, k, generator=gen) / k ** 0.5
    return x, w


def _pinned(x: torch.Tensor, w: torch.Tensor, silu: bool) -> torch.Tensor:
    out = torch.full((x.shape[0], w.shape[0] // 2 if silu else w.shape[0]), float("nan"))
    (linear_silu_mul if silu else linear)(x, w, out)
    return out


@pytest.mark.parametrize("silu", [False, True])
def test_m_tile_loop_bitwise_at_every_width(silu):
    x, w = _inputs(64, 2 * N_OUT if silu else N_OUT, seed=int(silu))
    want = _pinned(x, w, silu)  # the pinned kernel is width invariant (tests/kernels/test_linear.py)
    for n in range(1, 65):
        out = torch.full_like(want[:n], float("nan"))
        lw.linear_wide(x[:n], w, out, silu_mul=silu)  # m_tiles = cdiv(n, 16)
        assert torch.equal(out, want[:n]), n


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("m_tiles", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [1, 16, 17, 50, 70])
def test_any_m_tiles_gives_the_pinned_bits(silu, m_tiles, n):
    x, w = _inputs(n, 2 * N_OUT if silu else N_OUT, seed=n)
    out = torch.full_like(_pinned(x, w, silu), float("nan"))
    lw.linear_wide(x, w, out, silu_mul=silu, m_tiles=m_tiles)
    assert torch.equal(out, _pinned(x, w, silu))
    alone = torch.full_like(out[:1], float("nan"))
    lw.linear_wide(x[n - 1:], w, alone, silu_mul=silu, m_tiles=m_tiles)
    assert torch.equal(alone[0], out[n - 1])  # the last row, at position 0 alone


def test_wider_block_n_matches_pinned_kernel_at_that_block_n():
    x, w = _inputs(33, N_OUT + 50, seed=3)
    want = torch.empty(33, N_OUT + 50)
    lw.linear_tiles(x, w, want, False, 16, 64)
    out = torch.full_like(want, float("nan"))
    lw.linear_wide(x, w, out, config=lw.WideConfig(block_n=64))
    assert torch.equal(out, want)


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("n", [1, 5, 16, 33, 64])
def test_splitk_m_tile_loop_bitwise(silu, n):
    x, w = _inputs(n, 2 * N_OUT if silu else N_OUT, k=200, seed=n + 7)
    want = torch.full((n, N_OUT), float("nan"))
    (sk.linear_silu_mul_splitk if silu else sk.linear_splitk)(x, w, want, None, SMALL_SPLIT)
    for tiles in (None, 1, 4):
        out = torch.full_like(want, float("nan"))
        ws = torch.full(sk.splitk_workspace_shape(n, w.shape[0], 200, SMALL_SPLIT), float("nan"))
        lw.linear_wide_splitk(x, w, out, ws, SMALL_SPLIT, silu_mul=silu, m_tiles=tiles)
        assert torch.equal(out, want), tiles


@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("tiles", [(16, 32, 4, 4), (32, 32, 4, 4), (64, 32, 4, 4), (64, 32, 2, 4),
                                   (16, 64, 4, 4), (16, 128, 4, 4), (16, 32, 8, 4), (16, 32, 4, 3)])
def test_tile_variants_match_the_pinned_kernel(silu, tiles):
    x, w = _inputs(37, 2 * N_OUT if silu else N_OUT, seed=11)
    out = torch.full_like(_pinned(x, w, silu), float("nan"))
    lw.linear_tiles(x, w, out, silu, *tiles)
    want = _pinned(x, w, silu)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    if tiles == (16, 32, 4, 4):  # the pinned constants: the pinned kernel's launch, bit for bit
        assert torch.equal(out, want)


def test_rejects_bad_m_tiles_and_blocks():
    x, w = _inputs(3, N_OUT)
    out = torch.empty(3, N_OUT)
    with pytest.raises(KernelInputError, match="m_tiles"):
        lw.linear_wide(x, w, out, m_tiles=5)
    with pytest.raises(KernelInputError, match="powers of two"):
        lw.linear_wide(x, w, out, config=lw.WideConfig(block_n=24))
    assert lw.default_m_tiles(1) == 1 and lw.default_m_tiles(17) == 2 and lw.default_m_tiles(500) == 4


def test_sweep_cpu_smoke(tmp_path, monkeypatch):
    from benchmarks import wide_sweep as ws

    def refuse(*args, **kwargs):
        raise AssertionError("a --dry-run sweep called CUDA")
    monkeypatch.setattr(torch.cuda, "Event", refuse)
    monkeypatch.setattr(torch.cuda, "synchronize", refuse)
    ws.main(["--dry-run", "--out", str(tmp_path), "--shapes", "gate_up,down,lm_head",
             "--candidates", "mloop,bm64_w4,splitk_mloop,cublas,lm_fused,rule,splitk_rule"])
    data = json.loads((tmp_path / "wide_sweep.json").read_text())
    assert data["benchmark"] == "wide_sweep" and data["widths"] == list(ws.DRY_WIDTHS)
    got = {(e["shape"], e["candidate"]) for e in data["results"]}
    assert {("gate_up", "mloop"), ("down", "splitk_mloop"), ("lm_head", "lm_fused"),
            ("gate_up", "bm64_w4"), ("down", "cublas"), ("gate_up", "rule"),
            ("down", "splitk_rule")} <= got
    for e in data["results"]:
        assert "error" not in e, e
        assert e["us"] > 0 and e["eq_self"] <= e["n"]
        # bitwise by construction; the rule keeps the pinned tiles in the interpreter
        if e["candidate"] in ("pinned", "mloop", "splitk", "splitk_mloop", "rule", "splitk_rule"):
            assert e["eq_ref"] == e["n"] and e["max_abs_diff_ref"] == 0.0, e
    assert set(data["summary"]) == {"gate_up", "down", "lm_head"}
    assert data["summary"]["down"]["1"]["best_bitwise_ref"] is not None


def test_sweep_chain_shapes_cpu_smoke(tmp_path, monkeypatch):
    """The chain's fused linears (benchmarks/wide_chain.py) in the dry sweep: the pinned ref, the
    rule and the forced M-loop, every row of every width bitwise the ref's row alone."""
    from benchmarks import wide_sweep as ws

    monkeypatch.setattr(torch.cuda, "Event", lambda *a, **k: pytest.fail("dry run called CUDA"))
    ws.main(["--dry-run", "--out", str(tmp_path), "--shapes", "qkv_norm,eh_proj_concat_splitk",
             "--candidates", "rule,mloop"])
    data = json.loads((tmp_path / "wide_sweep.json").read_text())
    got = {(e["shape"], e["candidate"]) for e in data["results"]}
    assert got == {("qkv_norm", "pinned"), ("qkv_norm", "rule"), ("eh_proj_concat_splitk", "pinned"),
                   ("eh_proj_concat_splitk", "rule"), ("eh_proj_concat_splitk", "mloop")}
    for e in data["results"]:
        assert "error" not in e, e
        assert e["family"] == "pinned" and e["eq_ref"] == e["n"] and e["eq_self"] == e["n"], e


def test_sweep_compile_only_worker_runs_its_share(monkeypatch):
    """The precompile workers' path (in-process here): each launches its share of the kernels."""
    from benchmarks import wide_sweep as ws

    calls: list[str] = []
    real = lw.linear_wide
    monkeypatch.setattr(lw, "linear_wide", lambda *a, **k: calls.append("wide") or real(*a, **k))
    shapes = [s for s in ws.DRY_SHAPES if s[0] == "down"]
    ws.compile_only(1, 2, shapes, torch.device("cpu"), torch.float32, True, {"mloop"})
    ws.compile_only(0, 2, shapes, torch.device("cpu"), torch.float32, True, {"mloop"})
    # mloop at n = 1 (rows 0 and 1), 32, 64, by exactly one of the two workers
    assert calls == ["wide"] * 4
