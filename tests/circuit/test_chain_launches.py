"""The dense MTP chain's launches per draft step (issue 15 item 1), counted as the GPU runs them,
and the fused chain against the unfused eager oracle: the default pipeline's program equals the
eager run of the circuit as the head emits it, bitwise on CPU fp32 at widths 1, 3 and 8 (bitmask,
confidence stop and embed target on, so every fusion's optional path runs); with the Triton
kernels under the interpreter the launch-saving kernels are chosen and the drafts agree.

Honest counting: a plan's `launches` are schedule entries; `gpu_launches` adds up what each
binding issues (the lm-head argmax and decode attention are a split kernel and its merge: two
each), and the interpreter test counts the Triton kernels actually launched."""
import math

import pytest
import torch

import triton.runtime.interpreter as interpreter

from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.circuit.planner import CompileOptions, compile_draft
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.program import ProgramRunner
from draft_circuit.runners.testing import cuda, random_draft_batch, random_mtp_weights

CFG = MtpConfig(vocab_size=133, hidden_size=40, intermediate_size=72, num_attention_heads=4,
                num_key_value_heads=2, head_dim=10, rms_norm_eps=1e-6, rope_theta=10000.0,
                num_hidden_layers=2, tie_word_embeddings=False, max_position_embeddings=512)
KV = KvLayout(num_blocks=60, block_size=8, max_blocks_per_seq=5)
K, MAX_WIDTH = 3, 8
# per step, as the GPU runs it: eh_proj with the embedding and both norms in its prologue (1),
# q/k/v with input_layernorm in its prologue (1), rope + the paged KV write (1; the opt-in
# fuse_qkv_rope_kv_write folds it into q/k/v, see circuit.passes.OPT_IN), decode attention's
# splits and merge (2), o_proj + residual (1), gate_up + SwiGLU with
# post_attention_layernorm in its prologue (1), down_proj + residual (1), the lm-head's argmax
# partials with the final norm in their prologue, then the merge with keep_if_active (2)
NODES_PER_STEP, GPU_LAUNCHES_PER_STEP, MAX_GPU_LAUNCHES_PER_STEP = 8, 10, 10
PER_CHAIN = 2  # the two stacks, once a chain (references)


def chain(**kw):
    return emit_draft_chain(MtpHead(CFG), K, max_width=MAX_WIDTH, kv=KV, **kw)


def test_launches_per_step():
    c = chain()
    params = MtpHead(CFG).bind(random_mtp_weights(CFG, seed=1))
    compiled = compile_draft(c, params, [1, MAX_WIDTH], options=CompileOptions(interpret_kernels=True))
    report = compiled.report()
    for w in (1, MAX_WIDTH):
        assert len(compiled.programs[w].launches) == NODES_PER_STEP * K + PER_CHAIN
        wr = report.width(w)
        assert wr.launches_per_step == NODES_PER_STEP
        assert wr.gpu_launches_per_step == GPU_LAUNCHES_PER_STEP <= MAX_GPU_LAUNCHES_PER_STEP
        in_steps = [x for x in compiled.programs[w].launches if x.step is not None]
        assert all(x.kernel != "reference" for x in in_steps), [x.node for x in in_steps]
        assert wr.reference_launches == PER_CHAIN


def test_the_proposers_chain_keeps_the_count():
    """Bitmask, confidence stop and embed target on (the proposer's chain): last_kept and the
    confidence gate ride in the lm-head merge's epilogue, so a step is still
    GPU_LAUNCHES_PER_STEP kernels and no step node runs a reference."""
    c = chain(bitmask=True, embed_target=True, confidence_stop=True)
    params = MtpHead(CFG).bind(random_mtp_weights(CFG, seed=2))
    compiled = compile_draft(c, params, [MAX_WIDTH], options=CompileOptions(interpret_kernels=True))
    wr = compiled.report().width(MAX_WIDTH)
    assert wr.launches_per_step == NODES_PER_STEP
    assert wr.gpu_launches_per_step == GPU_LAUNCHES_PER_STEP
    in_steps = [x for x in compiled.programs[MAX_WIDTH].launches if x.step is not None]
    assert all(x.kernel != "reference" for x in in_steps), [x.node for x in in_steps]


def test_cuda_plan_counts_split_kernels_twice():
    """On CUDA (a shapes-only plan) the same chain launches the same kernels: every step node
    bound, GPU_LAUNCHES_PER_STEP kernels a step."""
    head = MtpHead(CFG, "bfloat16")
    params = {k: torch.empty(s, dtype=torch.bfloat16, device="meta")
              for k, (_, s) in head.param_specs().items()}
    c = emit_draft_chain(head, K, max_width=MAX_WIDTH, kv=KV)
    wr = compile_draft(c, params, [1], device="cuda").report().width(1)
    assert wr.gpu_launches_per_step == GPU_LAUNCHES_PER_STEP
    assert wr.gpu_launches == GPU_LAUNCHES_PER_STEP * K
    argmax = [g for g in wr.fused_groups if g["op"] == "rmsnorm_linear_argmax_keep"]
    assert len(argmax) == K


# the runner's input guard (runners/input_guard.py) launches its kernel once a chain, before the
# plan's launches: not a step's launch, so not in the plan's count
RUNNER_KERNELS = ("draft_circuit.kernels.input_guard",)


def _count_triton_launches(monkeypatch) -> list[str]:
    """Every Triton kernel of the plan the interpreter runs (warm-ups excluded), by name."""
    seen: list[str] = []
    run = interpreter.InterpretedFunction.run

    def counted(self, *args, grid, warmup, **kwargs):
        if not warmup and self.fn.__module__ not in RUNNER_KERNELS:
            seen.append(self.fn.__name__)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)
    monkeypatch.setattr(interpreter.InterpretedFunction, "run", counted)
    return seen


@pytest.mark.parametrize("width", [1, 3])
def test_the_interpreter_launches_what_the_plan_counts(width, monkeypatch):
    """Run the planned chain's Triton kernels under the interpreter and count the kernels
    launched: exactly the report's gpu_launches, GPU_LAUNCHES_PER_STEP a step."""
    c = chain()
    params = MtpHead(CFG).bind(random_mtp_weights(CFG, seed=5))
    compiled = compile_draft(c, params, [width], options=CompileOptions(interpret_kernels=True))
    batch = random_draft_batch(CFG, KV, width, seed=width, num_drafts=K)
    seen = _count_triton_launches(monkeypatch)
    ProgramRunner(compiled, batch.clone_states()).run(batch.inputs)
    assert len(seen) == compiled.report().width(width).gpu_launches == GPU_LAUNCHES_PER_STEP * K


@cuda
def test_gpu_kernels_per_step_under_the_profiler():
    """On the H200: the kernels one uncaptured run of the bf16 chain launches (torch.profiler's
    CUDA kernel events) are the plan's gpu_launches plus the per-chain references' kernels."""
    from torch.profiler import ProfilerActivity, profile

    head = MtpHead(CFG, "bfloat16")
    params = head.bind(random_mtp_weights(CFG, seed=3, dtype=torch.bfloat16, device="cuda"))
    c = emit_draft_chain(head, K, max_width=MAX_WIDTH, kv=KV)
    compiled = compile_draft(c, params, [4], device="cuda")
    batch = random_draft_batch(CFG, KV, 4, seed=4, num_drafts=K, dtype=torch.bfloat16, device="cuda")
    inputs = batch.inputs
    runner = ProgramRunner(compiled, batch.clone_states())
    runner.run(inputs)  # compile every kernel first
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        runner.run(inputs)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    # Triton kernels are named after their jit functions; torch's are at:: / void at:: templates;
    # copies and fills show as Memcpy / Memset; the runner's input guard is not the plan's
    plan_kernels = [n for n in names
                    if not n.startswith(("void at::", "at::", "void (anonymous", "Memcpy", "Memset"))
                    and "input_guard" not in n]
    report = compiled.report().width(4)
    assert len(plan_kernels) == report.gpu_launches, names


def _run(c, compiled, width, params, seed):
    batch = random_draft_batch(CFG, KV, width, seed=seed, num_drafts=K, bitmask=True)
    batch.inputs["bitmask"][:, 0] |= 1
    batch.inputs["log_tau"] = torch.full((width,), math.log(0.02))
    want_states = {**batch.clone_states(), "embed_target": torch.zeros(MAX_WIDTH, CFG.hidden_size)}
    got_states = {k: v.clone() for k, v in want_states.items()}
    want = EagerRunner(c, params, want_states).run(batch.inputs)
    got = ProgramRunner(compiled, got_states).run(batch.inputs)
    return got, want, got_states, want_states


@pytest.mark.parametrize("width", [1, 3, 8])
def test_fused_chain_equals_the_unfused_eager_chain(width):
    c = chain(bitmask=True, embed_target=True, confidence_stop=True)
    params = MtpHead(CFG).bind(random_mtp_weights(CFG, seed=width))
    compiled = compile_draft(c, params, [width])
    got, want, got_states, want_states = _run(c, compiled, width, params, seed=width)
    for k in want:
        assert torch.equal(got[k], want[k]), k
    for k in want_states:
        assert torch.equal(got_states[k], want_states[k]), k


@pytest.mark.parametrize("width", [1, 3])
def test_interpreted_kernels_of_the_fused_chain(width):
    c = chain(bitmask=True, embed_target=True, confidence_stop=True)
    params = MtpHead(CFG).bind(random_mtp_weights(CFG, seed=20 + width))
    compiled = compile_draft(c, params, [width], options=CompileOptions(interpret_kernels=True))
    kernels = {x.kernel for x in compiled.programs[width].launches}
    # step 0 gates its rows; middle steps also keep the last draft; the last step only keeps it
    assert {"triton_embed_rmsnorm_linear_concat", "triton_rmsnorm_linear_qkv", "triton_rope_kv_write",
            "triton_linear_add", "triton_rmsnorm_linear_silu_mul", "triton_rmsnorm_linear_argmax_keep_gate",
            "triton_rmsnorm_linear_argmax_keep_last_gate", "triton_rmsnorm_linear_argmax_keep_last"} <= kernels
    assert compiled.report().width(width).gpu_launches_per_step == GPU_LAUNCHES_PER_STEP
    got, want, got_states, want_states = _run(c, compiled, width, params, seed=width)
    assert torch.equal(got["drafts"], want["drafts"])
    torch.testing.assert_close(got["confidences"], want["confidences"], atol=1e-5, rtol=1e-5)
    for k in want_states:
        torch.testing.assert_close(got_states[k], want_states[k], atol=1e-5, rtol=1e-5)
