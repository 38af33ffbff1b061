"""`map_ids` and `remap_bitmask` (ops/vocab.py): bit by bit against plain loops on irregular
sizes, -1 stays -1, ids past the table refused by row; their CUDA bindings equal the references."""
import pytest
import torch

from draft_circuit.ops.registry import get_op
from draft_circuit.ops.sampling import mask_words
from draft_circuit.ops.vocab import DraftIdError, map_ids_ref, remap_bitmask_ref
from draft_circuit.runners.testing import cuda


def random_mask(n: int, words: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, (n, words), generator=g, dtype=torch.int64).to(torch.int32)


def bit(mask: torch.Tensor, row: int, token: int) -> int:
    return (int(mask[row, token >> 5]) >> (token & 31)) & 1  # Python's >> keeps the sign: & 1 is exact


@pytest.mark.parametrize("size", [1, 31, 32, 33, 70, 96])
def test_remap_bitmask_moves_each_subset_bit(size):
    vocab = 200
    g = torch.Generator().manual_seed(size)
    ids = torch.randperm(vocab, generator=g)[:size].int()
    mask = random_mask(4, mask_words(vocab), seed=size)
    out = remap_bitmask_ref(mask, ids)
    assert out.dtype == torch.int32 and out.shape == (4, mask_words(size))
    for r in range(4):
        for s in range(out.shape[1] * 32):
            want = bit(mask, r, int(ids[s])) if s < size else 0  # bits past the subset: 0
            assert bit(out, r, s) == want, (r, s)


def test_remap_bitmask_refuses_ids_past_the_mask():
    with pytest.raises(DraftIdError, match="subset id 64 is outside the 2-word bitmask"):
        remap_bitmask_ref(random_mask(1, 2, 0), torch.tensor([3, 64], dtype=torch.int32))


def test_map_ids_keeps_minus_one_and_names_a_bad_row():
    table = torch.tensor([40, 7, 99], dtype=torch.int32)
    out = map_ids_ref(torch.tensor([2, -1, 0, 1], dtype=torch.int32), table)
    assert out.tolist() == [99, -1, 40, 7] and out.dtype == torch.int32
    with pytest.raises(DraftIdError, match="draft id 3 at row 1"):
        map_ids_ref(torch.tensor([0, 3], dtype=torch.int32), table)


def test_shape_rules_refuse_what_the_ops_cannot_take():
    from draft_circuit.circuit.ir import TensorSpec
    from draft_circuit.ops.registry import ShapeError
    S = lambda dt, *shape: TensorSpec(dtype=dt, shape=shape)  # noqa: E731
    with pytest.raises(ShapeError, match="id table must be int32"):
        get_op("map_ids").infer([S("int32", "n"), S("int64", 5)], None)
    with pytest.raises(ShapeError, match="subset ids must be int32"):
        get_op("remap_bitmask").infer([S("int32", "n", 3), S("int64", 5)], None)
    assert get_op("remap_bitmask").infer([S("int32", "n", 3), S("int32", 33)], None)[0].shape == ("n", 2)


@cuda
def test_cuda_bindings_equal_the_references():
    ids = torch.randperm(5000)[:1000].int()
    mask = random_mask(7, mask_words(5000), seed=1)
    draft = torch.randint(-1, 1000, (7,), dtype=torch.int32)
    for op, ins in (("remap_bitmask", [mask, ids]), ("map_ids", [draft, ids])):
        want = get_op(op).reference(ins, None)[0]
        for binding in get_op(op).kernels:  # remap_bitmask: the Triton kernel, then the torch fallback
            out = torch.empty_like(want, device="cuda")
            binding.launch([t.cuda() for t in ins], [out], [], None)
            assert torch.equal(out.cpu(), want), binding.name
