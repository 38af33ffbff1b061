"""YaRN RoPE against transformers 5: the frequency table and attention factor bit for bit, the
softmax mscale DeepseekV3Attention uses, rope_freqs equal to transformers' (interleaved) rotary
embedding at positions far past original_max_position_embeddings, and the refusals by name."""
from __future__ import annotations

import math

import pytest
import torch

from draft_circuit.circuit.layers.config import ConfigError
from draft_circuit.circuit.layers.rope import RopeScaling, deinterleaved
from draft_circuit.ops.rope_freqs import rope_freqs_ref

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402

V3 = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
      "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}
VARIANTS = [
    V3,
    {**V3, "mscale": 0.8, "mscale_all_dim": 0.5},          # attention_factor != 1
    {**V3, "truncate": False, "factor": 4.0, "beta_fast": 16},
    {**V3, "original_max_position_embeddings": 16, "beta_slow": 2},
    {**V3, "attention_factor": 1.3},
    {"rope_type": "default", "rope_theta": 50000.0},
]


def hf_config(rope: dict, **kw) -> "transformers.DeepseekV3Config":
    fields = dict(vocab_size=64, hidden_size=32, num_attention_heads=2, qk_rope_head_dim=8, qk_nope_head_dim=6,
                  v_head_dim=5, kv_lora_rank=12, q_lora_rank=10, max_position_embeddings=64)
    fields.update(kw)
    return transformers.DeepseekV3Config(**fields, rope_parameters={k: v for k, v in rope.items() if v is not None})


def ours(cfg) -> RopeScaling:
    return RopeScaling.from_hf(cfg.to_dict(), theta=cfg.rope_parameters["rope_theta"])


@pytest.mark.parametrize("rope", VARIANTS, ids=range(len(VARIANTS)))
@pytest.mark.parametrize("dim", [8, 64])
def test_inv_freq_and_attention_factor_are_transformers_bits(rope, dim):
    cfg = hf_config(rope, qk_rope_head_dim=dim)
    init = hf_ds.DeepseekV3RotaryEmbedding.compute_default_rope_parameters \
        if rope["rope_type"] == "default" else ROPE_INIT_FUNCTIONS["yarn"]
    want, factor = init(cfg)
    r = ours(cfg)
    got = r.inv_freq(dim)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert r.attention_factor == factor
    assert r.softmax_scale(6 + dim) == hf_ds.DeepseekV3Attention(cfg, 0).scaling


def test_rope_scaling_of_old_configs_reads_the_same():
    """DeepSeek-V3's hub config.json: `rope_scaling` with `type`, rope_theta beside it."""
    hub = {"rope_theta": 10000, "max_position_embeddings": 163840,
           "rope_scaling": {"type": "yarn", **{k: v for k, v in V3.items() if k not in ("rope_type", "rope_theta")}}}
    r = RopeScaling.from_hf(hub, theta=10000.0)
    assert r == ours(hf_config(V3))
    assert RopeScaling.from_hf({**hub, "rope_parameters": {**V3}}, theta=10000.0) == r


@pytest.mark.parametrize("field, value, pattern", [
    ("rope_parameters", {"rope_type": "linear", "factor": 2.0}, r"'rope_parameters\.rope_type' = 'linear'"),
    ("rope_scaling", {"type": "dynamic", "factor": 2.0}, r"'rope_scaling\.rope_type' = 'dynamic'"),
    ("rope_scaling", {"type": "llama3", "factor": 8.0}, r"'llama3': implemented RoPE types are default, yarn"),
    ("rope_parameters", {"rope_type": "yarn", "factor": 0.5, "original_max_position_embeddings": 8},
     r"factor' = 0\.5"),
    ("rope_parameters", {"rope_type": "yarn", "factor": float("nan"), "original_max_position_embeddings": 8},
     r"factor' = nan"),
    ("rope_parameters", {"rope_type": "yarn", "type": "default", "factor": 2.0}, r"disagree"),
    ("rope_parameters", {"rope_type": "yarn", "original_max_position_embeddings": 8}, r"factor' is missing"),
])
def test_other_rope_types_and_bad_fields_are_refused_by_name(field, value, pattern):
    with pytest.raises(ConfigError, match=pattern):
        RopeScaling.from_hf({field: value, "max_position_embeddings": 64}, theta=10000.0)


def test_aliases_that_disagree_are_refused():
    with pytest.raises(ConfigError, match=r"rope_parameters\.factor=40\.0, rope_scaling\.factor=4\.0"):
        RopeScaling.from_hf({"rope_parameters": V3, "rope_scaling": {**V3, "factor": 4.0}}, theta=1e4)


@pytest.mark.parametrize("rope", VARIANTS[:2], ids=["v3", "mscale"])
def test_rope_freqs_is_transformers_interleaved_rope_past_the_original_length(rope):
    """Positions up to 40x original_max_position_embeddings: transformers rotates interleaved
    pairs and returns [even', odd']; rope_freqs on the de-interleaved rows gives the same fp32."""
    dim, heads = 64, 3
    cfg = hf_config(rope, qk_rope_head_dim=dim)
    rotary = hf_ds.DeepseekV3RotaryEmbedding(cfg)
    pos = torch.tensor([0, 1, 4095, 4096, 4097, 9000, 65536, 163839])
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(pos), heads, dim, generator=g)
    k = torch.randn(len(pos), 1, dim, generator=g)
    cos, sin = rotary(q, pos[None])  # [1, n, dim]
    want_q, want_k = hf_ds.apply_rotary_pos_emb_interleave(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    r, perm = ours(cfg), deinterleaved(dim)
    got_q = rope_freqs_ref(q[..., perm].reshape(len(pos), -1), pos.int(), r.inv_freq(dim), dim, r.attention_factor)
    got_k = rope_freqs_ref(k[..., perm].reshape(len(pos), -1), pos.int(), r.inv_freq(dim), dim, r.attention_factor)
    assert torch.equal(got_q.view(len(pos), heads, dim), want_q[0].transpose(0, 1))
    assert torch.equal(got_k.view(len(pos), 1, dim), want_k[0].transpose(0, 1))
    # and the plain (non-interleaved) layout is apply_rotary_pos_emb on the rows as they are
    want_q2, _ = hf_ds.apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got_q2 = rope_freqs_ref(q.reshape(len(pos), -1), pos.int(), r.inv_freq(dim), dim, r.attention_factor)
    assert torch.equal(got_q2.view(len(pos), heads, dim), want_q2[0].transpose(0, 1))


def test_pos_offset_is_an_integer_add():
    x = torch.randn(2, 8)
    inv = RopeScaling().inv_freq(8)
    pos = torch.tensor([2**24 - 1, 5], dtype=torch.int32)
    assert torch.equal(rope_freqs_ref(x, pos, inv, 8, pos_offset=3), rope_freqs_ref(x, pos + 3, inv, 8))
    assert math.isclose(RopeScaling().attention_factor, 1.0)
