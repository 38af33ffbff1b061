"""The MoE MTP head (DeepSeek-V3 / GLM-4.5 layout): `MoeConfig`, `MoeMtpHead` (its MLP is moe_route +
moe_experts over stacked expert weights, optionally fp8), the refusals that send a batch per
sequence (`batch_refusal`), and `moe_plan_note`, what the plan report says about them.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from draft_circuit.circuit.builder import CircuitBuilder
from draft_circuit.ops import moe as moe_ops  # registers the MoE ops
from draft_circuit.circuit.layers.config import _NUM_EXPERTS_ALIASES, MTP_PARAM_SHAPES, ConfigError, MtpConfig, _is_int
from draft_circuit.circuit.layers.mtp import GATE_UP, MtpHead, yarn_param_specs, yarn_params
from draft_circuit.ops.moe import FP8, KILL_SWITCH, SCALE_BLOCK, dequantize_blocks, expand_block_scales

GATE, BIAS = "mlp.gate.weight", "mlp.gate.e_score_correction_bias"
EXPERTS_GATE_UP, EXPERTS_DOWN = "mlp.experts.gate_up_proj.weight", "mlp.experts.down_proj.weight"
SHARED_GATE_UP, SHARED_DOWN = "mlp.shared_experts.gate_up_proj.weight", "mlp.shared_experts.down_proj.weight"
SCALE = "_scale_inv"  # "<weight>_scale_inv": DeepSeek-V3's name for a weight's block scales
DENSE_MLP = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
SIGMOID_FAMILIES = ("deepseek_v3", "glm4_moe")  # model_types whose absent scoring_func is sigmoid
# model_types whose router transformers keeps fp32 (_keep_in_fp32_modules_strict) and whose weights
# are normalised at top_k == 1 too (Glm4MoeTopkRouter: `if self.norm_topk_prob`, no top_k > 1)
ROUTER_FP32_FAMILIES = ("glm4_moe",)
ROUTING_DTYPES = (None, "float32")  # None: the head's dtype


class MoeWeightError(ValueError):
    """A MoE weight is missing or cannot be bound as asked; names the tensor."""


@dataclass(frozen=True, kw_only=True)
class MoeConfig(MtpConfig):
    """An MtpConfig whose MTP layer's MLP is a MoE. `routing_dtype` None: the gate runs in the
    head's dtype (fp32 logits either way); "float32": an fp32 gate (refused for batches, as the
    reference engine's grouped decode does). `expert_parallel_size` > 1: experts are sharded
    across ranks by the host (refused: the circuit has no cross-rank combine yet).
    `fp32_gate`, `norm_top1`: GLM-4.5's router as transformers runs it (an fp32 gate by the model's
    definition, never refused for batches; a lone expert's weight normalised too), set for
    ROUTER_FP32_FAMILIES; DeepSeek-V3's and Llama-named MoE configs keep both off."""

    n_routed_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    scoring_func: str = "sigmoid"
    routing_dtype: str | None = None
    expert_parallel_size: int = 1
    fp32_gate: bool = False
    norm_top1: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        _validate_moe(self)

    @property
    def gate_dtype(self) -> str | None:
        """The gate's dtype: float32 when routing is configured so or the family's gate is fp32;
        None: the head's."""
        return "float32" if self.routing_dtype == "float32" or self.fp32_gate else None

    @property
    def num_experts(self) -> int:
        return self.n_routed_experts

    @property
    def shared_intermediate_size(self) -> int:
        return self.n_shared_experts * self.moe_intermediate_size

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], *, source: str = "config") -> MoeConfig:
        """HF names (DeepSeek-V3, GLM-4.5, Qwen3-MoE). Absent: scoring_func -> sigmoid for
        SIGMOID_FAMILIES, else softmax; norm_topk_prob -> True for sigmoid, False for softmax;
        n_group, topk_group -> 1; n_shared_experts -> 0; routed_scaling_factor -> 1.0."""
        base = MtpConfig.from_hf(d, source=source)  # also: the expert-count aliases agree
        try:
            experts = next((d[a] for a in _NUM_EXPERTS_ALIASES if d.get(a) is not None), None)
            for name, v in (("n_routed_experts", experts), ("num_experts_per_tok", d.get("num_experts_per_tok")),
                            ("moe_intermediate_size", d.get("moe_intermediate_size"))):
                if v is None:
                    raise ConfigError(f"config field {name!r} is required for a MoE head but missing")
            assert experts is not None  # checked just above
            scoring = d.get("scoring_func") or ("sigmoid" if d.get("model_type") in SIGMOID_FAMILIES else "softmax")

            def get(k: str, default: Any) -> Any:
                return default if d.get(k) is None else d[k]
            return cls(**dataclasses.asdict(base), n_routed_experts=experts,
                       num_experts_per_tok=d["num_experts_per_tok"],
                       moe_intermediate_size=d["moe_intermediate_size"],
                       n_shared_experts=get("n_shared_experts", 0), n_group=get("n_group", 1),
                       topk_group=get("topk_group", 1), scoring_func=scoring,
                       routed_scaling_factor=get("routed_scaling_factor", 1.0),
                       norm_topk_prob=get("norm_topk_prob", scoring == "sigmoid"),
                       routing_dtype=d.get("routing_dtype"),
                       expert_parallel_size=get("expert_parallel_size", 1),
                       fp32_gate=d.get("model_type") in ROUTER_FP32_FAMILIES,
                       norm_top1=d.get("model_type") in ROUTER_FP32_FAMILIES)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None


def is_moe_hf_config(d: Mapping[str, Any]) -> bool:
    """A config.json naming an expert count describes a MoE MTP layer."""
    return any(d.get(a) is not None for a in _NUM_EXPERTS_ALIASES)


def _validate_moe(c: MoeConfig) -> None:
    for name in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "n_group",
                 "topk_group", "expert_parallel_size"):
        v = getattr(c, name)
        if not _is_int(v) or v <= 0:
            raise ConfigError(f"config field {name!r} = {v!r}: must be a positive int")
    if not _is_int(c.n_shared_experts) or c.n_shared_experts < 0:
        raise ConfigError(f"config field 'n_shared_experts' = {c.n_shared_experts!r}: must be an int >= 0")
    e, g = c.n_routed_experts, c.n_group
    if c.scoring_func not in ("sigmoid", "softmax"):
        raise ConfigError(f"config field 'scoring_func' = {c.scoring_func!r}: must be 'sigmoid' or 'softmax'")
    if e % g or c.topk_group > g or (g > 1 and (e // g < 2 or c.scoring_func != "sigmoid")):
        raise ConfigError(f"config fields 'n_group' = {g}, 'topk_group' = {c.topk_group}: n_group must "
                          f"divide n_routed_experts = {e} into sigmoid-routed groups of >= 2 and "
                          "topk_group <= n_group")
    if c.num_experts_per_tok > c.topk_group * (e // g):
        raise ConfigError(f"config field 'num_experts_per_tok' = {c.num_experts_per_tok}: more than the "
                          f"{c.topk_group * (e // g)} experts of the kept groups")
    if isinstance(c.routed_scaling_factor, bool) or not isinstance(c.routed_scaling_factor, (int, float)) \
            or not c.routed_scaling_factor > 0:
        raise ConfigError(f"config field 'routed_scaling_factor' = {c.routed_scaling_factor!r}: must be > 0")
    object.__setattr__(c, "routed_scaling_factor", float(c.routed_scaling_factor))
    if not isinstance(c.norm_topk_prob, bool):
        raise ConfigError(f"config field 'norm_topk_prob' = {c.norm_topk_prob!r}: must be a bool")
    for name in ("fp32_gate", "norm_top1"):
        if not isinstance(getattr(c, name), bool):
            raise ConfigError(f"MoE option {name!r} = {getattr(c, name)!r}: must be a bool")
    if c.routing_dtype not in ROUTING_DTYPES:
        raise ConfigError(f"config field 'routing_dtype' = {c.routing_dtype!r}: must be one of {ROUTING_DTYPES}")
    if e % c.expert_parallel_size:  # FAULT 23
        raise ConfigError(f"config field 'expert_parallel_size' = {c.expert_parallel_size}: must divide "
                          f"n_routed_experts = {e}")


def moe_checkpoint_shapes(c: MoeConfig) -> dict[str, tuple[int, ...]]:
    """Canonical MTP-layer names -> shapes with the MoE MLP (per-expert tensors, as stored)."""
    h, i, s = c.hidden_size, c.moe_intermediate_size, c.shared_intermediate_size
    shapes = {k: v for k, v in MTP_PARAM_SHAPES(c).items() if k not in DENSE_MLP}
    shapes[GATE] = (c.n_routed_experts, h)
    if c.scoring_func == "sigmoid":
        shapes[BIAS] = (c.n_routed_experts,)
    for prefix, size in [*((f"mlp.experts.{e}.", i) for e in range(c.n_routed_experts)),
                         *((("mlp.shared_experts.", s),) if s else ())]:
        shapes.update({f"{prefix}gate_proj.weight": (size, h), f"{prefix}up_proj.weight": (size, h),
                       f"{prefix}down_proj.weight": (h, size)})
    return shapes


def random_moe_weights(c: MoeConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Canonical-name weights like runners.testing.random_mtp_weights; the routing bias is
    zero-mean (spread 0.1), so it moves selections without swamping the scores."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in moe_checkpoint_shapes(c).items():
        t = torch.randn(shape, generator=g)
        t = 0.1 * t if name == BIAS else 1 + 0.1 * t if len(shape) == 1 else \
            t if "embed" in name else t / math.sqrt(shape[-1])
        out[name] = t.to(dtype=torch.float32 if name == BIAS else dtype, device=device)
    return out


def quantize_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 e4m3 weight, f32 block scales) with each 128x128 block's amax mapped to 448."""
    rows, cols = weight.shape[-2:]
    pr, pc = -rows % SCALE_BLOCK, -cols % SCALE_BLOCK
    w = F.pad(weight.float(), (0, pc, 0, pr))
    blocks = w.reshape(*w.shape[:-2], w.shape[-2] // SCALE_BLOCK, SCALE_BLOCK,
                       w.shape[-1] // SCALE_BLOCK, SCALE_BLOCK)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / 448.0
    q = (weight.float() / expand_block_scales(scale, weight.shape)).to(torch.float8_e4m3fn)
    return q, scale


def _real(weights: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """A checkpoint weight as real numbers (block-scaled ones dequantised to fp32)."""
    if name not in weights:
        raise MoeWeightError(f"MoE head: weight {name!r} is missing")
    w, scale = weights[name], weights.get(name + SCALE)
    return dequantize_blocks(w, scale) if scale is not None else w


class MoeMtpHead(MtpHead):
    """An MTP head whose MLP routes each row to k experts plus the shared ones. fp8_experts:
    routed experts stay fp8 e4m3 with 128x128 block scales (moe_experts_fp8); shared experts and
    everything else are dequantised to the head's dtype when bound. Its attention is the dense
    head's (MtpHead.emit_step), YaRN included: it declares and binds the same frequency table
    (yarn_param_specs, yarn_params) that rope_op reads."""

    config: MoeConfig

    def __init__(self, config: MoeConfig, dtype: str = "float32", fp8_experts: bool = False) -> None:
        if not isinstance(config, MoeConfig):
            raise TypeError(f"MoeMtpHead needs a MoeConfig, got {type(config).__name__}")
        super().__init__(config, dtype)
        self.fp8_experts = fp8_experts

    def param_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        c, dt = self.config, self.dtype
        h, i, s, e = c.hidden_size, c.moe_intermediate_size, c.shared_intermediate_size, c.n_routed_experts
        specs = {k: (dt, v) for k, v in MtpHead.param_shapes(self).items()
                 if k not in (GATE_UP, "mlp.down_proj.weight")}
        specs[GATE] = (c.gate_dtype or dt, (e, h))
        if c.scoring_func == "sigmoid":
            specs[BIAS] = ("float32", (e,))
        experts = FP8 if self.fp8_experts else dt
        specs[EXPERTS_GATE_UP], specs[EXPERTS_DOWN] = (experts, (e, 2 * i, h)), (experts, (e, h, i))
        if self.fp8_experts:

            def blocks(r: int, col: int) -> tuple[int, int, int]:
                return (e, math.ceil(r / SCALE_BLOCK), math.ceil(col / SCALE_BLOCK))
            specs[EXPERTS_GATE_UP + SCALE] = ("float32", blocks(2 * i, h))
            specs[EXPERTS_DOWN + SCALE] = ("float32", blocks(h, i))
        if s:
            specs[SHARED_GATE_UP], specs[SHARED_DOWN] = (dt, (2 * s, h)), (dt, (h, s))
        return specs | yarn_param_specs(c)  # last, as the dense head's: default RoPE adds nothing

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: shape for k, (_, shape) in self.param_specs().items()}

    def declare_params(self, b: CircuitBuilder) -> None:
        for name, (dtype, shape) in self.param_specs().items():
            b.param(name, dtype, shape)

    def bind(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Canonical checkpoint weights (moe_checkpoint_shapes' names, each optionally with its
        `_scale_inv`) -> the circuit's params. fp8 experts keep stored fp8 and scales (the gate
        and up halves must then split at a 128 block: moe_intermediate_size % 128 == 0) and
        quantise dense ones per block."""
        c, specs = self.config, self.param_specs()
        experts = range(c.n_routed_experts)
        stacked = {EXPERTS_GATE_UP: [[f"mlp.experts.{e}.gate_proj.weight", f"mlp.experts.{e}.up_proj.weight"] for e in experts],
                   EXPERTS_DOWN: [[f"mlp.experts.{e}.down_proj.weight"] for e in experts]}
        params = {k: _real(weights, k) for k in specs if k not in (*stacked, SHARED_GATE_UP, SHARED_DOWN)
                  and not k.endswith(SCALE) and k not in yarn_param_specs(c)}  # YaRN's table: computed
        params.update(yarn_params(c, params[GATE].device))
        if c.shared_intermediate_size:
            params[SHARED_GATE_UP] = torch.cat([_real(weights, f"mlp.shared_experts.{p}_proj.weight")
                                                for p in ("gate", "up")])
            params[SHARED_DOWN] = _real(weights, "mlp.shared_experts.down_proj.weight")
        for name, groups in stacked.items():
            stored = all(weights.get(k + SCALE) is not None and weights[k].dtype == torch.float8_e4m3fn
                         for g in groups for k in g)
            if self.fp8_experts and stored:
                if name == EXPERTS_GATE_UP and c.moe_intermediate_size % SCALE_BLOCK:
                    raise MoeWeightError(f"fp8 experts: moe_intermediate_size = {c.moe_intermediate_size} is "
                                         f"no multiple of {SCALE_BLOCK}, so gate and up scales cannot stack")
                params[name] = torch.stack([torch.cat([weights[k] for k in g]) for g in groups])
                params[name + SCALE] = torch.stack([torch.cat([weights[k + SCALE] for k in g]) for g in groups])
            else:
                params[name] = torch.stack([torch.cat([_real(weights, k) for k in g]) for g in groups])
                if self.fp8_experts:
                    params[name], params[name + SCALE] = quantize_blocks(params[name])
        return {k: params[k].to(dtype=getattr(torch, dt)).contiguous() for k, (dt, _) in specs.items()}

    def emit_mlp(self, b: CircuitBuilder, x: str) -> str:
        c = self.config
        attrs = {"top_k": c.num_experts_per_tok, "scoring_func": c.scoring_func, "n_group": c.n_group,
                 "topk_group": c.topk_group, "norm_topk_prob": c.norm_topk_prob,
                 "routed_scaling_factor": c.routed_scaling_factor, **({"norm_top1": True} if c.norm_top1 else {})}
        bias = BIAS if c.scoring_func == "sigmoid" else None
        ids, weights = b.op("moe_route", [x, GATE, bias], attrs, name="router")
        shared = [SHARED_GATE_UP, SHARED_DOWN] if c.shared_intermediate_size else []
        if self.fp8_experts:
            return b.op1("moe_experts_fp8", [x, ids, weights, EXPERTS_GATE_UP, EXPERTS_GATE_UP + SCALE,
                                             EXPERTS_DOWN, EXPERTS_DOWN + SCALE, *shared], name="experts")
        return b.op1("moe_experts", [x, ids, weights, EXPERTS_GATE_UP, EXPERTS_DOWN, *shared], name="experts")

    def plan_notes(self) -> dict[str, Any]:
        return {"moe": moe_plan_note(self.config)}

    def batch_refusal(self, n: int) -> str | None:
        """The reference engine's refusals of the grouped decode, checked before anything runs."""
        c = self.config
        if moe_ops.grouped_decode_switched_off():
            return f"grouped MoE decode switched off ({KILL_SWITCH}={os.environ[KILL_SWITCH]})"
        if c.routing_dtype == "float32":
            return "MoE routing configured in float32 (routing_dtype)"
        if c.expert_parallel_size > 1:
            return f"expert parallelism (expert_parallel_size={c.expert_parallel_size})"
        return None


def moe_plan_note(config: MoeConfig) -> dict[str, Any]:
    """For the plan report: each refusal, whether it is active now, and whether the n-row program
    could still serve the batch with another kernel (the proposer refuses all three regardless)."""
    k, e = config.num_experts_per_tok, config.n_routed_experts
    return {
        "op": "moe_experts", "grouped_kernel": "triton_moe_grouped", "num_experts": e, "top_k": k,
        "distinct_experts_estimate": "E * (1 - (1 - k/E)^n), uniform routing (a skewed router reads fewer)",
        "refusals": [
            {"reason": "kill_switch", "env": KILL_SWITCH, "active": moe_ops.grouped_decode_switched_off(),
             "n_row_program_serves": True, "kernel": "reference",
             "how": "planned with the switch set, moe_experts takes its reference: per row and slot "
                    "gathers (capturable, no host sync) that read each selected expert once per row"},
            {"reason": "fp32_routing", "active": config.routing_dtype == "float32",
             "n_row_program_serves": True, "kernel": "triton_moe_route_fp32_gate + triton_moe_grouped",
             "how": "routing is its own op: an fp32 gate over 16-bit rows takes moe_route's fp32-gate "
                    "kernel (the rows widened to fp32, then the fp32 linear); "
                    "the grouped expert kernel only reads ids and weights"},
            {"reason": "expert_parallel", "active": config.expert_parallel_size > 1,
             "n_row_program_serves": False, "kernel": None,
             "how": "experts sharded across ranks need an all_to_all or all_reduce the op "
                    "vocabulary does not have yet; each sequence drafts alone"},
        ],
    }
