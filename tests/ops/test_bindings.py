"""Kernel bindings: when a binding applies (devices, float dtypes, conditions such as the block
sizes a kernel takes), and end to end: the whole chain planned with Triton kernels (run by the
interpreter on CPU) against the eager oracle, with bitmask, confidence stop and embed target."""
import math
import subprocess
import sys

import pytest
import torch

from draft_circuit.circuit.ir import TensorSpec
from draft_circuit.circuit.planner import CompileOptions, compile_draft
from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.ops.bindings import CUDA, KERNEL_FLOATS, TRITON, Applies, Condition
from draft_circuit.ops.registry import get_op
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.program import ProgramRunner
from draft_circuit.runners.testing import compare_drafts, cuda, random_draft_batch, random_mtp_weights, run_side_by_side

CFG = MtpConfig(vocab_size=133, hidden_size=40, intermediate_size=72, num_attention_heads=4,
                num_key_value_heads=2, head_dim=10, rms_norm_eps=1e-6, rope_theta=10000.0,
                num_hidden_layers=2, tie_word_embeddings=False, max_position_embeddings=512)
KV = KvLayout(num_blocks=60, block_size=8, max_blocks_per_seq=5)
K = 3


@pytest.mark.parametrize("width", [1, 4])
def test_triton_chain_matches_eager(width):
    head = MtpHead(CFG)
    chain = emit_draft_chain(head, K, max_width=4, kv=KV, bitmask=True, embed_target=True,
                             confidence_stop=True)
    params = head.bind(random_mtp_weights(CFG, seed=9))
    compiled = compile_draft(chain, params, [width], options=CompileOptions(interpret_kernels=True))
    kernels = {x.kernel for x in compiled.programs[width].launches}
    # issue 15: the norms ride in the next linear's prologue and the residual adds in o_proj's
    # and down_proj's epilogues, so no plain linear or add_rmsnorm is left in a step
    assert {"triton_rmsnorm_linear_qkv", "triton_rope_kv_write", "triton_decode_attention", "triton_linear_add",
            "triton_rmsnorm_linear_silu_mul", "triton_embed_rmsnorm_linear_concat"} <= kernels, kernels
    # the lm-head argmax with the final norm, keep_if_active, last_kept and the confidence gate
    # folded in (the merge's epilogue writes them)
    assert {"triton_rmsnorm_linear_argmax_keep_gate", "triton_rmsnorm_linear_argmax_keep_last_gate",
            "triton_rmsnorm_linear_argmax_keep_last"} <= kernels, kernels
    batch = random_draft_batch(CFG, KV, width, seed=width, num_drafts=K, bitmask=True)
    batch.inputs["bitmask"][:, 0] |= 1  # token 0 allowed: no all-masked row here
    batch.inputs["log_tau"] = torch.full((width,), math.log(0.004))
    _assert_drafts_as_eager(chain, params, compiled, batch.inputs,
                            {**batch.states(), "embed_target": torch.zeros(4, CFG.hidden_size)})


def _assert_drafts_as_eager(chain, params, compiled, inputs, states):
    """The kernels' program drafts what eager drafts; confidences and every state within 1e-5."""
    r = run_side_by_side(chain, params, compiled, inputs, states)
    assert torch.equal(r.got["drafts"], r.want["drafts"])
    torch.testing.assert_close(r.got["confidences"], r.want["confidences"], atol=1e-5, rtol=1e-5)
    for k in r.want_states:
        torch.testing.assert_close(r.got_states[k], r.want_states[k], atol=1e-5, rtol=1e-5)


def S(dtype, *shape):
    return TensorSpec(dtype=dtype, shape=shape)


def test_fp8_is_a_float_no_kernel_takes_unless_it_says_so():
    ins = [S("float8_e4m3fn", 4, 4), S("int32", "n"), S("bool", "n")]
    assert not Applies(TRITON)("cuda", ins, None)
    assert Applies(TRITON).why_not("cuda", ins, None) == \
        "takes floats bfloat16, float16, float32; got f8e4m3[4,4]"
    assert Applies(CUDA, floats=KERNEL_FLOATS | {"float8_e4m3fn"})("cuda", ins, None)  # ints, bool: not floats
    assert Applies(TRITON)("interpret", [S("bfloat16", "n", 4), S("int64", "n")], None)
    assert Applies(CUDA).why_not("interpret", [], None) == "runs on cuda, not interpret"
    big = Condition("x narrower than 8", lambda ins, a: ins[0].shape[1] < 8)
    assert Applies(TRITON, conditions=(big,)).why_not("cuda", [S("float32", "n", 9)], None) == \
        "needs x narrower than 8"


def test_moe_fp8_experts_bind_only_on_cuda():
    fp8 = get_op("moe_experts_fp8").kernels[0].applies
    specs = [S("bfloat16", "n", 6), S("int32", "n", 2), S("float32", "n", 2), S("float8_e4m3fn", 4, 10, 6),
             S("float32", 4, 1, 1), S("float8_e4m3fn", 4, 6, 5), S("float32", 4, 1, 1)]
    assert fp8("cuda", specs, None) and not fp8("interpret", specs, None)
    unscaled = specs[:4] + specs[5:6]  # fp8 weights without scales reach no kernel
    assert not get_op("moe_experts").kernels[0].applies("cuda", unscaled, None)


@pytest.mark.parametrize("block_size, attention_kernel", [
    (4, "reference"), (12, "reference"), (8, "triton_decode_attention"),
    (32, "triton_decode_attention")])
def test_attention_kernel_is_planned_only_for_block_sizes_it_takes(block_size, attention_kernel):
    """kernels.decode_attention takes power-of-two block sizes >= 8; rope_kv_write's kernel takes
    any.
    Planned for 4 or 12, the program used to pick the Triton attention and fail at run time
    (issue 19 item 9): now the plan picks the reference and the program runs."""
    kv = KvLayout(num_blocks=60, block_size=block_size, max_blocks_per_seq=-(-40 // block_size))
    head = MtpHead(CFG)
    chain = emit_draft_chain(head, K, max_width=4, kv=kv)
    params = head.bind(random_mtp_weights(CFG, seed=3))
    width = 3
    compiled = compile_draft(chain, params, [width], options=CompileOptions(interpret_kernels=True))
    launches = compiled.programs[width].launches
    kernels = {(x.op, x.kernel) for x in launches}
    assert sum(x.op == "decode_attention" for x in launches) == K
    assert {kernel for op, kernel in kernels if op == "decode_attention"} == {attention_kernel}
    assert ({kernel for op, kernel in kernels if op == "rope_kv_write"}
            == {"triton_rope_kv_write"})
    why = get_op("decode_attention").kernels[0].applies.why_not(
        "interpret", [chain.value(v).spec for v in chain.node("s0.attention").inputs],
        get_op("decode_attention").parse_attrs({}))
    assert why == (None if attention_kernel != "reference" else "needs block_size a power of two >= 8")
    batch = random_draft_batch(CFG, kv, width, seed=block_size, num_drafts=K)
    _assert_drafts_as_eager(chain, params, compiled, batch.inputs, batch.states())


def test_importing_the_vocabulary_imports_no_kernel():
    """Kernels are reached through ops.bindings.kernel, on first use: the registry, the passes
    and a CPU plan never import triton or a kernel module."""
    code = ("import sys; import draft_circuit.ops, draft_circuit.circuit.passes; "
            "from draft_circuit.circuit.layers.config import DEFAULT_CONFIG; "
            "from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain; "
            "from draft_circuit.circuit.planner import compile_draft; import torch; "
            "head = MtpHead(DEFAULT_CONFIG); "
            "chain = emit_draft_chain(head, 2, max_width=2, kv=KvLayout(9, 16, 4)); "
            "compile_draft(chain, {k: torch.empty(s, device='meta') for k, s in head.param_shapes().items()}, [1]); "
            "print(sorted(m for m in sys.modules if m == 'triton' or m.startswith('draft_circuit.kernels')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


@cuda
@pytest.mark.parametrize("block_size", [4, 12, 16])
def test_cuda_plans_for_any_block_size_run(block_size):
    """On the GPU: block sizes the Triton attention refuses plan the reference attention (the
    uncaptured program runs; its host sync keeps it out of CUDA graphs), 16 plans the kernel;
    rope_kv_write is the Triton kernel at every block size. Drafts match the oracle."""
    kv = KvLayout(num_blocks=60, block_size=block_size, max_blocks_per_seq=-(-40 // block_size))
    head = MtpHead(CFG)
    chain = emit_draft_chain(head, K, max_width=4, kv=kv)
    params = head.bind(random_mtp_weights(CFG, seed=3, device="cuda"))
    width = 4
    compiled = compile_draft(chain, params, [width], device="cuda")
    kernels = {(x.op, x.kernel) for x in compiled.programs[width].launches}
    assert {k for op, k in kernels if op == "decode_attention"} == \
        {"reference" if block_size in (4, 12) else "triton_decode_attention"}
    assert {k for op, k in kernels if op == "rope_kv_write"} == {"triton_rope_kv_write"}
    batch = random_draft_batch(CFG, kv, width, seed=block_size, num_drafts=K, device="cuda")
    want_states = batch.clone_states()
    got_states = {k: v.clone() for k, v in want_states.items()}
    keep = tuple(f"s{j}.lm_head" for j in range(K))
    want = EagerRunner(chain, params, want_states).run(batch.inputs, keep=keep)
    top2 = torch.stack([want[n].float().log_softmax(-1).topk(2, dim=-1).values for n in keep], dim=1)
    got = ProgramRunner(compiled, got_states).run(batch.inputs)
    compare_drafts(got, want, top2[..., 0] - top2[..., 1], conf_atol=1e-4)
    for k in want_states:
        torch.testing.assert_close(got_states[k], want_states[k], atol=1e-4, rtol=1e-4)
