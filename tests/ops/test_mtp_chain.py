"""The eager draft chain against an independent, straightforward MTP implementation (fp32, CPU).

The reference below keeps each sequence's drafter KV as a plain [rows, kv_heads, head_dim] list
(no paging, no registry ops), so a bug in paging, in the ops or in the chain's wiring shows here.
"""
import math

import pytest
import torch
import torch.nn.functional as F

from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.runners.eager import EagerRunner
from tests.plain_reference import rms, rope

CFG = MtpConfig(vocab_size=97, hidden_size=48, intermediate_size=80, num_attention_heads=4,
                num_key_value_heads=2, head_dim=12, rms_norm_eps=1e-6, rope_theta=10000.0,
                num_hidden_layers=2, tie_word_embeddings=False, max_position_embeddings=512)
KV = KvLayout(num_blocks=48, block_size=8, max_blocks_per_seq=6)


def random_weights(cfg: MtpConfig, seed: int) -> dict[str, torch.Tensor]:
    from draft_circuit.circuit.layers.config import MTP_PARAM_SHAPES
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in MTP_PARAM_SHAPES(cfg).items():
        t = torch.randn(shape, generator=g)
        out[name] = 1 + 0.1 * t if len(shape) == 1 else t / math.sqrt(shape[-1])
    return out


def reference_chain(w, cfg, k, token, hidden, pos, keys, vals):
    """One sequence: k greedy MTP drafts. keys/vals: lists of [kv_heads, head_dim] rows."""
    d, hq, hk = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    drafts, confs = [], []
    for j in range(k):
        e = w["embed_tokens.weight"][token]
        x = torch.cat([rms(e, w["enorm.weight"], cfg.rms_norm_eps),
                       rms(hidden, w["hnorm.weight"], cfg.rms_norm_eps)]) @ w["eh_proj.weight"].T
        a = rms(x, w["input_layernorm.weight"], cfg.rms_norm_eps)
        q = rope(a @ w["self_attn.q_proj.weight"].T, pos + j, d, cfg.rope_theta)   # [hq, d]
        kk = rope(a @ w["self_attn.k_proj.weight"].T, pos + j, d, cfg.rope_theta)  # [hk, d]
        keys.append(kk)
        vals.append((a @ w["self_attn.v_proj.weight"].T).view(hk, d))
        K, V = torch.stack(keys), torch.stack(vals)   # [L, hk, d]
        heads = []
        for h in range(hq):
            s = (K[:, h // (hq // hk)] @ q[h]) / math.sqrt(d)
            heads.append(s.softmax(0) @ V[:, h // (hq // hk)])
        x = x + torch.cat(heads) @ w["self_attn.o_proj.weight"].T
        m = rms(x, w["post_attention_layernorm.weight"], cfg.rms_norm_eps)
        x = x + (F.silu(m @ w["mlp.gate_proj.weight"].T) * (m @ w["mlp.up_proj.weight"].T)) \
            @ w["mlp.down_proj.weight"].T
        logits = rms(x, w["shared_head.norm.weight"], cfg.rms_norm_eps) @ w["shared_head.head.weight"].T
        token = int(logits.argmax())
        drafts.append(token)
        confs.append(float(logits.log_softmax(0)[token]))
        hidden = x
    return drafts, confs


@pytest.mark.parametrize("width", [1, 3, 8])
def test_eager_chain_matches_independent_reference(width):
    k = 4
    g = torch.Generator().manual_seed(width)
    weights = random_weights(CFG, seed=7)
    head = MtpHead(CFG)
    circuit = emit_draft_chain(head, k, max_width=8, kv=KV)
    kc = torch.zeros(KV.num_blocks, KV.block_size, CFG.num_key_value_heads, CFG.head_dim)
    vc = torch.zeros_like(kc)
    runner = EagerRunner(circuit, head.bind(weights), {"k_cache": kc, "v_cache": vc})

    # live lengths that end mid-block, on a boundary and span several blocks
    lives = [0, 7, 8, 9, 17, 30, 3, 24][:width]
    perm = torch.randperm(KV.num_blocks, generator=g)  # scattered, not contiguous, blocks
    tables = torch.zeros(width, KV.max_blocks_per_seq, dtype=torch.int32)
    seq_keys, seq_vals = [], []
    for i, live in enumerate(lives):
        tables[i] = perm[i * KV.max_blocks_per_seq:(i + 1) * KV.max_blocks_per_seq].int()
        keys = [torch.randn(CFG.num_key_value_heads, CFG.head_dim, generator=g) for _ in range(live)]
        vals = [torch.randn(CFG.num_key_value_heads, CFG.head_dim, generator=g) for _ in range(live)]
        for r in range(live):
            kc[tables[i, r // KV.block_size], r % KV.block_size] = keys[r]
            vc[tables[i, r // KV.block_size], r % KV.block_size] = vals[r]
        seq_keys.append(keys)
        seq_vals.append(vals)
    tokens = torch.randint(0, CFG.vocab_size, (width,), generator=g, dtype=torch.int32)
    hidden = torch.randn(width, CFG.hidden_size, generator=g)
    positions = torch.tensor(lives, dtype=torch.int32) + 3
    out = runner.run({"tokens": tokens, "hidden": hidden, "positions": positions,
                      "block_tables": tables, "live_rows": torch.tensor(lives, dtype=torch.int32),
                      "active": torch.ones(width, dtype=torch.int32)})
    assert out["drafts"].shape == (width, k) and out["drafts"].dtype == torch.int32
    for i in range(width):
        drafts, confs = reference_chain(weights, CFG, k, int(tokens[i]), hidden[i],
                                        int(positions[i]), seq_keys[i], seq_vals[i])
        assert out["drafts"][i].tolist() == drafts, f"row {i}"
        torch.testing.assert_close(out["confidences"][i], torch.tensor(confs), atol=1e-5, rtol=0)
        # the chain wrote exactly its k rows at live .. live + k - 1
        for r in range(lives[i], lives[i] + k):
            blk, off = tables[i, r // KV.block_size], r % KV.block_size
            torch.testing.assert_close(kc[blk, off], seq_keys[i][r].view_as(kc[blk, off]),
                                       atol=1e-5, rtol=1e-5)


def _stop_setup(log_tau: float, width: int = 3):
    from draft_circuit.runners.testing import random_draft_batch
    head = MtpHead(CFG)
    chain = emit_draft_chain(head, 4, max_width=8, kv=KV, confidence_stop=True, embed_target=True)
    batch = random_draft_batch(CFG, KV, width, seed=4, num_drafts=4)
    batch.inputs["log_tau"] = torch.full((width,), log_tau)
    states = {**batch.clone_states(), "embed_target": torch.zeros(8, CFG.hidden_size)}
    out = EagerRunner(chain, head.bind(random_weights(CFG, 7)), states).run(batch.inputs)
    return batch, states, out


def test_confidence_stop_keeps_the_first_low_draft_and_writes_no_more_kv():
    batch, states, out = _stop_setup(0.0)  # tau = 1: every draft is below it
    assert (out["drafts"][:, 0] >= 0).all() and (out["drafts"][:, 1:] == -1).all()
    for i, live in enumerate(batch.lives):
        tables = batch.inputs["block_tables"][i]
        for r in range(live, live + 4):
            blk, off = tables[r // KV.block_size], r % KV.block_size
            written = not torch.equal(states["k_cache"][blk, off], batch.k_cache[blk, off])
            assert written == (r == live), (i, r)  # only the first draft's row
    emb = random_weights(CFG, 7)["embed_tokens.weight"][out["drafts"][:, 0].long()]
    assert torch.equal(states["embed_target"][:3], emb)  # the last *kept* draft's embedding


def test_no_stop_threshold_equals_the_plain_chain():
    _, _, out = _stop_setup(float("-inf"))
    assert (out["drafts"] >= 0).all()


def test_nan_confidence_never_stops():
    from draft_circuit.ops.sampling import confidence_gate_ref
    active = torch.tensor([1, 1, 1, 0], dtype=torch.int32)
    logprob = torch.tensor([float("nan"), -5.0, -0.1, -0.1])
    got = confidence_gate_ref(active, logprob, torch.full((4,), -1.0))
    assert got.tolist() == [1, 0, 1, 0]
