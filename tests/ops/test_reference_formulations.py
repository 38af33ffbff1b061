"""The CPU references cut to few torch ops (issue 20: at the quick start's shapes each op costs
microseconds whatever its size) keep every bit of their plain formulations: each plain form below
is the reference as it was written before, one op per step, and the live reference must equal it
bitwise (outputs and mutated states) on random inputs and the edge cases: fp32 / fp16 / bf16,
widths 1, 4 and 20, partial rotary, inactive rows, row offsets, non-finite logits, tied maxima,
bitmasks that allow nothing or only bit 31, NaN confidences."""
import itertools

import pytest
import torch

from draft_circuit.ops.attention import KvWriteAttrs, RopeAttrs, RopeKvWriteAttrs
from draft_circuit.ops.registry import REGISTRY
from draft_circuit.ops.sampling import KeepAttrs

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
WIDTHS = (1, 4, 20)


@pytest.fixture(autouse=True)
def one_thread():
    # several threads make a shared KV slot's last writer vary; the engine runs one
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# ---- the plain formulations ----
def plain_rope(x, positions, head_dim, theta, pos_offset, rotary_dim=None):
    n, r = x.shape[0], head_dim if rotary_dim is None else rotary_dim
    inv_freq = 1.0 / (theta ** (torch.arange(0, r, 2, device=x.device).float() / r))
    angle = (positions.float() + pos_offset).unsqueeze(-1) * inv_freq
    cos, sin = angle.cos().unsqueeze(1), angle.sin().unsqueeze(1)
    xf = x.float().view(n, -1, head_dim)
    x1, x2 = xf[..., : r // 2], xf[..., r // 2: r]
    out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., r:]], dim=-1)
    return out.view(n, -1).to(x.dtype)


def plain_kv_write(kc, vc, k, v, tables, live, active, row_offset):
    block_size, heads, dim = kc.shape[1:]
    rows = live.long() + row_offset
    blocks = tables.long().gather(1, (rows // block_size).unsqueeze(1)).squeeze(1)
    keep = torch.ones_like(rows, dtype=torch.bool) if active is None else active != 0
    blocks, offs = blocks[keep], (rows % block_size)[keep]
    kc[blocks, offs] = k[keep].view(-1, heads, dim)
    vc[blocks, offs] = v[keep].view(-1, heads, dim)


def plain_rope_kv_write(t, a):
    q, k, v, pos, kc, vc, tables, live = t[:8]
    q_rot = plain_rope(q, pos, a.head_dim, a.theta, a.pos_offset, a.rotary_dim)
    k_rot = plain_rope(k, pos, a.head_dim, a.theta, a.pos_offset, a.rotary_dim)
    plain_kv_write(kc, vc, k_rot, v, tables, live, t[8] if len(t) > 8 else None, a.row_offset)
    return q_rot, kc, vc


def plain_allowed(bitmask, vocab):
    bits = torch.arange(32, dtype=torch.int64)
    return ((bitmask.long().unsqueeze(-1) >> bits) & 1).view(bitmask.shape[0], -1)[:, :vocab].bool()


def plain_argmax(logits, bitmask):
    x = logits.float()
    allowed = torch.isfinite(x)
    if bitmask is not None:
        allowed &= plain_allowed(bitmask, x.shape[1])
    masked = x.masked_fill(~allowed, float("-inf"))
    best = masked.max(dim=-1).values
    token = (masked == best.unsqueeze(-1)).to(torch.int8).argmax(dim=-1).to(torch.int32)
    logprob = best - torch.logsumexp(masked, dim=-1)
    none = ~allowed.any(dim=-1)
    return token.masked_fill(none, -1), logprob.masked_fill(none, float("-inf"))


def plain_keep(token, active, fallback=None, fill=-1):
    return torch.where(active.bool(), token, torch.full_like(token, fill) if fallback is None else fallback)


def plain_gate(active, logprob, log_tau):
    return (active.bool() & ~(logprob < log_tau)).to(torch.int32)


def same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert torch.equal(g.nan_to_num(7.0), w.nan_to_num(7.0)) and torch.equal(g.isnan(), w.isnan()) \
            if g.is_floating_point() else torch.equal(g, w)


def rnd(g, *shape, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


# ---- rope, kv_write, rope_kv_write ----
@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_and_kv_writes_keep_the_plain_bits(dtype):
    g = torch.Generator().manual_seed(0)
    rope, kv, rkv = (REGISTRY[n].reference for n in ("rope", "kv_write", "rope_kv_write"))
    for n, (hq, hk, d), rotary, off, (bs, ro) in itertools.product(
            WIDTHS, ((4, 2, 16), (8, 1, 32), (2, 2, 128)), (None, "half"), (0, 3), ((4, 0), (16, 1), (1, 3))):
        rd = None if rotary is None else d // 2
        pos = torch.randint(0, 5000, (n,), generator=g)
        x = rnd(g, n, hq * d, dtype=dtype, scale=3)
        same(rope([x, pos], RopeAttrs(head_dim=d, pos_offset=off, rotary_dim=rd)),
             (plain_rope(x, pos, d, 10000.0, off, rd),))
        max_blocks = 5
        kc, vc = rnd(g, n * max_blocks + 1, bs, hk, d, dtype=dtype), rnd(g, n * max_blocks + 1, bs, hk, d, dtype=dtype)
        tables = torch.randperm(n * max_blocks + 1, generator=g)[: n * max_blocks].view(n, -1).to(torch.int32)
        live = torch.randint(0, max_blocks * bs - ro - 1, (n,), generator=g).to(torch.int32)
        q, k, v = (rnd(g, n, h * d, dtype=dtype) for h in (hq, hk, hk))
        for active in (None, torch.ones(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32),
                       torch.randint(-1, 3, (n,), generator=g).to(torch.int32)):
            extra = [] if active is None else [active]
            got_kc, got_vc, want_kc, want_vc = kc.clone(), vc.clone(), kc.clone(), vc.clone()
            kv([got_kc, got_vc, k, v, tables, live, *extra], KvWriteAttrs(row_offset=ro))
            plain_kv_write(want_kc, want_vc, k, v, tables, live, active, ro)
            same((got_kc, got_vc), (want_kc, want_vc))
            a = RopeKvWriteAttrs(head_dim=d, pos_offset=off, row_offset=ro, rotary_dim=rd)
            for qq in (q, q.float()):  # q of k's dtype is roped with k, q of another alone
                got = rkv([qq, k, v, live.long() + ro, kc.clone(), vc.clone(), tables, live, *extra], a)
                same(got, plain_rope_kv_write([qq, k, v, live.long() + ro, kc.clone(), vc.clone(), tables, live,
                                               *extra], a))


def test_kv_write_edge_rows_match_the_plain_write():
    """Rows sharing a slot (the last one wins), a row past its table (raises, active or not),
    a negative block id (wraps, as indexing does), float positions with -0.0."""
    g = torch.Generator().manual_seed(1)
    n, bs, hk, d = 4, 4, 2, 8
    kc, vc = rnd(g, 9, bs, hk, d), rnd(g, 9, bs, hk, d)
    k, v = rnd(g, n, hk * d), rnd(g, n, hk * d)
    tables = torch.randint(0, 9, (n, 3), generator=g).to(torch.int32)
    live = torch.tensor([1, 1, 5, 2], dtype=torch.int32)
    shared = tables.clone()
    shared[:] = tables[0]
    negative = tables.clone()
    negative[0] = -1
    kv = REGISTRY["kv_write"].reference
    for tab, lv, active in ((shared, live, None), (negative, live, None),
                            (shared, live, torch.tensor([1, 0, 1, 1], dtype=torch.int32))):
        got, want = (kc.clone(), vc.clone()), (kc.clone(), vc.clone())
        kv([*got, k, v, tab, lv, *([] if active is None else [active])], KvWriteAttrs())
        plain_kv_write(*want, k, v, tab, lv, active, 0)
        same(got, want)
    far = torch.tensor([1, 99, 2, 3], dtype=torch.int32)
    for active in (None, torch.zeros(n, dtype=torch.int32)):
        with pytest.raises(RuntimeError):
            plain_kv_write(kc.clone(), vc.clone(), k, v, tables, far, active, 0)
        with pytest.raises(RuntimeError):
            kv([kc.clone(), vc.clone(), k, v, tables, far, *([] if active is None else [active])], KvWriteAttrs())
    # a cache whose heads are not rope's (k of 2 rope heads of 8 in 1 cache head of 16)
    kc16, vc16 = rnd(g, 9, bs, 1, 16), rnd(g, 9, bs, 1, 16)
    q = rnd(g, n, 32)
    a = RopeKvWriteAttrs(head_dim=8, pos_offset=1)
    got = REGISTRY["rope_kv_write"].reference([q, k, v, live.long(), kc16.clone(), vc16.clone(), tables, live], a)
    same(got, plain_rope_kv_write([q, k, v, live.long(), kc16.clone(), vc16.clone(), tables, live], a))
    x = rnd(g, 4, 32)
    x[0, 3], x[1, 5], x[2, 9] = float("nan"), float("inf"), -0.0
    for pos in (torch.arange(4), torch.tensor([0.0, -0.0, 2.5, 1e7])):
        same(REGISTRY["rope"].reference([x, pos], RopeAttrs(head_dim=16)), (plain_rope(x, pos, 16, 10000.0, 0),))


# ---- argmax, keep, gate ----
def _logits(g, n, vocab, kind):
    x = torch.randn(n, vocab, generator=g)
    if kind == "ties":
        x = (x * 2).round()
    elif kind == "nonfinite":
        for value in ("nan", "inf", "-inf"):
            x[torch.rand(n, vocab, generator=g) < 0.05] = float(value)
        x[min(1, n - 1)] = float("nan")
        x[min(2, n - 1)] = float("-inf")
    return x


def _masks(g, n, vocab):
    words = (vocab + 31) // 32
    nothing = torch.full((n, words), -1, dtype=torch.int32)
    nothing[0] = 0
    return (None, torch.randint(-2**31, 2**31 - 1, (n, words), generator=g, dtype=torch.int64).to(torch.int32),
            nothing, torch.full((n, words), -2**31, dtype=torch.int32))


@pytest.mark.parametrize("kind", ("plain", "ties", "nonfinite"))
def test_argmax_keep_and_gate_keep_the_plain_bits(kind):
    g = torch.Generator().manual_seed(2)
    argmax = REGISTRY["argmax_logprob"].reference
    for n, vocab in itertools.product(WIDTHS, (256, 33, 1, 4096)):
        x = _logits(g, n, vocab, kind)
        for mask, dtype in itertools.product(_masks(g, n, vocab), DTYPES):
            extra = [] if mask is None else [mask]
            same(argmax([x.to(dtype), *extra], None), plain_argmax(x.to(dtype), mask))
        token, fallback = (torch.randint(-1, vocab, (n,), generator=g).to(torch.int32) for _ in range(2))
        active = torch.randint(-1, 3, (n,), generator=g).to(torch.int32)
        for fill in (-1, 7):
            same(REGISTRY["keep_if_active"].reference([token, active], KeepAttrs(fill=fill)),
                 (plain_keep(token, active, fill=fill),))
        same(REGISTRY["keep_if_active"].reference([token, active, fallback], KeepAttrs()),
             (plain_keep(token, active, fallback),))
        logprob = torch.randn(n, generator=g) - 1
        logprob[0] = float("nan")
        for tau in (-1.0, float("-inf"), float("nan")):
            log_tau = torch.full((n,), tau)
            same(REGISTRY["confidence_gate"].reference([active, logprob, log_tau], None),
                 (plain_gate(active, logprob, log_tau),))


@pytest.mark.parametrize("dtype", DTYPES)
def test_lm_head_draft_ops_keep_the_plain_bits(dtype):
    """The lm-head's fused draft ops against the plain parts they compose (norm, linear, argmax,
    keep, gate), with tied and non-finite logits."""
    from draft_circuit.ops.basic import EpsAttrs, linear_ref, rmsnorm_ref
    g = torch.Generator().manual_seed(3)
    for n, (hidden, vocab) in itertools.product(WIDTHS, ((128, 256), (32, 100))):
        x, norm, w = rnd(g, n, hidden, dtype=dtype), rnd(g, hidden, dtype=dtype), rnd(g, vocab, hidden, dtype=dtype)
        w[vocab // 2:] = w[: vocab - vocab // 2].clone()  # tied logits
        x[0, 0] = float("inf")
        active = torch.randint(-1, 3, (n,), generator=g).to(torch.int32)
        fallback = torch.randint(-1, vocab, (n,), generator=g).to(torch.int32)
        log_tau = torch.full((n,), -2.0)
        e = EpsAttrs()
        for mask in _masks(g, n, vocab):
            extra = [] if mask is None else [mask]
            token, logprob = plain_argmax(linear_ref(rmsnorm_ref(x, norm, e.eps), w, torch.float32), mask)
            kept, last, gate = (plain_keep(token, active), plain_keep(token, active, fallback),
                                plain_gate(active, logprob, log_tau))
            for name, ins, want in (
                    ("rmsnorm_linear_argmax_keep", [active], (kept,)),
                    ("rmsnorm_linear_argmax_keep_last", [active, fallback], (kept, last)),
                    ("rmsnorm_linear_argmax_keep_gate", [active, log_tau], (kept, gate)),
                    ("rmsnorm_linear_argmax_keep_last_gate", [active, fallback, log_tau], (kept, last, gate))):
                same(REGISTRY[name].reference([x, norm, w, *ins, *extra], e), (token, logprob, *want))


# ---- input_guard ----
def plain_guard(tokens, tables, live, active, faults, a):
    n, m = tables.shape
    big = torch.iinfo(torch.int32).max
    act = active != 0
    tok_bad = (tokens < 0) | (tokens >= a.vocab) if a.vocab > 0 else torch.zeros_like(act)
    live_oob = (live < 0) | (live > m * a.block_size - a.steps)
    used = torch.where(live_oob, 0, torch.div(live + a.steps - 1, a.block_size, rounding_mode="floor") + 1)
    cols = torch.arange(m, dtype=torch.int32)
    oob = (cols[None, :] < used[:, None]) & ((tables < 0) | (tables >= a.num_blocks))
    first_col = torch.where(oob, cols[None, :], big).amin(1) if m else torch.full_like(tokens, big)
    blk_oob = first_col < big
    flagged = act & (live_oob | blk_oob)
    bad = tok_bad | flagged
    fix = bad | live_oob | blk_oob
    zero = torch.zeros_like(tokens)
    guarded = (torch.where(fix, zero, tokens), torch.where(fix[:, None], torch.full_like(tables, a.scratch_block), tables),
               torch.where(fix, zero, live), torch.where(fix, zero, active))
    if n == 0:
        return (*guarded, faults)
    rows = torch.arange(n, dtype=torch.int32)
    tok_row = torch.where(tok_bad, rows, big).amin()
    other_row = torch.where(flagged, rows, big).amin()
    is_tok = tok_row < big
    any_bad = is_tok | (other_row < big)
    row = torch.where(is_tok, tok_row, other_row)
    at = rows == row
    r_col = torch.where(at, first_col, 0).sum()
    code = torch.where(is_tok, 1, torch.where((at & live_oob).any(), 2, 3))
    r_blk = torch.where(at[:, None] & (cols[None, :] == r_col), tables, 0).sum()
    value = torch.where(code == 1, torch.where(at, tokens, 0).sum(),
                        torch.where(code == 2, torch.where(at, live, 0).sum(), r_blk))
    words = (code, row, value, torch.where(code == 3, r_col, -1), torch.tensor(n), bad.sum(), faults[6], faults[7])
    new = torch.where(any_bad & (faults[0] == 0), torch.stack([w.to(torch.int32) for w in words]), faults)
    new[6] = faults[6] + any_bad.to(torch.int32)
    faults.copy_(new)
    return (*guarded, faults)


def test_input_guard_keeps_the_plain_bits_and_reads_nothing_on_the_host():
    from draft_circuit.ops.input_guard import GuardAttrs
    guard = REGISTRY["input_guard"].reference
    g = torch.Generator().manual_seed(4)
    for n, m, vocab, nb, bs, steps, trial in itertools.product(
            (0, 1, 4, 20, 130), (0, 1, 3, 70), (0, 20), (12, 1), (4, 1), (1, 3), range(3)):
        ins = [torch.randint(-3, 24, (n,), generator=g, dtype=torch.int32),
               torch.randint(-2, nb + 2, (n, m), generator=g, dtype=torch.int32),
               torch.randint(-2, m * bs + 2, (n,), generator=g, dtype=torch.int32),
               torch.randint(-1, 3, (n,), generator=g, dtype=torch.int32)]
        if trial == 1:  # valid rows, but for a few
            ins = [ins[0].clamp(0, max(vocab - 1, 0)), ins[1].clamp(0, nb - 1), ins[2].clamp(0, max(m * bs - steps, 0)),
                   ins[3]]
        if trial == 2 and n:
            ins[2][0], ins[2][-1], ins[0][0] = 2**31 - 1, -2**31, -2**31
        a = GuardAttrs(vocab=vocab, num_blocks=nb, block_size=bs, steps=steps, scratch_block=0)
        for faults in ([0] * 8, [0, 0, 0, 0, 0, 0, 5, 9], [3, 1, 7, 1, 4, 2, 1, 0]):
            f = torch.tensor(faults, dtype=torch.int32)
            same(guard([t.clone() for t in ins] + [f.clone()], a), plain_guard(*[t.clone() for t in ins], f.clone(), a))
    meta = [torch.empty(s, dtype=torch.int32, device="meta") for s in ((4,), (4, 3), (4,), (4,), (8,))]
    guard(meta, GuardAttrs(vocab=20, num_blocks=12, block_size=4, steps=2, scratch_block=0))  # no data: no reads


# ---- embedding, embed_write, rmsnorm ----
def plain_embedding(table, ids):
    return table[ids.clamp(min=0).long()].masked_fill((ids < 0).unsqueeze(-1), 0)


def plain_rmsnorm(x, w, eps):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


@pytest.mark.parametrize("dtype", DTYPES)
def test_embedding_and_rmsnorm_keep_the_plain_bits(dtype):
    from draft_circuit.ops.basic import EpsAttrs
    from draft_circuit.ops.tokens import TokenError
    g = torch.Generator().manual_seed(5)
    embed, write, norm = (REGISTRY[n].reference for n in ("embedding", "embed_write", "rmsnorm"))
    for n, hidden in itertools.product((0, *WIDTHS), (128, 48)):
        table, w = rnd(g, 50, hidden, dtype=dtype), rnd(g, hidden, dtype=dtype)
        for ids in (torch.randint(0, 50, (n,), generator=g), torch.randint(-1, 50, (n,), generator=g)):
            for ids in (ids, ids.to(torch.int32)):
                same(embed([table, ids], None), (plain_embedding(table, ids),))
                target, active = rnd(g, n, hidden, dtype=dtype), torch.randint(-1, 2, (n,), generator=g).to(torch.int32)
                got = write([target.clone(), table, ids, active], None)
                same(got, (torch.where(active.bool().unsqueeze(-1), plain_embedding(table, ids), target),))
                same(write([target.clone(), table, ids], None), (plain_embedding(table, ids),))
        if n:
            with pytest.raises(TokenError, match=f"token id 50 at row {n - 1} "):
                embed([table, torch.cat([torch.zeros(n - 1, dtype=torch.long), torch.tensor([50])])], None)
        x = rnd(g, n, hidden, dtype=dtype, scale=3)
        if n > 1:
            x[1] = 0
        for eps in (1e-6, 1e-5, 0.1, 2**-24 * (1 + 2**-30)):  # the last: rounds to fp32 2**-24 exactly
            same(norm([x, w], EpsAttrs(eps=eps)), (plain_rmsnorm(x, w, eps),))
