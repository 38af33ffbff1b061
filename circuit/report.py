"""The plan report: the versioned, plain-data view of a compiled draft that the CLI, the
visualisation and tests read. Built only from programs; nothing downstream recomputes analysis.
Same circuit, param shapes and options give byte-identical JSON (no clocks, sorted keys)."""
from __future__ import annotations

import json
from typing import Any

from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from draft_circuit.circuit.ir import Circuit, Origin
from draft_circuit.circuit.program import Launch, Program
from draft_circuit.circuit.types import TensorSpec
from draft_circuit.ops.registry import get_op

REPORT_SCHEMA_VERSION = 1


class ReportError(ValueError):
    """A plan report that cannot be read: names the file (when there is one) and what is wrong."""


class NodeInfo(BaseModel):
    model_config = ConfigDict(frozen=True)
    name: str
    op: str
    step: int | None
    attrs: dict[str, Any]
    inputs: list[str]
    outputs: list[str]
    shapes: dict[str, str]  # value -> printed spec, for every input and output
    fused: list[str]
    origin: list[Origin] = []  # the layer lines that built it (a fused node: each part's)


class KernelChoice(BaseModel):
    """Why a node got its kernel at one width (circuit/tuning.py): the chosen binding, the rule,
    and the measured us of every candidate."""
    model_config = ConfigDict(frozen=True)
    node: str
    kernel: str
    why: str
    us: dict[str, float]


class WidthReport(BaseModel):
    model_config = ConfigDict(frozen=True)
    width: int
    launches: int  # schedule entries (nodes), each one call of a kernel binding or a reference
    launches_per_step: float
    # the GPU kernels those calls issue (a split kernel and its merge are two; see
    # KernelBinding.launches); reference launches run torch ops counted only in reference_launches
    gpu_launches: int = 0
    gpu_launches_per_step: float = 0.0
    reference_launches: int = 0
    fused_groups: list[dict[str, Any]]  # node, op, kernel, fused (the original nodes)
    arena_bytes: int  # this width's own plan; the shared arena is the plan's max
    lower_bound_bytes: int
    naive_bytes: int
    strategy: str
    bytes_moved: int
    flops: int
    floor_us: float
    capture_ms: float | None = None  # filled by a graph runner when it captures
    graph_pool_bytes: int | None = None  # the graph pool's reserved growth while capturing it
    kernel_choices: list[KernelChoice] = []  # measured choices (CompileOptions.tuning)
    schedule: list[Launch]
    buffers: list[dict[str, Any]]


class FamilyWidth(BaseModel):
    """One width of a derived program family (e.g. the KV-only catch-up program): what it launches
    and moves, beside the main family's full `WidthReport`."""
    model_config = ConfigDict(frozen=True)
    width: int
    launches: int
    bytes_moved: int
    flops: int
    floor_us: float


class PlanReport(BaseModel):
    model_config = ConfigDict(frozen=True)
    schema_version: int = REPORT_SCHEMA_VERSION
    circuit: str
    fingerprint: str
    device: str
    options: dict[str, Any]
    pipeline: list[str]
    num_nodes_before: int
    num_nodes_after: int
    arena_bytes: int
    nodes: list[NodeInfo]
    widths: list[WidthReport]
    notes: dict[str, Any] = {}  # what the layer states about the plan (an MoE head's refusals)
    # derived program families by name (the one-step chain's "kv_only"), each per width
    families: dict[str, list[FamilyWidth]] = {}

    def to_json(self) -> str:
        data = self.model_dump(mode="json")
        if not data["families"]:  # a plan without derived families reads as it always did
            del data["families"]
        return json.dumps(data, sort_keys=True, indent=1)

    @classmethod
    def from_json(cls, text: str, source: str = "plan report") -> "PlanReport":
        """Parse and validate; every failure is a `ReportError` naming `source` (a file name)."""
        try:
            data = json.loads(text)
        except (ValueError, RecursionError) as e:  # truncated, not JSON, or nested too deep
            raise ReportError(f"{source}: not a readable JSON plan report ({type(e).__name__}: "
                              f"{str(e)[:200]})") from None
        if not isinstance(data, dict):
            raise ReportError(f"{source}: a plan report is a JSON object, got "
                              f"{type(data).__name__}")
        if data.get("schema_version") != REPORT_SCHEMA_VERSION:
            raise ReportError(f"{source}: plan report schema_version "
                              f"{data.get('schema_version')!r}; this build reads "
                              f"{REPORT_SCHEMA_VERSION}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            first = e.errors(include_url=False)[0]
            where = ".".join(str(x) for x in first["loc"])
            raise ReportError(f"{source}: invalid plan report at {where or 'top level'}: "
                              f"{first['msg']} ({e.error_count()} errors)") from None

    @classmethod
    def read(cls, path: "str | Path") -> "PlanReport":
        try:
            text = Path(path).read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise ReportError(f"cannot read plan report {str(path)!r}: {e}") from None
        return cls.from_json(text, source=str(path))

    def width(self, n: int) -> WidthReport:
        for w in self.widths:
            if w.width == n:
                return w
        raise ReportError(f"the plan has no width {n}; it has {[w.width for w in self.widths]}")


def node_infos(c: Circuit) -> list[NodeInfo]:
    from draft_circuit.circuit.program import step_of
    return [NodeInfo(name=n.name, op=n.op, step=step_of(n.name), attrs=dict(n.attrs),
                     inputs=list(n.inputs), outputs=list(n.outputs),
                     shapes={v: str(c.value(v).spec) for v in (*n.inputs, *n.outputs)},
                     fused=list(n.fused), origin=list(n.origin))
            for n in c.topo_order()]


def family_width(p: Program, bandwidth_gbps: float) -> FamilyWidth:
    return FamilyWidth(width=p.width, launches=len(p.launches), bytes_moved=p.bytes_moved,
                       flops=sum(x.flops for x in p.launches),
                       floor_us=round(p.bytes_moved / (bandwidth_gbps * 1e3), 4))


def gpu_launches(x: Launch) -> int | None:
    """The GPU kernels launch `x` issues (its binding's declared count for these operands); None
    for a reference (torch ops whose kernels the plan does not know)."""
    op = get_op(x.op)
    binding = next((k for k in op.kernels if k.name == x.kernel), None)
    if binding is None:
        return None
    specs = [TensorSpec(dtype=s.dtype, shape=s.shape) for s in x.inputs]
    return binding.launch_count(specs, op.parse_attrs(dict(x.attrs)))


def width_report(p: Program, bandwidth_gbps: float) -> WidthReport:
    steps = {x.step for x in p.launches if x.step is not None}
    in_steps = sum(1 for x in p.launches if x.step is not None)
    counts = [gpu_launches(x) for x in p.launches]
    gpu_in_steps = sum(c or 0 for c, x in zip(counts, p.launches) if x.step is not None)
    return WidthReport(
        width=p.width, launches=len(p.launches),
        launches_per_step=round(in_steps / len(steps), 3) if steps else float(len(p.launches)),
        gpu_launches=sum(c or 0 for c in counts),
        gpu_launches_per_step=(round(gpu_in_steps / len(steps), 3) if steps
                               else float(sum(c or 0 for c in counts))),
        reference_launches=sum(1 for c in counts if c is None),
        fused_groups=[{"node": x.node, "op": x.op, "kernel": x.kernel, "fused": list(x.fused)}
                      for x in p.launches if x.fused],
        arena_bytes=p.arena_bytes, lower_bound_bytes=p.lower_bound_bytes,
        naive_bytes=p.naive_bytes, strategy=p.strategy, bytes_moved=p.bytes_moved,
        flops=sum(x.flops for x in p.launches),
        floor_us=round(p.bytes_moved / (bandwidth_gbps * 1e3), 4),
        schedule=list(p.launches), buffers=[b.model_dump() for b in p.buffers])
