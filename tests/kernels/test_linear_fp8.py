"""kernels.linear_fp8 against ops.fp8's reference: DeepSeek-V3 block scales expanded to rows (and
rows permuted, as bind does), K off the 128 block, irregular N and n; the fp8 conversion is exact,
so fp32 results agree to rounding. CPU: the interpreter. cuda: bf16, rows alone == in a batch."""
from __future__ import annotations

import pytest
import torch

from draft_circuit.circuit.layers.moe import quantize_blocks
from draft_circuit.kernels._common import KernelInputError
from draft_circuit.kernels.linear_fp8 import linear_fp8
from draft_circuit.ops.fp8 import linear_fp8_ref
from draft_circuit.runners.testing import cuda


def _case(n, rows, k, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    real = torch.randn(rows, k, generator=g) * torch.rand(rows, 1, generator=g) * 3
    w, blocks = quantize_blocks(real)  # [ceil(N/128), ceil(K/128)]
    perm = torch.randperm(rows, generator=g)
    row_scale = blocks.repeat_interleave(128, dim=0)[:rows][perm].contiguous()
    w = w.view(torch.uint8)[perm].view(torch.float8_e4m3fn).contiguous()
    x = torch.randn(n, k, generator=g).to(dtype)
    return x.to(device), w.to(device), row_scale.to(device)


@pytest.mark.parametrize("n, rows, k", [(1, 40, 128), (5, 200, 300), (17, 33, 7)])
def test_kernel_matches_reference(n, rows, k):
    x, w, s = _case(n, rows, k)
    out = torch.empty(n, rows)
    linear_fp8(x, w, s, out)
    want = linear_fp8_ref(x, w, s)
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-5)
    one = torch.empty(1, rows)
    linear_fp8(x[-1:], w, s, one)
    assert torch.equal(one, out[-1:])  # width independent


def test_bad_operands_are_refused_by_name():
    x, w, s = _case(2, 40, 130)
    with pytest.raises(KernelInputError, match="row_scale"):
        linear_fp8(x, w, s[:, :1].contiguous(), torch.empty(2, 40))
    with pytest.raises(KernelInputError, match="weight"):
        linear_fp8(x, w.float(), s, torch.empty(2, 40))


@cuda
@pytest.mark.parametrize("n", [1, 8, 64])
def test_bf16_on_gpu_rows_alone_are_bitwise(n):
    x, w, s = _case(n, 1536, 7168, torch.bfloat16, "cuda")
    out = torch.empty(n, 1536, dtype=torch.bfloat16, device="cuda")
    linear_fp8(x, w, s, out)
    torch.testing.assert_close(out.float(), linear_fp8_ref(x, w, s).float(), atol=3e-2, rtol=2e-2)
    alone = torch.empty(1, 1536, dtype=torch.bfloat16, device="cuda")
    linear_fp8(x[n // 2:n // 2 + 1], w, s, alone)
    assert torch.equal(alone, out[n // 2:n // 2 + 1])
