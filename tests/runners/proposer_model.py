"""Independent oracles for the proposer's rule tests: the K row a drafter row holds, computed
from the ops' references (so a test can tell at which RoPE position, and from which token and
hidden, a row was written), and the reference's rules as a plain model of one state."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from draft_circuit.ops.attention import rope_ref
from draft_circuit.ops.basic import linear_ref, rmsnorm_ref


def expected_k(p, token: int, hidden: torch.Tensor, rope_position: int) -> torch.Tensor:
    """The K row the MTP head writes for the pair (token, target hidden) at `rope_position`:
    [kv_heads, head_dim]. It depends on nothing else (K is computed before attention)."""
    c, w = p.head.config, p.params
    emb = w["embed_tokens.weight"][token].view(1, -1)
    h = hidden.view(1, -1).to(emb.dtype)
    x = torch.cat([rmsnorm_ref(emb, w["enorm.weight"], c.rms_norm_eps),
                   rmsnorm_ref(h, w["hnorm.weight"], c.rms_norm_eps)], dim=-1)
    a = rmsnorm_ref(linear_ref(x, w["eh_proj.weight"]), w["input_layernorm.weight"], c.rms_norm_eps)
    k = rope_ref(linear_ref(a, w["self_attn.k_proj.weight"]), torch.tensor([rope_position]),
                 c.head_dim, c.rope_theta, 0)
    return k.view(c.num_key_value_heads, c.head_dim)


def trim_rule(num_drafted: int, num_accepted: int, kv_exact: bool, refeed: bool) -> int:
    """Issue 13 rule 1, written out again for the model (the code under test is not called)."""
    d = num_drafted if num_drafted > 1 else 1
    if kv_exact:
        return d - 1
    extra = num_accepted - 1 if refeed and num_accepted > 1 else 0
    return min((d - num_accepted if d > num_accepted else 0) + extra, d)


@dataclass
class ModelState:
    """What the rules say one state holds: rows, the newest pair key, the last propose's drafts,
    and whether an after_verify would trim."""

    rows: int = 0
    key: int | None = None
    drafted: int = 0
    awaiting: bool = False

    def next_position(self) -> int:
        """The RoPE position of the next row: one past the newest row's (key + 1)."""
        return self.key + 2 if self.key is not None else 1

    def proposed(self, position: int, num_drafts: int) -> None:
        self.rows += num_drafts
        if num_drafts:
            self.key = position + num_drafts - 2
        self.drafted, self.awaiting = num_drafts, True

    def verified(self, accepted: int, kv_exact: bool, refeed: bool) -> int:
        if not self.awaiting:
            return 0  # kept departure: only the first after_verify after a propose trims
        self.awaiting = False
        trim = trim_rule(self.drafted, accepted, kv_exact, refeed)
        self.rows = max(self.rows - trim, 0)
        if self.key is not None:
            self.key = max(self.key - trim, 0)
        return trim

    def appended(self, first_position: int, count: int) -> None:
        self.rows += count
        if count:
            self.key = first_position + count - 2

    def emptied(self) -> None:
        self.rows, self.key, self.drafted, self.awaiting = 0, None, 0, False
