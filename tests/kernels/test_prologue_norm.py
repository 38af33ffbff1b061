"""kernels.prologue_norm: a prologue linear's x as a launch of its own, then the plain kernel
(`normed=`), is the one-launch prologue linear bit for bit: gate_up with its norm and SwiGLU, a
norm with the residual epilogue, the MTP input (gather with a -1 id, two norms, the concat) in
one launch and split-K, q/k/v; K over one slab of the row; fp32 and fp16 under the interpreter,
bf16 at the 8B shapes on the GPU, where every row of n = 2..64 also equals the row alone. The op
bindings give the buffer, and count the launch, exactly at the widths prenorm_pays names."""
from __future__ import annotations

import pytest
import torch

from draft_circuit.circuit.types import TensorSpec
from draft_circuit.kernels import prologue_norm as pn
from draft_circuit.kernels._common import KernelInputError
from draft_circuit.kernels.linear_fused import linear_prologue, rmsnorm_linear_qkv
from draft_circuit.kernels.linear_fused_splitk import linear_prologue_splitk
from draft_circuit.kernels.linear_splitk import SplitKConfig
from draft_circuit.ops.registry import get_op
from draft_circuit.runners.testing import cuda

EPS = 1e-5


def _r(g, *shape, dtype, scale=1.0, device="cpu"):
    return (torch.randn(*shape, generator=g) * scale).to(device=device, dtype=dtype)


def _norm_w(g, k, dtype, device="cpu"):
    return (1 + 0.1 * torch.randn(k, generator=g)).to(device=device, dtype=dtype)


def _both(run, out):
    """(out without normed, out with it): run(out, normed) launches one way or the other."""
    a, b = torch.full_like(out, float("nan")), torch.full_like(out, float("nan"))
    run(a, None)
    run(b, "normed")
    return a, b


def _gate_up_cases(g, n, k, rows, dtype, device="cpu"):
    x, nw = _r(g, n, k, dtype=dtype, scale=3.0, device=device), _norm_w(g, k, dtype, device)
    w = _r(g, 2 * rows, k, dtype=dtype, scale=k ** -0.5, device=device)
    res = _r(g, n, 2 * rows, dtype=dtype, device=device)
    normed = torch.empty(n, k, dtype=dtype, device=device)
    return x, nw, w, res, normed


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,rows", [(1, 200, 40), (5, 300, 33), (2, 4096 + 72, 16)])
def test_norm_then_plain_is_the_prologue_linear(dtype, n, k, rows):
    g = torch.Generator().manual_seed(n + k)
    x, nw, w, res, normed = _gate_up_cases(g, n, k, rows, dtype)

    def gate_up(out, how):
        linear_prologue(x, w, out, norm1=nw, eps1=EPS, silu_mul=True,
                        normed=normed if how else None)
    a, b = _both(gate_up, torch.empty(n, rows, dtype=dtype))
    assert torch.equal(a, b)

    def residual(out, how):
        linear_prologue(x, w, out, norm1=nw, eps1=EPS, residual=res, normed=normed if how else None)
    a, b = _both(residual, torch.empty(n, 2 * rows, dtype=dtype))
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k1,k2,rows", [(1, 100, 100, 40), (6, 130, 70, 33)])
def test_mtp_input_norm_then_plain_is_the_prologue(dtype, n, k1, k2, rows):
    g = torch.Generator().manual_seed(n * 13 + k1 + k2)
    table, x2 = _r(g, 50, k1, dtype=dtype), _r(g, n, k2, dtype=dtype, scale=2.0)
    ids = torch.randint(0, 50, (n,), generator=g, dtype=torch.int32)
    ids[n // 2] = -1  # an all-masked draft: a zero row either way
    n1, n2 = _norm_w(g, k1, dtype), _norm_w(g, k2, dtype)
    w = _r(g, rows, k1 + k2, dtype=dtype, scale=(k1 + k2) ** -0.5)
    normed = torch.empty(n, k1 + k2, dtype=dtype)
    kw = dict(ids=ids, norm1=n1, eps1=EPS, x2=x2, norm2=n2, eps2=EPS)

    def one(out, how):
        linear_prologue(table, w, out, **kw, normed=normed if how else None)
    a, b = _both(one, torch.empty(n, rows, dtype=dtype))
    assert torch.equal(a, b)
    cfg = SplitKConfig(block_n=16, split_k=64, block_k=32, num_warps=4, num_stages=2)

    def split(out, how):
        linear_prologue_splitk(table, w, out, **kw, config=cfg, normed=normed if how else None)
    a, b = _both(split, torch.empty(n, rows, dtype=dtype))
    assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_qkv_norm_then_plain_is_the_prologue(dtype):
    g = torch.Generator().manual_seed(11)
    n, k, rows = 5, 200, (40, 8, 8)
    x, nw = _r(g, n, k, dtype=dtype, scale=2.0), _norm_w(g, k, dtype)
    ws = [_r(g, r, k, dtype=dtype, scale=k ** -0.5) for r in rows]
    a = [torch.full((n, r), float("nan"), dtype=dtype) for r in rows]
    b = [torch.full((n, r), float("nan"), dtype=dtype) for r in rows]
    rmsnorm_linear_qkv(x, nw, EPS, ws, a)
    rmsnorm_linear_qkv(x, nw, EPS, ws, b, normed=torch.empty(n, k, dtype=dtype))
    assert all(torch.equal(p, q) for p, q in zip(a, b))


def test_a_wrong_normed_buffer_is_refused_by_name():
    g = torch.Generator().manual_seed(2)
    x, nw, w, _, _ = _gate_up_cases(g, 3, 64, 16, torch.float32)
    out = torch.empty(3, 16)
    bad = (torch.empty(3, 63), torch.empty(3, 64, dtype=torch.float16), torch.empty(2, 64),
           torch.empty(64, 3).t(),  # the innermost dimension strided
           torch.empty(200)[:128].as_strided((3, 64), (32, 1)),  # rows overlapping
           x)  # x itself: the norm would read what it writes
    for normed in bad:
        with pytest.raises(KernelInputError, match="normed"):
            linear_prologue(x, w, out, norm1=nw, silu_mul=True, normed=normed)
    ws = [torch.empty(r, 64) for r in (16, 8, 8)]
    with pytest.raises(KernelInputError, match="normed"):
        rmsnorm_linear_qkv(x, nw, EPS, ws, [torch.empty(3, r) for r in (16, 8, 8)],
                           normed=torch.empty(3, 32))
    table, ids = torch.randn(10, 32), torch.tensor([1, 2, 3], dtype=torch.int32)
    with pytest.raises(KernelInputError, match="normed"):
        linear_prologue_splitk(table, torch.randn(16, 96), torch.empty(3, 16), ids=ids, norm1=nw[:32],
                               x2=torch.randn(3, 64), norm2=nw, normed=torch.empty(3, 95))


def test_q_k_v_outputs_share_a_dtype():
    """One kernel selects among the three outputs' pointers: mixed dtypes are refused by name."""
    from draft_circuit.kernels.linear_multi import linear_qkv
    x, ws = torch.randn(2, 32), [torch.randn(r, 32) for r in (16, 8, 8)]
    outs = [torch.empty(2, 16), torch.empty(2, 8, dtype=torch.float16), torch.empty(2, 8)]
    with pytest.raises(KernelInputError, match="out1"):
        linear_qkv(x, ws, outs)


def test_bindings_take_the_norm_launch_exactly_where_it_pays(interpreted_launches, monkeypatch):
    """The workspace rule hands out the buffer, and the launch count adds one, at n > the rule's
    threshold only (and K from its own); the binding then launches the norm, then the plain
    kernel."""
    wide, narrow = pn.PRENORM_FROM_N + 1, pn.PRENORM_FROM_N
    k = pn.PRENORM_FROM_K
    assert not pn.prenorm_pays(wide, (k - pn.ALIGN,)) and pn.prenorm_pays(wide, (k,))
    # parts a multiple of ALIGN columns only (where the two paths' loads were shown alike)
    assert not pn.prenorm_pays(wide, (k + 8,)) and pn.prenorm_pays(wide, (k // 2, k // 2))
    assert not pn.prenorm_pays(wide, (k // 2 + 8, k // 2 - 8))
    monkeypatch.setattr(pn, "PRENORM_FROM_K", 64)
    op = get_op("rmsnorm_linear_silu_mul")
    binding = next(b for b in op.kernels if b.name == "triton_rmsnorm_linear_silu_mul")
    attrs = op.parse_attrs({"eps": EPS})
    for n, buffers, launches in ((narrow, 0, 1), (wide, 1, 2)):
        specs = [TensorSpec(dtype="float32", shape=(n, 64)), TensorSpec(dtype="float32", shape=(64,)),
                 TensorSpec(dtype="float32", shape=(32, 64))]
        ws = binding.workspace(specs, {}, attrs)
        assert len(ws) == buffers and binding.launch_count(specs, attrs) == launches
    g = torch.Generator().manual_seed(4)
    x, nw, w, _, normed = _gate_up_cases(g, wide, 64, 16, torch.float32)
    out, want = torch.empty(wide, 16), torch.empty(wide, 16)
    interpreted_launches.clear()
    binding.launch([x, nw, w], [out], [normed], attrs)
    assert interpreted_launches == ["prologue_norm_kernel", "linear_prologue_kernel"]
    linear_prologue(x, w, want, norm1=nw, eps1=EPS, silu_mul=True)
    assert torch.equal(out, want)
    eh = get_op("embed_rmsnorm_linear_concat")
    split = next(b for b in eh.kernels if b.name.endswith("_splitk"))
    specs = [TensorSpec(dtype="bfloat16", shape=(100, 4096)), TensorSpec(dtype="int32", shape=(wide,)),
             TensorSpec(dtype="bfloat16", shape=(4096,)), TensorSpec(dtype="bfloat16", shape=(wide, 4096)),
             TensorSpec(dtype="bfloat16", shape=(4096,)), TensorSpec(dtype="bfloat16", shape=(4096, 8192))]
    assert split.launch_count(specs, attrs) == 3
    assert split.workspace(specs, {}, attrs)[1] == ("bfloat16", (wide, 8192))


@pytest.mark.cuda
@cuda
def test_gpu_unaligned_rows_are_refused():
    """On a GPU the norm's own launch takes rows starting ALIGN-element aligned only (its loads'
    layout, and so its sums' tree, is the prologue's there): a stride off it is refused by name."""
    x = torch.randn(3, 4104, device="cuda", dtype=torch.bfloat16)[:, :4100]  # stride 4104
    nw = torch.ones(4100, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 4100, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(KernelInputError, match="aligned"):
        linear_prologue(x, w, torch.empty(3, 32, device="cuda", dtype=torch.bfloat16), norm1=nw,
                        silu_mul=True, normed=torch.empty(3, 4100, device="cuda", dtype=torch.bfloat16))


@pytest.mark.cuda
@cuda
def test_gpu_prenorm_bits_at_the_8b_shapes():
    """bf16, the 8B head's shapes: the prenorm path equals the one-launch prologue at n = 1, 2,
    8, 16, 17, 33 and 64 (either path may serve any width: the rule is a measured choice), and every row of every n = 2..64 on the path its width takes equals the row alone."""
    dev, dt, h = "cuda", torch.bfloat16, 4096
    g = torch.Generator().manual_seed(5)
    x, nw = _r(g, 64, h, dtype=dt, scale=3.0, device=dev), _norm_w(g, h, dt, dev)
    w = _r(g, 2 * 1024, h, dtype=dt, scale=h ** -0.5, device=dev)
    table, x2 = _r(g, 1000, h, dtype=dt, device=dev), _r(g, 64, h, dtype=dt, device=dev)
    ids = torch.randint(0, 1000, (64,), generator=g, dtype=torch.int32).to(dev)
    ids[7] = -1
    weh = _r(g, h, 2 * h, dtype=dt, scale=(2 * h) ** -0.5, device=dev)
    qkv = [_r(g, r, h, dtype=dt, scale=h ** -0.5, device=dev) for r in (h, 1024, 1024)]

    def gate_up(n, prenorm):
        out = torch.empty(n, 1024, dtype=dt, device=dev)
        linear_prologue(x[:n], w, out, norm1=nw, eps1=EPS, silu_mul=True,
                        normed=torch.empty(n, h, dtype=dt, device=dev) if prenorm else None)
        return out

    def eh(n, prenorm):
        out = torch.empty(n, h, dtype=dt, device=dev)
        linear_prologue_splitk(table, weh, out, ids=ids[:n], norm1=nw, eps1=EPS, x2=x2[:n],
                               norm2=nw, eps2=EPS,
                               normed=torch.empty(n, 2 * h, dtype=dt, device=dev) if prenorm else None)
        return out

    def q_k_v(n, prenorm):
        outs = [torch.empty(n, r.shape[0], dtype=dt, device=dev) for r in qkv]
        rmsnorm_linear_qkv(x[:n], nw, EPS, qkv, outs,
                           normed=torch.empty(n, h, dtype=dt, device=dev) if prenorm else None)
        return torch.cat(outs, dim=1)

    for f in (gate_up, eh, q_k_v):
        for n in (1, 2, 8, 16, 17, 33, 64):
            assert torch.equal(f(n, False), f(n, True)), (f.__name__, n)
        for n in range(2, 65):
            got = f(n, pn.prenorm_pays(n, (h, h) if f is eh else (h,), qkv=f is q_k_v))
            for i in (0, n // 2, n - 1):
                want = _row_alone(f, i, x, x2, ids)
                assert torch.equal(got[i], want), (f.__name__, n, i)


def _row_alone(f, i, x, x2, ids):
    """f's row i computed as a batch of one (the one-launch prologue at n = 1)."""
    saved = (x[0].clone(), x2[0].clone(), ids[0].clone())
    x[0], x2[0], ids[0] = x[i].clone(), x2[i].clone(), ids[i].clone()
    try:
        return f(1, False)[0]
    finally:
        x[0], x2[0], ids[0] = saved


def test_qkv_has_its_own_threshold(monkeypatch):
    """q/k/v's binding follows QKV_PRENORM_FROM_N (the others PRENORM_FROM_N): at 0 (the rule),
    a one-row q/k/v takes the norm's own launch and the gate_up does not."""
    monkeypatch.setattr(pn, "QKV_PRENORM_FROM_N", 0)
    specs = [TensorSpec(dtype="bfloat16", shape=(1, 4096)), TensorSpec(dtype="bfloat16", shape=(4096,))]
    qkv = get_op("rmsnorm_linear_qkv")
    b = qkv.kernels[0]
    a = qkv.parse_attrs({"eps": EPS})
    w = [TensorSpec(dtype="bfloat16", shape=(r, 4096)) for r in (4096, 1024, 1024)]
    assert b.workspace([*specs, *w], {}, a) == [("bfloat16", (1, 4096))] and b.launch_count([*specs, *w], a) == 2
    gate = get_op("rmsnorm_linear_silu_mul").kernels[0]
    gw = [TensorSpec(dtype="bfloat16", shape=(2048, 4096))]
    assert gate.workspace([*specs, *gw], {}, a) == [] and gate.launch_count([*specs, *gw], a) == 1
