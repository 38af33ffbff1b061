"""The interpreter's tl.dot as the tests run it (tests/interpreter_dot.py): each row of a tile
gets the bits it has alone, wherever it sits in the tile, as the GPU's MMA gives them. On an AVX2
machine OpenBLAS's sgemm gives rows 6.. of a 16-row tile other bits than the same row alone, and
every width-invariance test of a tl.dot kernel failed there (CI's machine kind included)."""
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from draft_circuit.kernels._common import interpreting


@triton.jit
def _dot_kernel(a_ptr, b_ptr, out_ptr, rows, K: tl.constexpr, N: tl.constexpr, BLOCK_M: tl.constexpr):
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, K)
    n = tl.arange(0, N)
    a = tl.load(a_ptr + m[:, None] * K + k[None, :], mask=(m < rows)[:, None], other=0.0)
    b = tl.load(b_ptr + k[:, None] * N + n[None, :])
    acc = tl.dot(a, b, tl.zeros((BLOCK_M, N), dtype=tl.float32), input_precision="ieee")
    tl.store(out_ptr + m[:, None] * N + n[None, :], acc, mask=(m < rows)[:, None])


@pytest.mark.skipif(not interpreting(), reason="the interpreter's dot (a GPU runs its own)")
@pytest.mark.parametrize("K,N", [(32, 32), (64, 16), (128, 64)])
def test_a_row_of_a_tile_has_the_bits_it_has_alone(K, N):
    g = torch.Generator().manual_seed(K + N)
    a, b = torch.randn(16, K, generator=g), torch.randn(K, N, generator=g)
    full = torch.empty(16, N)
    _dot_kernel[(1,)](a, b, full, 16, K=K, N=N, BLOCK_M=16)
    for r in range(16):
        alone = torch.empty(1, N)
        _dot_kernel[(1,)](a[r:r + 1].contiguous(), b, alone, 1, K=K, N=N, BLOCK_M=16)
        assert torch.equal(full[r], alone[0]), r
    # and each row is numpy's matmul of that row (the interpreter's own arithmetic, row by row)
    want = np.concatenate([a[r:r + 1].numpy() @ b.numpy() for r in range(16)])
    assert np.array_equal(full.numpy(), want)
