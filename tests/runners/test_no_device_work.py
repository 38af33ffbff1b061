"""runners/no_device_work: a launcher walked for its Triton compiles does no device work (the
precompile's guard against computing on a garbage arena; FAULTS: no state corrupted)."""
import pytest
import torch

from draft_circuit.runners.no_device_work import DeviceWorkRefused, no_device_work


def test_an_out_of_range_gather_is_not_run_and_has_its_shape():
    table = torch.randn(10, 4)
    ids = torch.tensor([3, 10_000_000, -5])  # garbage ids, as an undone argmax would leave
    with no_device_work("cpu"):
        emb = table.index_select(0, ids.clamp(min=0))
        g = table.gather(1, torch.full((3, 2), 99))
    assert emb.shape == (3, 4) and emb.dtype == table.dtype
    assert g.shape == (3, 2)


def test_writes_return_their_targets_unwritten():
    state = torch.zeros(6, 3)
    out = torch.zeros(2, 3)
    with no_device_work("cpu"):
        r1 = state.index_put_((torch.tensor([0, 5]),), torch.ones(2, 3))
        r2 = state.add_(1.0)
        r3 = torch.mul(torch.ones(2, 3), 2.0, out=out)
        state.copy_(torch.ones(6, 3))
        state[1:3].fill_(7.0)
    assert r1 is state and r2 is state and r3 is out
    assert torch.equal(state, torch.zeros(6, 3)) and torch.equal(out, torch.zeros(2, 3))


def test_views_are_real_and_results_keep_shape_stride_dtype():
    arena = torch.arange(64, dtype=torch.float32)
    with no_device_work("cpu"):
        v = arena[8:24].view(4, 4)
        t = v.t()
        s = (v @ v).to(torch.float16)
        parts = torch.split(arena, 16)
        mx = torch.max(v, dim=1)
    assert v.data_ptr() == arena[8:].data_ptr() and t.stride() == (1, 4)
    assert s.shape == (4, 4) and s.dtype == torch.float16
    assert [p.data_ptr() for p in parts] == [arena[i * 16:].data_ptr() for i in range(4)]
    assert mx.values.shape == (4,) and mx.indices.dtype == torch.int64


def test_other_devices_and_host_reads_are_unaffected_or_refused_by_name():
    with no_device_work("cuda"):  # nothing here is on cuda: runs as usual
        assert torch.tensor([1, 2]).sum().item() == 3
    with no_device_work("cpu"):
        with pytest.raises(DeviceWorkRefused, match="nonzero"):
            torch.tensor([0, 1, 1]).nonzero()
        with pytest.raises(DeviceWorkRefused, match="_local_scalar_dense"):
            torch.tensor([2.0]).item()
