#!/usr/bin/env bash
# Everything the H200 run records, in one command (the device is lent briefly): the GPU test
# suite, the draft-chain benchmark, and the engine table: tokens/s with circuit / eager drafting
# and target-only, the speedup and mean accepted, on the embedded default and on a random 8B-class
# checkpoint, with the transformers MTP peer row beside the default (engine_table.md).
# The decode-step benchmark (issue 14) and the input guard's cost (issue 19) are parts too.
# Usage (repo root, on the GPU machine): OUT=dir [PARTS="tests bench decode guard engine"] [TESTS=tests]
#   [TEST_TIMEOUT=s] bash benchmarks/run_h200.sh
set -u
PARTS=${PARTS:-tests bench decode guard engine}
has() { [[ " $PARTS " == *" $1 "* ]]; }
export PYTHONPATH="${PYTHONPATH:-}:$PWD" PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
mkdir -p "$OUT"
if has tests; then
  # -v writes a line per test as it ends, so a run cut by the timeout still names what failed
  # and how far it got (the whole GPU suite took ~300 s on 2026-12-02)
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest -m cuda -v -p no:cacheprovider -rf ${TESTS:-tests} \
    > "$OUT/cuda_tests.log" 2>&1
  echo "== cuda tests (rc $?): $(grep -c ' PASSED' "$OUT/cuda_tests.log") passed, last: $(grep -E ' (PASSED|FAILED|ERROR|XFAIL|SKIPPED)' "$OUT/cuda_tests.log" | tail -1)"
  grep -E ' (FAILED|ERROR)' "$OUT/cuda_tests.log" | grep -v '^FAILED\|^ERROR' | head -40
  tail -3 "$OUT/cuda_tests.log"
fi
if has bench; then
  timeout 160 python3 benchmarks/draft_chain.py --out "$OUT" --results-md "$OUT/RESULTS.md" > "$OUT/draft_chain.log" 2>&1
  tail -20 "$OUT/draft_chain.log"
fi
if has decode; then
  timeout 240 python3 -m benchmarks.decode_step --device cuda --configs small,8b,moe --widths 1,8,32,64 \
    --out "$OUT/decode_step.json" --results-md "$OUT/decode_step.md" > "$OUT/decode_step.log" 2>&1
  echo "== decode_step (rc $?)"; cat "$OUT/decode_step.md" 2>/dev/null
fi
if has guard; then
  timeout 150 python3 -m benchmarks.guard_cost --out "$OUT/guard.json" > "$OUT/guard.log" 2>&1
  echo "== guard_cost (rc $?)"; tail -4 "$OUT/guard.log"
fi
has engine || exit 0
# The engine table (issue 20 item 5): per checkpoint, speculation with circuit drafting (its
# summary carries the in-process target-only baseline, the speedup and the outputs-identical
# check), eager drafting, and the transformers MTP peer row at batch 1 (benchmarks/peer_mtp.py);
# benchmarks/engine_table.py turns the summaries into $OUT/engine_table.md.
engine() {  # name, then engine flags
  local name=$1; shift
  timeout 300 python3 -m examples.engine --device cuda --quiet --summary-json "$OUT/engine_$name.json" "$@" \
    > "$OUT/engine_$name.log" 2>&1; echo "== $name (rc $?): $(grep -E 'tokens/s|accepted' "$OUT/engine_$name.log" | tr '\n' ' ')"
}
engine default_circuit --forward circuit
engine default_eager --forward eager --no-compare
timeout 300 python3 benchmarks/peer_mtp.py --device cuda --out "$OUT/peer_mtp.json" > "$OUT/peer_mtp.log" 2>&1
echo "== peer (rc $?)"; tail -12 "$OUT/peer_mtp.log"
rm -rf /tmp/ck8b  # write_random_checkpoint refuses a directory holding one (a warm machine's)
python3 - <<'PY'
import json, os, torch
from draft_circuit.circuit.layers.checkpoint import write_random_checkpoint
from draft_circuit.circuit.layers.config import MtpConfig
# Llama-3-8B's layer shapes and vocabulary, 8 of its 32 layers (a target step ~8 draft steps in
# weights; random weights: acceptance ~0, so this row measures costs, not a speedup)
cfg = MtpConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                num_hidden_layers=8, tie_word_embeddings=False, max_position_embeddings=8192)
write_random_checkpoint("/tmp/ck8b", cfg, dtype=torch.bfloat16, mtp_shares_embed=True, mtp_shares_head=True)
g = torch.Generator().manual_seed(0)
json.dump([torch.randint(0, cfg.vocab_size, (48,), generator=g).tolist() for _ in range(8)],
          open(os.environ["OUT"] + "/prompts_8b.json", "w"))
PY
common=(--checkpoint /tmp/ck8b --dtype bfloat16 --prompts "$OUT/prompts_8b.json" --max-batch 8 --max-new-tokens 32 --kv-blocks 512 --max-rows 64)
engine 8b_circuit --forward circuit "${common[@]}"
engine 8b_eager --forward eager --no-compare "${common[@]}"
python3 benchmarks/engine_table.py "$OUT" && cat "$OUT/engine_table.md"
