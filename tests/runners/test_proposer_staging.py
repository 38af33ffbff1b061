"""The steady-state host path (issue 14 step 2): propose_batch and catchup_batch build no tensor
of their own once warm (CPU: a trace of torch's tensor constructors on the proposer's frames;
GPU: no device allocation), stage straight into a compiled runner's own input buffers (which it
runs unchecked, by identity) with a handful of torch ops a call whatever n is, keep block tables
on the host rewritten only when a sequence's blocks change, and draft and write exactly what the
oracle does."""
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

import draft_circuit.runners as runners_pkg
import draft_circuit.runners.draft as draft_mod
from draft_circuit.circuit.binding import BindingError
from draft_circuit.runners.draft import CircuitDraftRunner
from draft_circuit.runners.hidden_rows import HiddenRows
from draft_circuit.runners.input_values import RunnerInputError
from draft_circuit.runners.staging import INTS, ChainStaging
from draft_circuit.runners.testing import assert_no_allocation, cuda
from tests.runners.guard_helpers import PendingFault
from tests.runners.test_proposer import CFG, K, hidden, make, prefilled

CONSTRUCTORS = ("tensor", "as_tensor", "ones", "zeros", "full", "empty", "arange", "stack",
                "cat", "ones_like", "zeros_like", "full_like", "empty_like", "empty_strided")
RUNNERS = Path(runners_pkg.__file__).parent
OWN = {RUNNERS / f for f in ("proposer.py", "proposer_inputs.py", "proposer_rows.py",
                             "proposer_state.py", "proposer_device.py", "staging.py", "chains.py",
                             "draft.py")}


class ConstructorTrace:
    """Patch torch's tensor constructors; record each call made from one of `frames`' files."""

    def __init__(self, monkeypatch, frames=OWN):
        self.calls: list[str] = []
        files = {str(f) for f in frames}
        for name in CONSTRUCTORS:
            real = getattr(torch, name)

            def traced(*args, _real=real, _name=name, **kwargs):
                caller = sys._getframe(1)
                # a call given out= writes into a tensor that exists: it builds none
                if caller.f_code.co_filename in files and kwargs.get("out") is None:
                    self.calls.append(f"torch.{_name} at {Path(caller.f_code.co_filename).name}:"
                                      f"{caller.f_lineno} in {caller.f_code.co_name}")
                return _real(*args, **kwargs)
            monkeypatch.setattr(torch, name, traced)


class DecodeLoop:
    """n sequences drafting k, verified with random acceptance, caught up on the accepted."""

    def __init__(self, p, n, device="cpu", seed=0):
        self.p, self.rng = p, random.Random(seed)
        self.states = [prefilled(p, 20 + i, length=9 + i)[0] for i in range(n)]
        self.hid = hidden(3, n).to(device)
        self.catch = [hidden(40 + i, K).to(device) for i in range(n)]
        self.drafts: list[list[list[int]]] = []

    def step(self):
        p, states = self.p, self.states
        pos = [p.last_pair_key(s) + 2 for s in states]
        drafts = p.propose_batch([5] * len(states), self.hid, pos, K, states)
        self.drafts.append(drafts)
        accepted = [self.rng.randint(0, len(d)) for d in drafts]
        for s, a in zip(states, accepted):
            p.after_verify(a, s)
        p.catchup_batch([d[:a] for d, a in zip(drafts, accepted)],
                        [h[:a] for h, a in zip(self.catch, accepted)],
                        [q + 1 for q in pos], states)


@pytest.mark.parametrize("forward", ["eager", "circuit"])
def test_steady_state_builds_no_tensor_in_the_proposers_frames(forward, monkeypatch):
    p = make(forward, num_blocks=80, max_blocks_per_seq=12)
    loop = DecodeLoop(p, n=3)
    for _ in range(2):  # warm: slots assigned, tables staged
        loop.step()
    trace = ConstructorTrace(monkeypatch)
    for _ in range(4):
        loop.step()
    assert trace.calls == []


def test_the_trace_sees_a_constructor_in_an_own_frame(monkeypatch):
    """The witness works: building a staging (which allocates its buffers) is recorded."""
    trace = ConstructorTrace(monkeypatch)
    ChainStaging(max_width=4, max_blocks=3, hidden_size=8, dtype=torch.float32, max_drafts=2,
                 scratch_block=0, device="cpu")
    assert any("staging.py" in c for c in trace.calls)


def test_staged_decode_loop_equals_the_oracle_bitwise():
    mine, oracle = make("circuit", num_blocks=80, max_blocks_per_seq=12), \
        make("eager", num_blocks=80, max_blocks_per_seq=12)
    a, b = DecodeLoop(mine, n=4, seed=5), DecodeLoop(oracle, n=4, seed=5)
    for _ in range(6):
        a.step(), b.step()
    assert a.drafts == b.drafts
    for name in ("k_cache", "v_cache"):
        assert torch.equal(mine.states[name], oracle.states[name])


def test_host_tables_are_rewritten_only_when_blocks_change():
    p = make("eager", num_blocks=80, max_blocks_per_seq=12)
    s, _ = prefilled(p, 1, length=5)  # 4 rows: one block of 8
    table = p.slots
    before = table.tables.copy()
    assert table.tables[s.slot, 0] == s.blocks.blocks[0]
    assert (table.tables[s.slot, 1:] == 0).all()  # the scratch block past its blocks
    p.catchup_batch([[1, 2]], [hidden(2, 2)], [5], [s])  # rows 4, 5: same block
    assert (table.tables == before).all()
    p.catchup_batch([[1, 2, 3]], [hidden(3, 3)], [7], [s])  # rows 6..8: a second block
    assert table.tables[s.slot, :2].tolist() == list(s.blocks.blocks)
    assert table.capacity[s.slot] == 16 and table.rows[s.slot] == 9
    handed = p.take_drafter_kv(s)  # hand the blocks to another state: its row follows them
    assert (table.tables[s.slot] == 0).all() and table.capacity[s.slot] == 0
    t = p.alloc_state()
    assert p.install_drafter_kv(t, *handed)
    p.propose(4, hidden(4), p.last_pair_key(t) + 2, K, t)
    assert table.tables[t.slot, :len(t.blocks.blocks)].tolist() == list(t.blocks.blocks)


def test_a_state_dropped_gives_its_slot_back():
    import gc
    p = make("eager")
    s, _ = prefilled(p, 1)
    slot = s.slot
    free = p.slots.free_slots
    p.free_state(s)
    del s
    gc.collect()
    assert p.slots.free_slots == free + 1
    t = p.alloc_state()  # the slot comes back empty: no rows, key, drafts or table
    assert t.slot == slot and p.drafter_rows(t) == 0 and p.last_pair_key(t) is None
    assert t.last_drafts == [] and t.pending is None and (p.slots.tables[slot] == 0).all()
    assert p.take_drafter_kv(t) is None


def test_more_states_than_slots_grow_the_table():
    from draft_circuit.runners.proposer_slots import SlotTable
    p = make("eager", num_blocks=200)
    p.slots = SlotTable(max_blocks=6, max_drafts=K, scratch_block=0, slots=2)
    states = [prefilled(p, i, length=4)[0] for i in range(5)]
    oracle = make("eager", num_blocks=200)
    theirs = [prefilled(oracle, i, length=4)[0] for i in range(5)]
    pos = [p.last_pair_key(s) + 2 for s in states]
    assert p.propose_batch([1] * 5, hidden(9, 5), pos, K, states) == \
        oracle.propose_batch([1] * 5, hidden(9, 5), pos, K, theirs)
    assert p.slots.size >= 5 and len({s.slot for s in states}) == 5
    assert [p.drafter_rows(s) for s in states] == [oracle.drafter_rows(s) for s in theirs]
    assert [s.last_drafts for s in states] == [s.last_drafts for s in theirs]


@pytest.mark.cuda
def test_steady_state_allocates_no_device_memory_on_cuda():
    p = make("circuit", device="cuda", num_blocks=400, max_blocks_per_seq=40)
    loop = DecodeLoop(p, n=4, device="cuda")
    for _ in range(2):
        loop.step()
    assert_no_allocation(loop.step, repeats=4)


def cat_calls(monkeypatch):
    """Record every torch.cat the staging makes into its buffer (out=)."""
    calls, real = [], torch.cat

    def cat(tensors, *args, **kwargs):
        if kwargs.get("out") is not None:
            calls.append(len(tensors))
        return real(tensors, *args, **kwargs)
    monkeypatch.setattr(torch, "cat", cat)
    return calls


def test_a_catch_up_of_several_sequences_stages_its_hiddens_in_one_cat(monkeypatch):
    p = make("eager", num_blocks=80, max_blocks_per_seq=12)
    states = [prefilled(p, 60 + i, length=5)[0] for i in range(3)]
    calls = cat_calls(monkeypatch)
    p.catchup_batch([[1, 2], [3], [4, 5, 6]], [hidden(1, 2), hidden(2, 1), hidden(3, 3)],
                    [5, 5, 5], states)
    assert calls == [3]  # three segments, one launch


class HostOps(TorchDispatchMode):
    """Every torch op dispatched outside the chains' programs (their `backend.execute` is
    paused): the proposer's own per-call host work, op by op."""

    def __init__(self, p):
        super().__init__()
        self.ops: list[str] = []
        self.paused = False
        for r in p.chains.runners():
            if isinstance(r, CircuitDraftRunner):
                real = r.backend.execute

                def execute(n, _real=real):
                    self.paused = True
                    try:
                        _real(n)
                    finally:
                        self.paused = False
                r.backend.execute = execute

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # detach: what Tensor.numpy() issues (the read's host view of drafts; no data moves)
        if not self.paused and func is not torch.ops.aten.detach.default:
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def steady_ops(p, n, device="cpu"):
    """Torch ops of one steady-state propose_batch and one catch-up of a row each at width n
    (each warmed at that width first, so the runner's views of it exist)."""
    states = [prefilled(p, 20 + i, length=9)[0] for i in range(n)]
    hid = hidden(3, n).to(device)
    one = [hidden(4, 1).to(device) for _ in range(n)]
    pos = [p.last_pair_key(s) + 2 for s in states]
    counts = []
    for _ in range(3):  # two warm steps, then the counted one
        mode = HostOps(p)
        with mode:
            p.propose_batch([5] * n, hid, pos, K, states)
        propose = mode.ops
        for s in states:
            p.after_verify(1, s)
        mode = HostOps(p)
        with mode:
            p.catchup_batch([[1]] * n, one, [q + 1 for q in pos], states)
        counts = [propose, mode.ops]
        pos = [p.last_pair_key(s) + 2 for s in states]
    for s in states:
        p.free_state(s)
    return counts


def test_steady_state_issues_a_few_torch_ops_whatever_n():
    """Item 4, structurally: a steady-state propose_batch issues the same few torch ops at every
    width, own or padded (3 pads to 4): the hiddens' copy and its view, no per-row op, no input
    copy of the runner's (it runs on the buffers staged in place), no pad fill; a catch-up of n
    sequences likewise (one cat of their hiddens)."""
    p = make("circuit", num_blocks=200, max_blocks_per_seq=12)
    proposes, catchups = {}, {}
    for n in (1, 2, 3, 4, 8):
        proposes[n], catchups[n] = steady_ops(p, n)
    assert all(len(ops) <= 3 for ops in proposes.values()), proposes
    assert len({len(ops) for ops in proposes.values()}) == 1, proposes
    assert all(len(ops) <= 3 for ops in catchups.values()), catchups
    assert len({len(ops) for n, ops in catchups.items() if n > 1}) == 1, catchups


def test_the_op_count_sees_per_row_work(monkeypatch):
    """The witness works: a staging that copied each row's hidden alone is counted n times."""
    from draft_circuit.runners import staging as staging_mod
    real = staging_mod.ChainStaging._stage_hiddens

    def per_row(self, region, hiddens, n, turn):
        real(self, region, hiddens, n, turn)
        for i in range(n):
            region.hidden[i].copy_(region.hidden[i])  # what a per-row staging would issue
    monkeypatch.setattr(staging_mod.ChainStaging, "_stage_hiddens", per_row)
    p = make("circuit", num_blocks=200, max_blocks_per_seq=12)
    one, eight = steady_ops(p, 1)[0], steady_ops(p, 8)[0]
    assert len(eight) - len(one) >= 7 * 2  # a view and a copy a row


def test_a_compiled_runner_runs_the_staged_buffers_without_checking_them(monkeypatch):
    """The proposer hands a compiled runner its own `staged_inputs(n)` (the very mapping: O(1)
    identity), which it runs with no shape/dtype check and no copy; any other inputs are still
    checked in full."""
    p = make("circuit", num_blocks=80, max_blocks_per_seq=12)
    loop = DecodeLoop(p, n=3)
    loop.step()
    checks, given = [], []
    real_check = draft_mod.check_inputs
    monkeypatch.setattr(draft_mod, "check_inputs", lambda c, i: checks.append(1) or real_check(c, i))
    runner = p.chain_runner(K)
    real_run = runner.run
    runner.run = lambda n, inputs: given.append((n, inputs)) or real_run(n, inputs)
    loop.step()
    assert checks == [] and given
    assert all(inputs is runner.staged_inputs(n) for n, inputs in given)
    mine = {k: v.clone() for k, v in runner.staged_inputs(3).items()}
    mine["tokens"] = mine["tokens"].long()  # not the runner's buffers: checked, refused
    with pytest.raises(BindingError, match="tokens"):
        runner.run(3, mine)
    assert checks


@pytest.mark.parametrize("picked", [False, True], ids=["tensors", "picked"])
def test_rows_past_n_stay_neutral_through_shrinking_and_unstaged_runs(picked):
    """A padded program reads the rows past n of the runner's buffers: the staging keeps them at
    their neutral values when n shrinks and after a run the proposer did not stage (which wrote
    them), and the drafts and KV stay the oracle's; also when the hiddens are rows picked from
    one tensor (HiddenRows: gathered, not copied, into the buffer)."""
    mine, oracle = make("circuit", num_blocks=120, max_blocks_per_seq=12), \
        make("eager", num_blocks=120, max_blocks_per_seq=12)
    runner = mine.chain_runner(K)
    pairs = [(prefilled(mine, 70 + i, length=9)[0], prefilled(oracle, 70 + i, length=9)[0])
             for i in range(4)]
    for step, n in enumerate((4, 3, 1, 3)):
        if step == 2:  # someone else's run over the buffers: garbage hiddens, nothing active
            theirs = {k: v.clone() for k, v in runner.staged_inputs(4).items()}
            theirs["hidden"].normal_()
            theirs["active"].zero_()
            runner.run(4, theirs)
        got = []
        source = hidden(80 + step, n + 3)
        rows = np.arange(n + 2, -1, -1, dtype=np.int64)[:n]  # reversed, past the first rows
        mine_h = HiddenRows(source, rows) if picked else source[torch.from_numpy(rows)]
        for p, states, h in ((mine, [a for a, _ in pairs[:n]], mine_h),
                             (oracle, [b for _, b in pairs[:n]], source[torch.from_numpy(rows)])):
            pos = [p.last_pair_key(s) + 2 for s in states]
            got.append(p.propose_batch([7] * n, h, pos, K, states))
            for s in states:
                p.after_verify(1, s)
        assert got[0] == got[1]
        static = runner.backend.static_inputs
        w = runner.plan(n).parts[0][0]
        assert (static["hidden"][n:w] == 0).all()
        assert (static["block_tables"][n:] == 0).all() and (static["active"][n:] == 0).all()
        for name in ("tokens", "positions", "live_rows"):
            assert (static[name][n:] == 0).all(), name
    for name in ("k_cache", "v_cache"):
        assert torch.equal(mine.states[name], oracle.states[name])


def test_the_int_inputs_are_one_region_the_staging_fills():
    """The runner's int32 inputs are views of one contiguous buffer (runners/program.py) and the
    staging writes into it (its region is the runner's, not its own)."""
    p = make("circuit")
    runner = p.chain_runner(K)
    static = runner.backend.static_inputs
    storages = {static[k].untyped_storage().data_ptr() for k in INTS}
    assert len(storages) == 1
    region = p.staging._region(runner)
    assert region is not p.staging._own and region.hidden is static["hidden"]
    assert p.staging._region(p.chain_runner(K, bitmask=True)) is p.staging._own  # its bitmask


@pytest.mark.parametrize("device_path", [False, True])
def test_a_bad_row_in_the_staged_buffers_is_named_through_the_proposer(monkeypatch, device_path):
    """The staged path skips the runner's own checks: the input guard is what catches a bad row
    (here a token the staging was made to write past the vocabulary), and the proposer's call
    raises its RunnerInputError naming row, input and value (on CPU at the end of the run; on
    a GPU at the proposer's read, test_proposer_staging_cuda)."""
    p = make("circuit", num_blocks=80, max_blocks_per_seq=12)
    states = [prefilled(p, 90 + i, length=9)[0] for i in range(3)]
    real = p.staging.inputs

    def corrupt(*args, **kwargs):
        out = real(*args, **kwargs)
        out["tokens"][1] = 10 ** 6
        return out
    monkeypatch.setattr(p.staging, "inputs", corrupt)
    pos = [p.last_pair_key(s) + 2 for s in states]
    call = p.propose_batch_on_device if device_path else p.propose_batch
    with pytest.raises(RunnerInputError, match="row 1: token 1000000") as e:
        call([5] * 3, hidden(91, 3), pos, K, states)
    assert (e.value.row, e.value.input, e.value.value) == (1, "tokens", 10 ** 6)


@cuda
def test_steady_state_stages_in_one_host_to_device_copy_on_cuda(monkeypatch):
    """On a GPU a steady-state propose_batch copies host memory to the device once (every int
    input of the run, padding included) and issues the same ops at every width, own or padded."""
    h2d = []
    real_dispatch = HostOps.__torch_dispatch__

    def dispatch(self, func, types, args=(), kwargs=None):
        if not self.paused and str(func) == "aten.copy_.default" and \
                args[0].device.type == "cuda" and args[1].device.type == "cpu":
            h2d.append(tuple(args[0].shape))
        return real_dispatch(self, func, types, args, kwargs)
    monkeypatch.setattr(HostOps, "__torch_dispatch__", dispatch)
    p = make("circuit", device="cuda", num_blocks=200, max_blocks_per_seq=12)
    counts = {}
    for n in (1, 3, 8):
        h2d.clear()
        propose, catchup = steady_ops(p, n, device="cuda")
        counts[n] = len(propose)
        assert len(h2d) == 6, h2d  # steady_ops' three proposes and three catch-ups: one each
    assert len(set(counts.values())) == 1, counts


def test_a_device_batch_raises_its_chains_fault_when_it_settles():
    """The device-resident path checks its chain's (and the catch-up chain's) input-guard
    records at the batch's one read, after recording every state: the step's read raises the
    bad row, the states are settled all the same."""
    p = make("eager", num_blocks=80, max_blocks_per_seq=12)
    states = [prefilled(p, 95 + i, length=9)[0] for i in range(2)]
    fake = PendingFault(p.chain_runner(), "row 1: token 999 is outside the vocabulary", row=1, input="tokens",
                        value=999)
    p.set_circuit_draft(fake)
    pos = [p.last_pair_key(s) + 2 for s in states]
    assert p.propose_batch_on_device([5, 6], hidden(96, 2), pos, K, states) is not None
    assert fake.checks == 0  # nothing read yet: nothing checked
    with pytest.raises(RunnerInputError, match="row 1: token 999") as e:
        p.last_drafts(states)
    assert (e.value.row, e.value.input, e.value.value) == (1, "tokens", 999)
    assert all(s.pending is None and len(s.last_drafts) == K for s in states)
    assert p.last_drafts(states) == [s.last_drafts for s in states]  # settled once, no re-raise


def corrupting(p, value=10 ** 6):
    real = p.staging.inputs

    def corrupt(*args, **kwargs):
        out = real(*args, **kwargs)
        out["tokens"][1] = value
        return out
    return corrupt


@cuda
@pytest.mark.parametrize("device_path", [False, True])
def test_a_bad_row_is_named_at_the_proposers_read_on_cuda(monkeypatch, device_path):
    """On a GPU the staged path is guarded only in the graph: a bad row runs inert and its
    record, copied beside the drafts, raises RunnerInputError naming row, input and value at
    the call's read (propose_batch) or the batch's settle (propose_batch_on_device); a bad
    catch-up row at the next propose's read."""
    p = make("circuit", device="cuda", num_blocks=80, max_blocks_per_seq=12)
    states = [prefilled(p, 90 + i, length=9)[0] for i in range(3)]
    hid = hidden(91, 3).cuda()
    pos = [p.last_pair_key(s) + 2 for s in states]
    monkeypatch.setattr(p.staging, "inputs", corrupting(p))
    with pytest.raises(RunnerInputError, match="row 1: token 1000000") as e:
        if device_path:
            p.propose_batch_on_device([5] * 3, hid, pos, K, states)
            p.last_drafts(states)
        else:
            p.propose_batch([5] * 3, hid, pos, K, states)
    assert (e.value.row, e.value.input, e.value.value) == (1, "tokens", 10 ** 6)
    monkeypatch.undo()
    for s in states:
        p.after_verify(0, s)
    pos = [p.last_pair_key(s) + 2 for s in states]
    monkeypatch.setattr(p.staging, "inputs", corrupting(p, -5))
    p.catchup_batch([[1], [2], [3]], [hidden(92, 1).cuda() for _ in states], pos, states)
    monkeypatch.undo()
    with pytest.raises(RunnerInputError, match="row 1: token -5"):
        p.propose_batch([5] * 3, hid, [q + 1 for q in pos], K, states)


def test_catch_up_checks_name_the_same_faults_after_their_fast_pass():
    """catchup_batch's checks pass in one fast pass when all is well and otherwise name the
    first bad sequence as the row-by-row loop always did; what the loop admits (a bool token,
    a tensor subclass) the fast pass hands to it and it still admits."""
    from draft_circuit.ops.tokens import TokenError
    from draft_circuit.runners.proposer_inputs import HiddenWidthError, check_catchup_counts
    from draft_circuit.runners.proposer_state import ProposerError
    states = [object(), object()]
    ok = dict(hidden_size=4, vocab=10)
    check_catchup_counts([[1, 2], [True]], [torch.zeros(2, 4), torch.nn.Parameter(torch.zeros(1, 4))],
                         [1, 3], states, **ok)
    with pytest.raises(TokenError, match="token 10 at row 1 of sequence 1"):
        check_catchup_counts([[1], [2, 10]], [torch.zeros(1, 4), torch.zeros(2, 4)], [1, 1], states, **ok)
    with pytest.raises(ProposerError, match="sequence 0: 2 tokens but 1 hiddens"):
        check_catchup_counts([[1, 2], [3]], [torch.zeros(1, 4), torch.zeros(1, 4)], [1, 1], states, **ok)
    with pytest.raises(HiddenWidthError, match="sequence 1"):
        check_catchup_counts([[1], [3]], [torch.zeros(1, 4), torch.zeros(1, 5)], [1, 1], states, **ok)
    with pytest.raises(ProposerError, match="sequence 1: first position 0"):
        check_catchup_counts([[1], [3]], [torch.zeros(1, 4), torch.zeros(1, 4)], [1, 0], states, **ok)


@pytest.mark.parametrize("width", [1, 3, 4, 8])
def test_catch_up_chunks_are_the_rows_in_order_cut_at_the_width(width):
    """catchup_chunks (its whole-sequence fast path and its split path) gives, chunk by chunk,
    exactly the rows a row-by-row construction gives: token, position, live row, owner and
    hidden, cut every `width` rows."""
    from draft_circuit.runners.proposer_chunks import catchup_chunks
    rng = random.Random(width)
    lengths = [rng.randint(0, 5) for _ in range(9)]
    tokens = [[rng.randrange(90) for _ in range(m)] for m in lengths]
    hiddens = [torch.randn(m + rng.randint(0, 1), 4) for m in lengths]  # a spare row at times
    first, bases, owners = [rng.randint(1, 50) for _ in lengths], \
        [rng.randint(0, 30) for _ in lengths], list(range(100, 100 + len(lengths)))  # slots
    rows = [(t, f + k, b + k, s, h[k]) for ts, h, f, b, s in zip(tokens, hiddens, first, bases, owners)
            for k, t in enumerate(ts)]
    chunks = catchup_chunks(tokens, hiddens, first, np.array(owners), np.array(bases), width)
    assert [len(c.tokens) for c in chunks] == \
        [min(width, len(rows) - i) for i in range(0, len(rows), width)]
    got = [(t, p, lv, s, h) for c in chunks
           for t, p, lv, s, h in zip(c.tokens.tolist(), c.positions.tolist(), c.live.tolist(),
                                     c.slots.tolist(), torch.cat(list(c.hiddens)))]
    assert len(got) == len(rows)
    for (t, p, lv, s, h), (wt, wp, wl, ws, wh) in zip(got, rows):
        assert (t, p, lv, s) == (wt, wp, wl, ws) and torch.equal(h, wh)
    assert all(c.kv_only for c in chunks)
