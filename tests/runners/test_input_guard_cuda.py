"""The in-graph input guard on the GPU (issue 19 item 1; FAULTS 20, 25; run with `-m cuda`):
the compiled Triton guard equals its reference bit for bit; through captured CUDA graphs a row
with a -1 or out-of-pool block id, a bad live_rows or a token >= vocab replays inert (every
output and the whole pool bitwise what the replay with that row made inert by hand gives, the
pool outside the good rows' own blocks untouched), `run` never raises (no sync) and
`check_faults()` raises RunnerInputError naming row, input and value, once; a valid replay is
bitwise the same with the guard off; the guard's replay allocates nothing. The uncaptured
program runner on CUDA reports through `check_faults()` alike (its `run` has no host check)."""
import pytest
import torch

from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.circuit.planner import compile_draft
from draft_circuit.ops.registry import get_op
from draft_circuit.runners.input_values import RunnerInputError
from draft_circuit.runners.testing import (assert_no_allocation, cuda, random_draft_batch,
                                           random_mtp_weights)
from tests.runners.guard_helpers import SCRATCH, assert_ran_inert, assert_reported_once, edited, inert

CFG = MtpConfig(vocab_size=1000, hidden_size=256, intermediate_size=704, num_attention_heads=8,
                num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6, rope_theta=10000.0,
                num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=4096)
KV = KvLayout(num_blocks=8 * 16 + 1, block_size=16, max_blocks_per_seq=16)
K, N = 4, 8
WIDTHS = [1, 2, 4, 8]
CASES = [  # (input, row, col, value, message)
    ("block_tables", 1, 0, -1, "row 1: block id -1 at table entry 0"),
    ("block_tables", 5, 0, KV.num_blocks, f"row 5: block id {KV.num_blocks} at table entry 0"),
    ("live_rows", 0, None, -3, "row 0: live_rows -3 must be in"),
    ("live_rows", 7, None, KV.max_rows, f"row 7: live_rows {KV.max_rows} must be in"),
    ("tokens", 2, None, -7, "row 2: token -7 is outside the vocabulary"),
    ("tokens", 3, None, CFG.vocab_size, f"row 3: token {CFG.vocab_size} is outside the vocabulary"),
]


@pytest.fixture(scope="module")
def built():
    head = MtpHead(CFG, "bfloat16")
    chain = emit_draft_chain(head, K, max_width=N, kv=KV)
    params = head.bind(random_mtp_weights(CFG, seed=1, dtype=torch.bfloat16, device="cuda"))
    return chain, params, compile_draft(chain, params, WIDTHS, device="cuda")


def _batch(seed):
    return random_draft_batch(CFG, KV, N, seed=seed, num_drafts=K, dtype=torch.bfloat16,
                              device="cuda")


def _graphs(compiled, states, guard=True):
    from draft_circuit.runners.cudagraph import GraphRunner
    return GraphRunner(compiled, states, scratch_block=SCRATCH, strict=True, guard=guard)


def _replay(runner, inputs):
    out = runner.run(inputs)
    return {k: v.clone() for k, v in out.items()}


@cuda
def test_guard_kernel_equals_reference_on_the_gpu():
    op = get_op("input_guard")
    g = torch.Generator().manual_seed(0)
    for n, m in ((1, 3), (8, 16), (64, 70), (200, 300)):
        attrs = op.parse_attrs(dict(vocab=20, num_blocks=12, block_size=4, steps=3, scratch_block=0))
        ins = [torch.randint(-3, 24, (n,), generator=g, dtype=torch.int32),
               torch.randint(-2, 14, (n, m), generator=g, dtype=torch.int32),
               torch.randint(-2, m * 4 + 2, (n,), generator=g, dtype=torch.int32),
               torch.randint(0, 2, (n,), generator=g, dtype=torch.int32)]
        ins = [t.cuda() for t in ins]
        faults = torch.zeros(8, dtype=torch.int32, device="cuda")
        want = op.reference([t.clone() for t in ins] + [faults.clone()], attrs)
        outs = [torch.empty_like(t) for t in ins] + [faults]
        op.kernels[0].launch(ins + [faults], outs, [], attrs)
        for got, exp in zip(outs, want):
            assert torch.equal(got, exp), (n, m)


@cuda
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}={c[3]}" for c in CASES])
def test_a_bad_row_replays_inert_and_is_reported(built, case):
    _, _, compiled = built
    name, row, col, value, message = case
    batch = _batch(seed=3)
    want_states = batch.clone_states()
    want = _replay(_graphs(compiled, want_states), inert(batch, row))
    states = batch.clone_states()
    before = {k: v.clone() for k, v in states.items()}
    runner = _graphs(compiled, states)
    got = _replay(runner, edited(batch, name, row, col, value))  # no sync, no raise
    torch.cuda.synchronize()
    assert_ran_inert(got, want, states, want_states, before, batch, row, kv=KV, num_drafts=K)
    assert_reported_once(runner, message, row, name, value)
    _replay(runner, batch.inputs)
    runner.check_faults()  # a valid replay after a fault records nothing


@cuda
def test_valid_replays_are_bitwise_with_the_guard_off_and_allocate_nothing(built):
    _, _, compiled = built
    batch = _batch(seed=20)
    results = []
    for guard in (True, False):
        states = batch.clone_states()
        runner = _graphs(compiled, states, guard=guard)
        outs = [_replay(runner, {k: v[:n] for k, v in batch.inputs.items()}) for n in WIDTHS]
        results.append((outs, states))
        if guard:
            assert_no_allocation(runner.run, batch.inputs)
            runner.check_faults()
    (a, sa), (b, sb) = results
    for n, x, y in zip(WIDTHS, a, b):
        for k in x:
            assert torch.equal(x[k], y[k]), (n, k)
    for k in sa:  # the guarded runner replayed N rows 4 more times: the same rows, same values
        assert torch.equal(sa[k], sb[k]), k


@cuda
def test_program_runner_on_cuda_reports_at_check_faults(built):
    from draft_circuit.runners.program import ProgramRunner
    _, _, compiled = built
    batch = _batch(seed=5)
    runner = ProgramRunner(compiled, batch.clone_states(), scratch_block=SCRATCH)
    out = runner.run(edited(batch, "block_tables", 4, 0, -1))  # no host check on CUDA
    assert out["drafts"][4].eq(-1).all()
    with pytest.raises(RunnerInputError, match="row 4: block id -1"):
        runner.check_faults()


@cuda
def test_circuit_draft_runner_and_split_plans_name_the_part(built):
    """A split width's guard sees part-relative rows: the error lists the parts' caller rows."""
    from draft_circuit.runners.draft import CircuitDraftRunner, WidthPolicy
    _, _, compiled = built
    n = 7  # split 4 + 2 + 1
    batch = random_draft_batch(CFG, KV, n, seed=6, num_drafts=K, dtype=torch.bfloat16, device="cuda")
    runner = CircuitDraftRunner(compiled, batch.clone_states(), scratch_block=SCRATCH,
                                policy=WidthPolicy(allow_padding=False))
    assert runner.plan(n).parts == ((4, 4), (2, 2), (1, 1))
    out = runner.run(n, edited(batch, "live_rows", 5, None, -1))  # caller row 5: part row 1
    assert out["drafts"][5].eq(-1).all()
    with pytest.raises(RunnerInputError, match=r"row 1: live_rows -1 .* split into parts starting "
                                               r"at caller rows 0 \(width 4\), 4 \(width 2\), 6"):
        runner.check_faults()
