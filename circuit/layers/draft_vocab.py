"""Reduced draft vocabularies (FR-Spec; SGLang's `--speculative-token-map` is the peer): a token
list, read from a file or built from a corpus, and what a draft chain over it binds.

A `DraftVocab` is a list of target token ids, most frequent first; `top(n)` keeps the first n.
Files: `.json` (a JSON list of ints, what `save_draft_vocab` writes), `.pt` (a 1-D integer tensor
or a list, read with `torch.load(weights_only=True)`: SGLang's token-map format, e.g. FR-Spec's
`freq_32768.pt`) or `.npy` (a 1-D integer array, no pickles). Ids must be distinct and in
[0, vocab_size); every fault is a `DraftVocabError` naming the file.

A chain over S subset tokens (`emit_draft_chain(..., draft_vocab=S)`) declares the head's lm-head
with S rows and the int32 table `draft_vocab.ids` [S]; `bind_draft_vocab` gathers those rows at
bind time, in ascending target-id order, so a tie between two logits goes to the lower target id,
exactly as over the full vocabulary. Drafts are mapped back to target ids on the device
(`map_ids`, which the planner folds into the lm-head argmax's merge: one table load a row, so a
subset chain launches what the full chain does a step) and a grammar bitmask over the target vocabulary is remapped to the subset on the
device (`remap_bitmask`). The confidence of a draft is then its log-probability renormalised over
the subset: logit - logsumexp over the subset tokens the mask allows (never the full vocabulary).
"""
from __future__ import annotations

import copy
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Protocol, TypeVar

import torch

__all__ = ["DRAFT_VOCAB_IDS", "DraftVocab", "DraftVocabError", "load_draft_vocab", "save_draft_vocab",
           "build_draft_vocab", "read_token_ids", "bind_draft_vocab", "chain_param_specs",
           "chain_vocab_size", "over_subset"]

DRAFT_VOCAB_IDS = "draft_vocab.ids"  # param: int32 [S], the target id of each lm-head row, ascending
ParamSpecs = dict[str, tuple[str, tuple[int, ...]]]  # name -> (dtype, shape)


class DraftVocabError(ValueError):
    """A token list that cannot be a draft vocabulary (file, ids, size), or a head that cannot
    draft over the one asked for."""


class VocabHead(Protocol):
    """What this module reads of a head: its lm-head param, its own draft vocabulary (EAGLE-3's;
    None: the target's) and its params as (dtype, shape)."""

    lm_head: str
    draft_vocab_size: int | None

    @property
    def config(self) -> Any: ...
    def param_specs(self) -> ParamSpecs: ...


@dataclass(frozen=True)
class DraftVocab:
    """Target token ids, most frequent first, distinct, each in [0, vocab_size)."""

    ids: tuple[int, ...]
    vocab_size: int
    source: str = "draft vocabulary"

    def __post_init__(self) -> None:
        if not self.ids:
            raise DraftVocabError(f"{self.source}: an empty token list")
        bad = [i for i in self.ids if not 0 <= i < self.vocab_size]
        if bad:
            raise DraftVocabError(f"{self.source}: token id {bad[0]} is outside the target vocabulary "
                                  f"[0, {self.vocab_size}) ({len(bad)} such)")
        if len(set(self.ids)) != len(self.ids):
            dup = next(i for i, c in Counter(self.ids).items() if c > 1)
            raise DraftVocabError(f"{self.source}: token id {dup} is listed more than once")

    @property
    def size(self) -> int:
        return len(self.ids)

    def top(self, n: int) -> DraftVocab:
        """The n most frequent ids."""
        if not 1 <= n <= self.size:
            raise DraftVocabError(f"{self.source}: cannot keep {n} of its {self.size} ids")
        return DraftVocab(self.ids[:n], self.vocab_size, f"{self.source} (top {n})")

    def sorted_ids(self) -> torch.Tensor:
        """The ids ascending, int64: the order of the bound lm-head rows."""
        return torch.tensor(sorted(self.ids), dtype=torch.int64)


def read_token_ids(path: str | os.PathLike[str]) -> list[int]:
    """A 1-D list of ints from .json, .pt or .npy (the formats named in the module docstring)."""
    p = Path(path)
    suffix = p.suffix.lower()
    try:
        if suffix == ".json":
            data: Any = json.loads(p.read_text())
        elif suffix == ".pt":
            data = torch.load(p, map_location="cpu", weights_only=True)
        elif suffix == ".npy":
            import numpy as np
            data = torch.from_numpy(np.load(p, allow_pickle=False))
        else:
            raise DraftVocabError(f"{p}: a token list is .json, .pt or .npy, not {suffix or 'no suffix'!r}")
    except DraftVocabError:
        raise
    except Exception as e:  # unreadable, truncated, a pickle, not JSON
        raise DraftVocabError(f"{p}: cannot read a token list: {type(e).__name__}: {e}") from None
    if isinstance(data, torch.Tensor):
        if data.dim() != 1 or data.dtype.is_floating_point or data.dtype == torch.bool:
            raise DraftVocabError(f"{p}: expected a 1-D integer tensor, got {data.dtype} {list(data.shape)}")
        return [int(x) for x in data.tolist()]
    if not isinstance(data, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in data):
        raise DraftVocabError(f"{p}: expected a list of integer token ids")
    return list(data)


def load_draft_vocab(path: str | os.PathLike[str], vocab_size: int, size: int | None = None) -> DraftVocab:
    """The token list of a file; `size`: keep only its first (most frequent) ids."""
    vocab = DraftVocab(tuple(read_token_ids(path)), vocab_size, os.fspath(path))
    return vocab if size is None else vocab.top(size)


def save_draft_vocab(path: str | os.PathLike[str], vocab: DraftVocab) -> Path:
    """Write `vocab` as a JSON list (most frequent first); refuses another suffix."""
    p = Path(path)
    if p.suffix.lower() != ".json":
        raise DraftVocabError(f"{p}: save_draft_vocab writes .json token lists")
    p.write_text(json.dumps(list(vocab.ids)) + "\n")
    return p


def build_draft_vocab(token_ids: Iterable[int], vocab_size: int, size: int) -> DraftVocab:
    """The `size` most frequent ids of a corpus of target token ids (ties: the lower id first).
    A corpus with fewer distinct ids than `size` is refused: pad it with a bigger corpus."""
    counts = Counter(int(t) for t in token_ids)
    bad = [t for t in counts if not 0 <= t < vocab_size]
    if bad:
        raise DraftVocabError(f"corpus: token id {min(bad)} is outside the target vocabulary [0, {vocab_size})")
    if len(counts) < size:
        raise DraftVocabError(f"corpus: {len(counts)} distinct ids, fewer than the {size} asked for")
    ranked = sorted(counts, key=lambda t: (-counts[t], t))
    return DraftVocab(tuple(ranked[:size]), vocab_size, f"corpus top {size}")


def chain_vocab_size(head: VocabHead, draft_vocab: int | None) -> int | None:
    """The number of tokens a chain drafts over: `draft_vocab` (a subset of the head's
    vocabulary) or the head's own draft vocabulary (EAGLE-3); None: the whole target vocabulary."""
    own = head.draft_vocab_size
    if draft_vocab is None:
        return own
    limit = own if own is not None else head.config.vocab_size
    if isinstance(draft_vocab, bool) or not isinstance(draft_vocab, int) or not 1 <= draft_vocab <= limit:
        raise DraftVocabError(f"draft_vocab = {draft_vocab!r}: must be an int in [1, {limit}] (the "
                              f"head's {'draft' if own is not None else 'target'} vocabulary)")
    return draft_vocab


def chain_param_specs(head: VocabHead, size: int | None) -> ParamSpecs:
    """The head's params for a chain over `size` tokens: its lm-head with `size` rows and the id
    table beside it (declared in the head's order, the table last)."""
    specs = dict(head.param_specs())
    if size is None:
        return specs
    dtype, shape = specs[head.lm_head]
    specs[head.lm_head] = (dtype, (size, *shape[1:]))
    specs[DRAFT_VOCAB_IDS] = ("int32", (size,))
    return specs


def bind_draft_vocab(params: Mapping[str, torch.Tensor], head: VocabHead,
                     vocab: DraftVocab) -> dict[str, torch.Tensor]:
    """The head's bound params (`head.bind(weights)`) for a chain over `vocab`: the lm-head's rows
    of its ids, ascending, and the id table. A head over its own draft vocabulary (EAGLE-3) keeps
    the rows of the ids it holds; an id it cannot draft is refused by name."""
    out = dict(params)
    lm = params[head.lm_head]
    vocab_size = head.config.vocab_size
    if vocab.vocab_size != vocab_size:
        raise DraftVocabError(f"{vocab.source}: a list over {vocab.vocab_size} target ids, the head's "
                              f"target vocabulary has {vocab_size}")
    held = params.get(DRAFT_VOCAB_IDS)
    table = held.long().cpu() if held is not None else torch.arange(lm.shape[0])
    row_of = torch.full((vocab_size,), -1, dtype=torch.int64)
    row_of[table] = torch.arange(table.shape[0])
    ids = vocab.sorted_ids()
    rows = row_of[ids]
    if bool((rows < 0).any()):
        missing = ids[rows < 0]
        raise DraftVocabError(f"{vocab.source}: token id {int(missing[0])} is not in the head's own "
                              f"draft vocabulary ({missing.numel()} such): a subset must lie inside it")
    out[head.lm_head] = lm[rows.to(lm.device)].contiguous()
    out[DRAFT_VOCAB_IDS] = ids.to(torch.int32).to(lm.device)
    return out


H = TypeVar("H", bound=VocabHead)


def over_subset(head: H, vocab: DraftVocab) -> H:
    """The head whose chains draft over `vocab` (for a host such as a proposer that emits
    `emit_draft_chain(head, k, ...)` with no `draft_vocab`): a shallow copy with
    `draft_vocab_size` = the subset's size, so every chain it emits declares the subset lm-head
    and id table. Its params are `bind_draft_vocab(head.bind(weights), head, vocab)`: bind with
    the original head first, which still knows its own vocabulary."""
    out = copy.copy(head)
    out.draft_vocab_size = vocab.size
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m draft_circuit.circuit.layers.draft_vocab --corpus IDS --vocab-size V --size N
    --out LIST.json`: the N most frequent ids of a corpus of token ids (.json, .pt or .npy)."""
    import argparse

    p = argparse.ArgumentParser(description=main.__doc__)
    p.add_argument("--corpus", required=True, type=Path, help="token ids: .json list, .pt or .npy")
    p.add_argument("--vocab-size", required=True, type=int, help="the target vocabulary size")
    p.add_argument("--size", required=True, type=int, help="how many ids to keep (e.g. 32768)")
    p.add_argument("--out", required=True, type=Path, help="the token list to write (.json)")
    args = p.parse_args(argv)
    try:
        vocab = build_draft_vocab(read_token_ids(args.corpus), args.vocab_size, args.size)
        save_draft_vocab(args.out, vocab)
    except DraftVocabError as e:
        p.exit(2, f"error: {e}\n")
    print(f"wrote {args.out}: the {vocab.size} most frequent of {args.vocab_size} ids")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
