"""Benchmark: one k-step MTP draft chain, the circuit against the ways engines run it today.

In one process, on the same random weights, KV pool and inputs, for each config and width:

  eager              plain PyTorch (benchmarks/torch_mtp.py), op by op, k steps from Python
  torch_compile      torch.compile(mode="reduce-overhead") of ONE step, called k times
  graph_per_step     one CUDA graph of one step per width, replayed k times from Python with the
                     step's outputs copied into the next replay's static inputs (vLLM V1)
  graph_whole_chain  one CUDA graph of the whole k-step chain of the unfused ops (SGLang)
  circuit            this project: emit_draft_chain -> compile_draft -> CircuitDraftRunner
                     (one CUDA graph per width); the replay `runner.backend.execute(n)` is timed
  circuit_fast       the same with CompileOptions(width_independent=False) (cuBLAS linears)

Each chain is timed alone with CUDA events, from an idle device (synchronised before it, so
host launch overhead counts) to its last kernel; its inputs are copied into the strategy's
buffers before that, outside the timed region. Input sets (each with its own disjoint blocks of
the KV pool) rotate; the median of `--iters` chains after `--warmup` is reported, against the
floor: the bytes the chain must move (k x every MTP weight but the embedding table, k x the live
KV rows each step reads, plus small activations; a MoE config counts, instead of every expert,
k x the expected distinct experts its rows select) over the device-to-device copy bandwidth
measured in the same run. `--configs moe` (not in the default) runs a MoE MTP layer
(MoeMtpHead; the torch peer's MoE MLP is torch_mtp.moe_mlp). `--configs 8b_vocab32k` runs the 8B
chain over a 32,768-id draft vocabulary (every strategy; its circuit time is also given over the
`8b` chain's floor, issue 18's target), `eagle3_8b` the EAGLE-3 drafter at its published 8B
shapes (circuit strategies only, checked against the project's eager oracle; draft_heads.py),
`deepseek_v3` DeepSeek-V3's MTP layer (MLA, YaRN, 256 fp8 experts, fp8 projections; its torch
peer is torch_mtp_mla.py, fp8 dequantised to bf16 at setup; every strategy's drafts are checked
against the project's eager oracle; its floor counts latent rows; deepseek_head.py).
Results go to `--out` (JSON) and `--results-md` (markdown), rewritten
after every config so a run cut short still leaves its numbers. torch_compile runs last, after
every config's other strategies (its compiles are the slowest and least certain part); a
(width, strategy) not started by `--deadline-s` is recorded as skipped.

One file, in sections (floor, device helpers, shared setup, strategies, the run, output, command
line), because the benchmark is one script; the torch peer lives in torch_mtp.py.

    PYTHONPATH=$PWD python3 benchmarks/draft_chain.py --out $OUT --results-md $OUT/RESULTS.md
    PYTHONPATH=$PWD python3 benchmarks/draft_chain.py --dry-run --out /tmp/x   # CPU, tiny, fast
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks import deepseek_head as dsh  # noqa: E402
from benchmarks import draft_heads as dh  # noqa: E402
from benchmarks import torch_mtp as tm  # noqa: E402
from benchmarks import torch_mtp_mla as tmla  # noqa: E402
from draft_circuit.circuit.layers.config import MTP_PARAM_SHAPES, MtpConfig  # noqa: E402
from draft_circuit.circuit.layers.mla import MlaConfig  # noqa: E402
from draft_circuit.circuit.layers.moe import BIAS, MoeConfig, moe_checkpoint_shapes  # noqa: E402
from draft_circuit.ops.moe import expected_distinct_experts  # noqa: E402

STRATEGIES = ("eager", "torch_compile", "graph_per_step", "graph_whole_chain", "circuit",
              "circuit_fast")
PEER_STRATEGIES = ("eager", "torch_compile", "graph_per_step", "graph_whole_chain")  # torch_mtp's
NO_PEER = ("skipped: no plain-torch peer for EAGLE-3 (circuit strategies only; drafts_agree_eager "
           "compares them with the project's eager oracle)")
PHASE_B = ("torch_compile",)  # run after every config's other strategies (slowest to set up)
INPUT_NAMES = ("tokens", "hidden", "positions", "block_tables", "live_rows")

CONFIGS: dict[str, MtpConfig] = {
    "small": MtpConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                       num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                       rms_norm_eps=1e-6, rope_theta=10000.0, num_hidden_layers=1,
                       tie_word_embeddings=False, max_position_embeddings=8192),
    "8b": MtpConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                    num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                    rms_norm_eps=1e-5, rope_theta=500000.0, num_hidden_layers=1,
                    tie_word_embeddings=False, max_position_embeddings=131072),
    # a DeepSeek-V3-style MoE MTP layer at a small hidden size: 64 routed experts (8 groups, 4
    # kept), top-6, 2 shared, sigmoid + e_score_correction_bias (intermediate_size is unused)
    "moe": MoeConfig(vocab_size=32000, hidden_size=2048, intermediate_size=1408,
                     num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                     rms_norm_eps=1e-6, rope_theta=10000.0, num_hidden_layers=1,
                     tie_word_embeddings=False, max_position_embeddings=8192,
                     n_routed_experts=64, num_experts_per_tok=6, n_shared_experts=2,
                     moe_intermediate_size=1408, n_group=8, topk_group=4,
                     routed_scaling_factor=2.5, scoring_func="sigmoid"),
}
# issue 18: the 8B chain over FR-Spec's 32,768 most frequent ids (dh.DRAFT_VOCABS) against "8b",
# and the EAGLE-3 drafter at its published 8B shapes
CONFIGS["8b_vocab32k"] = CONFIGS["8b"]
CONFIGS["eagle3_8b"] = dh.EAGLE3_8B
CONFIGS["deepseek_v3"] = dsh.DEEPSEEK_V3  # issue 16: MLA + YaRN + fp8 MoE at DeepSeek-V3's shapes
DEFAULT_CONFIGS = "small,8b"  # moe only when asked: its setup would delay the others' phase B
DRY_CONFIG = MtpConfig(vocab_size=384, hidden_size=64, intermediate_size=128,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       rms_norm_eps=1e-6, rope_theta=10000.0, num_hidden_layers=1,
                       tie_word_embeddings=False, max_position_embeddings=512)
DRY_MOE_CONFIG = MoeConfig(vocab_size=384, hidden_size=64, intermediate_size=128,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                           rms_norm_eps=1e-6, rope_theta=10000.0, num_hidden_layers=1,
                           tie_word_embeddings=False, max_position_embeddings=512,
                           n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
                           moe_intermediate_size=32, n_group=4, topk_group=2,
                           routed_scaling_factor=2.5, scoring_func="sigmoid")

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f}s] {msg}", flush=True)


# ---------------------------------------------------------------------------------------------
# the floor
# ---------------------------------------------------------------------------------------------
def weight_bytes(config: MtpConfig, dtype_bytes: int) -> int:
    """Every MTP weight a step reads in full: all but the embedding table (its gathered rows are
    counted with the activations). gate and up count once each (the bound gate_up matrix).
    A MoeConfig: every weight but the routed experts' (the router gate, its fp32
    e_score_correction_bias and the shared experts included); see expert_bytes."""
    if not isinstance(config, MoeConfig):
        return sum(math.prod(s) for name, s in MTP_PARAM_SHAPES(config).items()
                   if name != "embed_tokens.weight") * dtype_bytes
    total = 0
    for name, s in moe_checkpoint_shapes(config).items():
        if name == "embed_tokens.weight" or name.startswith("mlp.experts."):
            continue
        total += math.prod(s) * (4 if name == BIAS else dtype_bytes)
    return total


def expert_bytes(config: MoeConfig, dtype_bytes: int) -> int:
    """One routed expert: gate_up [2I, H] + down [H, I]."""
    return 3 * config.moe_intermediate_size * config.hidden_size * dtype_bytes


def floor_bytes(config: MtpConfig, width: int, num_drafts: int, kv_rows: float,
                dtype_bytes: int = 2, max_blocks: int = 64,
                draft_vocab: int | None = None) -> dict[str, float]:
    """The fewest bytes a k-step chain over `width` rows moves, by part.
    `draft_vocab` S: the lm-head reads S rows; an Eagle3Config: its own weights (fc once, the
    lm-head over its draft vocabulary, or S of it) and a 3-hidden-wide input (draft_heads.py).

    weights: k x weight_bytes. kv_read: step j reads kv_rows + j + 1 rows (K and V) of every
    sequence. kv_write: one K and V row a sequence a step. activations: inputs read once
    (tokens, positions, live rows int32, hidden, the block-table row), outputs written once
    (drafts and confidences 4 bytes each a step, hidden_out) and one embedding row a step.
    A MoeConfig adds experts: k x expected_distinct_experts(E, top_k, width) x expert_bytes (each
    step reads every expert its rows select once; uniform routing, the high end).
    """
    if dsh.is_mla(config):  # latent rows, fp8 projections and experts (deepseek_head.py)
        return dsh.floor_bytes(config, width, num_drafts, kv_rows, dtype_bytes, max_blocks)
    h, eb, k = config.hidden_size, dtype_bytes, num_drafts
    kv_row = 2 * config.num_key_value_heads * config.head_dim * eb
    rows_read = sum(kv_rows + j + 1 for j in range(k))
    if dh.is_eagle3(config) or draft_vocab:  # a smaller lm-head; EAGLE-3 reads fc once
        step, once = dh.head_bytes(config, eb, draft_vocab)
        weights = k * step + once
    else:
        weights = k * weight_bytes(config, eb)
    parts = {
        "weights": float(weights),
        "kv_read": float(width * rows_read * kv_row),
        "kv_write": float(width * k * kv_row),
        "activations": float(width * (3 * 4 + dh.hidden_in(config) * eb + max_blocks * 4  # inputs
                                      + 2 * 4 * k + h * eb                  # outputs
                                      + k * h * eb)),                       # embedding rows
    }
    if isinstance(config, MoeConfig):
        parts["experts"] = float(k * expected_distinct_experts(
            config.n_routed_experts, config.num_experts_per_tok, width)
            * expert_bytes(config, eb))
    parts["total"] = sum(parts.values())
    return parts


def floor_us(nbytes: float, bandwidth_gbps: float) -> float:
    return nbytes / (bandwidth_gbps * 1e3)


# ---------------------------------------------------------------------------------------------
# device helpers: timing, capture (real on CUDA, an uncaptured stand-in on CPU for --dry-run)
# ---------------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def measure(device: torch.device, prepare: Callable[[int], None], run: Callable[[], None],
            num_sets: int, iters: int, warmup: int) -> list[float]:
    """Microseconds of each of `iters` chains, each from an idle device; set i % num_sets."""
    for i in range(warmup):
        prepare(i % num_sets)
        run()
    sync(device)
    if device.type != "cuda":
        out = []
        for i in range(iters):
            prepare(i % num_sets)
            t = time.perf_counter()
            run()
            out.append((time.perf_counter() - t) * 1e6)
        return out
    events = []
    for i in range(iters):
        prepare(i % num_sets)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return [s.elapsed_time(e) * 1e3 for s, e in events]


def copy_bandwidth(device: torch.device, nbytes: int, reps: int = 10) -> tuple[float, list[float]]:
    """Device-to-device copy: (bytes read + written) / median time, in GB/s; and the samples."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = measure(device, lambda i: None, lambda: dst.copy_(src), 1, reps, 3)
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    gbps = [2 * nbytes / (t * 1e3) for t in times]
    return statistics.median(gbps), gbps


class Capturer:
    """Graphs of one strategy in one pool. On CPU (dry run) a 'graph' re-runs the function and
    copies its results into the tensors the capture returned: the same static-buffer data flow,
    uncaptured."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.graphs: list[Any] = []
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None

    def capture(self, fn: Callable[[], tuple[torch.Tensor, ...]], warmup: int = 2):
        if self.device.type != "cuda":
            outs = fn()

            def replay() -> None:
                for dst, src in zip(outs, fn()):
                    dst.copy_(src)
            return replay, outs
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            outs = fn()
        torch.cuda.synchronize()
        self.graphs.append(graph)
        return graph.replay, outs


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# the shared setup of one config: weights, KV pool, rotated input sets
# ---------------------------------------------------------------------------------------------
@dataclass
class Settings:
    device: torch.device
    dtype: torch.dtype
    num_drafts: int
    widths: list[int]
    max_width: int
    block_size: int
    max_blocks: int
    num_sets: int
    live_min: int
    live_max: int
    iters: int
    warmup: int
    seed: int
    circuit_widths: str
    compile_dynamic: bool | None
    compile_backend: str | None  # None: inductor with mode="reduce-overhead"
    tuning: str = "off"  # CompileOptions.tuning for the circuit strategies
    tuning_cache: str | None = None

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).replace("torch.", "")


def random_weights(config: MtpConfig, s: Settings) -> dict[str, torch.Tensor]:
    """Canonical-name weights, made on the device: norms 1 + 0.1 N(0,1), embeddings N(0,1),
    projections N(0,1)/sqrt(fan_in) (so activations stay O(1), as runners.testing does). A
    MoeConfig: its checkpoint names (per-expert matrices), the routing bias 0.1 N(0,1) in fp32
    (as circuit.layers.moe.random_moe_weights)."""
    g = torch.Generator(device=s.device).manual_seed(s.seed)
    out = {}
    moe = isinstance(config, MoeConfig)
    for name, shape in (moe_checkpoint_shapes(config) if moe else MTP_PARAM_SHAPES(config)).items():
        if moe and name == BIAS:
            out[name] = 0.1 * torch.randn(shape, generator=g, device=s.device, dtype=torch.float32)
            continue
        t = torch.randn(shape, generator=g, device=s.device, dtype=s.dtype)
        if len(shape) == 1:
            t.mul_(0.1).add_(1.0)
        elif "embed" not in name:
            t.mul_(1.0 / math.sqrt(shape[-1]))
        out[name] = t
    return out


class Bench:
    """Weights (bound once: one dict for every strategy), one KV pool and `num_sets` input sets
    at the max width; width n uses each set's leading n rows. Every (set, row) owns
    `max_blocks` scattered blocks of the pool; block 0 is the circuit's scratch block."""

    def __init__(self, name: str, config: MtpConfig, s: Settings) -> None:
        from draft_circuit.circuit.layers.moe import MoeMtpHead
        from draft_circuit.circuit.layers.mtp import MtpHead
        from draft_circuit.circuit.layers.draft_vocab import bind_draft_vocab
        self.name, self.config, self.s = name, config, s
        self.head = (dsh.make_head(config, s.dtype_name) if dsh.is_mla(config)
                     else MoeMtpHead(config, s.dtype_name) if isinstance(config, MoeConfig)
                     else dh.make_head(config, s.dtype_name))
        self.draft_vocab = dh.DRAFT_VOCABS.get(name)
        # torch_mtp runs GQA MTP heads (over any vocabulary), torch_mtp_mla DeepSeek-V3's; not EAGLE-3
        self.no_peer = NO_PEER if dh.is_eagle3(config) else None
        self.peer, mla = self.no_peer is None, dsh.is_mla(config)
        weights = (dh.random_eagle3_weights(config, s.device, s.dtype, s.seed) if dh.is_eagle3(config)
                   else dsh.random_weights(config, s.device, s.dtype, s.seed) if mla
                   else random_weights(config, s))
        self.params = self.head.bind(weights)
        # the MLA peer reads the checkpoint tensors: fp8 dequantised once, the rest shared with params
        peer_weights = tmla.peer_weights(config, weights, s.dtype) if mla else None
        del weights  # gate and up live on only inside gate_up
        if self.draft_vocab:
            vocab = dh.subset_vocab(config.vocab_size, self.draft_vocab, s.seed)
            self.params = bind_draft_vocab(self.params, self.head, vocab)
        dev, c = s.device, config
        g = torch.Generator(device="cpu").manual_seed(s.seed + 1)
        self.num_blocks = 1 + s.num_sets * s.max_width * s.max_blocks
        k_shape, v_shape = self.head.cache_shapes(self.kv())  # MLA: roped keys and latents
        gd = torch.Generator(device=dev).manual_seed(s.seed + 2)
        self.k_cache = torch.randn(k_shape, generator=gd, device=dev, dtype=s.dtype)
        self.v_cache = torch.randn(v_shape, generator=gd, device=dev, dtype=s.dtype)
        perm = (torch.randperm(self.num_blocks - 1, generator=g) + 1).to(torch.int32)
        tables = perm.view(s.num_sets, s.max_width, s.max_blocks)
        self.sets: list[dict[str, torch.Tensor]] = []
        for i in range(s.num_sets):
            lives = torch.randint(s.live_min, s.live_max + 1, (s.max_width,), generator=g,
                                  dtype=torch.int32)
            inputs = {
                "tokens": torch.randint(0, c.vocab_size, (s.max_width,), generator=g,
                                        dtype=torch.int32),
                "hidden": torch.randn(s.max_width, dh.hidden_in(c), generator=g).to(s.dtype),
                "positions": lives + torch.randint(0, 50, (s.max_width,), generator=g,
                                                   dtype=torch.int32),
                "block_tables": tables[i].clone(),
                "live_rows": lives,
                "active": torch.ones(s.max_width, dtype=torch.int32),
            }
            self.sets.append({k: v.to(dev).contiguous() for k, v in inputs.items()})
        self.mean_live = float(torch.stack([x["live_rows"] for x in self.sets]).float().mean())
        max_live = int(torch.stack([x["live_rows"] for x in self.sets]).max())
        self.shape = tm.StepShape(c, s.block_size,
                                  tm.attn_blocks_for(max_live, s.num_drafts, s.block_size,
                                                     s.max_blocks))
        self.freqs = tm.inv_freq(c.head_dim, c.rope_theta, dev)
        # what the peer strategies run: torch_mtp over the circuit's params and pools, or for MLA
        # torch_mtp_mla over its weights and one latent pool made from the circuit's two
        self.peer_params, self.peer_caches = self.params, (self.k_cache, self.v_cache)
        self.peer_step_advance, self.peer_chain = tm.mtp_step_advance, tm.mtp_chain
        if isinstance(c, MlaConfig) and peer_weights is not None:
            self.peer_params, self.peer_caches = peer_weights, (tmla.latent_pool(self.k_cache, self.v_cache),)
            self.peer_step_advance, self.peer_chain = tmla.mla_step_advance, tmla.mla_chain
            self.freqs = tmla.rope_inv_freq(c.rope, c.qk_rope_head_dim, dev)
        self.dtype_bytes = torch.empty((), dtype=s.dtype).element_size()

    def mean_live_at(self, n: int) -> float:
        """The mean live rows of the sequences width n uses (each set's leading n rows)."""
        return float(torch.stack([x["live_rows"][:n] for x in self.sets]).float().mean())

    def inputs(self, i: int, n: int, names=INPUT_NAMES) -> dict[str, torch.Tensor]:
        return {k: self.sets[i][k][:n] for k in names}

    def eager_chain(self, inp: dict[str, torch.Tensor]):
        if not self.peer:  # the project's oracle: the reference every draft is checked against
            return self.oracle_chain(inp)
        return self.peer_chain(self.peer_params, self.shape, self.freqs, self.s.num_drafts,
                               inp["tokens"], inp["hidden"], inp["positions"], inp["block_tables"],
                               inp["live_rows"], *self.peer_caches)

    def oracle_chain(self, inp: dict[str, torch.Tensor]):
        return (self.oracle().run({**inp, "active": torch.ones_like(inp["tokens"])})["drafts"],)

    def reference_chain(self, inp: dict[str, torch.Tensor]):
        """What drafts_agree_eager compares with: the torch peer, or for EAGLE-3 and MLA (whose
        peer is checked against it in tests) the project's eager oracle, as before the MLA peer."""
        return self.oracle_chain(inp) if dsh.is_mla(self.config) else self.eager_chain(inp)

    def oracle(self):
        from draft_circuit.circuit.layers.mtp import emit_draft_chain
        from draft_circuit.runners.eager import EagerRunner
        if not hasattr(self, "_oracle"):
            chain = emit_draft_chain(self.head, self.s.num_drafts, max_width=self.s.max_width, kv=self.kv(),
                                     draft_vocab=self.draft_vocab)
            self._oracle = EagerRunner(chain, self.params, {"k_cache": self.k_cache, "v_cache": self.v_cache})
        return self._oracle

    def kv(self):
        from draft_circuit.circuit.layers.mtp import KvLayout
        return KvLayout(num_blocks=self.num_blocks, block_size=self.s.block_size,
                        max_blocks_per_seq=self.s.max_blocks)


# ---------------------------------------------------------------------------------------------
# strategies: each gives prepare(set), run() (the timed chain) and drafts() (after a run)
# ---------------------------------------------------------------------------------------------
@dataclass
class Case:
    prepare: Callable[[int], None]
    run: Callable[[], None]
    drafts: Callable[[], torch.Tensor]
    info: dict[str, Any] = field(default_factory=dict)


def static_copy(b: Bench, n: int) -> tuple[dict[str, torch.Tensor], Callable[[int], None]]:
    static = {k: v.clone() for k, v in b.inputs(0, n).items()}

    def prepare(i: int) -> None:
        for k, src in b.inputs(i, n).items():
            static[k].copy_(src)
    return static, prepare


def case_eager(b: Bench, n: int) -> Case:
    cur: dict[str, Any] = {}

    def prepare(i: int) -> None:
        cur["in"] = b.inputs(i, n)

    def run() -> None:
        cur["out"] = b.eager_chain(cur["in"])
    return Case(prepare, run, lambda: cur["out"][0])


def case_graph_per_step(b: Bench, n: int, cap: Capturer) -> Case:
    static, prepare = static_copy(b, n)
    k = b.s.num_drafts

    def step():
        return b.peer_step_advance(b.peer_params, b.shape, b.freqs, static["tokens"], static["hidden"],
                                   static["positions"], static["block_tables"],
                                   static["live_rows"], *b.peer_caches)
    replay, (tok, lp, hid, pos, rows) = cap.capture(step)
    drafts = torch.empty(n, k, dtype=torch.int32, device=b.s.device)
    confs = torch.empty(n, k, dtype=torch.float32, device=b.s.device)

    def run() -> None:
        for j in range(k):
            replay()
            drafts[:, j].copy_(tok)
            confs[:, j].copy_(lp)
            if j + 1 < k:  # the next step's static inputs (vLLM V1: between replays)
                static["tokens"].copy_(tok)
                static["hidden"].copy_(hid)
                static["positions"].copy_(pos)
                static["live_rows"].copy_(rows)
    return Case(prepare, run, lambda: drafts)


def case_graph_whole_chain(b: Bench, n: int, cap: Capturer) -> Case:
    static, prepare = static_copy(b, n)
    replay, outs = cap.capture(lambda: b.eager_chain(static))
    return Case(prepare, replay, lambda: outs[0])


class CircuitBuild:
    """A compiled draft (all widths it was asked for) and its CircuitDraftRunner, built once."""

    def __init__(self, b: Bench, widths: list[int], fast: bool, bandwidth_gbps: float) -> None:
        from draft_circuit.circuit.planner import CompileOptions, compile_draft
        from draft_circuit.circuit.layers.mtp import emit_draft_chain
        from draft_circuit.runners.draft import CircuitDraftRunner
        s = b.s
        chain = emit_draft_chain(b.head, s.num_drafts, max_width=s.max_width, kv=b.kv(),
                                 draft_vocab=b.draft_vocab)
        options = CompileOptions(kv_rows=round(b.mean_live), bandwidth_gbps=bandwidth_gbps,
                                 width_independent=not fast, tuning=s.tuning,
                                 tuning_cache=s.tuning_cache)
        t = time.perf_counter()
        self.compiled = compile_draft(chain, b.params, widths=widths, device=str(s.device),
                                      options=options)
        self.compile_s = time.perf_counter() - t
        t = time.perf_counter()
        self.runner = CircuitDraftRunner(self.compiled, {"k_cache": b.k_cache, "v_cache": b.v_cache},
                                         scratch_block=0)
        sync(s.device)
        self.capture_wall_s = time.perf_counter() - t
        self.backend = self.runner.backend

    def summary(self) -> dict[str, Any]:
        report = self.compiled.report()
        stats = getattr(self.backend, "stats", None)
        capture_ms = {int(w): float(v) for w, v in (stats.capture_ms if stats else {}).items()}
        pool = {int(w): int(v) for w, v in (stats.pool_bytes if stats else {}).items()}
        return {
            "widths_compiled": list(self.compiled.widths),
            "compile_s": self.compile_s,
            "capture_wall_s": self.capture_wall_s,
            "compile_plus_capture_s": self.compile_s + self.capture_wall_s,
            "capture_ms": capture_ms,
            "capture_ms_sum": sum(capture_ms.values()),
            "pool_bytes": pool,
            "pool_bytes_sum": sum(pool.values()),
            "arena_bytes": int(self.compiled.arena_bytes),
            "capture_failures": dict(stats.failures) if stats else {},
            "launches": {w.width: w.launches for w in report.widths},
            "launches_per_step": {w.width: w.launches_per_step for w in report.widths},
            # what the GPU runs: a split kernel and its merge count two (KernelBinding.launches)
            "gpu_launches_per_step": {w.width: w.gpu_launches_per_step for w in report.widths},
            "kernel_choices": {w.width: [c.model_dump() for c in w.kernel_choices]
                               for w in report.widths if w.kernel_choices},
            "plan_bytes_moved": {w.width: w.bytes_moved for w in report.widths},
            "plan_floor_us": {w.width: w.floor_us for w in report.widths},
            "kernels": sorted({x.kernel for x in report.widths[-1].schedule}),
        }

    def case(self, b: Bench, n: int) -> Case:
        if not self.backend.serves(n):
            fails = getattr(getattr(self.backend, "stats", None), "failures", {})
            raise RuntimeError(f"width {n} not served: {fails.get(n, 'not compiled')}")
        bufs = self.backend.input_buffers(n)
        names = tuple(bufs)

        def prepare(i: int) -> None:
            for k, src in b.inputs(i, n, names).items():
                bufs[k].copy_(src)
        report = self.compiled.report().width(n)
        return Case(prepare, lambda: self.backend.execute(n),
                    lambda: self.backend.output_buffers(n)["drafts"],
                    {"launches": report.launches, "launches_per_step": report.launches_per_step,
                     "gpu_launches_per_step": report.gpu_launches_per_step})


class CompiledStep:
    """torch.compile of one step (mode="reduce-overhead"); weights and KV pool are marked static
    addresses, so the compiled graph reads them in place (no copies into graph inputs)."""

    def __init__(self, b: Bench) -> None:
        import torch._dynamo as dynamo
        dynamo.reset()  # no state carried from another config
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(dynamo.config, knob):
                setattr(dynamo.config, knob, 64)
        for t in (*b.peer_params.values(), *b.peer_caches, b.freqs):
            dynamo.mark_static_address(t)
        shape, freqs, advance = b.shape, b.freqs, b.peer_step_advance

        def step(w, tokens, hidden, positions, tables, rows, *caches):
            return advance(w, shape, freqs, tokens, hidden, positions, tables, rows, *caches)
        if b.s.compile_backend:
            self.fn = torch.compile(step, backend=b.s.compile_backend, dynamic=b.s.compile_dynamic)
        else:
            self.fn = torch.compile(step, mode="reduce-overhead", dynamic=b.s.compile_dynamic)
        self.b = b

    def case(self, n: int) -> Case:
        b, k = self.b, self.b.s.num_drafts
        cur: dict[str, Any] = {}

        def prepare(i: int) -> None:
            cur["in"] = b.inputs(i, n)

        trees = not b.s.compile_backend  # reduce-overhead: inductor's CUDA-graph trees

        def run() -> None:
            if trees:
                torch.compiler.cudagraph_mark_step_begin()  # a new chain: earlier outputs die
            x = cur["in"]
            tok, hid, pos, rows = x["tokens"], x["hidden"], x["positions"], x["live_rows"]
            toks, lps = [], []
            for _ in range(k):
                tok, lp, hid, pos, rows = self.fn(b.peer_params, tok, hid, pos, x["block_tables"],
                                                  rows, *b.peer_caches)
                toks.append(tok)
                lps.append(lp)
            cur["drafts"] = torch.stack(toks, 1)
        return Case(prepare, run, lambda: cur["drafts"])


def cudagraph_counters() -> dict[str, int]:
    try:
        from torch._dynamo.utils import counters
        return {k: int(v) for k, v in counters["inductor"].items() if "cudagraph" in k}
    except Exception:  # noqa: BLE001 - informational only
        return {}


# ---------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------
def short_error(e: BaseException) -> str:
    text = f"{type(e).__name__}: {e}"
    return text if len(text) < 2000 else text[:2000] + " ..."


class Run:
    def __init__(self, args: argparse.Namespace, s: Settings, configs: dict[str, MtpConfig],
                 strategies: list[str]) -> None:
        self.args, self.s, self.configs, self.strategies = args, s, configs, strategies
        self.results: dict[str, Any] = {}
        self.deadline = T0 + args.deadline_s

    def past_deadline(self) -> bool:
        return time.perf_counter() > self.deadline

    def record(self, cfg: str, n: int, strategy: str, entry: dict[str, Any]) -> None:
        self.results[cfg]["widths"].setdefault(str(n), {})[strategy] = entry

    def time_case(self, b: Bench, n: int, strategy: str, make: Callable[[], Case],
                  ref: torch.Tensor) -> None:
        s = self.s
        if self.past_deadline():
            self.record(b.name, n, strategy, {"error": "skipped: past --deadline-s"})
            log(f"{b.name} n={n} {strategy}: skipped (deadline)")
            return
        try:
            t = time.perf_counter()
            case = make()
            setup_s = time.perf_counter() - t
            t = time.perf_counter()
            case.prepare(0)
            case.run()  # first call (a compiled step compiles here)
            sync(s.device)
            first_s = time.perf_counter() - t
            samples = measure(s.device, case.prepare, case.run, s.num_sets, s.iters, s.warmup)
            case.prepare(0)
            case.run()
            got = case.drafts().clone()
            sync(s.device)
        except Exception as e:  # noqa: BLE001 - one strategy's failure is a result, not a crash
            traceback.print_exc()
            self.record(b.name, n, strategy, {"error": short_error(e)})
            log(f"{b.name} n={n} {strategy}: FAILED {short_error(e)[:300]}")
            free_memory(s.device)
            return
        agree = (got.cpu() == ref.cpu())
        entry = {
            "median_us": statistics.median(samples),
            "min_us": min(samples),
            "p10_us": _quantile(samples, 0.1),
            "p90_us": _quantile(samples, 0.9),
            "samples_us": [round(x, 3) for x in samples],
            "setup_s": setup_s,
            "first_call_s": first_s,
            "drafts_agree_eager": float(agree.float().mean()),
            "first_draft_agree_eager": float(agree[:, 0].float().mean()),
            **case.info,
        }
        self.record(b.name, n, strategy, entry)
        log(f"{b.name} n={n} {strategy}: {entry['median_us']:.1f} us "
            f"(p10 {entry['p10_us']:.1f}, p90 {entry['p90_us']:.1f}; setup {setup_s:.2f}s, "
            f"first {first_s:.2f}s; agree {entry['drafts_agree_eager']:.2f})")
        del case
        free_memory(s.device)

    def config_entry(self, name: str, b: Bench) -> None:
        c, s = b.config, self.s
        floors = {}
        for n in s.widths:
            live = b.mean_live_at(n)
            parts = floor_bytes(c, n, s.num_drafts, live, b.dtype_bytes, s.max_blocks, b.draft_vocab)
            floors[str(n)] = {"bytes": parts, "mean_live_rows": live,
                              "floor_us": floor_us(parts["total"], self.bw)}
        self.results[name] = {
            "config": asdict(c), "dtype": s.dtype_name, "num_drafts": s.num_drafts,
            "head": type(b.head).__name__, "draft_vocab": b.draft_vocab,
            "full_vocab_config": dh.FULL_VOCAB_PEER.get(name),
            "weight_bytes_per_step": weight_bytes(c, b.dtype_bytes),
            **({"expert_bytes": expert_bytes(c, b.dtype_bytes),
                "expected_distinct_experts": {
                    str(n): expected_distinct_experts(c.n_routed_experts, c.num_experts_per_tok, n)
                    for n in s.widths},
                "torch_moe_mode": {str(n): "gather" if tm.moe_gathers(c, n) else "dense"
                                   for n in s.widths}}
               if isinstance(c, MoeConfig) else {}),
            "num_blocks": b.num_blocks, "block_size": s.block_size,
            "max_blocks_per_seq": s.max_blocks, "mean_live_rows": b.mean_live,
            "attn_rows_torch": b.shape.attn_rows, "floors": floors, "widths": {},
            "circuit": None, "circuit_fast": None, "torch_compile": None,
            "torch_peer": tmla.PEER_NOTE if dsh.is_mla(c) else None,
        }

    def refs(self, b: Bench) -> dict[int, torch.Tensor]:
        out = {}
        for n in self.s.widths:
            out[n] = b.reference_chain(b.inputs(0, n))[0].clone()
        sync(self.s.device)
        return out

    def phase_a(self, name: str) -> None:
        s = self.s
        todo = [x for x in self.strategies if x not in PHASE_B]
        log(f"{name}: setting up (weights, KV pool, {s.num_sets} input sets)")
        b = Bench(name, self.configs[name], s)
        self.config_entry(name, b)
        if not todo:
            return
        refs = self.refs(b)
        builds: dict[str, CircuitBuild] = {}
        for strategy, fast in (("circuit", False), ("circuit_fast", True)):
            if strategy not in todo:
                continue
            if self.past_deadline():
                self.results[name][strategy] = {"error": "skipped: past --deadline-s"}
                continue
            widths = (list(range(1, s.max_width + 1))
                      if s.circuit_widths == "all" and not fast else list(s.widths))
            log(f"{name}: {strategy}: compile + capture of {len(widths)} widths")
            try:
                builds[strategy] = CircuitBuild(b, widths, fast, self.bw)
                self.results[name][strategy] = builds[strategy].summary()
                sm = self.results[name][strategy]
                log(f"{name}: {strategy}: compile {sm['compile_s']:.1f}s, capture "
                    f"{sm['capture_wall_s']:.1f}s (sum of capture_ms {sm['capture_ms_sum']:.0f}), "
                    f"pool {sm['pool_bytes_sum'] / 2**20:.1f} MiB, arena "
                    f"{sm['arena_bytes'] / 2**20:.1f} MiB, failures {len(sm['capture_failures'])}")
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                self.results[name][strategy] = {"error": short_error(e)}
                log(f"{name}: {strategy}: FAILED {short_error(e)[:300]}")
                free_memory(s.device)
        for n in s.widths:
            for strategy in todo:
                if strategy in PEER_STRATEGIES and not b.peer:
                    self.record(name, n, strategy, {"error": b.no_peer})
                    continue
                if strategy == "eager":
                    make = lambda: case_eager(b, n)  # noqa: E731
                elif strategy in ("graph_per_step", "graph_whole_chain"):
                    fn = case_graph_per_step if strategy == "graph_per_step" else case_graph_whole_chain
                    make = lambda fn=fn: fn(b, n, Capturer(s.device))  # noqa: E731
                elif strategy in builds:
                    make = lambda bd=builds[strategy]: bd.case(b, n)  # noqa: E731
                else:
                    err = (self.results[name].get(strategy) or {}).get("error", "not built")
                    self.record(name, n, strategy, {"error": err})
                    continue
                self.time_case(b, n, strategy, make, refs[n])
        del builds, b
        free_memory(s.device)

    def phase_b(self, name: str) -> None:
        s = self.s
        if "torch_compile" not in self.strategies:
            return
        if self.past_deadline():
            self.results[name]["torch_compile"] = {"error": "skipped: past --deadline-s"}
            for n in s.widths:
                self.record(name, n, "torch_compile", {"error": "skipped: past --deadline-s"})
            return
        if dh.is_eagle3(self.configs[name]):
            self.results[name]["torch_compile"] = {"error": NO_PEER}
            for n in s.widths:
                self.record(name, n, "torch_compile", {"error": NO_PEER})
            return
        log(f"{name}: torch_compile: setting up again (same seeds: same weights and inputs)")
        b = Bench(name, self.configs[name], s)
        refs = self.refs(b)
        trees = not s.compile_backend
        before = cudagraph_counters() if trees else {}
        error = None
        try:
            step = CompiledStep(b)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            error = short_error(e)
        t = time.perf_counter()
        for n in s.widths:
            if error is not None:
                self.record(name, n, "torch_compile", {"error": error})
                continue
            self.time_case(b, n, "torch_compile", lambda: step.case(n), refs[n])
            got = self.results[name]["widths"][str(n)]["torch_compile"]
            if "error" in got and not got["error"].startswith("skipped"):
                error = got["error"]  # a failed compile fails every width the same way: stop
            self.finish(partial=True)  # a compile that never returns still leaves the rest
        after = cudagraph_counters() if trees else {}
        log(f"{name}: torch_compile: error {error!r}, cudagraph counters this config "
            f"{ {k: after.get(k, 0) - before.get(k, 0) for k in after} }")
        self.results[name]["torch_compile"] = {
            "error": error, "wall_s": time.perf_counter() - t,
            "mode": s.compile_backend or "reduce-overhead", "dynamic": s.compile_dynamic,
            "cudagraph_counters": {k: after.get(k, 0) - before.get(k, 0) for k in after},
        }
        del b
        free_memory(s.device)

    def execute(self) -> None:
        s = self.s
        nbytes = int(self.args.copy_gib * 2**30)
        self.bw, self.bw_samples = copy_bandwidth(s.device, nbytes)
        log(f"device-to-device copy bandwidth: {self.bw:.0f} GB/s "
            f"({nbytes / 2**30:.2f} GiB, median of {len(self.bw_samples)})")
        for phase in (self.phase_a, self.phase_b):
            for name in self.configs:
                try:
                    phase(name)
                except Exception as e:  # noqa: BLE001 - the other config still runs
                    traceback.print_exc()
                    log(f"{name}: {phase.__name__} FAILED {short_error(e)[:300]}")
                    if name in self.results:
                        self.results[name].setdefault("errors", []).append(
                            f"{phase.__name__}: {short_error(e)}")
                    free_memory(s.device)
                self.finish(partial=True)
        self.finish(partial=False)

    # ---- output ----
    def derived(self) -> None:
        """us over the floor and over the circuit, for every (config, width, strategy)."""
        for cfg in self.results.values():
            for n, row in cfg["widths"].items():
                fl = cfg["floors"][n]["floor_us"]
                circ = row.get("circuit", {}).get("median_us")
                full = self.results.get(cfg.get("full_vocab_config") or "", {}).get("floors", {}).get(n)
                for entry in row.values():
                    if "median_us" in entry:
                        entry["floor_us"] = fl
                        entry["x_floor"] = entry["median_us"] / fl
                        entry["x_circuit"] = entry["median_us"] / circ if circ else None
                        if full:  # issue 18's target: the subset chain over the full chain's floor
                            entry["x_full_vocab_floor"] = entry["median_us"] / full["floor_us"]

    def payload(self, partial: bool) -> dict[str, Any]:
        s, dev = self.s, self.s.device
        try:
            import triton
            triton_version = triton.__version__
        except Exception:  # noqa: BLE001
            triton_version = None
        return {
            "date": self.date, "partial": partial, "dry_run": self.args.dry_run,
            "device": device_name(dev), "torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": triton_version, "python": sys.version.split()[0],
            "copy_bandwidth_gbps": self.bw, "copy_bandwidth_samples_gbps": self.bw_samples,
            "copy_bytes": int(self.args.copy_gib * 2**30),
            "settings": {**{k: v for k, v in asdict(s).items() if k not in ("device", "dtype")},
                         "device": str(dev), "dtype": s.dtype_name},
            "timing": ("CUDA events around each chain, from an idle device (synchronised "
                       "before it); inputs copied in before, outside the events"
                       if dev.type == "cuda" else "host clock around each chain (CPU)")
                      + f"; median of {s.iters} chains after {s.warmup} warm-up, "
                        f"{s.num_sets} input sets rotated",
            "strategies": self.strategies,
            "elapsed_s": time.perf_counter() - T0,
            "configs": self.results,
        }

    def finish(self, partial: bool) -> None:
        self.derived()
        os.makedirs(self.args.out, exist_ok=True)
        path = os.path.join(self.args.out, f"{self.date}-{slug(device_name(self.s.device))}.json")
        data = self.payload(partial)
        with open(path, "w") as f:
            json.dump(data, f, indent=1, sort_keys=True, default=str)
        write_markdown(self.args.results_md, data, os.path.basename(path))
        if not partial:
            log(f"wrote {path} and {self.args.results_md}")
            print(final_table(data), flush=True)

    @property
    def date(self) -> str:
        if not hasattr(self, "_date"):
            self._date = _dt.datetime.now().strftime("%Y-%m-%d")
        return self._date


def _quantile(xs: list[float], q: float) -> float:
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(q * len(ys)))]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "device"


# ---------------------------------------------------------------------------------------------
# markdown and the final table
# ---------------------------------------------------------------------------------------------
def _cell(entry: dict[str, Any] | None) -> str:
    if not entry:
        return "-"
    if "median_us" not in entry:
        err = entry.get("error", "?")
        return "skipped" if err.startswith("skipped") else "failed"
    xc = entry.get("x_circuit")
    xc = f"{xc:.2f}x" if xc is not None else "-"
    return f"{entry['median_us']:.1f} ({entry['x_floor']:.2f}x, {xc})"


def _moe_text(c: dict[str, Any]) -> str:
    if "n_routed_experts" not in c:
        return ""
    return (f"; MoE {c['n_routed_experts']} experts (groups {c['n_group']}/{c['topk_group']}) "
            f"top-{c['num_experts_per_tok']} + {c['n_shared_experts']} shared, expert "
            f"intermediate {c['moe_intermediate_size']}, {c['scoring_func']}; floor counts the "
            f"expected distinct experts selected")


def _vocab_text(cfg: dict[str, Any]) -> str:
    c, size = cfg["config"], cfg.get("draft_vocab")
    if "draft_vocab_size" in c:
        return (f"; EAGLE-3: fc over 3 x {c['target_hidden_size']}, lm-head over "
                f"{size or c['draft_vocab_size']} draft ids")
    return f"; lm-head over a {size}-id draft vocabulary" if size else ""


def _full_vocab_line(cfg: dict[str, Any]) -> list[str]:
    """The subset chain's circuit time over the full-vocabulary chain's floor (issue 18's target)."""
    cells = [f"n={n} {row['circuit']['x_full_vocab_floor']:.2f}x"
             for n, row in sorted(cfg["widths"].items(), key=lambda kv: int(kv[0]))
             if "x_full_vocab_floor" in (row.get("circuit") or {})]
    return [f"- circuit over the `{cfg['full_vocab_config']}` chain's floor: {', '.join(cells)}"] if cells else []


def config_markdown(name: str, cfg: dict[str, Any], strategies: list[str]) -> str:
    c = cfg["config"]
    lines = [f"### {name}: hidden {c['hidden_size']}, intermediate {c['intermediate_size']}, "
             f"{c['num_attention_heads']}/{c['num_key_value_heads']} heads x {c['head_dim']}, "
             f"vocab {c['vocab_size']}{_moe_text(c)}{_vocab_text(cfg)} ({cfg['dtype']}, k = {cfg['num_drafts']}, "
             f"mean live {cfg['mean_live_rows']:.1f} rows)", "",
             "Median us per chain (x floor, x circuit).", ""]
    head = ["n", "floor us", "circuit GPU launches/step (nodes)", *strategies]
    lines.append("| " + " | ".join(head) + " |")
    lines.append("|" + "---|" * len(head))
    for n, row in sorted(cfg["widths"].items(), key=lambda kv: int(kv[0])):
        circuit = row.get("circuit") or {}
        lps = (f"{circuit['gpu_launches_per_step']:g} ({circuit['launches_per_step']:g})"
               if "gpu_launches_per_step" in circuit else circuit.get("launches_per_step", "-"))
        cells = [n, f"{cfg['floors'][n]['floor_us']:.1f}", str(lps),
                 *[_cell(row.get(st)) for st in strategies]]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += _full_vocab_line(cfg)
    if cfg.get("torch_peer"):
        lines.append(f"- {cfg['torch_peer']}")
    errors = sorted({f"{st}: {e['error']}" for row in cfg["widths"].values()
                     for st, e in row.items() if "error" in e})
    for e in [*errors, *cfg.get("errors", [])]:
        first = e.splitlines()[0] if e else e
        lines.append(f"- {first[:300]}")
    for key in ("circuit", "circuit_fast"):
        sm = cfg.get(key)
        if sm and "compile_s" in sm:
            lines.append(
                f"- {key}: compile {sm['compile_s']:.1f} s + capture {sm['capture_wall_s']:.1f} s "
                f"for {len(sm['widths_compiled'])} widths ({sm['widths_compiled'][0]}.."
                f"{sm['widths_compiled'][-1]}); sum of capture_ms {sm['capture_ms_sum']:.0f} ms; "
                f"graph pool reserved {sm['pool_bytes_sum'] / 2**20:.1f} MiB beyond the arena of "
                f"{sm['arena_bytes'] / 2**20:.1f} MiB; capture failures: "
                f"{len(sm['capture_failures'])}")
            for w, picks in sorted(sm.get("kernel_choices", {}).items(), key=lambda kv: int(kv[0]))[:1]:
                lines.append(f"- {key} kernel choices (measured, every width): " + "; ".join(
                    f"{c['node']}: {c['kernel']} ({', '.join(f'{k} {us:.1f} us' for k, us in sorted(c['us'].items()))})"
                    for c in picks))
        elif sm and sm.get("error"):
            line = f"- {key}: {sm['error'].splitlines()[0][:300]}"
            if line not in lines:
                lines.append(line)
    tc = cfg.get("torch_compile")
    if tc:
        counters = tc.get("cudagraph_counters") or {}
        skipped = (" - CUDA graphs were SKIPPED for some compiled graphs (inductor ran them "
                   "without graphs)" if counters.get("cudagraph_skips") else "")
        lines.append(f"- torch_compile ({tc.get('mode')}, dynamic={tc.get('dynamic')}): wall "
                     f"{tc.get('wall_s', 0):.1f} s incl. compiles; cudagraph counters "
                     f"{counters}{skipped}")
    lines.append("")
    return "\n".join(lines)


def run_markdown(data: dict[str, Any], json_name: str) -> str:
    lines = [f"## {data['date']}, {data['device']}" + (" (partial)" if data["partial"] else "")
             + (" (dry run)" if data["dry_run"] else ""), "",
             f"torch {data['torch']}, CUDA {data['cuda']}, Triton {data['triton']}; "
             f"device-to-device copy {data['copy_bandwidth_gbps']:.0f} GB/s (read + written, "
             f"{data['copy_bytes'] / 2**30:.2f} GiB copy, median); {data['timing']}. "
             f"Floor = bytes the chain must move / that bandwidth. Full numbers: `{json_name}`.",
             ""]
    for name, cfg in data["configs"].items():
        lines.append(config_markdown(name, cfg, data["strategies"]))
    return "\n".join(lines)


def write_markdown(path: str, data: dict[str, Any], json_name: str) -> None:
    """Write (or replace) this run's section; sections of other runs in the file stay."""
    key = json_name.rsplit(".", 1)[0]
    begin, end = f"<!-- run: {key} -->", f"<!-- end run: {key} -->"
    section = f"{begin}\n{run_markdown(data, json_name)}\n{end}\n"
    title = "# Draft-chain benchmark results\n\n" \
            "Written by `benchmarks/draft_chain.py`; newest run first.\n\n"
    old = open(path).read() if os.path.exists(path) else ""
    if begin in old and end in old:
        pre, rest = old.split(begin, 1)
        text = pre + section + rest.split(end, 1)[1].lstrip("\n")
    elif old.startswith("# "):
        head, _, body = old.partition("\n\n")
        marker = body.find("<!-- run:")
        text = (old[:len(head) + 2 + marker] + section + "\n" + body[marker:]) if marker >= 0 \
            else old.rstrip("\n") + "\n\n" + section
    else:
        text = title + section
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def final_table(data: dict[str, Any]) -> str:
    short = {"eager": "eager", "torch_compile": "compile", "graph_per_step": "g/step",
             "graph_whole_chain": "g/chain", "circuit": "circuit", "circuit_fast": "c_fast"}
    out = [f"{data['device']}: copy {data['copy_bandwidth_gbps']:.0f} GB/s; median us per "
           f"{data['configs'] and next(iter(data['configs'].values()))['num_drafts']}-step chain "
           f"(x circuit)"]
    for name, cfg in data["configs"].items():
        cols = data["strategies"]
        out.append(f"{name:>6} {'floor':>8} " + " ".join(f"{short.get(c, c):>16}" for c in cols))
        for n, row in sorted(cfg["widths"].items(), key=lambda kv: int(kv[0])):
            cells = []
            for c in cols:
                e = row.get(c) or {}
                if "median_us" in e:
                    xc = e.get("x_circuit")
                    cells.append(f"{e['median_us']:9.1f}" + (f" {xc:5.2f}x" if xc else "       "))
                else:
                    cells.append(f"{'skip' if str(e.get('error', '')).startswith('skipped') else 'FAIL':>16}")
            out.append(f"{'n=' + n:>6} {cfg['floors'][n]['floor_us']:8.1f} " + " ".join(f"{x:>16}" for x in cells))
        sm = cfg.get("circuit") or {}
        if "compile_s" in sm:
            out.append(f"       circuit: {len(sm['widths_compiled'])} widths, compile "
                       f"{sm['compile_s']:.1f}s + capture {sm['capture_wall_s']:.1f}s (capture_ms sum "
                       f"{sm['capture_ms_sum']:.0f}), pool {sm['pool_bytes_sum'] / 2**20:.1f} MiB, "
                       f"arena {sm['arena_bytes'] / 2**20:.1f} MiB")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------
def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default=DEFAULT_CONFIGS,
                   help=f"comma list of {', '.join(CONFIGS)} (--dry-run: a dense name runs the "
                        "tiny config, moe the tiny MoE one, 8b_vocab32k tiny and tiny_vocab, "
                        "eagle3_8b a tiny EAGLE-3)")
    p.add_argument("--widths", default="1,2,4,8,16,32,64")
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--num-drafts", type=int, default=4)
    p.add_argument("--max-width", type=int, default=64, help="the circuit's max_width")
    p.add_argument("--circuit-widths", choices=("all", "bench"), default="all",
                   help="compile and capture the circuit for every width 1..max (capture stats) "
                        "or only the benchmark widths")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-blocks", type=int, default=64, help="block-table width per sequence")
    p.add_argument("--live-min", type=int, default=90)
    p.add_argument("--live-max", type=int, default=110)
    p.add_argument("--sets", type=int, default=4, help="input sets rotated between chains")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--copy-gib", type=float, default=2.0)
    p.add_argument("--compile-dynamic", choices=("auto", "true", "false"), default="auto",
                   help="torch.compile dynamic= (auto: None, one recompile marks n dynamic)")
    p.add_argument("--compile-backend", default=None,
                   help="torch.compile backend instead of inductor reduce-overhead (tests)")
    p.add_argument("--deadline-s", type=float, default=360.0,
                   help="seconds from the start; a (width, strategy) not started by then is "
                        "recorded as skipped (torch_compile runs last, after every config)")
    p.add_argument("--out", default=None,
                   help="folder for the JSON (default benchmarks/results; a temp folder for "
                        "--dry-run)")
    p.add_argument("--results-md", default=None,
                   help="markdown to write or update (default benchmarks/RESULTS.md; inside "
                        "--out for --dry-run)")
    p.add_argument("--device", default=None, help="default: cuda (cpu for --dry-run)")
    p.add_argument("--tuning", choices=("off", "cached", "measure"), default="off",
                   help="the circuit's measured kernel choice (CompileOptions.tuning): measure "
                        "times competing kernels once on the GPU and caches them")
    p.add_argument("--tuning-cache", default=None,
                   help="tuning cache file (default ~/.cache/draft_circuit/tuning.json)")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, a tiny fp32 config, one width, few iterations: checks the script")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[Settings, dict[str, MtpConfig], list[str]]:
    strategies = [x.strip() for x in args.strategies.split(",") if x.strip()]
    bad = [x for x in strategies if x not in STRATEGIES]
    if bad:
        raise SystemExit(f"unknown strategies {bad}; known: {', '.join(STRATEGIES)}")
    dynamic = {"auto": None, "true": True, "false": False}[args.compile_dynamic]
    if args.out is None:  # a dry run never touches the recorded results
        args.out = (tempfile.mkdtemp(prefix="draft_chain_dry_") if args.dry_run
                    else os.path.join("benchmarks", "results"))
    if args.results_md is None:
        args.results_md = (os.path.join(args.out, "RESULTS.md") if args.dry_run
                           else os.path.join("benchmarks", "RESULTS.md"))
    names = [x.strip() for x in args.configs.split(",") if x.strip()]
    unknown = [x for x in names if x not in CONFIGS]
    if unknown:
        raise SystemExit(f"unknown configs {unknown}; known: {', '.join(CONFIGS)}")
    if args.dry_run:
        device = torch.device(args.device or "cpu")
        configs = {}
        for n in names:
            if dsh.is_mla(CONFIGS[n]):
                configs["tiny_deepseek"] = dsh.DRY_DEEPSEEK
            elif isinstance(CONFIGS[n], MoeConfig):
                configs["tiny_moe"] = DRY_MOE_CONFIG
            elif dh.is_eagle3(CONFIGS[n]):
                configs["tiny_eagle3"] = dh.DRY_EAGLE3
            elif n in dh.DRAFT_VOCABS:
                configs["tiny"] = DRY_CONFIG  # the full-vocabulary peer, first
                configs["tiny_vocab"] = DRY_CONFIG
            else:
                configs["tiny"] = DRY_CONFIG
        s = Settings(device=device, dtype=torch.float32, num_drafts=args.num_drafts,
                     widths=[3], max_width=4, block_size=16, max_blocks=8, num_sets=2,
                     live_min=20, live_max=30, iters=3, warmup=1, seed=args.seed,
                     circuit_widths=args.circuit_widths, compile_dynamic=dynamic,
                     compile_backend=args.compile_backend or "eager")
        args.copy_gib = min(args.copy_gib, 1 / 64)
        return s, configs, strategies
    widths = sorted(set(_ints(args.widths)))
    if not widths or widths[0] < 1 or widths[-1] > args.max_width:
        raise SystemExit(f"widths {widths} must lie in 1..--max-width {args.max_width}")
    device = torch.device(args.device or "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: use --dry-run (CPU) or --device cpu")
    s = Settings(device=device, dtype=torch.bfloat16, num_drafts=args.num_drafts, widths=widths,
                 max_width=args.max_width, block_size=args.block_size, max_blocks=args.max_blocks,
                 num_sets=args.sets, live_min=args.live_min, live_max=args.live_max,
                 iters=args.iters, warmup=args.warmup, seed=args.seed,
                 circuit_widths=args.circuit_widths, compile_dynamic=dynamic,
                 compile_backend=args.compile_backend, tuning=args.tuning,
                 tuning_cache=args.tuning_cache)
    return s, {n: CONFIGS[n] for n in names}, strategies


def main(argv: list[str] | None = None) -> dict[str, Any]:
    global T0
    T0 = time.perf_counter()
    args = parse_args(argv)
    s, configs, strategies = build(args)
    log(f"draft_chain: {', '.join(configs)} on {device_name(s.device)}, widths {s.widths}, "
        f"k = {s.num_drafts}, strategies {', '.join(strategies)}; torch {torch.__version__}")
    run = Run(args, s, configs, strategies)
    threads = torch.get_num_threads()
    if s.device.type == "cpu":
        torch.set_num_threads(1)  # tiny CPU ops: a thread pool only adds contention
    try:
        run.execute()
    finally:
        torch.set_num_threads(threads)
    return run.payload(partial=False)


if __name__ == "__main__":
    main()
