"""The MTP draft proposer: `DraftProposer` (runners/contract.py) over the MTP head.

`propose` drafts one sequence on the one-row program; `propose_batch` n sequences in one n-row
run, or None before anything runs, recording how in `last_served`. Chains run on `DraftRunner`s
a factory builds at construction (compiled for "circuit", the oracle for "eager") and a host may
replace (`set_circuit_draft`): one code path whatever runs them. This module is the contract
only: rules in proposer_state.py, checks and inputs in proposer_inputs.py, all-or-nothing runs
in proposer_rows.py, runners and factories in chains.py. A state is a handle to a slot of
`self.slots` (proposer_slots.py: every state's rows, key, drafts and block table in columns),
so the batch calls (proposer_batch.py) work on slot arrays. Drafter KV lives in a paged pool
whose block 0 is the scratch block inert rows point at.

One module on purpose (it runs past 400 lines): it is the one class a host calls, the
contract's methods each a few lines that check ownership and hand over to the module that
holds the rule; what grows it is their docstrings (each the method's contract, as
runners/contract.py states it for every drafter), not logic. Split, a host's one object would
become several.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Literal, Mapping, Sequence, cast

import numpy as np
import torch

from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
from draft_circuit.circuit.planner import KV_ONLY, kv_only_circuit
from draft_circuit.runners.chains import (KV_ONLY_KEY, ChainRunners, DraftBinding,
                                          RunnerFactory, compiled_runners, eager_runner,
                                          kv_only_widths)
from draft_circuit.runners.contract import Served, ServedKind
from draft_circuit.runners.input_guard import check_runner_faults
from draft_circuit.runners.kv_cache import BlockPool
from draft_circuit.runners.hidden_rows import HiddenRows
from draft_circuit.runners.protocol import DraftRunner
from draft_circuit.runners.proposer_chunks import ChainRows
from draft_circuit.runners.proposer_inputs import (SCRATCH_BLOCK,
                                                   check_propose, confidence_log_tau,
                                                   drafter_pools)
from draft_circuit.runners.proposer_args import check_proposer_args
from draft_circuit.runners.proposer_batch import (after_verify_all, batch_refusal, catchup_all,
                                                  catchup_one, last_drafts_of, last_pair_keys_of,
                                                  propose_all, settled_slots, warn_once)
from draft_circuit.runners.proposer_device import DeviceDrafts, propose_on_device
from draft_circuit.runners.proposer_rows import run_chain
from draft_circuit.runners.proposer_slots import SlotTable
from draft_circuit.runners.proposer_step import step_all
from draft_circuit.runners.proposer_ahead import step_all_ahead
from draft_circuit.runners.staging import ChainStaging
from draft_circuit.runners.single_caller import single_caller
from draft_circuit.runners.proposer_state import (MtpProposerState, ProposerError,
                                                  free_all, install_kv, kept_drafts,
                                                  record_drafts, settle, take_kv,
                                                  trim_after_verify)

__all__ = ["DraftBinding", "MtpProposer", "SCRATCH_BLOCK", "Served"]

# single-caller (FAULTS 29): a second thread entering while one is inside raises ConcurrentCallError
@single_caller("propose", "propose_batch", "propose_batch_on_device", "verify_tokens",
               "last_drafts", "prefill_drafter", "catchup_drafter", "catchup_batch", "after_verify",
               "after_verify_batch", "last_pair_keys", "step_batch", "step_ahead",
               "alloc_state", "free_state", "take_drafter_kv", "install_drafter_kv",
               "free_drafter_kv", "read_deferred_draft_token", "set_circuit_draft")
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
        check_proposer_args(head, params, num_drafts=num_drafts, num_blocks=num_blocks,
                            block_size=block_size, max_blocks_per_seq=max_blocks_per_seq,
                            max_width=max_width, widths=widths, device=device, kv_exact=kv_exact,
                            refeed=refeed, draft_confidence_stop=draft_confidence_stop,
                            factory=factory)  # typed errors up front (ProposerArgumentError)
        self.log_tau = confidence_log_tau(draft_confidence_stop)
        # the proposer owns placement: params follow its device (a host may load on CPU)
        self.head, self.num_drafts, self.device = head, num_drafts, device
        self.params = {k: v.to(device) for k, v in params.items()}
        self.kv = KvLayout(num_blocks, block_size, max_blocks_per_seq)
        self.max_width = max_width
        self.widths = tuple(sorted({1, *(w for w in widths if w <= max_width)}))
        # catch-up and prefill rows: a step's (k + 1 a sequence) in one run of the KV-only chain
        self.kv_widths = kv_only_widths(self.widths, num_drafts)
        self.kv_exact, self.refeed, self.forward = kv_exact, refeed, forward
        self.pool = BlockPool(num_blocks, reserved=1)  # block 0: the scratch block
        self.states = drafter_pools(head, self.kv, max_width, device)
        # every state's rows, key, drafts and host block table, in columns by slot
        self.slots = SlotTable(max_blocks=max_blocks_per_seq, max_drafts=num_drafts,
                               scratch_block=SCRATCH_BLOCK)
        # persistent input/output buffers: a steady-state run builds no tensor of its own
        self.staging = ChainStaging(max_width=max(max_width, self.kv_widths[-1]),
                                    max_blocks=max_blocks_per_seq,
                                    hidden_size=head.hidden_in_size,
                                    dtype=getattr(torch, head.dtype), max_drafts=num_drafts,
                                    scratch_block=SCRATCH_BLOCK, device=device)
        if factory is None:
            factory = compiled_runners(self.widths, device=device) if forward == "circuit" \
                else eager_runner
        self.chains = ChainRunners(self.circuit_draft, factory, self.circuit_draft_kv_only)
        self._deferred: torch.Tensor | None = None
        # propose_batch_on_device's buffers and its latest batch (runners/proposer_device.py)
        self.device_drafts = DeviceDrafts(max_width=max_width, num_drafts=num_drafts, device=device)
        self.stats: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
        self.last_served: Served | None = None
        self._served: dict[tuple[ServedKind, int], Served] = {}
        self.warm_up()

    def warm_up(self) -> None:
        """Build (compile, and on a GPU capture) the chains every engine step uses: the k-step
        chain and the one-step catch-up chain, and the staging's views of their every width.
        A masked chain or another k is built on first use."""
        chain = self.chains.get(self.num_drafts, False)
        self.chains.get(1, False)
        self.staging.warm((chain, self.chains.kv_only()[0]))
        if self.device_drafts.cuda:  # (a CPU has no modules to load)
            self.device_drafts.warm(self.max_width, self.num_drafts)

    # ---- circuit binding (the host may compile and install the runners itself) ----
    def circuit_draft(self, num_drafts: int | None = None, bitmask: bool = False) -> DraftBinding:
        """The chain of `num_drafts` steps (default: the proposer's k) and what its runner binds."""
        k = num_drafts or self.num_drafts
        chain = emit_draft_chain(self.head, k, max_width=self.max_width, kv=self.kv,
                                 bitmask=bitmask, embed_target=True, confidence_stop=True)
        return DraftBinding(chain, self.params, self.states, SCRATCH_BLOCK, row_order=k == 1,
                            notes=self.head.plan_notes())

    def circuit_draft_kv_only(self) -> DraftBinding:
        """The KV-only chain of catch-up and prefill rows: the one-step chain (no embed target,
        no confidence stop) with only its K/V writes as outputs, bound to the same pools, up to
        `kv_widths[-1]` rows (compile it at `binding.widths`, the proposer's `kv_widths`)."""
        chain = kv_only_circuit(emit_draft_chain(self.head, 1, max_width=self.kv_widths[-1],
                                                 kv=self.kv))
        names = {v.name for v in chain.values}
        return DraftBinding(chain, {k: v for k, v in self.params.items() if k in names},
                            {k: v for k, v in self.states.items() if k in names}, SCRATCH_BLOCK,
                            row_order=True, notes=self.head.plan_notes(), family=KV_ONLY,
                            widths=self.kv_widths)

    def set_circuit_draft(self, runner: DraftRunner | None, *, num_drafts: int | None = None,
                          bitmask: bool = False, kv_only: bool = False) -> None:
        """Install a host-built runner for one chain (default: the k-step chain; build it from
        `circuit_draft` with the same arguments, bound to its states; `kv_only`: the catch-up
        chain, built from `circuit_draft_kv_only`), or, with None, remove every installed
        runner: all chains then draft on the eager oracle."""
        if runner is None:
            self.chains.reset(eager_runner)
            self.forward = "eager"
            return
        if not isinstance(runner, DraftRunner) or not runner.serves(1):
            raise ProposerError(f"set_circuit_draft: {runner!r} is not a DraftRunner serving width 1 "
                                "(propose drafts one sequence on the one-row program)")
        self.chains.install(KV_ONLY_KEY if kv_only else (num_drafts or self.num_drafts, bitmask),
                            runner)
        self.forward = "circuit"

    def chain_runner(self, num_drafts: int | None = None, bitmask: bool = False) -> DraftRunner:
        """The runner that drafts `num_drafts` steps (built now if it was not yet)."""
        return self.chains.get(num_drafts or self.num_drafts, bitmask)

    def _execute(self, k: int, rows: ChainRows,
                 bitmask: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if k == 1 and bitmask is None and rows.kv_only:
            return self._execute_kv(rows)
        runner, n = self.chains.get(k, bitmask is not None), len(rows.tokens)
        self.stats[runner.plan(n).kind][n] += 1
        if bitmask is not None and k > 1:
            warn_once("mask", "grammar-masked drafting with num_drafts > 1: the mask is held "
                              "fixed across draft positions; acceptance may drop")
        # a masked draft's confidence is not measured in the reference: a masked chain never stops
        log_tau = float("-inf") if bitmask is not None else self.log_tau
        # the runner's own input buffers, filled in place (it then skips its checks and copies)
        assert rows.live is not None  # run_chain read it
        inputs = self.staging.inputs(rows.tokens, rows.positions, rows.live, rows.slots,
                                     rows.hiddens, log_tau, runner, tables=self.slots.tables,
                                     advance=rows.advance)
        if bitmask is not None:  # a masked chain stages in the staging's own (read-only) views
            inputs = {**inputs, "bitmask": bitmask}
        return runner.run(n, inputs)

    def _execute_kv(self, rows: ChainRows) -> dict[str, torch.Tensor]:
        """Catch-up rows on the KV-only chain (their K/V, nothing else computed), or on the
        host's installed one-step chain."""
        (runner, kv_only), n = self.chains.kv_only(), len(rows.tokens)
        self.stats[runner.plan(n).kind][n] += 1
        assert rows.live is not None  # a catch-up chunk's own
        inputs = self.staging.inputs(rows.tokens, rows.positions, rows.live, rows.slots,
                                     rows.hiddens, None if kv_only else self.log_tau, runner,
                                     tables=self.slots.tables)
        return runner.run(n, inputs)

    # ---- states ----
    def alloc_state(self) -> MtpProposerState:
        return MtpProposerState(id(self), self.slots, self.pool, self.kv.block_size,
                                self.kv.max_blocks_per_seq)

    def _mine(self, state: object) -> MtpProposerState | None:
        """The state, settled, if this proposer allocated it; None for any other object."""
        if type(state) is not MtpProposerState or state.table is not self.slots:
            return None
        settle(state)
        return state

    def _slots(self, states: Sequence[object]) -> np.ndarray | None:
        return settled_slots(self, states)  # every state this proposer's, settled, or None

    def _own(self, state: object) -> MtpProposerState:
        mine = self._mine(state)
        if mine is None:
            raise ProposerError(f"state {state!r} does not belong to this proposer")
        return mine

    def drafter_rows(self, state: object) -> int:
        mine = self._mine(state)
        return mine.rows if mine is not None else 0

    def last_pair_key(self, state: object) -> int | None:
        mine = self._mine(state)
        return mine.last_pair_key if mine is not None else None

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
        into it; nothing is copied to the host before this returns. Zero drafts: [] (no run)."""
        state = self._own(state)
        mask = check_propose([last_token], target_hidden.view(1, -1), [position], num_drafts,
                             [state], bitmask, num_drafts_max=self.num_drafts,
                             config=self.head.config, device=self.device,
                             hidden_size=self.head.hidden_in_size)
        if num_drafts == 0:
            self._deferred = None
            record_drafts(state, [], state.rows, position)
            return []
        out, rows = self._run_chain([last_token], target_hidden.view(1, -1), [position],
                                    num_drafts, [state], mask)
        if embed_target is not None:
            embed_target.copy_(self.states["embed_target"][0].view_as(embed_target))
            drafts = out["drafts"][0].clone()
            state.pending = (drafts, int(rows[0]), position)
            self._deferred = drafts
            return drafts
        record_drafts(state, kept_drafts(out["drafts"][0].tolist()), int(rows[0]), position)
        check_runner_faults(self.chains.get(num_drafts, mask is not None))  # synced just above
        return state.last_drafts

    def check_faults(self) -> None:
        """`RunnerInputError` for a bad input row any chain runner's input guard found since its
        last check (cleared). `propose` and `propose_batch` check their chain after their sync;
        a host that runs catch-up or device-resident batches calls this where it syncs."""
        for runner in self.chains.runners():
            check_runner_faults(runner)

    def propose_batch(self, last_tokens: Sequence[int], target_hiddens: torch.Tensor | HiddenRows,
                      positions: Sequence[int], num_drafts: int, states: Sequence[object], *,
                      bitmask: torch.Tensor | None = None,
                      out_conf: list[list[float]] | None = None) -> list[list[int]] | None:
        """Every sequence in one n-row run, or None before anything runs (then propose each
        alone). `last_served` says which, and why when refused; `out_conf` receives each kept
        draft's confidence (its top-1 log-probability). `target_hiddens`: [n, H], or n rows of
        one tensor picked by index (`HiddenRows`, runners/hidden_rows.py: one gather on the
        device instead of a host-side stack)."""
        return propose_all(self, last_tokens, target_hiddens, positions, num_drafts, states,
                           bitmask, out_conf)

    def propose_batch_on_device(self, last_tokens: Sequence[int],
                                target_hiddens: torch.Tensor | HiddenRows,
                                positions: Sequence[int], num_drafts: int,
                                states: Sequence[object], *, bitmask: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`propose_batch` whose drafts stay on the device: (drafts i32[n, k], -1 after a row's
        stop; confidences f32[n, k]), or None before anything runs. Nothing is read back here:
        each state settles (its rows, key and drafts recorded, one read for the whole batch,
        from a copy already enqueued behind the chain) on the next call that touches any of
        them, as a deferred propose does. `verify_tokens()` is the batch's verify input. The
        tensors are the proposer's buffers, valid until its next device-resident batch
        (runners/proposer_device.py)."""
        return propose_on_device(self, last_tokens, target_hiddens, positions, num_drafts,
                                 states, bitmask)

    def step_batch(self, num_accepted: Sequence[int], catchup_tokens: Sequence[Sequence[int]],
                   catchup_hiddens: Sequence[torch.Tensor] | HiddenRows,
                   last_tokens: Sequence[int], target_hiddens: torch.Tensor | HiddenRows,
                   positions: Sequence[int], num_drafts: int,
                   states: Sequence[object], *, catchup_first: Sequence[int] | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The draft side of a decode step in one call: `after_verify_batch(num_accepted,
        states)`, the catch-up of `catchup_tokens[i]` with `catchup_hiddens[i]` (one a token)
        at `catchup_first[i]` (None: `last_pair_key` + 2 after the trim, 1 with no key), then
        `propose_batch_on_device(last_tokens, target_hiddens, positions, num_drafts, states)`:
        bitwise what those calls leave, the propose's return; None: trimmed and caught up, the
        propose refused (`last_served` says why). Every input is checked before anything
        changes (runners/proposer_step.py). Either hiddens may be a `HiddenRows` (the catch-up's
        picks every sequence's rows in order)."""
        return step_all(self, num_accepted, catchup_tokens, catchup_hiddens, last_tokens,
                        target_hiddens, positions, num_drafts, states, catchup_first)

    def step_ahead(self, greedy: torch.Tensor, hiddens: torch.Tensor, num_drafts: int,
                   states: Sequence[object]) -> tuple[list[list[int]], torch.Tensor] | None:
        """`step_batch` launched before the host reads the verify of the latest device-resident
        batch (`states`, in order, or the ones still waiting on it when the others were freed;
        its greedy tokens and hiddens unread on the device): the
        contract is runners/proposer_ahead.py's. Returns (the verified drafts, the next verify
        input) or None, nothing changed but the drafts' read (`last_served` says why)."""
        return step_all_ahead(self, greedy, hiddens, num_drafts, states)

    def verify_tokens(self) -> torch.Tensor:
        """The latest device-resident batch's verify input on the device: i32[n * (k + 1)], row
        i's last token then its k drafts, a -1 (after a stop) as token 0 (never accepted)."""
        return self.device_drafts.verify_tokens()

    def last_drafts(self, states: Sequence[object]) -> list[list[int]]:
        """Each state's kept drafts of its latest propose (settling a device-resident batch:
        its one read); [] for a state of another proposer."""
        return last_drafts_of(self, states)

    def last_pair_keys(self, states: Sequence[object]) -> list[int | None]:
        """`last_pair_key` of each state (None: no key, or a state of another proposer)."""
        return last_pair_keys_of(self, states)

    def _batch_refusal(self, n: int, k: int, states: Sequence[object],
                       masked: bool) -> tuple[str | None, np.ndarray]:
        return batch_refusal(self, n, k, states, masked)  # and the states' slots

    def _run_chain(self, tokens: Sequence[int], hiddens: torch.Tensor | HiddenRows,
                   positions: Sequence[int],
                   k: int, states: list[MtpProposerState], bitmask: torch.Tensor | None,
                   slots: np.ndarray | None = None
                   ) -> tuple[dict[str, torch.Tensor], Sequence[int] | np.ndarray]:
        if slots is None:
            slots = np.fromiter((s.slot for s in states), dtype=np.intp, count=len(states))
        return run_chain(self._execute, self.slots,
                         ChainRows(tokens, hiddens if isinstance(hiddens, HiddenRows)
                                   else (hiddens,), positions, slots, None, states), k, bitmask)

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
        """`catchup_drafter(prompt, hiddens, 0, 1, state)`: P - 1 rows at RoPE 1..P-1."""
        return self.catchup_drafter(prompt_tokens, hiddens, 0, 1, state)

    def catchup_drafter(self, tokens: Sequence[int], hiddens: torch.Tensor, row_base: int,
                        pos_base: int, state: MtpProposerState) -> int:
        """Row r pairs tokens[r + 1] with hiddens[r] at RoPE pos_base + r: len(tokens) - 1 rows,
        written only when row_base is the state's row count (else 0, nothing written)."""
        return catchup_one(self, tokens, hiddens, row_base, pos_base, state)

    def catchup_batch(self, tokens: Sequence[Sequence[int]],
                      hiddens: Sequence[torch.Tensor] | HiddenRows, first_pos: Sequence[int],
                      states: Sequence[object]) -> int:
        """tokens[i][k] with hiddens[i][k] at RoPE first_pos[i] + k, appended at each state's row
        count; every count is checked before anything runs (0 when a state is not this
        proposer's). `hiddens` may be one `HiddenRows` picking every sequence's rows in order."""
        return catchup_all(self, tokens, hiddens, first_pos, states)

    # ---- after verify and hand-over ----
    def after_verify(self, num_accepted: int, state: MtpProposerState) -> None:
        trim_after_verify(self._own(state), num_accepted, kv_exact=self.kv_exact, refeed=self.refeed)

    def after_verify_batch(self, num_accepted: Sequence[int], states: Sequence[object]) -> None:
        """`after_verify(num_accepted[i], states[i])` for every state, as array operations over
        their slots: one ownership check (the first foreign state raises, as after_verify's),
        every count checked before any state is trimmed (all or nothing), distinct states."""
        after_verify_all(self, num_accepted, states)

    def take_drafter_kv(self, state: object) -> tuple[list[int], int, int | None] | None:
        mine = self._mine(state)
        return take_kv(mine) if mine is not None else None

    def install_drafter_kv(self, state: object, blocks: Sequence[int], rows: int,
                           last_pair_key: int | None) -> bool:
        mine = self._mine(state)
        return install_kv(mine, blocks, rows, last_pair_key) if mine is not None else False

    def free_drafter_kv(self, blocks: Sequence[int]) -> None:
        if blocks:
            self.pool.free(blocks)

    def free_state(self, state: MtpProposerState) -> None:
        """`free_all` (proposer_state.py): the state emptied, what it holds left unsettled."""
        if type(state) is not MtpProposerState or state.table is not self.slots:
            raise ProposerError(f"state {state!r} does not belong to this proposer")
        free_all(state)
