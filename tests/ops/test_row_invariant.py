"""ops.row_invariant: a row's bits from the references' linear never depend on the rows beside it.

This is what keeps speculation token-exact on CPU (a verify row must equal the decode row the
target alone computes), and it rests on a measured property of the BLAS (a fixed GEMM shape
treats its rows alike), so it is measured here: every row of batches of 1..3 * ROW_TILE rows
against the same row alone, bitwise, for the embedded default's target and drafter shapes and
odd ones, in every tiled dtype and at 1 and 2 threads (CI's count, and the engine's default).
"""
import pytest
import torch

from draft_circuit.ops import row_invariant
from draft_circuit.ops.basic import linear_ref
from draft_circuit.ops.row_invariant import ROW_TILE, TILED_DTYPES, row_invariant_linear

# (N, K): the embedded default (hidden 128, 4 x 32 q heads, 2 kv heads, intermediate 384, vocab
# 256): q/o, k/v, gate_up, down, lm_head; the MTP head's eh_proj and an EAGLE-3 fc; then odd sizes
SHAPES = [(128, 128), (64, 128), (768, 128), (128, 384), (256, 128), (128, 256), (128, 384 + 1),
          (97, 131), (1000, 77), (33, 1024), (1, 5), (7, 3), (4096, 64), (64, 4096)]
DTYPES = sorted(TILED_DTYPES, key=str) + [torch.float64]  # float64: the per-row path
THREADS = (1, 2)


@pytest.fixture(params=THREADS, ids=lambda t: f"threads{t}")
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _alone(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.stack([row_invariant_linear(row[None].clone(), w)[0] for row in x])


def _mismatches(got: torch.Tensor, want: torch.Tensor) -> list[int]:
    return [i for i in range(want.shape[0]) if not torch.equal(got[i], want[i])]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"N{s[0]}K{s[1]}")
def test_a_row_has_its_bits_alone_at_every_position_of_every_batch(shape, dtype, threads):
    n_out, k = shape
    g = torch.Generator().manual_seed(n_out * 7919 + k)
    w = torch.randn(n_out, k, generator=g).to(dtype)
    probes = (torch.randn(3 * ROW_TILE, k, generator=g) * torch.linspace(0.1, 8, 3 * ROW_TILE)[:, None]).to(dtype)
    alone = _alone(probes, w)
    for n in range(1, 3 * ROW_TILE + 1):
        for trial in range(2):  # other neighbours and other positions for the same rows
            pick = torch.randperm(3 * ROW_TILE, generator=g)[:n]
            got = row_invariant_linear(probes[pick], w)
            bad = _mismatches(got, alone[pick])
            assert not bad, (f"{dtype} [{n_out}, {k}] at {threads} threads: rows at positions {bad} "
                             f"of a {n}-row batch differ from the same rows alone")


@pytest.mark.parametrize("dtype", sorted(TILED_DTYPES, key=str), ids=str)
def test_neighbours_values_and_the_inputs_layout_do_not_reach_a_row(dtype, threads):
    """Non-finite and huge neighbours, a misaligned input view, a non-contiguous weight (a
    column shard) and a batch of several tiles with a ragged tail."""
    g = torch.Generator().manual_seed(3)
    k = 131
    w_full = torch.randn(97, 2 * k + 1, generator=g).to(dtype)
    for w in (w_full[:, :k].contiguous(), w_full[:, 1:k + 1]):  # the same tensor's layouts differ
        probes = torch.randn(5 * ROW_TILE + 3, k, generator=g).to(dtype)
        alone = _alone(probes, w)
        assert not _mismatches(row_invariant_linear(probes, w), alone)  # several tiles, a ragged tail
        rows = probes[:ROW_TILE].clone()
        rows[1], rows[ROW_TILE - 2] = float("nan"), float("inf")
        rows[3] = 1e4
        got = row_invariant_linear(rows, w)
        keep = [i for i in range(ROW_TILE) if i not in (1, 3, ROW_TILE - 2)]
        assert not _mismatches(got[keep], alone[keep]), "a NaN/Inf/huge row changed its neighbours"
        for offset in (1, 3):  # a row-multiple batch is read in place: at any alignment
            buf = torch.empty(offset + 2 * ROW_TILE * k, dtype=dtype)
            view = buf[offset:].view(2 * ROW_TILE, k)
            view.copy_(probes[:2 * ROW_TILE])
            assert not _mismatches(row_invariant_linear(view, w), alone[:2 * ROW_TILE]), \
                f"an input {offset} elements off its allocation's alignment changed rows"


def test_a_verify_reads_the_weights_once_per_tile_not_once_per_row(monkeypatch):
    """The point of the tiles (issue 20): k + 1 <= ROW_TILE verify rows are one GEMM call."""
    calls = []
    mm = torch.mm
    monkeypatch.setattr(row_invariant.torch, "mm", lambda *a, **kw: calls.append(a[0].shape) or mm(*a, **kw))
    w, x = torch.randn(64, 32), torch.randn(3 * ROW_TILE + 1, 32)
    for n, tiles in ((1, 1), (ROW_TILE - 3, 1), (ROW_TILE, 1), (ROW_TILE + 1, 2), (3 * ROW_TILE + 1, 4)):
        calls.clear()
        assert row_invariant_linear(x[:n], w).shape == (n, 64)
        assert calls == [(ROW_TILE, 32)] * tiles, f"{n} rows: GEMM calls {calls}"


def test_the_product_is_x_times_w_transposed():
    g = torch.Generator().manual_seed(5)
    x, w = torch.randn(13, 40, generator=g, dtype=torch.float64), torch.randn(9, 40, generator=g, dtype=torch.float64)
    torch.testing.assert_close(row_invariant_linear(x.float(), w.float()).double(), x @ w.T, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(row_invariant_linear(x, w), x @ w.T, rtol=0, atol=1e-12)  # per-row path
    assert row_invariant_linear(x[:0].float(), w.float()).shape == (0, 9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_linear_ref_with_a_wider_out_dtype_is_row_invariant_too(dtype, threads):
    """fp32 logits from bf16 / fp16 weights (the lm_head with out_dtype float32)."""
    g = torch.Generator().manual_seed(11)
    w = torch.randn(256, 128, generator=g).to(dtype)
    x = torch.randn(2 * ROW_TILE + 5, 128, generator=g).to(dtype)
    alone = torch.stack([linear_ref(row[None], w, torch.float32)[0] for row in x])
    for n in (1, 5, ROW_TILE, 2 * ROW_TILE + 5):
        got = linear_ref(x[:n], w, torch.float32)
        assert got.dtype == torch.float32 and not _mismatches(got, alone[:n])
