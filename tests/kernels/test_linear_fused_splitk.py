"""kernels.linear_fused_splitk against the unfused kernels on the same operands (CPU interpreter,
tests/conftest.py sets TRITON_INTERPRET; fp32 and fp16): the two-launch prologue linear is,
bitwise, the prologue materialised as linear_prologue computes it and then linear_splitk (or
linear_silu_mul_splitk) with the same SplitKConfig, for gathers (ids -1 and past the table), one
and two x's, norms, SwiGLU and the residual, K off the split and the tiles; a row's bits never
depend on n; each K tile is summed exactly once; bad operands raise KernelInputError naming
them; the op binding takes the split kernel by the weight's shape only and launches two kernels,
and an 8B chain's plan binds it and counts the extra launch. cuda: the 8B eh_proj in bf16, rows
alone == rows in a batch.

The materialised prologue is linear_prologue's own output against an identity weight (fp32
ieee products: each value times 1 plus zeros, exact), so it carries the kernel's chunked norm
bits; it is checked against the composition of the rmsnorm and embedding kernels the way
tests/kernels/test_linear_fused.py checks the prologue (bitwise in fp16, within the sum's order
in fp32)."""
from __future__ import annotations

import pytest
import torch

from draft_circuit.kernels import linear_fused_splitk as lfs
from draft_circuit.kernels._common import KernelInputError
from draft_circuit.kernels.linear_fused import linear_prologue
from draft_circuit.kernels.linear_fused_splitk import linear_prologue_splitk, splitk_pays
from draft_circuit.kernels.linear_splitk import (SplitKConfig, linear_silu_mul_splitk, linear_splitk,
                                                 splitk_workspace_shape)
from draft_circuit.kernels.rmsnorm import rmsnorm
from draft_circuit.runners.testing import cuda

EPS = 1e-5
NORM_TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float16: dict(atol=0, rtol=0)}
# 4 splits of 64 over K = 240 (the last 48: one full tile of 32 and one half), tiles of 16 columns
CFG = SplitKConfig(block_n=16, split_k=64, block_k=32, num_warps=4, num_stages=2)
V = 30  # table rows


def _r(g, *shape, dtype, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _norm_w(g, k, dtype):
    return (1 + 0.1 * torch.randn(k, generator=g)).to(dtype)


def _normed(x, w):
    out = torch.empty_like(x)
    rmsnorm(x, w, out, EPS)
    return out


def _materialised(x1, k, dtype, **prologue):
    """[p1(x1) | p2(x2)] as linear_prologue computes it, stored: its output for an identity weight."""
    n = prologue["ids"].shape[0] if prologue.get("ids") is not None else x1.shape[0]
    out = torch.empty(n, k, dtype=dtype)
    linear_prologue(x1, torch.eye(k, dtype=dtype), out, **prologue)
    return out


def _operands(g, n, dtype, k1=150, k2=90, two_x=True, gather=True):
    table = _r(g, V, k1, dtype=dtype, scale=2.0) if gather else _r(g, n, k1, dtype=dtype, scale=2.0)
    prologue = dict(norm1=_norm_w(g, k1, dtype), eps1=EPS)
    if gather:
        ids = torch.randint(0, V, (n,), generator=g, dtype=torch.int32)
        ids[n // 2] = -1  # an all-masked draft: a zero row
        if n > 2:
            ids[-1] = V + 3  # past the table: a zero row too
        prologue["ids"] = ids
    if two_x:
        prologue.update(x2=_r(g, n, k2, dtype=dtype, scale=3.0), norm2=_norm_w(g, k2, dtype), eps2=EPS)
    return table, k1 + (k2 if two_x else 0), prologue


def _unfused_prologue(table, prologue):
    """The embedding, the norms and the concat by the rmsnorm kernel, as test_linear_fused builds them."""
    x1 = table
    if (ids := prologue.get("ids")) is not None:
        ok = (ids >= 0) & (ids < table.shape[0])
        x1 = table[ids.clamp(0, table.shape[0] - 1).long()].masked_fill(~ok[:, None], 0)
    parts = [_normed(x1, prologue["norm1"])]
    if "x2" in prologue:
        parts.append(_normed(prologue["x2"], prologue["norm2"]))
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [1, 3, 17])
@pytest.mark.parametrize("mode", ["two_x", "one_x", "silu_mul", "residual"])
def test_is_the_materialised_prologue_then_linear_splitk(dtype, n, mode):
    g = torch.Generator().manual_seed(n * 7 + len(mode))
    table, k, prologue = _operands(g, n, dtype, two_x=mode != "one_x", gather=mode != "one_x")
    mat = _materialised(table, k, dtype, **prologue)
    torch.testing.assert_close(mat, _unfused_prologue(table, prologue), **NORM_TOL[dtype])
    rows = 40  # off the 16-column tile
    silu = mode == "silu_mul"
    w = _r(g, 2 * rows if silu else rows, k, dtype=dtype, scale=k ** -0.5)
    res = _r(g, n, rows, dtype=dtype) if mode == "residual" else None
    out = torch.full((n, rows), float("nan"), dtype=dtype)
    ws = torch.full(splitk_workspace_shape(n, w.shape[0], k, CFG), float("nan"))
    linear_prologue_splitk(table, w, out, ws, silu_mul=silu, residual=res, config=CFG, **prologue)
    want = torch.empty_like(out)
    if silu:
        linear_silu_mul_splitk(mat, w, want, config=CFG)
    else:
        linear_splitk(mat, w, want, config=CFG, residual=res)
    assert torch.equal(out, want)
    if res is not None:  # out may be the residual itself
        aliased = res.clone()
        linear_prologue_splitk(table, w, aliased, ws, residual=aliased, config=CFG, **prologue)
        assert torch.equal(aliased, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_default_config_and_its_own_workspace(dtype):
    """config None: linear_splitk's default_config for the weight's shape (here 5 splits of 512
    over K = 2100, the last 52 wide; 32-column tiles), the workspace allocated here."""
    g = torch.Generator().manual_seed(5)
    n = 3
    table, k, prologue = _operands(g, n, dtype, k1=1100, k2=1000)
    w = _r(g, 24, k, dtype=dtype, scale=k ** -0.5)
    out, want = torch.empty(n, 24, dtype=dtype), torch.empty(n, 24, dtype=dtype)
    linear_prologue_splitk(table, w, out, **prologue)
    linear_splitk(_materialised(table, k, dtype, **prologue), w, want)
    assert torch.equal(out, want)


def test_rows_never_depend_on_the_batch():
    """Row i of an n-row launch is row i launched alone, bitwise (gather, two norms, residual)."""
    g = torch.Generator().manual_seed(9)
    n, dtype = 19, torch.float16
    table, k, prologue = _operands(g, n, dtype)
    w, res = _r(g, 24, k, dtype=dtype, scale=k ** -0.5), _r(g, n, 24, dtype=dtype)
    batch = torch.empty(n, 24, dtype=dtype)
    linear_prologue_splitk(table, w, batch, residual=res, config=CFG, **prologue)
    for i in (0, n // 2, 7, n - 1):
        alone = torch.empty(1, 24, dtype=dtype)
        one = dict(prologue, ids=prologue["ids"][i:i + 1], x2=prologue["x2"][i:i + 1])
        linear_prologue_splitk(table, w, alone, residual=res[i:i + 1], config=CFG, **one)
        assert torch.equal(alone[0], batch[i])


@pytest.mark.parametrize("mode", ["plain", "gather", "norm", "two_x"])
def test_each_k_tile_is_summed_once(mode):
    """Weight row t is 1 on K tile t's columns, x all ones: out[:, t] is the count of tile t's
    columns before K, exactly. A split loop that skips its last tile gives 0 there, one that
    runs a tile on (or starts a tile late) counts the next split's first tile twice, and one
    that ignores K's mask counts past it."""
    dtype, n, k1, k2 = torch.float32, 3, 150, 90
    bk = CFG.block_k
    k = k1 + (k2 if mode == "two_x" else 0)
    tiles = -(-k // bk)
    w = torch.zeros(tiles, k, dtype=dtype)
    for t in range(tiles):
        w[t, t * bk:(t + 1) * bk] = 1
    want = torch.tensor([min(bk, k - t * bk) for t in range(tiles)], dtype=dtype).expand(n, tiles)
    x1 = torch.ones(V if mode != "plain" else n, k1, dtype=dtype)
    # eps 1e-30 vanishes next to a mean square of 1: rsqrt(1.0) = 1, the normed ones stay ones
    prologue: dict = {}
    if mode != "plain":
        prologue["ids"] = torch.tensor([0, 5, V - 1], dtype=torch.int32)
    if mode in ("norm", "two_x"):
        prologue.update(norm1=torch.ones(k1, dtype=dtype), eps1=1e-30)
    if mode == "two_x":
        prologue.update(x2=torch.ones(n, k2, dtype=dtype), norm2=torch.ones(k2, dtype=dtype), eps2=1e-30)
    out = torch.empty(n, tiles, dtype=dtype)
    linear_prologue_splitk(x1, w, out, config=CFG, **prologue)
    assert torch.equal(out, want), out[0].tolist()


@pytest.mark.parametrize("launch", [lfs.Launch(), lfs.Launch(1), lfs.Launch(2)], ids=str)
@pytest.mark.parametrize("mode", ["two_x", "norm1_only", "x2_unnormed", "plain"])
def test_launch_options_keep_the_bits(monkeypatch, launch, mode):
    """Every Launch (the two norms one after the other, or in one pass with 4 or 8 chunks of
    each in flight) gives the module LAUNCH's bits: norms over rows of unequal width (1100 and
    700: several steps, the last ones past the shorter row), one x, an x2 without its norm, no
    prologue at all; K ends inside a tile."""
    dtype, n = torch.float16, 3
    g = torch.Generator().manual_seed(len(mode))
    table, k, prologue = _operands(g, n, dtype, k1=1100, k2=700, two_x=mode in ("two_x", "x2_unnormed"),
                                   gather=mode != "plain")
    if mode == "x2_unnormed":
        prologue.pop("norm2")
    if mode == "plain":
        prologue = {}
    w = _r(g, 24, k, dtype=dtype, scale=k ** -0.5)
    cfg = SplitKConfig(block_n=16, split_k=512, block_k=128, num_stages=2)
    want, got = torch.empty(n, 24, dtype=dtype), torch.empty(n, 24, dtype=dtype)
    linear_prologue_splitk(table, w, want, config=cfg, **prologue)
    monkeypatch.setattr(lfs, "LAUNCH", launch)
    linear_prologue_splitk(table, w, got, config=cfg, **prologue)
    assert torch.equal(got, want)


def test_launchers_name_the_bad_operand():
    x, w, out = torch.zeros(2, 8), torch.zeros(4, 8), torch.zeros(2, 4)
    cases = [
        ("norm1", dict(norm1=torch.zeros(7))),
        ("residual", dict(residual=torch.zeros(2, 5))),
        ("ids", dict(ids=torch.zeros(2, dtype=torch.float32))),
        ("norm2 needs x2", dict(norm2=torch.zeros(8))),
        ("x2", dict(x2=torch.zeros(3, 4))),
        ("workspace", dict(workspace=torch.zeros(2, 2, 4))),
        ("workspace", dict(workspace=torch.zeros(1, 2, 4, dtype=torch.float16))),
        ("split_k a multiple of block_k", dict(config=SplitKConfig(block_n=16, split_k=48, block_k=32))),
    ]
    for what, kwargs in cases:
        with pytest.raises(KernelInputError, match=what):
            linear_prologue_splitk(x, w, out, **kwargs)
    with pytest.raises(KernelInputError, match="weight"):  # K is x1's 8 plus x2's 4
        linear_prologue_splitk(x, w, out, x2=torch.zeros(2, 4))
    with pytest.raises(KernelInputError, match="out"):
        linear_prologue_splitk(x, w, torch.zeros(2, 5))
    with pytest.raises(KernelInputError, match="weight"):
        linear_prologue_splitk(x, torch.zeros(5, 8), torch.zeros(2, 2), silu_mul=True)


def test_the_rule_is_the_weights_shape():
    assert splitk_pays(4096, 8192) and splitk_pays(7168, 14336)  # 8B and DeepSeek-V3 eh_proj
    assert not splitk_pays(4096, 2048)  # a small head's K: the one-launch kernel
    assert splitk_pays(8160, 4096) and not splitk_pays(8192, 4096)  # 255 tiles of 32, then 256


def test_the_binding_is_first_by_the_weights_shape_and_launches_two_kernels(interpreted_launches):
    from draft_circuit.circuit.ir import ROW, TensorSpec
    from draft_circuit.ops.registry import get_op

    op = get_op("embed_rmsnorm_linear_concat")
    first = op.kernels[0]
    assert first.name == "triton_embed_rmsnorm_linear_concat_splitk"

    def specs(rows, k1, k2, width=ROW):  # (table, ids, norm1, x2, norm2, weight)
        return [TensorSpec(dtype=dt, shape=s) for dt, s in (
            ("float32", (V, k1)), ("int32", (width,)), ("float32", (k1,)), ("float32", (width, k2)),
            ("float32", (k2,)), ("float32", (rows, k1 + k2)))]
    attrs = op.parse_attrs({"eps": EPS})
    for width in (ROW, 1, 64):  # never n
        assert first.applies("interpret", specs(4096, 4096, 4096, width), attrs)
        assert first.applies("cuda", specs(7168, 7168, 7168, width), attrs)
        assert not first.applies("cuda", specs(2048, 1024, 1024, width), attrs)
        assert not first.applies("cuda", specs(8192, 2048, 2048, width), attrs)
    # the interpreter runs it at K = 4096 (4 splits of 1024): two kernels, the op's reference
    seen = interpreted_launches
    g = torch.Generator().manual_seed(3)
    n, k1, k2, rows = 2, 2048, 2048, 8
    inputs = [_r(g, V, k1, dtype=torch.float32), torch.tensor([4, -1], dtype=torch.int32),
              _norm_w(g, k1, torch.float32), _r(g, n, k2, dtype=torch.float32),
              _norm_w(g, k2, torch.float32), _r(g, rows, k1 + k2, dtype=torch.float32, scale=0.02)]
    sp = specs(rows, k1, k2, n)
    assert first.applies("interpret", sp, attrs) and first.launch_count(sp, attrs) == 2
    ws = [torch.empty(shape, dtype=getattr(torch, dt)) for dt, shape in first.workspace(sp, {}, attrs)]
    out = torch.empty(n, rows)
    first.launch(inputs, [out], ws, attrs)
    assert seen == ["_prologue_partial_kernel", "_reduce_kernel"]
    table, ids = inputs[0], inputs[1]
    emb = table[ids.clamp(min=0).long()].masked_fill((ids < 0)[:, None], 0)
    want = torch.cat([torch.nn.functional.rms_norm(emb, (k1,), inputs[2], EPS),
                      torch.nn.functional.rms_norm(inputs[3], (k2,), inputs[4], EPS)], 1) @ inputs[5].T
    torch.testing.assert_close(out, want, atol=1e-4, rtol=1e-4)


def test_plans_of_the_8b_chain_bind_it_and_count_its_two_launches(monkeypatch):
    """An 8B-shaped chain planned for CUDA (meta weights) binds the split kernel for eh_proj at
    every width and its report counts one launch more a step than the one-launch kernel's plan;
    a 1024-wide head (K 2048) keeps the one-launch kernel."""
    import draft_circuit.ops.prologue_linear as prologue_linear
    from tests.plan_shapes import plan_kernels

    def plan(hidden, inter, heads, kv_heads, d):
        return plan_kernels("embed_rmsnorm_linear_concat", vocab=1000, hidden=hidden, inter=inter,
                            heads=heads, kv_heads=kv_heads, head_dim=d)

    big = plan(4096, 14336, 32, 8, 128)
    small = plan(1024, 2816, 16, 4, 64)
    monkeypatch.setattr(prologue_linear, "_k_prologue_splitk_pays", lambda: lambda rows, k: False)
    one_launch = plan(4096, 14336, 32, 8, 128)
    for w in (1, 8):
        assert big[w][0] == {"triton_embed_rmsnorm_linear_concat_splitk"}
        assert one_launch[w][0] == small[w][0] == {"triton_embed_rmsnorm_linear_concat"}
        assert big[w][1] == one_launch[w][1] + 1  # two launches where there was one, each step


@cuda
@pytest.mark.parametrize("n", [1, 8, 64])
def test_cuda_bf16_8b_eh_proj(n):
    """bf16 at the 8B eh_proj's shape on the GPU, its default config (8 splits of 1024): within
    bf16 rounding of the materialised prologue then linear_splitk (the interpreter checks the
    bits), and every row of the n-row launch equal to the row launched alone, bitwise."""
    dev, dt, h = "cuda", torch.bfloat16, 4096
    g = torch.Generator().manual_seed(n)
    table = _r(g, 1000, h, dtype=dt).to(dev)
    ids = torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32).to(dev)
    x2 = _r(g, n, h, dtype=dt, scale=2.0).to(dev)
    n1, n2 = _norm_w(g, h, dt).to(dev), _norm_w(g, h, dt).to(dev)
    w = _r(g, h, 2 * h, dtype=dt, scale=(2 * h) ** -0.5).to(dev)
    prologue = dict(ids=ids, norm1=n1, eps1=EPS, x2=x2, norm2=n2, eps2=EPS)
    out = torch.empty(n, h, dtype=dt, device=dev)
    linear_prologue_splitk(table, w, out, **prologue)
    mat = torch.empty(n, 2 * h, dtype=dt, device=dev)
    linear_prologue(table, torch.eye(2 * h, dtype=dt, device=dev), mat, **prologue)
    want = torch.empty_like(out)
    linear_splitk(mat, w, want)
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)
    for i in {0, n // 2, n - 1}:
        alone = torch.empty(1, h, dtype=dt, device=dev)
        linear_prologue_splitk(table, w, alone, ids=ids[i:i + 1], norm1=n1, eps1=EPS,
                               x2=x2[i:i + 1], norm2=n2, eps2=EPS)
        assert torch.equal(alone[0], out[i])


@cuda
@pytest.mark.parametrize("n", [1, 8, 64])
def test_cuda_bf16_8b_eh_proj_launch_keeps_the_bits(monkeypatch, n):
    """On the GPU the module's LAUNCH (its tile, warps and stages included) gives the default
    Launch's bits at the 8B eh_proj's shape, at every width."""
    dev, dt, h = "cuda", torch.bfloat16, 4096
    g = torch.Generator().manual_seed(n + 100)
    table = _r(g, 1000, h, dtype=dt).to(dev)
    ids = torch.randint(0, 1000, (n,), generator=g, dtype=torch.int32).to(dev)
    prologue = dict(ids=ids, norm1=_norm_w(g, h, dt).to(dev), eps1=EPS,
                    x2=_r(g, n, h, dtype=dt, scale=2.0).to(dev), norm2=_norm_w(g, h, dt).to(dev), eps2=EPS)
    w = _r(g, h, 2 * h, dtype=dt, scale=(2 * h) ** -0.5).to(dev)
    got, want = (torch.empty(n, h, dtype=dt, device=dev) for _ in range(2))
    linear_prologue_splitk(table, w, got, **prologue)
    monkeypatch.setattr(lfs, "LAUNCH", lfs.Launch())
    linear_prologue_splitk(table, w, want, **prologue)
    assert torch.equal(got, want)
