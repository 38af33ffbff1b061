"""Train the engine's embedded default: a 12-layer byte-level Llama target and its one
DeepSeek-V3-style MTP layer, on the Python standard library's own source, saved as a Hugging
Face checkpoint (bf16 safetensors, config.json, the training log and held-out prompts).

    python -m examples.train_tiny --device cuda --out examples/data/pystdlib_12l   # ~3 min, H200
    # the MTP head distilled further from that checkpoint, the target kept bit for bit:
    python -m examples.train_tiny --device cuda --init examples/data/pystdlib_12l --steps 0 \
        --distil-steps 3000 --out examples/data/pystdlib_12l

Why this shape (CONFIG): 12 layers of width 128 beside one MTP layer of the same width, so one
draft step is about 1/12 of a target step in weights and under 1/6 in ops (the circuit's target
runs ~15 ops a layer, a draft step ~24 in all), which is what lets speculation pay where cost is
per-op overhead (this CPU, and GPU launches); vocabulary 256 (bytes), 2.7M parameters, 5.4 MB.

Phase 1 trains the target (next-byte loss) and the MTP head (the byte after next) jointly;
phase 2 freezes the target and distils its next-byte distribution into the MTP head's k-step
chain, which is what acceptance measures. The chain is trained as the proposer runs it: step s
at position p reads the drafter's own hidden from step s-1 at p-1 and attends to exact rows up
to the chain's start p-s+1 and to the chain's own rows after it (see `chain_attention`).

On CUDA: bf16 autocast over fp32 master weights, fused AdamW, the corpus on the device. Each
phase's learning-rate schedule runs on progress = max(step / steps, elapsed / its share of
--max-minutes), so a slower device finishes the schedule (fewer steps) within the cap. The
held-out split is whole files (HELD_OUT); the held-out teacher-forced acceptance is measured in
fp32 on the bf16-rounded weights, i.e. on the checkpoint as written. On CPU with a large cap the
run is deterministic for a seed and thread count (the tests rely on it). Nothing imports this
script at run time.

The corpus (the standard library's files, the held-out split) is examples/stdlib_corpus.py, which
the engine's `--draft-vocab N` reads too; the rest is one recipe a user runs from top to bottom
(the model, the two training phases, the export and its load for `--init`), which nothing else
imports. One module on purpose (it runs past 400 lines): a user reads and edits the recipe as one
file, and its pieces share the model class and its checkpoint names (`checkpoint_tensors`, which
both the export and `--init`'s load walk), so a split would make a package of what one command runs.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import shutil
import sys
import sysconfig
import time
from pathlib import Path
from typing import Callable, cast

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from draft_circuit.circuit.layers.config import MtpConfig
from examples.stdlib_corpus import read_bytes, stdlib_files, write_prompts

# the embedded default's shape (examples/data/pystdlib_12l)
CONFIG = MtpConfig(
    vocab_size=256, hidden_size=128, intermediate_size=384, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
    num_hidden_layers=12, tie_word_embeddings=False, max_position_embeddings=2048,
)
DEFAULT_OUT = Path(__file__).parent / "data" / "pystdlib_12l"

# ---- the model: the same maths as the circuit's ops (fp32 RMSNorm, rotate-half RoPE, GQA) ----
def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [B, heads, T, D], pos [T]; in fp32."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device).float() / d)
    ang = pos.float()[:, None] * inv
    cos, sin = ang.cos(), ang.sin()
    x = x.float()
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Block(nn.Module):
    """A Llama decoder layer whose attention is given as a function of (q, k, v)."""

    def __init__(self, c: MtpConfig) -> None:
        super().__init__()
        h, d = c.hidden_size, c.head_dim
        self.c = c
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(h, c.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(h, c.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(h, c.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * d, h, bias=False)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)

    def qkv(self, x: torch.Tensor, pos: torch.Tensor):
        """q, k, v [B, heads, T, D] (k, v repeated over the query heads), in the projections'
        dtype (bf16 under autocast: what the fused attention kernels take)."""
        c, (b, t, _) = self.c, x.shape
        a = rmsnorm(x, self.input_layernorm, c.rms_norm_eps)
        split = lambda y: y.view(b, t, -1, c.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q_proj(a)), split(self.k_proj(a)), split(self.v_proj(a))
        groups = c.num_attention_heads // c.num_key_value_heads
        k = rope(k, pos, c.rope_theta).to(v.dtype).repeat_interleave(groups, 1)
        return rope(q, pos, c.rope_theta).to(v.dtype), k, v.repeat_interleave(groups, 1)

    def finish(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """o [B, heads, T, D] -> the block's output (both residuals; the residual stays fp32)."""
        b, _, t, _ = o.shape
        x = x + self.o_proj(o.transpose(1, 2).reshape(b, t, -1))
        m = rmsnorm(x, self.post_attention_layernorm, self.c.rms_norm_eps)
        return x + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))

    def forward(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x, pos)
        return self.finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True))


class TinyLlama(nn.Module):
    def __init__(self, c: MtpConfig) -> None:
        super().__init__()
        self.c = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(Block(c) for _ in range(c.num_hidden_layers))
        self.norm = nn.Parameter(torch.ones(c.hidden_size))
        self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        # the MTP layer (DeepSeek-V3): shares the embedding and the output head with the target
        self.enorm = nn.Parameter(torch.ones(c.hidden_size))
        self.hnorm = nn.Parameter(torch.ones(c.hidden_size))
        self.eh_proj = nn.Linear(2 * c.hidden_size, c.hidden_size, bias=False)
        self.mtp = Block(c)
        self.shared_norm = nn.Parameter(torch.ones(c.hidden_size))

    def mtp_parameters(self) -> list[nn.Parameter]:
        return [self.enorm, self.hnorm, self.shared_norm, *self.eh_proj.parameters(),
                *self.mtp.parameters()]

    def target(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] -> (final-norm hiddens [B, T, H] fp32, logits [B, T, V])."""
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, pos)
        h = rmsnorm(x, self.norm, self.c.rms_norm_eps)
        return h, self.lm_head(h)

    def chain(self, tokens: torch.Tensor, h: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The MTP chain, teacher-forced. Over positions p = 1..T-1 (index p-1): step s reads
        token t_p and the hidden at p-1 (the target's for s = 1, else the drafter's own from
        step s-1) and predicts t_{p+1}. Returns each step's logits [B, T-1, V]."""
        c, eps = self.c, self.c.rms_norm_eps
        tok, pos = tokens[:, 1:], torch.arange(1, tokens.shape[1], device=tokens.device)
        emb = rmsnorm(self.embed_tokens(tok), self.enorm, eps)
        hidden, keys, values, logits = h[:, :-1], [], [], []
        for s in range(steps):
            # fp32 out, as the target's residual stream (autocast would hand back bf16)
            x = self.eh_proj(torch.cat([emb, rmsnorm(hidden, self.hnorm, eps)], dim=-1)).float()
            q, k, v = self.mtp.qkv(x, pos)
            keys.append(k)
            values.append(v)
            x = self.mtp.finish(x, chain_attention(q, keys, values, c.head_dim))
            logits.append(self.lm_head(rmsnorm(x, self.shared_norm, eps)))
            # the next step at p reads this step's hidden at p-1 (row 0 has none: zeros, masked)
            hidden = F.pad(x[:, :-1], (0, 0, 1, 0))
        return logits


def chain_attention(q: torch.Tensor, keys: list, values: list, head_dim: int) -> torch.Tensor:
    """Step s = len(keys) at query index p attends to exact rows (step 1's keys) j <= p-s+1 and
    to the chain's rows after them: step m's key at p-s+m, m = 2..s (the proposer's drafter KV
    during one propose). q and keys: [B, heads, N, D]. Step 1 is plain causal attention (the
    fused kernel: no N x N score matrix in memory)."""
    s, n = len(keys), q.shape[2]
    if s == 1:
        return F.scaled_dot_product_attention(q, keys[0], values[0], is_causal=True)
    scale = 1.0 / math.sqrt(head_dim)
    scores = (q @ keys[0].transpose(-1, -2)).float() * scale               # [B, h, N, N]
    p, j = torch.arange(n, device=q.device)[:, None], torch.arange(n, device=q.device)[None, :]
    scores = scores.masked_fill(j > p - s + 1, float("-inf"))
    extra_scores, extra_values = [], []
    for m in range(2, s + 1):
        shift = s - m  # step m's row at p - shift
        k = F.pad(keys[m - 1], (0, 0, shift, 0))[:, :, :n]
        extra_scores.append((q.float() * k.float()).sum(-1, keepdim=True) * scale)
        extra_values.append(F.pad(values[m - 1], (0, 0, shift, 0))[:, :, :n])
    probs = torch.cat([scores, *extra_scores], dim=-1).softmax(-1)
    out = probs[..., :n].to(values[0].dtype) @ values[0]
    for i, v in enumerate(extra_values):
        out = out + probs[..., n + i:n + i + 1] * v
    return out.to(values[0].dtype)


def chain_loss(logits: list[torch.Tensor], labels: torch.Tensor, teacher: torch.Tensor | None) -> torch.Tensor:
    """Mean over steps; step s's first s-1 positions have no full chain behind them (masked).
    labels [B, T-1] (t_{p+1}); teacher: the target's logits at p [B, T-1, V] (phase 2: KL)."""
    total = logits[0].new_zeros((), dtype=torch.float32)
    for s, lg in enumerate(logits):
        lg = lg[:, s:].float()
        if teacher is None:
            total = total + F.cross_entropy(lg.reshape(-1, lg.shape[-1]), labels[:, s:].reshape(-1))
        else:
            t = teacher[:, s:].float().log_softmax(-1)
            total = total + F.kl_div(lg.log_softmax(-1), t, log_target=True, reduction="none").sum(-1).mean()
    return total / len(logits)


def batch(data: torch.Tensor, size: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """`size` windows of `length` bytes at random starts (drawn on the CPU generator, so a seed
    gives the same windows on any device), gathered where `data` lives."""
    starts = torch.randint(0, len(data) - length - 1, (size,), generator=gen).to(data.device)
    return data[starts[:, None] + torch.arange(length, device=data.device)].long()


@torch.no_grad()
def evaluate(model: TinyLlama, data: torch.Tensor, steps: int, gen: torch.Generator, *,
             seqs: int = 64, length: int = 512, per_batch: int = 16) -> dict:
    """Held-out, fp32: the target's bits per byte, each chain step's agreement with the
    target's greedy byte, and teacher-forced accepted drafts per verify at k = steps (a chain
    starting at p is accepted through step s while steps 1..s all hit the target's greedy)."""
    length = min(length, len(data) - 2)
    loss_sum, agree_sum, accepted_sum, batches = 0.0, [0.0] * steps, 0.0, 0
    per_batch = min(per_batch, seqs)
    for _ in range(max(1, seqs // per_batch)):
        tokens = batch(data, per_batch, length, gen)
        h, logits = model.target(tokens)
        loss_sum += float(F.cross_entropy(logits[:, :-1].reshape(-1, 256).float(), tokens[:, 1:].reshape(-1)))
        greedy = logits[:, 1:-1].argmax(-1)  # the target's choice at p = 1..T-2
        starts = greedy.shape[1] - steps + 1
        run = torch.ones_like(greedy[:, :starts], dtype=torch.bool)
        for s, lg in enumerate(model.chain(tokens[:, :-1], h[:, :-1], steps)):
            hit = lg.argmax(-1) == greedy
            agree_sum[s] += float(hit[:, s:].float().mean())
            run = run & hit[:, s:s + starts]
            accepted_sum += float(run.float().mean())
        batches += 1
    return {"target_bits_per_byte": round(loss_sum / batches / math.log(2), 3),
            "step_agreement": [round(a / batches, 3) for a in agree_sum],
            "teacher_forced_accepted_per_verify": round(accepted_sum / batches, 3),
            "num_drafts": steps, "bytes_scored": batches * per_batch * length}


def checkpoint_tensors(model: TinyLlama) -> dict[str, torch.Tensor]:
    """The model's tensors by checkpoint name (HF names; the MTP layer at model.layers.{L} in
    the DeepSeek-V3 naming, its embedding and head the target's own tensors under two names)."""
    L = model.c.num_hidden_layers
    t: dict[str, torch.Tensor] = {"model.embed_tokens.weight": model.embed_tokens.weight,
                                  "model.norm.weight": model.norm, "lm_head.weight": model.lm_head.weight}

    def block(prefix: str, b: Block) -> None:
        t[prefix + "input_layernorm.weight"] = b.input_layernorm
        t[prefix + "post_attention_layernorm.weight"] = b.post_attention_layernorm
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[f"{prefix}self_attn.{name}.weight"] = getattr(b, name).weight
        for name in ("gate_proj", "up_proj", "down_proj"):
            t[f"{prefix}mlp.{name}.weight"] = getattr(b, name).weight

    for i, layer in enumerate(model.layers):
        block(f"model.layers.{i}.", cast(Block, layer))
    m = f"model.layers.{L}."
    block(m, model.mtp)
    t.update({m + "embed_tokens.weight": model.embed_tokens.weight, m + "enorm.weight": model.enorm,
              m + "hnorm.weight": model.hnorm, m + "eh_proj.weight": model.eh_proj.weight,
              m + "shared_head.norm.weight": model.shared_norm,
              m + "shared_head.head.weight": model.lm_head.weight})
    return t


def export(model: TinyLlama, out: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """config.json and model.safetensors (`checkpoint_tensors`' names, in `dtype`)."""
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to("cpu", dtype).contiguous().clone()
               for k, v in checkpoint_tensors(model).items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    config = model.c.to_hf() | {"torch_dtype": str(dtype).removeprefix("torch."),
                                "draft_circuit": {"tokenizer": "bytes"}}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_into(model: TinyLlama, path: Path) -> None:
    """`export`'s checkpoint at `path` into `model` (fp32 masters holding its values exactly):
    what `--init` continues from. Raises SystemExit naming what does not fit: another shape
    (config.json), a missing or extra tensor, a tensor of another shape, or an MTP copy of the
    embedding or head that differs from the target's (this model shares them)."""
    try:
        stored = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--init {path}: no readable config.json ({e})") from None
    want = model.c.to_hf()
    diff = {k: (stored.get(k), v) for k, v in want.items() if stored.get(k) != v}
    if diff:
        raise SystemExit(f"--init {path}: config.json is not this script's shape (stored, "
                         f"expected): {diff}")
    names = checkpoint_tensors(model)
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        if keys != set(names):
            raise SystemExit(f"--init {path}: tensors missing {sorted(set(names) - keys)[:4]}, "
                             f"unexpected {sorted(keys - set(names))[:4]}")
        seen: dict[int, tuple[str, torch.Tensor]] = {}
        with torch.no_grad():
            for name, param in names.items():
                value = f.get_tensor(name)
                if value.shape != param.shape:
                    raise SystemExit(f"--init {path}: {name} is {list(value.shape)}, expected "
                                     f"{list(param.shape)}")
                first = seen.setdefault(id(param), (name, value))
                if first[0] != name and not torch.equal(first[1], value):
                    raise SystemExit(f"--init {path}: {name} differs from {first[0]}; this model "
                                     f"shares them")
                param.copy_(value.float())


def round_to(model: nn.Module, dtype: torch.dtype) -> None:
    """Round every weight to `dtype` in place (kept in fp32): the model becomes the checkpoint."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT,
                    help="checkpoint directory: config.json, model.safetensors, train_log.txt, "
                         "heldout_prompts.json")
    ap.add_argument("--prompts-out", type=Path, help="held-out prompts (default: OUT/heldout_prompts.json)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--steps", type=int, default=6000, help="phase 1 (joint) steps")
    ap.add_argument("--distil-steps", type=int, default=1500, help="phase 2 (MTP only) steps")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--chain", type=int, default=4, help="MTP chain steps distilled (k)")
    ap.add_argument("--joint-chain", type=int, default=1, help="MTP chain steps in phase 1")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--weight-decay", type=float, default=0.05)
    ap.add_argument("--max-minutes", type=float, default=3.0,
                    help="wall-time cap of both phases' steps (80%% phase 1, 20%% phase 2; a phase "
                         "with no steps leaves its share to the other; evaluation and export after "
                         "them take seconds)")
    ap.add_argument("--log-every", type=int, default=250)
    ap.add_argument("--eval-seqs", type=int, default=64, help="held-out windows of --eval-len bytes")
    ap.add_argument("--eval-len", type=int, default=512)
    ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16",
                    help="the checkpoint's (and, on CUDA, autocast's) dtype")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--init", type=Path,
                    help="start from this checkpoint (an earlier run's, this shape) instead of random "
                         "weights: with --steps 0 the MTP head is distilled further and the target "
                         "kept bit for bit; its train_log.txt heads this run's, its held-out prompts "
                         "are kept")
    return ap


def _read_log(path: Path) -> str:
    """An earlier run's train_log.txt with a line to end it ('' where it has none)."""
    try:
        text = (path / "train_log.txt").read_text()
    except OSError:
        return ""
    return text if not text or text.endswith("\n") else text + "\n"


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = getattr(torch, args.dtype)
    args.out.mkdir(parents=True, exist_ok=True)
    # an --init run's log follows its checkpoint's (read first: --init may be --out)
    previous = _read_log(args.init) if args.init is not None else ""
    log_file = (args.out / "train_log.txt").open("w")
    log_file.write(previous)

    def log(msg: str) -> None:
        print(msg, flush=True)
        log_file.write(msg + "\n")
        log_file.flush()

    torch.manual_seed(args.seed)
    train_files, held_files = stdlib_files()
    if not held_files or len(train_files) < 100:
        raise SystemExit(f"{sysconfig.get_paths()['stdlib']}: {len(train_files)} training and "
                         f"{len(held_files)} held-out .py files; this Python's standard library "
                         f"source is not installed (the corpus needs it)")
    train, held = read_bytes(train_files).to(device), read_bytes(held_files).to(device)
    log(f"python {platform.python_version()}, torch {torch.__version__}, device "
        f"{torch.cuda.get_device_name(device) if cuda else 'cpu'}; argv {sys.argv[1:] if argv is None else argv}")
    log(f"train: {len(train_files)} stdlib files, {len(train) / 1e6:.1f} MB; held out: "
        f"{[f.name for f in held_files]}, {len(held) / 1e3:.0f} kB")
    model = TinyLlama(CONFIG)
    if args.init is not None:
        load_into(model, args.init)
        log(f"init: {args.init} (the run above)")
    model = model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log(f"config: {json.dumps(CONFIG.to_hf())}; {n_params / 1e6:.2f}M parameters")
    gen, eval_gen = torch.Generator().manual_seed(args.seed), torch.Generator().manual_seed(99)

    def optimiser(params: list[nn.Parameter], lr: float) -> torch.optim.Optimizer:
        # fused: one kernel for the whole step on CUDA (the per-parameter loop is launch-bound)
        return torch.optim.AdamW(params, lr=lr, weight_decay=args.weight_decay, betas=(0.9, 0.95),
                                 **({"fused": True} if cuda else {}))

    autocast: Callable[[], torch.autocast] = lambda: torch.autocast(  # noqa: E731
        device.type, dtype=dtype, enabled=cuda)
    start = time.time()
    budget = args.max_minutes * 60
    # the cap's shares: 80% joint, 20% distillation; a phase with no steps leaves its share to the other
    joint_share = 0.8 if args.distil_steps > 0 else 1.0
    distil_share = 0.2 if args.steps > 0 else 1.0
    phases = [("joint", args.steps, joint_share * budget, args.lr),
              ("distil", args.distil_steps, distil_share * budget, args.lr / 3)]
    done = 0
    for phase, steps, phase_budget, lr in phases:
        if steps <= 0:
            continue
        distil = phase == "distil"
        params = model.mtp_parameters() if distil else list(model.parameters())
        opt = optimiser(params, lr)
        phase_start, tokens_seen = time.time(), 0
        for step in range(steps):
            # progress by steps or by time, whichever is further: the cosine ends inside the cap
            progress = max(step / steps, (time.time() - phase_start) / phase_budget
                           if phase_budget > 0 else 1.0)
            if progress >= 1:
                log(f"{phase}: wall-time cap reached after {step} of {steps} steps")
                break
            warm = min(1.0, (step + 1) / 200)
            scale = warm * max(0.5 * (1 + math.cos(math.pi * progress)), 0.05)
            for group in opt.param_groups:
                group["lr"] = lr * scale
            tokens = batch(train, args.batch, args.seq_len + 1, gen)
            with autocast():
                with torch.set_grad_enabled(not distil):
                    h, logits = model.target(tokens[:, :-1])
                target_loss = F.cross_entropy(logits.float().reshape(-1, 256), tokens[:, 1:].reshape(-1))
                chain = model.chain(tokens[:, :-1], h.detach(), args.chain if distil else args.joint_chain)
                teacher = logits[:, 1:].detach() if distil else None
                mtp_loss = chain_loss(chain, tokens[:, 2:], teacher)
            loss = mtp_loss if distil else target_loss + mtp_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            tokens_seen += tokens.numel()
            done += 1
            if step % args.log_every == 0 or step == steps - 1:
                elapsed = time.time() - phase_start
                log(f"{phase} step {step}/{steps} target {target_loss.item():.3f} mtp {mtp_loss.item():.3f} "
                    f"lr {lr * scale:.2e} ({time.time() - start:.0f}s, {tokens_seen / max(elapsed, 1e-9) / 1e6:.2f}M tok/s)")
    train_s = time.time() - start
    model.eval()
    round_to(model, dtype)  # measure the checkpoint as written
    held_out = evaluate(model, held, args.chain, eval_gen, seqs=args.eval_seqs, length=args.eval_len)
    log(f"held out (fp32 on the {args.dtype}-rounded weights): {json.dumps(held_out)}")
    export(model, args.out, dtype)
    prompts = args.prompts_out or args.out / "heldout_prompts.json"
    # an --init run keeps its checkpoint's prompts: they are cut from this Python's standard
    # library, which another Python's (the H200's 3.12, this CPU's 3.11) does not match
    kept = args.init / "heldout_prompts.json" if args.init is not None and not args.prompts_out else None
    if kept is not None and kept.is_file():
        if kept.resolve() != prompts.resolve():
            shutil.copyfile(kept, prompts)
    else:
        write_prompts(held_files, prompts)
    size = (args.out / "model.safetensors").stat().st_size
    log(f"wrote {args.out} ({size / 1e6:.2f} MB) and {prompts}: {done} steps in {train_s:.0f}s of "
        f"training, {time.time() - start:.0f}s in all")
    (args.out / "train_result.json").write_text(json.dumps(
        {"held_out": held_out, "steps": done, "train_s": round(train_s, 1), "parameters": n_params,
         "bytes": size, "args": {k: str(v) for k, v in vars(args).items()}}, indent=1) + "\n")
    log_file.close()


if __name__ == "__main__":
    main()
