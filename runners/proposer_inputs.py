"""What the proposer checks and builds before a chain runs: token ids, bitmasks, all-or-nothing
block-table growth, and the runner inputs of a set of rows. Nothing here runs a chain; every
check raises before anything changes."""
from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import chain
from typing import Sequence

import torch

from draft_circuit.circuit.layers.config import MtpConfig
from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead
from draft_circuit.ops.tokens import TokenError
from draft_circuit.ops.sampling import mask_words
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


def check_tokens(tokens: Sequence[int], vocab: int, where: str = "") -> None:
    """Every id an int in [0, vocab): a bad id is refused before the embedding gather."""
    # per-step host work: the common case in C-level passes, the row-by-row loop only to name
    # the bad one (an int subclass such as bool takes the loop, which admits it as before)
    if all(type(t) is int for t in tokens) and (not tokens or (min(tokens) >= 0
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


def check_propose(tokens: Sequence[int], hiddens: torch.Tensor, positions: Sequence[int], k: int,
                  states: Sequence[MtpProposerState], bitmask: torch.Tensor | None, *,
                  num_drafts_max: int, config: MtpConfig,
                  device: str | torch.device, hidden_size: int | None = None) -> torch.Tensor | None:
    """Every check a propose makes before anything changes; returns the checked bitmask on the
    proposer's device. `hidden_size`: the head's `hidden_in_size` (None: config.hidden_size)."""
    n, c = len(tokens), config
    width = c.hidden_size if hidden_size is None else hidden_size
    check_num_drafts(k, num_drafts_max)
    if hiddens.dim() == 2 and hiddens.shape[1] != width:
        raise HiddenWidthError(f"hiddens must be [{n}, {width}], got {list(hiddens.shape)}: target hiddens "
                               f"{hiddens.shape[1]} wide, the head reads {width} (its hidden_in_size)")
    if len({id(s) for s in states}) != n or len(positions) != n or hiddens.shape != (n, width):
        raise ProposerError(f"a batch of {n} needs {n} distinct states, positions and hiddens "
                            f"[{n}, {width}]; got {len(states)} states, "
                            f"{len(positions)} positions, hiddens {list(hiddens.shape)}")
    if not (all(type(p) is int for p in positions) and (not positions or min(positions) >= 1)):
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


def check_catchup_counts(tokens: Sequence[Sequence[int]], hiddens: Sequence[torch.Tensor],
                         first_pos: Sequence[int], states: Sequence[object], *, hidden_size: int,
                         vocab: int) -> None:
    """catchup_batch's counts, all before anything runs: one token list, hidden list, first
    position and state per sequence, as many hiddens as tokens in each, distinct states, valid
    positions and token ids. Each error names the sequence and the counts."""
    counts = (len(tokens), len(hiddens), len(first_pos), len(states))
    if len(set(counts)) != 1:
        raise ProposerError(f"catchup_batch: {counts[0]} token lists, {counts[1]} hidden lists, "
                            f"{counts[2]} first positions and {counts[3]} states: one of each per "
                            "sequence")
    if len({id(s) for s in states}) != len(states):
        raise ProposerError("catchup_batch: a state appears twice (its rows would be written twice "
                            "at the same row)")
    if _catchup_ok(tokens, hiddens, first_pos, hidden_size, vocab):
        return  # per-step host work: the loop below runs only to name what is wrong
    for i, (ts, hs, p) in enumerate(zip(tokens, hiddens, first_pos)):
        m = _num_hiddens(hs, hidden_size, f"catchup_batch sequence {i}")
        if m != len(ts):
            raise ProposerError(f"catchup_batch sequence {i}: {len(ts)} tokens but {m} hiddens "
                                "(token k pairs with hidden k)")
        check_position(p, f"catchup_batch sequence {i}: first position")
        check_tokens(list(ts), vocab, f" of sequence {i}")


def _catchup_ok(tokens: Sequence[Sequence[int]], hiddens: Sequence[torch.Tensor],
                first_pos: Sequence[int], hidden_size: int, vocab: int) -> bool:
    """True when every check of `check_catchup_counts`' loop passes, in as few Python steps a
    sequence as it takes (False: the loop runs and names the first failure; anything unusual,
    such as a tensor subclass or a bool, takes the loop too)."""
    for ts, hs in zip(tokens, hiddens):
        if type(hs) is not torch.Tensor or hs.dim() != 2 or hs.shape[1] != hidden_size \
                or hs.shape[0] != len(ts):
            return False
    flat = list(chain.from_iterable(tokens))
    if not all(type(t) is int for t in flat) or (flat and (min(flat) < 0 or max(flat) >= vocab)):
        return False
    return all(type(p) is int for p in first_pos) and (not first_pos or min(first_pos) >= 1)


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


def grow_all(states: Sequence[MtpProposerState], rows: Sequence[int]) -> None:
    """Give every state storage for its rows, or none of them any more than before: a table that
    would overflow or a pool that runs dry raises with nothing half-allocated."""
    grown: list[MtpProposerState] = []
    try:
        for s, r in zip(states, rows):
            if r > s.blocks.capacity_rows:  # steady state: most tables have room already
                s.blocks.ensure_rows(r)
                grown.append(s)
    except Exception:
        for s in grown:
            s.blocks.release_unused()
        raise


@dataclass(frozen=True)
class ChainRows:
    """The rows of one chain run: row i belongs to states[i], holds `live[i]` drafter rows before
    this run and writes its first row at RoPE position `positions[i]`."""

    tokens: list[int]
    hiddens: Sequence[torch.Tensor]  # the rows' hiddens: segments [m, H] adding up to n rows
    positions: list[int]
    states: list[MtpProposerState]
    live: list[int]
    kv_only: bool = False   # catch-up rows: only their K/V is wanted (the KV-only chain)


def catchup_chunks(tokens: Sequence[Sequence[int]], hiddens: Sequence[torch.Tensor],
                   first_pos: Sequence[int], states: Sequence[MtpProposerState],
                   bases: Sequence[int], width: int) -> list[ChainRows]:
    """Catch-up rows of several sequences as one-step chain runs of at most `width` rows, in
    row order: sequence i's k-th row pairs tokens[i][k] with hiddens[i][k] at RoPE position
    first_pos[i] + k and is written at drafter row bases[i] + k, attending to the rows before
    it (earlier chunks, or earlier rows of the same kv_write launch). Built a sequence's run of
    rows at a time (one hidden view each), not row by row: this is per-step host work."""
    chunks: list[ChainRows] = []
    toks: list[int] = []
    pos: list[int] = []
    live: list[int] = []
    owners: list[MtpProposerState] = []
    segments: list[torch.Tensor] = []
    for ts, h, p, b, s in zip(tokens, hiddens, first_pos, bases, states):
        done, m = 0, len(ts)
        if 0 < m and len(toks) + m < width:  # the common case: the sequence fits, the chunk
            toks += ts                       # stays open (fewer list operations a sequence)
            pos += range(p, p + m)
            live += range(b, b + m)
            owners += [s] * m
            segments.append(h if m == h.shape[0] else h[:m])
            continue
        while done < m:  # the sequence's rows, split where a chunk fills up
            take = min(m - done, width - len(toks))
            toks.extend(ts[done:done + take])
            pos.extend(range(p + done, p + done + take))
            live.extend(range(b + done, b + done + take))
            owners.extend([s] * take)
            # a whole sequence's hiddens go as they are (a slice costs a tensor of its own)
            segments.append(h if take == m == h.shape[0] else h[done:done + take])
            done += take
            if len(toks) == width:
                chunks.append(ChainRows(toks, segments, pos, owners, live, kv_only=True))
                toks, pos, live, owners, segments = [], [], [], [], []
    if toks:
        chunks.append(ChainRows(toks, segments, pos, owners, live, kv_only=True))
    return chunks
