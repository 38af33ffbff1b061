"""The engine's device path drafting each next step ahead (issue 14 item 4): at a step's end,
when the next batch is known to be this one's unfinished sequences, the trims, the catch-up and
the next propose are one `MtpProposer.step_batch` call whose verify input the next step
verifies as it is (examples/engine/draft_side.py). On CPU (`Engine.device_drafts = True`):

- token-exact with target-only greedy, and the same drafts (every target pass's input, bit for
  bit) and statistics as the separate calls (`Engine.propose_ahead = False`), over runs where
  sequences finish at different steps, requests are admitted mid-run, widths are declined,
  chains stop early, the trim rule is not exact-KV, and max_new_tokens / num_drafts are small;
- the catch-up rows it gives step_batch start where the separate calls find them
  (`last_pair_key` + 2 after the trim);
- a steady step is one step_batch and one read of the drafts;
- drafts proposed ahead for a batch that then changes (a request added between steps) are
  withdrawn: settled, their rows dropped, no block leaked, the drafts after it as if they had
  never been proposed.
On the GPU (`-m cuda`) the same path is CUDA's default: the last test here runs it against the
separate calls there, and tests/examples/test_engine_device_cuda.py holds it to greedy."""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

import examples.engine.engine as engine_module
from examples.engine import draft_side
from examples.engine import Engine, EngineConfig, Request, load_checkpoint
from draft_circuit.runners.hidden_rows import HiddenRows
from draft_circuit.runners.proposer import MtpProposer
from draft_circuit.runners.testing import cuda
from tests.examples.helpers import SMALL, generate, random_requests

# more requests than batch slots and varied lengths: finishes at different steps, admissions
REQUESTS = random_requests(SMALL.vocab_size, 7, seed=11)
# the edges: max_new_tokens 1 (done at the prefill), 2 (one decode step), fewer tokens left than
# drafts, one-token prompts (no prefill rows for the drafter)
EDGES = [Request([5], 1), Request([7, 9, 11], 2), Request([3], 3), Request([1, 2], 9),
         Request([4, 4, 4, 4], 1), Request([8], 12)]
CALLS = ("propose_batch", "propose_batch_on_device", "last_drafts", "after_verify_batch",
         "last_pair_keys", "catchup_batch", "step_batch", "step_ahead")


def run(path, requests, *, ahead: bool, before_read: bool = True, **config):
    """(outputs, engine, every target pass's input tokens) of one generate on the device path.
    `before_read`: draft ahead before the verify's read (`step_ahead`) where the proposer can."""
    engine = Engine(load_checkpoint(path), EngineConfig(**config))
    engine.device_drafts, engine.propose_ahead = True, ahead
    engine.draft_before_read = before_read
    passes: list[list[int]] = []
    launch = engine.target.model.launch  # every pass (forward reads what it launches)

    def recorded(rows):
        passes.append(rows.tokens.tolist())
        return launch(rows)
    engine.target.model.launch = recorded
    outputs = engine.generate(requests).outputs
    assert engine._ahead is None  # nothing proposed ahead outlives the run
    assert engine.pool.num_used == 0 and engine.proposer.pool.num_used == 0
    assert engine.proposer.slots.num_pending == 0
    return outputs, engine, passes


def count_calls(engine, monkeypatch) -> Counter:
    p, calls = engine.proposer, Counter()
    for name in CALLS:
        real = getattr(p, name)
        monkeypatch.setattr(p, name, lambda *a, _n=name, _r=real, **kw: calls.update([_n]) or _r(*a, **kw))
    return calls


CASES = {  # name: (requests, engine config)
    "k3": (REQUESTS, dict(forward="circuit", num_drafts=3, widths=(1, 2, 4), max_batch=3)),
    "k1": (REQUESTS, dict(forward="circuit", num_drafts=1, widths=(1, 2, 4), max_batch=4)),
    "stops": (REQUESTS, dict(forward="circuit", num_drafts=4, draft_confidence_stop=0.2,
                             widths=(1, 2, 4), max_batch=3)),
    "declined": (REQUESTS, dict(forward="circuit", num_drafts=3, widths=(1, 2), max_batch=4)),
    "eager": (REQUESTS, dict(forward="eager", num_drafts=2, max_batch=2)),
    "inexact": (REQUESTS, dict(forward="circuit", num_drafts=3, kv_exact=False, max_batch=3,
                               widths=(1, 2, 4))),
    "refeed": (REQUESTS, dict(forward="circuit", num_drafts=3, kv_exact=False, refeed=True,
                              max_batch=3, widths=(1, 2, 4))),
    "edges": (EDGES, dict(forward="circuit", num_drafts=6, widths=(1, 2, 4), max_batch=3)),
    "edges_k1": (EDGES, dict(forward="circuit", num_drafts=1, widths=(1, 2, 4), max_batch=8)),
}
_GREEDY: dict[int, list[list[int]]] = {}


def greedy(path, requests):
    if id(requests) not in _GREEDY:
        _GREEDY[id(requests)] = generate(path, requests, speculate=False, max_batch=3)[0]
    return _GREEDY[id(requests)]


def used(stats) -> dict[int, int]:
    """The draft batches a run used, per width verified: those served, less those drafted ahead
    and withdrawn, with those narrowed to their unfinished sequences counted at the width they
    verified (the separate calls drafted those sequences at that width, maybe as another kind:
    so widths only)."""
    d, out = stats.draft_batches, Counter()
    for n, per in d.table().items():
        out[n] += sum(c - d.withdrawn[kind][n] for kind, c in per.items())
    for per in d.narrowed.values():
        for (n, m), c in per.items():
            out[n] -= c
            out[m] += c
    return {n: c for n, c in sorted(out.items()) if c}


def widths(table: dict[int, dict[str, int]]) -> dict[int, int]:
    return {n: sum(per.values()) for n, per in table.items()}


@pytest.mark.parametrize("before_read", [True, False])
@pytest.mark.parametrize("case", list(CASES))
def test_drafting_ahead_equals_greedy_and_the_separate_calls(small_checkpoint, monkeypatch, case,
                                                             before_read):
    requests, config = CASES[case]
    outputs, engine, passes = run(small_checkpoint, requests, ahead=True, before_read=before_read,
                                  **config)
    assert outputs == greedy(small_checkpoint, requests)
    base_out, base, base_passes = run(small_checkpoint, requests, ahead=False, **config)
    assert outputs == base_out
    assert passes == base_passes  # every draft of every step, bit for bit
    a, b = engine.stats, base.stats
    assert (a.steps, a.verifies, a.drafted, a.accepted, a.widths) == \
        (b.steps, b.verifies, b.drafted, b.accepted, b.widths)
    assert used(a) == widths(b.draft_batches.table()) and not b.draft_batches.withdrawn
    # the path was taken (counted on a third run)
    engine = Engine(load_checkpoint(small_checkpoint), EngineConfig(**config))
    engine.device_drafts, engine.draft_before_read = True, before_read
    calls = count_calls(engine, monkeypatch)
    assert engine.generate(requests).outputs == outputs
    exact = config.get("kv_exact", True) and not config.get("refeed", False)
    assert calls["step_ahead" if before_read and exact else "step_batch"] > 0


def forced_accept(drafts: list[int], target_tokens: list[int]) -> int:
    """An acceptance count that varies step to step, up to every draft, whatever the target
    says: random heads accept almost nothing, and the catch-up of accepted rows is what the
    trim rules and first positions change. The output is no longer greedy's, but both paths
    take it alike, so they must still agree bit for bit."""
    return (sum(drafts) + 7 * len(target_tokens)) % (len(drafts) + 1)


@pytest.mark.parametrize("case", ["k3", "stops", "inexact", "refeed", "edges"])
def test_forced_acceptance_ahead_equals_the_separate_calls(small_checkpoint, monkeypatch, case):
    """(Read first: a forced count is the host's alone; drafting before the read counts on the
    device by the real rule, tests/runners/test_proposer_ahead.py holds it to a spread of
    counts.)"""
    monkeypatch.setattr(engine_module, "accept", forced_accept)
    requests, config = CASES[case]
    outputs, engine, passes = run(small_checkpoint, requests, ahead=True, before_read=False,
                                  **config)
    assert engine.stats.accepted > engine.stats.verifies // 2
    assert (outputs, passes) == run(small_checkpoint, requests, ahead=False, **config)[::2]


@pytest.mark.parametrize("force", [False, True])
@pytest.mark.parametrize("case", ["k3", "stops", "inexact", "refeed", "edges"])
def test_catch_up_rows_start_where_the_separate_calls_find_them(small_checkpoint, monkeypatch,
                                                                case, force):
    """step_batch stood in for by the calls it stands for, checking on the way that the first
    catch-up position the engine gives (from `key_after_verify`) is `last_pair_key` + 2 after the
    trim, and that every catch-up token is the sequence's token at its position."""
    requests, config = CASES[case]
    if force:
        monkeypatch.setattr(engine_module, "accept", forced_accept)
    engine = Engine(load_checkpoint(small_checkpoint), EngineConfig(**config))
    engine.device_drafts, engine.draft_before_read = True, False  # step_batch's rows
    p, checked = engine.proposer, []

    def separately(accepted, tokens, hiddens, last, hid, positions, k, states, *, catchup_first):
        p.after_verify_batch(accepted, states)
        assert [key + 2 for key in p.last_pair_keys(states)] == list(catchup_first)
        seqs = {id(s.draft_state): s for s in engine.scheduler.running}
        if isinstance(hiddens, HiddenRows):  # the engine's pick of the verify's rows: per sequence
            ends = np.add.accumulate([0, *map(len, tokens)])
            hiddens = [hiddens.source[torch.from_numpy(hiddens.rows[lo:hi])]
                       for lo, hi in zip(ends, ends[1:])]
        for ts, hs, first, state in zip(tokens, hiddens, catchup_first, states):
            assert ts == seqs[id(state)].tokens[first:first + len(ts)] and len(hs) == len(ts)
        keep = [i for i, ts in enumerate(tokens) if ts]
        if keep:
            p.catchup_batch([tokens[i] for i in keep], [hiddens[i] for i in keep],
                            [catchup_first[i] for i in keep], [states[i] for i in keep])
        checked.append(len(states))
        return p.propose_batch_on_device(last, hid, positions, k, states)
    monkeypatch.setattr(p, "step_batch", separately)
    outputs = engine.generate(requests).outputs
    assert force or outputs == greedy(small_checkpoint, requests)
    assert checked


@pytest.mark.parametrize("ahead,before_read,narrow,steady,last", [
    (True, True, True, {"step_ahead": 1}, {"step_ahead": 1}),
    (True, True, False, {"step_ahead": 1}, {"step_ahead": 1}),
    (True, False, True, {"last_drafts": 1, "step_batch": 1}, {"last_drafts": 1}),
    (False, False, True, {"propose_batch_on_device": 1, "last_drafts": 1,
                          "after_verify_batch": 1, "last_pair_keys": 1},
     {"propose_batch_on_device": 1, "last_drafts": 1}),
])
def test_a_steady_step_is_one_step_batch_and_one_read(small_checkpoint, monkeypatch, ahead,
                                                      before_read, narrow, steady, last):
    """Three requests, three slots: after the first step (its prefill's catch-up and its own
    propose) every step but the last is the steady one; the last (every sequence done) reads
    the drafts and has nothing left to trim or draft. Drafting before the read, a steady step
    is one `step_ahead` (the drafts' read is inside it), and the last one's drafts, proposed
    before the step knew every sequence would finish, are withdrawn (counted; every state was
    freed with its sequence, so there is nothing to read or hand back).
    A step whose sequence finishes, and the one after it, are steady ones too where the rest's
    drafts are kept (`narrow_ahead`): the next step verifies them as proposed and step_ahead
    serves the batch's rows still waiting (`proposer_ahead.kept_rows`). Without
    `narrow_ahead` the drafts are withdrawn (a `last_drafts` read) and the next step drafts
    for itself before its verify. The separate calls' steps,
    for contrast (their catchup_batch runs only on a step that accepted a draft: with exact KV
    no row is missing otherwise)."""
    requests = [Request(r.prompt, 12 + 3 * i) for i, r in enumerate(REQUESTS[:3])]
    engine = Engine(load_checkpoint(small_checkpoint),
                    EngineConfig(forward="circuit", num_drafts=3, widths=(1, 2, 4), max_batch=3))
    engine.device_drafts, engine.propose_ahead = True, ahead
    engine.draft_before_read, engine.narrow_ahead = before_read, narrow
    calls = count_calls(engine, monkeypatch)
    per_step: list[dict[str, int]] = []

    def on_step(_):
        per_step.append(dict(calls))
        calls.clear()
    assert engine.generate(requests, on_step=on_step).outputs == greedy(small_checkpoint, requests)
    first, *middle, final = per_step
    if not ahead:
        middle = [{k: v for k, v in step.items() if k != "catchup_batch"} for step in middle]
    if before_read and not narrow:  # a step whose sequence finishes withdraws the drafts made before its
        # read (a last_drafts), and the next step drafts for itself first
        finishes = [i for i, step in enumerate(middle) if step != steady]
        assert [middle[i] for i in finishes] == [
            {"step_ahead": 1, "last_drafts": 1}, {"propose_batch_on_device": 1, "step_ahead": 1}
        ] * (len(finishes) // 2) and len(finishes) == 4, middle
        middle = [step for i, step in enumerate(middle) if i not in finishes]
    assert middle and all(step == steady for step in middle), middle
    assert first["catchup_batch"] >= 1 and first["propose_batch_on_device"] == 1
    assert final == last


@pytest.mark.parametrize("before_read", [False, True])
def test_drafts_for_a_batch_that_changed_are_withdrawn(small_checkpoint, monkeypatch, before_read):
    """A request added between two steps (outside `generate`) joins the next batch; where its
    prompt prefills in a pass of its own (merge_prefill off), the drafts proposed ahead for the
    old batch are withdrawn: the states hold nothing pending and await no verify after it, no
    block leaks, and every later draft is the separate calls' (a withdrawal that left a row
    behind would change the drafter's attention). Merged into the verify (the default), the
    old batch verifies its drafts as proposed and nothing is withdrawn for the admission."""
    config = dict(forward="circuit", num_drafts=3, widths=(1, 2, 4), max_batch=4)
    late = Request(REQUESTS[5].prompt, 9)

    def drive(ahead: bool, before_read: bool, merge: bool = False):
        engine = Engine(load_checkpoint(small_checkpoint), EngineConfig(**config))
        engine.device_drafts, engine.propose_ahead = True, ahead
        engine.draft_before_read, engine.merge_prefill = before_read, merge
        passes, launch = [], engine.target.model.launch
        engine.target.model.launch = lambda rows: passes.append(rows.tokens.tolist()) or launch(rows)
        seqs = [engine.scheduler.add(r) for r in REQUESTS[:2]]
        for step in range(40):
            if step == 3:
                assert (engine._ahead is not None) == ahead
                seqs.append(engine.scheduler.add(late))
                before = len(withdrawn)
            if not engine.scheduler.has_work:
                break
            engine.step()
            if step == 3:
                at_admission.append(withdrawn[before:])
        assert not engine.scheduler.has_work and engine._ahead is None
        assert engine.pool.num_used == 0 and engine.proposer.pool.num_used == 0
        return [s.generated for s in seqs], passes

    at_admission: list[list[int]] = []  # what the admission's step withdrew, a run
    withdrawn, real = [], engine_module.withdraw

    def spy(proposer, ahead, stats=None):
        real(proposer, ahead, stats)
        states = [s.draft_state for s in ahead.seqs if not s.finished]
        assert proposer.slots.num_pending == 0
        assert not any(s.awaiting_verify for s in states)
        withdrawn.append(len(ahead.seqs))
    monkeypatch.setattr(engine_module, "withdraw", spy)  # the engine's call and end_step's
    monkeypatch.setattr(draft_side, "withdraw", spy)
    outputs, passes = drive(True, before_read)
    # before the read, a step whose sequence finishes withdraws its drafts too
    assert withdrawn == [2] if not before_read else 2 in withdrawn
    requests = [*REQUESTS[:2], late]
    assert outputs == generate(small_checkpoint, requests, speculate=False, max_batch=3)[0]
    assert (outputs, passes) == drive(False, False)
    assert at_admission[0] == [2]  # the old batch's two drafts, proposed ahead
    at_admission.clear()
    assert drive(True, before_read, merge=True)[0] == outputs
    assert at_admission == [[]]  # verified as proposed, the prompt beside them


@cuda
@pytest.mark.parametrize("force", [False, True])
def test_drafting_ahead_on_the_gpu_equals_the_separate_calls(small_checkpoint, monkeypatch,
                                                             force):
    """CUDA's default decode step drafts ahead too: greedy's outputs (unforced), the separate
    calls' target-pass inputs bit for bit, step_batch taken, nothing leaked."""
    config = dict(device="cuda", max_rows=64, forward="circuit", num_drafts=3,
                  widths=(1, 2, 4), max_batch=3)
    if force:  # a forced count is the host's: read first (step_batch)
        monkeypatch.setattr(engine_module, "accept", forced_accept)
    outputs, engine, passes = run(small_checkpoint, REQUESTS, ahead=True, before_read=not force,
                                  **config)
    assert (outputs, passes) == run(small_checkpoint, REQUESTS, ahead=False, **config)[::2]
    if not force:
        assert outputs == generate(small_checkpoint, REQUESTS, speculate=False, max_batch=3,
                                   device="cuda", max_rows=64)[0]
    engine = Engine(load_checkpoint(small_checkpoint), EngineConfig(**config))
    assert engine.device_drafts is None and engine._on_device(3)  # CUDA's default
    engine.draft_before_read = not force
    calls = count_calls(engine, monkeypatch)
    assert engine.generate(REQUESTS).outputs == outputs
    assert calls["step_batch" if force else "step_ahead"] > 0


@pytest.mark.parametrize("before_read", [False, True])
def test_a_draft_side_that_raises_leaves_the_sequences_consistent(small_checkpoint, monkeypatch,
                                                                   before_read):
    """Review regression: the step's target KV rows and statistics are accounted after the draft
    side's launch; when the draft side raises they are still accounted, so every running
    sequence keeps the engine's invariant (the target's KV holds every token but the last).
    Drafting before the read, the draft side raises before anything is appended: the verify's
    KV rows lie past every sequence's cached rows (dead, as a rejected row's)."""
    engine = Engine(load_checkpoint(small_checkpoint), EngineConfig(max_batch=3, num_drafts=3))
    engine.device_drafts, engine.draft_before_read = True, before_read
    for r in REQUESTS[:3]:
        engine.scheduler.add(r)
    engine.step()  # the prefill and a first step
    calls = {"n": 0}

    def broken(*args, **kwargs):
        calls["n"] += 1
        raise RuntimeError("draft side down")
    if before_read:
        monkeypatch.setattr(engine.proposer, "step_ahead", broken)
    else:
        monkeypatch.setattr(engine_module, "end_step", broken)
    with pytest.raises(RuntimeError, match="draft side down"):
        while engine.scheduler.has_work:
            engine.step()
    assert calls["n"] == 1
    for s in engine.scheduler.running:
        assert s.num_cached == len(s.tokens) - 1, s.id
    assert engine.stats.generated > 0 and engine.stats.verifies > 0 or before_read


@pytest.mark.parametrize("case", ["k3", "inexact", "refeed", "edges"])
def test_the_steady_step_picks_the_verifys_rows(small_checkpoint, monkeypatch, case):
    """Both hiddens of a steady step_batch are rows of the verify's one tensor picked by index
    (HiddenRows: one gather on the device, no view or stack a sequence); a step whose catch-up
    reaches back to the hidden before the verify's rows (the inexact and refeed trim rules
    re-feed a row from there) hands tensors instead. Either way the run is the separate
    calls' bit for bit (their catch-up hands tensors)."""
    requests, config = CASES[case]
    monkeypatch.setattr(engine_module, "accept", forced_accept)  # rows to catch up every step
    kinds = Counter[tuple[bool, bool]]()
    real = MtpProposer.step_batch

    def recorded(self, accepted, tokens, hiddens, last, hid, *args, **kwargs):
        kinds[isinstance(hiddens, HiddenRows), isinstance(hid, HiddenRows)] += 1
        if isinstance(hiddens, HiddenRows):  # a pick is exactly the catch-up's rows
            assert len(hiddens.rows) == sum(map(len, tokens))
            assert hiddens.source is hid.source  # both from the one verify pass
        return real(self, accepted, tokens, hiddens, last, hid, *args, **kwargs)
    monkeypatch.setattr(MtpProposer, "step_batch", recorded)
    outputs, _, passes = run(small_checkpoint, requests, ahead=True, before_read=False, **config)
    assert kinds[True, True] > 0, kinds
    if case in ("inexact", "refeed"):  # both ways within the run
        assert kinds[False, False] > 0, kinds
    assert set(kinds) <= {(True, True), (False, False)}, kinds
    assert (outputs, passes) == run(small_checkpoint, requests, ahead=False, **config)[::2]


def test_a_finished_sequence_lets_go_of_its_pass_hiddens(small_checkpoint, monkeypatch):
    """A sequence keeps its pass's whole hidden tensor (hidden_src) while it decodes; once
    finished it holds none, so a long batch does not keep every finished request's pass alive."""
    requests, config = CASES["k3"]
    finished = []
    real = Engine._finish

    def recorded(self, seq):
        assert seq.hidden_src is not None  # it decoded from one
        real(self, seq)
        finished.append((seq.hidden_src, seq.hidden))
    monkeypatch.setattr(Engine, "_finish", recorded)
    Engine(load_checkpoint(small_checkpoint), EngineConfig(**config)).generate(requests)
    assert finished and all(src is None and h is None for src, h in finished)


def test_the_summary_counts_withdrawn_batches(small_checkpoint):
    """Drafts proposed before a step's read for sequences of which some then finished are
    withdrawn (all finished) or narrowed to the rest (`draft_side.narrowed`): the summary reports
    both per width (JSON and text), out of the batches drafted."""
    from examples.engine.report import format_summary, summary
    requests, config = CASES["k3"]
    engine = Engine(load_checkpoint(small_checkpoint), EngineConfig(**config))
    engine.device_drafts, engine.draft_before_read = True, True
    result = engine.generate(requests)
    d, stats = summary(engine, result), engine.stats.draft_batches
    for key, counted, text in (("withdrawn_batches", stats.withdrawn, "withdrawn unused"),
                               ("narrowed_batches", stats.narrowed, "verified for fewer")):
        assert d[key] and sum(d[key].values()) == \
            sum(c for per in counted.values() for c in per.values()), key
        for n, c in d[key].items():
            assert c <= sum(d["draft_batches"][n].values())
        assert text in format_summary(d)


def forced_greedy(engine, k: int):
    """Patch the engine's target so each verify accepts a spread of its drafts (row i of the
    pass takes its first a_i drafts as the target's tokens, a_i varying step to step): the same
    "target" for both paths, so drafting before the read (which counts on the device) and
    reading first must give the same outputs and the same target passes, with catch-ups of
    1..k rows on the way (random heads alone accept almost nothing)."""
    launch, seen = engine.target.model.launch, [0]
    # the verify the runner launches next: its tokens (the proposer's buffer, or the rows of
    # it a finish left, `draft_side.narrowed`); a merged pass's are another buffer, not forced
    verifying: list[torch.Tensor | None] = [None]
    launch_verify = engine.target.launch_verify

    def marked(seqs, tokens, num_drafts, prefill=()):
        verifying[0] = None if prefill else tokens
        return launch_verify(seqs, tokens, num_drafts, prefill)
    engine.target.launch_verify = marked

    def forced(rows):
        tokens, hidden = launch(rows)
        verify, verifying[0] = verifying[0], None
        if verify is not None and rows.tokens.data_ptr() == verify.data_ptr():
            n = rows.tokens.shape[0] // (k + 1)
            g, v = tokens.clone().view(n, k + 1), rows.tokens.view(n, k + 1)
            for i in range(n):
                seen[0] += 1
                for j in range((7 * seen[0]) % (k + 1)):
                    if int(v[i, j + 1]) == 0:  # a stopped row's padding
                        break
                    g[i, j] = v[i, j + 1]
            tokens = g.view(-1)
        return tokens, hidden
    engine.target.model.launch = forced


@pytest.mark.parametrize("tau", [None, 0.2])
def test_drafting_before_the_read_with_accepted_drafts(small_checkpoint, tau):
    config = dict(forward="circuit", num_drafts=3, widths=(1, 2, 4), max_batch=3,
                  draft_confidence_stop=tau)
    got = []
    for before_read in (True, False):
        engine = Engine(load_checkpoint(small_checkpoint), EngineConfig(**config))
        engine.device_drafts, engine.draft_before_read = True, before_read
        forced_greedy(engine, 3)
        passes, launch = [], engine.target.model.launch
        engine.target.model.launch = lambda rows: passes.append(rows.tokens.tolist()) or launch(rows)
        outputs = engine.generate(REQUESTS).outputs
        assert engine.proposer.pool.num_used == 0 and engine.pool.num_used == 0
        got.append((outputs, passes, engine.stats.accepted, engine.stats.steps))
        if before_read:
            assert engine.stats.draft_batches.batches and engine.stats.accepted > engine.stats.steps
    assert got[0] == got[1]


def test_an_exact_pool_finishes_drafting_before_the_read(small_checkpoint):
    """--kv-blocks at exactly what the request check asks: near a request's end the worst case
    step_ahead grows for (every draft accepted) needs a block the pool lacks, so it declines
    and that step reads first; the output is greedy's."""
    requests = [Request([1, 2, 3], 5), Request([7, 8, 9], 5)]
    config = dict(widths=(1, 2), max_batch=2, block_size=4, kv_blocks=7, num_drafts=4)
    engine = Engine(load_checkpoint(small_checkpoint), EngineConfig(**config))
    engine.device_drafts, engine.draft_before_read = True, True
    assert engine.generate(requests).outputs == \
        generate(small_checkpoint, requests, speculate=False, max_batch=2)[0]


class _Seq:
    def __init__(self, finished: bool) -> None:
        self.finished = finished


@pytest.mark.parametrize("finished", [(1,), (0,), (3,), (0, 2), (1, 2), (0, 1, 2, 3)])
def test_narrowed_keeps_the_unfinished_rows_in_order(finished):
    """`draft_side.narrowed`: the verify rows of the sequences that did not finish, in their
    order (one run or several); none when all did (the engine then withdraws and counts it;
    a narrowed batch it counts when a step verifies it)."""
    n, k1 = 4, 3
    seqs = [_Seq(i in finished) for i in range(n)]
    tokens = torch.arange(n * k1, dtype=torch.int32)
    got = draft_side.narrowed(draft_side.Ahead(seqs, tokens, "own"))
    keep = [i for i in range(n) if i not in finished]
    if not keep:
        assert got is None
        return
    assert got is not None and got.seqs == [seqs[i] for i in keep] and got.width == n
    assert got.tokens.tolist() == [i * k1 + j for i in keep for j in range(k1)]


@pytest.mark.parametrize("merge", [True, False])
def test_a_finish_keeps_the_rest_drafts_for_the_next_verify(small_checkpoint, monkeypatch, merge):
    """Drafts proposed before a step's read for a batch of which one sequence then finished:
    with `narrow_ahead` the rest's are verified as proposed at the next step (its prompt
    merged beside them where one is admitted), against withdrawing them and drafting again:
    the same target passes bit for bit, the same outputs (greedy's), fewer proposes, no block
    leaked, nothing pending. Where the admission prefills alone (merge off) they are withdrawn
    as before."""
    config = dict(forward="circuit", num_drafts=3, widths=(1, 2, 4), max_batch=3)

    def drive(narrow: bool):
        engine = Engine(load_checkpoint(small_checkpoint), EngineConfig(**config))
        engine.device_drafts = engine.draft_before_read = True
        engine.narrow_ahead, engine.merge_prefill = narrow, merge
        calls = count_calls(engine, monkeypatch)
        passes, launch = [], engine.target.model.launch
        engine.target.model.launch = lambda rows: passes.append(rows.tokens.tolist()) or launch(rows)
        outputs = engine.generate(REQUESTS).outputs
        assert engine._ahead is None and engine.proposer.slots.num_pending == 0
        assert engine.pool.num_used == 0 and engine.proposer.pool.num_used == 0
        return outputs, passes, engine.stats.draft_batches, calls

    out, passes, stats, calls = drive(True)
    base_out, base_passes, base_stats, base_calls = drive(False)
    assert out == base_out == greedy(small_checkpoint, REQUESTS)
    assert passes == base_passes
    narrowed = sum(c for per in stats.narrowed.values() for c in per.values())
    assert not base_stats.narrowed
    if merge:  # every finish but the last's narrowed (the last has no sequence left)
        assert narrowed >= 3
        assert calls["propose_batch_on_device"] + calls["step_batch"] < \
            base_calls["propose_batch_on_device"] + base_calls["step_batch"]
    else:  # a finish while requests wait: the admission prefills alone, so withdrawn
        assert narrowed < sum(c for per in base_stats.withdrawn.values() for c in per.values())


def test_a_narrowed_batch_withdrawn_for_a_lone_prefill_counts_withdrawn_only(small_checkpoint,
                                                                            monkeypatch):
    """Narrowed at a finish, then withdrawn at the next step because the admitted prompt does
    not fit the verify's pass (max_rows) and prefills alone: counted withdrawn, not also
    narrowed; every narrowed batch counted is one a step verified. Outputs stay greedy's."""
    requests = random_requests(SMALL.vocab_size, 7, seed=5, min_prompt=8, max_prompt=20)
    config = dict(forward="circuit", num_drafts=3, widths=(1, 2, 4), max_batch=3, max_rows=16)
    engine = Engine(load_checkpoint(small_checkpoint), EngineConfig(**config))
    engine.device_drafts = engine.draft_before_read = True
    verified, withdrawn = [], []
    real_take, real_withdraw = engine._take_ahead, engine_module.withdraw

    def take(seqs, on_device):
        ahead = engine._ahead
        got = real_take(seqs, on_device)
        if ahead is not None and ahead.width != len(ahead.seqs):
            (verified if got is not None else withdrawn).append(ahead.width)
        return got
    monkeypatch.setattr(engine, "_take_ahead", take)
    outputs = engine.generate(requests).outputs
    assert outputs == generate(small_checkpoint, requests, speculate=False, max_batch=3)[0]
    assert withdrawn, "no narrowed batch was withdrawn: the case is not exercised"
    stats = engine.stats.draft_batches
    counted = sum(c for per in stats.narrowed.values() for c in per.values())
    assert counted == len(verified)
    assert engine.proposer.pool.num_used == 0 and engine.pool.num_used == 0


@pytest.mark.parametrize("where", ["settle", "mid-run"])
@pytest.mark.parametrize("merge", [True, False])
def test_a_fault_read_at_a_finish_still_finishes_the_step(small_checkpoint, monkeypatch, merge,
                                                          where):
    """Review regression: the last of a device batch's states to be freed settles it, and that
    settle reads its input guards' records (FAULTS 25), so on CUDA a finish can raise
    `RunnerInputError`. The step still finishes every finished sequence (their target blocks
    go back), drafts and accounts for the rest, and only then raises; the engine runs on after
    it with no block leaked. Injected once: "settle", the records' check raises inside a free
    (the real path; here it comes at the run's last finish); "mid-run", a free raises after
    freeing at the first finish that leaves sequences running (the rest's step must go on)."""
    from draft_circuit.runners.input_values import RunnerInputError
    from draft_circuit.runners.proposer_device import DeviceDrafts

    engine = Engine(load_checkpoint(small_checkpoint),
                    EngineConfig(forward="circuit", num_drafts=3, widths=(1, 2, 4), max_batch=3))
    engine.device_drafts = engine.draft_before_read = True
    engine.merge_prefill = merge
    seen = {"armed": False, "raised": 0}
    check, free_state = DeviceDrafts.check_faults, MtpProposer.free_state

    def injected(self):
        if seen["armed"] and not seen["raised"]:
            seen["raised"] += 1
            raise RunnerInputError("row 0 of the batch: token id 999999 is out of range (injected)")
        return check(self)

    def freeing(self, state):
        seen["armed"] = where == "settle"
        try:
            free_state(self, state)
        finally:
            seen["armed"] = False
        if where == "mid-run" and not seen["raised"] and \
                [s for s in engine.scheduler.running if not s.finished]:
            seen["raised"] += 1
            raise RunnerInputError("a row of the batch: injected at a finish")
    monkeypatch.setattr(DeviceDrafts, "check_faults", injected)
    monkeypatch.setattr(MtpProposer, "free_state", freeing)
    for r in REQUESTS:
        engine.scheduler.add(r)
    faults = 0
    while engine.scheduler.has_work:
        try:
            engine.step()
        except RunnerInputError as e:
            assert "injected" in str(e)
            faults += 1
            assert not [s for s in engine.scheduler.running if s.finished]  # all finished
            for s in engine.scheduler.running:  # the rest kept the engine's invariant
                assert s.num_cached == len(s.tokens) - 1, s.id
    assert faults == seen["raised"] == 1
    assert engine._ahead is None and engine.proposer.slots.num_pending == 0
    assert engine.pool.num_used == 0 and engine.proposer.pool.num_used == 0
