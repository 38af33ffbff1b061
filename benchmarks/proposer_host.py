"""Benchmark: the proposer's own host work per decode step (issue 14 item 2), on the CPU.

A simulated decode loop as benchmarks/decode_step.py's (n sequences, propose k=4, seeded random
acceptance, after_verify, catch-up of the accepted tokens), with every compiled program's launch
list skipped (`backend.execute` a no-op; the chain's drafts buffer preset to a valid id), so what
is timed is what the host does around the programs: checks, staging, the runner's input
handling, the read-back and the states' bookkeeping. `--path host` drafts with propose_batch,
`--path device` with propose_batch_on_device and one last_drafts read, `--path step` makes the
step's two host calls: last_drafts, then step_batch (after_verify, catch-up and the next
device-resident propose in one call; each fresh batch's first propose is untimed), `--path
picked` the same with both hiddens given as rows of one tensor picked by index (`HiddenRows`:
the engine's device path since the fourth session; the indices built per step, as it does),
`--path sliced` the same step with the hiddens as the engine built them before that: a view of
the one source a sequence (catch-up rows and target), the targets stacked, per step (`--path
picked --against . --against-path sliced` is the engine's change, host inputs included; the
`step` path's views are made once, outside the timing), `--path ahead` the engine's steady step
on a GPU: one `step_ahead` (the verify's greedy tokens and hiddens in, the drafts' read, the
accept on the device's side, the trims, the catch-up and the next propose; here the accept and
its shifts are ~10 torch ops on CPU tensors, where a GPU replays one kernel: most of this
path's CPU time, and not a GPU host's cost). Prints the
median per step and per propose, microseconds, and each proposer call's own median (propose,
last_drafts, after_verify_batch, last_pair_keys, catchup_batch, step_batch: `calls`, those the
path makes); `--out` writes them as JSON. The step's time is its proposer calls', the host's
own accept loop left out.

This is a CPU measurement of Python and torch-dispatch overhead, not the H200 number (there a
launch and a copy cost more host time than a CPU op does; decode_step.py measures that). The
issue's target is <= 50 us of host overhead a decode step at every n <= 64.

`--against DIR` measures side by side with another checkout (a `git worktree` of the base
commit, say): one worker process in this checkout and one in DIR, each running its own
`measure`, and every round runs each width on both in turn (which goes first alternating), so
both see the same load; it prints each side's median over `--rounds` rounds and its best
round (on a shared machine the best round is the quiet one; `--against .` shows the noise),
and each call's median over the rounds. Both sides run their own checkout's `measure`: to compare
like with like, the other checkout needs this file's `measure` (copy it there). `--against-path`
runs the other side on another path (`--path step --against . --against-path device`: the one
call against the separate calls in this checkout).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from itertools import chain
from pathlib import Path

import numpy as np
import torch

from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.mtp import MtpHead
from draft_circuit.runners.draft import CircuitDraftRunner
from draft_circuit.runners.hidden_rows import HiddenRows
from draft_circuit.runners.proposer import MtpProposer
from draft_circuit.runners.testing import random_mtp_weights

CFG = MtpConfig(vocab_size=90, hidden_size=32, intermediate_size=48, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=4096)
K = 4


def _proposer() -> MtpProposer:
    head = MtpHead(CFG)
    p = MtpProposer(head, head.bind(random_mtp_weights(CFG, seed=11)), num_drafts=K,
                    num_blocks=64 * 40 + 8, block_size=16, max_blocks_per_seq=40, max_width=64,
                    widths=(1, 2, 4, 8, 16, 32, 64), forward="circuit")
    for r in p.chains.runners():
        if isinstance(r, CircuitDraftRunner):
            b = r.backend
            if "drafts" in b.output_buffers(1):
                b.static_outputs["drafts"].fill_(3)  # type: ignore[attr-defined]
            b.execute = lambda n: None  # type: ignore[method-assign]
    return p


#: the proposer calls of a step, timed one by one (`calls` in measure's result)
CALLS = ("propose", "last_drafts", "after_verify", "pair_keys", "catchup", "step_batch",
         "step_ahead")
#: the calls each path makes
PATH_CALLS = {"host": CALLS[:5], "device": CALLS[:5], "step": ("last_drafts", "step_batch"),
              "picked": ("last_drafts", "step_batch"), "sliced": ("last_drafts", "step_batch"),
              "ahead": ("step_ahead",)}
PATHS = tuple(PATH_CALLS)
ONE_CALL = ("step", "picked", "sliced", "ahead")  # the paths that make a step in one call


def measure(n: int, path: str, steps: int, seed: int = 0) -> dict[str, float | dict[str, float]]:
    """Median host us per decode step and per propose (the drafts in hand: `last_drafts`
    included on the device paths; on the step path the step_batch that proposes) at width n,
    and in `calls` each proposer call's median (PATH_CALLS[path]; `last_drafts` 0 on the host
    path, whose propose hands the drafts back)."""
    p, rng = _proposer(), random.Random(seed)
    g = torch.Generator().manual_seed(seed)

    def fresh() -> list:
        states = []
        for _ in range(n):
            s = p.alloc_state()
            p.prefill_drafter([1 + j % 80 for j in range(20)], torch.randn(20, CFG.hidden_size,
                                                                         generator=g), s)
            states.append(s)
        return states
    states = fresh()
    hid = torch.randn(n, CFG.hidden_size, generator=g)
    catch = [torch.randn(K, CFG.hidden_size, generator=g) for _ in range(n)]
    views = {a: [c[:a] for c in catch] for a in range(K + 1)}
    # the picked path's one source: every catch-up row (K a sequence), then the targets
    source = torch.cat([*catch, hid])
    fixed = {a: [7] * a for a in range(K + 1)}
    step_us: list[float] = []
    propose_us: list[float] = []
    call_us: dict[str, list[float]] = {c: [] for c in PATH_CALLS[path]}
    pos: list[int] = []  # the step path's next positions (the host's own, as an engine's)

    def step() -> None:
        pos = [p.last_pair_key(s) + 2 for s in states]
        t0 = time.perf_counter()
        if path == "device":
            p.propose_batch_on_device([5] * n, hid, pos, K, states)
            ta = time.perf_counter()
            drafts = p.last_drafts(states)
        else:
            drafts = p.propose_batch([5] * n, hid, pos, K, states)  # type: ignore[assignment]
            ta = time.perf_counter()
        t1 = time.perf_counter()
        acc = [rng.randint(0, len(d)) for d in drafts]
        tb = time.perf_counter()
        p.after_verify_batch(acc, states)
        tc = time.perf_counter()
        keys = p.last_pair_keys(states)  # the engine finds each catch-up's first row from these
        td = time.perf_counter()
        keep = [i for i, a in enumerate(acc) if a]
        if keep:
            p.catchup_batch([fixed[acc[i]] for i in keep], [views[acc[i]][i] for i in keep],
                            [keys[i] + 2 for i in keep], [states[i] for i in keep])
        t2 = time.perf_counter()
        step_us.append((t2 - t0 - (tb - t1)) * 1e6)  # the host's own accept work left out
        propose_us.append((t1 - t0) * 1e6)
        for c, us in zip(CALLS, (ta - t0, t1 - ta, tc - tb, td - tc, t2 - td)):
            call_us[c].append(us * 1e6)

    def one_call_step() -> None:
        """last_drafts, the accept, step_batch: the trims, each catch-up of its accepted
        tokens at the rows after its trimmed key (step_batch's default) and the next propose,
        each row's at one past its accepted drafts (the key the catch-up leaves, + 2)."""
        t0 = time.perf_counter()
        drafts = p.last_drafts(states)
        t1 = time.perf_counter()
        acc = [rng.randint(0, len(d)) for d in drafts]
        pos[:] = [q + a + 1 for q, a in zip(pos, acc)]
        tb = time.perf_counter()
        if path == "picked":  # the indices built here, as the engine builds them a step
            rows = np.fromiter(chain.from_iterable(range(K * i, K * i + a)
                                                   for i, a in enumerate(acc)),
                               dtype=np.int64, count=sum(acc))
            targets = np.arange(K * n, K * n + n, dtype=np.int64)  # each sequence's, a step
            p.step_batch(acc, [fixed[a] for a in acc], HiddenRows(source, rows), [5] * n,
                         HiddenRows(source, targets), pos, K, states)
        elif path == "sliced":  # the views and the stack made here, as the engine made them
            p.step_batch(acc, [fixed[a] for a in acc],
                         [source[K * i:K * i + a] for i, a in enumerate(acc)], [5] * n,
                         torch.stack([source[K * n + i] for i in range(n)]), pos, K, states)
        else:
            p.step_batch(acc, [fixed[a] for a in acc], [views[a][i] for i, a in enumerate(acc)],
                         [5] * n, hid, pos, K, states)
        t2 = time.perf_counter()
        step_us.append((t2 - t0 - (tb - t1)) * 1e6)  # the host's own accept work left out
        propose_us.append((t2 - tb) * 1e6)
        call_us["last_drafts"].append((t1 - t0) * 1e6)
        call_us["step_batch"].append((t2 - tb) * 1e6)

    k1 = K + 1
    verify_hidden = torch.randn(n * k1, CFG.hidden_size, generator=g)

    def ahead_step() -> None:
        """step_ahead, the engine's steady step on a GPU: the verify's greedy tokens (made
        outside the timing, as the target's pass makes them: each row accepts a random count
        of its drafts, all 3 here) and hiddens in, the drafts read and the next step's drafted
        in the one call; the accept is on the device's side (its counts), so nothing is left
        out of the step."""
        acc = [rng.randint(0, K) for _ in range(n)]
        greedy = torch.full((n, k1), 3, dtype=torch.int32)
        for i, a in enumerate(acc):
            greedy[i, a] = 4  # the first token that is no draft: a drafts accepted
        greedy = greedy.view(-1)
        t0 = time.perf_counter()
        got = p.step_ahead(greedy, verify_hidden, K, states)
        t1 = time.perf_counter()
        assert got is not None, p.last_served
        step_us.append((t1 - t0) * 1e6)
        propose_us.append((t1 - t0) * 1e6)
        call_us["step_ahead"].append((t1 - t0) * 1e6)

    def first_propose() -> None:  # a fresh batch's first, untimed (no verify before it)
        pos[:] = [p.last_pair_key(s) + 2 for s in states]
        p.propose_batch_on_device([5] * n, hid, pos, K, states)
    run = ahead_step if path == "ahead" else one_call_step if path in ONE_CALL else step
    left = steps
    while left > 0:  # tables hold 40 blocks: fresh states every 60 steps (outside the timing)
        if path in ONE_CALL:
            first_propose()
        for _ in range(3):
            run()
        for got in (step_us, propose_us, *call_us.values()):
            del got[-3:]  # warm
        for _ in range(min(60, left)):
            run()
        left -= 60
        for s in states:
            p.free_state(s)
        states[:] = fresh()
    return {"step_us": statistics.median(step_us), "propose_us": statistics.median(propose_us),
            "calls": {c: statistics.median(v) for c, v in call_us.items()}}


_WORKER = """
import json, sys, torch
from benchmarks.proposer_host import measure
torch.set_num_threads(1)
for line in sys.stdin:
    n, path, steps = line.split()
    print(json.dumps(measure(int(n), path, int(steps))), flush=True)
"""


def side_by_side(widths: list[int], path: str, steps: int, rounds: int, against: Path,
                 against_path: str | None = None) -> dict[str, dict[str, dict[str, float]]]:
    """{"this": ..., "against": ...}: per width the median step_us over the rounds and the best
    round's (`best_us`), and each call's median over the rounds (`<call>_us`, CALLS; a
    checkout whose measure times no calls has none). Each side is a worker process started in
    its checkout (alike, so neither side is the process that has run the other's rounds);
    every round runs a width on both in turn, which goes first alternating. The other side
    runs `against_path` (default: `path`)."""
    paths = {"this": path, "against": against_path or path}
    here = Path(__file__).resolve().parents[1]
    workers = {side: subprocess.Popen([sys.executable, "-c", _WORKER], cwd=root, text=True,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE)
               for side, root in (("this", here), ("against", against))}
    got: dict[str, dict[int, list[dict]]] = {side: {n: [] for n in widths} for side in workers}
    try:
        for r in range(rounds):
            for n in widths:
                for side in (("this", "against") if r % 2 == 0 else ("against", "this")):
                    w = workers[side]
                    assert w.stdin is not None and w.stdout is not None
                    w.stdin.write(f"{n} {paths[side]} {steps}\n")
                    w.stdin.flush()
                    got[side][n].append(json.loads(w.stdout.readline()))
    finally:
        for w in workers.values():
            assert w.stdin is not None
            w.stdin.close()
            w.wait()
    return {side: {str(n): _rounds(v) for n, v in per.items()} for side, per in got.items()}


def _rounds(results: list[dict]) -> dict[str, float]:
    """One width's rounds: the median and best step, each call's median."""
    steps = [r["step_us"] for r in results]
    out = {"step_us": statistics.median(steps), "best_us": min(steps)}
    for c in CALLS:
        if all(c in r.get("calls", {}) for r in results):
            out[f"{c}_us"] = statistics.median(r["calls"][c] for r in results)
    return out


def _calls_line(calls: dict[str, float]) -> str:
    return ", ".join(f"{c} {calls[c]:.1f}" for c in CALLS if c in calls)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--path", choices=PATHS, default="host")
    ap.add_argument("--steps", type=int, default=360)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--against", type=Path, help="another checkout to measure side by side")
    ap.add_argument("--against-path", choices=PATHS,
                    help="the --against side's path (default: --path)")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    if args.against is not None:
        other = args.against_path or args.path
        both = side_by_side(args.n, args.path, args.steps, args.rounds, args.against, other)
        for n in map(str, args.n):
            a, b = both["against"][n], both["this"][n]
            print(f"n={n}: {args.against} ({other}) {a['step_us']:.0f} us a step (best round "
                  f"{a['best_us']:.0f}), this ({args.path}) {b['step_us']:.0f} us (best "
                  f"{b['best_us']:.0f}); "
                  f"median of {args.rounds} interleaved rounds")
            for side, r in ((str(args.against), a), ("this", b)):
                calls = {c: r[f"{c}_us"] for c in CALLS if f"{c}_us" in r}
                if calls:
                    print(f"    {side} calls (us): {_calls_line(calls)}")
        if args.out is not None:
            args.out.write_text(json.dumps({"path": args.path, "against": str(args.against),
                                            "against_path": other, "widths": both}, indent=1))
        return 0
    result = {str(n): measure(n, args.path, args.steps) for n in args.n}
    for n, r in result.items():
        print(f"{args.path} n={n}: {r['step_us']:.0f} us a step, {r['propose_us']:.0f} us a propose; "
              f"calls (us): {_calls_line(r['calls'])}")  # type: ignore[arg-type]
    if args.out is not None:
        args.out.write_text(json.dumps({"path": args.path, "widths": result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
