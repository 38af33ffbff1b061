"""The EAGLE-3 drafter (`LlamaForCausalLMEagle3`, as vLLM's llama_eagle3.py and SGLang's
llama_eagle3.py run it): `Eagle3Config` and `Eagle3Head`, whose k-step chain is
`emit_draft_chain(head, k, ...)` like any head's.

One step: h = fc(concat of three target hiddens) at step 0, the drafter's own pre-norm hidden
after; x = [input_layernorm(embed(token)), hidden_norm(h)] (2H wide, so q/k/v take 2H); the
attention residual is h (hidden_norm(h) with `norm_before_residual`); a Llama MLP; the hidden
handed to the next step is the residual stream before the final `norm` (vLLM's hidden_prenorm,
SGLang's hidden_states_to_aux), the logits `lm_head(norm(x))` over `draft_vocab_size` ids whose
target ids are `arange + d2t` (d2t holds offsets), mapped on the device by the chain.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

import torch

from draft_circuit.circuit.builder import CircuitBuilder
from draft_circuit.circuit.layers.config import ConfigError, MtpConfig, _is_int
from draft_circuit.circuit.layers.draft_vocab import DRAFT_VOCAB_IDS
from draft_circuit.circuit.layers.mtp import GATE_UP, MtpHead, StepIO

__all__ = ["Eagle3Config", "Eagle3Head", "EAGLE3_ARCHITECTURES", "eagle3_checkpoint_shapes",
           "draft_targets"]

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # vLLM's registry: both
LAYER = "midlayer."  # the one decoder layer's prefix in the published checkpoints


@dataclass(frozen=True, kw_only=True)
class Eagle3Config(MtpConfig):
    """An EAGLE-3 drafter's config.json. `num_hidden_layers` is the drafter's own layer count (1);
    `target_hidden_size` the width of each tapped target hidden (absent: hidden_size);
    `aux_layer_ids` (eagle_config.eagle_aux_hidden_state_layer_ids) the target layers whose
    outputs are tapped, None for the default (see `tapped_layers`)."""

    draft_vocab_size: int
    target_hidden_size: int
    norm_before_residual: bool = False
    aux_layer_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        _validate_eagle3(self)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], *, source: str = "config") -> Eagle3Config:
        """HF names. Absent (or null): draft_vocab_size -> vocab_size (vLLM, SGLang),
        target_hidden_size -> hidden_size, norm_before_residual -> false."""
        base = MtpConfig.from_hf(d, source=source)
        nest = d.get("eagle_config")
        eagle: Mapping[str, Any] = nest if isinstance(nest, Mapping) else {}
        top, nested = d.get("eagle_aux_hidden_state_layer_ids"), eagle.get("eagle_aux_hidden_state_layer_ids")
        if top is not None and nested is not None and top != nested:
            raise ConfigError(f"{source}: config aliases disagree: eagle_aux_hidden_state_layer_ids={top!r}, "
                              f"eagle_config.eagle_aux_hidden_state_layer_ids={nested!r}")
        ids = top if top is not None else nested
        def get(k: str, default: Any) -> Any:
            return default if d.get(k) is None else d[k]
        try:
            return cls(**dataclasses.asdict(base), draft_vocab_size=get("draft_vocab_size", base.vocab_size),
                       target_hidden_size=get("target_hidden_size", base.hidden_size),
                       norm_before_residual=get("norm_before_residual", False),
                       aux_layer_ids=tuple(ids) if isinstance(ids, list) else ids)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        d = {**super().to_hf(), "architectures": [EAGLE3_ARCHITECTURES[0]]}
        aux = d.pop("aux_layer_ids")
        del d["num_nextn_predict_layers"]  # an MTP field; the drafter is its own model
        if aux is not None:
            d["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux), "use_aux_hidden_state": True}
        return d

    def tapped_layers(self, target_num_layers: int) -> tuple[int, ...]:
        """The target layers whose outputs (the residual stream after that layer, before the
        target's final norm) the engine concatenates, in this order, into the chain's `hidden`.
        Default: the outputs of layers 1, L//2 - 1 and L - 4, i.e. the inputs of layers 2, L//2 and
        L - 3 (vLLM's and SGLang's default capture); named ids are layer outputs, as SGLang reads
        them (SpecForge, which trains these drafters, taps the same). vLLM reads the same keys as
        capture points instead (id j: the input of layer j, one layer earlier), so a drafter whose
        ids were pinned for vLLM (the speculators format) is tapped here, as by SGLang, one layer
        later than vLLM taps it; the defaults agree in all three."""
        if self.aux_layer_ids is not None:
            ids = self.aux_layer_ids
        else:
            ids = (1, target_num_layers // 2 - 1, target_num_layers - 4)
        if not all(0 <= i < target_num_layers for i in ids):
            raise ConfigError(f"EAGLE-3 taps the outputs of target layers {list(ids)}; a target of "
                              f"{target_num_layers} layers has no such layer")
        return tuple(ids)


def _validate_eagle3(c: Eagle3Config) -> None:
    for name in ("draft_vocab_size", "target_hidden_size"):
        v = getattr(c, name)
        if not _is_int(v) or v <= 0:
            raise ConfigError(f"config field {name!r} = {v!r}: must be a positive int")
    if c.draft_vocab_size > c.vocab_size:
        raise ConfigError(f"config field 'draft_vocab_size' = {c.draft_vocab_size}: more than "
                          f"'vocab_size' = {c.vocab_size}")
    if c.num_hidden_layers != 1:  # vLLM's `layers.{i}` / SGLang's `midlayers.{i}` beyond the first
        raise ConfigError(f"config field 'num_hidden_layers' = {c.num_hidden_layers}: the EAGLE-3 head "
                          "runs one decoder layer (`midlayer`)")
    if not isinstance(c.norm_before_residual, bool):
        raise ConfigError(f"config field 'norm_before_residual' = {c.norm_before_residual!r}: must be a bool")
    ids = c.aux_layer_ids
    if ids is not None and (not isinstance(ids, tuple) or len(ids) != 3
                            or not all(_is_int(i) and i >= 0 for i in ids)):
        raise ConfigError(f"config field 'eagle_aux_hidden_state_layer_ids' = {ids!r}: fc takes three "
                          "tapped hiddens, so three layer ids >= 0")


def eagle3_checkpoint_shapes(c: Eagle3Config) -> dict[str, tuple[int, ...]]:
    """The float tensors of the published layout (names as stored, no `model.` prefix);
    `d2t` (int64 [draft_vocab_size]) and `t2d` (bool [vocab_size]) are read apart."""
    h, i, v = c.hidden_size, c.intermediate_size, c.vocab_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    return {
        "embed_tokens.weight": (v, h),
        "fc.weight": (h, 3 * c.target_hidden_size),
        f"{LAYER}input_layernorm.weight": (h,),
        f"{LAYER}hidden_norm.weight": (h,),
        f"{LAYER}self_attn.q_proj.weight": (q, 2 * h),
        f"{LAYER}self_attn.k_proj.weight": (kv, 2 * h),
        f"{LAYER}self_attn.v_proj.weight": (kv, 2 * h),
        f"{LAYER}self_attn.o_proj.weight": (h, q),
        f"{LAYER}post_attention_layernorm.weight": (h,),
        f"{LAYER}mlp.gate_proj.weight": (i, h),
        f"{LAYER}mlp.up_proj.weight": (i, h),
        f"{LAYER}mlp.down_proj.weight": (h, i),
        "norm.weight": (h,),
        "lm_head.weight": (c.draft_vocab_size, h),
    }


def draft_targets(d2t: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Target id of each draft id: `draft_id + d2t[draft_id]` (d2t holds offsets: SGLang's
    `hot_token_id = d2t + arange`, vLLM's `targets = base + draft_id_to_target_id`), int64.
    Raises ValueError unless every target is a distinct id in [0, vocab_size)."""
    targets = torch.arange(d2t.shape[0]) + d2t.long().cpu()
    bad = (targets < 0) | (targets >= vocab_size)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"d2t maps draft id {i} to target id {int(targets[i])}, outside [0, {vocab_size})")
    if torch.unique(targets).numel() != targets.numel():
        raise ValueError("d2t maps two draft ids to one target id")
    return targets


class Eagle3Head(MtpHead):
    """The EAGLE-3 layer: its params, their binding from the checkpoint, and one draft step.
    A subclass of MtpHead for what they share (the Llama SwiGLU MLP, batch refusals, notes)."""

    config: Eagle3Config
    lm_head = "lm_head.weight"

    def __init__(self, config: Eagle3Config, dtype: str = "float32") -> None:
        if not isinstance(config, Eagle3Config):
            raise TypeError(f"Eagle3Head needs an Eagle3Config, got {type(config).__name__}")
        super().__init__(config, dtype)
        self.draft_vocab_size = config.draft_vocab_size  # its logits run over its own draft ids

    @property
    def hidden_in_size(self) -> int:
        return 3 * self.config.target_hidden_size  # the three tapped target hiddens, concatenated

    def param_specs(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        c, dt = self.config, self.dtype
        specs = {k.removeprefix(LAYER): (dt, s) for k, s in eagle3_checkpoint_shapes(c).items()}
        gate = specs.pop("mlp.gate_proj.weight")[1]
        del specs["mlp.up_proj.weight"]
        specs[GATE_UP] = (dt, (2 * gate[0], gate[1]))
        specs[DRAFT_VOCAB_IDS] = ("int32", (c.draft_vocab_size,))
        return specs

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: s for k, (_, s) in self.param_specs().items()}

    def declare_params(self, b: CircuitBuilder) -> None:
        for name, (dtype, shape) in self.param_specs().items():
            b.param(name, dtype, shape)

    def bind(self, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Checkpoint tensors (stored names, `load_eagle3_weights`) -> params. The lm-head rows
        are put in ascending target-id order with the id table beside them, so a tie goes to the
        lower target id, as over vLLM's full-vocabulary logits."""
        dt = getattr(torch, self.dtype)
        w = {k.removeprefix(LAYER): t for k, t in weights.items()}
        targets = draft_targets(w.pop("d2t"), self.config.vocab_size)
        order = torch.argsort(targets)
        lm = w.pop(self.lm_head)
        params = {k: t.to(dt).contiguous() for k, t in w.items()
                  if k not in ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
        params[GATE_UP] = torch.cat([w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"]]).to(dt).contiguous()
        params[self.lm_head] = lm[order.to(lm.device)].to(dt).contiguous()
        params[DRAFT_VOCAB_IDS] = targets[order].to(torch.int32).to(lm.device)
        return {k: params[k] for k in self.param_specs()}

    def emit_step(self, b: CircuitBuilder, step: int, token: str, hidden: str, positions: str,
                  tables: str, live: str, k_cache: str, v_cache: str, active: str,
                  bitmask: str | None = None) -> StepIO:
        c = self.config
        eps = {"eps": c.rms_norm_eps}
        rope = {"head_dim": c.head_dim, "theta": c.rope_theta, "pos_offset": step}
        if step == 0:  # hidden: [n, 3 * target_hidden] tapped from the target
            hidden = b.op1("linear", [hidden, "fc.weight"], name="fc")
        emb = b.op1("embedding", ["embed_tokens.weight", token])
        e = b.op1("rmsnorm", [emb, "input_layernorm.weight"], eps, name="input_layernorm")
        h = b.op1("rmsnorm", [hidden, "hidden_norm.weight"], eps, name="hidden_norm")
        residual = h if c.norm_before_residual else hidden
        a = b.op1("concat", [e, h])  # [n, 2H]
        q = b.op1("linear", [a, "self_attn.q_proj.weight"], name="q_proj")
        k = b.op1("linear", [a, "self_attn.k_proj.weight"], name="k_proj")
        v = b.op1("linear", [a, "self_attn.v_proj.weight"], name="v_proj")
        q = b.op1("rope", [q, positions], rope, name="rope_q")
        k = b.op1("rope", [k, positions], rope, name="rope_k")
        # rows that stopped (or are inert padding) write no drafter-KV row
        k_cache, v_cache = b.op("kv_write", [k_cache, v_cache, k, v, tables, live, active],
                                {"row_offset": step})
        o = b.op1("decode_attention", [q, k_cache, v_cache, tables, live], {"row_offset": step},
                  name="attention")
        x = b.op1("add", [residual, b.op1("linear", [o, "self_attn.o_proj.weight"], name="o_proj")],
                  name="attn_residual")
        m = b.op1("rmsnorm", [x, "post_attention_layernorm.weight"], eps, name="post_attention_layernorm")
        x = b.op1("add", [x, self.emit_mlp(b, m)], name="mlp_residual")  # the hidden handed on
        y = b.op1("rmsnorm", [x, "norm.weight"], eps, name="norm")
        # fp32 logits over the draft vocabulary (subset rows, ascending target ids)
        logits = b.op1("linear", [y, self.lm_head], {"out_dtype": "float32"}, name="lm_head")
        tok, lp = b.op("argmax_logprob", [logits, bitmask])
        return StepIO(hidden=x, token=tok, logprob=lp, k_cache=k_cache, v_cache=v_cache)

    def plan_notes(self) -> dict[str, Any]:
        c = self.config
        return {"eagle3": {"draft_vocab_size": c.draft_vocab_size, "hidden_in": self.hidden_in_size,
                           "norm_before_residual": c.norm_before_residual}}
