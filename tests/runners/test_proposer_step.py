"""`step_batch`, the draft side of a decode step in one call (issue 14), against the calls it
stands for (after_verify_batch, last_pair_keys, catchup_batch of the states with rows,
propose_batch_on_device) made one by one: the same drafts, confidences, verify input, rows,
keys, block tables and drafter KV, bit for bit, on the compiled programs at exact, padded and
split widths, n = 1 and past SMALL_BATCH; and its refusals: a typed error naming what was
wrong with nothing changed, or None (not served) with the trims and catch-up done. On the GPU
(`-m cuda`): a loop of step_batch calls equals the host loop, allocates no device memory and
makes no host sync but its read of the drafts."""
import numpy as np
import pytest
import torch

from draft_circuit.circuit.planner import compile_draft
from draft_circuit.ops.tokens import TokenError
from draft_circuit.runners.draft import CircuitDraftRunner, WidthPolicy
from draft_circuit.runners.proposer_inputs import HiddenWidthError
from draft_circuit.runners.proposer_slots import SMALL_BATCH
from draft_circuit.runners.proposer_state import ProposerError
from draft_circuit.runners.testing import assert_no_allocation, cuda
from tests.runners.test_proposer import CFG, K, hidden, make, prefilled
from tests.runners.test_proposer_device_cuda import _sync_mode
from tests.runners.test_proposer_staging import DecodeLoop

WIDE = SMALL_BATCH + 4


def split_factory(binding):
    """Compiled runners whose k-step chain splits every width between its programs (no
    padding: 3 = 2 + 1, 5 = 4 + 1, 6 = 4 + 2, 7 = 4 + 2 + 1) and whose KV-only chain stops at
    4 rows, so a step's catch-up runs in chunks of at most 4 rows."""
    widths = (1, 2, 4) if binding.row_order else (1, 2, 4, 8)
    compiled = compile_draft(binding.circuit, binding.params, widths, device="cpu",
                             notes=binding.notes)
    return CircuitDraftRunner(compiled, binding.states, scratch_block=binding.scratch_block,
                              policy=WidthPolicy(allow_padding=binding.row_order,
                                                 allow_split=not binding.row_order))


#: (n, proposer options): exact widths, padded ones (3, 5, 7: between programs), split ones
#: (and chunked catch-ups), n = 1, and the array paths past SMALL_BATCH
CASES = [(1, {}), (3, {}), (5, {}), (8, {}), (3, {"factory": split_factory}),
         (7, {"factory": split_factory}),
         (WIDE, {"num_blocks": 8 * WIDE + 8, "max_blocks_per_seq": 8, "max_width": 32,
                 "widths": (1, 2, 4, 8, 32)})]
IDS = [f"n{n}-{'split' if 'factory' in o else 'w' + str(max(o.get('widths', (8,))))}"
       for n, o in CASES]


def _pair(n, opts):
    a, b = make("circuit", **opts), make("circuit", **opts)
    return (a, [prefilled(a, 40 + i, length=6 + i % 5)[0] for i in range(n)],
            b, [prefilled(b, 40 + i, length=6 + i % 5)[0] for i in range(n)])


def _accepted(drafts, step):
    """A spread of accept counts (0 to all of a row's kept drafts), differing step to step."""
    return [min((3 * i + step) % (K + 1), len(d)) for i, d in enumerate(drafts)]


def _same(a, sa, b, sb):
    assert [a.drafter_rows(s) for s in sa] == [b.drafter_rows(s) for s in sb]
    assert a.last_pair_keys(sa) == b.last_pair_keys(sb)
    assert [s.blocks.blocks for s in sa] == [s.blocks.blocks for s in sb]
    assert np.array_equal(a.slots.tables[[s.slot for s in sa]],
                          b.slots.tables[[s.slot for s in sb]])
    assert a.pool.num_used == b.pool.num_used
    for name in ("k_cache", "v_cache"):
        assert torch.equal(a.states[name], b.states[name]), name
    assert {k: dict(v) for k, v in a.stats.items()} == {k: dict(v) for k, v in b.stats.items()}


def read_alike(a, sa, got_a, b, sb, got_b, step):
    """Both proposers' latest device batches alike (drafts, confidences, verify input, how
    served, the drafts read back); then the step's accept counts and catch-up rows."""
    assert torch.equal(got_a[0], got_b[0]) and torch.equal(got_a[1], got_b[1])
    assert torch.equal(a.verify_tokens(), b.verify_tokens())
    assert a.last_served == b.last_served
    drafts = a.last_drafts(sa)
    assert b.last_drafts(sb) == drafts
    accepted = _accepted(drafts, step)
    return (accepted, *_catchup(drafts, accepted, step))


def _catchup(drafts, accepted, step):
    """Each state's catch-up: its accepted drafts with a target hidden each ([] and [0, H]
    for a state that accepted none)."""
    tokens = [list(d[:a]) for d, a in zip(drafts, accepted)]
    hiddens = [hidden(100 * step + i, a) if a else hidden(1, 1)[:0]
               for i, a in enumerate(accepted)]
    return tokens, hiddens


@pytest.mark.parametrize("explicit_first", [False, True])
@pytest.mark.parametrize("n,opts", CASES, ids=IDS)
def test_a_step_is_the_calls_it_stands_for(n, opts, explicit_first):
    """Several decode steps (propose, read, accept, trim, catch-up, next propose), tables
    growing across block boundaries on the way: one step_batch a step on `b`, the separate
    calls on `a`, every output and state bitwise alike after each step."""
    a, sa, b, sb = _pair(n, opts)
    if "factory" in opts:  # the plans this case means to cover
        assert a.chain_runner().plan(n).kind == "split" and a.chains.kv_only()[0].max_width == 4
    pos = [a.last_pair_key(s) + 2 for s in sa]
    last = [(5 + i) % CFG.vocab_size for i in range(n)]
    got_a = a.propose_batch_on_device(last, hidden(7, n), pos, K, sa)
    got_b = b.propose_batch_on_device(last, hidden(7, n), pos, K, sb)
    for step in range(5):
        accepted, tokens, hiddens = read_alike(a, sa, got_a, b, sb, got_b, step)
        # the next propose: each row's new last token, one past its accepted drafts
        last = [(7 * i + step) % CFG.vocab_size for i in range(n)]
        hid = hidden(200 + step, n)
        first = [p + 1 for p in pos]
        pos = [p + c + 1 for p, c in zip(pos, accepted)]
        a.after_verify_batch(accepted, sa)
        keys = a.last_pair_keys(sa)
        assert [k + 2 for k in keys] == first  # the rule the default first positions follow
        keep = [i for i, c in enumerate(accepted) if c]
        if keep:
            a.catchup_batch([tokens[i] for i in keep], [hiddens[i] for i in keep],
                            [first[i] for i in keep], [sa[i] for i in keep])
        got_a = a.propose_batch_on_device(last, hid, pos, K, sa)
        got_b = b.step_batch(accepted, tokens, hiddens, last, hid, pos, K, sb,
                             catchup_first=first if explicit_first else None)
        assert got_b is not None and got_b[0] is b.device_drafts.drafts(n, K)
        _same(a, sa, b, sb)


def test_a_step_with_nothing_to_catch_up_and_a_state_without_a_verify():
    """No state accepted anything (no catch-up run at all), and a second step_batch with no
    propose between: its trims are no-ops, as a second after_verify's are."""
    a, sa, b, sb = _pair(3, {})
    pos = [a.last_pair_key(s) + 2 for s in sa]
    a.propose_batch_on_device([3] * 3, hidden(7, 3), pos, K, sa)
    b.propose_batch_on_device([3] * 3, hidden(7, 3), pos, K, sb)
    empty = [hidden(1, 1)[:0]] * 3
    pos = [p + 1 for p in pos]
    a.after_verify_batch([0, 0, 0], sa)
    a.propose_batch_on_device([4] * 3, hidden(8, 3), pos, K, sa)
    b.step_batch([0, 0, 0], [[], [], []], empty, [4] * 3, hidden(8, 3), pos, K, sb)
    _same(a, sa, b, sb)
    assert torch.equal(a.device_drafts.drafts(3, K), b.device_drafts.drafts(3, K))


def _snapshot(p, states):
    return ([p.drafter_rows(s) for s in states], p.last_pair_keys(states),
            [s.awaiting_verify for s in states], [s.blocks.blocks for s in states],
            p.pool.num_used, p.states["k_cache"].clone(), dict(p.stats))


def _unchanged(before, after):
    *plain, k, stats = before
    *plain2, k2, stats2 = after
    assert plain == plain2 and torch.equal(k, k2) and stats == stats2


BAD = {  # what is wrong -> (the arguments' change, the error type, words the message names)
    "accept count past the drafts": (lambda a: a.update(accepted=[K + 1, 0, 0]), ProposerError,
                                     "num_accepted"),
    "accept counts a state short": (lambda a: a.update(accepted=[0, 0]), ProposerError,
                                    "2 accepted counts for 3"),
    "catch-up token outside the vocab": (lambda a: a.update(tokens=[[CFG.vocab_size], [], []]),
                                         TokenError, "sequence 0"),
    "catch-up hiddens a row short": (lambda a: a.update(tokens=[[1, 2], [], []]), ProposerError,
                                     "step_batch sequence 0: 2 tokens but 1 hiddens"),
    "catch-up lists a state short": (lambda a: a.update(tokens=[[1], []]), ProposerError,
                                     "2 token lists"),
    "catch-up first position 0": (lambda a: a.update(first=[0, 1, 1]), ProposerError,
                                  "first position"),
    "propose hiddens of another width": (
        lambda a: a.update(hid=torch.zeros(3, CFG.hidden_size + 1)), HiddenWidthError,
        "hidden_in_size"),
    "propose token outside the vocab": (lambda a: a.update(last=[-1, 3, 3]), TokenError, "row 0"),
    "propose position 0": (lambda a: a.update(pos=[0, 5, 5]), ProposerError, "row 0: position"),
    "num_drafts past the proposer's": (lambda a: a.update(k=K + 1), ProposerError, "num_drafts"),
}


@pytest.mark.parametrize("what", list(BAD))
def test_a_bad_step_is_refused_with_nothing_changed(what):
    """Every input is checked before anything changes: no trim, no catch-up row, no run, no
    block drawn; the error's type and message name what was wrong. (The separate calls would
    have trimmed before the propose's inputs were looked at.)"""
    p = make("circuit")
    states = [prefilled(p, 40 + i, length=6)[0] for i in range(3)]
    pos = [p.last_pair_key(s) + 2 for s in states]
    p.propose_batch_on_device([3] * 3, hidden(7, 3), pos, K, states)
    p.last_drafts(states)
    args = dict(accepted=[1, 0, 0], tokens=[[4], [], []],
                hiddens=[hidden(9, 1), hidden(1, 1)[:0], hidden(1, 1)[:0]],
                last=[3, 3, 3], hid=hidden(8, 3), pos=[p_ + 1 for p_ in pos], k=K, first=None)
    change, error, words = BAD[what]
    change(args)
    before = _snapshot(p, states)
    with pytest.raises(error, match=words):
        p.step_batch(args["accepted"], args["tokens"], args["hiddens"], args["last"], args["hid"],
                     args["pos"], args["k"], states, catchup_first=args["first"])
    _unchanged(before, _snapshot(p, states))
    # and the same step, corrected, then runs
    assert p.step_batch([1, 0, 0], [[4], [], []], args["hiddens"] if what != "catch-up hiddens a "
                        "row short" else [hidden(9, 1), hidden(1, 1)[:0], hidden(1, 1)[:0]],
                        [3, 3, 3], hidden(8, 3), [p_ + 1 for p_ in pos], K, states) is not None


def test_a_foreign_or_repeated_state_is_refused_by_name():
    p, other = make("circuit"), make("circuit")
    states = [prefilled(p, 40 + i, length=6)[0] for i in range(2)]
    stranger = prefilled(other, 50, length=6)[0]
    empty = hidden(1, 1)[:0]
    with pytest.raises(ProposerError, match="does not belong to this proposer"):
        p.step_batch([0, 0], [[], []], [empty, empty], [3, 3], hidden(8, 2), [7, 7], K,
                     [states[0], stranger])
    with pytest.raises(ProposerError, match="appears twice"):
        p.step_batch([0, 0], [[], []], [empty, empty], [3, 3], hidden(8, 2), [7, 7], K,
                     [states[0], states[0]])


def test_an_unserved_width_returns_none_with_the_trims_and_catch_up_done():
    """Nine states on a proposer whose chain serves up to 8: None, `last_served` refused with
    the reason, and the trims and catch-up are what the separate calls leave (whose propose
    returns None too); nothing pending, no block leaked once the states are freed."""
    n = 9
    a, sa, b, sb = _pair(n, {"num_blocks": 8 * n + 8})
    drafts = []
    for p, states in ((a, sa), (b, sb)):  # one row each proposed alone: a verify to trim
        drafts = [p.propose(3, hidden(7 + i), p.last_pair_key(s) + 2, K, s)
                  for i, s in enumerate(states)]
    accepted = _accepted(drafts, 0)
    tokens, hiddens = _catchup(drafts, accepted, 0)
    pos = [s.rows + 1 for s in sa]  # unused: a refused batch's inputs are not read
    a.after_verify_batch(accepted, sa)
    keys = a.last_pair_keys(sa)
    keep = [i for i, c in enumerate(accepted) if c]
    a.catchup_batch([tokens[i] for i in keep], [hiddens[i] for i in keep],
                    [keys[i] + 2 for i in keep], [sa[i] for i in keep])
    assert a.propose_batch_on_device([3] * n, hidden(8, n), pos, K, sa) is None
    assert b.step_batch(accepted, tokens, hiddens, [3] * n, hidden(8, n), pos, K, sb) is None
    assert b.last_served == a.last_served and b.last_served.kind == "refused"
    assert "width 9 is not served" in b.last_served.reason
    _same(a, sa, b, sb)
    assert all(s.pending is None for s in sb)
    for s in sb:
        b.free_state(s)
    assert b.pool.num_used == 0


class StepLoop(DecodeLoop):
    """DecodeLoop's steps as an engine makes them with step_batch: the drafts' read, then one
    call for the trims, the catch-up and the next propose (the batch's first propose made on
    the first step). `no_sync`: the step_batch under torch's sync debug mode "error"."""

    no_sync = False
    pos: list[int] | None = None

    def step(self):
        p, states, n = self.p, self.states, len(self.states)
        if self.pos is None:
            self.pos = [p.last_pair_key(s) + 2 for s in states]
            assert p.propose_batch_on_device([5] * n, self.hid, self.pos, K, states) is not None
        drafts = p.last_drafts(states)  # the step's one read
        self.drafts.append(drafts)
        accepted = [self.rng.randint(0, len(d)) for d in drafts]
        first = [q + 1 for q in self.pos]
        self.pos = [q + a + 1 for q, a in zip(self.pos, accepted)]
        catch, targets = self.hiddens(accepted)
        with _sync_mode(self.no_sync):
            assert p.step_batch(accepted, [d[:a] for d, a in zip(drafts, accepted)], catch,
                                [5] * n, targets, self.pos, K, states,
                                catchup_first=first) is not None

    def hiddens(self, accepted):
        """The step's catch-up hiddens (each state's accepted rows) and next targets."""
        return [h[:a] for h, a in zip(self.catch, accepted)], self.hid


def loops_agree(device, loop=None):
    """`loop` (a StepLoop class; default StepLoop) over five steps drafts, trims and catches
    up as DecodeLoop on the same seeds: drafts, the next drafts and the drafter KV alike."""
    opts = dict(num_blocks=400, max_blocks_per_seq=40, device=device)
    one, host = make("circuit", **opts), make("circuit", **opts)
    a, b = (loop or StepLoop)(one, n=4, device=device, seed=3), \
        DecodeLoop(host, n=4, device=device, seed=3)
    for _ in range(5):
        a.step(), b.step()
    assert a.drafts == b.drafts
    # the step loop has proposed once more (its next step's drafts): the host loop too
    pos = [host.last_pair_key(s) + 2 for s in b.states]
    host.propose_batch([5] * 4, b.hid, pos, K, b.states)
    assert one.last_drafts(a.states) == host.last_drafts(b.states)
    for name in ("k_cache", "v_cache"):
        assert torch.equal(one.states[name], host.states[name])


def test_the_step_loop_is_the_host_loop():
    """On CPU: this file's witness that StepLoop drafts, trims and catches up as DecodeLoop."""
    loops_agree("cpu")


@cuda
def test_the_step_loop_is_the_host_loop_on_cuda():
    loops_agree("cuda")


@cuda
def test_a_cuda_step_allocates_nothing_and_makes_no_host_sync():
    steady_cuda_steps(StepLoop)


def steady_cuda_steps(loop_class):
    """Warm steps of `loop_class` (a StepLoop) on CUDA allocate no device memory, then run
    under torch's sync debug mode "error" (no host sync but the drafts' read)."""
    p = make("circuit", device="cuda", num_blocks=400, max_blocks_per_seq=40)
    loop = loop_class(p, n=4, device="cuda")
    for _ in range(2):  # warm: slots assigned, tables staged
        loop.step()
    assert_no_allocation(loop.step, repeats=4)
    torch.cuda.synchronize()
    loop.no_sync = True
    for _ in range(4):
        loop.step()
