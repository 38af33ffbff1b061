"""CPU smoke test of the draft-chain benchmark's issue-18 configs (benchmarks/draft_heads.py): the
torch peer over a reduced vocabulary drafts what the project's eager runner drafts, the floors of
a subset head and of EAGLE-3 equal hand counts, and `--dry-run --configs 8b_vocab32k,eagle3_8b`
runs end to end (EAGLE-3: circuit strategies, checked against the eager oracle)."""
import json

import pytest
import torch

from benchmarks import draft_chain as dc
from benchmarks import draft_heads as dh
from benchmarks import torch_mtp as tm
from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.draft_vocab import bind_draft_vocab
from draft_circuit.circuit.layers.eagle3 import Eagle3Config
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.testing import random_draft_batch, random_mtp_weights

CFG = MtpConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=512)
KV = KvLayout(num_blocks=40, block_size=4, max_blocks_per_seq=8)
K = 4


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest.py beside this file


def test_torch_peer_over_a_subset_equals_the_eager_runner():
    head = MtpHead(CFG)
    params = bind_draft_vocab(head.bind(random_mtp_weights(CFG, seed=2)), head, dh.subset_vocab(300, 80, 1))
    chain = emit_draft_chain(head, K, max_width=4, kv=KV, draft_vocab=80)
    batch = random_draft_batch(CFG, KV, 3, seed=9, num_drafts=K)
    want = EagerRunner(chain, params, batch.clone_states()).run(batch.inputs)
    st, x = batch.clone_states(), batch.inputs
    drafts, confs, _ = tm.mtp_chain(params, tm.StepShape(CFG, KV.block_size, KV.max_blocks_per_seq),
                                    tm.inv_freq(CFG.head_dim, CFG.rope_theta, "cpu"), K, x["tokens"],
                                    x["hidden"], x["positions"], x["block_tables"].clamp(min=0),
                                    x["live_rows"], st["k_cache"], st["v_cache"])
    assert torch.equal(drafts, want["drafts"])
    torch.testing.assert_close(confs, want["confidences"], atol=1e-5, rtol=1e-5)


def test_floors_by_hand():
    tiny = MtpConfig(vocab_size=10, hidden_size=4, intermediate_size=6, num_attention_heads=2,
                     num_key_value_heads=1, head_dim=2, rms_norm_eps=1e-6, rope_theta=10000.0,
                     num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=64)
    full = dc.floor_bytes(tiny, width=3, num_drafts=2, kv_rows=10, dtype_bytes=2, max_blocks=4)
    sub = dc.floor_bytes(tiny, width=3, num_drafts=2, kv_rows=10, dtype_bytes=2, max_blocks=4, draft_vocab=6)
    assert full["weights"] - sub["weights"] == 2 * (10 - 6) * 4 * 2  # k x the rows left out, bf16
    assert sub["kv_read"] == full["kv_read"] and sub["activations"] == full["activations"]
    e3 = Eagle3Config(**{**tiny.__dict__, "draft_vocab_size": 7, "target_hidden_size": 3})
    # a step: norms input, hidden, post-attention, final 4 x 4 = 16; q 4 x 8 = 32; k, v 2 x 8 each;
    # o 4 x 4 = 16; gate, up, down 24 each; lm head 7 x 4 = 28 -> 196; fc 4 x 9 = 36 once
    parts = dc.floor_bytes(e3, width=3, num_drafts=2, kv_rows=10, dtype_bytes=2, max_blocks=4)
    assert 16 + 32 + 2 * 16 + 16 + 3 * 24 + 28 == 196
    assert parts["weights"] == 2 * (2 * 196) + 2 * 36
    # the input hidden is 3 x 3 wide: 9 x 2 bytes a row instead of 4 x 2
    assert parts["activations"] - full["activations"] == 3 * (9 - 4) * 2


def test_8b_shapes():
    step, once = dh.head_bytes(dh.EAGLE3_8B, 2, None)
    assert once == 4096 * 3 * 4096 * 2
    full, _ = dh.head_bytes(dc.CONFIGS["8b"], 2, None)
    sub, _ = dh.head_bytes(dc.CONFIGS["8b"], 2, 32768)
    assert full - sub == (128256 - 32768) * 4096 * 2
    assert dh.head_bytes(dh.EAGLE3_8B, 2, 16384)[0] == step - (32000 - 16384) * 4096 * 2


def test_dry_run_of_the_issue_18_configs(tmp_path):
    dc.main(["--dry-run", "--configs", "8b_vocab32k,eagle3_8b", "--out", str(tmp_path),
             "--results-md", str(tmp_path / "R.md")])
    saved = json.loads(next(tmp_path.glob("*-cpu.json")).read_text())
    assert set(saved["configs"]) == {"tiny", "tiny_vocab", "tiny_eagle3"}
    vocab, e3 = saved["configs"]["tiny_vocab"], saved["configs"]["tiny_eagle3"]
    assert vocab["draft_vocab"] == 96 and vocab["full_vocab_config"] == "tiny"
    for strategy, entry in vocab["widths"]["3"].items():
        assert entry["drafts_agree_eager"] == 1.0, strategy  # fp32: the peer maps ids as the circuit does
    circuit = vocab["widths"]["3"]["circuit"]
    assert circuit["x_full_vocab_floor"] == pytest.approx(circuit["median_us"] / saved["configs"]["tiny"]["floors"]["3"]["floor_us"])
    assert e3["head"] == "Eagle3Head"
    for strategy in dc.PEER_STRATEGIES:
        assert e3["widths"]["3"][strategy]["error"] == dc.NO_PEER
    for strategy in ("circuit", "circuit_fast"):
        assert e3["widths"]["3"][strategy]["drafts_agree_eager"] == 1.0
    text = (tmp_path / "R.md").read_text()
    assert "lm-head over a 96-id draft vocabulary" in text and "circuit over the `tiny` chain's floor" in text
