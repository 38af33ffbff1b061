"""argmax_logprob and linear_argmax_logprob against a plain torch reference (interpreter on CPU)."""
from __future__ import annotations

import math

import pytest
import torch

import draft_circuit.kernels.argmax_logprob as argmax_module
from draft_circuit.kernels._common import KernelInputError
from draft_circuit.kernels.argmax_logprob import (
    CHUNK, LINEAR_BLOCK_V, argmax_logprob, linear_argmax_logprob, linear_argmax_workspace_shape,
)

from draft_circuit.runners.testing import cuda  # marks `cuda` and skips without a GPU
INF = float("inf")
# the interpreter evaluates both sides of tl.where, so masked-off NaN lanes warn; they are expected
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def reference(logits: torch.Tensor, bitmask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """token = lowest id of the largest allowed finite logit; logprob = max - logsumexp(allowed finite)."""
    x = logits.float().cpu()
    n, V = x.shape
    ids = torch.arange(V)
    allowed = torch.isfinite(x)
    if bitmask is not None:
        # int64 keeps all 32 bits of each word; bit 31 comes out of the sign extension intact
        bits = (bitmask.cpu().long()[:, ids >> 5] >> (ids & 31)) & 1
        allowed &= bits.bool()
    masked = torch.where(allowed, x, -INF)
    best = masked.max(dim=1).values
    token = torch.where(allowed & (masked == best[:, None]), ids, V).min(dim=1).values
    logprob = best - torch.logsumexp(masked, dim=1)
    empty = ~allowed.any(dim=1)
    token[empty] = -1
    logprob[empty] = -INF
    return token.int(), logprob


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """bool [n, V] -> int32 [n, ceil(V/32)], token v at bit v % 32 of word v // 32."""
    n, V = allowed.shape
    words = -(-V // 32)
    padded = torch.zeros(n, words * 32, dtype=torch.int64)
    padded[:, :V] = allowed.long()
    packed = (padded.view(n, words, 32) << torch.arange(32)).sum(dim=2)
    return torch.where(packed >= 2**31, packed - 2**32, packed).int()


def poisoned(n: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.full((n,), 123456, dtype=torch.int32, device=device),
            torch.full((n,), float("nan"), device=device))


def assert_matches(token: torch.Tensor, logprob: torch.Tensor, ref_token: torch.Tensor,
                   ref_logprob: torch.Tensor, atol: float = 1e-5) -> None:
    assert torch.equal(token.cpu(), ref_token), (token, ref_token)
    torch.testing.assert_close(logprob.cpu(), ref_logprob, atol=atol, rtol=1e-5)


def run_argmax(logits: torch.Tensor, bitmask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    token, logprob = poisoned(logits.shape[0], logits.device.type)
    argmax_logprob(logits, token, logprob, bitmask)
    return token, logprob


def run_linear(x: torch.Tensor, w: torch.Tensor, bitmask: torch.Tensor | None = None,
               workspace: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    token, logprob = poisoned(x.shape[0], x.device.type)
    linear_argmax_logprob(x, w, token, logprob, bitmask, workspace)
    return token, logprob


def integer_valued(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    # small integers: every dot product is exact in fp32, so ties are exact on any hardware
    return torch.randint(-3, 4, shape, generator=gen).float()


# ---- argmax_logprob ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("V", [1000, 333, 65, 1, CHUNK + 37])
@pytest.mark.parametrize("masked", [False, True])
def test_argmax_matches_reference(dtype: torch.dtype, V: int, masked: bool) -> None:
    gen = torch.Generator().manual_seed(V)
    logits = (3 * torch.randn(3, V, generator=gen)).to(dtype)
    bitmask = pack_bitmask(torch.rand(3, V, generator=gen) < 0.5) if masked else None
    assert_matches(*run_argmax(logits, bitmask), *reference(logits, bitmask))


def test_argmax_ties_lowest_id_across_chunks() -> None:
    V = 2 * CHUNK + 5
    logits = torch.zeros(4, V)
    hot = [7, CHUNK + 1, 2 * CHUNK + 4]  # one per chunk, the last in the final partial chunk
    logits[:, hot] = 5.0
    allowed = torch.ones(4, V, dtype=torch.bool)
    allowed[1, 7] = False  # the tie moves to the second chunk
    allowed[2, [7, CHUNK + 1]] = False  # ... to the last chunk
    allowed[3] = False
    allowed[3, [40, 41]] = True  # a tie among non-max logits: 40
    bitmask = pack_bitmask(allowed)
    token, logprob = run_argmax(logits, bitmask)
    assert token.tolist() == [7, CHUNK + 1, 2 * CHUNK + 4, 40]
    assert_matches(token, logprob, *reference(logits, bitmask))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_argmax_non_finite_never_wins(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    V = 333
    logits = torch.randn(6, V, generator=gen)
    logits[0, 5], logits[0, 6], logits[0, 7] = float("nan"), INF, -INF
    logits[1, :] = float("nan")  # whole-NaN row: nothing allowed
    logits[2, :] = -INF
    logits[3, :] = INF
    logits[4, :] = float("nan")
    logits[4, 300] = -2.0  # the one finite logit wins, logprob 0
    logits[5, ::2] = INF
    logits = logits.to(dtype)
    token, logprob = run_argmax(logits)
    assert token[1:4].tolist() == [-1, -1, -1] and token[4].item() == 300
    assert logprob[4].item() == 0.0 and math.isinf(logprob[1].item())
    assert_matches(token, logprob, *reference(logits))


def test_argmax_single_allowed_token_and_bit_31() -> None:
    V = 65  # three words, the last one holding a single token
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(2))
    allowed = torch.zeros(6, V, dtype=torch.bool)
    for row, tok in enumerate([31, 0, 63, 64, 32]):
        allowed[row, tok] = True
    # row 5: nothing allowed
    token, logprob = run_argmax(logits, pack_bitmask(allowed))
    assert token.tolist() == [31, 0, 63, 64, 32, -1]
    assert logprob[:5].tolist() == [0.0] * 5 and logprob[5].item() == -INF


def test_argmax_row_does_not_depend_on_batch() -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 1000, generator=gen)
    bitmask = pack_bitmask(torch.rand(5, 1000, generator=gen) < 0.3)
    token, logprob = run_argmax(logits, bitmask)
    alone = run_argmax(logits[:1].clone(), bitmask[:1].clone())
    assert torch.equal(alone[0], token[:1]) and torch.equal(alone[1], logprob[:1])


def test_argmax_empty_batch() -> None:
    run_argmax(torch.randn(0, 100))


@pytest.mark.parametrize("bad", ["words", "dtype", "rows"])
def test_argmax_rejects_bad_bitmask(bad: str) -> None:
    logits = torch.randn(2, 100)  # needs 4 words
    bitmask = {"words": torch.zeros(2, 3, dtype=torch.int32), "dtype": torch.zeros(2, 4, dtype=torch.int64),
               "rows": torch.zeros(3, 4, dtype=torch.int32)}[bad]
    with pytest.raises(KernelInputError, match="bitmask") as info:
        run_argmax(logits, bitmask)
    if bad == "words":
        assert "4 words" in str(info.value) and "got 3" in str(info.value)


def test_argmax_rejects_bad_outputs() -> None:
    logits = torch.randn(2, 100)
    with pytest.raises(KernelInputError, match="token_out"):
        argmax_logprob(logits, torch.empty(2, dtype=torch.int64), torch.empty(2))
    with pytest.raises(KernelInputError, match="logprob_out"):
        argmax_logprob(logits, torch.empty(2, dtype=torch.int32), torch.empty(3))
    with pytest.raises(KernelInputError, match="logits"):
        argmax_logprob(logits.int(), torch.empty(2, dtype=torch.int32), torch.empty(2))


# ---- linear_argmax_logprob ---------------------------------------------------------------------

def linear_reference(x: torch.Tensor, w: torch.Tensor, bitmask: torch.Tensor | None = None):
    return reference(x.float() @ w.float().T, bitmask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,V,K", [(3, 333, 40), (5, 200, 72), (1, 65, 17), (2, 2 * LINEAR_BLOCK_V, 64)])
@pytest.mark.parametrize("masked", [False, True])
def test_linear_matches_reference(dtype: torch.dtype, n: int, V: int, K: int, masked: bool) -> None:
    gen = torch.Generator().manual_seed(V + K)
    x = integer_valued((n, K), gen).to(dtype)
    w = integer_valued((V, K), gen).to(dtype)
    bitmask = pack_bitmask(torch.rand(n, V, generator=gen) < 0.5) if masked else None
    assert_matches(*run_linear(x, w, bitmask), *linear_reference(x, w, bitmask), atol=1e-4)


def test_linear_random_fp32_close() -> None:
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(4, 96, generator=gen), torch.randn(300, 96, generator=gen)
    token, logprob = run_linear(x, w)
    ref_token, ref_logprob = linear_reference(x, w)
    logits = x @ w.T
    # a differently ordered fp32 sum may flip a near-tie; the pick must then be a near-max
    chosen = logits.gather(1, token.long()[:, None])[:, 0]
    torch.testing.assert_close(chosen, logits.max(dim=1).values, atol=1e-4, rtol=0)
    torch.testing.assert_close(logprob, ref_logprob, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("merge_block", [None, 2])
def test_linear_ties_masks_and_non_finite(merge_block: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    if merge_block is not None:  # several serial steps of the merge, as a 2**17+ vocab would take
        monkeypatch.setattr(argmax_module, "MERGE_BLOCK", merge_block)
    gen = torch.Generator().manual_seed(6)
    n, V, K = 6, 3 * LINEAR_BLOCK_V + 9, 24
    x = integer_valued((n, K), gen)
    w = integer_valued((V, K), gen)
    w[[3, LINEAR_BLOCK_V + 2, V - 1]] = 3.0  # equal top rows in three chunks: exact ties
    x[:, :] = x.abs() + 1  # positive rows, so those all-3 weight rows hold every row's max
    w[10, 0] = float("nan")  # column 10 is NaN for every row
    w[11, 0] = INF
    x[4] = float("nan")  # a whole-NaN row
    allowed = torch.ones(n, V, dtype=torch.bool)
    allowed[1, 3] = False
    allowed[2, [3, LINEAR_BLOCK_V + 2]] = False
    allowed[3] = False  # all masked
    allowed[5] = False
    allowed[5, 31] = True
    bitmask = pack_bitmask(allowed)
    token, logprob = run_linear(x, w, bitmask)
    assert token.tolist() == [3, LINEAR_BLOCK_V + 2, V - 1, -1, -1, 31]
    assert_matches(token, logprob, *linear_reference(x, w, bitmask), atol=1e-4)


def test_linear_workspace_passed_in_and_checked() -> None:
    gen = torch.Generator().manual_seed(7)
    x, w = integer_valued((3, 20), gen), integer_valued((300, 20), gen)
    workspace = torch.full(linear_argmax_workspace_shape(3, 300), float("nan"))
    assert_matches(*run_linear(x, w, workspace=workspace), *linear_reference(x, w), atol=1e-4)
    with pytest.raises(KernelInputError, match="workspace"):
        run_linear(x, w, workspace=torch.empty(3, 2, 3))
    with pytest.raises(KernelInputError, match="weight"):
        run_linear(x, w.half())
    with pytest.raises(KernelInputError, match="bitmask"):
        run_linear(x, w, torch.zeros(3, 9, dtype=torch.int32))  # 300 needs 10 words


def test_linear_row_does_not_depend_on_batch() -> None:
    gen = torch.Generator().manual_seed(8)
    x, w = torch.randn(5, 48, generator=gen), torch.randn(200, 48, generator=gen)
    token, logprob = run_linear(x, w)
    alone = run_linear(x[:1].clone(), w)
    assert torch.equal(alone[0], token[:1]) and torch.equal(alone[1], logprob[:1])


# ---- GPU ---------------------------------------------------------------------------------------

def assert_tokens_match_off_near_ties(logits: torch.Tensor, bitmask: torch.Tensor | None, token: torch.Tensor,
                                      ref_token: torch.Tensor, gap: float) -> None:
    """Tokens equal wherever the top two allowed logits are more than gap apart."""
    masked = torch.where(torch.isfinite(logits), logits, -INF)
    if bitmask is not None:
        ids = torch.arange(logits.shape[1])
        allowed = ((bitmask.cpu().long()[:, ids >> 5] >> (ids & 31)) & 1).bool()
        masked = masked.masked_fill(~allowed, -INF)
    top2 = masked.topk(2, dim=1).values
    clear = (top2[:, 0] - top2[:, 1]) > gap
    assert clear.float().mean() > 0.5
    assert torch.equal(token.cpu()[clear], ref_token[clear])


@cuda
@pytest.mark.parametrize("masked", [False, True])
def test_cuda_bf16_against_fp32_reference(masked: bool) -> None:
    gen = torch.Generator().manual_seed(10)
    n, V, K = 37, 32000 + 17, 1024
    logits = (3 * torch.randn(n, V, generator=gen)).bfloat16()
    logits[0, 100] = float("nan")
    bitmask = pack_bitmask(torch.rand(n, V, generator=gen) < 0.5) if masked else None
    dev_mask = bitmask.cuda() if masked else None
    assert_matches(*run_argmax(logits.cuda(), dev_mask), *reference(logits, bitmask), atol=1e-4)
    x = torch.randn(n, K, generator=gen).bfloat16()
    w = (torch.randn(V, K, generator=gen) / 8).bfloat16()
    token, logprob = run_linear(x.cuda(), w.cuda(), dev_mask)
    ref_token, ref_logprob = linear_reference(x, w, bitmask)
    # fp32 sums in another order: tokens may differ only at near-ties
    assert_tokens_match_off_near_ties(x.float() @ w.float().T, bitmask, token, ref_token, gap=1e-3)
    torch.testing.assert_close(logprob.cpu(), ref_logprob, atol=1e-3, rtol=1e-3)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_linear_matches_argmax_of_fp32_logits(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(11)
    n, V, K = 24, 50000 + 3, 2048
    x = torch.randn(n, K, generator=gen).to(dtype).cuda()
    w = (torch.randn(V, K, generator=gen) / 16).to(dtype).cuda()
    token, logprob = run_linear(x, w)
    torch.backends.cuda.matmul.allow_tf32 = False  # the default; the reference must be true fp32
    logits = x.float() @ w.float().T
    ref_token, ref_logprob = run_argmax(logits)
    assert_tokens_match_off_near_ties(logits.cpu(), None, token, ref_token.cpu(), gap=1e-3)
    # fp32 inputs must be multiplied in fp32, not tf32 (which would miss by ~1e-2 here)
    tol = 1e-3 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(logprob, ref_logprob, atol=tol, rtol=tol)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_width_independence(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(12)
    V, K = 32000 + 5, 512
    w = (torch.randn(V, K, generator=gen) / 8).to(dtype).cuda()
    row_logits = torch.randn(1, V, generator=gen).to(dtype).cuda()
    row_x = torch.randn(1, K, generator=gen).to(dtype).cuda()
    row_mask = pack_bitmask(torch.rand(1, V, generator=gen) < 0.7).cuda()
    alone = run_argmax(row_logits, row_mask), run_linear(row_x, w, row_mask)
    for n in torch.randint(2, 65, (12,), generator=gen).tolist() + [2, 64, 100]:  # 100: two row tiles
        logits = torch.cat([row_logits, torch.randn(n - 1, V, generator=gen).to(dtype).cuda()])
        x = torch.cat([row_x, torch.randn(n - 1, K, generator=gen).to(dtype).cuda()])
        mask = torch.cat([row_mask, pack_bitmask(torch.rand(n - 1, V, generator=gen) < 0.5).cuda()])
        for (tok1, lp1), (tok, lp) in zip(alone, (run_argmax(logits, mask), run_linear(x, w, mask))):
            assert torch.equal(tok[:1], tok1) and torch.equal(lp[:1], lp1), n
