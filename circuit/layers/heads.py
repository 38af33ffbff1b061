"""The draft head a checkpoint describes, one rule for every caller (`circuit plan`, the engine):
`MoeMtpHead` when the MTP layer's MLP is a MoE (its config names an expert count), with fp8
experts when every routed expert is stored fp8 e4m3 beside its block scales; `Qwen3NextMtpHead`
for a Qwen3-Next checkpoint's `mtp.*` layer; `Eagle3Head` for an
EAGLE-3 drafter (config.json names `LlamaForCausalLMEagle3`); else `MtpHead`.
"""
from __future__ import annotations

import os

import torch

from draft_circuit.circuit.layers.checkpoint import load_mtp_weights
from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.eagle3 import Eagle3Config, Eagle3Head
from draft_circuit.circuit.layers.eagle3_checkpoint import is_eagle3_checkpoint, load_eagle3_weights
from draft_circuit.circuit.layers.deepseek import DeepseekMtpHead
from draft_circuit.circuit.layers.mla import MlaConfig
from draft_circuit.circuit.layers.moe import SCALE, MoeConfig, MoeMtpHead
from draft_circuit.circuit.layers.mtp import MtpHead
from draft_circuit.circuit.layers.qwen3_next import Qwen3NextMtpConfig, Qwen3NextMtpHead
from draft_circuit.ops.moe import SCALE_BLOCK

__all__ = ["head_for", "load_head", "describe_head"]


def _fp8_experts(config: MoeConfig, weights: dict[str, torch.Tensor]) -> bool:
    names = [f"mlp.experts.{e}.{p}_proj.weight" for e in range(config.n_routed_experts)
             for p in ("gate", "up", "down")]
    return all(n in weights and weights[n].dtype == torch.float8_e4m3fn and n + SCALE in weights
               for n in names)


def _fp8_projections(config: MlaConfig, weights: dict[str, torch.Tensor]) -> bool:
    q = ("q_a_proj", "q_b_proj") if config.q_lora_rank is not None else ("q_proj",)
    names = [f"self_attn.{p}.weight" for p in (*q, "kv_a_proj_with_mqa", "o_proj")]
    return all(n in weights and weights[n].dtype == torch.float8_e4m3fn and n + SCALE in weights
               for n in names)


def head_for(config: MtpConfig, dtype: str = "float32",
             weights: dict[str, torch.Tensor] | None = None) -> MtpHead:
    """`weights` (canonical names, as `load_mtp_weights(keep_fp8=True)` gives them) decide
    whether the experts stay fp8; without them a MoE head's experts are in `dtype`."""
    if isinstance(config, Eagle3Config):
        return Eagle3Head(config, dtype)
    if isinstance(config, MlaConfig):
        # DeepSeek-V3: what is stored fp8 stays fp8; experts only where gate and up stack at a
        # 128 scale block (else they are dequantised: the MoE kernel takes one scale per block)
        stack = config.moe_intermediate_size % SCALE_BLOCK == 0
        return DeepseekMtpHead(config, dtype,
                               fp8_experts=weights is not None and stack and _fp8_experts(config, weights),
                               fp8_dense=weights is not None and _fp8_projections(config, weights))
    if isinstance(config, Qwen3NextMtpConfig):
        return Qwen3NextMtpHead(config, dtype)
    if isinstance(config, MoeConfig):
        return MoeMtpHead(config, dtype, fp8_experts=weights is not None and _fp8_experts(config, weights))
    return MtpHead(config, dtype)


def load_head(path: str | os.PathLike[str], dtype: str = "float32", *, device: str | torch.device = "cpu",
              strict: bool = False, target_embed: torch.Tensor | None = None) -> tuple[MtpHead, dict[str, torch.Tensor]]:
    """The checkpoint's MTP layer (or EAGLE-3 drafter), loaded (every refusal applied) and its
    head chosen; the weights are the head's `bind` input (a MoE head dequantises what it keeps in
    `dtype`). `target_embed`: the target's embedding, for an EAGLE-3 drafter stored without one."""
    torch_dtype = getattr(torch, dtype)
    if is_eagle3_checkpoint(path):
        econfig, eweights = load_eagle3_weights(path, dtype=torch_dtype, device=device, strict=strict,
                                                target_embed=target_embed)
        return Eagle3Head(econfig, dtype), eweights
    config, weights = load_mtp_weights(path, dtype=torch_dtype, device=device, strict=strict,
                                       keep_fp8=True)
    head = head_for(config, dtype, weights)
    if not isinstance(head, MoeMtpHead) and any(w.dtype == torch.float8_e4m3fn for w in weights.values()):
        # the dense head's bind only casts: give it the weights dequantised at load
        _, weights = load_mtp_weights(path, config, dtype=torch_dtype, device=device, strict=strict)
    return head, weights


def describe_head(head: MtpHead) -> str:
    """One line for people: which head, its MLP, its dtype."""
    if isinstance(head, Eagle3Head):
        c3 = head.config
        return (f"Eagle3Head: fc over 3 x {c3.target_hidden_size} tapped hiddens, draft vocabulary "
                f"{c3.draft_vocab_size} of {c3.vocab_size}, {head.dtype}")
    if isinstance(head, DeepseekMtpHead):
        d = head.config
        stored = ", fp8 projections" if head.fp8_dense else ""
        return (f"DeepseekMtpHead: MLA (kv_lora_rank {d.kv_lora_rank}, rope {d.qk_rope_head_dim}, "
                f"{d.rope.rope_type}), {d.n_routed_experts} experts, top-{d.num_experts_per_tok}, "
                f"{'fp8 e4m3' if head.fp8_experts else head.dtype} experts{stored}, {head.dtype}")
    if isinstance(head, Qwen3NextMtpHead):
        q = head.config
        return (f"Qwen3NextMtpHead: gated attention, {q.num_experts} experts, top-{q.num_experts_per_tok}, "
                f"softmax routing, 1 gated shared expert, {head.dtype}{_attention(q)}")
    if isinstance(head, MoeMtpHead):
        c = head.config
        experts = "fp8 e4m3 experts" if head.fp8_experts else f"{head.dtype} experts"
        return (f"MoeMtpHead: {c.n_routed_experts} experts, top-{c.num_experts_per_tok}, "
                f"{c.n_shared_experts} shared, {c.scoring_func} routing, {experts}{_attention(c)}")
    return f"MtpHead: dense SwiGLU MLP, {head.dtype}{_attention(head.config)}"


def _attention(c: MtpConfig) -> str:
    """The family options of the attention and its RoPE scaling, where any is set (nothing for
    Llama's with default RoPE)."""
    yarn = c.rope_scaling
    parts = [what for on, what in ((c.qkv_bias, "q/k/v bias"), (c.qk_norm, "q/k norm"),
                                   (c.rotary_dim != c.head_dim, f"rotary {c.rotary_dim} of {c.head_dim} dims"),
                                   (yarn is not None, f"YaRN x{yarn.factor if yarn else 0:g} over "
                                                      f"{yarn.original_max_position_embeddings if yarn else 0}"))
             if on]
    return "".join(f", {p}" for p in parts)
