"""The in-graph input guard (issue 19 item 1; FAULTS 20, 25), on CPU: the guard's Triton kernel
(interpreted) equals its reference bit for bit; through the program runner (reference ops and
interpreted Triton kernels, so the bad values would reach rope_kv_write / decode_attention) and
the eager oracle, a row with a -1 or out-of-pool block id, a bad live_rows or a token outside
the vocabulary runs inert: every output equals the run with that row made inert by hand, bit
for bit, the pool is bitwise what that run leaves (nothing outside the good rows' own blocks
changes), and `check_faults()` raises RunnerInputError naming row, input and value, once."""
import pytest
import torch

from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.circuit.planner import CompileOptions, compile_draft
from draft_circuit.kernels.input_guard import COL_CHUNK, MIN_BLOCK_N, ONE_TILE, tile
from draft_circuit.ops.registry import get_op
from draft_circuit.runners.draft import CircuitDraftRunner
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.input_guard import InputGuard, check_runner_faults
from draft_circuit.runners.input_values import RunnerInputError
from draft_circuit.runners.program import ProgramRunner
from draft_circuit.runners.testing import random_draft_batch, random_mtp_weights
from tests.runners.tiny_chain import tiny_config
from tests.runners.guard_helpers import (SCRATCH, PendingFault, assert_ran_inert, assert_reported_once, edited,
                                         inert)

CFG = tiny_config()
KV = KvLayout(num_blocks=40, block_size=8, max_blocks_per_seq=4)
K, N = 3, 4
GUARD = get_op("input_guard")


@pytest.fixture(scope="module")
def chain():
    head = MtpHead(CFG)
    circuit = emit_draft_chain(head, K, max_width=N, kv=KV)
    params = head.bind(random_mtp_weights(CFG, seed=3))
    return circuit, params, {
        "program": compile_draft(circuit, params, [1, 2, 4]),
        "triton": compile_draft(circuit, params, [4], options=CompileOptions(interpret_kernels=True)),
    }


# ---- the op: kernel == reference, and the record's contract ----
def _guard_inputs(g, n, m):
    return [torch.randint(-3, 24, (n,), generator=g, dtype=torch.int32),
            torch.randint(-2, 14, (n, m), generator=g, dtype=torch.int32),
            torch.randint(-2, m * 4 + 2, (n,), generator=g, dtype=torch.int32),
            torch.randint(0, 2, (n,), generator=g, dtype=torch.int32)]


def _run_both(ins, faults, attrs):
    want = GUARD.reference([t.clone() for t in ins] + [faults.clone()], attrs)
    got_faults = faults.clone()
    outs = [torch.empty_like(t) for t in ins] + [got_faults]
    GUARD.kernels[0].launch(ins + [got_faults], outs, [], attrs)
    return outs, want


# n0 130: the column-chunked path; m 700 at n <= 8: one tile only unpadded (tile's rule)
@pytest.mark.parametrize("m,n0", [(3, 1), (70, 1), (70, 130), (700, 1)])
def test_kernel_equals_reference_bitwise(m, n0):
    g = torch.Generator().manual_seed(m)
    for trial in range(8 if n0 == 1 else 2):
        n = n0 + trial
        attrs = GUARD.parse_attrs(dict(vocab=20, num_blocks=12, block_size=4, steps=1 + trial % 3,
                                       scratch_block=2))
        faults = torch.zeros(8, dtype=torch.int32) if trial % 2 else \
            torch.tensor([0, 0, 0, 0, 0, 0, 5, 0], dtype=torch.int32)
        outs, want = _run_both(_guard_inputs(g, n, m), faults, attrs)
        for got, exp in zip(outs, want):
            assert torch.equal(got, exp), (trial, got, exp)


def test_tile_pads_rows_to_share_compiles_but_never_leaves_the_one_tile_path():
    """BLOCK_N is a constexpr: widths 1..MIN_BLOCK_N share one compile where the padded tile
    still fits ONE_TILE; a table that fits one tile unpadded always stays on that path (the
    chunked one reads the table twice, in column chunks)."""
    for m in (1, 4, 64, 256, 512, 513, 700, 1024, 4096):
        p2m = 1 << max(m - 1, 0).bit_length()
        for n in range(1, 130):
            block_n, block_m, one = tile(n, m)
            p2n = 1 << (n - 1).bit_length()
            assert one == (p2n * p2m <= ONE_TILE), (n, m)
            assert block_m == (p2m if one else COL_CHUNK), (n, m)
            assert block_n >= max(p2n, 1) and (not one or block_n * block_m <= ONE_TILE), (n, m)
            if n <= MIN_BLOCK_N and MIN_BLOCK_N * p2m <= ONE_TILE:
                assert block_n == MIN_BLOCK_N, (n, m)
    assert len({tile(n, 64) for n in range(1, MIN_BLOCK_N + 1)}) == 1


def test_record_names_the_first_fault_and_is_sticky():
    attrs = GUARD.parse_attrs(dict(vocab=20, num_blocks=12, block_size=4, steps=2, scratch_block=0))
    tokens = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    tables = torch.tensor([[1, 2, 3], [4, -1, 5], [6, 7, 12], [8, 9, 10]], dtype=torch.int32)
    live = torch.tensor([3, 5, 9, 11], dtype=torch.int32)   # row 1 uses entries 0..1, row 2 0..2
    active = torch.tensor([1, 1, 1, 0], dtype=torch.int32)  # row 3's live 11 > 12 - 2: inert, fixed
    faults = torch.zeros(8, dtype=torch.int32)
    outs, want = _run_both([tokens, tables, live, active], faults, attrs)
    assert torch.equal(outs[4], want[4])
    assert outs[4].tolist() == [3, 1, -1, 1, 4, 2, 1, 0]  # block id -1 at row 1, entry 1; 2 bad rows
    assert outs[3].tolist() == [1, 0, 0, 0] and outs[2].tolist() == [3, 0, 0, 0]
    assert outs[1][1:].eq(0).all() and torch.equal(outs[1][0], tables[0])
    # a token fault outranks a lower row's block fault; a second faulted run keeps the first record
    tokens[3] = 20
    outs, _ = _run_both([tokens, tables, live, active], torch.zeros(8, dtype=torch.int32), attrs)
    assert outs[4].tolist()[:4] == [1, 3, 20, -1]
    again, _ = _run_both([tokens, tables, live, active], outs[4], attrs)
    assert again[4].tolist()[:6] == outs[4].tolist()[:6] and again[4][6] == 2


def test_scratch_block_must_be_in_the_pool(chain):
    circuit, params, compiled = chain
    batch = random_draft_batch(CFG, KV, N, seed=1, num_drafts=K)
    with pytest.raises(ValueError, match="scratch block in the pool"):
        InputGuard.for_circuit(circuit, batch.states(), params, scratch_block=KV.num_blocks,
                               device=torch.device("cpu"), select_for="cpu")


# ---- through the runners ----
CASES = [  # (input, row, col, value, message)
    ("block_tables", 1, 0, -1, "row 1: block id -1 at table entry 0"),
    ("block_tables", 2, 0, 40, "row 2: block id 40 at table entry 0 .* outside the pool"),
    ("live_rows", 0, None, -1, "row 0: live_rows -1 must be in 0..29"),
    ("live_rows", 3, None, 30, "row 3: live_rows 30 must be in 0..29"),
    ("tokens", 1, None, -7, r"row 1: token -7 is outside the vocabulary \[0, 150\)"),
    ("tokens", 2, None, 150, "row 2: token 150 is outside the vocabulary"),
]


def _runner(kind, chain, states):
    circuit, params, compiled = chain
    if kind == "eager":
        eager = EagerRunner(circuit, params, states)
        return eager, lambda inputs: eager.run(inputs, defer_faults=True)
    program = ProgramRunner(compiled[kind], states)

    def run(inputs):  # execute, not run: on CPU run() refuses bad values on the host first
        program.copy_in(N, inputs)
        program.execute(N)
        return {k: v.clone() for k, v in program.output_buffers(N).items()}
    return program, run


@pytest.mark.parametrize("kind", ["program", "eager", "triton"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}={c[3]}" for c in CASES])
def test_a_bad_row_runs_inert_and_is_reported(chain, kind, case):
    if kind == "triton" and case[0] == "tokens":
        pytest.skip("the embedding has no Triton kernel: the program cases cover tokens")
    name, row, col, value, message = case
    batch = random_draft_batch(CFG, KV, N, seed=7, num_drafts=K)
    want_states = batch.clone_states()
    _, run_want = _runner(kind, chain, want_states)
    want = run_want(inert(batch, row))
    states = batch.clone_states()
    before = {k: v.clone() for k, v in states.items()}
    runner, run = _runner(kind, chain, states)
    got = run(edited(batch, name, row, col, value))
    assert_ran_inert(got, want, states, want_states, before, batch, row, kv=KV, num_drafts=K)
    err = assert_reported_once(runner, message, row, name, value)
    assert "input guard in a 4-row run" in str(err)


def test_eager_run_raises_after_the_run_by_default(chain):
    circuit, params, _ = chain
    batch = random_draft_batch(CFG, KV, N, seed=9, num_drafts=K)
    eager = EagerRunner(circuit, params, batch.clone_states())
    with pytest.raises(RunnerInputError, match="row 2: block id -1"):
        eager.run(edited(batch, "block_tables", 2, 0, -1))
    eager.run(batch.inputs)  # nothing left pending


def test_inert_rows_out_of_range_are_fixed_without_a_fault(chain):
    """An inactive row drafts nothing, so its out-of-range values are no error; the guard still
    points its table at scratch so no kernel reads through it."""
    batch = random_draft_batch(CFG, KV, N, seed=11, num_drafts=K)
    inputs = edited(batch, "active", 1, None, 0)
    inputs["live_rows"][1] = 10_000
    inputs["block_tables"][1] = -5
    states = batch.clone_states()
    runner, run = _runner("program", chain, states)
    out = run(inputs)
    runner.check_faults()
    assert out["drafts"][1].eq(-1).all()


def test_guard_leaves_valid_runs_bitwise_and_is_one_launch_per_run(chain):
    _, _, compiled = chain
    batch = random_draft_batch(CFG, KV, N, seed=5, num_drafts=K)
    outs = []
    for guard in (True, False):
        states = batch.clone_states()
        runner = ProgramRunner(compiled["program"], states, guard=guard)
        outs.append(({k: v.clone() for k, v in runner.run(batch.inputs).items()}, states))
        if guard:  # one launch per run, before the chain's own (its k steps add none)
            bound = runner._bound[N]
            assert [x.op for x in bound].count("input_guard") == 1 and bound[0].op == "input_guard"
            assert len(bound) == len(compiled["program"].programs[N].launches) + 1
        else:
            assert runner.guard is None
    (a, sa), (b, sb) = outs
    assert all(torch.equal(a[k], b[k]) for k in a) and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_circuit_draft_runner_on_cpu_raises_at_the_end_of_run(chain):
    """The compiled runner copies into the backend's buffers and executes (no host check on
    the way): on CPU it reads the guard's record after the run, where that costs no sync."""
    _, _, compiled = chain
    batch = random_draft_batch(CFG, KV, N, seed=13, num_drafts=K)
    runner = CircuitDraftRunner(compiled["program"], batch.clone_states(), scratch_block=SCRATCH)
    with pytest.raises(RunnerInputError, match="row 3: live_rows -4") as err:
        runner.run(N, edited(batch, "live_rows", 3, None, -4))
    assert err.value.input == "live_rows"
    check_runner_faults(runner)  # cleared
    runner.run(N, batch.inputs)


# ---- the proposer reads its chain's record where it syncs ----
def test_the_proposer_checks_its_chain_after_it_syncs():
    from draft_circuit.runners.proposer import MtpProposer
    head = MtpHead(CFG)
    p = MtpProposer(head, head.bind(random_mtp_weights(CFG, seed=11)), num_drafts=K, num_blocks=40,
                    block_size=8, max_blocks_per_seq=6, max_width=4, widths=(1, 2, 4),
                    forward="eager")
    states = [p.alloc_state() for _ in range(2)]
    for i, s in enumerate(states):
        p.prefill_drafter([3, 4, 5, 6], torch.randn(4, CFG.hidden_size), s)
    fake = PendingFault(p.chain_runner(), "row 0: block id -1 at table entry 0", row=0, input="block_tables", value=-1)
    p.set_circuit_draft(fake)
    with pytest.raises(RunnerInputError, match="row 0: block id -1"):
        p.propose_batch([7, 8], torch.randn(2, CFG.hidden_size), [4, 4], K, states)
    assert fake.checks == 1
    p.check_faults()  # cleared; every held runner is checked
    assert fake.checks == 2
    with pytest.raises(RunnerInputError):
        p.propose(9, torch.randn(CFG.hidden_size), 4, K, states[0])
