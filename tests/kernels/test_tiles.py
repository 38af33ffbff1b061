"""kernels.tiles' width rule over the chain's linears (tests/kernels/tile_cases.py names them).

CPU, Triton interpreter, fp32: the rule is inert (n = 64 launches today's pinned tiles, so
today's bits); the rule's table itself where wide tiles are allowed; the M-tile loop of the
split-K partials gives every row the pinned kernels' bits at n = 1..64; a forced BLOCK_M 64
computes the same products (to fp32 tolerance: numpy's sums over a 64-row block are another
order, which is why the interpreter keeps the pinned tiles). GPU (`-m cuda`, sm90, bf16): every
row at n = 2..64 is bitwise the row alone (n = 1, the pinned tiles), and n = 64 launched the wide
tiles.
"""
from __future__ import annotations

import pytest
import torch

from draft_circuit.kernels import linear_splitk as sk
from draft_circuit.kernels import tiles
from draft_circuit.kernels._common import KernelInputError
from tests.kernels.tile_cases import (CASES, KIND, LAUNCHED, MLOOP_KERNEL, LaunchRecorder,
                                      make_inputs)

SMALL_SPLIT = sk.SplitKConfig(block_n=16, split_k=64, block_k=32, num_warps=4, num_stages=2)
SPLITK_CASES = [c for c in CASES if KIND[c] in (tiles.SPLITK, tiles.PROLOGUE_SPLITK)]


@pytest.fixture(scope="module")
def cpu_inputs():
    # N = 24 off the 16- and 32-column tiles, K = 48 + 48 off the 128-column step: 2 K splits
    # of 64, the second one past K; small, since the interpreter runs 64 widths per case
    return make_inputs(64, 24, 96, 48, 50, torch.float32, "cpu", SMALL_SPLIT)


def test_rule_table_where_wide_tiles_are_allowed(monkeypatch):
    x = torch.empty(1, 8)
    monkeypatch.setattr(tiles, "wide_allowed", lambda t: True)
    for n in (1, 8, 16):
        for kind in tiles.MODES:
            assert tiles.choose(kind, n, x) == tiles.Tiles(tiles.PINNED)
    for n, m_tiles in ((17, 2), (33, 3), (64, 4), (200, 4)):
        assert tiles.choose(tiles.LINEAR, n, x) == tiles.Tiles(tiles.BM64, 64, 4)
        # the prologue kernels widen from three row tiles on (n > 32)
        assert tiles.choose(tiles.PROLOGUE, n, x) == (tiles.Tiles(tiles.BM64, 64, 4) if n > 32
                                                      else tiles.Tiles(tiles.PINNED))
        assert tiles.choose(tiles.SPLITK, n, x) == tiles.Tiles(tiles.MLOOP, 16, None, m_tiles)
        # the split-K prologue measured slower wide: pinned at every n
        assert tiles.choose(tiles.PROLOGUE_SPLITK, n, x) == tiles.Tiles(tiles.PINNED)
        # too few programs along N to fill the SMs at a wide tile: pinned
        for kind in tiles.MODES:
            assert tiles.choose(kind, n, x, programs=tiles.MIN_WIDE_PROGRAMS - 1) == \
                tiles.Tiles(tiles.PINNED)
        assert tiles.choose(tiles.LINEAR, n, x, programs=tiles.MIN_WIDE_PROGRAMS) == \
            tiles.Tiles(tiles.BM64, 64, 4)
    monkeypatch.setitem(tiles.WIDE, tiles.SPLITK, tiles.BM64)  # a kind's wide mode, switched
    monkeypatch.setitem(tiles.WIDE, tiles.PROLOGUE, tiles.PINNED)
    assert tiles.choose(tiles.SPLITK, 64, x) == tiles.Tiles(tiles.BM64, 64, 4)
    assert tiles.choose(tiles.PROLOGUE, 64, x) == tiles.Tiles(tiles.PINNED)
    assert tiles.choose(tiles.LINEAR, 64, x) == tiles.Tiles(tiles.BM64, 64, 4)
    assert tiles.describe(tiles.LINEAR, 64, x) == "bm64 (BLOCK_M 64, 4 warps)"


def test_rule_is_inert_in_the_interpreter_and_off_cuda():
    assert tiles.interpreting()  # this file's CPU tests run interpreted (tests/conftest.py)
    for kind in tiles.MODES:
        assert tiles.choose(kind, 64, torch.empty(64, 8)) == tiles.Tiles(tiles.PINNED)
        assert tiles.choose(kind, 64, torch.empty(64, 8, device="meta")) == tiles.Tiles(tiles.PINNED)
    assert tiles.describe(tiles.SPLITK, 64, torch.empty(1)) == "pinned (BLOCK_M 16)"
    assert tiles.describe(tiles.SPLITK, 40, torch.empty(1), tiles.MLOOP) == "mloop (3 x 16 rows)"


def test_forced_modes_are_checked_against_the_kind():
    x = torch.empty(1, 8)
    with pytest.raises(KernelInputError, match="mode must be one of"):
        tiles.choose(tiles.LINEAR, 64, x, tiles.MLOOP)
    with pytest.raises(KernelInputError, match="tile kind"):
        tiles.choose("attention", 64, x)
    with pytest.raises(KernelInputError, match="mode must be one of"):
        CASES["linear"](make_inputs(2, 8, 16, 8, 4, torch.float32, "cpu", SMALL_SPLIT), 2, "wide")


@pytest.mark.parametrize("case", list(CASES))
def test_interpreter_keeps_the_pinned_launch_at_n64(case, cpu_inputs, monkeypatch):
    rec = LaunchRecorder(monkeypatch)
    got = CASES[case](cpu_inputs, 64, None)
    name, block_m, m_tiles, warps = rec.first(LAUNCHED[case])
    assert (block_m, m_tiles, warps) == (16, None, 4), rec.seen  # today's constants, so its bits
    assert not any(s[0] in MLOOP_KERNEL.values() for s in rec.seen)
    assert torch.equal(got, CASES[case](cpu_inputs, 64, tiles.PINNED))


@pytest.mark.parametrize("case", SPLITK_CASES)
def test_mloop_partials_bitwise_the_pinned_at_every_width(case, cpu_inputs, monkeypatch):
    want = CASES[case](cpu_inputs, 64, tiles.PINNED)  # width invariant: its own tests say so
    rec = LaunchRecorder(monkeypatch)
    for n in range(1, 65):
        got = CASES[case](cpu_inputs, n, tiles.MLOOP)
        assert not got.isnan().any() and torch.equal(got, want[:n]), (case, n)
    used = {s[2] for s in rec.seen if s[0] == MLOOP_KERNEL[LAUNCHED[case]]}
    assert used == {1, 2, 3, 4}  # every M_TILES ran (n = 1..16, 17..32, ...)
    assert not any(s[0] == LAUNCHED[case] for s in rec.seen)


@pytest.mark.parametrize("case", list(CASES))
def test_forced_bm64_computes_the_same_products(case, cpu_inputs, monkeypatch):
    rec = LaunchRecorder(monkeypatch)
    want = CASES[case](cpu_inputs, 64, tiles.PINNED)
    for n in (17, 64):
        got = CASES[case](cpu_inputs, n, tiles.BM64)
        assert not got.isnan().any()
        torch.testing.assert_close(got, want[:n], atol=1e-5, rtol=1e-5)
    assert (64, 4) in {(s[1], s[3]) for s in rec.seen if s[0] == LAUNCHED[case]}


# ---- on the GPU: bf16, the rule's own choice, bitwise row alone == row in batch ----
@pytest.mark.cuda
@pytest.mark.parametrize("case", list(CASES))
def test_gpu_rows_bitwise_alone_and_wide_tiles_at_n64(case, monkeypatch):
    if tiles.interpreting() or not torch.cuda.is_available():
        pytest.fail("a cuda test ran without a compiled GPU path")
    if torch.cuda.get_device_capability() != tiles.MEASURED_ARCH:
        pytest.skip(f"the wide rule is for sm90 only; this GPU is {torch.cuda.get_device_capability()}")
    # K = 1024 + 1024 (the concat's two halves), N 4096 (enough programs for the wide tiles:
    # tiles.MIN_WIDE_PROGRAMS); the split config is the rule's own. A kind whose wide mode is
    # PINNED (the split-K prologue) runs its M-loop forced: its bits still must not move
    cfg = sk.default_config(4096, 2048)
    inp = make_inputs(64, 4096, 2048, 1024, 512, torch.bfloat16, "cuda", cfg, seed=1)
    fn = CASES[case]
    forced = tiles.MLOOP if tiles.WIDE[KIND[case]] == tiles.PINNED else None
    alone = torch.cat([fn(_row_inputs(inp, i), 1, None) for i in range(64)])
    rec = LaunchRecorder(monkeypatch)
    for n in range(2, 65):
        got = fn(inp, n, forced if n > 16 else None)
        same = (got.view(torch.int16) == alone[:n].view(torch.int16)).all(dim=1)
        assert bool(same.all()), (case, n, (~same).nonzero().flatten()[:8].tolist())
    # split-K: then its reduce
    wide = rec.seen[-2] if KIND[case] in (tiles.SPLITK, tiles.PROLOGUE_SPLITK) else rec.seen[-1]
    mode = forced or tiles.WIDE[KIND[case]]  # the rule's wide mode for the kind (BM64, MLOOP)
    assert mode != tiles.PINNED, "the kind's wide mode is switched off: nothing wide to check"
    want = ((MLOOP_KERNEL[LAUNCHED[case]], 16, 4, cfg.num_warps) if mode == tiles.MLOOP
            else (LAUNCHED[case], 64, None, 4))
    assert wide == want, rec.seen[-2:]


def _row_inputs(inp, i: int):
    """The inputs with row i moved to row 0, so that a launch of n = 1 runs row i alone."""
    import dataclasses

    rows = {f: getattr(inp, f)[i:i + 1] for f in ("x", "x1", "x2", "ids", "res")}
    return dataclasses.replace(inp, **rows)
