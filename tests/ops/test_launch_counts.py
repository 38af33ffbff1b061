"""Every kernel binding's declared `launches` is what it launches (issue 15: plan reports count
GPU launches, not nodes): each Triton binding the interpreter can run issues exactly that many
kernels on its op's example (tests/ops/test_registry.py), and each torch binding runs that many
kernel-launching aten ops on real CPU tensors (the declaration counts them on meta tensors)."""
import torch

from draft_circuit.circuit.types import ROW, TensorSpec
from draft_circuit.ops.bindings import aten_kernels
from draft_circuit.ops.registry import REGISTRY, torch_dtype
from tests.ops.test_registry import EXAMPLES, _launch_outputs, make_input

WIDTH = 3


def _example(name):
    op = REGISTRY[name]
    specs, attrs = EXAMPLES[name]
    parsed = op.parse_attrs(attrs)
    g = torch.Generator().manual_seed(7)
    tensors = [make_input(op, i, s, WIDTH, g) for i, s in enumerate(specs)]
    env = {ROW: WIDTH}
    outs = _launch_outputs(op, op.infer(specs, parsed), tensors, env)
    return op, specs, parsed, tensors, outs, env


def _workspace(binding, specs, env, parsed):
    return [torch.empty(shape, dtype=torch_dtype(dt))
            for dt, shape in (binding.workspace(specs, env, parsed) if binding.workspace else ())]


def test_triton_bindings_launch_what_they_declare(interpreted_launches):
    seen = interpreted_launches
    checked = set()
    for name in sorted(EXAMPLES):
        op, specs, parsed, tensors, outs, env = _example(name)
        for binding in op.kernels:
            if not binding.name.startswith("triton_") or not binding.applies("interpret", specs, parsed):
                continue
            seen.clear()
            binding.launch(tensors, outs, _workspace(binding, specs, env, parsed), parsed)
            # moe_route: its one Triton linear, then route_select's torch ops and two copies
            triton_only = binding.launch_count(specs, parsed) if name != "moe_route" else 1
            assert len(seen) == triton_only, (binding.name, seen)
            checked.add(binding.name)
    assert {"triton_linear_argmax_keep", "triton_rmsnorm_linear_qkv",
            "triton_embed_rmsnorm_linear_concat", "triton_rmsnorm_linear_argmax_keep",
            "triton_linear_add", "triton_rmsnorm_linear_silu_mul",
            "triton_rmsnorm_linear_qkv_rope_kv_write"} <= checked


# the torch bindings of the single-device chain ops (collectives count per group: tests/distributed)
TORCH_BINDINGS = {"torch_gather", "torch_embed_write", "torch_kv_write", "torch_map_ids",
                  "torch_remap_bitmask"}


def test_torch_bindings_declare_their_aten_kernels():
    checked = set()
    for name in sorted(EXAMPLES):
        op, specs, parsed, tensors, outs, env = _example(name)
        for binding in op.kernels:
            if binding.name not in TORCH_BINDINGS:
                continue
            ws = _workspace(binding, specs, env, parsed)
            count = aten_kernels(lambda: binding.launch(tensors, outs, ws, parsed))
            assert binding.launch_count(specs, parsed) == count, binding.name
            checked.add(binding.name)
    assert checked == TORCH_BINDINGS


def test_split_kernels_count_two():
    """The bindings that launch a kernel and its merge (or reduce) declare two."""
    two = {k.name for op in REGISTRY.values() for k in op.kernels
           if not callable(k.launches) and k.launches == 2}
    assert {"triton_linear_splitk", "triton_linear_argmax_logprob", "triton_linear_argmax_keep",
            "triton_decode_attention", "triton_mla_decode", "triton_linear_add_splitk",
            "triton_rmsnorm_linear_argmax_keep", "triton_rmsnorm_linear_argmax_logprob"} <= two


def test_prologue_bindings_launch_what_they_declare_at_wide_widths(interpreted_launches, monkeypatch):
    """With kernels.prologue_norm's thresholds lowered so the examples' width takes the norm's
    own launch, every norm-prologue binding the interpreter runs is handed its `normed` buffer
    and issues the launches its count declares for the width's concrete specs (one more)."""
    from draft_circuit.kernels import prologue_norm
    for name, value in (("PRENORM_FROM_N", 0), ("QKV_PRENORM_FROM_N", 0), ("PRENORM_FROM_K", 1),
                        ("ALIGN", 1)):
        monkeypatch.setattr(prologue_norm, name, value)
    seen, checked = interpreted_launches, set()
    for name in ("rmsnorm_linear_qkv", "rmsnorm_linear_silu_mul", "embed_rmsnorm_linear_concat"):
        op, specs, parsed, tensors, outs, env = _example(name)
        concrete = [TensorSpec(dtype=s.dtype, shape=s.concrete(env)) for s in specs]
        for binding in op.kernels:
            if not binding.name.startswith("triton_") or not binding.applies("interpret", specs, parsed):
                continue
            seen.clear()
            binding.launch(tensors, outs, _workspace(binding, specs, env, parsed), parsed)
            assert seen[0] == "prologue_norm_kernel", (binding.name, seen)
            assert len(seen) == binding.launch_count(concrete, parsed) == binding.launch_count(specs, parsed) + 1
            checked.add(binding.name)
    assert checked == {"triton_rmsnorm_linear_qkv", "triton_rmsnorm_linear_silu_mul",
                       "triton_embed_rmsnorm_linear_concat"}
