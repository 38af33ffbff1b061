"""kernels.rope_freqs against ops.rope_freqs' reference: YaRN frequencies and attention factor,
positions far past the original context, odd head counts and widths, out aliasing x.

CPU: fp32 and fp16 under the Triton interpreter. cuda: bf16, width independence.
"""
from __future__ import annotations

import pytest
import torch

from draft_circuit.circuit.layers.rope import RopeScaling
from draft_circuit.kernels._common import KernelInputError
from draft_circuit.kernels.rope_freqs import rope_freqs
from draft_circuit.ops.rope_freqs import rope_freqs_ref
from draft_circuit.runners.testing import cuda

YARN = RopeScaling(rope_type="yarn", factor=40.0, original_max_position_embeddings=4096, mscale=0.9,
                   mscale_all_dim=0.7)


def _case(n, heads, dim, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, heads * dim, generator=g).to(dtype).to(device)
    pos = torch.randint(0, 160000, (n,), generator=g, dtype=torch.int32).to(device)
    return x, pos, YARN.inv_freq(dim).to(device)


@pytest.mark.parametrize("n, heads, dim", [(1, 1, 64), (3, 5, 64), (7, 3, 10), (2, 2, 6)])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-5), (torch.float16, 2e-3)])
def test_kernel_matches_reference(n, heads, dim, dtype, tol):
    x, pos, inv = _case(n, heads, dim, dtype)
    af = YARN.attention_factor
    out = torch.empty_like(x)
    rope_freqs(x, pos, inv, out, head_dim=dim, attention_factor=af, pos_offset=2)
    want = rope_freqs_ref(x, pos, inv, dim, af, 2)
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)
    rope_freqs(x, pos, inv, x, head_dim=dim, attention_factor=af, pos_offset=2)  # in place
    torch.testing.assert_close(x.float(), want.float(), atol=tol, rtol=tol)


def test_bad_operands_are_refused_by_name():
    x, pos, inv = _case(2, 2, 8, torch.float32)
    with pytest.raises(KernelInputError, match="inv_freq"):
        rope_freqs(x, pos, inv[:3], torch.empty_like(x), head_dim=8)
    with pytest.raises(KernelInputError, match="head_dim 6 must be even and divide"):
        rope_freqs(x, pos, inv, torch.empty_like(x), head_dim=6)


@cuda
def test_bf16_on_gpu_and_rows_never_depend_on_the_batch():
    x, pos, inv = _case(16, 128, 64, torch.bfloat16, device="cuda")
    out = torch.empty_like(x)
    rope_freqs(x, pos, inv, out, head_dim=64, attention_factor=YARN.attention_factor)
    want = rope_freqs_ref(x, pos, inv, 64, YARN.attention_factor)
    torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)
    alone = torch.empty_like(x[5:6])
    rope_freqs(x[5:6], pos[5:6], inv, alone, head_dim=64, attention_factor=YARN.attention_factor)
    assert torch.equal(alone, out[5:6])
