"""`sigmoid_mul` (Qwen3-Next's attention and shared-expert gates): the op's reference is
transformers' arithmetic (`attn_output * torch.sigmoid(gate)`, `F.sigmoid(gate) * shared`, in the
activation dtype: fp32 bitwise, bf16 / fp16 with its two roundings), and the Triton kernel under
the interpreter matches the reference within two ulps of the output dtype, for a per-column gate and
a one-column (broadcast) gate; bad operands are named. A `cuda` test runs it compiled in bf16."""
from __future__ import annotations

import pytest
import torch

from draft_circuit.circuit.ir import ROW, TensorSpec
from draft_circuit.kernels._common import KernelInputError
from draft_circuit.kernels.sigmoid_mul import sigmoid_mul
from draft_circuit.ops import get_op
from draft_circuit.ops.registry import ShapeError
from draft_circuit.runners.testing import cuda

OP = get_op("sigmoid_mul")
ULP = {torch.float32: 2 ** -21, torch.bfloat16: 2 ** -6, torch.float16: 2 ** -9}  # two ulps (relative): the
# sigmoid may round the other way (tl.sigmoid vs torch.sigmoid), then the product rounds


def ref(x: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    return OP.reference([x, g], OP.parse_attrs({}))[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gate_cols", [1, 40])
def test_reference_is_transformers_arithmetic(dtype, gate_cols):
    g = torch.Generator().manual_seed(gate_cols)
    x, gate = torch.randn(6, 40, generator=g).to(dtype), (3 * torch.randn(6, gate_cols, generator=g)).to(dtype)
    assert torch.equal(ref(x, gate), x * torch.sigmoid(gate))  # what Qwen3NextAttention computes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows, cols, gate_cols", [(1, 8, 8), (5, 1500, 1500), (7, 33, 1)])
def test_kernel_matches_reference(dtype, rows, cols, gate_cols):
    g = torch.Generator().manual_seed(cols)
    x, gate = torch.randn(rows, cols, generator=g).to(dtype), (3 * torch.randn(rows, gate_cols, generator=g)).to(dtype)
    out = torch.full_like(x, float("nan"))
    sigmoid_mul(x, gate, out)
    want = ref(x, gate)
    assert ((out.float() - want.float()).abs() <= ULP[dtype] * want.float().abs().clamp(min=1)).all()


def test_bad_operands_are_named():
    x = torch.randn(3, 8)
    with pytest.raises(KernelInputError, match=r"gate: \[3, 4\].*expected \[3, 8\] or \[3, 1\]"):
        sigmoid_mul(x, torch.randn(3, 4), torch.empty_like(x))
    with pytest.raises(KernelInputError, match="out"):
        sigmoid_mul(x, torch.randn(3, 1), torch.empty(3, 8, dtype=torch.float16))
    with pytest.raises(ShapeError, match="one column"):
        OP.infer([TensorSpec(dtype="float32", shape=(ROW, 8)), TensorSpec(dtype="float32", shape=(ROW, 4))],
                 OP.parse_attrs({}))


@cuda
@pytest.mark.parametrize("gate_cols", [1, 4096])
def test_compiled_kernel_bf16(gate_cols):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, 4096, generator=g).to(torch.bfloat16).cuda()
    gate = (3 * torch.randn(8, gate_cols, generator=g)).to(torch.bfloat16).cuda()
    out = torch.empty_like(x)
    sigmoid_mul(x, gate, out)
    want = ref(x, gate)
    assert ((out.float() - want.float()).abs() <= ULP[torch.bfloat16] * want.float().abs().clamp(min=1)).all()
