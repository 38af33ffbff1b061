"""The engine table (issue 20 item 5) from run_h200.sh's summaries: per checkpoint, tokens/s with
speculation (circuit drafting), with eager drafting, target-only (the circuit run's in-process
baseline), the speedup over target-only, mean accepted drafts per verify and whether the outputs
were identical; then the transformers MTP peer rows (peer_mtp.json) when present.

    python3 benchmarks/engine_table.py OUT     # reads OUT/engine_*.json, writes OUT/engine_table.md
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

CHECKPOINTS = {"default": "embedded default (examples/data/pystdlib_12l)",
               "8b": "random 8B-class (Llama-3-8B layer shapes, 8 layers, bf16)"}


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def _cell(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def table(out: Path) -> str:
    lines = ["| checkpoint | speculation (circuit) tok/s | eager drafting tok/s | target only tok/s | "
             "speedup | mean accepted / verify (k) | outputs identical |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for key, label in CHECKPOINTS.items():
        spec, eager = _load(out / f"engine_{key}_circuit.json"), _load(out / f"engine_{key}_eager.json")
        if spec is None:
            lines.append(f"| {label} | failed (see engine_{key}_circuit.log) | | | | | |")
            continue
        base = spec.get("baseline") or {}
        lines.append(
            f"| {label} | {_cell(spec['tokens_per_s'])} | {_cell(eager['tokens_per_s'] if eager else None)} | "
            f"{_cell(base.get('tokens_per_s'))} | {_cell(spec.get('speedup'), '.2f')}x | "
            f"{_cell(spec['mean_accepted_per_verify'], '.2f')} ({spec['num_drafts']}) | "
            f"{spec.get('outputs_identical', '-')} |")
    peer = _load(out / "peer_mtp.json")
    if peer is not None:
        lines += ["", f"Batch 1, {peer['prompts']} held-out prompts x {peer['max_new_tokens']} tokens, "
                      f"{peer['dtype']}, transformers {peer.get('transformers')}:", "",
                  "| batch 1 | tokens/s | mean accepted / verify | drafts / verify |", "| --- | --- | --- | --- |"]
        for name, r in peer["rows"].items():
            lines.append(f"| {name} | {_cell(r['tokens_per_s'])} | {_cell(r['mean_accepted_per_verify'], '.2f')} | "
                         f"{r['num_drafts']} |")
        lines.append(f"\nchecks: {json.dumps(peer['checks'])}")
        if peer.get("transformers_error"):
            lines.append(f"\ntransformers: {peer['transformers_error']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    (out / "engine_table.md").write_text(table(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
