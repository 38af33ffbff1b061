"""MoE ops: `moe_route` (DeepSeek-V3 sigmoid group-limited routing, or softmax top-k), `moe_experts`
(selected experts' SwiGLU MLPs plus shared experts), `moe_experts_fp8` (fp8 e4m3 experts, 128x128
block scales). References are the oracles; each op's Triton binding is declared beside it."""
from __future__ import annotations

import math
import os
from functools import partial
from typing import Any, Literal, Sequence

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field

from draft_circuit.circuit.types import TensorSpec
from draft_circuit.ops.basic import linear_ref
from draft_circuit.ops.bindings import (aten_kernels, CUDA, KERNEL_FLOATS, TRITON, Applies, Condition, KernelBinding, Scratch,
                                        Tensors, kernel)
from draft_circuit.ops.registry import (GATHER, MATMUL, REDUCTION, Cost, CostContext, Env, OpDef, Specs, check,
                                        default_cost, dim_eq, rank, register)

FP8 = "float8_e4m3fn"
SCALE_BLOCK = 128  # DeepSeek-V3's weight_scale_inv blocks: real weight = fp8 * scale of its block
FLOATS = ("float32", "float16", "bfloat16")  # what activations may be (fp8 is a weight format)
KILL_SWITCH = "CIRCUIT_NO_GROUPED_MOE_DECODE"


def grouped_decode_switched_off() -> bool:
    """CIRCUIT_NO_GROUPED_MOE_DECODE set to anything but '' or '0'."""
    return os.environ.get(KILL_SWITCH, "0") not in ("", "0")


# ---- routing ----
class MoeRouteAttrs(BaseModel):
    """scoring_func "sigmoid" (DeepSeek-V3, GLM-4.5): select on sigmoid scores + bias, limited to
    the topk_group of n_group groups with the largest top-2 sums; "softmax": plain top-k of the
    softmax (n_group must be 1). Weights: the unbiased scores of the chosen experts, divided by
    their sum when norm_topk_prob and top_k > 1 (or at top_k == 1 too with norm_top1: GLM-4.5,
    as transformers' Glm4MoeTopkRouter; DeepSeek-V3 skips it), times routed_scaling_factor."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    top_k: int = Field(ge=1)
    scoring_func: Literal["sigmoid", "softmax"] = "sigmoid"
    n_group: int = Field(1, ge=1)
    topk_group: int = Field(1, ge=1)
    norm_topk_prob: bool = True
    routed_scaling_factor: float = Field(1.0, gt=0)
    norm_top1: bool = False

    def model_post_init(self, _: object) -> None:
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group {self.topk_group} exceeds n_group {self.n_group}")
        if self.scoring_func == "softmax" and self.n_group != 1:
            raise ValueError("group-limited routing is sigmoid routing's; softmax takes n_group=1")


def _infer_route(ins: list[TensorSpec], a: MoeRouteAttrs) -> list[TensorSpec]:
    x, gate = ins[:2]
    rank(x, 2, "moe_route x [n, H]")
    rank(gate, 2, "moe_route gate_weight [E, H]")
    check(x.dtype in FLOATS, lambda: f"moe_route x must be a float, got {x}")
    check(gate.dtype in (x.dtype, "float32"),
          lambda: f"gate_weight {gate} must be x's dtype {x.dtype} or float32 (fp32 routing)")
    dim_eq(x.shape[1], gate.shape[1], f"moe_route hidden size ({x} vs gate_weight {gate})")
    num_experts = int(gate.shape[0])
    if len(ins) > 2:
        check(a.scoring_func == "sigmoid", lambda: "e_score_correction_bias is for sigmoid routing")
        check(ins[2].dtype == "float32" and ins[2].shape == (num_experts,),
              lambda: f"e_score_correction_bias must be float32[{num_experts}], got {ins[2]}")
    check(num_experts % a.n_group == 0, lambda: f"n_group {a.n_group} must divide {num_experts} experts")
    group = num_experts // a.n_group
    check(a.n_group == 1 or group >= 2, lambda: f"groups of {group} expert: a group scores its top 2")
    check(a.top_k <= a.topk_group * group,
          lambda: f"top_k {a.top_k} exceeds the {a.topk_group} kept groups of {group} experts")
    return [TensorSpec(dtype=dt, shape=(x.shape[0], a.top_k)) for dt in ("int32", "float32")]


def topk_lowest_id(values: torch.Tensor, k: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Indices (int64) of the k largest entries along the last dim, largest first; bitwise-equal
    values go to the lowest index; entries where `keep` is False are never chosen while others
    remain. Each entry gets a unique int64 key, so torch.topk's own tie order never matters."""
    bits = values.float().contiguous().view(torch.int32).to(torch.int64)
    ordered = torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # int order == IEEE float order
    size = values.shape[-1]
    idx = torch.arange(size, device=values.device, dtype=torch.int64)
    key = ordered * 2**32 + (size - 1 - idx)
    if keep is not None:
        key = key.masked_fill(~keep, torch.iinfo(torch.int64).min)
    return key.topk(k, dim=-1).indices


def _scores(logits: torch.Tensor, scoring_func: str) -> torch.Tensor:
    """sigmoid or softmax of the router's logits. On CPU each row is its own call: a vectorised
    transcendental's main loop and its scalar tail give other bits for the same value (seen on an
    AVX2 machine: a row's routing weights alone differed from the same row's in a batch of 4),
    so a row's scores would depend on where it sits in the batch. A CUDA kernel computes every
    element alike, so there it is one call."""
    def score(t: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(t) if scoring_func == "sigmoid" else torch.softmax(t, dim=-1)
    if logits.device.type != "cpu":
        return score(logits)
    return torch.stack([score(row) for row in logits]) if logits.shape[0] else score(logits)


def route_select(logits: torch.Tensor, bias: torch.Tensor | None,
                 a: MoeRouteAttrs) -> tuple[torch.Tensor, torch.Tensor]:
    """logits f32[n, E] -> (topk_ids i32[n, k], topk_weights f32[n, k]), ids by descending
    selection score. Masked groups are -inf (DeepSeek-V3's inference code), not HF's 0.0."""
    n, num_experts = logits.shape
    scores = _scores(logits, a.scoring_func)
    choice = scores + bias if bias is not None else scores
    keep = None
    if a.n_group > 1:
        top2 = choice.view(n, a.n_group, -1).topk(2, dim=-1).values  # values only: ties harmless
        groups = topk_lowest_id(top2[..., 0] + top2[..., 1], a.topk_group)
        keep = torch.zeros(n, a.n_group, dtype=torch.bool, device=logits.device).scatter_(1, groups, True)
        keep = keep[:, :, None].expand(n, a.n_group, num_experts // a.n_group).reshape(n, num_experts)
    ids = topk_lowest_id(choice, a.top_k, keep)
    weights = scores.gather(1, ids)
    if a.norm_topk_prob and (a.top_k > 1 or a.norm_top1):
        total = weights[:, 0]
        for j in range(1, a.top_k):  # a fixed order, so a row's bits never depend on the batch
            total = total + weights[:, j]
        weights = weights / (total + 1e-20).unsqueeze(1)
    return ids.to(torch.int32), weights * a.routed_scaling_factor


def _route(t: list[torch.Tensor], a: Any) -> tuple[torch.Tensor, torch.Tensor]:
    # fp32 logits, row-invariant (linear_ref), from an fp32 gate when routing is configured in fp32
    logits = linear_ref(t[0].to(t[1].dtype), t[1], torch.float32)
    return route_select(logits, t[2] if len(t) > 2 else None, a)


_k_linear = kernel("linear", "linear")


def _route_launch(ins: Tensors, outs: Tensors, ws: Tensors, a: MoeRouteAttrs) -> None:
    _k_linear()(ins[0], ins[1], ws[0])  # fp32 logits, one launch
    ids, weights = route_select(ws[0], ins[2] if len(ins) > 2 else None, a)  # exact ops
    outs[0].copy_(ids)
    outs[1].copy_(weights)


def _route_launches(ins: Sequence[TensorSpec], a: Any) -> int:
    """The logits' linear, route_select's torch kernels (counted on meta tensors) and the two
    copies into the outputs."""
    experts = int(ins[1].shape[0])
    logits = torch.empty(2, experts, device="meta")
    bias = torch.empty(experts, device="meta") if len(ins) > 2 else None
    return 1 + aten_kernels(lambda: route_select(logits, bias, a)) + 2


def _route_fp32_gate_launch(ins: Tensors, outs: Tensors, ws: Tensors, a: MoeRouteAttrs) -> None:
    """An fp32 gate over 16-bit x (GLM-4.5's router, transformers' _keep_in_fp32_modules): x
    widened to fp32 (exact) in a workspace, then the fp32 linear, as the reference computes it."""
    ws[1].copy_(ins[0])
    _route_launch([ws[1], *ins[1:]], outs, ws[:1], a)


register(OpDef(
    name="moe_route", inputs=("x", "gate_weight", "e_score_correction_bias"),
    outputs=("topk_ids", "topk_weights"), attrs=MoeRouteAttrs, num_required=2,
    infer=_infer_route, reference=_route, tags=frozenset({MATMUL, REDUCTION}),
    cost=lambda ins, outs, a, ctx, env: default_cost(
        ins, outs, env, flops=2 * math.prod(ins[0].concrete(env)) * int(ins[1].shape[0])),
    # a gate in x's dtype; an fp32 gate over 16-bit x: x widened first (one more launch)
    kernels=(KernelBinding("triton_moe_route", _route_launch, Applies(TRITON, conditions=(
        Condition("gate_weight in x's dtype", lambda ins, a: ins[1].dtype == ins[0].dtype),)),
        workspace=lambda ins, env, a: [("float32", (ins[0].concrete(env)[0], int(ins[1].shape[0])))],
        launches=_route_launches),
        KernelBinding("triton_moe_route_fp32_gate", _route_fp32_gate_launch, Applies(TRITON, conditions=(
            Condition("an fp32 gate_weight over 16-bit x", lambda ins, a: ins[1].dtype == "float32" != ins[0].dtype),)),
            workspace=lambda ins, env, a: [("float32", (ins[0].concrete(env)[0], int(ins[1].shape[0]))),
                                           ("float32", tuple(ins[0].concrete(env)))],
            launches=lambda ins, a: 1 + _route_launches(ins, a))),
))


# ---- experts ----
def expand_block_scales(scale: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """[.., ceil(R/128), ceil(C/128)] block scales -> [.., R, C], one per weight element."""
    *lead, rows, cols = scale.shape  # expand, not repeat_interleave: no host sync under capture
    full = scale[..., :, None, :, None].expand(*lead, rows, SCALE_BLOCK, cols, SCALE_BLOCK)
    return full.reshape(*lead, rows * SCALE_BLOCK, cols * SCALE_BLOCK)[..., :shape[-2], :shape[-1]]


def dequantize_blocks(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 real weights of a block-scaled (fp8) weight."""
    return weight.float() * expand_block_scales(scale.float(), weight.shape)


def _swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One row through one expert in fp32; the activation rounds to x's dtype (as HF and the kernel
    do) before the down projection."""
    g, u = torch.mv(gate_up, x).chunk(2)
    return torch.mv(down, (F.silu(g) * u).to(dtype).float())


def _expert(w: torch.Tensor, scale: torch.Tensor | None, e: torch.Tensor) -> torch.Tensor:
    we = w.index_select(0, e)[0]  # a device-side gather: no host sync, so capturable
    return dequantize_blocks(we, scale.index_select(0, e)[0]) if scale is not None else we.float()


def experts_ref(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, shared: Sequence[torch.Tensor] = (),
                scales: Sequence[torch.Tensor | None] = (None, None)) -> torch.Tensor:
    """Row by row, in fp32: acc = 0; acc += w[i, j] * expert_{ids[i, j]}(x[i]) for j = 0..k-1
    (an id outside [0, E) adds nothing); acc += shared(x[i]); rounded once to x's dtype."""
    num_experts = gate_up.shape[0]
    shared_f = [w.float() for w in shared]
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        xi = x[i].float()
        acc = torch.zeros(x.shape[1], dtype=torch.float32, device=x.device)
        for j in range(ids.shape[1]):
            e = ids[i, j].long()
            ec = e.clamp(0, num_experts - 1).view(1)
            y = _swiglu(xi, _expert(gate_up, scales[0], ec), _expert(down, scales[1], ec), x.dtype)
            acc = torch.where((e >= 0) & (e < num_experts), acc + weights[i, j] * y, acc)
        if shared_f:
            acc = acc + _swiglu(xi, shared_f[0], shared_f[1], x.dtype)
        out[i] = acc.to(x.dtype)
    return out


def _parts(ins: Sequence[Any], fp8: bool) -> tuple[Any, ...]:
    """(x, ids, weights, w_gate_up, its scales, w_down, its scales, shared) of either op's inputs."""
    return (*ins[:7], tuple(ins[7:])) if fp8 else (*ins[:4], None, ins[4], None, tuple(ins[5:]))


def _infer_experts(ins: list[TensorSpec], a: Any, *, fp8: bool) -> list[TensorSpec]:
    x, ids, w, gu, gus, down, downs, shared = _parts(ins, fp8)
    rank(x, 2, "x [n, H]")
    check(x.dtype in FLOATS, lambda: f"x must be a float, got {x}")
    check(ids.dtype == "int32" and len(ids.shape) == 2, lambda: f"topk_ids must be int32[n, k], got {ids}")
    check(w.dtype == "float32" and w.shape == ids.shape,
          lambda: f"topk_weights must be float32{list(ids.shape)}, got {w}")
    dim_eq(ids.shape[0], x.shape[0], f"topk_ids rows ({ids} vs x {x})")
    rank(gu, 3, "w_gate_up [E, 2I, H]")
    num_experts, two_i, hidden = gu.shape
    check(two_i % 2 == 0, lambda: f"w_gate_up {gu}: 2I must be even (gate rows, then up rows)")
    dim_eq(hidden, x.shape[1], f"w_gate_up hidden size ({gu} vs x {x})")
    check(down.shape == (num_experts, hidden, two_i // 2),
          lambda: f"w_down must be [{num_experts}, {hidden}, {two_i // 2}], got {down}")
    want = FP8 if fp8 else x.dtype
    check(gu.dtype == want and down.dtype == want,
          lambda: f"expert weights must be {want}, got w_gate_up {gu}, w_down {down}")
    for name, wt, sc in (("w_gate_up", gu, gus), ("w_down", down, downs)) if fp8 else ():
        blocks = (num_experts, *(math.ceil(d / SCALE_BLOCK) for d in wt.shape[1:]))
        check(sc.dtype == "float32" and sc.shape == blocks,
              lambda: f"{name}_scale_inv must be float32{list(blocks)}, got {sc}")
    check(len(shared) != 1, lambda: "shared_gate_up and shared_down come together")
    if shared:
        sgu, sd = shared
        check(len(sgu.shape) == 2 and sgu.shape[1] == hidden and sgu.shape[0] % 2 == 0
              and sd.shape == (hidden, sgu.shape[0] // 2) and sgu.dtype == sd.dtype == x.dtype,
              lambda: f"shared experts must be {x.dtype}[2Is, {hidden}] and [{hidden}, Is], got "
                      f"{sgu} and {sd}")
    return [x]


def expected_distinct_experts(num_experts: int, top_k: int, n: int) -> float:
    """E * (1 - (1 - k/E)^n): distinct experts n rows select when each picks k of E uniformly
    (a skewed router selects fewer, so this is the high end of the estimate)."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** n)


def _experts_cost(ins: Specs, outs: Specs, a: Any, ctx: CostContext, env: Env, *, fp8: bool) -> Cost:
    """Bytes of the experts expected to be selected (expected_distinct_experts), plus the shared
    experts and the row operands; flops of the k routed and the shared SwiGLUs a row runs."""
    x, ids, w, gu, gus, down, downs, shared = _parts(ins, fp8)
    n, hidden = x.concrete(env)
    num_experts, two_i, _ = gu.shape
    per_expert = sum(s.nbytes(env) for s in (gu, gus, down, downs) if s is not None) // num_experts
    distinct = expected_distinct_experts(num_experts, int(ids.shape[1]), n)
    read = round(distinct * per_expert) + sum(s.nbytes(env) for s in (x, ids, w, *shared))
    shared_i = int(shared[0].shape[0]) // 2 if shared else 0
    flops = 2 * n * hidden * 3 * (int(ids.shape[1]) * two_i // 2 + shared_i)
    return Cost(read, outs[0].nbytes(env), flops)


def _experts(t: list[torch.Tensor], a: Any, *, fp8: bool) -> tuple[torch.Tensor]:
    x, ids, w, gu, gus, down, downs, shared = _parts(t, fp8)
    return (experts_ref(x, ids, w, gu, down, shared, (gus, downs)),)


# ---- kernels ----
_k_grouped = kernel("moe_grouped", "moe_grouped")
_k_grouped_ws = kernel("moe_grouped", "moe_grouped_workspace")


def _experts_launch(ins: Tensors, outs: Tensors, ws: Tensors, a: Any, *, fp8: bool) -> None:
    x, ids, w, gu, gus, down, downs, shared = _parts(ins, fp8)
    _k_grouped()(x, ids, w, gu, down, outs[0], ws, gate_up_scale=gus, down_scale=downs,
               shared_gate_up=shared[0] if shared else None, shared_down=shared[1] if shared else None)


def _experts_ws(ins: Sequence[TensorSpec], env: Env, a: Any, *, fp8: bool) -> Scratch:
    x, ids, _, gu, _, _, _, shared = _parts(ins, fp8)
    scratch: Scratch = _k_grouped_ws()(
        x.concrete(env)[0], int(ids.shape[1]), int(gu.shape[0]), int(x.shape[1]), int(gu.shape[1]) // 2,
        int(shared[0].shape[0]) // 2 if shared else 0, x.dtype)
    return scratch


def _experts_launches(ins: Sequence[TensorSpec], a: Any, *, fp8: bool) -> int:
    """kernels.moe_grouped: align, the routed gate_up and down, (the shared gate_up and down),
    combine."""
    return 6 if _parts(list(ins), fp8)[-1] else 4


# read when a program is planned: planned with the switch set, the experts take the reference
SWITCHED_ON = Condition(f"grouped MoE decode not switched off ({KILL_SWITCH})",
                        lambda ins, a: not grouped_decode_switched_off())
# triton_moe_grouped: bf16/fp16/fp32 experts on CUDA and the interpreter, fp8 ones on CUDA only
GROUPED = {False: Applies(TRITON, conditions=(SWITCHED_ON,)),
           True: Applies(CUDA, floats=KERNEL_FLOATS | {FP8}, conditions=(SWITCHED_ON,))}

for _fp8, _name, _weights in ((False, "moe_experts", ("w_gate_up", "w_down")),
                              (True, "moe_experts_fp8", ("w_gate_up", "w_gate_up_scale_inv",
                                                         "w_down", "w_down_scale_inv"))):
    register(OpDef(
        name=_name, inputs=("x", "topk_ids", "topk_weights", *_weights, "shared_gate_up", "shared_down"),
        outputs=("out",), num_required=3 + len(_weights),
        infer=partial(_infer_experts, fp8=_fp8), reference=partial(_experts, fp8=_fp8),
        cost=partial(_experts_cost, fp8=_fp8), tags=frozenset({MATMUL, GATHER}),
        kernels=(KernelBinding("triton_moe_grouped", partial(_experts_launch, fp8=_fp8), GROUPED[_fp8],
                               workspace=partial(_experts_ws, fp8=_fp8),
                               launches=partial(_experts_launches, fp8=_fp8)),),
    ))
