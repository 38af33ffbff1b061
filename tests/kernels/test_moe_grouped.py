"""The grouped MoE decode kernel against the moe_experts reference: fp32/fp16 under the interpreter
on small irregular shapes (experts spanning several row blocks, masked slots, padded expert
counts), the device-side grouping's invariants and launcher errors; bf16 and fp8 on CUDA, and
bitwise width independence for n in 2..64."""
from __future__ import annotations

import pytest
import torch

from draft_circuit.kernels._common import KernelInputError
from draft_circuit.kernels.moe_grouped import (BLOCK_M, max_blocks, moe_align_kernel, moe_grouped,
                                 moe_grouped_workspace)
from draft_circuit.circuit.layers.moe import quantize_blocks
from draft_circuit.ops.moe import dequantize_blocks, experts_ref
from draft_circuit.runners.testing import cuda


def make(n, h, e, i, k, shared, dtype, device="cpu", seed=0, masked=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).int()
    if masked and n > 2:
        ids[1, 0], ids[2, k - 1] = -1, e  # slots that select no expert
    t = {"x": torch.randn(n, h, generator=g), "ids": ids, "w": torch.rand(n, k, generator=g),
         "gu": torch.randn(e, 2 * i, h, generator=g) / h**0.5, "dn": torch.randn(e, h, i, generator=g) / i**0.5}
    if shared:
        t["sgu"] = torch.randn(2 * shared, h, generator=g) / h**0.5
        t["sd"] = torch.randn(h, shared, generator=g) / shared**0.5
    return {k_: v.to(device=device, dtype=dtype if v.is_floating_point() and k_ != "w" else v.dtype)
            for k_, v in t.items()}


def run(t, scales=None):
    out = torch.empty_like(t["x"])
    gu, dn = (t["gu"], t["dn"]) if scales is None else (scales[0][0], scales[1][0])
    moe_grouped(t["x"], t["ids"], t["w"], gu, dn, out,
                gate_up_scale=None if scales is None else scales[0][1],
                down_scale=None if scales is None else scales[1][1],
                shared_gate_up=t.get("sgu"), shared_down=t.get("sd"))
    return out


def reference(t, scales=None):
    shared = (t["sgu"], t["sd"]) if "sgu" in t else ()
    if scales is None:
        return experts_ref(t["x"], t["ids"], t["w"], t["gu"], t["dn"], shared)
    return experts_ref(t["x"], t["ids"], t["w"], scales[0][0], scales[1][0], shared,
                       (scales[0][1], scales[1][1]))


SHAPES = [  # n, H, E, I, k, shared I
    (5, 40, 6, 24, 2, 20),     # irregular everything
    (37, 24, 3, 16, 2, 0),     # ~25 rows an expert: several BLOCK_M blocks; 74 slots > one chunk
    (3, 136, 70, 8, 4, 8),     # 70 experts (padded to 128 in the grouping); H > one K tile
]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
@pytest.mark.parametrize("shape", SHAPES)
def test_interpreted_kernel_matches_reference(shape, dtype, tol):
    t = make(*shape, dtype=dtype)
    torch.testing.assert_close(run(t), reference(t), atol=tol, rtol=tol)


def test_grouping_invariants():
    n, k, e = 37, 3, 5
    g = torch.Generator().manual_seed(1)
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).int()
    ids[4, 2] = -1
    spec = moe_grouped_workspace(n, k, e, 8, 8, 0, "float32")
    slots, owners, starts = (torch.full(s, -7, dtype=torch.int32) for _, s in spec[:3])
    moe_align_kernel[(1,)](ids, slots, owners, starts, n * k, e, owners.shape[0], BLOCK_M=BLOCK_M,
                           EXPERTS=8, CHUNK=64)
    assert owners.shape[0] == max_blocks(n * k, e)
    placed = slots.view(-1, BLOCK_M)
    seen = []
    for b, expert in enumerate(owners.tolist()):
        live = [s for s in placed[b].tolist() if s >= 0]
        if expert < 0:
            assert not live  # unused blocks (the early exits) hold nothing
            continue
        assert live and all(int(ids.view(-1)[s]) == expert for s in live) and live == sorted(live)
        seen += live
    used = [x for x in owners.tolist() if x >= 0]
    assert used == sorted(used)  # an expert's blocks are adjacent
    assert sorted(seen) == [s for s in range(n * k) if 0 <= int(ids.view(-1)[s]) < e]


def test_launcher_errors_name_the_tensor():
    t = make(4, 16, 4, 8, 2, 0, torch.float32)
    with pytest.raises(KernelInputError, match="w_down"):
        moe_grouped(t["x"], t["ids"], t["w"], t["gu"], t["dn"][:, :, :4], torch.empty_like(t["x"]))
    with pytest.raises(KernelInputError, match="topk_ids"):
        moe_grouped(t["x"], t["ids"].long(), t["w"], t["gu"], t["dn"], torch.empty_like(t["x"]))
    with pytest.raises(KernelInputError, match="workspace must be"):
        moe_grouped(t["x"], t["ids"], t["w"], t["gu"], t["dn"], torch.empty_like(t["x"]), [])
    with pytest.raises(KernelInputError, match="come together"):
        moe_grouped(t["x"], t["ids"], t["w"], t["gu"], t["dn"], torch.empty_like(t["x"]),
                    gate_up_scale=torch.ones(4, 1, 1))


# ---- CUDA ----
GPU_SHAPE = (48, 520, 64, 256, 6, 512)  # n, H (not a multiple of 128), E, I, k, shared I


def _fp8(t):
    return quantize_blocks(t["gu"].float()), quantize_blocks(t["dn"].float())


@cuda
def test_bf16_and_fp32_kernel_match_reference_on_cuda():
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-4)):
        t = make(*GPU_SHAPE, dtype=dtype, device="cuda")
        torch.testing.assert_close(run(t).float(), reference(t).float(), atol=tol, rtol=tol)


@cuda
def test_fp8_kernel_matches_reference_on_cuda():
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-4)):
        t = make(*GPU_SHAPE, dtype=dtype, device="cuda", seed=3)
        scales = _fp8(t)
        got, want = run(t, scales).float(), reference(t, scales).float()
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)
        # and the block scales are really applied: the dequantised dense weights agree
        dense = {**t, "gu": dequantize_blocks(*scales[0]).to(dtype), "dn": dequantize_blocks(*scales[1]).to(dtype)}
        torch.testing.assert_close(got, reference(dense).float(), atol=5 * tol, rtol=5 * tol)


@cuda
@pytest.mark.parametrize("fp8", [False, True])
def test_width_independence_bitwise_on_cuda(fp8):
    """Each row computed alone equals the same row inside any batch of 2..64, bit for bit."""
    pool = make(64, 520, 64, 256, 6, 512, torch.bfloat16, device="cuda", seed=5, masked=False)
    scales = _fp8(pool) if fp8 else None
    alone = torch.cat([run({**pool, "x": pool["x"][r:r + 1], "ids": pool["ids"][r:r + 1],
                            "w": pool["w"][r:r + 1]}, scales) for r in range(64)])
    g = torch.Generator().manual_seed(0)
    for n in range(2, 65):
        rows = torch.randperm(64, generator=g)[:n].cuda()  # a different mix of rows each width
        batch = {**pool, "x": pool["x"][rows].contiguous(), "ids": pool["ids"][rows].contiguous(),
                 "w": pool["w"][rows].contiguous()}
        got = run(batch, scales)
        assert torch.equal(got, alone[rows]), f"n={n}: rows differ from their solo runs"
