"""remap_bitmask kernel (issue 18) against ops.vocab.remap_bitmask_ref, bit for bit.

CPU: under the Triton interpreter, widths 1, 3 and 8, subset sizes on and off a 32-bit word,
ids on bit 0 and bit 31 of a word and the vocabulary's last id, random, all-ones and all-zero
masks; every output word written, a row alone equals the row in a batch, strided rows, an id past
the mask reads nothing. The op binds it first, and a subset chain with a bitmask planned for
CUDA runs the remap as that one launch. cuda (`-m cuda`): the same bits on the GPU at the 8B
shapes, width independence, and one profiled kernel a remap.
"""
from __future__ import annotations

import pytest
import torch

from draft_circuit.kernels._common import KernelInputError
from draft_circuit.kernels.remap_bitmask import LAUNCHES, remap_bitmask
from draft_circuit.ops.registry import get_op
from draft_circuit.ops.sampling import mask_words
from draft_circuit.ops.vocab import DraftIdError, remap_bitmask_ref
from draft_circuit.runners.testing import cuda  # marks `cuda` and skips without a GPU

VOCAB = 1000  # 32 words, the last one partial (1000 = 31 * 32 + 8)
POISON = 0x5A5A5A5A  # what no output word starts as, so a word left unwritten shows


def random_mask(n: int, words: int, seed: int, device: str = "cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2**31, 2**31 - 1, (n, words), generator=g, dtype=torch.int64).to(torch.int32).to(device)


def subset_ids(size: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    """`size` distinct ids, most of them on a word's edge: bit 31 and bit 0 of words, the
    vocabulary's last id, then random ones."""
    edges = [31, 0, vocab - 1, 32, 63, 64 * 3 + 31, vocab - 1 - (vocab - 1) % 32]
    g = torch.Generator().manual_seed(seed)
    rest = [i for i in torch.randperm(vocab, generator=g).tolist() if i not in edges]
    return torch.tensor((edges + rest)[:size], dtype=torch.int32)


def launched(mask: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    out = torch.full((mask.shape[0], mask_words(ids.shape[0])), POISON, dtype=torch.int32, device=mask.device)
    remap_bitmask(mask, ids, out)
    return out


@pytest.mark.parametrize("size", [1, 31, 32, 33, 100])
@pytest.mark.parametrize("n", [1, 3, 8])
def test_kernel_equals_the_reference_bitwise(n, size):
    ids = subset_ids(size, seed=size)
    for mask in (random_mask(n, mask_words(VOCAB), seed=n * 100 + size),
                 torch.full((n, mask_words(VOCAB)), -1, dtype=torch.int32),  # all allowed
                 torch.zeros(n, mask_words(VOCAB), dtype=torch.int32)):
        got = launched(mask, ids)
        assert torch.equal(got, remap_bitmask_ref(mask, ids))
    # all-ones: every subset bit set, the last word's bits past S clear
    full = launched(torch.full((n, mask_words(VOCAB)), -1, dtype=torch.int32), ids)
    tail = size % 32
    assert (full[:, -1] == (-1 if tail == 0 else (1 << tail) - 1)).all()
    assert (full[:, :-1] == -1).all()


def test_the_sign_bit_moves_both_ways():
    """Bit 31 of an input word lands on bit 0 of the output and bit 0 on bit 31 (the sign)."""
    ids = torch.tensor([31] + list(range(100, 130)) + [32], dtype=torch.int32)  # 32 ids: one word
    mask = torch.zeros(2, mask_words(VOCAB), dtype=torch.int32)
    mask[0, 0] = -2**31  # only token 31
    mask[1, 1] = 1  # only token 32
    got = launched(mask, ids)
    assert got.tolist() == [[1], [-2**31]] == remap_bitmask_ref(mask, ids).tolist()


@pytest.mark.parametrize("size", [33, 100])
def test_a_row_alone_equals_the_row_in_a_batch(size):
    ids = subset_ids(size, seed=7)
    batch = random_mask(8, mask_words(VOCAB), seed=size)
    together = launched(batch, ids)
    for r in range(8):
        assert torch.equal(launched(batch[r:r + 1].clone(), ids)[0], together[r]), r


def test_strided_rows():
    ids = subset_ids(70, seed=3)
    base = random_mask(3, mask_words(VOCAB) + 5, seed=11)
    mask = base[:, 2:2 + mask_words(VOCAB)]
    out_base = torch.full((3, 9), POISON, dtype=torch.int32)
    out = out_base[:, 1:1 + mask_words(70)]
    remap_bitmask(mask, ids, out)
    assert torch.equal(out, remap_bitmask_ref(mask, ids))
    assert (out_base[:, :1] == POISON).all() and (out_base[:, 1 + mask_words(70):] == POISON).all()


def test_an_id_past_the_mask_reads_nothing():
    """The reference refuses an id outside [0, 32 W) (DraftIdError); the kernel, which cannot
    raise without a host sync, reads no word for it and gives 0 (not allowed), even where the
    words past the row's end are all ones."""
    words = mask_words(VOCAB)
    base = torch.full((2, words + 4), -1, dtype=torch.int32)
    mask = base[:, :words]
    ids = torch.tensor([5, 32 * words, 32 * words + 40, -1, 7], dtype=torch.int32)
    with pytest.raises(DraftIdError, match=f"subset id {32 * words} is outside the {words}-word bitmask"):
        remap_bitmask_ref(mask, ids)
    got = launched(mask, ids)
    assert got.tolist() == [[0b10001]] * 2


def test_the_bound_ids_always_lie_inside_the_mask():
    """Where ids are checked: a draft vocabulary refuses an id outside [0, vocab_size) when it is
    built, and the host's mask has ceil(vocab_size / 32) words, so every bound id has its bit."""
    from draft_circuit.circuit.layers.draft_vocab import DraftVocab, DraftVocabError
    with pytest.raises(DraftVocabError, match="outside the target vocabulary"):
        DraftVocab((3, VOCAB), VOCAB)
    assert VOCAB - 1 < 32 * mask_words(VOCAB)


def test_launcher_refuses_bad_operands():
    mask, ids = random_mask(2, 4, seed=0), torch.arange(40, dtype=torch.int32)
    with pytest.raises(KernelInputError, match="ids"):
        remap_bitmask(mask, ids.long(), torch.empty(2, 2, dtype=torch.int32))
    with pytest.raises(KernelInputError, match="out"):
        remap_bitmask(mask, ids, torch.empty(2, 3, dtype=torch.int32))
    with pytest.raises(KernelInputError, match="bitmask"):
        remap_bitmask(mask.float(), ids, torch.empty(2, 2, dtype=torch.int32))
    with pytest.raises(KernelInputError, match="bitmask"):
        remap_bitmask(mask[0], ids, torch.empty(2, 2, dtype=torch.int32))


def test_the_op_binds_the_kernel_first_as_one_launch(interpreted_launches):
    from draft_circuit.circuit.types import ROW, TensorSpec
    op = get_op("remap_bitmask")
    assert [k.name for k in op.kernels] == ["triton_remap_bitmask", "torch_remap_bitmask"]
    triton_binding, torch_binding = op.kernels
    specs = [TensorSpec(dtype="int32", shape=(ROW, 4008)), TensorSpec(dtype="int32", shape=(32768,))]
    assert triton_binding.applies("cuda", specs, None) and triton_binding.applies("interpret", specs, None)
    assert triton_binding.launch_count(specs, None) == LAUNCHES == 1 < torch_binding.launch_count(specs, None)
    mask, ids = random_mask(3, mask_words(VOCAB), seed=2), subset_ids(45, seed=2)
    out = torch.empty(3, mask_words(45), dtype=torch.int32)
    triton_binding.launch([mask, ids], [out], [], None)
    assert interpreted_launches == ["remap_bitmask_kernel"]
    assert torch.equal(out, remap_bitmask_ref(mask, ids))


def test_a_subset_chain_plans_the_remap_as_one_launch():
    """The proposer's 8B chain over 32,768 ids, planned for the GPU on meta weights: the mask's
    remap is the Triton kernel, one GPU launch (the torch binding's 15 aten kernels before)."""
    from draft_circuit.circuit.layers.config import MtpConfig
    from draft_circuit.circuit.layers.mtp import KvLayout, MtpHead, emit_draft_chain
    from draft_circuit.circuit.planner import compile_draft
    from draft_circuit.circuit.report import gpu_launches
    cfg = MtpConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                    num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0,
                    num_hidden_layers=1, tie_word_embeddings=False, max_position_embeddings=8192)
    c = emit_draft_chain(MtpHead(cfg, "bfloat16"), 3, max_width=8, kv=KvLayout(60, 8, 5), draft_vocab=32768,
                         bitmask=True, embed_target=True, confidence_stop=True)
    params = {v.name: torch.empty(v.shape, device="meta", dtype=getattr(torch, v.dtype))
              for v in c.values if v.kind == "param"}
    compiled = compile_draft(c, params, [1, 8], device="cuda")
    for w in (1, 8):
        (remap,) = [x for x in compiled.programs[w].launches if x.op == "remap_bitmask"]
        assert remap.kernel == "triton_remap_bitmask" and remap.step is None and gpu_launches(remap) == 1


# ---- on the GPU ----
@cuda
@pytest.mark.parametrize("vocab,size", [(VOCAB, 100), (5000, 1000), (128256, 32768), (151936, 32000)])
def test_cuda_kernel_equals_the_reference(vocab, size):
    ids = subset_ids(size, seed=size, vocab=vocab).cuda()
    for n in (1, 3, 8, 64):
        mask = random_mask(n, mask_words(vocab), seed=n).cuda()
        mask[0] = -1
        assert torch.equal(launched(mask, ids).cpu(), remap_bitmask_ref(mask.cpu(), ids.cpu())), (n, vocab, size)


@cuda
def test_cuda_rows_are_width_independent():
    ids = subset_ids(32768, seed=1, vocab=128256).cuda()
    batch = random_mask(64, mask_words(128256), seed=5).cuda()
    together = launched(batch, ids)
    for n in (1, 2, 7, 8, 33):
        assert torch.equal(launched(batch[:n].clone(), ids), together[:n]), n


@cuda
def test_cuda_one_kernel_a_remap():
    from torch.profiler import ProfilerActivity, profile
    ids = subset_ids(32768, seed=1, vocab=128256).cuda()
    mask = random_mask(8, mask_words(128256), seed=5).cuda()
    out = torch.empty(8, mask_words(32768), dtype=torch.int32, device="cuda")
    binding = get_op("remap_bitmask").kernels[0]
    binding.launch([mask, ids], [out], [], None)  # compile first
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        binding.launch([mask, ids], [out], [], None)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type.name == "CUDA"]
    assert names == ["remap_bitmask_kernel"], names
