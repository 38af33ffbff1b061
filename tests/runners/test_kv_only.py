"""The KV-only catch-up chain (issue 14 step 1): the one-step circuit with only its state writes
as outputs. It writes bitwise the KV rows the full one-step chain writes (compiled program vs the
eager oracle, at padded widths), its plan is listed as its own program family, and eliminating
outputs never removes a state write."""
import pytest
import torch

from draft_circuit.circuit import CircuitBuilder
from draft_circuit.circuit.planner import KV_ONLY, CompileOptions, PlanError, compile_draft, kv_only_circuit
from draft_circuit.circuit.report import PlanReport
from draft_circuit.runners.chains import compile_chain
from draft_circuit.runners.testing import cuda
from tests.runners.test_proposer import CFG, K, hidden, make, prefilled


def catch_up(p, seeds, lengths):
    """Prefill one sequence per seed, then catch each up by `lengths[i]` rows in one batch."""
    states = [prefilled(p, s, length=5 + s % 4)[0] for s in seeds]
    g = torch.Generator().manual_seed(99)
    tokens = [torch.randint(0, CFG.vocab_size, (m,), generator=g).tolist() for m in lengths]
    hiddens = [hidden(50 + i, m) for i, m in enumerate(lengths)]
    first = [st.rows + 1 for st in states]
    assert p.catchup_batch(tokens, hiddens, first, states) == sum(lengths)
    return states


@pytest.mark.parametrize("lengths", [[1, 2], [2, 1, 2], [3, 2], [1, 1, 1, 1, 1], [2, 3, 2]])
def test_kv_only_catchup_writes_the_one_step_chains_rows_bitwise(lengths):
    """3, 5 and 7 rows run padded on the KV-only program (widths 1, 2, 4, 8); the pools equal
    the eager oracle's, which runs the full one-step chain."""
    program, oracle = make("circuit"), make("eager")
    runner, kv_only = program.chains.kv_only()
    assert kv_only and runner is not program.chain_runner(1)
    assert runner.plan(3).kind == "pad" and runner.plan(7).kind == "pad"
    assert {runner.plan(n).kind for n in range(1, 9)} <= {"own", "pad"}  # never split
    seeds = list(range(1, len(lengths) + 1))
    mine, theirs = catch_up(program, seeds, lengths), catch_up(oracle, seeds, lengths)
    assert [s.rows for s in mine] == [s.rows for s in theirs]
    assert [s.last_pair_key for s in mine] == [s.last_pair_key for s in theirs]
    for name in ("k_cache", "v_cache"):
        assert torch.equal(program.states[name], oracle.states[name]), name
    # and a propose after the catch-up drafts the same from those rows
    pos = [s.rows + 1 for s in mine]
    got = program.propose_batch([3] * len(mine), hidden(7, len(mine)), pos, K, mine)
    assert got == oracle.propose_batch([3] * len(theirs), hidden(7, len(theirs)), pos, K, theirs)


def test_a_catchup_wider_than_the_chain_is_one_kv_only_run_and_writes_the_oracles_rows():
    """30 catch-up rows of 5 sequences (the chains' widest program has 8 rows): one padded run
    of the KV-only program at width 32 = (K + 1) x 8, not four runs of 8; the pools, row counts
    and keys equal the eager oracle's, which writes them as the one-step chain does."""
    program, oracle = make("circuit"), make("eager")
    runner, _ = program.chains.kv_only()
    assert runner.max_width == 8 * (K + 1) == 32 and program.chain_runner().max_width == 8
    seeds, lengths = [1, 2, 3, 4, 5], [6, 5, 7, 6, 6]
    states = [prefilled(program, s, length=5 + s % 4)[0] for s in seeds]
    runs = [(kind, dict(by_n)) for kind, by_n in program.stats.items()]
    g = torch.Generator().manual_seed(99)
    tokens = [torch.randint(0, CFG.vocab_size, (m,), generator=g).tolist() for m in lengths]
    first = [st.rows + 1 for st in states]
    assert program.catchup_batch(tokens, [hidden(50 + i, m) for i, m in enumerate(lengths)],
                                 first, states) == 30
    after = {(kind, n): c for kind, by_n in program.stats.items() for n, c in by_n.items()}
    before = {(kind, n): c for kind, by_n in runs for n, c in by_n.items()}
    assert {k: c - before.get(k, 0) for k, c in after.items() if c != before.get(k, 0)} \
        == {("pad", 30): 1}
    theirs = catch_up(oracle, seeds, lengths)
    assert [s.rows for s in states] == [s.rows for s in theirs]
    assert [s.last_pair_key for s in states] == [s.last_pair_key for s in theirs]
    for name in ("k_cache", "v_cache"):
        assert torch.equal(program.states[name], oracle.states[name]), name


def test_kv_only_program_equals_the_full_one_step_program_on_the_same_rows():
    """Program vs program as well: the same padded rows through both compiled circuits."""
    a, b = make("circuit"), make("circuit")
    full = compile_chain(b.circuit_draft(1), (1, 2, 4, 8), device="cpu")
    b.set_circuit_draft(full, num_drafts=1)  # b's catch-up now runs the host's full chain
    assert not b.chains.kv_only()[1] and a.chains.kv_only()[1]
    catch_up(a, [1, 2, 3], [2, 2, 1]), catch_up(b, [1, 2, 3], [2, 2, 1])
    for name in ("k_cache", "v_cache"):
        assert torch.equal(a.states[name], b.states[name]), name


def test_the_plan_report_lists_the_kv_only_family_per_width():
    p = make("circuit")
    report = p.chain_runner(1).compiled.report()
    family = report.families[KV_ONLY]
    # the chain's widths, then doubling up to a whole step's catch-up rows, (k + 1) x 8
    assert [w.width for w in family] == list(p.kv_widths) == [1, 2, 4, 8, 16, 8 * (K + 1)]
    for fw in family:
        if fw.width > 8:  # past the one-step chain's widths: the same launches over more rows
            assert fw.launches == family[3].launches and fw.bytes_moved > family[3].bytes_moved
            continue
        full = report.width(fw.width)
        assert 0 < fw.launches < full.launches and 0 < fw.bytes_moved < full.bytes_moved
        assert fw.floor_us < full.floor_us
    again = PlanReport.from_json(report.to_json())
    assert again.families == report.families
    # the k-step chain's report has no derived family, and its JSON reads as before
    k_report = p.chain_runner().compiled.report()
    assert k_report.families == {} and '"families"' not in k_report.to_json()


def test_kv_only_circuit_keeps_only_what_the_writes_read():
    p = make("eager")
    c = p.circuit_draft_kv_only().circuit
    ops = {n.op for n in c.nodes}
    assert "kv_write" in ops or "rope_kv_write" in ops
    assert not ops & {"decode_attention", "lm_head_argmax", "argmax", "silu_mul", "embed_write"}
    assert all(c.value(o).kind == "state" for o in c.outputs)
    assert {v.name for v in c.inputs_of_kind("param")} <= set(p.params)
    assert "lm_head.weight" not in {v.name for v in c.inputs_of_kind("param")}
    # the proposer's one-step chain writes the embed target too: a state write, so never dropped
    # (which is why the KV-only chain is emitted without it)
    with_target = kv_only_circuit(p.circuit_draft(1).circuit)
    assert "embed_write" in {n.op for n in with_target.nodes}


def unreturned_write():
    """A state write whose new version nobody reads, beside a returned output."""
    b = CircuitBuilder("unreturned", max_width=4)
    x = b.input("x", "float32", ("n", 8))
    tables, live = b.input("tables", "int32", ("n", 2)), b.input("live", "int32", ("n",))
    kc, vc = b.state("kc", "float32", (9, 4, 1, 4)), b.state("vc", "float32", (9, 4, 1, 4))
    wk, wo = b.param("wk", "float32", (4, 8)), b.param("wo", "float32", (8, 8))
    k = b.op1("linear", [x, wk], name="k")
    b.op("kv_write", [kc, vc, k, k, tables, live], name="kvw")
    b.output(b.op1("linear", [x, wo], name="out"), "out")
    return b.build()


def test_eliminating_outputs_never_removes_a_state_write():
    c = unreturned_write()
    kept = kv_only_circuit(c.replace(outputs=(*c.outputs, "kc")))
    assert [n.name for n in kept.nodes] == ["k", "kvw"]  # `out` went, the write stayed
    assert {v.name for v in kept.inputs_of_kind("param")} == {"wk"}  # wo pruned
    # the pass itself, with the only returned value removed: the write and what it reads stay
    from draft_circuit.circuit.passes.eliminate_dead_nodes import eliminate_dead_nodes
    live = eliminate_dead_nodes(c.replace(outputs=()))
    assert {n.name for n in live.nodes} == {"k", "kvw"}


def test_a_circuit_that_returns_no_state_has_no_kv_only_program():
    c = unreturned_write()
    with pytest.raises(PlanError, match="returns no state"):
        kv_only_circuit(c)


def test_kv_only_family_round_trips_through_compile():
    p = make("eager")
    one = p.circuit_draft(1)
    compiled = compile_draft(one.circuit, one.params, (1, 4), device="cpu")
    binding = p.circuit_draft_kv_only()
    family = compile_draft(binding.circuit, binding.params, (1, 4), device="cpu")
    before = compiled.report().to_json()
    compiled.add_family(KV_ONLY, family)
    assert compiled.report().to_json() != before
    assert [w.width for w in compiled.report().families[KV_ONLY]] == [1, 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("width", [1, 3, 4])
def test_kv_only_kernels_are_three_fused_launches_writing_the_full_steps_rows(width, dtype):
    """The KV-only circuit fuses like the full step (ops/kv_only.py): eh_proj (the runner adds
    the guard), input_layernorm + k/v in one launch and rope(k) + the paged write in one, not
    ~20 torch kernels (found on the H100 with benchmarks/engine_timeline.py). Under the Triton
    interpreter it writes bitwise the KV rows the full one-step chain's kernels write (the same
    q/k/v and rope kernels with the q part empty), at an own and a padded width."""
    _kv_only_against_full(width, 4, dtype, "cpu", CompileOptions(interpret_kernels=True))


@cuda
@pytest.mark.parametrize("width", [1, 8, 33, 64])
def test_kv_only_kernels_write_the_full_steps_rows_on_the_gpu(width):
    """bf16 on the GPU, up to n = 64 where the full step's q/k/v launch takes the wide tile and
    the KV-only one (fewer programs) the pinned one (kernels.tiles: on sm90 the tile shape does
    not change a row's bits): the KV rows are still bitwise the full step's."""
    _kv_only_against_full(width, 64, torch.bfloat16, "cuda", CompileOptions())


def _kv_only_against_full(width, program_width, dtype, device, options):
    from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
    from draft_circuit.runners.program import ProgramRunner
    from draft_circuit.runners.testing import random_draft_batch, random_mtp_weights
    from tests.ops.test_bindings import CFG as BCFG
    kv = KvLayout(num_blocks=program_width * 6 + 8, block_size=8, max_blocks_per_seq=5)
    head = MtpHead(BCFG, str(dtype).removeprefix("torch."))
    one = emit_draft_chain(head, 1, max_width=program_width, kv=kv, bitmask=False, embed_target=False)
    params = head.bind(random_mtp_weights(BCFG, seed=3, dtype=dtype, device=device))
    kv_only = kv_only_circuit(one)
    declared = lambda c: {v.name for v in c.inputs_of_kind("param")}  # noqa: E731
    compiled = {name: compile_draft(c, {k: v for k, v in params.items() if k in declared(c)},
                                    [program_width], device=device, options=options)
                for name, c in (("full", one), ("kv_only", kv_only))}
    launches = [x.kernel for x in compiled["kv_only"].programs[program_width].launches]
    assert launches == ["triton_embed_rmsnorm_linear_concat", "triton_rmsnorm_linear_kv",
                        "triton_rope_k_kv_write"], launches
    batch = random_draft_batch(BCFG, kv, width, seed=width, num_drafts=1, dtype=dtype, device=device)
    pools = {}
    n = program_width
    for name, c in compiled.items():
        states = batch.clone_states()
        runner = ProgramRunner(c, states)
        inputs = {k: v for k, v in batch.inputs.items() if k in runner.input_buffers(n)}
        pad = {k: torch.cat([v, v[-1:].expand(n - width, *v.shape[1:])]) if width < n else v
               for k, v in inputs.items()}
        if "active" in pad:
            pad["active"] = torch.cat([torch.ones(width, dtype=torch.int32, device=device),
                                       torch.zeros(n - width, dtype=torch.int32, device=device)])
        runner.run(pad)
        pools[name] = states
    for name in pools["full"]:
        assert torch.equal(pools["full"][name], pools["kv_only"][name]), name
