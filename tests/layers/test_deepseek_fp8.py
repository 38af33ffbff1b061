"""FP8 block-scaled projections (issue 16 step 3): a layer that keeps its attention projections
and dense MLP fp8 e4m3 (per-row scales from DeepSeek-V3's 128x128 `weight_scale_inv`) computes,
in the eager oracle, exactly what the same layer computes on the dequantised weights (fp32), for
dense and MoE layers and the MTP head with fp8 experts; under the interpreter the fp8 kernels
draft what eager drafts. GPU: bf16 chain with fp8 weights, rows alone == in a batch."""
from __future__ import annotations

import pytest
import torch

from draft_circuit.circuit.layers.deepseek import DeepseekMtpHead, layer_checkpoint_shapes, mtp_checkpoint_shapes
from draft_circuit.circuit.layers.moe import SCALE, quantize_blocks
from draft_circuit.circuit.layers.mtp import KvLayout, emit_draft_chain
from draft_circuit.circuit.planner import CompileOptions, compile_draft
from draft_circuit.ops.moe import dequantize_blocks
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.program import ProgramRunner
from draft_circuit.runners.testing import cuda, random_draft_batch

from tests.layers.deepseek_fixtures import random_weights, tiny_config

KV = KvLayout(num_blocks=60, block_size=4, max_blocks_per_seq=8)
QUANTISED = ("_proj.weight", "kv_a_proj_with_mqa.weight")  # what DeepSeek-V3 stores fp8


def as_checkpoint(weights: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(fp8 as stored with `_scale_inv`, the same weights dequantised): the projections, dense
    MLP and experts fp8; norms, router, embeddings, eh_proj and heads as they are."""
    stored, real = {}, {}
    for k, w in weights.items():
        if k.endswith(QUANTISED) and "eh_proj" not in k and w.dim() == 2:
            q, s = quantize_blocks(w)
            stored[k], stored[k + SCALE] = q, s
            real[k] = dequantize_blocks(q, s)
        else:
            stored[k] = real[k] = w
    return stored, real


def draft_batch(c, head, width, seed):
    b = random_draft_batch(c, KV, width, seed=seed, num_drafts=2)
    g = torch.Generator().manual_seed(seed)
    k_shape, v_shape = head.cache_shapes(KV)
    return b.inputs, {"k_cache": torch.randn(k_shape, generator=g), "v_cache": torch.randn(v_shape, generator=g)}


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_fp8_mtp_head_is_the_dequantised_head_bitwise(q_lora_rank):
    c = tiny_config(q_lora_rank=q_lora_rank, moe_intermediate_size=128)  # fp8 experts stack at 128 rows
    stored, real = as_checkpoint(random_weights(mtp_checkpoint_shapes(c), 2))
    fp8 = DeepseekMtpHead(c, fp8_experts=True, fp8_dense=True)
    plain = DeepseekMtpHead(c)
    fp8_params, plain_params = fp8.bind(stored), plain.bind(real)
    assert fp8_params["self_attn.q_nope.weight"].dtype == torch.float8_e4m3fn
    assert fp8_params["self_attn.q_nope.weight_row_scale_inv"].shape == (4 * 10, 1)
    assert fp8_params["mlp.experts.gate_up_proj.weight"].dtype == torch.float8_e4m3fn
    chain_fp8, chain = emit_draft_chain(fp8, 2, max_width=4, kv=KV), emit_draft_chain(plain, 2, max_width=4, kv=KV)
    assert sum(n.op == "linear_fp8" for n in chain_fp8.nodes) == 2 * (6 if q_lora_rank else 5)
    inputs, states = draft_batch(c, plain, 4, seed=3)
    a = EagerRunner(chain_fp8, fp8_params, {k: v.clone() for k, v in states.items()}).run(inputs)
    b = EagerRunner(chain, plain_params, {k: v.clone() for k, v in states.items()}).run(inputs)
    for name in b:
        assert torch.equal(a[name], b[name]), name


def test_fp8_dense_layer_equals_dequantised_layer_bitwise():
    from tests.layers.deepseek_fixtures import layer_circuit
    from draft_circuit.circuit.layers.deepseek import bind_layer, layer_param_specs
    from draft_circuit.circuit.builder import CircuitBuilder  # noqa: F401
    from draft_circuit.circuit.layers.mla import INV_FREQ
    c = tiny_config(hidden_size=160, intermediate_size=200)  # K off the 128 block
    weights = {f"model.layers.0.{k}": v for k, v in random_weights(layer_checkpoint_shapes(c, moe=False), 4).items()}
    stored, real = as_checkpoint(weights)
    fp8_params = bind_layer(c, stored, "model.layers.0.", False, "float32", fp8_dense=True)
    assert fp8_params["model.layers.0.mlp.gate_up_proj.weight"].dtype == torch.float8_e4m3fn
    assert set(fp8_params) == {f"model.layers.0.{k}" for k in layer_param_specs(c, False, "float32", fp8_dense=True)}
    # the fp8 params, dequantised row by row, are the real params
    plain = bind_layer(c, real, "model.layers.0.", False, "float32")
    for k, w in fp8_params.items():
        if w.dtype == torch.float8_e4m3fn:
            s = fp8_params[k + "_row_scale_inv"]
            deq = w.float() * s.repeat_interleave(128, dim=1)[:, :w.shape[1]]
            assert torch.equal(deq, plain[k]), k
    circuit = layer_circuit(c, 0, max_rows=4, num_blocks=20, block_size=4, max_blocks=4)
    assert circuit is not None and INV_FREQ in {v.name for v in circuit.values if v.kind == "param"}


def test_interpreted_fp8_kernels_draft_what_eager_drafts():
    c = tiny_config(moe_intermediate_size=128)
    stored, _ = as_checkpoint(random_weights(mtp_checkpoint_shapes(c), 5))
    head = DeepseekMtpHead(c, fp8_dense=True)  # fp8 experts bind on CUDA only
    params = head.bind(stored)
    chain = emit_draft_chain(head, 2, max_width=4, kv=KV)
    compiled = compile_draft(chain, params, [3], options=CompileOptions(interpret_kernels=True))
    assert {x.kernel for x in compiled.programs[3].launches if x.op == "linear_fp8"} == {"triton_linear_fp8"}
    inputs, states = draft_batch(c, head, 3, seed=6)
    want = EagerRunner(chain, params, {k: v.clone() for k, v in states.items()}).run(inputs)
    got = ProgramRunner(compiled, states).run(inputs)
    assert torch.equal(got["drafts"], want["drafts"])
    torch.testing.assert_close(got["hidden_out"], want["hidden_out"], atol=1e-4, rtol=1e-4)


@cuda
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_gpu_chain_bf16_and_fp8_rows_alone_equal_rows_in_batch(fp8):
    from draft_circuit.runners.cudagraph import GraphRunner
    c = tiny_config(hidden_size=256, moe_intermediate_size=128, intermediate_size=256, kv_lora_rank=128,
                    q_lora_rank=192, qk_nope_head_dim=32, qk_rope_head_dim=16, head_dim=16, v_head_dim=32,
                    num_attention_heads=16, num_key_value_heads=16)
    stored, real = as_checkpoint(random_weights(mtp_checkpoint_shapes(c), 7))
    head = DeepseekMtpHead(c, "bfloat16", fp8_experts=fp8, fp8_dense=fp8)
    params = {k: v.cuda() for k, v in head.bind(stored if fp8 else real).items()}
    chain = emit_draft_chain(head, 3, max_width=8, kv=KV)
    compiled = compile_draft(chain, params, [1, 8], device="cuda")
    inputs, states = draft_batch(c, head, 8, seed=8)
    inputs = {k: v.cuda() if k != "hidden" else v.bfloat16().cuda() for k, v in inputs.items()}
    states = {k: v.bfloat16().cuda() for k, v in states.items()}
    eager = EagerRunner(chain, params, {k: v.clone() for k, v in states.items()}).run(inputs)
    runner = GraphRunner(compiled, {k: v.clone() for k, v in states.items()})
    batch = {k: v.clone() for k, v in runner.run(inputs).items()}
    # bf16 kernels against fp32-accumulating references: a near tie may flip a first draft (and a
    # flipped draft changes every later one), so agreement is loose; bitwise is below
    agree = (batch["drafts"][:, 0] == eager["drafts"][:, 0]).float().mean()
    assert agree >= 0.75, (batch["drafts"], eager["drafts"])
    # each sequence alone (its rows are its own: rewriting them first, it reads what it wrote)
    for i in range(8):
        alone = runner.run({k: v[i:i + 1].contiguous() for k, v in inputs.items()})
        assert torch.equal(alone["drafts"], batch["drafts"][i:i + 1])
        assert torch.equal(alone["confidences"], batch["confidences"][i:i + 1])
