"""The draft side of a decode step after its verify (issue 14 item 4): the drafter's trims, the
catch-up of the rows it lacks and, when the engine knows the next step's batch is exactly this
step's unfinished sequences, the next device-resident propose, all in one `MtpProposer.step_batch`
call whose verify input the next step verifies as it is (`Ahead`). Otherwise the separate calls
(`after_verify_batch`, `last_pair_keys`, `catchup_batch`) and the next step proposes itself.

An `Ahead` the next step cannot take (its batch is not the one drafted for) is withdrawn: its
drafts are settled (the one read), every drafter row its propose wrote is dropped and the pair
key moved back as far, so the states are as the catch-up left them and hold nothing pending.
One whose sequences partly finished is narrowed instead where the engine asks (`narrowed`): the
rest keep their drafts, verified as proposed (a row's drafts do not depend on the rows beside
it), so the next step drafts nothing before its verify.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch

from examples.engine.runner import Launched
from examples.engine.sequence import Sequence
from examples.engine.speculate import DraftStats
from draft_circuit.runners.hidden_rows import HiddenRows
from draft_circuit.runners.proposer import MtpProposer
from draft_circuit.runners.proposer_chunks import consecutive_runs
from draft_circuit.runners.proposer_state import key_after_verify

#: a catch-up item: (sequence, tokens, their target hiddens [len, H], RoPE position of the first)
Rows = tuple[Sequence, list[int], torch.Tensor, int]


@dataclass
class Verified:
    """What a decode step's verify leaves the draft side, per sequence of the step (finished
    ones too: the draft side skips them, they are freed first): its kept drafts, how many the
    target accepted, the tokens the step kept (`Sequence.append`'s), the position it drafted
    from (its last token's before the step) and the target hiddens the step knows from the one
    before that on: `before` (the hidden that made the step's first token, at `proposed - 1`),
    then its k + 1 verify rows, `hidden[starts[i]:]` of the pass's one tensor [rows, H]."""
    seqs: list[Sequence]
    drafts: list[list[int]]
    accepted: list[int]
    hidden: torch.Tensor
    starts: list[int]
    kept: list[list[int]] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    # (source, row) as `Sequence.hidden_src` / `hidden_row` held it; source None only before a
    # prefill
    before: list[tuple[torch.Tensor | None, int]] = field(default_factory=list)
    prefill: list[Rows] = field(default_factory=list)  # prompts merged into the pass (host path)
    # the draft side launched before the verify's read (`MtpProposer.step_ahead`): trims and
    # catch-up done, the next step's drafts proposed for every sequence of this step
    ahead: "Ahead | None" = None
    _no_rows: torch.Tensor | None = field(default=None, init=False, repr=False)

    def no_rows(self) -> torch.Tensor:
        """[0, H] on the hiddens' device: every sequence with no catch-up row shares it."""
        if self._no_rows is None:
            self._no_rows = self.hidden[:0]
        return self._no_rows


@dataclass
class Ahead:
    """The next step's drafts, proposed at the end of this one: the sequences in the order they
    drafted and their verify input, i32[n * (k + 1)] on the device (the proposer's buffer: its
    next propose overwrites it, so it is verified before the proposer drafts again)."""
    seqs: list[Sequence]
    tokens: torch.Tensor
    kind: str = ""  # how the proposer served the batch (`Served.kind`: a withdrawal's count)
    width: int = 0  # how many sequences it drafted for (`narrowed` keeps fewer); 0: len(seqs)

    def __post_init__(self) -> None:
        self.width = self.width or len(self.seqs)


def end_step(proposer: MtpProposer, v: Verified, num_drafts: int, stats: DraftStats, *,
             ahead: bool) -> Ahead | None:
    """Trim and catch up every unfinished sequence of `v`; with `ahead` (the caller knows the
    next step's batch is exactly those, in order, on the device path) also draft their next
    step in the same call and return it. None: the next step drafts itself (no `ahead`, a
    merged prompt to catch up, a sequence that drafted nothing, or a batch the proposer
    declined, whose trims and catch-up are done all the same). A step drafted before its read
    (`v.ahead`, `step_ahead`) has done all that: its drafts are returned when `ahead` holds
    (the unfinished sequences' only, `narrowed`, where some finished), else withdrawn."""
    if v.ahead is not None:  # drafted before the read (`step_ahead`): trims and catch-up done
        # the next batch is the unfinished sequences (`ahead`): theirs verify as proposed
        kept = narrowed(v.ahead) if ahead else None
        if kept is None:  # withdrawn: one waits to be admitted, or every sequence finished
            withdraw(proposer, v.ahead, stats)
        return kept
    live = [i for i, s in enumerate(v.seqs) if not s.finished]
    if ahead and live and not v.prefill and all(v.drafts[i] for i in live):
        return _step_batch(proposer, v, live, num_drafts, stats)
    states = [v.seqs[i].draft_state for i in live]
    rows = list(v.prefill)
    if live:  # every trim in one call, then every pair key the catch-up is found from in one
        proposer.after_verify_batch([v.accepted[i] for i in live], states)
        keys = proposer.last_pair_keys(states)
        rows += [missing_rows(v, i, key) for i, key in zip(live, keys)]
    rows = [r for r in rows if r[1]]
    if rows:  # enqueued, not waited for: the next propose runs behind it
        catch_up(proposer, rows)
    return None


def step_ahead(proposer: MtpProposer, launched: Launched, num_drafts: int,
               stats: DraftStats) -> tuple[list[list[int]], Ahead] | None:
    """The draft side launched right behind the verify, before its read
    (`MtpProposer.step_ahead`): (the verified drafts, the next step's drafts for every
    sequence of this one), or None when the proposer declined (read first, then `end_step`).
    `end_step` keeps the drafts when the next batch is this one, else withdraws them."""
    seqs = launched.seqs
    got = proposer.step_ahead(launched.greedy, launched.hidden, num_drafts,
                              [s.draft_state for s in seqs])
    if got is None:
        return None
    kind = proposer.last_served.kind
    stats.batches[kind][len(seqs)] += 1
    return got[0], Ahead(seqs, got[1], kind)


def _step_batch(proposer: MtpProposer, v: Verified, live: list[int], num_drafts: int,
                stats: DraftStats) -> Ahead | None:
    """`end_step` in one `step_batch`. The catch-up rows are found from each state's pair key
    after the trim, which step_batch makes inside the call, so the key comes from the
    proposer's own rule (`key_after_verify`, beside the trim it mirrors) instead of a read; the
    rows are given their positions explicitly so tokens and RoPE positions agree whatever the
    key. Both hiddens go as rows of the verify's one tensor picked by index (`HiddenRows`: one
    gather on the device, no view or stack a sequence on the host), unless a sequence's rows
    reach back to the hidden before this step's (`before`, another tensor): then tensors."""
    kv_exact, refeed, source = proposer.kv_exact, proposer.refeed, v.hidden
    # every per-sequence list the call takes, in one pass over the live sequences
    seqs: list[Sequence] = []
    accepted, first, last, positions, states, targets = [], [], [], [], [], []
    keys: list[int | None] = []
    tokens: list[list[int]] = []
    spans: list[range] = []  # each sequence's catch-up rows in `source`
    picked = True  # every catch-up row and target a row of `source`
    for i in live:
        a = v.accepted[i]
        s = v.seqs[i]
        key = key_after_verify(v.proposed[i], len(v.drafts[i]), a, kv_exact=kv_exact,
                               refeed=refeed)
        f, lo, hi = _span(v, i, key)
        keys.append(key)
        at = v.starts[i]
        picked = picked and (lo > 0 or hi <= lo) and s.hidden_src is source
        spans.append(range(at + lo - 1, at + hi - 1) if hi > lo else range(0))
        seqs.append(s)
        accepted.append(a)
        tokens.append(s.tokens[f:f + max(hi - lo, 0)])
        first.append(f)
        last.append(s.tokens[-1])
        targets.append(s.hidden_row)
        positions.append(len(s.tokens) - 1)
        states.append(s.draft_state)
    if picked:
        rows = np.fromiter(chain.from_iterable(spans), dtype=np.int64,
                           count=sum(map(len, spans)))
        got = proposer.step_batch(accepted, tokens, HiddenRows(source, rows), last,
                                  HiddenRows(source, np.array(targets, dtype=np.int64)),
                                  positions, num_drafts, states, catchup_first=first)
    else:  # a row before this step's: the tensors, as missing_rows builds them
        hiddens = [missing_rows(v, i, key)[2] for i, key in zip(live, keys)]
        targets_t = torch.stack([s.hidden for s in seqs])  # type: ignore[misc]
        got = proposer.step_batch(accepted, tokens, hiddens, last, targets_t, positions,
                                  num_drafts, states, catchup_first=first)
    if got is None:  # declined (an unserved width): trimmed and caught up, nothing drafted
        return None
    kind = proposer.last_served.kind
    stats.batches[kind][len(seqs)] += 1
    return Ahead(seqs, proposer.verify_tokens(), kind)


def _span(v: Verified, i: int, key: int | None) -> tuple[int, int, int]:
    """Sequence i's missing drafter rows from its pair key after the trim (`missing_rows`'
    rule): (first position, lo, hi), rows [lo, hi) of [before, *its verify rows]."""
    s, known_from = v.seqs[i], v.proposed[i] - 1
    first, last = (key + 2 if key is not None else 1), s.position - 1
    lo, hi = first - 1 - known_from, last - known_from
    if lo < 0:
        raise RuntimeError(f"sequence {s.id}: the drafter needs rows from position {first}, "
                           f"but this step holds target hiddens from {known_from} on")
    return first, lo, hi


def missing_rows(v: Verified, i: int, key: int | None) -> Rows:
    """The drafter rows sequence i's next propose needs and the drafter lacks, found from its
    pair key after the step's trim as a host of the reference does: the next row is at
    key + 2, the last at the new last token's position - 1, and the row at p pairs the token
    at p with the target hidden at p - 1. The hiddens known are [before, *its verify rows]
    from `proposed - 1` on; one slice of the pass's hiddens where the rows start past `before`
    (the exact-KV steady state: no copy), the shared empty one where there are none."""
    s = v.seqs[i]
    first, lo, hi = _span(v, i, key)  # rows [lo, hi) of [before, *rows]
    at = v.starts[i]
    if hi <= lo:
        hiddens = v.no_rows()
    elif lo:
        hiddens = v.hidden[at + lo - 1:at + hi - 1]
    else:
        src, row = v.before[i]
        assert src is not None  # a decoding sequence has the hidden its last token came from
        before = src.view(1, -1) if row < 0 else src[row:row + 1]
        hiddens = torch.cat([before, v.hidden[at:at + hi - 1]])
    return (s, s.tokens[first:first + max(hi - lo, 0)], hiddens, first)


def catch_up(proposer: MtpProposer, rows: list[Rows]) -> None:
    """Every (sequence, tokens, their target hiddens, first position) in one proposer call."""
    proposer.catchup_batch([r[1] for r in rows], [r[2] for r in rows], [r[3] for r in rows],
                           [r[0].draft_state for r in rows])


def narrowed(ahead: Ahead) -> Ahead | None:
    """`ahead` for its unfinished sequences only: the finished ones' verify rows dropped (one
    `cat` of the kept runs of rows on the device, no sync; a view of the proposer's buffer
    where they are one run, verified before the proposer drafts again as the whole one is) and
    their states' part of the batch gone with them (freed: `PendingBatch.dropped`). The rest
    stay pending as proposed; the next call that touches one settles them, as for any batch.
    None when every sequence finished (nothing is pending: `withdraw` counts it). The engine
    counts a narrowed batch when it verifies it (`DraftStats.narrowed`): one withdrawn after all
    (its admission prefilled alone) is counted withdrawn only."""
    seqs = ahead.seqs
    keep = [i for i, s in enumerate(seqs) if not s.finished]
    if not keep:
        return None
    if len(keep) == len(seqs):
        return ahead
    rows = ahead.tokens.view(len(seqs), -1)
    runs = [rows[a:b] for a, b in consecutive_runs(keep)]  # (one finish leaves at most two)
    tokens = torch.cat(runs).view(-1) if len(runs) > 1 else runs[0].reshape(-1)
    return Ahead([seqs[i] for i in keep], tokens, ahead.kind, ahead.width)


def withdraw(proposer: MtpProposer, ahead: Ahead, stats: DraftStats | None = None) -> None:
    """Undo `ahead`'s propose for its sequences still running (a finished one's state was
    freed, which drops its part of the batch): settle the drafts (their one read), then hand
    each state's drafter KV out and back in with the d rows its propose wrote dropped and the
    pair key moved back as far (the contract's KV hand-over), so each state is as the catch-up
    left it: no pending drafts, not awaiting a verify, and the next propose writes those rows
    again. No block is freed or leaked: the blocks go back to the same state. `stats`
    counts the batch as withdrawn (`DraftStats.withdrawn`)."""
    if stats is not None:
        stats.withdrawn[ahead.kind][ahead.width] += 1
    seqs = [s for s in ahead.seqs if not s.finished and s.draft_state is not None]
    if not seqs:  # every one finished: their states were freed, nothing to read or hand back
        return
    states = [s.draft_state for s in seqs]
    for s, state, drafts in zip(seqs, states, proposer.last_drafts(states)):
        got = proposer.take_drafter_kv(state)
        if got is None:  # no rows: the propose wrote none
            continue
        blocks, rows, key = got
        rows -= len(drafts)
        back = key - len(drafts) if rows and key is not None else None
        if not proposer.install_drafter_kv(state, blocks, rows, back):
            raise RuntimeError(f"sequence {s.id}: its drafter KV did not go back")
