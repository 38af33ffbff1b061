"""The target: a dense Llama decoder emitted as a circuit of the project's own ops over query rows
(with the config's attention options: Qwen2's q/k/v biases, Qwen3's per-head q/k norms).

Every query token is a row. A row attends, through its sequence's block table, to the KV rows
0..live_rows (its own row included: kv_write runs before attention), so a prefill of P tokens, a
verify of k+1 tokens and a plain decode step are the same circuit at different row counts.
Outputs per row: the greedy token, its log-probability and the final-norm hidden (the MTP
head's target hidden); with `tap_layers` (an EAGLE-3 drafter) also the chosen layers' outputs
concatenated, which is then the hidden the drafter is handed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from draft_circuit.circuit.builder import CircuitBuilder
from draft_circuit.circuit.ir import ROW, SCRATCH_BLOCK, Circuit
from draft_circuit.circuit.layers.config import TARGET_PARAM_SHAPES, MtpConfig
from draft_circuit.circuit.layers.mtp import (KvLayout, emit_qk_norm, qkv_params, rope_op, rotary_attrs,
                                              yarn_param_specs, yarn_params)
from draft_circuit.circuit.layers.tp import TpPlan, row_sum, shard_target_weights, vocab_argmax
from draft_circuit.runners.eager import EagerDraftRunner
from draft_circuit.runners.protocol import DraftRunner
from examples.engine.capture import GRAPH_ROWS, TargetPasses
from examples.engine.target_staging import TargetStaging

GATE_UP = "mlp.gate_up_proj.weight"  # per layer: gate rows, then up rows (what silu_mul reads)


def target_param_shapes(config: MtpConfig) -> dict[str, tuple[int, ...]]:
    """The circuit's params: HF names, with each layer's gate and up fused into one weight."""
    shapes = dict(TARGET_PARAM_SHAPES(config))
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}."
        gate = shapes.pop(p + "mlp.gate_proj.weight")
        shapes.pop(p + "mlp.up_proj.weight")
        shapes[p + GATE_UP] = (2 * gate[0], gate[1])
    return shapes


def bind_target(config: MtpConfig, weights: dict[str, torch.Tensor],
                dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-named checkpoint tensors -> the circuit's params, in `dtype`."""
    params = {}
    for name in target_param_shapes(config):
        if name.endswith(GATE_UP):
            p = name.removesuffix(GATE_UP)
            w = torch.cat([weights[p + "mlp.gate_proj.weight"], weights[p + "mlp.up_proj.weight"]])
        else:
            w = weights[name]
        params[name] = w.to(dtype).contiguous()
    return params | yarn_params(config, torch.device("cpu"))  # YaRN's f32 frequencies, if scaled


def check_tap_layers(config: MtpConfig, tap_layers: tuple[int, ...]) -> tuple[int, ...]:
    """Distinct layer indices of the target, ascending (the order the outputs are concatenated
    in, as vLLM and SGLang collect them while running the layers); ValueError names a bad one."""
    if not tap_layers or len(set(tap_layers)) != len(tap_layers):
        raise ValueError(f"tap_layers {list(tap_layers)}: give distinct target layer indices")
    for i in tap_layers:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < config.num_hidden_layers:
            raise ValueError(f"tap_layers: {i!r} is no layer of a {config.num_hidden_layers}-layer target")
    return tuple(sorted(tap_layers))


def emit_target(config: MtpConfig, *, kv: KvLayout, max_rows: int, dtype: str = "float32",
                name: str = "llama_target", tap_layers: tuple[int, ...] | None = None,
                tp: TpPlan | None = None) -> Circuit:
    """The target's forward over n query rows.

    Inputs: tokens i32[n], positions i32[n], block_tables i32[n, M] (a row's sequence's table),
    live_rows i32[n] (KV rows before this row: the row writes row live_rows and attends to
    0..live_rows), active i32[n] (0: an inert padding row that writes no KV).
    States: k_cache_{l}, v_cache_{l} [num_blocks, block_size, kv_heads, head_dim] per layer.
    Outputs: token i32[n] (argmax), logprob f32[n], hidden [n, H] (after the final norm);
    with tap_layers also taps [n, len(tap_layers) * H]: the residual stream after each tapped
    layer (before the next layer's norm), ascending layer order (`check_tap_layers`).
    `tp`: rank tp.rank's shard (circuit/layers/tp.py, as the MTP head shards): its heads and
    intermediate rows, all_reduce after o_proj and down_proj, the lm-head's vocabulary rows and
    vocab_parallel_argmax; outputs as above, replicated on every rank.
    """
    c = config if tp is None else tp.local_config
    taps = check_tap_layers(c, tap_layers) if tap_layers is not None else ()
    tapped: list[str] = []
    b = CircuitBuilder(name, max_width=max_rows)
    tokens = b.input("tokens", "int32", (ROW,))
    positions = b.input("positions", "int32", (ROW,))
    tables = b.input("block_tables", "int32", (ROW, kv.max_blocks_per_seq), neutral=SCRATCH_BLOCK)
    live = b.input("live_rows", "int32", (ROW,))
    active = b.input("active", "int32", (ROW,), neutral=0)  # inert rows write no KV
    for pname, shape in target_param_shapes(c).items():
        b.param(pname, dtype, (tp.vocab[1], shape[1]) if tp is not None and pname == "lm_head.weight" else shape)
    for pname, (pdtype, shape) in yarn_param_specs(c).items():  # rope_scaling yarn: rope_freqs' table
        b.param(pname, pdtype, shape)
    cache_shape = (kv.num_blocks, kv.block_size, c.num_key_value_heads, c.head_dim)
    eps = {"eps": c.rms_norm_eps}
    rope = {"head_dim": c.head_dim, "theta": c.rope_theta, **rotary_attrs(c)}
    x = b.op1("embedding", ["model.embed_tokens.weight", tokens], name="embed_tokens")
    for layer in range(c.num_hidden_layers):
        p = f"model.layers.{layer}."
        k_cache = b.state(f"k_cache_{layer}", dtype, cache_shape)
        v_cache = b.state(f"v_cache_{layer}", dtype, cache_shape)
        with b.scope(f"l{layer}"):
            a = b.op1("rmsnorm", [x, p + "input_layernorm.weight"], eps, name="input_layernorm")
            q = emit_qk_norm(b, c, "q", b.op1("linear", [a, *qkv_params(c, "q", p)], name="q_proj"), p)
            k = emit_qk_norm(b, c, "k", b.op1("linear", [a, *qkv_params(c, "k", p)], name="k_proj"), p)
            v = b.op1("linear", [a, *qkv_params(c, "v", p)], name="v_proj")
            q = b.op1(*rope_op(b, c, q, positions, rope), name="rope_q")  # YaRN: rope_freqs
            k = b.op1(*rope_op(b, c, k, positions, rope), name="rope_k")
            k_cache, v_cache = b.op("kv_write", [k_cache, v_cache, k, v, tables, live, active])
            o = b.op1("decode_attention", [q, k_cache, v_cache, tables, live], name="attention")
            o = row_sum(b, b.op1("linear", [o, p + "self_attn.o_proj.weight"], name="o_proj"), tp)
            x = b.op1("add", [x, o], name="attn_residual")
            m = b.op1("rmsnorm", [x, p + "post_attention_layernorm.weight"], eps,
                      name="post_attention_layernorm")
            g = b.op1("silu_mul", [b.op1("linear", [m, p + GATE_UP], name="gate_up_proj")])
            x = b.op1("add", [x, row_sum(b, b.op1("linear", [g, p + "mlp.down_proj.weight"],
                                               name="down_proj"), tp)], name="mlp_residual")
        if layer in taps:
            tapped.append(x)
        b.output(k_cache)
        b.output(v_cache)
    h = b.op1("rmsnorm", [x, "model.norm.weight"], eps, name="norm")
    logits = b.op1("linear", [h, "lm_head.weight"], {"out_dtype": "float32"}, name="lm_head")
    token, logprob = vocab_argmax(b, logits, None, tp)
    b.output(token, "token")
    b.output(logprob, "logprob")
    b.output(h, "hidden")
    if taps:
        b.output(b.op1("concat", tapped, name="taps") if len(tapped) > 1 else tapped[0], "taps")
    return b.build()


@dataclass
class TargetRows:
    """One target pass's inputs: every query token a row (host tensors, int32)."""

    tokens: torch.Tensor        # [n]
    positions: torch.Tensor     # [n]
    block_tables: torch.Tensor  # [n, max_blocks_per_seq]
    live_rows: torch.Tensor     # [n]


class TargetModel:
    """The target's circuit, its bound weights and its paged KV pools, and what runs them.

    forward="eager": the eager runner, any row count, no compile. forward="circuit": the circuit
    compiled (fused passes, Triton kernels on CUDA) for power-of-two row counts up to max_rows,
    a pass padded up to the next one with inert rows (never split: a sequence's rows must run in
    order); on CUDA every bucket up to graph_rows is a CUDA graph, prefill included (wider ones
    run uncaptured; examples/engine/capture.py). Either way a row's bits never depend on the rows it shares a pass
    with (row-wise references; width-independent kernels), which is what makes speculative
    output equal target-only output.
    """

    hidden_output = "hidden"  # the circuit output `forward` hands back as the drafter's hidden
    # the captured buckets' staging, made at the first pass that stages (subclasses build their
    # own circuits and runners without this __init__: the class default serves them too)
    _graph_staging: TargetStaging | None = None

    def __init__(self, config: MtpConfig, weights: dict[str, torch.Tensor], kv: KvLayout, *,
                 max_rows: int, dtype: torch.dtype = torch.float32, device: str = "cpu",
                 forward: str = "eager", tap_layers: tuple[int, ...] | None = None,
                 graph_rows: int = GRAPH_ROWS, tp: TpPlan | None = None) -> None:
        """`tp`: this rank's shard (whole `weights` in; its slices are bound, its KV heads pooled)."""
        self.config, self.kv, self.device, self.max_rows = config, kv, torch.device(device), max_rows
        dtype_name = str(dtype).removeprefix("torch.")
        self.circuit = emit_target(config, kv=kv, max_rows=max_rows, dtype=dtype_name, tap_layers=tap_layers, tp=tp)
        # the hidden handed to the drafter: the tapped layers' outputs (EAGLE-3) or the last one
        self.hidden_output = "taps" if tap_layers else "hidden"
        self.hidden_size = config.hidden_size * (len(tap_layers) if tap_layers else 1)
        if tp is not None:
            weights = shard_target_weights(weights, tp)
        params = {k: w.to(self.device) for k, w in bind_target(config, weights, dtype).items()}
        kv_heads = (config if tp is None else tp.local_config).num_key_value_heads
        shape = (kv.num_blocks, kv.block_size, kv_heads, config.head_dim)
        states = {f"{kind}_cache_{layer}": torch.zeros(shape, dtype=dtype, device=self.device)
                  for layer in range(config.num_hidden_layers) for kind in ("k", "v")}
        self.runner: DraftRunner
        if forward == "eager":
            self.runner = EagerDraftRunner(self.circuit, params, states)
        elif forward == "circuit":  # buckets up to graph_rows captured on CUDA (prefill too)
            self.runner = TargetPasses(self.circuit, params, states, max_rows=max_rows,
                                       device=str(self.device), graph_rows=graph_rows)
        else:
            raise ValueError(f"target forward must be 'eager' or 'circuit', got {forward!r}")

    def stage_inputs(self, rows: TargetRows) -> Mapping[str, torch.Tensor]:
        """One pass's runner inputs on the model's device. On CPU the rows' own tensors and a
        fresh `active` (as always). A captured pass (CUDA, a graph bucket) is written into its
        graph's own buffers (examples/engine/target_staging.py: one copy, no padding fills).
        Otherwise every host int input is written into ONE pinned
        host mirror (laid out [tokens | positions | live_rows | block_tables] for this n) and
        moved with one `non_blocking` copy, and `active` is a view of a persistent device
        buffer of ones: no pageable copy, so the host is not held behind the work already
        queued (the draft chain) before it can enqueue the verify. Tokens already on the
        device (a device-resident verify input) are passed as they are. The mirror is safe to
        rewrite on the next pass: every pass is read before the next is launched (`forward`
        syncs on its tokens before it returns; a `launch` is read by its caller, the engine's
        `read_verify`, which `TokensToHost` enforces), after this copy has run."""
        n = rows.tokens.shape[0]
        if self.device.type == "cpu":
            return {"tokens": rows.tokens, "positions": rows.positions,
                    "block_tables": rows.block_tables, "live_rows": rows.live_rows,
                    "active": torch.ones(n, dtype=torch.int32)}
        if self._graph_staging is None and isinstance(self.runner, TargetPasses):
            self._graph_staging = TargetStaging(self.runner, max_blocks=self.kv.max_blocks_per_seq,
                                                device=self.device)
        if self._graph_staging is not None:  # a captured pass: into its graph's own buffers
            staged = self._graph_staging.stage(rows.tokens, rows.positions, rows.block_tables,
                                               rows.live_rows)
            if staged is not None:
                return staged
        m = self.kv.max_blocks_per_seq
        if not hasattr(self, "_mirror"):  # made once: rows up to max_rows
            size = self.max_rows * (3 + m)
            self._mirror = torch.zeros(size, dtype=torch.int32, pin_memory=True)
            self._staged = torch.zeros(size, dtype=torch.int32, device=self.device)
            self._active = torch.ones(self.max_rows, dtype=torch.int32, device=self.device)
        host, dev = self._mirror, self._staged
        out, at = {}, 0
        for name, t in (("tokens", rows.tokens), ("positions", rows.positions),
                        ("live_rows", rows.live_rows), ("block_tables", rows.block_tables)):
            if t.device.type != "cpu":  # already on the device: passed as it is
                out[name] = t
                continue
            size = t.numel()
            host[at:at + size].view(t.shape).copy_(t)  # host to host, converting to int32
            out[name] = dev[at:at + size].view(t.shape)
            at += size
        if at:
            dev[:at].copy_(host[:at], non_blocking=True)  # the pass's one host-to-device copy
        out["active"] = self._active[:n]
        return out

    def forward(self, rows: TargetRows) -> tuple[list[int], torch.Tensor]:
        """Greedy tokens (host ints) and the drafter's hiddens of every row (on the device, the
        caller's to keep): final-norm hiddens [n, H], or with tap_layers the taps [n, taps * H]."""
        greedy, hidden = self.launch(rows)
        return greedy.tolist(), hidden

    def launch(self, rows: TargetRows) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` with nothing read: the greedy tokens as the runner's int32 output on the
        device (its buffer: valid until the next pass, so read or copy it before) and the
        hiddens (a copy, the caller's)."""
        n = rows.tokens.shape[0]
        if not 1 <= n <= self.max_rows:
            raise ValueError(f"a target pass takes 1..{self.max_rows} rows, got {n}")
        # a compiled runner's outputs are its buffers: the next pass overwrites them. The copy
        # is enqueued before the read that waits for the pass, so its launch is host time under
        # the pass's GPU time, not in the idle gap after the read
        out = self.runner.run(n, self.stage_inputs(rows))
        hidden = out[self.hidden_output].clone()
        return out["token"], hidden
