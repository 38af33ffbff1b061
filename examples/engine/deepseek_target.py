"""The engine's DeepSeek-V3-architecture target (MLA + MoE layers from the layer library,
circuit/layers/deepseek_target.py) behind TargetModel's interface: `forward(rows)` gives each
row's greedy token and final-norm hidden. Its KV is two latent pools per layer.

Additive beside model.py (the Llama target): the engine builds its target with `target_for`,
which picks this one for an `MlaConfig` checkpoint.
"""
from __future__ import annotations

import torch

from draft_circuit.circuit.layers.deepseek_target import bind_deepseek_target, emit_deepseek_target, target_state_shapes
from draft_circuit.circuit.layers.mla import MlaConfig
from draft_circuit.circuit.layers.moe import SCALE
from draft_circuit.circuit.layers.mtp import KvLayout
from draft_circuit.circuit.planner import compile_draft
from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.runners.draft import CircuitDraftRunner, WidthPolicy
from draft_circuit.runners.eager import EagerDraftRunner
from draft_circuit.runners.protocol import DraftRunner
from examples.engine.model import TargetModel


def _stored_fp8(weights: dict[str, torch.Tensor], suffix: str) -> bool:
    names = [k for k in weights if k.endswith(suffix) and not k.endswith(SCALE)]
    return bool(names) and all(weights[k].dtype == torch.float8_e4m3fn and k + SCALE in weights for k in names)


class DeepseekTargetModel(TargetModel):
    """forward="eager": the eager oracle at any row count; "circuit": compiled for power-of-two
    row counts up to max_rows, a pass padded up with inert rows (TargetModel's policy).
    Weights as load_deepseek_target_weights gives them: fp8 projections / experts kept fp8 when
    stored so (keep_fp8=True) run fp8; dequantised ones run in `dtype`."""

    def __init__(self, config: MlaConfig, weights: dict[str, torch.Tensor], kv: KvLayout, *,
                 max_rows: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 forward: str = "eager", tap_layers: tuple[int, ...] | None = None) -> None:
        if not isinstance(config, MlaConfig):
            raise TypeError(f"DeepseekTargetModel needs an MlaConfig, got {type(config).__name__}")
        if tap_layers is not None:  # an EAGLE-3 drafter's taps: emit_deepseek_target has none
            raise ValueError(f"tap_layers {list(tap_layers)}: the DeepSeek-V3 target taps no layers "
                             "(draft with its MTP layer)")
        self.config, self.kv, self.device, self.max_rows = config, kv, torch.device(device), max_rows
        self.hidden_size = config.hidden_size  # the final-norm hidden its MTP layer reads
        name = str(dtype).removeprefix("torch.")
        fp8 = {"fp8_dense": _stored_fp8(weights, "self_attn.o_proj.weight"),
               "fp8_experts": config.moe_intermediate_size % 128 == 0 and _stored_fp8(weights, "down_proj.weight")
               and any(config.is_moe_layer(i) for i in range(config.num_hidden_layers))}
        self.circuit = emit_deepseek_target(config, kv=kv, max_rows=max_rows, dtype=name, **fp8)
        params = {k: w.to(self.device) for k, w in bind_deepseek_target(config, weights, name, **fp8).items()}
        states = {k: torch.zeros(s, dtype=dtype, device=self.device) for k, s in target_state_shapes(config, kv).items()}
        self.runner: DraftRunner
        if forward == "eager":
            self.runner = EagerDraftRunner(self.circuit, params, states)
        elif forward == "circuit":
            widths = sorted({min(1 << i, max_rows) for i in range(max_rows.bit_length() + 1)})
            compiled = compile_draft(self.circuit, params, widths, device=str(self.device))
            self.runner = CircuitDraftRunner(compiled, states, scratch_block=0, policy=WidthPolicy(allow_split=False))
        else:
            raise ValueError(f"target forward must be 'eager' or 'circuit', got {forward!r}")


def target_for(config: MtpConfig, weights: dict[str, torch.Tensor], kv: KvLayout, **kwargs) -> TargetModel:
    """The target model a checkpoint's config describes: DeepSeek-V3's for an MlaConfig, else Llama's."""
    if isinstance(config, MlaConfig):
        return DeepseekTargetModel(config, weights, kv, **kwargs)
    return TargetModel(config, weights, kv, **kwargs)
