"""The family table, as data: each architecture / `model_type` the loader knows, its drafter
layout, what loads, what runs (target, drafter), what is refused and why. `check_family` applies
it to a raw config.json: a family not in the table, a family that cannot run, or a field set to a
value that changes the math in a way the head does not implement raises an
`UnsupportedConfigError` naming the field, the architecture and the file. README's "Supported
architectures" section is `markdown_table()`, checked equal by a test.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Mapping

from draft_circuit.circuit.layers.config import ConfigError
from draft_circuit.circuit.layers.family_options import (OptionReader, glm4_moe_options, no_options,
                                                         qwen2_options, qwen3_next_options, qwen3_options)

__all__ = ["UnsupportedConfigError", "UnsupportedArchitectureError", "FieldRule", "Family",
           "FAMILIES", "check_family", "family_label", "markdown_table"]

_MISSING = object()


class UnsupportedConfigError(ConfigError):
    """A config field changes the math to something the head does not implement."""


class UnsupportedArchitectureError(UnsupportedConfigError):
    """The architecture / model_type is not in the family table, or is but cannot run."""


@dataclass(frozen=True)
class FieldRule:
    """`field` (dotted into nested objects) must be one of `allowed`; absent means `default`,
    the value the family's transformers config class assumes."""

    field: str
    allowed: tuple[Any, ...]
    default: Any
    why: str

    def value(self, d: Mapping[str, Any]) -> Any:
        cur: Any = d
        for part in self.field.split("."):
            if not isinstance(cur, Mapping) or cur.get(part) is None:
                return self.default
            cur = cur[part]
        return cur

    def violated(self, d: Mapping[str, Any]) -> bool:
        v = self.value(d)
        v = tuple(v) if isinstance(v, list) else v  # JSON arrays; `allowed` holds tuples (hashable)
        # `True == 1` in Python: a bool field must be a bool, not an int that compares equal
        return not any(v == a and type(v) is type(a) or (_number(v) and _number(a) and v == a)
                       for a in self.allowed)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass(frozen=True)
class Family:
    """One row of the table. `blocked` non-empty: the family is known but cannot run; each entry
    names the tensors / fields and the op or layer the project lacks."""

    model_type: str
    architectures: tuple[str, ...]
    drafter: str    # the MTP layer's layout, by its real names
    loads: str
    target: str     # what runs as the engine's target
    runs: str       # what runs as the drafter
    rules: tuple[FieldRule, ...] = ()
    blocked: tuple[str, ...] = ()
    options: OptionReader = no_options  # config.json -> MtpConfig's attention options

    def config_options(self, d: Mapping[str, Any], source: str = "config") -> dict[str, Any]:
        """The attention options this family's config.json sets (family_options.py)."""
        try:
            return self.options(d)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e} ({family_label(d)})") from None

    @property
    def refused(self) -> tuple[str, ...]:
        """`blocked`, then the rules grouped by reason: `a`, `b` other than x: why."""
        by_why: dict[str, list[FieldRule]] = {}
        for r in self.rules:
            by_why.setdefault(r.why, []).append(r)
        return self.blocked + tuple(
            f"{', '.join(f'`{r.field}`' for r in rules)} other than "
            f"{' / '.join(json.dumps(a) for a in rules[0].allowed)}: {why}" for why, rules in by_why.items())


_NO_BIAS = ("the head's only biases are q/k/v's (Qwen2's, GLM-4.5's): o_proj and the MLP have "
            "none")
_ROPE = "the rope op is default RoPE (no scaling)"
_SLIDING = "attention is full causal over the drafter's rows (no sliding window)"
# Fields every runnable family reads the same way (transformers' Llama semantics).
_COMMON = (
    FieldRule("hidden_act", ("silu",), "silu", "the MLP is SwiGLU (silu_mul)"),
    FieldRule("rope_parameters.rope_type", ("default",), "default", _ROPE),
    FieldRule("rope_scaling.rope_type", ("default",), "default", _ROPE),
    FieldRule("rope_scaling.type", ("default",), "default", _ROPE),
)
_TENSORS = ("any tensor inside a module the head runs that it has no use for (a `.bias`, "
            "`self_attn.q_norm` / `k_norm`, an MoE gate under a dense MLP): it changes that "
            "module's math")
_MTP_NAMES = "DeepSeek-V3 MTP names (as for `llama`)"
_EAGLE3_NO_BIAS = "the EAGLE-3 head's projections (`fc`, q/k/v, o, the MLP) have no bias"
_DS_ROPE = "the rope is default RoPE or YaRN (rope_freqs over YaRN's frequencies, mscale in the softmax)"
_GQA_ROPE = ("the rope is default RoPE or YaRN (rope_freqs over YaRN's frequencies and attention factor: "
             "the dense and MoE heads and the engine's target)")
_QWEN3_NEXT_MOE = ("vLLM and SGLang build `mtp.layers.0` at layer index 0, a MoE layer only when "
                   "(0 + 1) % decoder_sparse_step == 0: the head's MLP is the MoE")
_DS_ROUTING = "routing is DeepSeek-V3's: sigmoid scores plus `e_score_correction_bias`, group-limited top-k"

FAMILIES: tuple[Family, ...] = (
    Family(
        "llama", ("LlamaForCausalLM",),
        drafter="DeepSeek-V3 MTP names: `embed_tokens`, `enorm`, `hnorm`, `eh_proj`, the decoder "
                "block, `shared_head.norm`, `shared_head.head` under `model.layers.{num_hidden_layers}.` "
                "(or `model.layers.0.` exported alone); Llama block; MLP dense SwiGLU, or MoE when "
                "config.json names an expert count (`mlp.gate`, `e_score_correction_bias`, "
                "`mlp.experts.{e}.*`, `mlp.shared_experts.*`, bf16 or fp8 with `weight_scale_inv`)",
        loads="target: `model.embed_tokens`, `model.layers.{l}`, `model.norm`, `lm_head` (tied or "
              "not); MTP layer, its embed / head falling back to the target's",
        target="yes: dense Llama (examples/engine)", runs="yes: `MtpHead` (dense), `MoeMtpHead` (MoE)",
        rules=_COMMON[:1] + tuple(FieldRule(f, ("default", "yarn"), "default", _GQA_ROPE) for f in (
            "rope_parameters.rope_type", "rope_scaling.rope_type", "rope_scaling.type")) + (
            FieldRule("attention_bias", (False,), False, _NO_BIAS),
            FieldRule("mlp_bias", (False,), False, _NO_BIAS),
        ),
    ),
    Family(
        "deepseek_v3", ("DeepseekV3ForCausalLM",),
        drafter=f"{_MTP_NAMES}; MLA block (`self_attn.q_a_proj`, `q_a_layernorm`, `q_b_proj`, or "
                "`q_proj` when `q_lora_rank` is null; `kv_a_proj_with_mqa`, `kv_a_layernorm`, "
                "`kv_b_proj`, `o_proj`); MoE MLP; bf16, or fp8 e4m3 beside `weight_scale_inv`",
        loads="target: `model.embed_tokens`, `model.layers.{l}` (MLA; dense MLP below "
              "`first_k_dense_replace`, MoE from it), `model.norm`, `lm_head`; MTP layer at "
              "`model.layers.{num_hidden_layers}`, its embed / head falling back to the target's",
        target="yes: MLA + MoE layers from the layer library (circuit/layers/deepseek.py)",
        runs="yes: `DeepseekMtpHead` (absorbed MLA decode over paged latent pools, YaRN, MoE; fp8 "
             "projections and experts kept fp8)",
        rules=(
            FieldRule("hidden_act", ("silu",), "silu", "the MLP is SwiGLU (silu_mul)"),
            *(FieldRule(f, ("default", "yarn"), "default", _DS_ROPE)
              for f in ("rope_parameters.rope_type", "rope_scaling.rope_type", "rope_scaling.type")),
            FieldRule("attention_bias", (False,), False, "MLA's projections have no bias"),
            FieldRule("scoring_func", ("sigmoid",), "sigmoid", _DS_ROUTING),
            FieldRule("topk_method", ("noaux_tc",), "noaux_tc",
                      "experts are chosen on scores plus `e_score_correction_bias` (noaux_tc)"),
            FieldRule("moe_layer_freq", (1,), 1, "every layer from `first_k_dense_replace` on is MoE"),
            FieldRule("ep_size", (1,), 1, "experts are not sharded across ranks (no cross-rank combine op)"),
            FieldRule("quantization_config.quant_method", ("fp8",), "fp8",
                      "a quantised weight is fp8 beside its `weight_scale_inv`"),
            FieldRule("quantization_config.fmt", ("e4m3",), "e4m3", "fp8 weights are e4m3"),
            FieldRule("quantization_config.weight_block_size", ((128, 128),), (128, 128),
                      "a block scale covers 128x128 weights"),
            FieldRule("quantization_config.activation_scheme", ("dynamic",), "dynamic",
                      "activations stay in the head's dtype (weight-only fp8): there are no static "
                      "activation scales to apply"),
        ),
    ),
    Family(
        "qwen2", ("Qwen2ForCausalLM",),
        drafter=f"{_MTP_NAMES}; Qwen2 block: q/k/v with biases (`self_attn.{{q,k,v}}_proj.bias`, "
                "always: Qwen2Attention has no flag); MLP dense SwiGLU",
        loads="as for `llama`, plus each layer's q/k/v biases",
        target="yes: examples/engine (the dense target with its q/k/v biases)",
        runs="yes: `MtpHead` (`qkv_bias`)",
        rules=_COMMON + (FieldRule("use_sliding_window", (False,), False, _SLIDING),),
        options=qwen2_options,
    ),
    Family(
        "qwen3", ("Qwen3ForCausalLM",),
        drafter=f"{_MTP_NAMES}; Qwen3 block: per-head RMSNorm of q and k before RoPE "
                "(`self_attn.q_norm.weight`, `self_attn.k_norm.weight`, [head_dim]); MLP dense SwiGLU",
        loads="as for `llama`, plus each layer's q/k norms",
        target="yes: examples/engine (the dense target with its q/k norms)",
        runs="yes: `MtpHead` (`qk_norm`)",
        rules=_COMMON + (FieldRule("attention_bias", (False,), False, _NO_BIAS + " (Qwen3's flag "
                                   "biases o_proj too)"),
                         FieldRule("use_sliding_window", (False,), False, _SLIDING)),
        options=qwen3_options,
    ),
    Family(
        "glm4_moe", ("Glm4MoeForCausalLM",),
        drafter=f"{_MTP_NAMES} (`num_nextn_predict_layers`); GLM-4.5 block; MoE MLP (sigmoid "
                "routing, `e_score_correction_bias`, shared experts)",
        loads="the MTP layer at `model.layers.{num_hidden_layers}`: `enorm`, `hnorm`, `eh_proj`, "
              "`shared_head.*` (embed / head falling back to the target's), q/k/v biases iff "
              "`attention_bias`, `self_attn.{q,k}_norm` iff `use_qk_norm`, `mlp.gate` (read fp32), "
              "`e_score_correction_bias`, `mlp.experts.{e}.*`, `mlp.shared_experts.*`",
        target="yes: examples/engine/glm_target.py (`first_k_dense_replace` dense layers, then MoE "
               "layers: the fp32 sigmoid router with `e_score_correction_bias`, routed and shared experts)",
        runs="yes: `MoeMtpHead` (partial rotary from `rope_parameters.partial_rotary_factor` or the "
             "top-level field, 0.5 absent; fp32 gate; weights normalised at top_k 1 too, as "
             "transformers). Position 0's embedding is not zeroed as in vLLM: the engine never drafts there",
        rules=_COMMON,
        options=glm4_moe_options,
    ),
    Family(
        "qwen3_next", ("Qwen3NextForCausalLM",),
        drafter="its own MTP names (vLLM's / SGLang's qwen3_next_mtp): `mtp.pre_fc_norm_embedding`, "
                "`mtp.pre_fc_norm_hidden`, `mtp.fc` over [embedding, hidden], `mtp.layers.0.*` (a "
                "full-attention Qwen3NextDecoderLayer: `q_proj` emitting query and gate per head, "
                "`q_norm` / `k_norm`, MoE `mlp.gate`, `mlp.experts.{e}.*`, `mlp.shared_expert.*`, "
                "`mlp.shared_expert_gate`), `mtp.norm`; embedding and head are the target's "
                "`model.embed_tokens`, `lm_head`",
        loads="the `mtp.*` layer, the target's embedding and lm-head (circuit/layers/qwen3_next_checkpoint.py); "
              "every other `mtp.*` tensor is refused by name",
        target="no: its linear-attention (Gated DeltaNet) layers are out of scope",
        runs="yes: `Qwen3NextMtpHead` (zero-centred norms, 1 + weight in fp32 in the norm, sigmoid attention "
             "gate, partial rotary from `partial_rotary_factor`, 0.25 absent, softmax top-k routing, "
             "sigmoid-gated shared expert; the hidden handed on is after `mtp.norm`)",
        rules=_COMMON + (
            FieldRule("attention_bias", (False,), False, "Qwen3-Next's flag biases q/k/v and o_proj; "
                      "the head's projections have none"),
            FieldRule("decoder_sparse_step", (1,), 1, _QWEN3_NEXT_MOE),
            FieldRule("mlp_only_layers", ((),), (), "a listed layer index (vLLM and SGLang read "
                      "`mtp.layers.0` as index 0) would make the MTP layer's MLP dense: the head's is the MoE"),
            FieldRule("mtp_use_dedicated_embeddings", (False,), False,
                      "the MTP layer embeds with the target's `model.embed_tokens`"),
        ),
        options=qwen3_next_options,
    ),
    Family(
        # a drafter of its own: model_type llama, told from Llama by its architecture alone
        "llama", ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM"),
        drafter="EAGLE-3 (vLLM's / SGLang's llama_eagle3 names): `fc` over three tapped target "
                "hiddens, `midlayer.*` (`input_layernorm`, `hidden_norm`, q/k/v over 2 x hidden), "
                "`norm`, `lm_head` over `draft_vocab_size`, `d2t` offsets (`t2d` checked against "
                "it), `embed_tokens` optional (absent: the target's)",
        loads="the drafter alone (circuit/layers/eagle3_checkpoint.py); the target is a Llama",
        target="no: a drafter", runs="yes: `Eagle3Head`",
        rules=(
            FieldRule("hidden_act", ("silu",), "silu", "the MLP is SwiGLU (silu_mul)"),
            FieldRule("rope_parameters.rope_type", ("default",), "default", _ROPE),
            FieldRule("rope_scaling.rope_type", ("default",), "default", _ROPE),
            FieldRule("rope_scaling.type", ("default",), "default", _ROPE),
            FieldRule("attention_bias", (False,), False, _EAGLE3_NO_BIAS),
            FieldRule("mlp_bias", (False,), False, _EAGLE3_NO_BIAS),
            FieldRule("bias", (False,), False, _EAGLE3_NO_BIAS),
            FieldRule("num_hidden_layers", (1,), 1, "the head runs one EAGLE-3 decoder layer (`midlayer`)"),
            FieldRule("tie_word_embeddings", (False,), False,
                      "the head reads its own `lm_head` over `draft_vocab_size` ids"),
            FieldRule("eagle_config.use_aux_hidden_state", (True,), True,
                      "the head's step 0 is `fc` over the three tapped target hiddens"),
        ),
    ),
)

# A config that names no architecture is the first family of its model_type (llama: Llama).
_BY_TYPE: dict[str, Family] = {}
for _f in FAMILIES:
    _BY_TYPE.setdefault(_f.model_type, _f)
_BY_ARCH = {a: f for f in FAMILIES for a in f.architectures}


def family_label(d: Mapping[str, Any]) -> str:
    """`Arch (model_type 'x')` as a config names it, for messages."""
    archs, mt = d.get("architectures"), d.get("model_type")
    arch = ", ".join(map(str, archs)) if isinstance(archs, list) and archs else "no architectures"
    return f"{arch} (model_type {mt!r})"


def check_family(d: Mapping[str, Any], source: str = "config") -> Family:
    """The family a config.json describes, after every rule of it passed; raises otherwise."""
    label = family_label(d)
    archs, mt = d.get("architectures"), d.get("model_type")
    if archs is not None and (not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)):
        raise UnsupportedArchitectureError(f"{source}: config field 'architectures' = {archs!r}: "
                                           "expected a list of class names")
    by_arch = {_BY_ARCH.get(a) for a in archs or []}
    if mt is None and not archs:
        raise UnsupportedArchitectureError(f"{source}: neither 'model_type' nor 'architectures' is "
                                           f"set, so the family is unknown; known: {_known()}")
    # architectures decide (two families share model_type llama); model_type must agree with them
    named = {f for f in by_arch if f is not None}
    if len(named) < len(by_arch) or (mt is not None and mt not in _BY_TYPE):
        raise UnsupportedArchitectureError(f"{source}: {label}: not in the family table; known: {_known()}")
    family = next(iter(named)) if named else _BY_TYPE[str(mt)]
    if len(named) > 1 or (mt is not None and mt != family.model_type):
        raise UnsupportedArchitectureError(f"{source}: {label}: disagree (architectures and model_type "
                                           f"name different families); known: {_known()}")
    if family.blocked:
        raise UnsupportedArchitectureError(
            f"{source}: {label} is a known family that cannot run yet: {'; '.join(family.blocked)}")
    for rule in family.rules:
        if rule.violated(d):
            raise UnsupportedConfigError(
                f"{source}: config field {rule.field!r} = {rule.value(d)!r} ({label}): the head "
                f"implements only {' / '.join(repr(a) for a in rule.allowed)}; {rule.why}")
    return family


def _known() -> str:
    return ", ".join(f"{f.architectures[0]} ({f.model_type})" for f in FAMILIES)


def markdown_table() -> str:
    """The README's "Supported architectures" table."""
    rows = ["| architecture / `model_type` | drafter layout | loads | target | drafter | refused, and why |",
            "| --- | --- | --- | --- | --- | --- |"]
    for f in FAMILIES:
        refused = "<br>".join([*f.refused, *(() if f.blocked else (_TENSORS,))])
        rows.append(f"| {', '.join(f.architectures)} / `{f.model_type}` | {f.drafter} | {f.loads} | "
                    f"{f.target} | {f.runs} | {refused} |")
    return "\n".join(rows) + "\n"
