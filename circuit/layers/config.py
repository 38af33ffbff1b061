"""`MtpConfig`: the shapes of a dense MTP draft head and its Llama target, read from and written to
Hugging Face `config.json`. Every bad field, and every pair of aliases that disagree, raises a
`ConfigError` naming the field(s); nothing is picked silently.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:  # rope.py imports ConfigError from here: the class is imported where it is used
    from draft_circuit.circuit.layers.rope import RopeScaling

__all__ = ["ConfigError", "MtpConfig", "DEFAULT_CONFIG", "MTP_PARAM_SHAPES", "TARGET_PARAM_SHAPES"]


class ConfigError(ValueError):
    """A config field is missing, mistyped or out of range, or two of its aliases disagree."""


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")
_POSITIVE_INTS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
    "head_dim", "num_hidden_layers", "max_position_embeddings",
)
# HF LlamaConfig's defaults for fields a config.json may leave out.
_DEFAULTS: dict[str, Any] = {
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "max_position_embeddings": 2048, "num_nextn_predict_layers": 1,
}
# Each group names one quantity; every alias present must agree (FAULT 22).
_ROPE_THETA_ALIASES = ("rope_theta", "rope_parameters.rope_theta", "rope_scaling.rope_theta")
_NUM_EXPERTS_ALIASES = ("n_routed_experts", "num_experts", "num_local_experts")
_MISSING = object()
FAMILY_OPTIONS = ("qkv_bias", "qk_norm", "partial_rotary_factor")  # set by the family table only
_READ_APART = (*FAMILY_OPTIONS, "rope_scaling")  # fields not read from a config.json key of that name
_NO_OPTIONS = {"qkv_bias": False, "qk_norm": False, "partial_rotary_factor": 1.0}


@dataclass(frozen=True)
class MtpConfig:
    """The MTP layer sits at index `num_hidden_layers` (the target's layer count).

    `num_attention_heads * head_dim` need not equal `hidden_size` (q/o projections carry the
    difference); `num_nextn_predict_layers == 0` describes a target with no MTP layer.
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    num_hidden_layers: int
    tie_word_embeddings: bool
    max_position_embeddings: int
    num_nextn_predict_layers: int = 1
    # The attention's family options (set from config.json by the family table, families.py;
    # never read from a field of these names): q/k/v projections with a bias (Qwen2, GLM-4.5's
    # attention_bias), a per-head RMSNorm of q and k before RoPE (Qwen3, GLM-4.5's use_qk_norm),
    # RoPE over each head's first int(head_dim * partial_rotary_factor) dims only (GLM-4.5: 0.5).
    qkv_bias: bool = False
    qk_norm: bool = False
    partial_rotary_factor: float = 1.0
    # RoPE scaling from `rope_parameters` / `rope_scaling` (circuit/layers/rope.py): None for default
    # RoPE over rope_theta, else YaRN (the GQA layers then run rope_freqs over its frequencies; its
    # theta is rope_theta). An MlaConfig keeps its scaling in its own `rope` field instead.
    rope_scaling: RopeScaling | None = None

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def rotary_dim(self) -> int:
        """The rotated dims of each head (transformers: int(head_dim * partial_rotary_factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_hf(cls, d: Mapping[str, Any], *, source: str = "config") -> MtpConfig:
        """Read HF config.json field names; `source` (the file) prefixes every error message."""
        if not isinstance(d, Mapping):
            raise ConfigError(f"{source}: expected a JSON object, got {type(d).__name__}")
        try:
            return cls(**_hf_fields(d))
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def to_hf(self) -> dict[str, Any]:
        """A Llama config.json dict (plus `num_nextn_predict_layers`) that `from_hf` reads back equal.
        A config with family options is no Llama's: transformers' own config class writes those."""
        options = {f: getattr(self, f) for f in FAMILY_OPTIONS}
        if options != _NO_OPTIONS:
            raise ConfigError(f"to_hf writes Llama's config.json; {options} are a family's attention "
                              "(Qwen2, Qwen3, GLM-4.5): write its config with transformers' config class")
        fields = {k: v for k, v in dataclasses.asdict(self).items() if k not in _READ_APART}
        # YaRN as transformers 5 writes it (rope_parameters); default RoPE as before
        rope = {"rope_scaling": None} if self.rope_scaling is None else \
            {"rope_parameters": self.rope_scaling.to_hf()}
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_act": "silu",
            **fields,
            **rope,
        }


def _hf_fields(d: Mapping[str, Any]) -> dict[str, Any]:
    for name in _REQUIRED:
        if d.get(name) is None:
            raise ConfigError(f"config field {name!r} is required but missing")
    _agreed(d, _NUM_EXPERTS_ALIASES)  # MoE fields are not in MtpConfig yet; only their agreement is checked
    heads, hidden = d["num_attention_heads"], d["hidden_size"]
    head_dim = d.get("head_dim")
    if head_dim is None:
        if not _is_int(heads) or not _is_int(hidden) or heads <= 0 or hidden % heads:
            raise ConfigError(
                f"config field 'head_dim' is absent and 'hidden_size'={hidden!r} is not divisible "
                f"by 'num_attention_heads'={heads!r}: give head_dim explicitly"
            )
        head_dim = hidden // heads
    fields = {f.name: d.get(f.name) for f in dataclasses.fields(MtpConfig) if f.name not in _READ_APART}
    fields = {k: (_DEFAULTS.get(k) if v is None else v) for k, v in fields.items()}
    if d.get("num_key_value_heads") is None:
        fields["num_key_value_heads"] = heads  # HF: absent means multi-head attention (no GQA)
    fields["head_dim"] = head_dim
    theta = _agreed(d, _ROPE_THETA_ALIASES)
    fields["rope_theta"] = _DEFAULTS["rope_theta"] if theta is None else theta
    fields["rope_scaling"] = _rope_scaling(d, fields["rope_theta"])
    return fields


def _rope_scaling(d: Mapping[str, Any], theta: Any) -> RopeScaling | None:
    """YaRN from rope_parameters / rope_scaling, None for default RoPE; any other type (linear,
    dynamic, llama3, longrope) is refused by name: ignoring it would silently change the drafts."""
    from draft_circuit.circuit.layers.rope import RopeScaling
    try:
        t = float(theta) if _is_int(theta) or isinstance(theta, float) else math.nan
    except OverflowError:  # an int past float's range
        t = math.nan
    if not 0 < t < math.inf:
        return None  # _validate names the bad rope_theta
    rope = RopeScaling.from_hf(d, theta=t)
    return None if rope.rope_type == "default" else rope


def _lookup(d: Mapping[str, Any], dotted: str) -> Any:
    cur: Any = d
    for part in dotted.split("."):
        if not isinstance(cur, Mapping) or cur.get(part) is None:
            return _MISSING
        cur = cur[part]
    return cur


def _agreed(d: Mapping[str, Any], aliases: tuple[str, ...]) -> Any:
    """The one value the present aliases share, or None when none is present."""
    found = {name: v for name in aliases if (v := _lookup(d, name)) is not _MISSING}
    values = list(found.values())
    if any(not _same(v, values[0]) for v in values[1:]):
        listed = ", ".join(f"{name}={v!r}" for name, v in found.items())
        raise ConfigError(f"config aliases disagree: {listed}; make them equal or drop all but one")
    return values[0] if values else None


def _same(a: Any, b: Any) -> bool:
    # NaN != NaN: two NaN aliases agree, and the value check then names the field
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _validate(c: MtpConfig) -> None:
    for name in _POSITIVE_INTS:
        v = getattr(c, name)
        if not _is_int(v) or v <= 0:
            raise ConfigError(f"config field {name!r} = {v!r}: must be a positive int")
    n = c.num_nextn_predict_layers
    if not _is_int(n) or n < 0:
        raise ConfigError(f"config field 'num_nextn_predict_layers' = {n!r}: must be an int >= 0")
    for name in ("rms_norm_eps", "rope_theta"):
        v = getattr(c, name)
        # Infinity passes `v > 0`; json.loads reads the bare token Infinity (and NaN) as floats
        try:
            fv = float(v) if _is_int(v) or isinstance(v, float) else math.nan
        except OverflowError:  # an int past float's range
            fv = math.inf
        if not 0 < fv < math.inf:
            raise ConfigError(f"config field {name!r} = {v!r}: must be a positive finite number")
        object.__setattr__(c, name, fv)  # 10000 and 10000.0 compare and print the same
    if not isinstance(c.tie_word_embeddings, bool):
        raise ConfigError(f"config field 'tie_word_embeddings' = {c.tie_word_embeddings!r}: must be a bool")
    if c.num_attention_heads % c.num_key_value_heads:
        raise ConfigError(
            f"config field 'num_key_value_heads' = {c.num_key_value_heads}: must divide "
            f"'num_attention_heads' = {c.num_attention_heads} (GQA groups)"
        )
    if c.head_dim % 2:
        raise ConfigError(f"config field 'head_dim' = {c.head_dim}: must be even (RoPE rotates pairs)")
    for name in ("qkv_bias", "qk_norm"):
        if not isinstance(getattr(c, name), bool):
            raise ConfigError(f"attention option {name!r} = {getattr(c, name)!r}: must be a bool")
    f = c.partial_rotary_factor
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f <= 1:
        raise ConfigError(f"config field 'partial_rotary_factor' = {f!r}: must be a number in (0, 1]")
    if c.rotary_dim % 2 or c.rotary_dim < 2:
        raise ConfigError(f"config field 'partial_rotary_factor' = {f!r}: rotates {c.rotary_dim} of "
                          f"head_dim = {c.head_dim} dims; RoPE needs an even count >= 2")
    object.__setattr__(c, "partial_rotary_factor", float(f))
    _validate_rope_scaling(c)


def _validate_rope_scaling(c: MtpConfig) -> None:
    from draft_circuit.circuit.layers.rope import RopeScaling
    r: Any = c.rope_scaling
    if isinstance(r, Mapping):  # dataclasses.asdict of a config (a subclass built from its base)
        r = RopeScaling(**r)
        object.__setattr__(c, "rope_scaling", r)
    if r is None:
        return
    if not isinstance(r, RopeScaling) or r.rope_type != "yarn":
        raise ConfigError(f"config field 'rope_scaling' = {r!r}: expected None (default RoPE) or a "
                          "RopeScaling of type yarn")
    if r.theta != c.rope_theta:
        raise ConfigError(f"rope_scaling theta {r.theta} != rope_theta {c.rope_theta}")
    if c.rotary_dim != c.head_dim:  # rope_freqs rotates whole heads
        raise ConfigError(f"config field 'partial_rotary_factor' = {c.partial_rotary_factor} with "
                          f"rope_scaling yarn: YaRN runs over whole heads only (rope_freqs)")


DEFAULT_CONFIG = MtpConfig(
    vocab_size=256, hidden_size=128, intermediate_size=352, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
    num_hidden_layers=2, tie_word_embeddings=False, max_position_embeddings=2048,
)


def _decoder_shapes(c: MtpConfig, prefix: str) -> dict[str, tuple[int, ...]]:
    h, i = c.hidden_size, c.intermediate_size
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    bias = {f"{prefix}self_attn.{p}_proj.bias": (size,) for p, size in (("q", q), ("k", kv), ("v", kv))}
    norms = {f"{prefix}self_attn.{p}_norm.weight": (c.head_dim,) for p in ("q", "k")}
    return {
        f"{prefix}input_layernorm.weight": (h,),
        f"{prefix}self_attn.q_proj.weight": (q, h),
        f"{prefix}self_attn.k_proj.weight": (kv, h),
        f"{prefix}self_attn.v_proj.weight": (kv, h),
        **(bias if c.qkv_bias else {}),
        **(norms if c.qk_norm else {}),
        f"{prefix}self_attn.o_proj.weight": (h, q),
        f"{prefix}post_attention_layernorm.weight": (h,),
        f"{prefix}mlp.gate_proj.weight": (i, h),
        f"{prefix}mlp.up_proj.weight": (i, h),
        f"{prefix}mlp.down_proj.weight": (h, i),
    }


def MTP_PARAM_SHAPES(config: MtpConfig) -> dict[str, tuple[int, ...]]:  # noqa: N802 (the name the design fixes)
    """Canonical MTP weight names (HF names relative to the MTP layer prefix) -> shapes."""
    h, v = config.hidden_size, config.vocab_size
    return {
        "embed_tokens.weight": (v, h),
        "enorm.weight": (h,),
        "hnorm.weight": (h,),
        "eh_proj.weight": (h, 2 * h),
        **_decoder_shapes(config, ""),
        "shared_head.norm.weight": (h,),
        "shared_head.head.weight": (v, h),
    }


def TARGET_PARAM_SHAPES(config: MtpConfig) -> dict[str, tuple[int, ...]]:  # noqa: N802
    """HF names -> shapes of the Llama target; `lm_head.weight` is listed even when tied."""
    h, v = config.hidden_size, config.vocab_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for layer in range(config.num_hidden_layers):
        shapes.update(_decoder_shapes(config, f"model.layers.{layer}."))
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (v, h)
    return shapes
