"""The independent EAGLE-3 reference the tests compare against, written from the published
architecture (vLLM's llama_eagle3.py, SGLang's llama_eagle3.py): plain torch on the checkpoint's
own tensors (midlayer names, d2t offsets, lm_head rows in stored order), unpaged KV lists, no
registry; and the tiny config, KV layout and inputs the EAGLE-3 tests share."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from draft_circuit.circuit.layers.eagle3 import Eagle3Config, eagle3_checkpoint_shapes
from draft_circuit.circuit.layers.mtp import KvLayout
from draft_circuit.runners.testing import random_draft_batch
from tests.plain_reference import rms, rope

CFG = Eagle3Config(vocab_size=160, hidden_size=32, intermediate_size=56, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                   num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=512,
                   draft_vocab_size=70, target_hidden_size=24)
KV = KvLayout(num_blocks=80, block_size=8, max_blocks_per_seq=5)
K = 4


def checkpoint(cfg: Eagle3Config = CFG, seed: int = 3, ascending: bool = False) -> dict[str, torch.Tensor]:
    """Tensors under their published names; d2t holds offsets to (by default unsorted) targets."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in eagle3_checkpoint_shapes(cfg).items():
        t = torch.randn(shape, generator=g)
        out[name] = 1 + 0.1 * t if len(shape) == 1 else t if "embed" in name else t / math.sqrt(shape[-1])
    targets = torch.randperm(cfg.vocab_size, generator=g)[:cfg.draft_vocab_size]
    if ascending:
        targets = targets.sort().values
    out["d2t"] = targets - torch.arange(cfg.draft_vocab_size)
    return out


# ---- the reference: vLLM's llama_eagle3.py / SGLang's llama_eagle3.py, one sequence at a time ----
def reference_chain(w, cfg, k, token, aux, pos, keys, vals):
    """k greedy drafts from the tapped hiddens `aux` [3 * target_hidden]: (target ids, logprobs, last hidden)."""
    d, hq, hk, eps = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps
    L = lambda name: w["midlayer." + name]  # noqa: E731
    hidden = aux @ w["fc.weight"].T  # combine_hidden_states
    drafts, confs = [], []
    for j in range(k):
        embeds = rms(w["embed_tokens.weight"][token], L("input_layernorm.weight"), eps)
        normed = rms(hidden, L("hidden_norm.weight"), eps)
        residual = normed if cfg.norm_before_residual else hidden
        x = torch.cat([embeds, normed])  # [2H]
        q = rope(x @ L("self_attn.q_proj.weight").T, pos + j, d, cfg.rope_theta)
        keys.append(rope(x @ L("self_attn.k_proj.weight").T, pos + j, d, cfg.rope_theta))
        vals.append((x @ L("self_attn.v_proj.weight").T).view(hk, d))
        Ks, Vs = torch.stack(keys), torch.stack(vals)
        heads = [((Ks[:, h // (hq // hk)] @ q[h]) / math.sqrt(d)).softmax(0) @ Vs[:, h // (hq // hk)]
                 for h in range(hq)]
        residual = residual + torch.cat(heads) @ L("self_attn.o_proj.weight").T
        m = rms(residual, L("post_attention_layernorm.weight"), eps)
        residual = residual + (F.silu(m @ L("mlp.gate_proj.weight").T) * (m @ L("mlp.up_proj.weight").T)) \
            @ L("mlp.down_proj.weight").T
        logits = rms(residual, w["norm.weight"], eps) @ w["lm_head.weight"].T  # [draft_vocab]
        draft = int(logits.argmax())
        token = draft + int(w["d2t"][draft])  # d2t: offsets
        drafts.append(token)
        confs.append(float(logits.log_softmax(0)[draft]))
        hidden = residual  # the pre-norm hidden feeds the next step
    return drafts, confs, hidden


def eager_inputs(width: int, seed: int):
    batch = random_draft_batch(CFG, KV, width, seed=seed, num_drafts=K)
    g = torch.Generator().manual_seed(seed + 100)
    batch.inputs["hidden"] = torch.randn(width, 3 * CFG.target_hidden_size, generator=g)
    return batch


def paged_rows(batch, i, live):
    tables = batch.inputs["block_tables"][i]
    rows = [(tables[r // KV.block_size], r % KV.block_size) for r in range(live)]
    return ([batch.k_cache[b, o].clone() for b, o in rows], [batch.v_cache[b, o].clone() for b, o in rows])
