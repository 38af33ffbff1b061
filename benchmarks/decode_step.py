"""Benchmark: the draft side of a decode step (issue 14), before and after its host work left.

A simulated decode loop on one `MtpProposer` (random weights; config and weight builders are
benchmarks/draft_chain.py's): n sequences, each prefilled with ~`--live` drafter rows; a step
is propose (k drafts) -> the host reads the drafts once (a verify stands there in an engine) ->
`after_verify_batch` with seeded random acceptances a in 0..k -> `catchup_batch` of the a
accepted tokens. Two columns per config and width, on the same proposer, weights, seeds and
acceptances:

  before  host-returning `propose_batch` (one device-to-host copy and sync inside) and the
          catch-up on the full one-step chain (installed as the host's one-step runner, which
          the proposer then prefers for catch-up rows)
  after   `propose_batch_on_device` (drafts stay on the device; their read is the pinned copy
          behind the chain) and the catch-up on the KV-only chain
  step    after's work as an engine makes it in two host calls a step: the drafts' read, then
          `step_batch` (the trims, the catch-up and the next propose in one call); a step is
          read -> trims -> catch-up -> next propose, the batch's first propose made untimed
  pipelined  after's steps back to back with no sync but each step's one read (as an engine
          runs them: a catch-up overlaps the next step's host work); per-step means of the block

Per step (before, after): wall (from an idle device until the catch-up's last kernel), GPU busy
time (CUDA events around every graph replay, summed; on CPU the host clock around each program
run), host overhead (wall - GPU), the chain's and the catch-up's GPU time, the catch-up's
launches (the replayed programs' launch lists) against the KV-only family's plan (launches and
floor: its programs' bytes over the bandwidth measured here, for the same rows), and the k-step
chain's floor (draft_chain.floor_bytes at the mean live rows). Medians over `--steps` steps
after `--warmup`. The issue's targets are reported, not asserted: host overhead <= 50 us a step,
catch-up GPU <= 10% of the chain's on the 8B-class head, wall <= 1.1x the chain's GPU time.

    python3 -m benchmarks.decode_step --device cuda --out $OUT/decode_step.json
    python3 -m benchmarks.decode_step --device cpu --quick --out /tmp/decode_step.json  # smoke

CUDA is only touched when --device is cuda (events, synchronisation, bandwidth).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import draft_chain as dc  # noqa: E402
from benchmarks import draft_heads as dh  # noqa: E402
from draft_circuit.circuit.layers.config import MtpConfig  # noqa: E402
from draft_circuit.circuit.layers.moe import MoeConfig, MoeMtpHead  # noqa: E402
from draft_circuit.runners.proposer import MtpProposer  # noqa: E402

DEFAULT_CONFIGS = "small,8b,moe"
QUICK_CONFIGS = {"small": ("tiny", dc.DRY_CONFIG), "8b": ("tiny", dc.DRY_CONFIG),
                 "moe": ("tiny_moe", dc.DRY_MOE_CONFIG)}
MODES = ("before", "after", "step", "pipelined")  # pipelined: after's steps without a sync
#: the modes compared with before (`<mode>_over_before` in the ratios)
AGAINST_BEFORE = ("after", "step", "pipelined")
TARGETS = {"host_us_max": 50.0, "catchup_over_chain_gpu_max_8b": 0.10,
           "wall_over_chain_gpu_max": 1.1}


def log(msg: str) -> None:
    print(f"[decode_step {time.strftime('%H:%M:%S')}] {msg}", flush=True)


@dataclass(frozen=True)
class Setup:
    device: torch.device
    dtype: torch.dtype
    num_drafts: int
    widths: list[int]
    steps: int
    warmup: int
    live: int
    block_size: int
    seed: int

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def max_width(self) -> int:
        return 1 << (max(self.widths) - 1).bit_length()  # the proposer's widths: powers of two

    @property
    def max_blocks(self) -> int:
        """A table covers the prefill, every step's rows (k drafts at most + catch-up) and k."""
        rows = self.live + (self.steps + self.warmup + 1) * (self.num_drafts + 1) + self.num_drafts
        return -(-rows // self.block_size) + 1


def sync(s: Setup) -> None:
    if s.cuda:
        torch.cuda.synchronize()


class ReplayTimer:
    """GPU time of every graph replay a tagged runner makes: CUDA events around
    `backend.execute` (events made up front, reused each step), or on CPU the host clock around
    the program run. Also the replayed programs' launches and bytes."""

    def __init__(self, s: Setup) -> None:
        self.s = s
        self.events: list[tuple[Any, Any]] = []
        self.records: list[tuple[str, int, int, float]] = []  # (tag, launches, bytes, us or index)
        self._grow(64)

    def reserve(self, count: int) -> None:
        """Events for `count` replays made now, not inside a timed block."""
        if len(self.events) < count:
            self._grow(count - len(self.events))

    def _grow(self, count: int) -> None:
        if self.s.cuda:
            self.events += [(torch.cuda.Event(enable_timing=True),
                             torch.cuda.Event(enable_timing=True)) for _ in range(count)]

    def wrap(self, runner: Any, tag: str) -> None:
        backend, programs = runner.backend, runner.compiled.programs
        real: Callable[[int], None] = backend.execute

        def execute(w: int) -> None:
            p = programs[w]
            if self.s.cuda:
                i = len(self.records)
                if i >= len(self.events):
                    self._grow(64)
                start, end = self.events[i]
                start.record()
                real(w)
                end.record()
                self.records.append((tag, len(p.launches), p.bytes_moved, float(i)))
            else:
                t = time.perf_counter()
                real(w)
                self.records.append((tag, len(p.launches), p.bytes_moved,
                                     (time.perf_counter() - t) * 1e6))
        backend.execute = execute

    def collect(self) -> dict[str, dict[str, float]]:
        """Per tag: us, replays, launches, bytes of the step just synchronised; then cleared."""
        out: dict[str, dict[str, float]] = {}
        for tag, launches, nbytes, x in self.records:
            us = self.events[int(x)][0].elapsed_time(self.events[int(x)][1]) * 1e3 \
                if self.s.cuda else x
            d = out.setdefault(tag, {"us": 0.0, "replays": 0, "launches": 0, "bytes": 0})
            d["us"] += us
            d["replays"] += 1
            d["launches"] += launches
            d["bytes"] += nbytes
        self.records.clear()
        return out


class Loop:
    """One config's proposer and the decode loop over n sequences."""

    def __init__(self, name: str, config: MtpConfig, s: Setup, bandwidth_gbps: float, *,
                 timed: bool = True) -> None:
        """`timed`: CUDA events (on CPU the host clock) around every replay (ReplayTimer);
        benchmarks/host_ops.py builds the loop without them, counting what the host does."""
        self.name, self.config, self.s, self.bw = name, config, s, bandwidth_gbps
        dtype_name = str(s.dtype).removeprefix("torch.")
        self.head = MoeMtpHead(config, dtype_name) if isinstance(config, MoeConfig) \
            else dh.make_head(config, dtype_name)
        weights = dc.random_weights(config, _settings(s))
        params = self.head.bind(weights)
        del weights
        widths = [1 << i for i in range(s.max_width.bit_length())]
        t = time.perf_counter()
        self.p = MtpProposer(self.head, params, num_drafts=s.num_drafts,
                             num_blocks=1 + s.max_width * s.max_blocks, block_size=s.block_size,
                             max_blocks_per_seq=s.max_blocks, max_width=s.max_width,
                             widths=widths, forward="circuit", device=str(s.device))
        self.build_s = time.perf_counter() - t
        self.chain = self.p.chain_runner(s.num_drafts)
        self.one_step = self.p.chain_runner(1)
        self.kv_only, is_kv = self.p.chains.kv_only()
        assert is_kv, "the proposer's catch-up chain should be the KV-only one"
        self.timer = ReplayTimer(s)
        if timed:
            self.timer.wrap(self.chain, "chain")
            self.timer.wrap(self.one_step, "catchup")
            self.timer.wrap(self.kv_only, "catchup")
        self.dtype_bytes = torch.empty((), dtype=s.dtype).element_size()

    # ---- the plan's floors ----
    def kv_only_plan(self, rows: int) -> tuple[int, float]:
        """(launches, floor us) of the KV-only programs `rows` catch-up rows replay (chunks of
        the widest program, the rest padded), the plan's bytes over the measured bandwidth."""
        launches, nbytes, w = 0, 0, self.kv_only.max_width
        for start in range(0, rows, w):
            plan = self.kv_only.plan(min(w, rows - start))
            for width, _ in plan.parts:
                prog = self.kv_only.compiled.programs[width]
                launches += len(prog.launches)
                nbytes += prog.bytes_moved
        return launches, nbytes / (self.bw * 1e3)

    def chain_floor(self, n: int, live: float) -> dict[str, float]:
        parts = dc.floor_bytes(self.config, n, self.s.num_drafts, live, self.dtype_bytes,
                               self.s.max_blocks)
        plan = self.chain.plan(n)
        prog_bytes = sum(self.chain.compiled.programs[w].bytes_moved for w, _ in plan.parts)
        return {"floor_us": dc.floor_us(parts["total"], self.bw),
                "plan_floor_us": prog_bytes / (self.bw * 1e3),
                "plan_launches": sum(len(self.chain.compiled.programs[w].launches)
                                     for w, _ in plan.parts)}

    # ---- one width, one mode ----
    def states(self, n: int, g: torch.Generator) -> list[Any]:
        p, c, s = self.p, self.config, self.s
        states = [p.alloc_state() for _ in range(n)]
        prompts = [torch.randint(0, c.vocab_size, (s.live + 1,), generator=g).tolist()
                   for _ in range(n)]
        hid = torch.randn(n, s.live, self.head.hidden_in_size, generator=g).to(s.dtype).to(s.device)
        p.catchup_batch([q[1:] for q in prompts], [hid[i] for i in range(n)], [1] * n, states)
        return states

    def begin(self, n: int, mode: str) -> list[Any]:
        """A mode's fresh states at width n, its catch-up runner installed, and the step's
        seeded inputs (the same seeds for every mode): what `_step` then runs on. The caller
        frees the states."""
        p, s = self.p, self.s
        if mode == "before":  # the full one-step chain serves catch-up rows (the host's runner)
            p.set_circuit_draft(self.one_step, num_drafts=1)
        else:
            p.chains.uninstall((1, False))
        g = torch.Generator().manual_seed(s.seed + n)
        self.rng = random.Random(s.seed + n)
        states = self.states(n, g)
        self.hid = torch.randn(n, self.head.hidden_in_size, generator=g).to(s.dtype).to(s.device)
        catch = torch.randn(n, s.num_drafts, self.head.hidden_in_size,
                            generator=g).to(s.dtype).to(s.device)
        self.catch_h = [catch[i] for i in range(n)]
        self.lives: list[float] = []
        if mode == "step":  # the batch's first propose (no verify before it), untimed
            tokens = [self.rng.randrange(self.config.vocab_size) for _ in states]
            self.pos = [q + 2 for q in p.last_pair_keys(states)]
            assert p.propose_batch_on_device(tokens, self.hid, self.pos, s.num_drafts,
                                             states) is not None, p.last_served
        return states

    def run(self, n: int, mode: str) -> dict[str, Any]:
        """One mode's steps at width n on fresh states (the same seeds for every mode)."""
        p = self.p
        states = self.begin(n, mode)
        try:
            if mode == "pipelined":
                samples = self._pipelined(states)
            else:
                samples = self._synced(states, mode)
        finally:
            for st in states:
                p.free_state(st)
        entry: dict[str, Any] = {key: statistics.median(x[key] for x in samples)
                                 for key in samples[0]}
        entry["samples"] = {key: [round(x[key], 3) for x in samples] for key in samples[0]}
        entry["served"] = p.last_served.kind if p.last_served else None
        entry["mean_live_rows"] = statistics.mean(self.lives)
        return entry

    def _live(self, states: list[Any]) -> None:
        """Record the mean drafter rows a step starts from (outside any timed block)."""
        self.lives.append(statistics.mean(self.p.drafter_rows(st) for st in states))

    def _step(self, states: list[Any], mode: str) -> int:
        """One decode step's draft side; returns the catch-up rows."""
        p, k = self.p, self.s.num_drafts
        if mode == "step":
            return self._one_call_step(states)
        tokens = [self.rng.randrange(self.config.vocab_size) for _ in states]
        # the batch calls an engine makes (examples/engine: last_pair_keys, after_verify_batch),
        # not a proposer call a sequence, which would bill the driver's loop as host overhead
        pos = [q + 2 for q in p.last_pair_keys(states)]
        if mode == "before":
            drafts = p.propose_batch(tokens, self.hid, pos, k, states)
            assert drafts is not None, p.last_served
        else:
            assert p.propose_batch_on_device(tokens, self.hid, pos, k, states) is not None, \
                p.last_served
            drafts = p.last_drafts(states)  # the step's one read (an engine's verify read)
        accepted = [self.rng.randint(0, len(d)) for d in drafts]
        p.after_verify_batch(accepted, states)
        p.catchup_batch([d[:a] for d, a in zip(drafts, accepted)],
                        [h[:a] for h, a in zip(self.catch_h, accepted)],
                        [q + 1 for q in pos], states)
        return sum(accepted)

    def _one_call_step(self, states: list[Any]) -> int:
        """The step mode's step: the read of the drafts, then one `step_batch` (the same seeded
        draws in the same order as `_step`'s, so the same drafts and rows)."""
        p, k = self.p, self.s.num_drafts
        drafts = p.last_drafts(states)  # the step's one read (an engine's verify read)
        accepted = [self.rng.randint(0, len(d)) for d in drafts]
        tokens = [self.rng.randrange(self.config.vocab_size) for _ in states]
        first = [q + 1 for q in self.pos]
        self.pos = [q + a + 1 for q, a in zip(self.pos, accepted)]  # one past the accepted
        assert p.step_batch(accepted, [d[:a] for d, a in zip(drafts, accepted)],
                            [h[:a] for h, a in zip(self.catch_h, accepted)], tokens, self.hid,
                            self.pos, k, states, catchup_first=first) is not None, p.last_served
        return sum(accepted)

    def _sample(self, wall: float, rows: int, got: dict[str, dict[str, float]],
                steps: int = 1) -> dict[str, float]:
        chain, cu = got.get("chain", {}), got.get("catchup", {})
        kv_launches, kv_floor = self.kv_only_plan(rows)
        gpu = chain.get("us", 0.0) + cu.get("us", 0.0)
        return {"wall_us": wall / steps, "gpu_us": gpu / steps, "host_us": (wall - gpu) / steps,
                "chain_gpu_us": chain.get("us", 0.0) / steps,
                "catchup_gpu_us": cu.get("us", 0.0) / steps,
                "catchup_replays": cu.get("replays", 0) / steps,
                "catchup_launches": cu.get("launches", 0) / steps,
                "catchup_rows": rows / steps, "kv_only_launches": kv_launches / steps,
                "kv_only_floor_us": kv_floor / steps}

    def _synced(self, states: list[Any], mode: str) -> list[dict[str, float]]:
        """Each step alone: from an idle device to its catch-up's last kernel."""
        samples = []
        for step in range(self.s.warmup + self.s.steps):
            if step >= self.s.warmup:
                self._live(states)
            sync(self.s)
            self.timer.records.clear()
            t0 = time.perf_counter()
            rows = self._step(states, mode)
            sync(self.s)
            wall = (time.perf_counter() - t0) * 1e6
            got = self.timer.collect()
            if step >= self.s.warmup:
                samples.append(self._sample(wall, rows, got))
        return samples

    def _pipelined(self, states: list[Any]) -> list[dict[str, float]]:
        """The after path's steps back to back, as an engine runs them: no sync but each step's
        one read, so a catch-up overlaps the next step's host work. One sample: the block's
        totals per step (the KV-only plan of each step's rows summed)."""
        s = self.s
        for _ in range(s.warmup):
            self._step(states, "after")
        self.timer.reserve(s.steps * (2 + -(-len(states) * s.num_drafts // self.kv_only.max_width)))
        self._live(states)
        sync(s)
        self.timer.records.clear()
        t0 = time.perf_counter()
        rows = [self._step(states, "after") for _ in range(s.steps)]
        sync(s)
        wall = (time.perf_counter() - t0) * 1e6
        self._live(states)  # the block's mean: about halfway between its first and last
        sample = self._sample(wall, 0, self.timer.collect(), s.steps)
        plans = [self.kv_only_plan(r) for r in rows]
        sample.update(catchup_rows=sum(rows) / s.steps,
                      kv_only_launches=sum(x[0] for x in plans) / s.steps,
                      kv_only_floor_us=sum(x[1] for x in plans) / s.steps)
        return [sample]


def _settings(s: Setup) -> dc.Settings:
    """draft_chain's settings for its weight builder (only device, dtype and seed are read)."""
    return dc.Settings(device=s.device, dtype=s.dtype, num_drafts=s.num_drafts, widths=s.widths,
                       max_width=s.max_width, block_size=s.block_size, max_blocks=s.max_blocks,
                       num_sets=1, live_min=s.live, live_max=s.live, iters=s.steps,
                       warmup=s.warmup, seed=s.seed, circuit_widths="bench",
                       compile_dynamic=None, compile_backend=None)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 and math.isfinite(a) and math.isfinite(b) else None


def ratios(name: str, entry: dict[str, Any], chain_floor: dict[str, float]) -> dict[str, Any]:
    """Each mode against its floors and the targets; after against before."""
    out: dict[str, Any] = {}
    for mode in MODES:
        e = entry[mode]
        out[mode] = {
            "wall_over_chain_gpu": _ratio(e["wall_us"], e["chain_gpu_us"]),
            "wall_over_chain_floor": _ratio(e["wall_us"], chain_floor["floor_us"]),
            "chain_gpu_over_floor": _ratio(e["chain_gpu_us"], chain_floor["floor_us"]),
            "catchup_over_kv_only_floor": _ratio(e["catchup_gpu_us"], e["kv_only_floor_us"]),
            "catchup_over_chain_gpu": _ratio(e["catchup_gpu_us"], e["chain_gpu_us"]),
            "catchup_launches_over_kv_only": _ratio(e["catchup_launches"], e["kv_only_launches"]),
        }
        r = out[mode]
        out[mode]["meets"] = {
            "host_us": e["host_us"] <= TARGETS["host_us_max"],
            "wall_over_chain_gpu": r["wall_over_chain_gpu"] is not None
            and r["wall_over_chain_gpu"] <= TARGETS["wall_over_chain_gpu_max"],
            **({"catchup_over_chain_gpu": r["catchup_over_chain_gpu"] is not None
                and r["catchup_over_chain_gpu"] <= TARGETS["catchup_over_chain_gpu_max_8b"]}
               if name == "8b" else {}),
        }
    b = entry["before"]
    for mode in AGAINST_BEFORE:
        out[f"{mode}_over_before"] = {key: _ratio(entry[mode][key], b[key]) for key in
                                      ("wall_us", "gpu_us", "host_us", "catchup_gpu_us",
                                       "catchup_launches")}
    return out


def markdown(data: dict[str, Any]) -> str:
    lines = [f"Decode step, draft side ({data['device']}, k = {data['num_drafts']}, "
             f"~{data['live_rows']} drafter rows, {data['steps']} steps, copy bandwidth "
             f"{data['bandwidth_gbps']:.0f} GB/s; µs, medians of synced steps, before -> after; "
             "pipelined: after's steps back to back, per step)", "",
             "| config | n | wall | GPU | host | chain GPU (floor) | catch-up GPU | catch-up "
             "launches (KV-only plan) | KV-only floor | step_batch wall (host) | "
             "pipelined wall (host) | wall / chain GPU |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, cfg in data["configs"].items():
        for n, e in cfg["widths"].items():
            if "error" in e:
                lines.append(f"| {name} | {n} | failed: {e['error'][:80]} |" + " |" * 10)
                continue
            b, a, q, r = e["before"], e["after"], e["pipelined"], e["ratios"]
            one = e["step"]

            def pair(key: str, fmt: str = "{:.1f}") -> str:
                return f"{fmt.format(b[key])} -> {fmt.format(a[key])}"

            def rr(mode: str) -> str:
                x = r[mode]["wall_over_chain_gpu"]
                return "-" if x is None else f"{x:.2f}x"
            lines.append(
                f"| {name} | {n} | {pair('wall_us')} | {pair('gpu_us')} | {pair('host_us')} | "
                f"{pair('chain_gpu_us')} ({e['chain_floor']['floor_us']:.1f}) | "
                f"{pair('catchup_gpu_us')} | {pair('catchup_launches', '{:.0f}')} "
                f"({a['kv_only_launches']:.0f}) | {a['kv_only_floor_us']:.1f} | "
                f"{one['wall_us']:.1f} ({one['host_us']:.1f}) | "
                f"{q['wall_us']:.1f} ({q['host_us']:.1f}) | "
                f"{rr('before')} -> {rr('after')}, {rr('pipelined')} |")
    return "\n".join(lines) + "\n"


def write_markdown(path: str, text: str) -> None:
    """Write (or replace) this benchmark's section of `path`; other sections stay."""
    begin, end = "<!-- run: decode_step -->", "<!-- end run: decode_step -->"
    section = f"{begin}\n## Decode step (benchmarks/decode_step.py)\n\n{text}{end}\n"
    old = open(path).read() if os.path.exists(path) else ""
    if begin in old and end in old:
        pre, rest = old.split(begin, 1)
        new = pre + section + rest.split(end, 1)[1]
    else:
        new = (old.rstrip("\n") + "\n\n" if old else "") + section
    with open(path, "w") as f:
        f.write(new)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return make_parser().parse_args(argv)


def make_parser() -> argparse.ArgumentParser:
    """The benchmark's arguments (benchmarks/host_ops.py adds its own to them)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma list of small, 8b, moe")
    p.add_argument("--widths", default="1,8,32,64")
    p.add_argument("--num-drafts", type=int, default=4)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--live", type=int, default=100, help="drafter rows each sequence starts with")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--copy-gib", type=float, default=2.0, help="bandwidth measurement size")
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true",
                   help="tiny configs (fp32), widths 1,3, 3 steps: checks the script (CPU smoke)")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/"
                                               "decode_step_<device>.json; none with --quick)")
    p.add_argument("--results-md", default=None, help="markdown file to write the table into")
    return p


def setup(args: argparse.Namespace) -> tuple[dict[str, MtpConfig], Setup, int]:
    """(configs by name, the loop's setup, the bandwidth measurement's bytes) of parsed args."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --device cpu")
    if args.num_drafts < 2:  # the k-step and one-step chains must be two runners to time apart
        raise SystemExit(f"--num-drafts must be >= 2, got {args.num_drafts}")
    names = [x.strip() for x in args.configs.split(",") if x.strip()]
    unknown = [x for x in names if x not in QUICK_CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {', '.join(QUICK_CONFIGS)}")
    if args.quick:
        configs = dict(QUICK_CONFIGS[n] for n in names)
        s = Setup(device=device, dtype=torch.float32, num_drafts=args.num_drafts, widths=[1, 3],
                  steps=3, warmup=1, live=20, block_size=8, seed=args.seed)
        copy_bytes = 1 << 20
    else:
        configs = {n: dc.CONFIGS[n] for n in names}
        widths = sorted({int(x) for x in args.widths.split(",") if x.strip()})
        if not widths or widths[0] < 1:
            raise SystemExit(f"widths {widths} must be >= 1")
        s = Setup(device=device, dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                  num_drafts=args.num_drafts, widths=widths, steps=args.steps,
                  warmup=args.warmup, live=args.live, block_size=args.block_size, seed=args.seed)
        copy_bytes = int(args.copy_gib * (1 << 30))
    return configs, s, copy_bytes


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    configs, s, copy_bytes = setup(args)
    device = s.device
    threads = torch.get_num_threads()
    if not s.cuda:
        torch.set_num_threads(1)  # tiny CPU ops: a pool only adds contention
    try:
        bw, _ = dc.copy_bandwidth(device, copy_bytes)
        data: dict[str, Any] = {
            "benchmark": "decode_step", "device": dc.device_name(device),
            "torch": torch.__version__, "quick": args.quick, "dtype": str(s.dtype),
            "num_drafts": s.num_drafts, "steps": s.steps, "warmup": s.warmup,
            "live_rows": s.live, "widths": s.widths, "bandwidth_gbps": bw, "targets": TARGETS,
            "configs": {}}
        for name, config in configs.items():
            log(f"{name}: building the proposer (compile{' and capture' if s.cuda else ''})")
            loop = Loop(name, config, s, bw)
            cfg: dict[str, Any] = {"config": asdict(config), "head": type(loop.head).__name__,
                                   "build_s": loop.build_s, "widths": {}}
            data["configs"][name] = cfg
            for n in s.widths:
                try:
                    entry: dict[str, Any] = {m: loop.run(n, m) for m in MODES}
                    entry["chain_floor"] = loop.chain_floor(n, entry["after"]["mean_live_rows"])
                    entry["ratios"] = ratios(name, entry, entry["chain_floor"])
                except Exception as e:  # noqa: BLE001 - one width's failure is a result
                    entry = {"error": f"{type(e).__name__}: {e}"}
                    log(f"{name} n={n}: FAILED {entry['error'][:300]}")
                cfg["widths"][str(n)] = entry
                if "error" not in entry:
                    a, b = entry["after"], entry["before"]
                    log(f"{name} n={n}: wall {b['wall_us']:.1f} -> {a['wall_us']:.1f} us, host "
                        f"{b['host_us']:.1f} -> {a['host_us']:.1f}, catch-up GPU "
                        f"{b['catchup_gpu_us']:.1f} -> {a['catchup_gpu_us']:.1f}")
            del loop
            dc.free_memory(device)
    finally:
        torch.set_num_threads(threads)
    table = markdown(data)
    print(table)
    out = args.out or (None if args.quick else os.path.join(
        "benchmarks", "results", f"decode_step_{dc.slug(data['device'])}.json"))
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(data, f, indent=1)
        log(f"wrote {out}")
    if args.results_md:
        write_markdown(args.results_md, table)
    return data


if __name__ == "__main__":
    main()
