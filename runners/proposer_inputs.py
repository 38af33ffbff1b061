"""What the proposer checks before a chain runs: token ids, bitmasks, positions, target hiddens
(tensors or picked rows), catch-up counts; and the chains' states and confidence threshold it
builds once. Nothing here runs a chain or changes a state; every check raises before anything
changes. The rows of a run are built in runners/proposer_chunks.py, run in proposer_rows.py."""
from __future__ import annotations

import math
from itertools import chain, repeat
from operator import attrgetter
from typing import Iterable, Sequence

import torch

from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead
from draft_circuit.ops.tokens import TokenError
from draft_circuit.ops.sampling import mask_words
from draft_circuit.runners.hidden_rows import HiddenRows, check_hidden_rows
from draft_circuit.runners.proposer_slots import SMALL_BATCH
from draft_circuit.runners.proposer_state import MtpProposerState, ProposerError

#: block 0 of the drafter pool: what inert rows and the unused tail of every table point at
SCRATCH_BLOCK = 0


class HiddenWidthError(ProposerError):
    """Target hiddens of another width than the head reads (`head.hidden_in_size`: the target's
    hidden for an MTP head, three tapped target hiddens concatenated for EAGLE-3)."""


def confidence_log_tau(tau: float | None) -> float:
    """log(tau) for the chain's confidence stop (-inf: no stop); tau must lie in (0, 1)."""
    if tau is None:
        return float("-inf")
    if not 0 < tau < 1:  # NaN fails this too
        raise ProposerError(f"draft_confidence_stop must be in (0, 1) exclusive, got {tau!r}")
    return math.log(tau)


def drafter_pools(head: MtpHead, kv: KvLayout, max_width: int,
                  device: str | torch.device) -> dict[str, torch.Tensor]:
    """The chains' states: the paged drafter-KV pools in the shapes the head declares (GQA's K
    and V, an MLA head's roped keys and latents) and the embed target (one row a sequence)."""
    dtype = getattr(torch, head.dtype)
    k_shape, v_shape = head.cache_shapes(kv)
    return {"k_cache": torch.zeros(k_shape, dtype=dtype, device=device),
            "v_cache": torch.zeros(v_shape, dtype=dtype, device=device),
            "embed_target": torch.zeros(max_width, head.config.hidden_size, dtype=dtype,
                                        device=device)}


def plain_ints(values: Iterable[object]) -> bool:
    """Every value a plain int (not a bool or another subclass), in one C-level pass (no Python
    statement a value: this is per-step host work)."""
    return set(map(type, values)) <= _INT


_INT = {int}


def check_tokens(tokens: Sequence[int], vocab: int, where: str = "") -> None:
    """Every id an int in [0, vocab): a bad id is refused before the embedding gather."""
    # per-step host work: the common case in C-level passes, the row-by-row loop only to name
    # the bad one (an int subclass such as bool takes the loop, which admits it as before)
    if plain_ints(tokens) and (not tokens or (min(tokens) >= 0
                                                              and max(tokens) < vocab)):
        return
    for i, t in enumerate(tokens):
        if not isinstance(t, int) or not 0 <= t < vocab:
            raise TokenError(f"token {t!r} at row {i}{where} is outside the vocabulary [0, {vocab})")


def check_bitmask(bitmask: torch.Tensor, n: int, vocab: int) -> torch.Tensor:
    """An int32 [n, ceil(vocab/32)] mask (a 1-D mask for one row is viewed as [1, words])."""
    words = mask_words(vocab)
    if bitmask.dtype != torch.int32:
        raise ProposerError(f"bitmask must be int32, got {bitmask.dtype}")
    mask = bitmask.view(1, -1) if bitmask.dim() == 1 else bitmask
    if mask.shape != (n, words):
        raise ProposerError(f"bitmask must be [{n}, {words}] (ceil({vocab}/32) words a row), got "
                            f"{list(bitmask.shape)}")
    return mask


def check_num_drafts(k: object, num_drafts: int) -> None:
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= num_drafts:
        raise ProposerError(f"num_drafts {k!r} must be in 0..{num_drafts}")


def check_propose(tokens: Sequence[int], hiddens: torch.Tensor | HiddenRows,
                  positions: Sequence[int], k: int,
                  states: Sequence[MtpProposerState], bitmask: torch.Tensor | None, *,
                  num_drafts_max: int, config: MtpConfig,
                  device: str | torch.device, hidden_size: int | None = None,
                  distinct: bool = False, what: str = "propose_batch target_hiddens"
                  ) -> torch.Tensor | None:
    """Every check a propose makes before anything changes; returns the checked bitmask on the
    proposer's device. `hiddens`: [n, hidden_size], or n rows picked from one tensor
    (runners/hidden_rows.py; a bad pick's error names `what`). `hidden_size`: the head's
    `hidden_in_size` (None: config.hidden_size); `distinct`: the states are known distinct
    (`SlotTable.distinct`), else counted here."""
    n, c = len(tokens), config
    width = c.hidden_size if hidden_size is None else hidden_size
    check_num_drafts(k, num_drafts_max)
    if isinstance(hiddens, HiddenRows):
        check_hidden_rows(hiddens, n, width, what)
        shape: tuple[int, ...] = (n, width)
    else:
        if not isinstance(hiddens, torch.Tensor):
            raise ProposerError(f"{what}: hiddens must be a tensor [{n}, {width}] or HiddenRows, "
                                f"got {type(hiddens).__name__}")
        shape = tuple(hiddens.shape)
        if hiddens.dim() == 2 and hiddens.shape[1] != width:
            raise HiddenWidthError(f"{what}: hiddens must be [{n}, {width}], got {list(shape)}: "
                                   f"target hiddens {hiddens.shape[1]} wide, the head reads "
                                   f"{width} (its hidden_in_size)")
    if len(states) != n or (not distinct and len(set(map(id, states))) != n) \
            or len(positions) != n or shape != (n, width):
        raise ProposerError(f"a batch of {n} needs {n} distinct states, positions and hiddens "
                            f"[{n}, {width}]; got {len(states)} states, "
                            f"{len(positions)} positions, hiddens {list(shape)}")
    if not (plain_ints(positions) and (not positions or min(positions) >= 1)):
        for i, p in enumerate(positions):  # only to name the bad row (see check_tokens)
            check_position(p, f"row {i}: position")
    check_tokens(tokens, c.vocab_size)
    return None if bitmask is None else check_bitmask(bitmask, n, c.vocab_size).to(device)


def check_position(position: object, what: str) -> None:
    """A drafter row sits at RoPE position >= 1: it pairs its token with the target hidden one
    position before it (whose position is the row's pair key, never negative)."""
    if isinstance(position, bool) or not isinstance(position, int) or position < 1:
        raise ProposerError(f"{what} {position!r} must be an int >= 1 (a drafter row at RoPE "
                            "position p pairs its token with the target hidden at p - 1)")


def _num_hiddens(hiddens: object, hidden_size: int, what: str) -> int:
    if isinstance(hiddens, torch.Tensor) and hiddens.dim() == 2 and hiddens.shape[1] != hidden_size:
        raise HiddenWidthError(f"{what}: hiddens must be [rows, {hidden_size}], got {list(hiddens.shape)}: "
                               f"target hiddens {hiddens.shape[1]} wide, the head reads {hidden_size} "
                               "(its hidden_in_size)")
    if not isinstance(hiddens, torch.Tensor) or hiddens.dim() != 2:
        shape = list(hiddens.shape) if isinstance(hiddens, torch.Tensor) else type(hiddens).__name__
        raise ProposerError(f"{what}: hiddens must be [rows, {hidden_size}], got {shape}")
    return int(hiddens.shape[0])


def check_catchup_counts(tokens: Sequence[Sequence[int]],
                         hiddens: Sequence[torch.Tensor] | HiddenRows,
                         first_pos: Sequence[int] | None, states: Sequence[object], *,
                         hidden_size: int, vocab: int, distinct: bool = False,
                         what: str = "catchup_batch", arg: str = "hiddens") -> list[int] | None:
    """catchup_batch's counts, all before anything runs: one token list, hidden list, first
    position and state per sequence, as many hiddens as tokens in each (or one HiddenRows
    picking every sequence's rows in order, as many as their tokens: runners/hidden_rows.py),
    distinct states (`distinct`: known so, `SlotTable.distinct`), valid positions and token
    ids. Each error names the call (`what`), the sequence and the counts. `first_pos` None:
    the positions are the proposer's own (step_batch's, from each state's key), nothing to
    check. Returns the token ids in row order when the check made that list (past SMALL_BATCH
    sequences: the catch-up's rows are built from it). `arg`: the hiddens' argument name, which
    a bad pick's error gives after the call's."""
    if isinstance(hiddens, HiddenRows):
        return _check_picked(tokens, hiddens, first_pos, states, hidden_size=hidden_size,
                             vocab=vocab, distinct=distinct, what=what, arg=arg)
    counts = (len(tokens), len(hiddens), len(states if first_pos is None else first_pos),
              len(states))
    if len(set(counts)) != 1:
        raise ProposerError(f"{what}: {counts[0]} token lists, {counts[1]} hidden lists, "
                            f"{counts[2]} first positions and {counts[3]} states: one of each per "
                            "sequence")
    if not distinct and len(set(map(id, states))) != len(states):
        raise ProposerError(f"{what}: a state appears twice (its rows would be written twice "
                            "at the same row)")
    ok, flat = _catchup_ok(tokens, hiddens, first_pos, hidden_size, vocab)
    if ok:
        return flat  # per-step host work: the loop below runs only to name what is wrong
    for i, (ts, hs) in enumerate(zip(tokens, hiddens)):
        m = _num_hiddens(hs, hidden_size, f"{what} sequence {i}")
        if m != len(ts):
            raise ProposerError(f"{what} sequence {i}: {len(ts)} tokens but {m} hiddens "
                                "(token k pairs with hidden k)")
        if first_pos is not None:
            check_position(first_pos[i], f"{what} sequence {i}: first position")
        check_tokens(list(ts), vocab, f" of sequence {i}")
    return None  # (the fast pass is stricter than the loop: what it refused, the loop admits)


def _check_picked(tokens: Sequence[Sequence[int]], hiddens: HiddenRows,
                  first_pos: Sequence[int] | None, states: Sequence[object], *,
                  hidden_size: int, vocab: int, distinct: bool, what: str,
                  arg: str) -> list[int]:
    """`check_catchup_counts` of a catch-up whose hiddens are one HiddenRows: the same counts,
    the pick's rows as many as the tokens; returns the token ids in row order."""
    counts = (len(tokens), len(states if first_pos is None else first_pos), len(states))
    if len(set(counts)) != 1:
        raise ProposerError(f"{what}: {counts[0]} token lists, {counts[1]} first positions and "
                            f"{counts[2]} states: one of each per sequence")
    if not distinct and len(set(map(id, states))) != len(states):
        raise ProposerError(f"{what}: a state appears twice (its rows would be written twice "
                            "at the same row)")
    flat = list(chain.from_iterable(tokens))
    check_hidden_rows(hiddens, len(flat), hidden_size, f"{what} {arg}")
    if first_pos is not None and not (plain_ints(first_pos) and (not first_pos
                                                                 or min(first_pos) >= 1)):
        for i, p in enumerate(first_pos):  # only to name the bad sequence
            check_position(p, f"{what} sequence {i}: first position")
    if not (plain_ints(flat) and (not flat or (min(flat) >= 0 and max(flat) < vocab))):
        for i, ts in enumerate(tokens):  # only to name the bad sequence
            check_tokens(list(ts), vocab, f" of sequence {i}")
    return flat


def _catchup_ok(tokens: Sequence[Sequence[int]], hiddens: Sequence[torch.Tensor],
                first_pos: Sequence[int] | None, hidden_size: int,
                vocab: int) -> tuple[bool, list[int] | None]:
    """(True, ...) when every check of `check_catchup_counts`' loop passes, in as few Python
    steps a sequence as it takes (False: the loop runs and names the first failure; anything
    unusual, such as a tensor subclass or a bool, takes the loop too), and past SMALL_BATCH
    sequences the token ids in row order (the list the range check read)."""
    if first_pos is not None and (not plain_ints(first_pos)
                                  or (first_pos and min(first_pos) < 1)):
        return False, None
    if 0 < len(hiddens) <= SMALL_BATCH:  # a few sequences: a bounded loop costs less
        for ts, hs in zip(tokens, hiddens):
            # a torch.Size is a tuple: rank, rows and width in one comparison
            if type(hs) is not torch.Tensor or hs.shape != (len(ts), hidden_size):
                return False, None
        flat = list(chain.from_iterable(tokens))
        ok = plain_ints(flat) and (not flat or (min(flat) >= 0 and max(flat) < vocab))
        return ok, None
    if not hiddens:
        return True, None
    # C-level passes: types, then every shape against (its tokens, width) in one list
    # comparison (a torch.Size is a tuple: rank, rows and width at once), the token types,
    # then their range on the array the rows are built from
    if set(map(type, hiddens)) != {torch.Tensor} or \
            list(map(_SHAPE, hiddens)) != list(zip(map(len, tokens), repeat(hidden_size))):
        return False, None
    flat = list(chain.from_iterable(tokens))
    if not plain_ints(flat) or (flat and (min(flat) < 0 or max(flat) >= vocab)):
        return False, None
    return True, flat


def check_drafter_pairs(tokens: Sequence[int], hiddens: torch.Tensor, pos_base: int, *,
                        hidden_size: int, vocab: int, what: str) -> None:
    """catchup_drafter's / prefill_drafter's counts: row r pairs tokens[r + 1] with hiddens[r],
    so hiddens are one per token (the last pairs with no later token and is unused) or one fewer."""
    m = _num_hiddens(hiddens, hidden_size, what)
    if m not in (len(tokens), max(len(tokens) - 1, 0)):
        raise ProposerError(f"{what}: {len(tokens)} tokens but {m} hiddens (row r pairs "
                            f"tokens[r + 1] with hiddens[r]: give {len(tokens)} or "
                            f"{max(len(tokens) - 1, 0)} hiddens)")
    check_position(pos_base, f"{what}: pos_base")
    check_tokens(list(tokens), vocab)


_SHAPE = attrgetter("shape")
