"""`Engine`: batched greedy speculative decoding over a Llama-like or DeepSeek-V3 target and its
drafter (the MTP head `heads.head_for` picks from the checkpoint, or an EAGLE-3 drafter, which reads
the target layers it taps), optionally over a reduced draft vocabulary (`EngineConfig.draft_vocab`).

The constructor reads as the lifecycle: size the KV pools, build the target circuit, build the
proposer (for --forward circuit, compile its chains' bindings and install the runners), then the
scheduler. Each
`step` admits what fits, then runs one decode step for the running batch: draft, verify every
sequence's [last token, drafts...] in one target pass (the prompts of sequences admitted beside
a running batch in the same pass), accept, then the draft side (examples/engine/draft_side.py):
trim, catch up and, on the device path when the next batch is known, the next step's drafts in
the same proposer call. The output is target-only greedy decoding's, token for token.

One module on purpose (it runs past 400 lines): `step` and the calls it makes (`_decode`,
`_end_step`, `_take_ahead`, `_merges`, `_prefill`, `_account`, `_finish`) share one piece of
state between steps, the drafts proposed ahead (`_ahead`) and when they may be used (narrowed
to the sequences that did not finish, withdrawn, or verified beside an admission), and one
order within a step (finishes, then the draft side, then the accounting, a fault a finish read
raised only after all three); split across modules those rules would be spread over several.
What has a job of its own already lives beside it: the draft side (draft_side.py), acceptance
(speculate.py), the target's passes (runner.py, model.py), admission (scheduler.py), request
checks (request_checks.py) and the warm-up's dummy requests (warm_up.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Literal, Sequence as Seq

import torch

from examples.engine.checkpoints import Checkpoint, EngineError
from examples.engine.draft_side import (Ahead, Rows, Verified, catch_up, end_step, step_ahead,
                                        withdraw)
from examples.engine.glm_target import target_for  # GLM-4.5's target, else DeepSeek-V3's or Llama's
from examples.engine.request_checks import check_requests
from examples.engine.runner import SCRATCH_BLOCK, NonFiniteLogitsError, RowsOut, TargetRunner
from examples.engine.scheduler import Scheduler
from examples.engine.sequence import Request, Sequence
from examples.engine.speculate import DraftStats, accept, draft, draft_each, draft_on_device, usable
from examples.engine.tp import plan_for as tp_plan_for, shard_drafter
from examples.engine.warm_up import dummy_requests
from draft_circuit.circuit.layers.draft_vocab import DraftVocab, DraftVocabError, bind_draft_vocab, over_subset
from draft_circuit.circuit.layers.eagle3 import Eagle3Config
from draft_circuit.circuit.layers.heads import head_for
from draft_circuit.circuit.layers.mtp import KvLayout
from draft_circuit.runners.chains import compile_chain
from draft_circuit.runners.kv_cache import BlockPool
from draft_circuit.runners.proposer import MtpProposer


@dataclass(frozen=True)
class EngineConfig:
    speculate: bool = True
    forward: Literal["eager", "circuit"] = "circuit"  # the drafter's: compiled, or the oracle
    target_forward: Literal["eager", "circuit"] = "eager"  # the target's (see TargetModel)
    num_drafts: int = 4
    draft_confidence_stop: float | None = None
    kv_exact: bool = True             # drafter trim rule (runners.proposer_state.rows_to_trim)
    refeed: bool = False
    widths: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    max_batch: int = 8
    kv_blocks: int = 1024             # per pool (target and drafter), block 0 reserved
    block_size: int = 16
    max_seq_len: int | None = None    # prompt + new tokens; None: min(max_position_embeddings, 4096)
    max_rows: int = 1024              # rows per target pass (longer prefills run in chunks)
    dtype: torch.dtype = torch.float32
    device: str = "cpu"
    draft_vocab: DraftVocab | None = None  # draft over these target ids only (subset lm-head)
    tp: int = 1                       # tensor-parallel ranks (examples/engine/tp.py: under torchrun)
    warm_up: bool | None = None       # `Engine.warm_up` at construction; None: on CUDA only


@dataclass
class Stats:
    generated: int = 0
    verifies: int = 0                 # sequence-verifies (one per sequence per decode step)
    drafted: int = 0                  # usable drafts only: none past max_new_tokens or an EOS
    accepted: int = 0                 # (speculate.usable; issue 20 item 3)
    steps: int = 0
    draft_s: float = 0.0              # propose + catch-up (prefill's included); on the device
    #                                   path host time only: the chain's GPU time ends in target_s
    target_s: float = 0.0
    wall_s: float = 0.0
    cpu_s: float = 0.0                # this process's CPU time in generate (steadier than wall_s
    #                                   on a shared CPU; a GPU's work is not in it)
    widths: dict[int, int] = field(default_factory=dict)  # decode-step width -> steps
    draft_batches: DraftStats = field(default_factory=DraftStats)


@dataclass
class Result:
    requests: list[Request]
    outputs: list[list[int]]          # generated ids, request order
    stats: Stats


class Engine:
    def __init__(self, checkpoint: Checkpoint, config: EngineConfig = EngineConfig()) -> None:
        c, self.config, self.checkpoint = checkpoint.config, config, checkpoint
        self.k = config.num_drafts if config.speculate else 0
        if config.speculate and checkpoint.mtp is None:
            raise EngineError("speculation needs the MTP layer: load the checkpoint with it")
        if not 1 <= config.max_batch:
            raise EngineError(f"--max-batch must be >= 1, got {config.max_batch}")
        if config.speculate and not 1 <= config.num_drafts:
            raise EngineError(f"--num-drafts must be >= 1, got {config.num_drafts}")
        self.max_seq_len = config.max_seq_len or min(c.max_position_embeddings, 4096)
        self.tp = tp_plan_for(c, config.tp)  # this rank's shard of the target (None: one process)
        # a table covers the longest sequence plus the drafts its last verify writes
        max_blocks = -(-(self.max_seq_len + self.k) // config.block_size)
        kv = KvLayout(config.kv_blocks, config.block_size, max_blocks)
        self.pool = BlockPool(config.kv_blocks, reserved=1)
        # an EAGLE-3 drafter reads three target layers' outputs: the target taps them
        draft = checkpoint.mtp_config if config.speculate else None
        taps = draft.tapped_layers(c.num_hidden_layers) if isinstance(draft, Eagle3Config) else None
        try:
            model = target_for(c, checkpoint.target, kv, max_rows=config.max_rows, dtype=config.dtype,
                               device=config.device, forward=config.target_forward,
                               **({"tap_layers": taps} if taps is not None else {}),
                               **({"tp": self.tp} if self.tp is not None else {}))
        except ValueError as e:  # a tap the target cannot give (named by the model)
            raise EngineError(f"EAGLE-3 drafter over this target: {e}") from None
        self.target = TargetRunner(model)
        self.proposer = self._proposer(checkpoint, kv) if config.speculate else None
        self.scheduler = Scheduler(self.pool, config.block_size, max_blocks,
                                   max_batch=config.max_batch, num_drafts=self.k,
                                   pad_block=SCRATCH_BLOCK)
        self.stats = Stats()
        self._cuda = torch.device(config.device).type == "cuda"  # read twice a step
        self._ahead: Ahead | None = None  # the next step's drafts, proposed at this one's end
        if config.warm_up if config.warm_up is not None else self._cuda:
            self.warm_up()

    def _proposer(self, checkpoint: Checkpoint, kv: KvLayout) -> MtpProposer:
        """The drafter's head as the checkpoint describes it (`heads.head_for`: dense, MoE, MLA,
        EAGLE-3; fp8 experts/projections kept where stored so), bound, over `draft_vocab` when set,
        and its proposer. The target's drafter hidden must be as wide as the head reads."""
        cfg = self.config
        assert checkpoint.mtp is not None and checkpoint.mtp_config is not None
        head = head_for(checkpoint.mtp_config, str(cfg.dtype).removeprefix("torch."), checkpoint.mtp)
        head, params = shard_drafter(head, checkpoint.mtp, self.tp, cfg.draft_vocab)
        if cfg.draft_vocab is not None:
            try:  # the lm-head's rows of the subset, gathered now; drafts mapped back on the device
                params = bind_draft_vocab(params, head, cfg.draft_vocab)
            except DraftVocabError as e:
                raise EngineError(f"--draft-vocab: {e}") from None
            head = over_subset(head, cfg.draft_vocab)
        width = self.target.model.hidden_size
        if width != head.hidden_in_size:  # before any run: the proposer would refuse every call
            raise EngineError(f"the target hands the drafter hiddens {width} wide, but "
                              f"{type(head).__name__} reads {head.hidden_in_size}")
        widths = tuple(w for w in cfg.widths if w >= 1)
        if not widths:
            raise EngineError(f"--widths {cfg.widths}: give at least one width >= 1")
        # the proposer starts on the eager oracle; --forward circuit compiles the chains a step
        # uses (k-step propose, one-step chain, KV-only catch-up) from its bindings and installs them
        proposer = MtpProposer(head, params, num_drafts=cfg.num_drafts,
                               num_blocks=kv.num_blocks, block_size=kv.block_size,
                               max_blocks_per_seq=kv.max_blocks_per_seq, max_width=max(widths),
                               widths=widths, forward="eager", device=cfg.device,
                               draft_confidence_stop=cfg.draft_confidence_stop,
                               kv_exact=cfg.kv_exact, refeed=cfg.refeed)
        if cfg.forward == "circuit":
            for k in sorted({cfg.num_drafts, 1}):
                runner = compile_chain(proposer.circuit_draft(k), proposer.widths, device=cfg.device)
                proposer.set_circuit_draft(runner, num_drafts=k)
            # catch-up and prefill rows need only their K/V: the KV-only chain (issue 14 item 1),
            # at its own widths (a step's catch-up rows in one run)
            kv_only = proposer.circuit_draft_kv_only()
            proposer.set_circuit_draft(compile_chain(kv_only, kv_only.widths or proposer.widths,
                                                     device=cfg.device), kv_only=True)
        return proposer

    #: True while `warm_up` generates: the benchmarks that wrap `generate` / `step` to time a
    #: run (benchmarks/engine_steps.py, engine_timeline.py, engine_repeat.py) skip those calls
    warming_up: bool = False

    def warm_up(self) -> None:
        """Generate for a few dummy requests and forget them, so that the first real request
        does not pay the process's one-time work (examples/engine/warm_up.py says what they
        cover and what is left after: nothing held, statistics and ids from zero)."""
        if self.scheduler.has_work:
            raise EngineError("warm_up runs before any request: this engine has requests queued")
        requests = dummy_requests(self)
        if not requests:  # a pool or length limit too small for any request: nothing to warm
            return
        self.warming_up = True
        try:
            self.generate(requests)
        except (EngineError, NonFiniteLogitsError) as e:  # named as the warm-up's, not a request's
            raise type(e)(f"the engine's warm-up (dummy requests generated before any of yours: "
                          f"Engine.warm_up; --no-warm-up skips it) failed: {e}") from e
        finally:
            self.warming_up = False
        self.stats = Stats()
        self.scheduler.restart_ids()

    # ---- checks, all before anything runs ----
    def check(self, requests: Seq[Request]) -> None:
        """Every request checked before anything runs (examples/engine/request_checks.py)."""
        check_requests(requests, vocab=self.checkpoint.config.vocab_size,
                       max_seq_len=self.max_seq_len, blocks_for=self.scheduler.blocks_for,
                       pool=self.pool, max_batch=self.config.max_batch,
                       block_size=self.config.block_size)

    # ---- generation ----
    def generate(self, requests: Seq[Request],
                 on_step: Callable[["Engine"], None] | None = None) -> Result:
        requests = list(requests)
        self.check(requests)
        seqs = [self.scheduler.add(r) for r in requests]
        start, cpu = time.perf_counter(), time.process_time()
        while self.scheduler.has_work:
            self.step()
            if on_step is not None:
                on_step(self)
        self.stats.wall_s += time.perf_counter() - start
        self.stats.cpu_s += time.process_time() - cpu
        return Result(requests, [s.generated for s in seqs], self.stats)

    def step(self) -> None:
        """Admit what fits, then one decode step for the sequences already running. A sequence
        admitted while others run has its prompt prefilled in that step's target pass (its rows
        after the verify rows: `merge_prefill`), so an admission costs no pass of its own, and
        decodes from the next step; with nothing running (the first admission, or a batch that
        finished together) the prefill is its own pass and the new sequences decode at once."""
        running = [s for s in self.scheduler.running if not s.finished]
        admitted = self.scheduler.admit()
        merged = admitted if admitted and running and self._merges(running, admitted) else []
        if admitted and not merged:
            self._prefill(admitted)
            running = [s for s in self.scheduler.running if not s.finished]
        verified = None
        if running:
            self.stats.steps += 1
            self.stats.widths[len(running)] = self.stats.widths.get(len(running), 0) + 1
            if self.proposer is not None:
                verified = self._decode(running, merged)
            else:
                self._decode_plain(running, merged)
        # a finish can raise the input guards' fault of a device batch whose last state it
        # frees (FAULTS 25): every finish and the rest's step still happen, then it is raised
        fault: Exception | None = None
        for s in [s for s in self.scheduler.running if s.finished]:
            try:
                self._finish(s)
            except Exception as e:
                fault = fault or e
        if verified is not None:  # after the finishes: the next step's batch is known now
            t0 = time.perf_counter()
            try:
                self._end_step(verified)
            finally:  # even when the draft side raises: the tokens are appended already, so the
                # target's KV rows and the statistics must follow them (num_cached == len - 1)
                self.stats.draft_s += time.perf_counter() - t0
                self._account(verified)  # behind the next GPU work's launch
        if fault is not None:
            raise fault

    #: on the device path, draft the next step in the call that trims and catches up this one
    #: (`MtpProposer.step_batch`) when its batch is known; False: the separate calls (a test
    #: and benchmarks/engine_step_host.py set it to compare)
    propose_ahead: bool = True

    #: drafts proposed before a step's read for sequences of which some then finished: keep
    #: the rest's (`draft_side.narrowed`) for the next step to verify as proposed, an
    #: admission's prompt merged beside them; False: withdraw them all and draft again
    narrow_ahead: bool = True

    def _end_step(self, v: Verified) -> None:
        """The draft side of the step just verified (`draft_side.end_step`), drafting the next
        step ahead when its batch is known: exactly this step's unfinished sequences, in order,
        on the device path. That holds when they are all the scheduler runs (no prompt merged
        into this pass waits to decode) and it admits nothing: nothing changes the scheduler
        between two steps of `generate`, so the next `admit` finds what `can_admit` does now.
        Drafts proposed before this step's read (`v.ahead`) are kept for those sequences with
        `narrow_ahead` even when the next step admits: an admission whose prompt merges into
        its pass leaves its verify rows as they are (one that prefills alone withdraws them,
        `_take_ahead`)."""
        live = [s for s in v.seqs if not s.finished]
        running = self.scheduler.running
        known = (self.propose_ahead and bool(live) and self._on_device(len(live))
                 and len(running) == len(live) and all(a is b for a, b in zip(running, live)))
        if v.ahead is not None and self.narrow_ahead:
            known = known and (self.merge_prefill or not self.scheduler.can_admit())
        elif v.ahead is not None:  # withdrawn when a sequence finished
            known = known and len(live) == len(v.seqs) and not self.scheduler.can_admit()
        else:
            known = known and not self.scheduler.can_admit()
        assert self.proposer is not None
        self._ahead = end_step(self.proposer, v, self.k, self.stats.draft_batches, ahead=known)

    def _take_ahead(self, seqs: list[Sequence], on_device: bool) -> torch.Tensor | None:
        """The verify input drafted at the last step's end when it was drafted for `seqs` and
        this step verifies on the device; otherwise None, the drafts withdrawn (a request added
        or a state touched between steps, outside `generate`) so no state keeps them."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return None
        if on_device and len(ahead.seqs) == len(seqs) \
                and all(a is b for a, b in zip(ahead.seqs, seqs)):
            if ahead.width != len(seqs):  # narrowed by finishes (draft_side.narrowed), verified
                self.stats.draft_batches.narrowed[ahead.kind][(ahead.width, len(seqs))] += 1
            return ahead.tokens
        assert self.proposer is not None
        withdraw(self.proposer, ahead, self.stats.draft_batches)
        return None

    #: prefill admitted sequences in the running batch's decode pass (row-wise ops give every row
    #: the bits it has alone, so the output is the same; one target pass fewer per admission)
    merge_prefill: bool = True

    def _merges(self, running: list[Sequence], admitted: list[Sequence]) -> bool:
        """Whether this step's admissions join its decode pass. On the device-resident draft
        path the verify input is the proposer's device tensor and the pass is never split, so
        the admitted prompts join it (behind its rows, `TargetRunner.launch_verify`) only where
        the whole pass fits the target's max_rows; otherwise they prefill in a pass of their
        own. (On the H100 that pass and its catch-up cost ~1.7 ms a synced admission step, and
        speculation's sequences, finishing at different steps, admit one or two at a time:
        RESULTS.md, eleventh session.)"""
        if not self.merge_prefill:
            return False
        if self.proposer is None or not self._on_device(len(running)):
            return True
        rows = len(running) * (self.k + 1) + sum(len(s.request.prompt) for s in admitted)
        return rows <= self.target.model.max_rows

    def _prefill(self, seqs: list[Sequence]) -> None:
        t0 = time.perf_counter()
        outs = self.target.run(seqs, [s.request.prompt for s in seqs])
        self.stats.target_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        rows = self._prefilled(seqs, outs)
        if rows:
            assert self.proposer is not None
            catch_up(self.proposer, rows)
        self.stats.draft_s += time.perf_counter() - t0

    def _prefilled(self, seqs: Seq[Sequence], outs: list[RowsOut]) -> list[Rows]:
        """After a prefill pass: each sequence's rows, hidden and first token, its drafter state,
        and the drafter rows it needs (`catch_up`'s items): the prompt pairs (prompt[i+1], h_i),
        i < P-1, catch-up rows at positions 1..P-1."""
        for s, out in zip(seqs, outs):
            s.blocks.set_rows(s.num_prompt)
            s.hidden = out.hiddens[-1]
            self.stats.generated += len(s.append([out.tokens[-1]], self.checkpoint.eos_token_id))
        if self.proposer is None:
            return []
        for s in seqs:
            s.draft_state = self.proposer.alloc_state()
        return [(s, s.request.prompt[1:], o.hiddens[:s.num_prompt - 1], 1)
                for s, o in zip(seqs, outs) if s.num_prompt > 1 and not s.finished]

    #: drafts stay on the device through verify (propose_batch_on_device); None: on CUDA only
    #: (CPU keeps the host-returning path; a test sets True to run the device path on CPU)
    device_drafts: bool | None = None

    def _on_device(self, n: int) -> bool:
        on = self.device_drafts if self.device_drafts is not None else self._cuda
        return on and n * (self.k + 1) <= self.target.model.max_rows  # one target pass

    def _decode(self, seqs: list[Sequence], prefill: Seq[Sequence] = ()) -> Verified:
        """Draft (or take the drafts the last step proposed ahead), verify [last token,
        drafts...] of every sequence in one target pass, accept, and update what the draft
        side's launch reads (tokens, finishes, hiddens); the drafter's trims and catch-up are
        `step`'s, after the finishes (`_end_step`), and the rest of the step's bookkeeping
        (target KV rows, statistics) follows that launch (`_account`).
        `prefill`: admitted sequences whose prompts ride in the same pass, after the verify
        rows (on the device path too, where `_merges` found the pass fits max_rows; no draft
        side is launched before that read); their drafter rows join the step's catch-up call.

        On the device path (CUDA) the drafts never come back before verify: the verify input is
        the proposer's device tensor (`draft_on_device`, or the last step's `step_batch`),
        launched straight behind the chain. The step's one read is the verify's greedy tokens
        (`read_verify`: their pinned copy, a sync on the target's pass); the drafts were copied
        to pinned memory behind the chain, so `last_drafts` reads them then without a sync of
        its own. With `draft_before_read`, `step_ahead` enqueues the draft side between the
        verify's launch and that read. The target stages its host inputs (positions, tables)
        in one pinned mirror with one non_blocking copy and keeps `active` on the device, so
        nothing holds the host behind the chain before the verify is enqueued."""
        assert self.proposer is not None
        t0 = time.perf_counter()
        on_device = self._on_device(len(seqs))
        tokens = self._take_ahead(seqs, on_device)
        if tokens is None and on_device:
            tokens = draft_on_device(self.proposer, seqs, self.k, self.stats.draft_batches)
        prefilled: list[RowsOut] = []
        if tokens is None:  # the host-returning path, or a batch the proposer declined
            drafts = (draft_each if on_device else draft)(self.proposer, seqs, self.k,
                                                          self.stats.draft_batches)
            t1 = time.perf_counter()
            out = self.target.run_pass([*seqs, *prefill],
                                       [[s.last_token, *d] for s, d in zip(seqs, drafts)]
                                       + [s.request.prompt for s in prefill])
            prefilled = [out.rows_out(i) for i in range(len(seqs), len(seqs) + len(prefill))]
        ahead = None
        if tokens is not None:
            t1 = time.perf_counter()
            launched = self.target.launch_verify(seqs, tokens, self.k, prefill)
            got = step_ahead(self.proposer, launched, self.k, self.stats.draft_batches) \
                if not prefill and self._ahead_of_read(seqs) else None
            if got is not None:
                drafts, ahead = got
            out = self.target.read_verify(launched)
            prefilled = [out.rows_out(i) for i in range(len(seqs), len(seqs) + len(prefill))]
            if ahead is None:
                drafts = self.proposer.last_drafts([s.draft_state for s in seqs])
        t2 = time.perf_counter()
        v = Verified(seqs, drafts, [], out.hidden, out.starts,
                     prefill=self._prefilled(prefill, prefilled), ahead=ahead)
        eos, hidden, kept = self.checkpoint.eos_token_id, out.hidden, v.kept
        # only what the draft side's next launch reads (tokens, hiddens, finishes): the rest of
        # the step's bookkeeping waits until it is launched (`_account`)
        for s, d, greedy, at in zip(seqs, drafts, out.tokens, out.starts):
            a = accept(d, greedy)
            v.accepted.append(a)
            # the target hiddens this step knows, from position - 1 (the one drafted from) on
            v.proposed.append(s.position)
            v.before.append((s.hidden_src, s.hidden_row))
            s.hidden_at(hidden, at + a)  # the tensor and the row: no view a sequence
            kept.append(s.append([*d[:a], greedy[a]], eos))
        self.stats.draft_s += t1 - t0
        self.stats.target_s += t2 - t1
        return v

    #: on the device path, launch the draft side behind the verify, before the host reads it
    #: (`MtpProposer.step_ahead`); False: read first, then `step_batch`. The default since it
    #: beat reading first on the H100 (benchmarks/RESULTS.md, 2026-12-07, sixth session).
    draft_before_read: bool = True

    def _ahead_of_read(self, seqs: list[Sequence]) -> bool:
        """Whether to draft the next step before this one's verify is read: the next batch will
        be these sequences unless one finishes (then the drafts are withdrawn, `_end_step`),
        so not while the scheduler could admit one or runs others."""
        return (self.draft_before_read and self.propose_ahead
                and len(self.scheduler.running) == len(seqs) and not self.scheduler.can_admit())

    def _account(self, v: Verified) -> None:
        """The step's bookkeeping no launch waits for, after the draft side launched: the
        target's KV rows (the last token's and the accepted drafts' are the target's; rejected
        rows' KV is dead, overwritten by the next verify; a finished sequence's table is gone)
        and the statistics."""
        eos, stats = self.checkpoint.eos_token_id, self.stats
        for s, d, a, kept, proposed in zip(v.seqs, v.drafts, v.accepted, v.kept, v.proposed):
            if not s.finished:
                s.blocks.set_rows(proposed + a + 1)  # num_cached before the step: proposed
            stats.generated += len(kept)
            stats.verifies += 1
            # the room before the step: what it generated before, all taken from its request
            room = s.request.max_new_tokens - (s.num_generated - len(kept))
            drafted, accepted_now = usable(len(d), a, room, kept, eos)  # issue 20 item 3
            stats.drafted += drafted
            stats.accepted += accepted_now

    def _decode_plain(self, seqs: list[Sequence], prefill: Seq[Sequence] = ()) -> None:
        """One target pass of every sequence's last token (and `prefill`'s prompts after them)."""
        t0 = time.perf_counter()
        outs = self.target.run([*seqs, *prefill], [[s.last_token] for s in seqs]
                               + [s.request.prompt for s in prefill])
        self.stats.target_s += time.perf_counter() - t0
        self._prefilled(prefill, outs[len(seqs):])
        for s, out in zip(seqs, outs[:len(seqs)]):
            s.blocks.set_rows(s.num_cached + 1)
            self.stats.generated += len(s.append(out.tokens, self.checkpoint.eos_token_id))

    def _finish(self, seq: Sequence) -> None:
        """Free the sequence's drafter state and target blocks. The drafter's free may raise a
        fault it read (see `step`); the blocks are freed before it does, and the target's go
        back here whatever it raised."""
        try:
            if self.proposer is not None and seq.draft_state is not None:
                self.proposer.free_state(seq.draft_state)
        finally:
            seq.hidden = None  # its pass's hidden tensor (device memory) is not kept for it
            self.scheduler.finish(seq)
