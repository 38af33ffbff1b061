"""Public test helpers for draft runners: random weights and batches for the MTP chain, runner
comparison against the eager oracle (`run_side_by_side` runs one call both ways over copies of
its states; `assert_program_matches_eager`: a compiled draft equals EagerRunner bitwise, outputs
and states, at every width), arena poisoning, and the `cuda` pytest
mark (marks and skips).

Host engines use these in their own test suites; the project's tests use them too.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence, TypeVar

import torch

from draft_circuit.circuit.ir import Circuit
from draft_circuit.circuit.layers.config import MTP_PARAM_SHAPES, MtpConfig
from draft_circuit.circuit.layers.mtp import KvLayout
from draft_circuit.circuit.planner import CompiledDraft, compile_draft
from draft_circuit.runners.draft import CircuitDraftRunner, WidthPolicy
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.program import ProgramRunner
from draft_circuit.runners.device import cuda_available  # noqa: F401  (public here too)


def random_mtp_weights(config: MtpConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """Canonical-name MTP weights scaled so activations stay O(1): norms near 1, projections
    1/sqrt(fan_in), embeddings unit normal."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in MTP_PARAM_SHAPES(config).items():
        t = torch.randn(shape, generator=g)
        if len(shape) == 1:
            t = 1 + 0.1 * t
        elif "embed" not in name:
            t = t / math.sqrt(shape[-1])
        out[name] = t.to(dtype=dtype, device=device)
    return out


@dataclass
class DraftBatch:
    """One call's inputs for the draft chain and the KV pool state they refer to."""

    inputs: dict[str, torch.Tensor]
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    lives: list[int]

    def states(self) -> dict[str, torch.Tensor]:
        return {"k_cache": self.k_cache, "v_cache": self.v_cache}

    def clone_states(self) -> dict[str, torch.Tensor]:
        return {"k_cache": self.k_cache.clone(), "v_cache": self.v_cache.clone()}


def random_draft_batch(config: MtpConfig, kv: KvLayout, width: int, *, seed: int = 0,
                       num_drafts: int = 4, dtype: torch.dtype = torch.float32,
                       device: str | torch.device = "cpu", reserved_blocks: int = 1,
                       bitmask: bool = False) -> DraftBatch:
    """Random live lengths (ending mid-block, spanning several blocks), disjoint scattered blocks
    per sequence, random KV contents (never zeros), random tokens, hiddens and positions.
    Blocks below `reserved_blocks` are never handed to a sequence (a runner's scratch)."""
    g = torch.Generator().manual_seed(seed)
    room = kv.max_rows - num_drafts
    lives = [int(x) for x in torch.randint(0, max(room, 1), (width,), generator=g)]
    need = [math.ceil((live + num_drafts) / kv.block_size) for live in lives]
    free = (torch.randperm(kv.num_blocks - reserved_blocks, generator=g) + reserved_blocks).tolist()
    if sum(need) > len(free):
        raise ValueError(f"pool of {kv.num_blocks} blocks cannot hold {width} random sequences")
    tables = torch.full((width, kv.max_blocks_per_seq), -1, dtype=torch.int32)  # tails: garbage
    for i, count in enumerate(need):
        tables[i, :count] = torch.tensor([free.pop() for _ in range(count)], dtype=torch.int32)
    shape = (kv.num_blocks, kv.block_size, config.num_key_value_heads, config.head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    inputs = {
        "tokens": torch.randint(0, config.vocab_size, (width,), generator=g, dtype=torch.int32),
        "hidden": torch.randn(width, config.hidden_size, generator=g).to(dtype),
        "positions": torch.tensor(lives, dtype=torch.int32) + torch.randint(
            0, 50, (width,), generator=g, dtype=torch.int32),
        "block_tables": tables,
        "live_rows": torch.tensor(lives, dtype=torch.int32),
        "active": torch.ones(width, dtype=torch.int32),
    }
    if bitmask:
        words = (config.vocab_size + 31) // 32
        inputs["bitmask"] = torch.randint(-2**31, 2**31 - 1, (width, words), generator=g,
                                          dtype=torch.int64).to(torch.int32)
    inputs = {k: v.to(device) for k, v in inputs.items()}
    return DraftBatch(inputs, k_cache.to(device), v_cache.to(device), lives)


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (floats) or a huge value (ints), so an element nothing writes shows."""
    if t.dtype == torch.uint8:
        return t.fill_(0xFF)  # every float view of 0xFF bytes is a NaN
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(torch.iinfo(t.dtype).max)


def assert_outputs_equal(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor],
                         *, exact: bool = True, atol: float = 1e-5) -> None:
    for name, w in want.items():
        g = got[name]
        if exact or not w.is_floating_point():
            assert torch.equal(g.cpu(), w.cpu()), f"output {name!r} differs:\n{g}\nvs\n{w}"
        else:
            torch.testing.assert_close(g.cpu(), w.cpu(), atol=atol, rtol=atol,
                                       msg=lambda m: f"output {name!r}: {m}")


Tensors = Mapping[str, torch.Tensor]
# (compiled, states, width, inputs) -> outputs: how a test runs the compiled draft
RunProgram = Callable[[CompiledDraft, dict[str, torch.Tensor], int, Tensors], Mapping[str, torch.Tensor]]


def _run_program_runner(compiled: CompiledDraft, states: dict[str, torch.Tensor], width: int,
                        inputs: Tensors) -> Mapping[str, torch.Tensor]:
    return ProgramRunner(compiled, states).run(inputs)


def run_draft_runner(compiled: CompiledDraft, states: dict[str, torch.Tensor], width: int,
                     inputs: Tensors) -> Mapping[str, torch.Tensor]:
    """A `run_program` for assert_program_matches_eager: the host-facing CircuitDraftRunner
    (scratch block 0) at exactly `width` rows, never split, so its width plan is checked too."""
    return CircuitDraftRunner(compiled, states, scratch_block=0,
                              policy=WidthPolicy(allow_split=False)).run(width, inputs)


@dataclass
class SideBySide:
    """One call run by the eager oracle and by a compiled draft, each over its own copy of the
    same states (written in place: the KV pools after the call)."""

    want: dict[str, torch.Tensor]  # the eager oracle's outputs (and its `keep` values)
    got: Mapping[str, torch.Tensor]  # the compiled draft's outputs
    want_states: dict[str, torch.Tensor]
    got_states: dict[str, torch.Tensor]


def run_side_by_side(chain: Circuit, params: Tensors, compiled: CompiledDraft, inputs: Tensors,
                     states: Tensors, *, keep: tuple[str, ...] = (), width: int | None = None,
                     run_program: RunProgram | None = None) -> SideBySide:
    """Run `inputs` through EagerRunner(chain) and through `run_program` (default: a ProgramRunner
    over `compiled`), each over a clone of `states`; `keep` names eager intermediates to return
    with its outputs, `width` the call's rows for run_program (default: the first input's). The
    caller compares what it needs (bitwise: assert_program_matches_eager; kernels: closely)."""
    want_states = {k: v.clone() for k, v in states.items()}
    got_states = {k: v.clone() for k, v in states.items()}
    want = EagerRunner(chain, params, want_states).run(inputs, keep=keep)
    rows = width if width is not None else int(next(iter(inputs.values())).shape[0])
    got = (run_program or _run_program_runner)(compiled, got_states, rows, inputs)
    return SideBySide(want, got, want_states, got_states)


def assert_program_matches_eager(chain: Circuit, params: Tensors, widths: Sequence[int],
                                 batch_for: Callable[[int], DraftBatch | tuple[Tensors, Tensors]], *,
                                 compiled: CompiledDraft | None = None,
                                 run_program: RunProgram | None = None) -> CompiledDraft:
    """The compiled draft equals the eager oracle to the bit at every width in `widths`.

    For each width, `batch_for(width)` gives the call (a DraftBatch, or (inputs, states)); the
    eager runner runs `chain` over one copy of the states and `run_program` (default: a
    ProgramRunner over `compiled`) over another (run_side_by_side), and every eager output and
    every state (the KV pools, written in place) must be torch.equal between the two; a failure
    names (width, name). `compiled` defaults to compile_draft(chain, params, widths) on CPU.
    Returns the compiled draft (so a caller can check its launches)."""
    if compiled is None:
        compiled = compile_draft(chain, params, list(widths))
    for width in widths:
        batch = batch_for(width)
        inputs, states = (batch.inputs, batch.states()) if isinstance(batch, DraftBatch) else batch
        r = run_side_by_side(chain, params, compiled, inputs, states, width=width, run_program=run_program)
        for name in r.want:
            assert torch.equal(r.got[name], r.want[name]), (width, name)
        for name in r.want_states:
            assert torch.equal(r.got_states[name], r.want_states[name]), (width, name)
    return compiled


# ---- the GPU test mark and graph-capture helpers (used by the project's GPU tests) ----
NEEDS_CUDA = "needs a CUDA GPU"
_T = TypeVar("_T", bound=Callable[..., Any])  # a test function or class


class CudaMark:
    """`@cuda`: one decorator that marks a test (function or class) `cuda`, so `-m cuda` selects
    it, and skips it where there is no GPU. `pytestmark = cuda.marks` does both for a module."""

    def __init__(self) -> None:
        import pytest  # a test extra: imported only where a test suite uses the mark

        self.marks = [pytest.mark.cuda,
                      pytest.mark.skipif(not cuda_available(), reason=NEEDS_CUDA)]

    def __call__(self, test: _T) -> _T:
        for mark in self.marks:
            test = mark(test)
        return test


def skip_cuda_without_gpu(items: Sequence[Any]) -> None:
    """The body of a `pytest_collection_modifyitems` hook: every collected test marked `cuda`
    (also spelled `@pytest.mark.cuda`) is skipped when no GPU is present."""
    if cuda_available():
        return
    import pytest

    skip = pytest.mark.skip(reason=NEEDS_CUDA)
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


try:
    cuda = CudaMark()
except ImportError:  # pytest is a test extra; the helpers below do not need it
    cuda = None  # type: ignore[assignment]


def compare_drafts(got: Mapping[str, torch.Tensor], want: Mapping[str, torch.Tensor],
                   want_logits_gap: torch.Tensor | None = None, *, conf_atol: float = 2e-2,
                   tie_gap: float = 1e-3, strict: bool = True) -> tuple[int, int]:
    """Drafts equal step by step; once a row's reference top-2 log-probability gap at a step is
    below `tie_gap` (a near tie any rounding may flip), that row's later drafts are not
    compared; nor are they after a mismatch when not `strict` (a flipped draft changes every
    later one). Returns (compared, mismatched); `strict` raises on the first mismatch."""
    g, w = got["drafts"].cpu(), want["drafts"].cpu()
    compared = mismatched = 0
    for i in range(w.shape[0]):
        for j in range(w.shape[1]):
            if want_logits_gap is not None and float(want_logits_gap[i, j]) < tie_gap:
                break
            compared += 1
            if int(g[i, j]) != int(w[i, j]):
                assert not strict, f"row {i} step {j}: {g[i].tolist()} vs {w[i].tolist()}"
                mismatched += 1
                break
            delta = abs(float(got["confidences"][i, j]) - float(want["confidences"][i, j]))
            assert delta <= conf_atol, f"row {i} step {j}: confidence off by {delta}"
    return compared, mismatched


def assert_no_allocation(fn: Callable[..., object], *args: object, repeats: int = 3) -> None:
    """`fn(*args)` allocates no device memory (the caching allocator's counters stay put)."""
    torch.cuda.synchronize()
    fn(*args)  # any lazy first-call work happens here
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    for _ in range(repeats):
        fn(*args)
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    for key in ("allocation.all.allocated", "segment.all.allocated"):
        assert after.get(key, 0) == before.get(key, 0), f"{key}: {before.get(key)} -> {after.get(key)}"


def poison_runner(runner: Any) -> None:
    """NaN/huge-fill a program or graph runner's arena and static outputs before a run, so any
    element the run does not write shows."""
    program = getattr(runner, "program", runner)
    poison_(program.arena)
    for buf in program.static_outputs.values():
        poison_(buf)
