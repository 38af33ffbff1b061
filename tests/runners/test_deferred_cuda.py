"""The deferred propose on the GPU (issue 12): with an `embed_target`, `propose` returns device
drafts and writes the last draft's embedding without one host synchronisation, so a host can
launch its verify pass straight after; `read_deferred_draft_token` is where the host syncs.
torch's sync debug mode turns any synchronising CUDA call (a device-to-host read, a pageable copy
that waits, a stream sync) into an error while proposing."""
from __future__ import annotations

import torch

from draft_circuit.runners.testing import cuda
from tests.runners.test_proposer import CFG, K, hidden, make, prefilled


@cuda
def test_deferred_propose_makes_no_host_sync_on_cuda():
    gpu, ref = make("circuit", device="cuda"), make("eager")
    s_gpu, _ = prefilled(gpu, 9)
    s_ref, _ = prefilled(ref, 9)
    want = ref.propose(3, hidden(10), 11, K, s_ref)

    h = hidden(10).to("cuda")
    target = torch.zeros(CFG.hidden_size, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        drafts = gpu.propose(3, h, 11, K, s_gpu, embed_target=target)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert isinstance(drafts, torch.Tensor) and drafts.is_cuda
    last = gpu.read_deferred_draft_token()  # the host syncs here, after the fact
    got = [d for d in drafts.tolist() if d >= 0]
    assert got == want and last == want[-1]
    assert torch.equal(target, gpu.params["embed_tokens.weight"][last])
    assert gpu.drafter_rows(s_gpu) == ref.drafter_rows(s_ref)
