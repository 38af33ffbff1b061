"""Bound params follow the weights' device (issue 16: DeepSeek's `rope.inv_freq`, computed at bind
time rather than read, stayed on the CPU, and the H200 benchmark's chain failed at setup).

On CPU the witness is the meta device: weights made there must bind to params all there, so
a tensor a bind builds on its own (on the CPU) is caught without a GPU. The @cuda test binds
CUDA-resident weights as `benchmarks/draft_chain.py` does (no `.cuda()` after bind) and runs the
compiled chain."""
from __future__ import annotations

import torch

from draft_circuit.circuit.layers.deepseek import DeepseekMtpHead, mtp_checkpoint_shapes
from draft_circuit.circuit.layers.deepseek_checkpoint import target_checkpoint_shapes
from draft_circuit.circuit.layers.deepseek_target import bind_deepseek_target, target_param_specs
from draft_circuit.circuit.layers.mla import INV_FREQ
from draft_circuit.circuit.layers.moe import quantize_blocks
from draft_circuit.circuit.layers.deepseek_checkpoint import FP8_STORED
from draft_circuit.circuit.layers.mtp import KvLayout, emit_draft_chain
from draft_circuit.runners.testing import cuda, random_draft_batch
from tests.layers.deepseek_fixtures import random_weights, tiny_config

META = torch.device("meta")


def _fp8(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The released layout: FP8_STORED weights fp8 e4m3 beside their block scales."""
    out = {}
    for k, v in weights.items():
        if k.endswith(FP8_STORED) and "eh_proj" not in k:
            out[k], out[k + "_scale_inv"] = quantize_blocks(v)
        else:
            out[k] = v
    return out


def _off(params: dict[str, torch.Tensor], device: torch.device) -> list[str]:
    return sorted(k for k, v in params.items() if v.device.type != device.type)


def test_deepseek_mtp_head_binds_every_param_on_the_weights_device():
    c = tiny_config()
    weights = {k: v.to(META) for k, v in random_weights(mtp_checkpoint_shapes(c), 1).items()}
    params = DeepseekMtpHead(c).bind(weights)
    assert INV_FREQ in params
    assert _off(params, META) == []


def test_deepseek_mtp_head_binds_fp8_weights_on_their_device():
    c = tiny_config(moe_intermediate_size=128, hidden_size=128)
    weights = {k: v.to(META) for k, v in _fp8(random_weights(mtp_checkpoint_shapes(c), 2)).items()}
    head = DeepseekMtpHead(c, fp8_experts=True, fp8_dense=True)
    params = head.bind(weights)
    assert any(v.dtype == torch.float8_e4m3fn for v in params.values())  # the fp8 path ran
    assert _off(params, META) == []


def test_deepseek_target_binds_every_param_on_the_weights_device():
    c = tiny_config()
    weights = {k: v.to(META) for k, v in random_weights(target_checkpoint_shapes(c), 3).items()}
    params = bind_deepseek_target(c, weights, "float32")
    assert set(params) == set(target_param_specs(c, "float32"))
    assert _off(params, META) == []


@cuda
def test_deepseek_chain_binds_and_runs_from_cuda_weights():
    """The benchmark's setup, small: weights made on the GPU, bound there, the compiled chain run."""
    from draft_circuit.circuit.planner import compile_draft
    from draft_circuit.runners.program import ProgramRunner
    dev = torch.device("cuda")
    c = tiny_config()
    head = DeepseekMtpHead(c)
    params = head.bind({k: v.to(dev) for k, v in random_weights(mtp_checkpoint_shapes(c), 4).items()})
    assert _off(params, dev) == []
    kv = KvLayout(num_blocks=40, block_size=4, max_blocks_per_seq=6)
    chain = emit_draft_chain(head, 2, max_width=4, kv=kv)
    compiled = compile_draft(chain, params, [1, 4], device="cuda")
    batch = random_draft_batch(c, kv, 4, seed=5, num_drafts=2)
    k_shape, v_shape = head.cache_shapes(kv)
    states = {"k_cache": torch.zeros(k_shape, device=dev), "v_cache": torch.zeros(v_shape, device=dev)}
    out = ProgramRunner(compiled, states).run({k: v.to(dev) for k, v in batch.inputs.items()})
    drafts = out["drafts"].cpu()
    assert drafts.shape == (4, 2) and bool(((drafts >= 0) & (drafts < c.vocab_size)).all())
