"""The MTP draft proposer: what a host engine calls (DESIGN.md, "The proposer contract").

`propose` drafts one sequence on the one-row program; `propose_batch` drafts n sequences in one
run of the n-row program, or returns None ("not served here: propose each alone") before
anything runs. Both forwards, `circuit` (compiled programs, CUDA graphs on a GPU) and `eager`
(the oracle), share one code path that differs only in the runner that executes the chain, so
they behave the same. Drafter KV lives in a paged pool whose block 0 is the scratch block inert
rows point at. This module is the contract's glue; the rules live in proposer_state.py.
"""
from __future__ import annotations

import logging
import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Literal, Mapping, Sequence

import torch

from draft_circuit.circuit.ir import Circuit
from draft_circuit.circuit.planner import compile_draft
from draft_circuit.ops.attention import TokenError
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.ops.sampling import mask_words
from draft_circuit.runners.draft import CircuitDraftRunner, WidthPolicy
from draft_circuit.runners.eager import EagerRunner
from draft_circuit.runners.kv_cache import BlockPool, SequenceBlocks
from draft_circuit.runners.proposer_state import (MtpProposerState, ProposerError, kept_drafts,
                                    rows_to_trim)

log = logging.getLogger(__name__)
_WARNED: set[str] = set()  # once-per-process warnings
SCRATCH_BLOCK = 0


def warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        log.warning(message)


@dataclass(frozen=True)
class DraftBinding:
    """A draft circuit and the params it binds: what a host compiles for `--forward circuit`."""

    circuit: Circuit
    params: Mapping[str, torch.Tensor]


class MtpProposer:
    def __init__(self, head: MtpHead, params: Mapping[str, torch.Tensor], *, num_drafts: int,
                 num_blocks: int, block_size: int = 16, max_blocks_per_seq: int,
                 max_width: int = 64, widths: Sequence[int] = (1, 2, 4, 8, 16, 32, 64),
                 forward: Literal["eager", "circuit"] = "circuit", device: str = "cpu",
                 kv_exact: bool = True, refeed: bool = False,
                 draft_confidence_stop: float | None = None) -> None:
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
        self._runners: dict[tuple[int, bool], object] = {}
        self._installed: object | None = None
        self._deferred: torch.Tensor | None = None
        self.stats: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        if forward == "circuit":
            self.warm_up()

    def warm_up(self) -> None:
        """Compile (and on a GPU capture) the chains every engine step uses, now rather than on
        the first propose: the k-step chain and the one-step catch-up chain. A masked chain or
        another k is compiled on first use."""
        self._runner(self.num_drafts, False)
        self._runner(1, False)

    # ---- circuit binding (the host may compile and install the runner itself) ----
    def circuit_draft(self, num_drafts: int | None = None, bitmask: bool = False) -> DraftBinding:
        return DraftBinding(self._chain(num_drafts or self.num_drafts, bitmask), self.params)

    def set_circuit_draft(self, runner: object | None) -> None:
        """Install the host-compiled runner of the default chain, or remove it (eager drafting)."""
        self._installed = runner
        self.forward = "circuit" if runner is not None else "eager"
        self._runners.clear()

    def _chain(self, k: int, bitmask: bool) -> Circuit:
        return emit_draft_chain(self.head, k, max_width=self.max_width, kv=self.kv, bitmask=bitmask,
                                embed_target=True, confidence_stop=True)

    def _runner(self, k: int, bitmask: bool):
        key = (k, bitmask)
        if key not in self._runners:
            if self.forward == "eager":
                self._runners[key] = EagerRunner(self._chain(k, bitmask), self.params, self.states)
            elif self._installed is not None and key == (self.num_drafts, False):
                self._runners[key] = self._installed
            else:
                compiled = compile_draft(self._chain(k, bitmask), self.params, self.widths,
                                         device=self.device, notes=self.head.plan_notes())
                # catch-up rows of one sequence must run in row order: pad, never split
                policy = WidthPolicy(allow_split=k > 1)
                self._runners[key] = CircuitDraftRunner(compiled, self.states,
                                                        scratch_block=SCRATCH_BLOCK, policy=policy)
        return self._runners[key]

    def _execute(self, k: int, bitmask: bool, n: int, inputs: dict) -> dict[str, torch.Tensor]:
        runner = self._runner(k, bitmask)
        if isinstance(runner, EagerRunner):
            self.stats["eager"][n] += 1
            return runner.run(inputs)
        self.stats[runner.plan(n).kind][n] += 1
        return runner.run(n, inputs)

    # ---- states ----
    def alloc_state(self) -> MtpProposerState:
        return MtpProposerState(owner=id(self),
                                blocks=SequenceBlocks(self.pool, self.kv.block_size,
                                                      self.kv.max_blocks_per_seq))

    def _own(self, state: object) -> MtpProposerState:
        if not isinstance(state, MtpProposerState) or state.owner != id(self):
            raise ProposerError(f"state {state!r} does not belong to this proposer")
        self._settle(state)
        return state

    def _settle(self, state: MtpProposerState) -> None:
        """Read a deferred propose's drafts (the one host sync it postponed) into the state."""
        if state.pending is not None:
            drafts, rows, position = state.pending
            state.pending = None
            self._record(state, kept_drafts(drafts.tolist()), rows, position)

    def _record(self, state: MtpProposerState, drafts: list[int], rows: int, position: int) -> None:
        state.blocks.set_rows(rows + len(drafts))  # a stopped row wrote no further row
        state.last_num_drafted, state.last_drafts = len(drafts), drafts
        state.last_pair_key = position + len(drafts) - 1 if drafts else state.last_pair_key

    def drafter_rows(self, state: MtpProposerState) -> int:
        return self._own(state).rows

    def last_pair_key(self, state: MtpProposerState) -> int | None:
        return self._own(state).last_pair_key

    # ---- drafting ----
    def propose_batch_max(self) -> int:
        runner = self._runner(self.num_drafts, False)
        return runner.max_width if not isinstance(runner, EagerRunner) else self.max_width

    def refusal(self, n: int) -> str | None:
        """Why a batch of n cannot take the n-row path (None: it can); the head decides (an MoE
        head refuses when its grouped decode is switched off or unsupported)."""
        return self.head.batch_refusal(n)

    def propose(self, last_token: int, target_hidden: torch.Tensor, position: int,
                num_drafts: int, state: MtpProposerState, *, embed_target: torch.Tensor | None = None,
                bitmask: torch.Tensor | None = None):
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
        self._record(state, kept_drafts(out["drafts"][0].tolist()), rows[0], position)
        return state.last_drafts

    def propose_batch(self, last_tokens: Sequence[int], target_hiddens: torch.Tensor,
                      positions: Sequence[int], num_drafts: int, states: Sequence[object], *,
                      bitmask: torch.Tensor | None = None,
                      out_conf: list | None = None) -> list[list[int]] | None:
        n = len(last_tokens)
        if not all(isinstance(s, MtpProposerState) and s.owner == id(self) for s in states):
            return None  # a state of another proposer: the caller drafts each alone
        runner = self._runner(num_drafts, bitmask is not None)
        if not isinstance(runner, EagerRunner) and not runner.serves(n):
            return None
        if n > self.max_width:
            return None
        reason = self.refusal(n)
        if reason is not None:
            warn_once(f"refuse:{reason}", f"propose_batch refused ({reason}); drafting each "
                                          "sequence alone")
            return None
        states = [self._own(s) for s in states]
        out, rows = self._draft(last_tokens, target_hiddens, positions, num_drafts, states, bitmask)
        drafts, confs = out["drafts"].tolist(), out["confidences"].tolist()
        result = []
        for state, row, conf, r, p in zip(states, drafts, confs, rows, positions):
            self._record(state, kept_drafts(row), r, p)
            result.append(state.last_drafts)
        if out_conf is not None:
            out_conf[:] = [c[:len(d)] for c, d in zip(confs, result)]
        return result

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
        _check_tokens(tokens, c.vocab_size)
        if bitmask is not None:
            bitmask = _check_bitmask(bitmask, n, c.vocab_size).to(self.device)
            if k > 1:
                warn_once("mask", "grammar-masked drafting with num_drafts > 1: the mask is held "
                                  "fixed across draft positions; acceptance may drop")
        rows = [s.rows for s in states]
        self._grow(states, [r + k for r in rows])
        inputs = self._rows_inputs(tokens, hiddens, positions, states, rows)
        if bitmask is not None:
            inputs["bitmask"] = bitmask
        try:
            return self._execute(k, bitmask is not None, n, inputs), rows
        except Exception:
            for s in states:
                s.blocks.release_unused()
            raise

    def _grow(self, states: list[MtpProposerState], rows: list[int]) -> None:
        grown = []
        try:
            for s, r in zip(states, rows):
                s.blocks.ensure_rows(r)
                grown.append(s)
        except Exception:
            for s in grown:  # nothing half-allocated: give back what this call took
                s.blocks.release_unused()
            raise

    def _rows_inputs(self, tokens, hiddens, positions, states, live) -> dict[str, torch.Tensor]:
        dev, n = self.device, len(tokens)
        tables = [s.blocks.table_row(SCRATCH_BLOCK) for s in states]
        return {"tokens": torch.tensor(list(tokens), dtype=torch.int32, device=dev),
                "hidden": hiddens.to(device=dev, dtype=getattr(torch, self.head.dtype)),
                "positions": torch.tensor(list(positions), dtype=torch.int32, device=dev),
                "block_tables": torch.tensor(tables, dtype=torch.int32, device=dev),
                "live_rows": torch.tensor(list(live), dtype=torch.int32, device=dev),
                "active": torch.ones(n, dtype=torch.int32, device=dev),
                "log_tau": torch.full((n,), self.log_tau, dtype=torch.float32, device=dev)}

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
            _check_tokens(list(ts), self.head.config.vocab_size)
        self._grow(states, [b + len(t) for b, t in zip(bases, tokens)])
        flat = [(s, t, h, p + i, b + i) for s, ts, hs, p, b in zip(states, tokens, hiddens, first_pos, bases)
                for i, (t, h) in enumerate(zip(ts, hs))]
        for start in range(0, len(flat), self.max_width):
            chunk = flat[start:start + self.max_width]
            inputs = self._rows_inputs([t for _, t, _, _, _ in chunk],
                                       torch.stack([h for _, _, h, _, _ in chunk]),
                                       [p for _, _, _, p, _ in chunk], [s for s, *_ in chunk],
                                       [r for *_, r in chunk])
            self._execute(1, False, len(chunk), inputs)
        for s, b, t, p in zip(states, bases, tokens, first_pos):
            if t:
                s.blocks.set_rows(max(s.rows, b + len(t)))
                s.last_pair_key = p + len(t) - 1
        return len(flat)

    # ---- after verify and hand-over ----
    def after_verify(self, num_accepted: int, state: MtpProposerState) -> None:
        state = self._own(state)
        if not 0 <= num_accepted <= max(state.last_num_drafted, 0):
            raise ProposerError(f"num_accepted {num_accepted} exceeds the {state.last_num_drafted} "
                                "drafts of the last propose")
        trim = min(rows_to_trim(state.last_num_drafted, num_accepted, kv_exact=self.kv_exact,
                                refeed=self.refeed), state.rows)
        if trim:
            state.blocks.set_rows(state.rows - trim)
            if state.last_pair_key is not None:
                state.last_pair_key -= trim
        state.last_num_drafted = 0  # a second call trims nothing more

    def take_drafter_kv(self, state: MtpProposerState) -> tuple[list[int], int, int | None] | None:
        state = self._own(state)
        if not state.blocks.blocks or state.rows == 0:
            return None
        key = state.last_pair_key
        blocks, rows = state.blocks.take()
        state.last_pair_key, state.last_num_drafted = None, 0
        return blocks, rows, key

    def install_drafter_kv(self, state: MtpProposerState, blocks: Sequence[int], rows: int,
                           last_pair_key: int | None) -> bool:
        state = self._own(state)
        if not state.is_empty() or not state.blocks.install(blocks, rows):
            return False
        state.last_pair_key = last_pair_key
        return True

    def free_drafter_kv(self, blocks: Sequence[int]) -> None:
        if blocks:
            self.pool.free(blocks)

    def free_state(self, state: MtpProposerState) -> None:
        state = self._own(state)
        state.blocks.free()
        state.last_pair_key, state.last_num_drafted, state.last_drafts = None, 0, []


def _check_tokens(tokens: Sequence[int], vocab: int) -> None:
    for i, t in enumerate(tokens):
        if not isinstance(t, int) or not 0 <= t < vocab:
            raise TokenError(f"token {t!r} at row {i} is outside the vocabulary [0, {vocab})")


def _check_bitmask(bitmask: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
    words = mask_words(vocab)
    if bitmask.dtype != torch.int32:
        raise ProposerError(f"bitmask must be int32, got {bitmask.dtype}")
    mask = bitmask.view(1, -1) if bitmask.dim() == 1 else bitmask
    if mask.shape != (n, words):
        raise ProposerError(f"bitmask must be [{n}, {words}] (ceil({vocab}/32) words a row), got "
                            f"{list(bitmask.shape)}")
    return mask
