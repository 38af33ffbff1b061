"""Peer row (issue 20 item 6): transformers' own MTP speculative decoding beside the engine, at
batch 1, on the same checkpoint, prompts and device.

    PYTHONPATH=$PWD python3 benchmarks/peer_mtp.py --device cuda --out $OUT/peer_mtp.json

What transformers runs (read from its source, 5.24.0: generation/candidate_generator.py
`MTPCandidateGenerator`, modeling_layers.py `MtpModel`): `generate(..., use_mtp=True)` is assisted
decoding (batch 1 only) whose candidates come from the checkpoint's MTP layers, one draft token
per MTP layer per verify, the first layer fed the main model's last hidden state (after the final
norm). With one MTP layer, as DeepSeek-V3 and this checkpoint have, it drafts exactly one token a
step; it does not chain the layer k times as the engine does (so the engine is timed at k = 1 as
well as at its default k = 4).

It does not run on a Llama + MTP checkpoint as stored: `MTPCandidateGenerator` needs
`config.num_mtp_layers` (only DeepSeek-V3-, GLM-4.5-style configs define it; LlamaConfig has no
such field, and our config.json's `num_nextn_predict_layers` is mapped to it only by those
classes) and `MtpModel.get_mtp_weights_regex` needs the main model class to list the MTP layer's
key pattern in `_keys_to_ignore_on_load_unexpected` (LlamaForCausalLM lists none). This script
sets both on the loaded model (`enable_mtp`); everything else is transformers' code unchanged: it
loads the DeepSeek-V3-named layer itself (`model.layers.{L}.` -> enorm, hnorm, eh_proj, the Llama
decoder block, shared_head.norm as its post_norm; embedding and head shared with the target).

Checked per prompt: transformers' MTP output == transformers' plain greedy output; the engine's
speculative output == the engine's target-only output (its invariant) and, reported, how many
prompts the engine's greedy output equals transformers' greedy output (fp32: all but near ties).
Mean accepted for transformers: (generated - 1 - verifies) / verifies, verifies = main-model
forwards after the prefill (the last verify may be cut by max_new_tokens).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from examples.engine import Engine, EngineConfig, Request, load_checkpoint
from examples.engine.checkpoints import default_prompts, encode_prompts


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def enable_mtp(model) -> int:
    """The two settings transformers' MTP path needs that a Llama model lacks (module docstring).
    Returns the number of MTP layers the checkpoint declares."""
    cfg = model.config
    layers = int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)
    if layers < 1:
        raise SystemExit(f"{cfg.name_or_path}: config.json declares no MTP layer (num_nextn_predict_layers)")
    cfg.num_mtp_layers = layers
    first = cfg.num_hidden_layers
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{first + i}\..*" for i in range(layers)]
    return layers


def hf_rows(path: str, prompts: list[list[int]], max_new: int, device: str, dtype: torch.dtype) -> dict:
    from draft_circuit.installed import prefer_installed

    prefer_installed("kernels")  # run from the root, our kernels/ would shadow transformers' own
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    model = model.to(device).eval()
    mtp_layers = enable_mtp(model)
    forwards = [0]
    model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))

    def gen(ids: list[int], use_mtp: bool) -> list[int]:
        x = torch.tensor([ids], device=device)
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False, pad_token_id=0,
                             eos_token_id=None, use_mtp=use_mtp)
        return out[0, len(ids):].tolist()

    rows = {}
    for mode in (False, True):
        with torch.no_grad():
            gen(prompts[0], mode)  # warm-up (kernels, the MTP model's load)
            sync(device)
            forwards[0], outs, start = 0, [], time.perf_counter()
            for p in prompts:
                outs.append(gen(p, mode))
            sync(device)
        wall = time.perf_counter() - start
        tokens = sum(len(o) for o in outs)
        verifies = forwards[0] - len(prompts)  # one prefill forward a prompt
        rows["transformers_mtp" if mode else "transformers_greedy"] = {
            "outputs": outs, "generated_tokens": tokens, "wall_s": round(wall, 3),
            "tokens_per_s": round(tokens / wall, 1),
            "mean_accepted_per_verify": round((tokens - len(prompts) - verifies) / verifies, 3)
            if mode and verifies else None,
            "num_drafts": mtp_layers if mode else 0}
    return rows


def engine_row(path: str, prompts: list[list[int]], max_new: int, device: str, dtype: torch.dtype,
               k: int | None) -> dict:
    config = EngineConfig(speculate=k is not None, num_drafts=k or 1, forward="circuit",
                          target_forward="circuit" if device.startswith("cuda") else "eager",
                          widths=(1,), max_batch=1, dtype=dtype, device=device)
    engine = Engine(load_checkpoint(path, with_mtp=k is not None), config)
    engine.generate([Request(prompts[0], max_new)])  # warm-up
    engine.stats = type(engine.stats)()
    sync(device)
    result = engine.generate([Request(p, max_new) for p in prompts])
    sync(device)
    s = result.stats
    return {"outputs": result.outputs, "generated_tokens": s.generated, "wall_s": round(s.wall_s, 3),
            "tokens_per_s": round(s.generated / s.wall_s, 1),
            "mean_accepted_per_verify": round(s.accepted / s.verifies, 3) if k and s.verifies else None,
            "num_drafts": k or 0}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", type=Path, help="Llama + DeepSeek-V3-MTP directory (default: the embedded one)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, required=True, help="results JSON (a .md table beside it)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (as the engine's CLI)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    checkpoint = load_checkpoint(args.checkpoint)
    path = str(checkpoint.path)
    prompts = encode_prompts(default_prompts(checkpoint, args.num_prompts), checkpoint)
    dtype = getattr(torch, args.dtype)
    rows = {"engine_target_only": engine_row(path, prompts, args.max_new_tokens, args.device, dtype, None),
            "engine_k1": engine_row(path, prompts, args.max_new_tokens, args.device, dtype, 1),
            "engine_k4": engine_row(path, prompts, args.max_new_tokens, args.device, dtype, 4)}
    try:
        rows |= hf_rows(path, prompts, args.max_new_tokens, args.device, dtype)
        hf_error = None
    except ImportError as e:
        hf_error = f"transformers is not importable here: {e}"
    except Exception as e:  # noqa: BLE001 - the peer's failure is a result to record, not a crash
        hf_error = f"transformers' MTP generation failed: {type(e).__name__}: {e}"
    base = rows["engine_target_only"]["outputs"]
    checks = {f"{name}_equals_engine_target_only": rows[name]["outputs"] == base
              for name in ("engine_k1", "engine_k4")}
    if "transformers_greedy" in rows:
        hf = rows["transformers_greedy"]["outputs"]
        checks["transformers_mtp_equals_transformers_greedy"] = rows["transformers_mtp"]["outputs"] == hf
        checks["prompts_engine_greedy_equals_transformers_greedy"] = sum(a == b for a, b in zip(base, hf))
    ref = rows["engine_target_only"]["tokens_per_s"]
    table = ["| batch 1 | tokens/s | x engine target-only | mean accepted / verify | drafts / verify |",
             "| --- | --- | --- | --- | --- |"]
    for name, r in rows.items():
        table.append(f"| {name} | {r['tokens_per_s']} | {r['tokens_per_s'] / ref:.2f} | "
                     f"{r['mean_accepted_per_verify'] if r['mean_accepted_per_verify'] is not None else '-'} | "
                     f"{r['num_drafts']} |")
    result = {"checkpoint": path, "device": args.device, "dtype": args.dtype,
              "gpu": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
              "torch": torch.__version__, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "checks": checks, "transformers_error": hf_error,
              "rows": {n: {k: v for k, v in r.items() if k != "outputs"} for n, r in rows.items()},
              "outputs": {n: r["outputs"] for n, r in rows.items()}}
    try:
        import transformers
        result["transformers"] = transformers.__version__
    except ImportError:
        result["transformers"] = None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    md = "\n".join(table) + f"\n\nchecks: {json.dumps(checks)}" + (f"\n\n{hf_error}" if hf_error else "") + "\n"
    args.out.with_suffix(".md").write_text(md)
    print(md)
    ok = all(v for k, v in checks.items() if k.endswith("_only") or k.startswith("transformers_mtp"))
    return 0 if ok and hf_error is None else 1


if __name__ == "__main__":
    sys.exit(main())
