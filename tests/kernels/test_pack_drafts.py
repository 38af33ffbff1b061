"""pack_drafts (issues 14 / 20): a device-resident batch's drafts, confidences' bits and fault
records packed for the host copy, and its verify input written, in one launch, against the
torch ops `DeviceDrafts.fill` runs elsewhere (a cat, the token column's copy, a clamp).

CPU: under the Triton interpreter, n = 1, 3, 64 and one past a program (n (k + 1) > 1024),
k = 1 and 4, zero, one and two records, rows stopped early (-1 drafts: 0 in the verify input);
words past the packed span and the verify input left as they were; every operand named. The
proposer's buffers filled through the kernel equal the torch ops'. cuda: the same bits on the
GPU, one profiled kernel.
"""
from __future__ import annotations

import pytest
import torch

from draft_circuit.kernels._common import KernelInputError
from draft_circuit.kernels.pack_drafts import LAUNCHES, pack_drafts
from draft_circuit.runners.proposer_device import DeviceDrafts
from draft_circuit.runners.testing import cuda

POISON = 0x5A5A5A5A
WORDS = 8


def case(n, k, records, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    drafts = torch.randint(0, 1000, (n, k), generator=g, dtype=torch.int32)
    for i in range(0, n, 3):  # rows stopped after a random draft
        drafts[i, int(torch.randint(0, k, (1,), generator=g)):] = -1
    bits = torch.rand((n, k), generator=g).view(torch.int32)
    tokens = torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32)
    recs = [torch.randint(-5, 5, (WORDS,), generator=g, dtype=torch.int32) for _ in range(records)]
    return [t.to(device) for t in (drafts.view(-1), bits.view(-1), tokens)], [r.to(device) for r in recs]


def buffers(n, k, device):
    return (torch.full((2 * n * k + 2 * WORDS + 5,), POISON, dtype=torch.int32, device=device),
            torch.full((n * (k + 1) + 5,), POISON, dtype=torch.int32, device=device))


def torch_ops(drafts, bits, tokens, recs, n, k):
    flat, verify = buffers(n, k, drafts.device)
    size = 2 * n * k + len(recs) * WORDS
    torch.cat([drafts, bits, *recs], out=flat[:size])
    rows = verify[:n * (k + 1)].view(n, k + 1)
    rows[:, 0].copy_(tokens)
    torch.clamp(drafts.view(n, k), min=0, out=rows[:, 1:])
    return flat, verify


@pytest.mark.parametrize("records", [0, 1, 2])
@pytest.mark.parametrize("n,k", [(1, 1), (3, 4), (64, 4), (210, 4), (5, 1)])
def test_the_kernel_is_the_torch_ops_bit_for_bit(n, k, records):
    (drafts, bits, tokens), recs = case(n, k, records, seed=n * 7 + k + records)
    flat, verify = buffers(n, k, "cpu")
    pack_drafts(drafts, bits, tokens, recs, flat, verify, k=k)
    want_flat, want_verify = torch_ops(drafts, bits, tokens, recs, n, k)
    assert torch.equal(flat, want_flat) and torch.equal(verify, want_verify)
    assert (verify[:n * (k + 1)] >= 0).all()  # a stop's -1 is a 0 in the verify input


@pytest.mark.parametrize("bad,match", [
    ("drafts_len", "drafts"), ("bits_dtype", "bits"), ("tokens_len", "tokens"),
    ("three_records", "at most 2"), ("record_dtype", "records"), ("flat_small", "flat"),
    ("verify_small", "verify")])
def test_a_bad_operand_is_named(bad, match):
    n, k = 3, 4
    (drafts, bits, tokens), recs = case(n, k, 2, seed=1)
    flat, verify = buffers(n, k, "cpu")
    if bad == "drafts_len":
        drafts = drafts[:-1]
    elif bad == "bits_dtype":
        bits = bits.view(torch.float32)
    elif bad == "tokens_len":
        tokens = tokens[:2]
    elif bad == "three_records":
        recs = recs + recs[:1]
    elif bad == "record_dtype":
        recs = [recs[0].long(), recs[1]]
    elif bad == "flat_small":
        flat = flat[:2 * n * k]
    elif bad == "verify_small":
        verify = verify[:n * (k + 1) - 1]
    with pytest.raises(KernelInputError, match=match):
        pack_drafts(drafts, bits, tokens, recs, flat, verify, k=k)


def test_the_proposer_buffers_filled_through_the_kernel():
    """`DeviceDrafts.fill` with the kernel (as on a GPU) writes the drafts, the confidences and
    the verify input the torch ops write, shape after shape (operands checked once a shape)."""
    k = 4
    fused, plain = (DeviceDrafts(max_width=8, num_drafts=k, device="cpu") for _ in range(2))
    for d in (fused, plain):
        d._verify_np = None  # (the CPU's numpy fill stands aside: the device path's ops run)
    fused.fused, plain.fused = True, False
    for step, n in enumerate([3, 3, 8, 1, 3]):
        (drafts, bits, tokens), _ = case(n, k, 0, seed=step)
        out = {"drafts": drafts.view(n, k).clone(), "confidences": bits.view(torch.float32).view(n, k).clone()}
        for d in (fused, plain):
            d.fill(out, tokens, n, k)
        assert torch.equal(fused.drafts(n, k), plain.drafts(n, k))
        assert torch.equal(fused.confidences(n, k), plain.confidences(n, k))
        assert torch.equal(fused.verify_tokens(), plain.verify_tokens())
        assert torch.equal(fused.verify_tokens().view(n, k + 1)[:, 1:], drafts.view(n, k).clamp(min=0))
    assert set(fused._packed) == {(3, 4), (8, 4), (1, 4)}


def test_the_warm_up_launches_the_pack_for_every_record_count():
    """`DeviceDrafts.warm` (the proposer calls it on a GPU) runs the counts and, where the fill
    is one kernel, the pack with zero, one and two records, on scratch: the proposer's own
    buffers are left as they were."""
    d = DeviceDrafts(max_width=4, num_drafts=3, device="cpu")
    d.fused = True
    seen = []
    import draft_circuit.runners.proposer_device as device_module
    real = device_module._pack_checked

    def spy(drafts, bits, tokens, records, flat, verify, *, k):
        seen.append(len(records))
        assert flat is not d.flat and verify is not d.verify
        return pack_drafts(drafts, bits, tokens, records, flat, verify, k=k)
    flat, verify = d.flat.clone(), d.verify.clone()
    device_module._pack_checked = lambda: spy
    try:
        d.warm(4, 3)
    finally:
        device_module._pack_checked = real
    assert seen == [0, 1, 2]
    assert torch.equal(d.flat, flat) and torch.equal(d.verify, verify)


@cuda
@pytest.mark.parametrize("n,records", [(1, 2), (4, 1), (64, 2)])
def test_the_kernel_on_the_gpu(n, records):
    k = 4
    (drafts, bits, tokens), recs = case(n, k, records, seed=n, device="cuda")
    flat, verify = buffers(n, k, "cuda")
    pack_drafts(drafts, bits, tokens, recs, flat, verify, k=k)
    want = torch_ops(drafts, bits, tokens, recs, n, k)
    assert torch.equal(flat, want[0]) and torch.equal(verify, want[1])
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        pack_drafts(drafts, bits, tokens, recs, flat, verify, k=k)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == LAUNCHES, [e.name for e in kernels]
