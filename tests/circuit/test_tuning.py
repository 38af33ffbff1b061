"""Measured kernel choice (issue 15 item 4, circuit/tuning.py): the cache invalidates when its
environment (device, library versions) or schema changes and misses on a new shape, dtype,
kernel or attrs; the planner binds the measured fastest candidate (one per node for every width
while width independence is on, per width without it), records each choice in the plan report
and page, reuses cached measurements without measuring again, and refuses to measure without a
GPU. cuda: a real measuring pass over the small config's chain."""
import json

import pytest
import torch

from draft_circuit.circuit import CircuitBuilder
from draft_circuit.circuit.planner import CompileOptions, PlanError, compile_draft
from draft_circuit.circuit.report import PlanReport
from draft_circuit.circuit.tuning import TUNING_SCHEMA, TuningCache, entry_key, environment
from draft_circuit.circuit.types import TensorSpec
from draft_circuit.circuit.viz.html import render_html
from draft_circuit.runners.testing import cuda

ENV = {"device": "NVIDIA H200", "torch": "2.11.0", "triton": "3.6.0", "cuda": "13.0"}
K_WIDE = 4096  # wide enough for split-K to apply to the first linear; the second has one kernel


def circuit():
    b = CircuitBuilder("two_linears", max_width=8)
    x = b.input("x", "float32", ("n", K_WIDE))
    w1, w2 = b.param("w1", "float32", (16, K_WIDE)), b.param("w2", "float32", (8, 16))
    b.output(b.op1("linear", [b.op1("linear", [x, w1], name="wide"), w2], name="narrow"), "y")
    return b.build(), {"w1": torch.empty(16, K_WIDE, device="meta"), "w2": torch.empty(8, 16, device="meta")}


def fake_measure(calls):
    """split-K: 9 us at n = 1, 4 us above; the single pass: 7 us at every width."""
    def measure(op, binding, specs, attrs, device):
        n = int(specs[0].shape[0])
        calls.append((binding.name, n))
        return (9.0 if n == 1 else 4.0) if binding.name == "triton_linear_splitk" else 7.0
    return measure


def _options(tmp_path, **kw):
    return CompileOptions(interpret_kernels=True, tuning_cache=str(tmp_path / "tuning.json"), **kw)


def test_cache_invalidates_on_an_environment_or_schema_change(tmp_path):
    path = tmp_path / "tuning.json"
    cache = TuningCache(path, ENV)
    assert not cache.invalidated and cache.get("k") is None
    cache.put("k", 3.5)
    cache.save()
    assert TuningCache(path, ENV).get("k") == 3.5  # the same environment: a hit
    for change in ({"triton": "3.7.0"}, {"torch": "2.12.0"}, {"device": "NVIDIA H100"}, {"cuda": "12.8"}):
        other = TuningCache(path, {**ENV, **change})
        assert other.invalidated and other.get("k") is None, change
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "schema": TUNING_SCHEMA + 1}))
    assert TuningCache(path, ENV).invalidated


def test_entry_keys_miss_on_a_new_shape_dtype_kernel_or_attrs():
    specs = [TensorSpec(dtype="bfloat16", shape=(8, 4096)), TensorSpec(dtype="bfloat16", shape=(16, 4096))]
    key = entry_key("linear", {}, "triton_linear", specs)
    assert key == entry_key("linear", {}, "triton_linear", list(specs))
    wider = [TensorSpec(dtype="bfloat16", shape=(16, 4096)), specs[1]]
    fp16 = [TensorSpec(dtype="float16", shape=s.shape) for s in specs]
    assert len({key, entry_key("linear", {}, "triton_linear", wider),
                entry_key("linear", {}, "triton_linear", fp16),
                entry_key("linear", {}, "triton_linear_splitk", specs),
                entry_key("linear", {"out_dtype": "float32"}, "triton_linear", specs)}) == 5


def test_an_unreadable_cache_is_a_typed_error(tmp_path):
    from draft_circuit.circuit.tuning import TuningError
    (tmp_path / "tuning.json").write_text("{not json")
    with pytest.raises(TuningError, match="unreadable"):
        TuningCache(tmp_path / "tuning.json", ENV)


def test_width_independent_choice_is_one_kernel_for_every_width(tmp_path):
    c, params = circuit()
    calls = []
    compiled = compile_draft(c, params, [1, 8], options=_options(tmp_path, tuning="measure"),
                             measure=fake_measure(calls))
    # split-K totals 13 us over the two widths, the single pass 14: split-K at both widths
    for w in (1, 8):
        kernels = {x.node: x.kernel for x in compiled.programs[w].launches}
        assert kernels == {"wide": "triton_linear_splitk", "narrow": "triton_linear"}
        (choice,) = compiled.report().width(w).kernel_choices
        assert choice.node == "wide" and choice.kernel == "triton_linear_splitk"
        assert choice.us == {"triton_linear_splitk": 9.0 if w == 1 else 4.0, "triton_linear": 7.0}
        assert "every width" in choice.why and "sample widths [1, 8]" in choice.why
    assert sorted(calls) == sorted([("triton_linear_splitk", 1), ("triton_linear", 1),
                                    ("triton_linear_splitk", 8), ("triton_linear", 8)])
    back = PlanReport.from_json(compiled.report().to_json())
    assert back.width(1).kernel_choices[0].kernel == "triton_linear_splitk"
    page = render_html(compiled.report())
    assert 'id="kernel-choices"' in page and "triton_linear_splitk 9.0" in page


def test_without_width_independence_each_width_takes_its_fastest(tmp_path):
    c, params = circuit()
    compiled = compile_draft(c, params, [1, 8], measure=fake_measure([]),
                             options=_options(tmp_path, tuning="measure", width_independent=False))
    chosen = {w: {x.node: x.kernel for x in compiled.programs[w].launches}["wide"] for w in (1, 8)}
    assert chosen == {1: "triton_linear", 8: "triton_linear_splitk"}
    assert "n=1" in compiled.report().width(1).kernel_choices[0].why


def test_cached_choices_are_reused_without_measuring(tmp_path):
    c, params = circuit()
    compile_draft(c, params, [1, 8], options=_options(tmp_path, tuning="measure"),
                  measure=fake_measure([]))

    def never(*args):
        raise AssertionError("a cached measurement was measured again")
    again = compile_draft(c, params, [1, 8], options=_options(tmp_path, tuning="measure"), measure=never)
    cached = compile_draft(c, params, [1, 8], options=_options(tmp_path, tuning="cached"))
    for compiled in (again, cached):
        assert compiled.report().width(8).kernel_choices[0].kernel == "triton_linear_splitk"
    # a width the cache has not seen: "cached" keeps the first applicable kernel and says why
    fresh = compile_draft(c, params, [2], options=_options(tmp_path, tuning="cached"))
    (choice,) = fresh.report().width(2).kernel_choices
    assert choice.kernel == "triton_linear_splitk" and "not measured" in choice.why


def test_tuning_off_records_nothing_and_measuring_needs_a_gpu(tmp_path):
    c, params = circuit()
    assert compile_draft(c, params, [1], options=_options(tmp_path)).report().width(1).kernel_choices == []
    assert 'id="kernel-choices"' in render_html(compile_draft(c, params, [1]).report())
    with pytest.raises(PlanError, match="on the GPU"):
        compile_draft(c, params, [1], options=_options(tmp_path, tuning="measure"))


def test_environment_names_the_libraries():
    env = environment("cpu")
    assert env["device"] == "cpu" and env["torch"] == torch.__version__ and set(env) == set(ENV)


@cuda
def test_measuring_pass_on_the_small_chain(tmp_path):
    """A real tuning pass on the H200 over the small config's chain (bf16, widths 1, 8, 64): every
    node with competing kernels gets a choice with positive measured us, the cache is written,
    and a cached compile binds the same kernels without measuring."""
    from benchmarks.draft_chain import CONFIGS
    from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
    from draft_circuit.runners.testing import random_mtp_weights

    head = MtpHead(CONFIGS["small"], "bfloat16")
    chain = emit_draft_chain(head, 4, max_width=64, kv=KvLayout(513, 16, 64))
    params = head.bind(random_mtp_weights(CONFIGS["small"], seed=1, dtype=torch.bfloat16, device="cuda"))
    options = CompileOptions(tuning="measure", tuning_cache=str(tmp_path / "tuning.json"))
    compiled = compile_draft(chain, params, [1, 8, 64], device="cuda", options=options)
    choices = compiled.report().width(1).kernel_choices
    assert choices and all(min(c.us.values()) > 0 for c in choices)
    print("\n" + "\n".join(f"{c.node}: {c.kernel} {c.us}" for c in choices))
    cached = compile_draft(chain, params, [1, 8, 64], device="cuda",
                           options=options.model_copy(update={"tuning": "cached"}))
    for w in (1, 8, 64):
        assert ([x.kernel for x in cached.programs[w].launches]
                == [x.kernel for x in compiled.programs[w].launches])


def test_only_sample_widths_are_measured(tmp_path):
    """1, the powers of two and the largest are timed; a width between takes its nearest
    sample's times and says so."""
    from draft_circuit.circuit.tuning import sample_widths
    assert sample_widths(range(1, 65)) == [1, 2, 4, 8, 16, 32, 64]
    assert sample_widths([3, 5, 6]) == [3, 6]
    c, params = circuit()
    calls = []
    compiled = compile_draft(c, params, [1, 2, 3, 6, 8], options=_options(tmp_path, tuning="measure"),
                             measure=fake_measure(calls))
    assert sorted({n for _, n in calls}) == [1, 2, 8]
    (choice,) = compiled.report().width(6).kernel_choices
    assert "measured at n=8" in choice.why and choice.us["triton_linear_splitk"] == 4.0
    (choice3,) = compiled.report().width(3).kernel_choices
    assert "measured at n=2" in choice3.why


def test_a_candidate_that_fails_to_run_is_never_chosen(tmp_path):
    """A kernel that raises when measured (a compile error on this GPU) loses, is named in the
    why, is not cached, and the report's JSON stays finite."""
    c, params = circuit()

    def measure(op, binding, specs, attrs, device):
        if binding.name == "triton_linear_splitk":
            raise RuntimeError("no such instruction on this device")
        return 7.0
    compiled = compile_draft(c, params, [1, 8], options=_options(tmp_path, tuning="measure"), measure=measure)
    (choice,) = compiled.report().width(8).kernel_choices
    assert choice.kernel == "triton_linear" and "failed to run: triton_linear_splitk" in choice.why
    assert choice.us == {"triton_linear": 7.0}
    assert "Infinity" not in compiled.report().to_json()
    assert len(json.loads((tmp_path / "tuning.json").read_text())["entries"]) == 2  # single pass only


def test_pdl_prefetch_variants_are_bound_only_when_measured_faster(tmp_path, monkeypatch):
    """The *_pdl_prefetch bindings (CUDA only) are never the default on a CUDA plan; a tuning
    pass that measures one faster binds it."""
    import draft_circuit.circuit.planner as planner
    from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
    from tests.circuit.test_chain_launches import CFG

    head = MtpHead(CFG, "bfloat16")
    params = {k: torch.empty(s, dtype=torch.bfloat16, device="meta") for k, (_, s) in head.param_specs().items()}
    chain = emit_draft_chain(head, 2, max_width=8, kv=KvLayout(60, 8, 5))
    plain = compile_draft(chain, params, [1], device="cuda")
    assert not any(x.kernel.endswith("_pdl_prefetch") for x in plain.programs[1].launches)
    monkeypatch.setattr(planner, "environment", lambda device: ENV)  # no GPU to name here

    def measure(op, binding, specs, attrs, device):
        return 3.0 if binding.name.endswith("_pdl_prefetch") else 5.0
    tuned = compile_draft(chain, params, [1, 8], device="cuda", measure=measure,
                          options=CompileOptions(tuning="measure", tuning_cache=str(tmp_path / "t.json")))
    kernels = {x.op: x.kernel for x in tuned.programs[8].launches}
    assert kernels["linear_add"] == "triton_linear_add_pdl_prefetch"
    assert kernels["rmsnorm_linear_silu_mul"] == "triton_rmsnorm_linear_silu_mul_pdl_prefetch"
    assert kernels["embed_rmsnorm_linear_concat"] == "triton_embed_rmsnorm_linear_concat_pdl_prefetch"


def test_without_width_independence_the_residual_linears_take_cublas():
    """circuit_fast (width_independent=False) binds cuBLAS for o_proj / down_proj + residual
    (cublas_linear_add), as it bound cublas_linear before the add folded in; the default never."""
    from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
    from tests.circuit.test_chain_launches import CFG

    head = MtpHead(CFG, "bfloat16")
    params = {k: torch.empty(s, dtype=torch.bfloat16, device="meta") for k, (_, s) in head.param_specs().items()}
    chain = emit_draft_chain(head, 2, max_width=8, kv=KvLayout(60, 8, 5))
    fast = compile_draft(chain, params, [4], device="cuda", options=CompileOptions(width_independent=False))
    default = compile_draft(chain, params, [4], device="cuda")
    assert {x.kernel for x in fast.programs[4].launches if x.op == "linear_add"} == {"cublas_linear_add"}
    assert "cublas_linear_add" not in {x.kernel for x in default.programs[4].launches}
