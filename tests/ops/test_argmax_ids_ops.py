"""The lm-head argmax ops with an id table (attr `ids`, issue 18): each reference is the op without
the table, its token outputs (token, kept, last) then mapped by map_ids' reference; the Triton
bindings (interpreter) equal the references at widths 1..8 with and without a bitmask (an
all-masked row's -1 stays -1); the shape rule refuses a table that is not int32 [V]; the cost
reads the table one entry a row; the launch count is the unmapped op's."""
from __future__ import annotations

import pytest
import torch

from draft_circuit.circuit.ir import ROW, TensorSpec
from draft_circuit.ops.registry import DTYPE_NAMES, CostContext, ShapeError, get_op
from draft_circuit.ops.vocab import map_ids_ref

OPS = ("linear_argmax_logprob", "linear_argmax_keep", "rmsnorm_linear_argmax_logprob",
       "rmsnorm_linear_argmax_keep", "rmsnorm_linear_argmax_keep_last",
       "rmsnorm_linear_argmax_keep_gate", "rmsnorm_linear_argmax_keep_last_gate")
TOKEN_OUTPUTS = ("token", "kept", "last")  # what the table maps; logprob and active_next stay
K, V, TARGET = 24, 70, 500


def inputs(name: str, n: int, masked: bool, seed: int = 0) -> list[torch.Tensor]:
    """The op's inputs by their names, without the table (bitmask last where asked)."""
    g = torch.Generator().manual_seed(seed)
    make = {
        "x": lambda: torch.randn(n, K, generator=g),
        "norm_weight": lambda: 1 + 0.1 * torch.randn(K, generator=g),
        "weight": lambda: torch.randn(V, K, generator=g) / K ** 0.5,
        "active": lambda: torch.tensor([i % 3 != 1 for i in range(n)], dtype=torch.int32),
        "fallback": lambda: torch.randint(-1, TARGET, (n,), generator=g, dtype=torch.int32),
        "log_tau": lambda: torch.tensor([float("nan") if i % 2 else -3.0 for i in range(n)]),
    }
    op = get_op(name)
    out = [make[i]() for i in op.inputs[:op.num_required]]
    if masked:
        mask = torch.randint(-2**31, 2**31 - 1, (n, (V + 31) // 32), generator=g, dtype=torch.int64)
        mask = mask.to(torch.int32)
        mask[0] = 0  # nothing allowed
        out.append(mask)
    return out


def table(seed: int = 1) -> torch.Tensor:
    return torch.randperm(TARGET, generator=torch.Generator().manual_seed(seed))[:V].sort().values.int()


def attrs_of(name: str, ids: bool):
    return get_op(name).parse_attrs({"ids": True} if ids else {})


def specs(ts: list[torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(dtype=DTYPE_NAMES[t.dtype], shape=tuple(t.shape)) for t in ts]


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", OPS)
def test_reference_is_the_op_then_map_ids(name, masked):
    op, ids = get_op(name), table()
    for n in (1, 3, 8):
        ins = inputs(name, n, masked, seed=n)
        plain = op.reference(ins, attrs_of(name, False))
        got = op.reference([*ins, ids], attrs_of(name, True))
        assert len(got) == len(plain) == len(op.outputs)
        for out, a, b in zip(op.outputs, got, plain):
            if out == "last":  # keep_if_active(token, active, fallback): the fallback is a target id
                want = torch.where(ins[3].bool(), map_ids_ref(plain[0], ids), ins[4])
            else:  # token and kept (-1 where inactive) mapped, logprob and active_next as they were
                want = map_ids_ref(b, ids) if out in TOKEN_OUTPUTS else b
            assert torch.equal(a, want), (name, out, n)
        if masked:
            assert got[0][0] == -1


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("name", OPS)
def test_triton_bindings_equal_the_reference_at_every_width(name, masked, monkeypatch):
    import draft_circuit.kernels.argmax_logprob as am
    monkeypatch.setattr(am, "PRENORM_FROM", 1 if masked else 1 << 40)  # both norm bindings run
    op, ids = get_op(name), table(seed=2)
    a = attrs_of(name, True)
    for n in range(1, 9):
        ins = [*inputs(name, n, masked, seed=10 + n), ids]
        binding = next(b for b in op.kernels if b.applies("interpret", specs(ins), a))
        if name.startswith("rmsnorm"):
            assert binding.name.endswith("_prenorm") == masked
        ws = [torch.full(shape, float("nan"), dtype=getattr(torch, dt))
              for dt, shape in (binding.workspace(specs(ins), {}, a) if binding.workspace else [])]
        want = op.reference(ins, a)
        outs = [torch.full_like(t, 7) for t in want]
        binding.launch(ins, outs, ws, a)
        for out, got, ref in zip(op.outputs, outs, want):
            if out == "logprob":
                torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
            else:
                assert torch.equal(got, ref), (name, out, n)
        assert set(outs[0].tolist()) <= set(ids.tolist()) | {-1}


@pytest.mark.parametrize("name", OPS)
def test_shape_rule_cost_and_launches_with_a_table(name):
    op = get_op(name)
    ins = specs(inputs(name, 4, True))
    ins = [TensorSpec(dtype=s.dtype, shape=(ROW, *s.shape[1:])) if s.shape[:1] == (4,) else s for s in ins]
    with_ids = [*ins, TensorSpec(dtype="int32", shape=(V,))]
    a, plain = attrs_of(name, True), attrs_of(name, False)
    assert op.infer(with_ids, a) == op.infer(ins, plain)
    for bad in (TensorSpec(dtype="int32", shape=(V + 1,)), TensorSpec(dtype="int64", shape=(V,))):
        with pytest.raises(ShapeError, match=r"id table must be int32 \[70\]"):
            op.infer([*ins, bad], a)
    outs = op.infer(ins, plain)
    env, ctx = {"n": 4}, CostContext(width=4)
    # the table is read one int32 a row (the winners'), never whole
    assert (op.cost_at(with_ids, outs, a, ctx, env).bytes_read
            == op.cost_at(ins, outs, plain, ctx, env).bytes_read + 4 * 4)
    for binding in op.kernels:
        assert binding.launch_count(with_ids, a) == binding.launch_count(ins, plain)


def test_ids_attr_without_a_table_is_refused():
    op = get_op("linear_argmax_logprob")
    x, w = TensorSpec(dtype="float32", shape=(ROW, K)), TensorSpec(dtype="float32", shape=(V, K))
    with pytest.raises(ShapeError, match="before its id table"):
        op.infer([x, w], attrs_of("linear_argmax_logprob", True))
