"""The MTP draft proposer: what a host engine calls (DESIGN.md, "The proposer contract").

`propose` drafts one sequence on the one-row program; `propose_batch` drafts n sequences in one
n-row run, or returns None ("not served here: propose each alone") before anything runs, and
records how it was served in `last_served`. Chains run on `DraftRunner`s (runners/protocol.py)
that a factory builds at construction (compiled programs for `forward="circuit"`, the eager
oracle for `"eager"`) and that a host may replace (`set_circuit_draft`): one code path, whatever
runs the chain. Drafter KV lives in a paged pool whose block 0 is the scratch block inert rows
point at. This module is the contract only: the rules live in proposer_state.py, the checks and
runner inputs in proposer_inputs.py, the runners and their factories in chains.py.
"""
from __future__ import annotations

import logging
import math
from collections import defaultdict
from typing import Literal, Mapping, Sequence

import torch

from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.runners.chains import (ChainRunners, DraftBinding, RunnerFactory,
                                          compiled_runners, eager_runner)
from draft_circuit.runners.contract import Served
from draft_circuit.runners.kv_cache import BlockPool, SequenceBlocks
from draft_circuit.runners.protocol import DraftRunner
from draft_circuit.runners.proposer_inputs import (SCRATCH_BLOCK, ChainRows, catchup_chunks,
                                                   chain_inputs, check_bitmask, check_tokens,
                                                   grow_all)
from draft_circuit.runners.proposer_state import (MtpProposerState, ProposerError, free_all,
                                                  install_kv, kept_drafts, record_drafts, settle,
                                                  take_kv, trim_after_verify)

__all__ = ["DraftBinding", "MtpProposer", "SCRATCH_BLOCK", "Served"]

log = logging.getLogger(__name__)
_WARNED: set[str] = set()  # once-per-process warnings


def warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message)


class MtpProposer:
    def __init__(self, head: MtpHead, params: Mapping[str, torch.Tensor], *, num_drafts: int,
                 num_blocks: int, block_size: int = 16, max_blocks_per_seq: int,
                 max_width: int = 64, widths: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
                 forward: Literal["eager", "circuit"] = "circuit", device: str = "cpu",
                 kv_exact: bool = True, refeed: bool = False,
                 draft_confidence_stop: float | None = None,
                 factory: RunnerFactory | None = None) -> None:
        """`factory` builds each chain's runner (default: compiled at `widths` for "circuit",
        the eager oracle for "eager"); the chains every step uses are built here, not on the
        first propose."""
        if forward not in ("eager", "circuit"):
            raise ProposerError(f"forward must be 'eager' or 'circuit', got {forward!r}")
        if draft_confidence_stop is not None and not 0 < draft_confidence_stop <= 1:
            raise ProposerError(f"draft_confidence_stop must be in (0, 1], got {draft_confidence_stop}")
        c = head.config
        # the proposer owns placement: params follow its device (a host may load on CPU)
        self.head, self.num_drafts, self.device = head, num_drafts, device
        self.params = {k: v.to(device) for k, v in params.items()}
        self.kv = KvLayout(num_blocks, block_size, max_blocks_per_seq)
        self.max_width = max_width
        self.widths = tuple(sorted({1, *(w for w in widths if w <= max_width)}))
        self.kv_exact, self.refeed, self.forward = kv_exact, refeed, forward
        self.log_tau = math.log(draft_confidence_stop) if draft_confidence_stop else float("-inf")
        self.pool = BlockPool(num_blocks, reserved=1)  # block 0: the scratch block
        dt = getattr(torch, head.dtype)
        shape = (num_blocks, block_size, c.num_key_value_heads, c.head_dim)
        self.states = {"k_cache": torch.zeros(shape, dtype=dt, device=device),
                       "v_cache": torch.zeros(shape, dtype=dt, device=device),
                       "embed_target": torch.zeros(max_width, c.hidden_size, dtype=dt, device=device)}
        if factory is None:
            factory = compiled_runners(self.widths, device=device) if forward == "circuit" \
                else eager_runner
        self.chains = ChainRunners(self.circuit_draft, factory)
        self._deferred: torch.Tensor | None = None
        self.stats: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.last_served: Served | None = None
        self.warm_up()

    def warm_up(self) -> None:
        """Build (compile, and on a GPU capture) the chains every engine step uses: the k-step
        chain and the one-step catch-up chain. A masked chain or another k is built on first use."""
        self.chains.get(self.num_drafts, False)
        self.chains.get(1, False)

    # ---- circuit binding (the host may compile and install the runners itself) ----
    def circuit_draft(self, num_drafts: int | None = None, bitmask: bool = False) -> DraftBinding:
        """The chain of `num_drafts` steps (default: the proposer's k) and what its runner binds."""
        k = num_drafts or self.num_drafts
        chain = emit_draft_chain(self.head, k, max_width=self.max_width, kv=self.kv,
                                 bitmask=bitmask, embed_target=True, confidence_stop=True)
        return DraftBinding(chain, self.params, self.states, SCRATCH_BLOCK, row_order=k == 1,
                            notes=self.head.plan_notes())

    def set_circuit_draft(self, runner: DraftRunner | None, *, num_drafts: int | None = None,
                          bitmask: bool = False) -> None:
        """Install a host-built runner for one chain (default: the k-step chain; build it from
        `circuit_draft` with the same arguments, bound to its states), or, with None, remove every
        installed runner: all chains then draft on the eager oracle."""
        if runner is None:
            self.chains.reset(eager_runner)
            self.forward = "eager"
            return
        if not isinstance(runner, DraftRunner) or not runner.serves(1):
            raise ProposerError(f"set_circuit_draft: {runner!r} is not a DraftRunner serving width 1 "
                                "(propose drafts one sequence on the one-row program)")
        self.chains.install((num_drafts or self.num_drafts, bitmask), runner)
        self.forward = "circuit"

    def chain_runner(self, num_drafts: int | None = None, bitmask: bool = False) -> DraftRunner:
        """The runner that drafts `num_drafts` steps (built now if it was not yet)."""
        return self.chains.get(num_drafts or self.num_drafts, bitmask)

    def _execute(self, k: int, rows: ChainRows,
                 bitmask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        runner, n = self.chains.get(k, bitmask is not None), len(rows.tokens)
        self.stats[runner.plan(n).kind][n] += 1
        inputs = chain_inputs(rows, log_tau=self.log_tau, dtype=getattr(torch, self.head.dtype),
                              device=self.device)
        if bitmask is not None:
            inputs["bitmask"] = bitmask
        return runner.run(n, inputs)

    # ---- states ----
    def alloc_state(self) -> MtpProposerState:
        return MtpProposerState(owner=id(self),
                                blocks=SequenceBlocks(self.pool, self.kv.block_size,
                                                      self.kv.max_blocks_per_seq))

    def _is_mine(self, state: object) -> bool:
        return isinstance(state, MtpProposerState) and state.owner == id(self)

    def _own(self, state: object) -> MtpProposerState:
        if not self._is_mine(state):
            raise ProposerError(f"state {state!r} does not belong to this proposer")
        assert isinstance(state, MtpProposerState)
        settle(state)
        return state

    def drafter_rows(self, state: MtpProposerState) -> int:
        return self._own(state).rows

    def last_pair_key(self, state: MtpProposerState) -> int | None:
        return self._own(state).last_pair_key

    # ---- drafting ----
    def propose_batch_max(self) -> int:
        return self.chains.get(self.num_drafts, False).max_width

    def refusal(self, n: int) -> str | None:
        """Why a batch of n cannot take the n-row path (None: it can); the head decides (an MoE
        head refuses when its grouped decode is switched off or unsupported)."""
        return self.head.batch_refusal(n)

    def propose(self, last_token: int, target_hidden: torch.Tensor, position: int,
                num_drafts: int, state: MtpProposerState, *, embed_target: torch.Tensor | None = None,
                bitmask: torch.Tensor | None = None) -> list[int] | torch.Tensor:
        """One sequence on the one-row program. With `embed_target` the drafts stay on the device
        (returned as a tensor, -1 after a stop) and the last kept draft's embedding is written
        into it; nothing is copied to the host before this returns."""
        state = self._own(state)
        out, rows = self._draft([last_token], target_hidden.view(1, -1), [position], num_drafts,
                                [state], bitmask)
        if embed_target is not None:
            embed_target.copy_(self.states["embed_target"][0].view_as(embed_target))
            drafts = out["drafts"][0].clone()
            state.pending = (drafts, rows[0], position)
            self._deferred = drafts
            return drafts
        record_drafts(state, kept_drafts(out["drafts"][0].tolist()), rows[0], position)
        return state.last_drafts

    def propose_batch(self, last_tokens: Sequence[int], target_hiddens: torch.Tensor,
                      positions: Sequence[int], num_drafts: int, states: Sequence[object], *,
                      bitmask: torch.Tensor | None = None,
                      out_conf: list | None = None) -> list[list[int]] | None:
        """Every sequence in one n-row run, or None before anything runs (then propose each
        alone). `last_served` says which, and why when refused; `out_conf` receives each kept
        draft's confidence (its top-1 log-probability)."""
        n = len(last_tokens)
        reason = self._batch_refusal(n, num_drafts, states, bitmask is not None)
        if reason is not None:
            self.last_served = Served("refused", n, reason)
            return None
        mine = [self._own(s) for s in states]
        out, rows = self._draft(last_tokens, target_hiddens, positions, num_drafts, mine, bitmask)
        self.last_served = Served(self.chains.get(num_drafts, bitmask is not None).plan(n).kind, n)
        drafts, confs = out["drafts"].tolist(), out["confidences"].tolist()
        result = []
        for state, row, r, p in zip(mine, drafts, rows, positions):
            record_drafts(state, kept_drafts(row), r, p)
            result.append(state.last_drafts)
        if out_conf is not None:
            out_conf[:] = [c[:len(d)] for c, d in zip(confs, result)]
        return result

    def _batch_refusal(self, n: int, k: int, states: Sequence[object], masked: bool) -> str | None:
        if not all(self._is_mine(s) for s in states):
            return "a state of another proposer"  # the caller drafts each alone
        runner = self.chains.get(k, masked)
        if not runner.serves(n):
            return f"width {n} is not served (the {k}-step chain serves up to {runner.max_width})"
        reason = self.refusal(n)
        if reason is not None:
            warn_once(f"refuse:{reason}", f"propose_batch refused ({reason}); drafting each "
                                          "sequence alone")
        return reason

    def _draft(self, tokens: Sequence[int], hiddens: torch.Tensor, positions: Sequence[int],
               k: int, states: list[MtpProposerState], bitmask: torch.Tensor | None):
        """Validate everything, grow every table (all or nothing), then run the chain once."""
        n, c = len(tokens), self.head.config
        if not 1 <= k <= self.num_drafts:
            raise ProposerError(f"num_drafts {k} must be in 1..{self.num_drafts}")
        if len({id(s) for s in states}) != n or len(positions) != n or hiddens.shape != (n, c.hidden_size):
            raise ProposerError(f"a batch of {n} needs {n} distinct states, positions and hiddens "
                                f"[{n}, {c.hidden_size}]; got {len(states)} states, "
                                f"{len(positions)} positions, hiddens {list(hiddens.shape)}")
        check_tokens(tokens, c.vocab_size)
        if bitmask is not None:
            bitmask = check_bitmask(bitmask, n, c.vocab_size).to(self.device)
            if k > 1:
                warn_once("mask", "grammar-masked drafting with num_drafts > 1: the mask is held "
                                  "fixed across draft positions; acceptance may drop")
        live = [s.rows for s in states]
        grow_all(states, [r + k for r in live])
        rows = ChainRows(list(tokens), hiddens, list(positions), states, live)
        try:
            return self._execute(k, rows, bitmask), live
        except Exception:
            for s in states:
                s.blocks.release_unused()
            raise

    def read_deferred_draft_token(self) -> int:
        """The last kept draft of the latest deferred propose (this is where the host syncs)."""
        if self._deferred is None:
            raise ProposerError("no deferred draft: propose with an embed_target first")
        kept = kept_drafts(self._deferred.tolist())
        if not kept:
            raise ProposerError("the deferred propose drafted nothing (an all-masked first draft)")
        return kept[-1]

    # ---- drafter rows from target hiddens ----
    def prefill_drafter(self, prompt_tokens: Sequence[int], hiddens: torch.Tensor,
                        state: MtpProposerState) -> int:
        """Rows for pairs (prompt[i+1], hiddens[i]), i < P-1, into an empty state."""
        state = self._own(state)
        if state.rows:
            raise ProposerError(f"prefill_drafter into a state that holds {state.rows} rows")
        if len(prompt_tokens) < 2:
            return 0
        return self.catchup_drafter(list(prompt_tokens[1:]), hiddens[:len(prompt_tokens) - 1],
                                    0, 1, state)

    def catchup_drafter(self, tokens: Sequence[int], hiddens: torch.Tensor, row_base: int,
                        pos_base: int, state: MtpProposerState) -> int:
        """Rows row_base.. for pairs (tokens[i], hiddens[i]) at positions pos_base + i."""
        return self.catchup_batch([list(tokens)], [hiddens], [pos_base], [state],
                                  row_bases=[row_base])

    def catchup_batch(self, tokens: Sequence[Sequence[int]], hiddens: Sequence[torch.Tensor],
                      first_pos: Sequence[int], states: Sequence[MtpProposerState], *,
                      row_bases: Sequence[int] | None = None) -> int:
        """Catch-up rows for several sequences in as few n-row runs as the widths allow: each
        token is a row whose live count is its row index, so a sequence's rows attend causally
        to the ones before them (written by the same kv_write launch)."""
        states = [self._own(s) for s in states]
        bases = list(row_bases) if row_bases is not None else [s.rows for s in states]
        for s, b in zip(states, bases):
            if not 0 <= b <= s.rows:
                raise ProposerError(f"catch-up row_base {b} must be within 0..{s.rows}")
        for ts in tokens:
            check_tokens(list(ts), self.head.config.vocab_size)
        grow_all(states, [b + len(t) for b, t in zip(bases, tokens)])
        chunks = catchup_chunks(tokens, hiddens, first_pos, states, bases, self.max_width)
        for chunk in chunks:
            self._execute(1, chunk)
        for s, b, t, p in zip(states, bases, tokens, first_pos):
            if t:
                s.blocks.set_rows(max(s.rows, b + len(t)))
                s.last_pair_key = p + len(t) - 1
        return sum(len(c.tokens) for c in chunks)

    # ---- after verify and hand-over ----
    def after_verify(self, num_accepted: int, state: MtpProposerState) -> None:
        trim_after_verify(self._own(state), num_accepted, kv_exact=self.kv_exact, refeed=self.refeed)

    def take_drafter_kv(self, state: MtpProposerState) -> tuple[list[int], int, int | None] | None:
        return take_kv(self._own(state))

    def install_drafter_kv(self, state: MtpProposerState, blocks: Sequence[int], rows: int,
                           last_pair_key: int | None) -> bool:
        return install_kv(self._own(state), blocks, rows, last_pair_key)

    def free_drafter_kv(self, blocks: Sequence[int]) -> None:
        if blocks:
            self.pool.free(blocks)

    def free_state(self, state: MtpProposerState) -> None:
        free_all(self._own(state))
