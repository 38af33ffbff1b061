"""transformers is the oracle: our eager DeepSeek-V3 layers (MLA with absorbed decode over the
paged latent pools, YaRN RoPE, dense and MoE MLPs) equal DeepseekV3DecoderLayer on the same tiny
random weights (fp32): a prefill of every row, then decode steps one row at a time, at positions
far past original_max_position_embeddings; likewise the MTP layer (transformers' MtpLayer)."""
from __future__ import annotations

import pytest
import torch

from draft_circuit.circuit.layers.deepseek import DeepseekMtpHead
from draft_circuit.circuit.layers.mtp import KvLayout, emit_draft_chain
from draft_circuit.runners.eager import EagerRunner

from tests.layers.deepseek_fixtures import checkpoint_tensors, hf_model, layer_circuit, layer_params, our_config

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3 import modeling_deepseek_v3 as hf_ds  # noqa: E402

BLOCK, MAX_BLOCKS, NUM_BLOCKS = 4, 12, 40
TOL = dict(atol=2e-5, rtol=2e-5)


def causal(n: int) -> torch.Tensor:
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


def hf_layer_out(model, layer: int, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        emb = model.model.rotary_emb(x[None], pos[None])
        return model.model.layers[layer](x[None], attention_mask=causal(len(pos)), position_ids=pos[None],
                                         position_embeddings=emb)[0]


def tables(g: torch.Generator) -> torch.Tensor:
    return torch.randperm(NUM_BLOCKS - 1, generator=g)[:MAX_BLOCKS].add(1).int()[None]  # scattered blocks


@pytest.mark.parametrize("variant", [{}, {"q_lora_rank": None}, {"rope_interleave": False},
                                     {"rope_parameters": {"rope_type": "default", "rope_theta": 5000.0}}],
                         ids=["v3", "q_proj", "no_interleave", "default_rope"])
@pytest.mark.parametrize("layer", [0, 1], ids=["dense", "moe"])
def test_target_layer_equals_transformers_prefill_then_decode(layer, variant):
    model = hf_model(**variant)
    c = our_config(model)
    assert c.is_moe_layer(layer) == (layer == 1)
    g = torch.Generator().manual_seed(3)
    prefill, decode, base = 30, 6, 7  # positions 7..42, original context 16
    total = prefill + decode
    x = torch.randn(total, c.hidden_size, generator=g)
    pos = torch.arange(total) + base
    want = hf_layer_out(model, layer, x, pos)
    circuit = layer_circuit(c, layer, max_rows=prefill, num_blocks=NUM_BLOCKS, block_size=BLOCK,
                            max_blocks=MAX_BLOCKS)
    pe = torch.zeros(NUM_BLOCKS, BLOCK, 1, c.qk_rope_head_dim)
    lat = torch.zeros(NUM_BLOCKS, BLOCK, 1, c.kv_lora_rank)
    runner = EagerRunner(circuit, layer_params(c, checkpoint_tensors(model), layer), {"pe_cache": pe,
                                                                                     "latent_cache": lat})
    table = tables(g)

    def run(rows: slice) -> torch.Tensor:
        n = rows.stop - rows.start
        return runner.run({"x": x[rows], "positions": pos[rows].int(), "block_tables": table.expand(n, -1).contiguous(),
                           "live_rows": torch.arange(rows.start, rows.stop, dtype=torch.int32),
                           "active": torch.ones(n, dtype=torch.int32)})["y"]

    torch.testing.assert_close(run(slice(0, prefill)), want[:prefill], **TOL)  # every row a query row
    for t in range(prefill, total):  # then one row a step over the cached rows
        torch.testing.assert_close(run(slice(t, t + 1)), want[t:t + 1], **TOL)


def test_mtp_layer_equals_transformers_mtp_layer():
    """Our k = 1 chain, run at each position of a sequence, is transformers' MtpLayer (a MoE
    DeepseekV3DecoderLayer behind enorm / hnorm / eh_proj, shared_head.norm as its post-norm) on
    the whole sequence: same hidden, same greedy draft, same log-probability."""
    model = hf_model(seed=5)
    c = our_config(model)
    tensors = checkpoint_tensors(model)
    g = torch.Generator().manual_seed(8)
    h = c.hidden_size
    mtp = {"embed_tokens.weight": tensors["model.embed_tokens.weight"], "enorm.weight": 1 + 0.1 * torch.randn(h, generator=g),
           "hnorm.weight": 1 + 0.1 * torch.randn(h, generator=g), "eh_proj.weight": torch.randn(h, 2 * h, generator=g) / 8,
           "shared_head.norm.weight": 1 + 0.1 * torch.randn(h, generator=g), "shared_head.head.weight": tensors["lm_head.weight"]}
    # the MTP layer's decoder block: layer 1's (MoE) weights under the canonical names
    mtp.update({k.removeprefix("model.layers.1."): v for k, v in tensors.items() if k.startswith("model.layers.1.")})
    mtp_config = model.config.get_mtp_config()
    layer = __import__("transformers.modeling_layers", fromlist=["MtpLayer"]).MtpLayer(
        mtp_config, hf_ds.DeepseekV3DecoderLayer, hf_ds.DeepseekV3RMSNorm, 0).eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            key = {"post_norm.weight": "shared_head.norm.weight"}.get(name, name.removeprefix("mtp_block."))
            if key.endswith("experts.gate_up_proj"):
                t = torch.stack([torch.cat([mtp[f"mlp.experts.{e}.{q}_proj.weight"] for q in ("gate", "up")])
                                 for e in range(c.n_routed_experts)])
            elif key.endswith("experts.down_proj"):
                t = torch.stack([mtp[f"mlp.experts.{e}.down_proj.weight"] for e in range(c.n_routed_experts)])
            else:
                t = mtp[key]
            p.copy_(t)
        layer.mtp_block.mlp.gate.e_score_correction_bias.copy_(mtp["mlp.gate.e_score_correction_bias"])
    length, base = 20, 9
    tokens = torch.randint(0, c.vocab_size, (length,), generator=g)
    hidden = torch.randn(length, h, generator=g)
    pos = torch.arange(length) + base
    with torch.no_grad():
        emb = model.model.rotary_emb(hidden[None], pos[None])
        normed = layer(model.model.embed_tokens(tokens)[None], hidden[None], position_embeddings=emb,
                       attention_mask=causal(length), position_ids=pos[None], cache=None)[0]
        logits = model.lm_head(normed).log_softmax(-1)
    head = DeepseekMtpHead(c)
    kv = KvLayout(NUM_BLOCKS, BLOCK, MAX_BLOCKS)
    chain = emit_draft_chain(head, 1, max_width=1, kv=kv)
    k_shape, v_shape = head.cache_shapes(kv)
    runner = EagerRunner(chain, head.bind(mtp), {"k_cache": torch.zeros(k_shape), "v_cache": torch.zeros(v_shape)})
    table = tables(g)
    for t in range(length):
        out = runner.run({"tokens": tokens[t:t + 1].int(), "hidden": hidden[t:t + 1], "positions": pos[t:t + 1].int(),
                          "block_tables": table, "live_rows": torch.tensor([t], dtype=torch.int32),
                          "active": torch.ones(1, dtype=torch.int32)})
        assert int(out["drafts"][0, 0]) == int(logits[t].argmax())
        torch.testing.assert_close(out["confidences"][0, 0], logits[t].max(), **TOL)
        torch.testing.assert_close(layer.post_norm(out["hidden_out"]), normed[t:t + 1], **TOL)
