"""`compile_draft(circuit, params, widths, device, options) -> CompiledDraft`: verify, run the pass
pipeline, and build one n-row `Program` per requested width. The result serves exactly those
widths and reports itself as plain data (`report()`); runners execute it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping, Sequence

import torch
from pydantic import BaseModel, ConfigDict

from draft_circuit.circuit.ir import Circuit, CircuitError
from draft_circuit.circuit.passes import DEFAULT_PIPELINE, run_passes
from draft_circuit.circuit.program import Program, ProgramBuilder
from draft_circuit.circuit.report import (KernelChoice, PlanReport, WidthReport, family_width, node_infos,
                                          width_report)
from draft_circuit.circuit.tuning import DEFAULT_CACHE, Measure, TuningCache, choose, environment, gpu_measure
from draft_circuit.circuit.verify import verify

#: the program family of a one-step chain's KV-only derivative (catch-up and prefill rows)
KV_ONLY = "kv_only"


class CompileOptions(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")
    pipeline: tuple[str, ...] = DEFAULT_PIPELINE
    verify_passes: bool = True        # verify after every pass (cheap at these sizes)
    kv_rows: int = 100                # live drafter-KV rows a sequence holds, for the cost model
    bandwidth_gbps: float = 4800.0    # for the floor time; pass the bandwidth you measured
    alignment: int = 256              # arena offsets (bytes)
    kernels: tuple[str, ...] | None = None  # allow only these kernels (None: any that applies)
    width_independent: bool = True    # a row's drafts never depend on the batch it shares
    interpret_kernels: bool = False   # on CPU, choose Triton kernels (TRITON_INTERPRET tests)
    # measured kernel choice (circuit/tuning.py): "off" binds the first applicable kernel;
    # "cached" uses measurements in the cache only; "measure" times what the cache lacks on the
    # GPU (once) and saves it
    tuning: Literal["off", "cached", "measure"] = "off"
    tuning_cache: str | None = None   # the cache file (None: ~/.cache/draft_circuit/tuning.json)


class PlanError(CircuitError):
    """A compile request that cannot be planned (widths, params, device)."""


@dataclass
class CompiledDraft:
    """One circuit compiled for a set of widths on one device; params are bound, states are not."""

    source: Circuit                   # the circuit as emitted
    circuit: Circuit                  # after the pass pipeline
    programs: dict[int, Program]
    params: dict[str, torch.Tensor]
    device: str
    options: CompileOptions
    notes: dict[str, Any] = field(default_factory=dict)  # the layer's statements for the report
    # derived program families compiled beside this one (KV_ONLY: catch-up rows), by name
    families: dict[str, "CompiledDraft"] = field(default_factory=dict)
    # width -> (capture ms, the graph pool's reserved growth in bytes), as a graph runner measured
    captures: dict[int, tuple[float, int]] = field(default_factory=dict)
    choices: dict[int, list[KernelChoice]] = field(default_factory=dict)  # measured kernel choices
    _report: PlanReport | None = field(default=None, repr=False)

    @property
    def widths(self) -> tuple[int, ...]:
        return tuple(sorted(self.programs))

    @property
    def max_width(self) -> int:
        return max(self.programs)

    @property
    def arena_bytes(self) -> int:
        """One arena serves every width: it is sized for the largest plan."""
        return max(p.arena_bytes for p in self.programs.values())

    def serves(self, n: int) -> bool:
        return n in self.programs

    def program(self, n: int) -> Program:
        if n not in self.programs:
            raise PlanError(f"width {n} is not compiled; compiled widths: {list(self.widths)}")
        return self.programs[n]

    def report(self) -> PlanReport:
        if self._report is None:
            self._report = PlanReport(
                circuit=self.circuit.name, fingerprint=self.source.fingerprint(),
                device=self.device, options=self.options.model_dump(mode="json"),
                pipeline=list(self.options.pipeline), num_nodes_before=len(self.source.nodes),
                num_nodes_after=len(self.circuit.nodes), arena_bytes=self.arena_bytes,
                nodes=node_infos(self.circuit), notes=dict(self.notes),
                widths=[self._width_report(w) for w in self.widths],
                families={name: [family_width(f.programs[w], self.options.bandwidth_gbps)
                                 for w in f.widths]
                          for name, f in sorted(self.families.items())})
        return self._report

    def _width_report(self, w: int) -> WidthReport:
        report = width_report(self.programs[w], self.options.bandwidth_gbps)
        if self.choices.get(w):
            report = report.model_copy(update={"kernel_choices": list(self.choices[w])})
        if w not in self.captures:
            return report
        ms, pool = self.captures[w]
        return report.model_copy(update={"capture_ms": round(ms, 3), "graph_pool_bytes": pool})

    def record_capture(self, width: int, capture_ms: float, graph_pool_bytes: int) -> None:
        """A graph runner's measurement of width `width`: how long its warm-up and capture took
        and how much the graph pool's reserved memory grew (the caching allocator's segments, not
        the bytes allocated in them). The report shows them from then on (plan page, JSON)."""
        if width not in self.programs:
            raise PlanError(f"width {width} is not compiled; compiled widths: {list(self.widths)}")
        if capture_ms < 0 or graph_pool_bytes < 0:
            raise PlanError(f"capture of width {width}: capture_ms {capture_ms} and "
                            f"graph_pool_bytes {graph_pool_bytes} must be >= 0")
        self.captures[width] = (float(capture_ms), int(graph_pool_bytes))
        self._report = None

    def add_family(self, name: str, family: "CompiledDraft") -> None:
        """List `family` (e.g. KV_ONLY) in this draft's report as its own program family."""
        self.families[name] = family
        self._report = None


def kv_only_circuit(c: Circuit) -> Circuit:
    """`c` with only its state writes as outputs: dead-node elimination then drops every node no
    state write reads (attention, MLP, final norm, lm-head, argmax), never a state writer, and
    the inputs, params and root states nothing reads any more are pruned from the interface.
    What is left writes exactly the rows `c` writes, from the same ops (catch-up, prefill)."""
    from draft_circuit.circuit.passes.eliminate_dead_nodes import eliminate_dead_nodes

    outputs = tuple(o for o in c.outputs if c.value(o).kind == "state")
    if not outputs:
        raise PlanError(f"circuit {c.name!r} returns no state: a KV-only program would do nothing")
    live = eliminate_dead_nodes(c.replace(outputs=outputs))
    used = set(live.outputs).union(*(n.inputs for n in live.nodes),
                                   *(n.outputs for n in live.nodes))
    values = [v for v in live.values if v.kind not in ("input", "param", "state") or v.name in used]
    return Circuit(name=f"{c.name}_kv_only", symbols=dict(live.symbols), values=tuple(values),
                   nodes=live.nodes, outputs=live.outputs)


def device_kind(device: str | torch.device) -> str:
    return torch.device(device).type


def compile_draft(circuit: Circuit, params: Mapping[str, torch.Tensor], widths: Sequence[int],
                  device: str | torch.device = "cpu",
                  options: CompileOptions | None = None,
                  notes: Mapping[str, Any] | None = None,
                  measure: Measure | None = None) -> CompiledDraft:
    """`notes`: plain data the layer states about its plan (e.g. which refused paths the n-row
    program could still serve), carried into the report unchanged. `measure`: the timing
    `options.tuning == "measure"` uses (default: circuit.tuning.gpu_measure, CUDA only)."""
    from draft_circuit.circuit.binding import check_params  # the same check every runner applies

    options = options or CompileOptions()
    verify(circuit)
    lo, hi = circuit.symbols["n"]
    bad = [w for w in widths if not isinstance(w, int) or not lo <= w <= hi]
    if bad or not widths:
        raise PlanError(f"widths {bad or list(widths)} are outside the circuit's bounds "
                        f"{lo} <= n <= {hi}" if bad else "no widths to compile")
    check_params(circuit, params)
    kind = device_kind(device)
    select_for = "interpret" if kind == "cpu" and options.interpret_kernels else kind
    for name, t in params.items():
        if t.device.type not in (kind, "meta"):  # meta: shapes-only plans (`circuit plan`)
            raise PlanError(f"param {name!r} is on {t.device}, the draft compiles for {device}")
    fused = run_passes(circuit, options.pipeline, check=options.verify_passes)
    allowed = set(options.kernels) if options.kernels is not None else None
    todo = sorted(set(widths))
    overrides, choices = _tuned(fused, todo, device, select_for, options, allowed, measure)
    # one builder per distinct kernel choice (one in all unless measured per width): what every
    # width shares is worked out once (circuit.program.ProgramBuilder)
    builders: dict[tuple[tuple[str, str], ...], ProgramBuilder] = {}
    programs = {}
    for w in todo:
        chosen = overrides.get(w)
        key = tuple(sorted(chosen.items())) if chosen else ()
        if key not in builders:
            builders[key] = ProgramBuilder(fused, select_for, kernels=allowed,
                                           width_independent=options.width_independent,
                                           overrides=chosen)
        programs[w] = builders[key].build(w, kv_rows=options.kv_rows, alignment=options.alignment)
    return CompiledDraft(source=circuit, circuit=fused, programs=programs, params=dict(params),
                         device=str(device), options=options, notes=dict(notes or {}),
                         choices=choices)


def _tuned(fused: Circuit, widths: list[int], device: str | torch.device, select_for: str,
           options: CompileOptions, allowed: set[str] | None, measure: Measure | None
           ) -> tuple[dict[int, dict[str, str]], dict[int, list[KernelChoice]]]:
    """The measured kernel choices `options.tuning` asks for (none when it is off)."""
    if options.tuning == "off":
        return {}, {}
    if options.tuning == "measure" and measure is None:
        if device_kind(device) != "cuda":
            raise PlanError(f"tuning='measure' times kernels on the GPU; the draft compiles for "
                            f"{device} (use tuning='cached', or pass measure=)")
        measure = gpu_measure
    cache = TuningCache(options.tuning_cache or DEFAULT_CACHE, environment(str(device)))
    overrides, choices = choose(fused, widths, select_for, cache=cache,
                                measure=measure if options.tuning == "measure" else None,
                                allowed=allowed, width_independent=options.width_independent)
    if options.tuning == "measure":
        cache.save()
    return overrides, choices
