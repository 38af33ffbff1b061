"""Split-K linear / linear_silu_mul against fp64 references, and the bindings that choose them.

CPU: fp32 and fp16 under the Triton interpreter, K off the split and BLOCK_K grids, N off
BLOCK_N, poisoned outputs and workspaces. cuda: bf16 at the small and 8B configs' shapes, and
width independence (a row's bits do not depend on n).
"""
from __future__ import annotations

import pytest
import torch

from draft_circuit.kernels._common import KernelInputError
from draft_circuit.kernels.linear_splitk import (MIN_SPLIT_K, SplitKConfig, default_config,
                                   linear_silu_mul_splitk, linear_splitk, num_splits,
                                   splitk_workspace_shape)

from draft_circuit.runners.testing import cuda  # marks `cuda` and skips without a GPU

TOL = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.float16: dict(atol=1e-2, rtol=1e-2),
       torch.bfloat16: dict(atol=5e-2, rtol=2e-2)}
# 4 splits of 64 columns (the last 8 long), 2 BLOCK_K steps each, 16-column N tiles
SMALL = SplitKConfig(block_n=16, split_k=64, block_k=32, num_warps=4, num_stages=2)


def reference_linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    return (x.double() @ weight.double().T).to(out_dtype)


def reference_linear_silu_mul(x: torch.Tensor, gate_up: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    inter = gate_up.shape[0] // 2
    gate = (x.double() @ gate_up[:inter].double().T).float()
    up = (x.double() @ gate_up[inter:].double().T).float()
    return (gate * torch.sigmoid(gate) * up).to(out_dtype)


def _inputs(n, k, rows, dtype, seed, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(n, k, device=device, generator=gen).to(dtype)
    w = (torch.randn(rows, k, device=device, generator=gen) / k ** 0.5).to(dtype)
    return x, w


def _poisoned(shape, dtype=torch.float32, device="cpu"):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,big_n,config", [(1, 300, 150, None), (3, 200, 40, SMALL),
                                              (17, 200, 33, SMALL), (3, 77, 40, None)])
def test_linear_splitk_matches_reference(dtype, n, k, big_n, config):
    x, w = _inputs(n, k, big_n, dtype, seed=n + k + big_n)
    out = _poisoned((n, big_n), dtype)
    ws = _poisoned(splitk_workspace_shape(n, big_n, k, config))  # every partial read is written
    linear_splitk(x, w, out, ws, config)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference_linear(x, w, dtype), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,inter,config", [(1, 300, 72, None), (3, 200, 45, SMALL), (17, 130, 24, SMALL),
                                                  (3, 77, 20, None)])
def test_linear_silu_mul_splitk_matches_reference(dtype, n, k, inter, config):
    x, gate_up = _inputs(n, k, 2 * inter, dtype, seed=n * k + inter)
    out = _poisoned((n, inter), dtype)
    ws = _poisoned(splitk_workspace_shape(n, 2 * inter, k, config))
    linear_silu_mul_splitk(x, gate_up, out, ws, config)
    assert not out.isnan().any()
    torch.testing.assert_close(out, reference_linear_silu_mul(x, gate_up, dtype), **TOL[dtype])


def test_strided_rows_fp32_out_and_own_workspace():
    x_base, w = _inputs(5, 300, 72, torch.float16, seed=5)
    x, w = x_base[:, 20:220], w[:, :200]  # rows with strides 300
    out_base = _poisoned((5, 80))
    out = out_base[:, 3:75]
    linear_splitk(x, w, out, config=SMALL)  # workspace allocated by the launcher
    torch.testing.assert_close(out, reference_linear(x, w, torch.float32), atol=1e-4, rtol=1e-4)
    assert out_base[:, :3].isnan().all() and out_base[:, 75:].isnan().all()


@pytest.mark.parametrize("fn", [linear_splitk, linear_silu_mul_splitk])
def test_width_independence_interpreted(fn):
    x, w = _inputs(19, 200, 66, torch.float32, seed=1)
    cols = 66 if fn is linear_splitk else 33
    batch, alone = _poisoned((19, cols)), _poisoned((1, cols))
    fn(x, w, batch, config=SMALL)
    fn(x[:1], w, alone, config=SMALL)
    assert torch.equal(batch[0], alone[0])


def test_rejects_bad_inputs():
    x = torch.randn(3, 64)
    with pytest.raises(KernelInputError, match="weight"):
        linear_splitk(x, torch.randn(10, 63), torch.empty(3, 10))
    with pytest.raises(KernelInputError, match="out"):
        linear_splitk(x, torch.randn(10, 64), torch.empty(3, 11))
    with pytest.raises(KernelInputError, match="workspace"):
        linear_splitk(x, torch.randn(10, 64), torch.empty(3, 10), torch.empty(1, 3, 11))
    with pytest.raises(KernelInputError, match="gate_up_weight"):
        linear_silu_mul_splitk(x, torch.randn(11, 64), torch.empty(3, 5))
    with pytest.raises(KernelInputError, match="split_k"):
        linear_splitk(x, torch.randn(10, 64), torch.empty(3, 10), config=SplitKConfig(16, 100, 32))


# the small and 8B configs' linears as (weight rows, K): eh_proj, q = o, k = v, gate_up, down
SHAPES = {"small": [(1024, 2048), (1024, 1024), (256, 1024), (2 * 2816, 1024), (1024, 2816)],
          "8b": [(4096, 8192), (4096, 4096), (1024, 4096), (2 * 14336, 4096), (4096, 14336)]}


@pytest.mark.parametrize("rows,k", [s for v in SHAPES.values() for s in v] + [(40, 80), (333, 300)])
def test_default_config_follows_the_measured_rule(rows, k):
    cfg = default_config(rows, k)
    assert cfg.split_k % cfg.block_k == 0 and cfg.split_k >= MIN_SPLIT_K
    assert (num_splits(rows, k) > 1) == (k >= 2048)  # narrow K: one split, the plain kernel
    assert cfg == default_config(rows, k)  # a pure function of the shape, never of n


# ---- the bindings: chosen ahead of the single-pass kernels where K splits, run through a Program
def _one_op_circuit(op: str, k: int, rows: int, attrs: dict | None = None):
    from draft_circuit.circuit.builder import CircuitBuilder
    from draft_circuit.circuit.ir import ROW
    b = CircuitBuilder("one_linear", max_width=4)
    x = b.input("x", "float32", (ROW, k))
    w = b.param("w", "float32", (rows, k))
    b.output(b.op1(op, [x, w], attrs), "y")
    return b.build()


@pytest.mark.parametrize("op,k,rows,attrs,want", [
    ("linear", 2100, 40, None, "triton_linear_splitk"),
    ("linear", 2100, 40, {"out_dtype": "float32"}, "triton_linear_splitk"),
    ("linear", 2100, 40, {"out_dtype": "float16"}, "triton_linear"),
    ("linear", 300, 40, None, "triton_linear"),  # one split: nothing to gain (measured)
    ("linear_silu_mul", 2100, 48, None, "triton_linear_silu_mul"),  # never split (measured)
])
def test_binding_chosen_and_matches_eager(op, k, rows, attrs, want):
    from draft_circuit.circuit.planner import CompileOptions, compile_draft
    from draft_circuit.runners.eager import EagerRunner
    from draft_circuit.runners.program import ProgramRunner
    c = _one_op_circuit(op, k, rows, attrs)
    params = {"w": torch.randn(rows, k, generator=torch.Generator().manual_seed(k)) / k ** 0.5}
    compiled = compile_draft(c, params, [1, 3], options=CompileOptions(interpret_kernels=True))
    for width in (1, 3):
        (launch,) = [x for x in compiled.programs[width].launches if x.op == op]
        assert launch.kernel == want
        x = torch.randn(width, k, generator=torch.Generator().manual_seed(width))
        got = ProgramRunner(compiled, {}).run({"x": x})["y"]
        ref = EagerRunner(c, params, {}).run({"x": x})["y"]
        torch.testing.assert_close(got.float(), ref.float(), atol=2e-3, rtol=2e-3)


# ---- cuda
@cuda
@pytest.mark.parametrize("rows,k", SHAPES["small"] + SHAPES["8b"][:3] + [(334, 200)])
@pytest.mark.parametrize("n", [1, 7, 64])
def test_cuda_bf16_matches_fp32_reference(rows, k, n):
    x, w = _inputs(n, k, rows, torch.bfloat16, seed=n + rows, device="cuda")
    out = _poisoned((n, rows), torch.bfloat16, "cuda")
    linear_splitk(x, w, out, _poisoned(splitk_workspace_shape(n, rows, k), device="cuda"))
    torch.testing.assert_close(out.float(), reference_linear(x, w, torch.float32), **TOL[torch.bfloat16])
    gate_up_out = _poisoned((n, rows // 2), torch.bfloat16, "cuda")
    linear_silu_mul_splitk(x, w, gate_up_out)
    torch.testing.assert_close(gate_up_out.float(), reference_linear_silu_mul(x, w, torch.float32),
                               **TOL[torch.bfloat16])


@cuda
@pytest.mark.parametrize("fn", [linear_splitk, linear_silu_mul_splitk])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,k", [(2000, 2048), (256, 1024), (1024, 2816)])
def test_cuda_width_independence(fn, dtype, rows, k):
    out_cols = rows if fn is linear_splitk else rows // 2
    x0, w = _inputs(1, k, rows, dtype, seed=0, device="cuda")
    alone = _poisoned((1, out_cols), dtype, "cuda")
    fn(x0, w, alone)
    gen = torch.Generator(device="cuda").manual_seed(1)
    for n in range(2, 65):
        x = torch.randn(n, k, device="cuda", generator=gen).to(dtype)
        x[0] = x0[0]
        out = _poisoned((n, out_cols), dtype, "cuda")
        fn(x, w, out)
        assert torch.equal(out[0], alone[0]), n
