"""The device-resident decode step on the GPU (issue 14 items 3-4, `pytest -m cuda`).

- Steady state, `propose_batch_on_device` + the KV-only catch-up allocate no device memory.
- Neither makes a host sync: torch's sync debug mode turns any synchronising CUDA call into an
  error around them (the drafts' read, the step's one read, stands outside).
- Device drafts equal the host-returned drafts bitwise, and the states and drafter KV match.
"""
from __future__ import annotations

import torch

from draft_circuit.runners.testing import assert_no_allocation, cuda
from tests.runners.test_proposer import K, make
from tests.runners.test_proposer_device import batch, kept
from tests.runners.test_proposer_staging import DecodeLoop


class DeviceLoop(DecodeLoop):
    """DecodeLoop on the device path: propose on the device, read the drafts once, verify
    (random acceptance), catch up on the KV-only chain. `no_sync` puts the propose and the
    catch-up under torch's sync debug mode "error"."""

    no_sync = False

    def step(self):
        p, states = self.p, self.states
        pos = [p.last_pair_key(s) + 2 for s in states]
        with _sync_mode(self.no_sync):
            assert p.propose_batch_on_device([5] * len(states), self.hid, pos, K, states) is not None
        drafts = p.last_drafts(states)  # the step's one read
        self.drafts.append(drafts)
        accepted = [self.rng.randint(0, len(d)) for d in drafts]
        for s, a in zip(states, accepted):
            p.after_verify(a, s)
        with _sync_mode(self.no_sync):
            p.catchup_batch([d[:a] for d, a in zip(drafts, accepted)],
                            [h[:a] for h, a in zip(self.catch, accepted)],
                            [q + 1 for q in pos], states)


class _sync_mode:
    def __init__(self, on: bool) -> None:
        self.on = on

    def __enter__(self) -> None:
        if self.on:
            torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc: object) -> None:
        if self.on:
            torch.cuda.set_sync_debug_mode(0)


@cuda
def test_device_step_allocates_no_device_memory():
    p = make("circuit", device="cuda", num_blocks=400, max_blocks_per_seq=40)
    loop = DeviceLoop(p, n=4, device="cuda")
    for _ in range(2):
        loop.step()
    assert p.chains.kv_only()[1], "catch-up should run on the KV-only chain"
    assert_no_allocation(loop.step, repeats=4)


@cuda
def test_device_step_makes_no_host_sync_but_its_one_read():
    p = make("circuit", device="cuda", num_blocks=400, max_blocks_per_seq=40)
    loop = DeviceLoop(p, n=4, device="cuda")
    for _ in range(2):  # warm: slots assigned, tables staged
        loop.step()
    torch.cuda.synchronize()
    loop.no_sync = True
    for _ in range(4):
        loop.step()


@cuda
def test_device_loop_equals_the_host_loop_on_cuda():
    """Same seeds: the device path drafts, trims and catches up exactly as the host path."""
    dev = make("circuit", device="cuda", num_blocks=400, max_blocks_per_seq=40)
    host = make("circuit", device="cuda", num_blocks=400, max_blocks_per_seq=40)
    a, b = DeviceLoop(dev, n=4, device="cuda", seed=3), DecodeLoop(host, n=4, device="cuda", seed=3)
    for _ in range(6):
        a.step(), b.step()
    assert a.drafts == b.drafts
    for name in ("k_cache", "v_cache"):
        assert torch.equal(dev.states[name], host.states[name])


@cuda
def test_device_drafts_equal_host_drafts_on_cuda():
    host, dev = make("circuit", device="cuda"), make("circuit", device="cuda")
    hs, pos, toks, h = batch(host)
    ds, _, _, _ = batch(dev)
    confs: list[list[float]] = []
    want = host.propose_batch(toks, h.cuda(), pos, K, hs, out_conf=confs)
    drafts, conf = dev.propose_batch_on_device(toks, h.cuda(), pos, K, ds)
    assert drafts.is_cuda and conf.is_cuda
    rows = drafts.tolist()
    assert [kept(r) for r in rows] == want
    assert [c[:len(w)] for c, w in zip(conf.tolist(), want)] == confs
    verify = dev.verify_tokens().view(3, K + 1).tolist()
    assert [v[0] for v in verify] == toks
    assert [v[1:] for v in verify] == [[max(t, 0) for t in r] for r in rows]
    assert dev.last_drafts(ds) == want
    assert [dev.last_pair_key(s) for s in ds] == [host.last_pair_key(s) for s in hs]
    for name in ("k_cache", "v_cache"):
        assert torch.equal(host.states[name], dev.states[name])


def test_the_cuda_loops_are_the_cpu_loops():
    """The loops above on CPU: the device path equals the host path there too (this file's
    witness that DeviceLoop drafts, trims and catches up as DecodeLoop does)."""
    dev = make("circuit", num_blocks=400, max_blocks_per_seq=40)
    host = make("circuit", num_blocks=400, max_blocks_per_seq=40)
    a, b = DeviceLoop(dev, n=4, seed=3), DecodeLoop(host, n=4, seed=3)
    for _ in range(4):
        a.step(), b.step()
    assert a.drafts == b.drafts
    for name in ("k_cache", "v_cache"):
        assert torch.equal(dev.states[name], host.states[name])


@cuda
def test_a_cuda_catch_up_stages_its_hiddens_in_one_cat(monkeypatch):
    """Device hiddens on "cuda:0" match the staging buffer made for "cuda": one cat, not a
    copy per sequence."""
    from tests.runners.test_proposer import hidden, prefilled
    from tests.runners.test_proposer_staging import cat_calls
    p = make("circuit", device="cuda", num_blocks=80, max_blocks_per_seq=12)
    states = [prefilled(p, 60 + i, length=5)[0] for i in range(3)]
    calls = cat_calls(monkeypatch)
    p.catchup_batch([[1, 2], [3], [4, 5, 6]],
                    [hidden(1, 2).cuda(), hidden(2, 1).cuda(), hidden(3, 3).cuda()],
                    [5, 5, 5], states)
    assert calls == [3]
