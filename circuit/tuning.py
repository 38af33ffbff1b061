"""Measured kernel choice (issue 15 item 4): where a node has more than one applicable kernel
binding (a linear: split-K, single pass, cuBLAS when width independence is off), time each on the
GPU in a CUDA graph once, cache the microseconds on disk, and let the planner bind the fastest.

- The cache file holds one environment (device name, torch, Triton and CUDA versions): opened
  under another, it starts empty (`TuningCache.invalidated`), so a driver or library upgrade
  re-measures. Each entry is keyed by the op, its attrs, the candidate kernel and the node's
  input shapes and dtypes at that width, so a new shape or dtype is a miss, never a stale hit.
- Width independence (the default) binds one kernel per node at every width: the candidate with
  the least total time over the compiled widths (its bits never depend on n; split-K and the
  single pass round differently, so choosing per width would make them). Without it, each
  width takes its own fastest.
- Only sample widths are timed (1, the powers of two, the largest: `sample_widths`); a width
  between them uses the nearest sample's times (the report says which), so a 64-width plan costs
  7 measurements a node shape and candidate, not 64.
- Every choice is plain data (`KernelChoice`: node, kernel, why, measured us per candidate) for
  the plan report and page.

`gpu_measure` is the measurement: random operands of the node's specs (float inputs N(0, 1)
scaled by 1/sqrt(K), indices 0), float params rotated through copies totalling more than the
L2 so every launch streams from HBM as in the chain, a graph of >= 20 launches replayed, the
median us per launch.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from draft_circuit.circuit.capture_rng import release_rng_capture
from draft_circuit.circuit.ir import ROW, Circuit, CircuitError, Node
from draft_circuit.circuit.report import KernelChoice
from draft_circuit.circuit.types import TensorSpec
from draft_circuit.ops.bindings import KernelBinding
from draft_circuit.ops.registry import OpDef, get_op, torch_dtype

log = logging.getLogger(__name__)
TUNING_SCHEMA = 1
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "draft_circuit" / "tuning.json"
ROTATE_BYTES = 128 << 20  # > 2x the H200's 50 MB L2
MIN_LAUNCHES, REPLAYS = 20, 7


class TuningError(CircuitError):
    """A tuning request that cannot be served (no GPU to measure on, an unreadable cache)."""


# (op, binding, the node's concrete input specs, parsed attrs, device) -> us per launch
Measure = Callable[[OpDef, KernelBinding, Sequence[TensorSpec], Any, str], float]


def environment(device: str) -> dict[str, str]:
    """What a measurement depends on beyond the node: the device and the library versions."""
    kind = torch.device(device).type
    name = torch.cuda.get_device_name(torch.device(device)) if kind == "cuda" else kind
    try:
        import triton
        triton_version = str(triton.__version__)
    except ImportError:  # a CPU-only install without Triton still plans
        triton_version = "none"
    return {"device": name, "torch": str(torch.__version__), "triton": triton_version,
            "cuda": str(torch.version.cuda or "none")}


def entry_key(op: str, attrs: Mapping[str, Any], kernel: str, specs: Sequence[TensorSpec]) -> str:
    """The cache key of one (node shape, candidate): op, attrs, kernel, input dtypes and shapes."""
    data = {"op": op, "attrs": dict(attrs), "kernel": kernel,
            "inputs": [[s.dtype, list(s.shape)] for s in specs]}
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:32]


class TuningCache:
    """Measured us on disk for one environment; `save()` writes atomically."""

    def __init__(self, path: str | Path, env: Mapping[str, str]) -> None:
        self.path, self.env = Path(path), dict(env)
        self.entries: dict[str, float] = {}
        self.invalidated = False  # a file existed for another environment (or schema)
        if self.path.exists():
            try:
                data = json.loads(self.path.read_text())
            except (OSError, ValueError) as e:
                raise TuningError(f"tuning cache {str(self.path)!r} is unreadable: {e}") from None
            if data.get("schema") == TUNING_SCHEMA and data.get("env") == self.env:
                self.entries = {str(k): float(v) for k, v in data.get("entries", {}).items()}
            else:
                self.invalidated = True

    def get(self, key: str) -> float | None:
        return self.entries.get(key)

    def put(self, key: str, us: float) -> None:
        self.entries[key] = float(us)

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"schema": TUNING_SCHEMA, "env": self.env, "entries": self.entries},
                          sort_keys=True, indent=1)
        fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".tuning.")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, self.path)


def candidates(op: OpDef, ins: Sequence[TensorSpec], attrs: Any, device: str,
               allowed: set[str] | None, width_independent: bool) -> list[KernelBinding]:
    """The bindings the planner could bind here (what choose_kernel picks the first of)."""
    return [k for k in op.kernels if (allowed is None or k.name in allowed)
            and (k.width_independent or not width_independent) and k.applies(device, ins, attrs)]


def sample_widths(widths: Sequence[int]) -> list[int]:
    """The widths a tuning pass times: the smallest, every power of two between, the largest."""
    ws = sorted(set(widths))
    return sorted({ws[0], ws[-1], *(w for w in ws if w & (w - 1) == 0)})


def _nearest(w: int, sample: Sequence[int]) -> int:
    return min(sample, key=lambda s: (abs(s - w), s))


def choose(c: Circuit, widths: Sequence[int], device: str, *, cache: TuningCache | None,
           measure: Measure | None, allowed: set[str] | None, width_independent: bool
           ) -> tuple[dict[int, dict[str, str]], dict[int, list[KernelChoice]]]:
    """(width -> node -> kernel to bind, width -> the choices made) for every node with two or
    more candidates. A candidate's time comes from the cache, else from `measure` (then cached);
    with neither the node keeps the planner's first applicable kernel (why says so)."""
    overrides: dict[int, dict[str, str]] = {w: {} for w in widths}
    choices: dict[int, list[KernelChoice]] = {w: [] for w in widths}
    for node in c.topo_order():
        op = get_op(node.op)
        attrs = op.parse_attrs(node.attrs)
        symbolic = [c.value(x).spec for x in node.inputs]
        cands = candidates(op, symbolic, attrs, device, allowed, width_independent)
        if len(cands) < 2:
            continue
        sample = sample_widths(widths)
        timed = {s: _times(node, op, attrs, symbolic, cands, s, device, cache, measure) for s in sample}
        _decide(node, cands, timed, list(widths), width_independent, overrides, choices)
    return overrides, choices


def _times(node: Node, op: OpDef, attrs: Any, symbolic: Sequence[TensorSpec],
           cands: Sequence[KernelBinding], width: int, device: str, cache: TuningCache | None,
           measure: Measure | None) -> dict[str, float | None]:
    specs = [TensorSpec(dtype=s.dtype, shape=s.concrete({ROW: width})) for s in symbolic]
    out: dict[str, float | None] = {}
    for k in cands:
        key = entry_key(op.name, node.attrs, k.name, specs)
        us = cache.get(key) if cache is not None else None
        if us is None and measure is not None:
            try:
                us = measure(op, k, specs, attrs, device)
            except Exception as e:  # noqa: BLE001 - a candidate that cannot run is never chosen
                log.warning("tuning: %s for %s at n=%d failed to run (%s: %s); not a candidate",
                            k.name, node.name, width, type(e).__name__, str(e)[:200])
                out[k.name] = math.inf  # not cached: the failure may be this run's alone
                continue
            if cache is not None:
                cache.put(key, us)
        out[k.name] = us
    return out


def _decide(node: Node, cands: Sequence[KernelBinding], times: Mapping[int, Mapping[str, float | None]],
            widths: Sequence[int], width_independent: bool, overrides: dict[int, dict[str, str]],
            choices: dict[int, list[KernelChoice]]) -> None:
    """`times`: the sample widths' us per candidate; every width in `widths` gets a choice."""
    first = cands[0].name
    complete = all(us is not None for t in times.values() for us in t.values())
    for w in widths:
        at = _nearest(w, list(times))
        t = times[at]
        where = "" if at == w else f" (times measured at n={at})"
        measured = {k: round(float(us), 3) for k, us in t.items()
                    if us is not None and math.isfinite(us)}
        failed = sorted(k for k, us in t.items() if us is not None and not math.isfinite(us))
        if failed and not measured:
            why = f"every candidate failed to run when measured ({', '.join(failed)}): the first applicable binding"
            choices[w].append(KernelChoice(node=node.name, kernel=first, why=why, us={}))
            continue
        if not complete:
            why = "not measured (no tuning cache entry and no GPU pass): the first applicable binding"
            choices[w].append(KernelChoice(node=node.name, kernel=first, why=why, us=measured))
            continue
        if width_independent:
            total = {k.name: sum(float(times[x][k.name] or 0.0) for x in times) for k in cands}
            best = min(total, key=lambda k: (total[k], k))
            why = (f"least total time over the sample widths {sorted(times)} "
                   f"({total[best]:.1f} us): one kernel at every width keeps a row's bits "
                   f"independent of n{where}")
            if failed:
                why += f"; failed to run: {', '.join(failed)}"
        else:
            best = min(measured, key=lambda k: (measured[k], k))
            why = f"fastest measured at n={at} (width independence off){where}"
            if failed:
                why += f"; failed to run: {', '.join(failed)}"
        overrides[w][node.name] = best
        choices[w].append(KernelChoice(node=node.name, kernel=best, why=why, us=measured))


# ---- the GPU measurement -----------------------------------------------------------------------
def _operand(spec: TensorSpec, device: str, g: torch.Generator) -> torch.Tensor:
    shape = tuple(int(d) for d in spec.shape)
    dtype = torch_dtype(spec.dtype)
    if not dtype.is_floating_point:
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.randn(shape, generator=g, device=device, dtype=torch.float32)
    return (t / math.sqrt(shape[-1]) if len(shape) > 1 else t).to(dtype)


def gpu_measure(op: OpDef, binding: KernelBinding, specs: Sequence[TensorSpec], attrs: Any,
                device: str) -> float:
    """Median us per launch of `binding` on random operands of `specs`, in a CUDA graph, with the
    rank-2 float inputs that do not depend on n (weights) rotated past the L2."""
    if torch.device(device).type != "cuda":
        raise TuningError(f"measuring kernels needs a CUDA device, not {device}")
    g = torch.Generator(device=device).manual_seed(0)
    base = [_operand(s, device, g) for s in specs]
    weight_idx = [i for i, t in enumerate(base) if t.dim() == 2 and t.is_floating_point() and i > 0]
    nbytes = sum(base[i].numel() * base[i].element_size() for i in weight_idx)
    copies = max(1, min(64, math.ceil(ROTATE_BYTES / max(nbytes, 1)))) if weight_idx else 1
    sets = [base] + [[t.clone() if i in weight_idx else t for i, t in enumerate(base)]
                     for _ in range(copies - 1)]
    outs = [torch.empty(tuple(int(d) for d in s.shape), dtype=torch_dtype(s.dtype), device=device)
            for s in op.infer(list(specs), attrs)]
    env = {ROW: int(specs[0].shape[0])} if specs and specs[0].shape else {}
    ws = [torch.empty(tuple(shape), dtype=torch_dtype(dt), device=device)
          for dt, shape in (binding.workspace(specs, env, attrs) if binding.workspace else ())]
    launches = max(MIN_LAUNCHES, copies)

    def run(i: int) -> None:
        binding.launch(sets[i % copies], outs, ws, attrs)

    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # torch stub
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        run(0)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph, stream=side):
            for i in range(launches):
                run(i)
    except Exception:
        # a failed capture leaves the RNG generator in capture mode on torch 2.11: put it back
        # before the caller moves on to the next candidate
        release_rng_capture(side)
        raise
    graph.replay()
    times = []
    for _ in range(REPLAYS):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / launches)
    return float(statistics.median(times))
