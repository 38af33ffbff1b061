"""The benchmark's DeepSeek-V3 config (benchmarks/deepseek_head.py): its floor equals a hand
count (fp8 projections with row scales, bf16 absorbed W_UK^T / W_UV and heads, latent KV rows,
expected distinct fp8 experts), and `--dry-run --configs deepseek_v3` runs every strategy on CPU
(the torch peers on benchmarks/torch_mtp_mla.py) with drafts equal to the eager oracle's; the peer
shares the embedding, lm-head and eh_proj tensors with the circuit's params."""
import json

from benchmarks import deepseek_head as dsh
import torch

from benchmarks import draft_chain as dc
from benchmarks import torch_mtp_mla as tmla
from draft_circuit.circuit.layers.moe import EXPERTS_GATE_UP, GATE
from draft_circuit.ops.moe import expected_distinct_experts


def test_deepseek_v3_floor_by_hand():
    c = dsh.DEEPSEEK_V3
    h, heads, v = 7168, 128, 129280
    fp8 = lambda rows, cols: rows * cols + rows * -(-cols // 128) * 4  # noqa: E731  fp8 + row scales
    bf16 = lambda *shape: 2 * __import__("math").prod(shape)  # noqa: E731
    attention = (fp8(1536, h) + bf16(1536) + fp8(heads * 128, 1536) + fp8(heads * 64, 1536) + fp8(512, h)
                 + fp8(64, h) + bf16(512) + bf16(heads, 512, 128) + bf16(heads, 128, 512) + fp8(h, heads * 128))
    mtp = bf16(h) * 2 + bf16(h, 2 * h) + bf16(h) * 2 + bf16(256, h) + 256 * 4 + bf16(4096, h) + bf16(h, 2048) \
        + bf16(h) + bf16(v, h) + 32 * 4  # ... shared_head.norm, the lm-head, rope.inv_freq (fp32)
    expert = 4096 * h + 32 * 56 * 4 + h * 2048 + 56 * 16 * 4  # gate_up and down fp8 with block scales
    k, n, live = 3, 8, 500
    parts = dc.floor_bytes(c, n, k, live, 2, 64)
    assert parts["weights"] == k * (attention + mtp)
    assert parts["experts"] == k * expected_distinct_experts(256, 8, n) * expert
    assert parts["kv_read"] == n * sum(live + j + 1 for j in range(k)) * 576 * 2
    assert parts["kv_write"] == n * k * 576 * 2
    assert 2.3e9 < parts["weights"] / k < 2.4e9  # the lm-head (1.85 GB) dominates a step


def test_deepseek_dry_run_every_strategy_agrees_with_eager(tmp_path):
    data = dc.main(["--dry-run", "--configs", "deepseek_v3", "--out", str(tmp_path), "--iters", "2"])
    cfg = data["configs"]["tiny_deepseek"]
    row = cfg["widths"]["3"]
    assert set(row) == set(dc.STRATEGIES)
    for strategy, entry in row.items():  # fp32: every strategy drafts what the oracle drafts
        assert "error" not in entry, (strategy, entry)
        assert entry["drafts_agree_eager"] == 1.0, strategy
    assert cfg["torch_peer"] == tmla.PEER_NOTE and "no plain-torch MLA peer" not in json.dumps(data)
    md = (tmp_path / "RESULTS.md").read_text()
    assert tmla.PEER_NOTE in md


def test_deepseek_bench_peer_shares_the_big_tensors():
    s, configs, _ = dc.build(dc.parse_args(["--dry-run", "--configs", "deepseek_v3"]))
    b = dc.Bench("tiny_deepseek", configs["tiny_deepseek"], s)
    for name in ("embed_tokens.weight", "shared_head.head.weight", "eh_proj.weight", GATE):
        assert b.peer_params[name].data_ptr() == b.params[name].data_ptr(), name
    assert b.peer_params[EXPERTS_GATE_UP].dtype == s.dtype  # dequantised; the circuit's stay fp8
    assert b.params[EXPERTS_GATE_UP].dtype == torch.float8_e4m3fn
    pool, = b.peer_caches
    assert torch.equal(pool, tmla.latent_pool(b.k_cache, b.v_cache))
