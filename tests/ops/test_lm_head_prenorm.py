"""The lm-head's final norm as a launch of its own (ops/prologue_argmax.py's `*_prenorm`
bindings over kernels.argmax_logprob's `normed=`): bound first by the weight's shape only (V x K
from argmax_logprob.PRENORM_FROM), three launches declared and run, the fused prologue's tokens
and its logprobs within the norm sum's order; an 8B-shaped chain planned for CUDA binds it at
every width and counts the extra launch, a small head keeps the prologue (CPU interpreter)."""
from __future__ import annotations

import pytest
import torch

from draft_circuit.circuit.ir import ROW, TensorSpec
from draft_circuit.ops.registry import get_op

EPS = 1e-5
LM_HEAD_OPS = ("rmsnorm_linear_argmax_logprob", "rmsnorm_linear_argmax_keep",
               "rmsnorm_linear_argmax_keep_last", "rmsnorm_linear_argmax_keep_gate",
               "rmsnorm_linear_argmax_keep_last_gate")


def _specs(v, k, width=ROW):  # (x, norm_weight, weight)
    return [TensorSpec(dtype="float32", shape=s) for s in ((width, k), (k,), (v, k))]


@pytest.mark.parametrize("name", LM_HEAD_OPS)
def test_the_prenorm_binding_is_first_and_applies_by_the_weights_shape(name):
    op = get_op(name)
    first, second = op.kernels[0], op.kernels[1]
    assert first.name == f"triton_{name}_prenorm" and second.name == f"triton_{name}"
    attrs = op.parse_attrs({"eps": EPS})
    for width in (ROW, 1, 64):  # never n
        ints = [TensorSpec(dtype="int32", shape=(width,))] * (op.num_required - 3)  # active, ...
        big, small = _specs(128256, 4096, width) + ints, _specs(32000, 1024, width) + ints
        assert first.applies("cuda", big, attrs) and first.launch_count(big, attrs) == 3
        assert not first.applies("cuda", small, attrs)
        assert second.applies("cuda", small, attrs) and second.launch_count(small, attrs) == 2


def test_the_prenorm_binding_runs_three_kernels_and_keeps_the_prologues_tokens(monkeypatch, interpreted_launches):
    import draft_circuit.kernels.argmax_logprob as am
    monkeypatch.setattr(am, "PRENORM_FROM", 1)  # a weight the interpreter runs quickly
    op = get_op("rmsnorm_linear_argmax_keep")
    prenorm, prologue = op.kernels[0], op.kernels[1]
    g = torch.Generator().manual_seed(5)
    n, k, v = 3, 96, 300
    x = torch.randn(n, k, generator=g) * 2
    inputs = [x, 1 + 0.1 * torch.randn(k, generator=g), 0.2 * torch.randn(v, k, generator=g),
              torch.tensor([1, 0, 1], dtype=torch.int32)]
    specs = [TensorSpec(dtype="float32", shape=s) for s in ((n, k), (k,), (v, k))] + \
        [TensorSpec(dtype="int32", shape=(n,))]
    attrs = op.parse_attrs({"eps": EPS})
    assert prenorm.applies("interpret", specs, attrs)
    seen = interpreted_launches

    def launch(binding):
        ws = [torch.full(shape, float("nan"), dtype=getattr(torch, dt))
              for dt, shape in binding.workspace(specs, {}, attrs)]
        outs = [torch.empty(n, dtype=torch.int32), torch.empty(n), torch.empty(n, dtype=torch.int32)]
        binding.launch(inputs, outs, ws, attrs)
        return outs, ws
    (tok, lp, kept), ws = launch(prenorm)
    assert len(seen) == prenorm.launch_count(specs, attrs) == 3 and seen[0] == "rmsnorm_kernel"
    torch.testing.assert_close(ws[1], torch.nn.functional.rms_norm(x, (k,), inputs[1], EPS))  # normed x
    (tok2, lp2, kept2), _ = launch(prologue)
    assert torch.equal(tok, tok2) and torch.equal(kept, kept2)
    torch.testing.assert_close(lp, lp2, atol=1e-5, rtol=1e-5)
    want_tok, want_lp, want_kept = op.reference(inputs, attrs)
    assert torch.equal(tok, want_tok.to(tok.dtype)) and torch.equal(kept, want_kept.to(kept.dtype))


def test_plans_of_the_8b_chain_bind_the_prenorm_and_count_its_launch(monkeypatch):
    """An 8B-shaped chain (vocabulary 128256) planned for CUDA on meta weights binds the lm-head's
    prenorm at every width and counts one launch more a step than with the rule turned off; a
    small head (vocabulary 32000 x 1024) keeps the norm in the prologue."""
    import draft_circuit.ops.prologue_argmax as prologue_argmax
    from tests.plan_shapes import plan_kernels

    def plan(vocab, hidden, inter, heads, kv_heads, d):
        return plan_kernels("rmsnorm_linear_argmax", vocab=vocab, hidden=hidden, inter=inter,
                            heads=heads, kv_heads=kv_heads, head_dim=d)

    big = plan(128256, 4096, 14336, 32, 8, 128)
    small = plan(32000, 1024, 2816, 16, 4, 64)
    monkeypatch.setattr(prologue_argmax, "_k_prenorm_pays", lambda: lambda v, k: False)
    off = plan(128256, 4096, 14336, 32, 8, 128)
    for w in (1, 8):
        assert big[w][0] and all(k.endswith("_prenorm") for k in big[w][0])
        assert off[w][0] and small[w][0] and not any(k.endswith("_prenorm") for k in off[w][0] | small[w][0])
        assert big[w][1] == off[w][1] + 1
