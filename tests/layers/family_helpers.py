"""What the model-family layer tests (Qwen2/3, GLM-4.5, Qwen3-Next, the YaRN MoE head) share on
our side of their transformers comparisons: the small KV layout and chain length most of them
draft with, `eager_chain` (our eager draft chain over one sequence whose drafter KV starts as
transformers' cache of a prefix), `draft_beside_transformers` (one random prefix drafted by
transformers' chain and by ours) and `assert_chain_matches` (our outputs and K rows against
transformers'), and the checkpoint-level program-vs-eager checks (bitwise at every width;
the interpreted Triton kernels, closely).

Each test keeps its own assertions on what these return; this module holds only the setup that
was written again in each of them."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import torch

from draft_circuit.circuit.layers.heads import load_head
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.circuit.planner import CompileOptions, compile_draft
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.testing import (DraftBatch, assert_program_matches_eager, random_draft_batch,
                                           run_side_by_side)

if TYPE_CHECKING:  # hf_family_reference imports transformers, which its callers importorskip first
    from tests.layers.hf_family_reference import HfChain

KV = KvLayout(num_blocks=40, block_size=4, max_blocks_per_seq=4)
PREFIX, DRAFTS = 6, 3
SCATTERED = torch.tensor([[3, 1, 4, 2]], dtype=torch.int32)  # one sequence's blocks out of order; 0 is scratch


def eager_chain(head: MtpHead, params: dict[str, torch.Tensor], keys: torch.Tensor, values: torch.Tensor,
                token: int, hidden: torch.Tensor, prefix: int, num_drafts: int = DRAFTS, *, kv: KvLayout = KV,
                tables: torch.Tensor = SCATTERED) -> tuple[dict, torch.Tensor]:
    """One sequence whose drafter KV holds `prefix` rows (transformers' keys / values) over the
    blocks of `tables` (1 x max_blocks_per_seq), drafting `num_drafts` from `token` at position
    `prefix` through EagerRunner; returns the outputs and the K pool's rows 0..prefix+num_drafts
    of that sequence (the prefix as written, then the drafts' own)."""
    c = head.config
    shape = (kv.num_blocks, kv.block_size, c.num_key_value_heads, c.head_dim)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    rows = torch.arange(prefix + num_drafts)
    blocks, slots = tables[0, rows // kv.block_size].long(), rows % kv.block_size
    k_cache[blocks[:prefix], slots[:prefix]] = keys[:prefix]
    v_cache[blocks[:prefix], slots[:prefix]] = values[:prefix]
    inputs = {"tokens": torch.tensor([token], dtype=torch.int32), "hidden": hidden.view(1, -1),
              "positions": torch.tensor([prefix], dtype=torch.int32), "block_tables": tables,
              "live_rows": torch.tensor([prefix], dtype=torch.int32), "active": torch.ones(1, dtype=torch.int32)}
    states = {"k_cache": k_cache, "v_cache": v_cache}
    out = EagerRunner(emit_draft_chain(head, num_drafts, max_width=1, kv=kv), params, states).run(inputs)
    return out, states["k_cache"][blocks, slots]


def draft_beside_transformers(head: MtpHead, weights: dict[str, torch.Tensor], oracle_root: Path, *, seed: int,
                              token: int, prefix: int = PREFIX, num_drafts: int = DRAFTS,
                              **eager_kw: Any) -> tuple[dict, torch.Tensor, HfChain, torch.Tensor]:
    """A random prefix of `prefix` rows and target hidden (torch.Generator seeded `seed`, prefix
    first), drafted from `token` by transformers' chain over `oracle_root`'s checkpoint
    (hf_family_reference.hf_draft_chain) and by eager_chain over the KV transformers cached
    (`eager_kw`: its kv / tables); returns (out, k_rows, transformers' chain, the hidden)."""
    from tests.layers.hf_family_reference import hf_draft_chain

    g = torch.Generator().manual_seed(seed)
    h = head.config.hidden_size
    rows, hidden = torch.randn(prefix, h, generator=g), torch.randn(h, generator=g)
    hf = hf_draft_chain(oracle_root, weights, rows, token, hidden, num_drafts)
    out, k_rows = eager_chain(head, head.bind(weights), hf.keys, hf.values, token, hidden, prefix, num_drafts,
                              **eager_kw)
    return out, k_rows, hf, hidden


def assert_chain_matches(out: dict, k_rows: torch.Tensor, ref: HfChain, prefix: int, *,
                         hidden_atol: float = 1e-5) -> None:
    """eager_chain's (out, k_rows) against transformers' chain over the same prefix: the drafts
    equal, the confidences within 1e-5, the last hidden within `hidden_atol` (rtol 1e-5), and the
    drafts' own K rows (past `prefix`: norms, biases and RoPE as transformers caches them) within
    1e-5."""
    assert out["drafts"][0].tolist() == ref.drafts
    torch.testing.assert_close(out["confidences"][0], torch.tensor(ref.confidences), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out["hidden_out"][0], ref.hidden, atol=hidden_atol, rtol=1e-5)
    torch.testing.assert_close(k_rows[prefix:], ref.keys[prefix:], atol=1e-5, rtol=1e-5)


def assert_checkpoint_program_matches_eager(root: Path, widths: Sequence[int], *, kv: KvLayout = KV,
                                            num_drafts: int = DRAFTS, position_shift: int = 0) -> None:
    """The head `root` loads (fp32), compiled at `widths`, equals its eager chain bitwise at each:
    random_draft_batch(seed=width), positions moved on by `position_shift`, every output and state."""
    head, weights = load_head(root)
    params = head.bind(weights)
    chain = emit_draft_chain(head, num_drafts, max_width=max(widths), kv=kv)

    def batch_for(width: int) -> DraftBatch:
        b = random_draft_batch(head.config, kv, width, seed=width, num_drafts=num_drafts)
        b.inputs["positions"] += position_shift
        return b

    assert_program_matches_eager(chain, params, widths, batch_for)


def interpreted_kernels_match_eager(root: Path, *, kv: KvLayout = KV, num_drafts: int = DRAFTS,
                                    width: int = 3) -> set[tuple[str, str]]:
    """The head `root` loads, compiled at `width` with the interpreted Triton kernels, drafts what
    its eager chain drafts (random_draft_batch seed 9), its hidden within 1e-4; returns the
    (op, kernel) pairs the program launches, for the caller to check the kernels it expects."""
    head, weights = load_head(root)
    params = head.bind(weights)
    chain = emit_draft_chain(head, num_drafts, max_width=4, kv=kv)
    compiled = compile_draft(chain, params, [width], options=CompileOptions(interpret_kernels=True))
    b = random_draft_batch(head.config, kv, width, seed=9, num_drafts=num_drafts)
    r = run_side_by_side(chain, params, compiled, b.inputs, b.states())
    assert torch.equal(r.got["drafts"], r.want["drafts"])
    torch.testing.assert_close(r.got["hidden_out"], r.want["hidden_out"], atol=1e-4, rtol=1e-4)
    return {(x.op, x.kernel) for x in compiled.programs[width].launches}
