"""Train the engine's embedded default: a byte-level Llama target and its DeepSeek-V3-style MTP
head, on the Python standard library's own source, saved as a Hugging Face checkpoint.

    python -m examples.train_tiny --out examples/data/tiny    # ~12 min on 2 idle CPU cores

Phase 1 trains the target (next-byte loss) and the MTP head (the byte after next) jointly;
phase 2 freezes the target and distils its next-byte distribution into the MTP head's k-step
chain, which is what acceptance measures. The chain is trained as the proposer runs it: step s
at position p reads the drafter's own hidden from step s-1 at p-1 and attends to exact rows up
to the chain's start p-s+1 and to the chain's own rows after it (see `chain_attention`).
Plain torch, deterministic for a seed and thread count; nothing imports this script at run time.
"""
from __future__ import annotations

import argparse
import json
import math
import sysconfig
import time
from pathlib import Path
from typing import cast

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from draft_circuit.circuit.layers.config import DEFAULT_CONFIG, MtpConfig

# held out from training (those this Python has); prompts for the acceptance measure come from them
HELD_OUT = ("bisect.py", "colorsys.py", "fnmatch.py", "heapq.py", "sched.py", "shlex.py",
            "struct.py", "textwrap.py")


def stdlib_files() -> tuple[list[Path], list[Path]]:
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    return [f for f in files if f.name not in HELD_OUT], [f for f in files if f.name in HELD_OUT]


def read_bytes(files: list[Path]) -> torch.Tensor:
    return torch.frombuffer(bytearray(b"\n\n".join(f.read_bytes() for f in files)), dtype=torch.uint8)


# ---- the model: the same maths as the circuit's ops (fp32 RMSNorm, rotate-half RoPE, GQA) ----
def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """x [B, heads, T, D], pos [T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    ang = pos.float()[:, None] * inv
    cos, sin = ang.cos(), ang.sin()
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
        c, (b, t, _) = self.c, x.shape
        a = rmsnorm(x, self.input_layernorm, c.rms_norm_eps)
        split = lambda y: y.view(b, t, -1, c.head_dim).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.q_proj(a)), split(self.k_proj(a)), split(self.v_proj(a))
        groups = c.num_attention_heads // c.num_key_value_heads
        k = rope(k, pos, c.rope_theta).repeat_interleave(groups, 1)
        return rope(q, pos, c.rope_theta), k, v.repeat_interleave(groups, 1)

    def finish(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """o [B, heads, T, D] -> the block's output (both residuals)."""
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

    def target(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] -> (final-norm hiddens [B, T, H], logits [B, T, V])."""
        pos = torch.arange(tokens.shape[1])
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
        tok, pos = tokens[:, 1:], torch.arange(1, tokens.shape[1])
        emb = rmsnorm(self.embed_tokens(tok), self.enorm, eps)
        hidden, keys, values, logits = h[:, :-1], [], [], []
        for s in range(steps):
            x = self.eh_proj(torch.cat([emb, rmsnorm(hidden, self.hnorm, eps)], dim=-1))
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
    during one propose). q and keys: [B, heads, N, D]."""
    s, n = len(keys), q.shape[2]
    scale = 1.0 / math.sqrt(head_dim)
    scores = (q @ keys[0].transpose(-1, -2)) * scale                       # [B, h, N, N]
    p, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    scores = scores.masked_fill(j > p - s + 1, float("-inf"))
    extra_scores, extra_values = [], []
    for m in range(2, s + 1):
        shift = s - m  # step m's row at p - shift
        k = F.pad(keys[m - 1], (0, 0, shift, 0))[:, :, :n]
        extra_scores.append((q * k).sum(-1, keepdim=True) * scale)
        extra_values.append(F.pad(values[m - 1], (0, 0, shift, 0))[:, :, :n])
    if not extra_scores:
        return scores.softmax(-1) @ values[0]
    probs = torch.cat([scores, *extra_scores], dim=-1).softmax(-1)
    out = probs[..., :n] @ values[0]
    for i, v in enumerate(extra_values):
        out = out + probs[..., n + i:n + i + 1] * v
    return out


def chain_loss(logits: list[torch.Tensor], labels: torch.Tensor, teacher: torch.Tensor | None) -> torch.Tensor:
    """Mean over steps; step s's first s-1 positions have no full chain behind them (masked).
    labels [B, T-1] (t_{p+1}); teacher: the target's logits at p [B, T-1, V] (phase 2: KL)."""
    total = logits[0].new_zeros(())
    for s, lg in enumerate(logits):
        lg = lg[:, s:]
        if teacher is None:
            total = total + F.cross_entropy(lg.reshape(-1, lg.shape[-1]), labels[:, s:].reshape(-1))
        else:
            t = teacher[:, s:].log_softmax(-1)
            total = total + F.kl_div(lg.log_softmax(-1), t, log_target=True, reduction="none").sum(-1).mean()
    return total / len(logits)


def batch(data: torch.Tensor, size: int, length: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, len(data) - length - 1, (size,), generator=gen)
    return torch.stack([data[s:s + length] for s in starts.tolist()]).long()


@torch.no_grad()
def evaluate(model: TinyLlama, data: torch.Tensor, steps: int, gen: torch.Generator) -> dict:
    tokens = batch(data, 16, 256, gen)
    h, logits = model.target(tokens)
    loss = F.cross_entropy(logits[:, :-1].reshape(-1, 256), tokens[:, 1:].reshape(-1))
    greedy = logits[:, 1:-1].argmax(-1)  # the target's choice at p = 1..T-2
    # a chain starting at index i is accepted through step s while steps 1..s all hit
    starts = greedy.shape[1] - steps + 1
    agree, run, accepted = [], torch.ones_like(greedy[:, :starts], dtype=torch.bool), 0.0
    for s, lg in enumerate(model.chain(tokens[:, :-1], h[:, :-1], steps)):
        hit = lg.argmax(-1) == greedy
        agree.append(round(float(hit[:, s:].float().mean()), 3))
        run = run & hit[:, s:s + starts]
        accepted += float(run.float().mean())
    return {"target_bits_per_byte": round(float(loss) / math.log(2), 3), "step_agreement": agree,
            "teacher_forced_accepted_per_verify": round(accepted, 3)}


def export(model: TinyLlama, out: Path) -> None:
    c, L = model.c, model.c.num_hidden_layers
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
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().float().contiguous().clone() for k, v in t.items()},
              str(out / "model.safetensors"), metadata={"format": "pt"})
    config = c.to_hf() | {"draft_circuit": {"tokenizer": "bytes"}}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_prompts(files: list[Path], path: Path, count: int = 16) -> None:
    """Held-out prompts: `count` snippets (40-200 bytes) of the held-out files, each starting at
    a line and ending wherever its length says (often mid-line: a continuation to complete)."""
    gen = torch.Generator().manual_seed(1)
    prompts = []
    for i in range(count):
        lines = files[i % len(files)].read_text().splitlines(keepends=True)
        start = int(torch.randint(0, max(len(lines) - 12, 1), (1,), generator=gen))
        want = 40 + int(torch.randint(0, 160, (1,), generator=gen))
        text = "".join(lines[start:start + 40])[:want]
        prompts.append(text.encode("ascii", "replace").decode("ascii"))
    path.write_text(json.dumps(prompts, indent=1) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "data" / "tiny")
    ap.add_argument("--prompts-out", type=Path, default=Path(__file__).parent / "data" / "heldout_prompts.json")
    ap.add_argument("--steps", type=int, default=2000, help="phase 1 (joint) steps")
    ap.add_argument("--distil-steps", type=int, default=400, help="phase 2 (MTP only) steps")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--chain", type=int, default=4, help="MTP chain steps distilled (k)")
    ap.add_argument("--joint-chain", type=int, default=1, help="MTP chain steps in phase 1")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    train_files, held_files = stdlib_files()
    train, held = read_bytes(train_files), read_bytes(held_files)
    print(f"train: {len(train_files)} files, {len(train) / 1e6:.1f} MB; held out: "
          f"{[f.name for f in held_files]}, {len(held) / 1e3:.0f} kB", flush=True)
    model = TinyLlama(DEFAULT_CONFIG)
    gen, eval_gen = torch.Generator().manual_seed(args.seed), torch.Generator().manual_seed(99)
    total = args.steps + args.distil_steps
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    start = time.time()
    for step in range(total):
        distil = step >= args.steps
        if step == args.steps:  # phase 2: a fresh optimiser over the MTP head only
            mtp = [model.enorm, model.hnorm, model.shared_norm, *model.eh_proj.parameters(),
                   *model.mtp.parameters()]
            opt = torch.optim.AdamW(mtp, lr=args.lr / 3, weight_decay=0.01, betas=(0.9, 0.95))
        local, span = (step - args.steps, args.distil_steps) if distil else (step, args.steps)
        lr_scale = min(1.0, (local + 1) / 50) * 0.5 * (1 + math.cos(math.pi * local / span))
        for group in opt.param_groups:
            group["lr"] = (args.lr / 3 if distil else args.lr) * max(lr_scale, 0.05)
        tokens = batch(train, args.batch, args.seq_len + 1, gen)
        with torch.set_grad_enabled(not distil):
            h, logits = model.target(tokens[:, :-1])
        target_loss = F.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
        chain = model.chain(tokens[:, :-1], h.detach(), args.chain if distil else args.joint_chain)
        teacher = logits[:, 1:].detach() if distil else None
        mtp_loss = chain_loss(chain, tokens[:, 2:], teacher)
        loss = mtp_loss if distil else target_loss + mtp_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0 or step == total - 1:
            print(f"step {step}/{total} {'distil' if distil else 'joint'} target {target_loss:.3f} "
                  f"mtp {mtp_loss:.3f} ({time.time() - start:.0f}s)", flush=True)
    model.eval()
    print("held out:", evaluate(model, held, args.chain, eval_gen), flush=True)
    export(model, args.out)
    write_prompts(held_files, args.prompts_out)
    size = (args.out / "model.safetensors").stat().st_size
    print(f"wrote {args.out} ({size / 1e6:.2f} MB) and {args.prompts_out} in "
          f"{time.time() - start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
