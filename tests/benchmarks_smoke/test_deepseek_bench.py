"""The benchmark's DeepSeek-V3 config (benchmarks/deepseek_head.py): its floor equals a hand
count (fp8 projections with row scales, bf16 absorbed W_UK^T / W_UV and heads, latent KV rows,
expected distinct fp8 experts), and `--dry-run --configs deepseek_v3` runs on CPU with the
circuit's drafts equal to the eager oracle's (no plain-torch MLA peer: those strategies skip)."""
import json

from benchmarks import deepseek_head as dsh
from benchmarks import draft_chain as dc
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


def test_deepseek_dry_run_circuit_agrees_with_eager(tmp_path):
    data = dc.main(["--dry-run", "--configs", "deepseek_v3", "--out", str(tmp_path), "--iters", "2"])
    cfg = data["configs"]["tiny_deepseek"]
    rows = {r["strategy"]: r for r in cfg["rows"] if r["width"] == 3} if "rows" in cfg else None
    text = json.dumps(data)
    assert "no plain-torch MLA peer" in text
    assert rows is None or rows["circuit"]["drafts_agree_eager"] == 1.0
    assert '"drafts_agree_eager": 1.0' in text
