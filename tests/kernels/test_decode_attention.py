"""decode_attention (paged, GQA, split-KV) against a plain torch reference (interpreter on CPU)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_circuit.kernels._common import KernelInputError
from draft_circuit.kernels.decode_attention import decode_attention, decode_attention_workspace_shape
from draft_circuit.runners.testing import cuda  # marks `cuda` and skips without a GPU
from tests import sm90_compile

# the interpreter evaluates both sides of tl.where, so masked-off lanes may warn; they are expected
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
              live_rows: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
              row_offset: int) -> torch.Tensor:
    """Row i attends to its sequence rows 0..L-1, L = live_rows[i] + row_offset + 1; fp32 softmax."""
    q, k_cache, v_cache = q.cpu(), k_cache.cpu(), v_cache.cpu()
    block_size = k_cache.shape[1]
    kv_of_head = torch.arange(num_heads) // (num_heads // num_kv_heads)
    out = torch.empty(q.shape, dtype=q.dtype)
    for i in range(q.shape[0]):
        rows = torch.arange(int(live_rows[i]) + row_offset + 1)
        blocks = block_tables[i].cpu().long()[rows // block_size]
        k = k_cache[blocks, rows % block_size].float()[:, kv_of_head]  # [L, Hq, D]
        v = v_cache[blocks, rows % block_size].float()[:, kv_of_head]
        qi = q[i].float().view(num_heads, head_dim)
        p = torch.softmax(scale * torch.einsum("hd,lhd->hl", qi, k), dim=-1)
        out[i] = torch.einsum("hl,lhd->hd", p, v).reshape(-1).to(q.dtype)
    return out


def make_case(lengths: list[int], *, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
              dtype: torch.dtype, tail: int, seed: int, spare_blocks: int = 2) -> dict:
    """Caches full of NaN except the live rows, shuffled blocks, block-table tails set to `tail`."""
    gen = torch.Generator().manual_seed(seed)
    n = len(lengths)
    blocks_per_row = [-(-length // block_size) for length in lengths]
    max_blocks = max(blocks_per_row) + spare_blocks
    num_blocks = sum(blocks_per_row) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, float("nan"), dtype=dtype)
    v_cache = torch.full(shape, float("nan"), dtype=dtype)
    order = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((n, max_blocks), tail, dtype=torch.int32)
    used = 0
    for i, (length, count) in enumerate(zip(lengths, blocks_per_row)):
        block_tables[i, :count] = order[used:used + count].int()
        used += count
        rows = torch.arange(length)
        blocks = block_tables[i].long()[rows // block_size]
        k_cache[blocks, rows % block_size] = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
        v_cache[blocks, rows % block_size] = torch.randn(length, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(n, num_heads * head_dim, generator=gen).to(dtype)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables)


#: tests that do not launch the split kernel: run once, not once a kind
_ONE_KIND = {"test_split_kernel_compiles_without_dot", "test_split_dot_kernel_compiles_for_sm90_with_its_two_dots",
             "test_split_programs_follow_the_width"}


def pytest_generate_tests(metafunc):
    if metafunc.function.__name__ not in _ONE_KIND:
        metafunc.parametrize("split_kind", [True, False], ids=["dot", "elementwise"], indirect=True)


@pytest.fixture(autouse=True)
def split_kind(request, monkeypatch):
    """Every test that launches the kernels runs the split as tl.dot tiles (the default) and
    elementwise; it checks that the launcher ran the kernel asked for."""
    import draft_circuit.kernels.decode_attention as da
    dot = getattr(request, "param", True)
    monkeypatch.setattr(da, "DOT_SPLIT", dot)
    ran = []
    for name in ("_split_kernel", "_split_dot_kernel"):
        real = getattr(da, name)
        monkeypatch.setattr(da, name, _Spy(real, name, ran))
    yield dot
    if ran:  # (split_rows not a multiple of 16 falls back to the elementwise kernel)
        assert set(ran) <= {"_split_dot_kernel" if dot else "_split_kernel", "_split_kernel"}
        assert dot or set(ran) == {"_split_kernel"}


class _Spy:
    """`kernel[grid](...)` as the real one, the kernel's name recorded."""

    def __init__(self, real, name, ran):
        self.real, self.name, self.ran = real, name, ran

    def __getitem__(self, grid):
        self.ran.append(self.name)
        return self.real[grid]


def run(case: dict, live_rows: torch.Tensor, **attrs) -> torch.Tensor:
    out = torch.full_like(case["q"], float("nan"))  # poisoned: every element must be written
    decode_attention(case["q"], case["k_cache"], case["v_cache"], case["block_tables"], live_rows, out, **attrs)
    return out


HEADS = [(2, 2, 80), (4, 2, 64), (8, 2, 80)]  # GQA ratios 1, 2, 4; head_dim 80 is not a power of two


# each factor at each of its values: dtype x (GQA ratio, head_dim) x (row_offset, block-table tail)
CASES = [
    (torch.float32, HEADS[0], 0, -1), (torch.float32, HEADS[1], 2, 10**6), (torch.float32, HEADS[2], 0, 10**6),
    (torch.float16, HEADS[0], 2, -1), (torch.float16, HEADS[1], 0, 10**6), (torch.float16, HEADS[2], 2, -1),
]


@pytest.mark.parametrize("dtype,heads,row_offset,tail", CASES)
def test_matches_reference(dtype: torch.dtype, heads: tuple[int, int, int], row_offset: int, tail: int) -> None:
    num_heads, num_kv_heads, head_dim = heads
    lengths = [max(length, row_offset + 1) for length in [1, 15, 16, 17, 40, 70]]
    case = make_case(lengths, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     block_size=16, dtype=dtype, tail=tail, seed=num_heads + row_offset)
    live_rows = torch.tensor(lengths, dtype=torch.int32) - row_offset - 1
    attrs = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                 scale=head_dim ** -0.5, row_offset=row_offset)
    # 32-row splits: the 40- and 70-row sequences span 2 and 3 splits, ending mid-split
    out = run(case, live_rows, split_rows=32, **attrs)
    ref = reference(**case, live_rows=live_rows, **attrs)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol)


# GQA groups of 8 and more: 4, 2 and 1 KV rows per step; 24 heads pad to 32 (masked head lanes)
BIG_GROUPS = [(torch.float32, (16, 1, 64)), (torch.float16, (8, 1, 80)), (torch.float16, (24, 1, 64))]


@pytest.mark.parametrize("dtype,heads", BIG_GROUPS)
def test_large_gqa_groups_match_reference(dtype: torch.dtype, heads: tuple[int, int, int]) -> None:
    num_heads, num_kv_heads, head_dim = heads
    lengths = [1, 9, 33]  # the 33-row sequence spans two 32-row splits
    case = make_case(lengths, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     block_size=16, dtype=dtype, tail=10**6, seed=num_heads)
    live_rows = torch.tensor(lengths, dtype=torch.int32) - 2
    attrs = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                 scale=head_dim ** -0.5, row_offset=1)
    out = run(case, live_rows, split_rows=32, **attrs)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out, reference(**case, live_rows=live_rows, **attrs), atol=tol, rtol=tol)


# Compiles the split kernel for sm90 (no GPU needed) in a fresh, interpreter-free process and prints
# how many tt.dot ops its TTGIR holds. The kernel is meant to be elementwise products + tl.sum only:
# Triton's combine pass turns sum(x[:, :, None] * y[None, :, :], 1) into a tt.dot when M, N >= 16
# whatever K is, and with K = rows per step (2 at G=16, 1 at G=32) Triton 3.6 lowers it to a tf32
# mma (k = 8) that gives wrong results on the GPU, which the interpreter never shows. Run after
# tests/sm90_compile.py's preamble (the module's jit functions alone, as `module`): each GQA
# group's tt.dot count and their least dimension.
_SPLIT_DOTS = """
    name = sys.argv[2]
    step = next(ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                and [t.id for t in n.targets if isinstance(t, ast.Name)] == ["STEP_ROWS_X_HEADS"])
    names = ["q_ptr", "k_ptr", "v_ptr", "tables_ptr", "live_ptr", "ws_ptr", "row_offset", "capacity",
             "max_splits", "grid_splits", "qk_scale_log2", "stride_q", "stride_table", "stride_kb", "stride_ks", "stride_kh",
             "stride_vb", "stride_vs", "stride_vh", "pdl_release"]
    types = ["*bf16"] * 3 + ["*i32", "*i32", "*fp32", "i32", "i32", "i32", "i32", "fp32"] + ["i32"] * 9
    consts = {t.id: ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
              for t in n.targets if isinstance(t, ast.Name) and t.id in ("DOT_BLOCK_N", "DOT_MIN")}
    consts.update({t.id: v for n in tree.body if isinstance(n, ast.Assign)
                   and isinstance(n.targets[0], ast.Tuple)
                   for t, v in zip(n.targets[0].elts, ast.literal_eval(n.value))
                   if t.id in ("DOT_BLOCK_N", "DOT_MIN")})
    dot = name == "_split_dot_kernel"
    for group, d in ((1, 128), (4, 128), (16, 64), (32, 80)) if dot else ((16, 64), (32, 64)):
        least = consts["DOT_MIN"] if dot else 1
        const = dict(NUM_HEADS=group, GROUP=group, GROUP_PAD=max(least, triton.next_power_of_2(group)),
                     HEAD_DIM=d, D_PAD=max(least, triton.next_power_of_2(d)), BLOCK_SIZE=16,
                     BLOCK_N=consts["DOT_BLOCK_N"] if dot else max(1, step // group),
                     SPLIT=32 if dot else 256, USE_PDL=False)
        sig = dict(zip(names, types), **{name: "constexpr" for name in const})
        kernel = triton.compile(ASTSource(fn=getattr(module, name), signature=sig, constexprs=const),
                                target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
        ir = kernel.asm["ttgir"]
        # each dot's operand and result shapes, e.g. tensor<16x128xbf16, ...>: their least dim
        dims = [min(int(x) for x in re.findall(r"tensor<((?:\\d+x)+)", line)[0].rstrip("x").split("x"))
                for line in ir.splitlines() if " tt.dot " in line]
        print("group", group, "dots", len(dims), "least", min(dims, default=0))
    shutil.rmtree(tmp.parent)
"""


def _compiled(name: str) -> list[str]:
    source = Path(__file__).resolve().parents[2] / "kernels" / "decode_attention.py"
    proc = sm90_compile.run(_SPLIT_DOTS, source, name)
    return [line for line in proc.stdout.splitlines() if line.startswith("group")]


def test_split_kernel_compiles_without_dot() -> None:
    assert _compiled("_split_kernel") == ["group 16 dots 0 least 0", "group 32 dots 0 least 0"]


def test_split_dot_kernel_compiles_for_sm90_with_its_two_dots() -> None:
    """The dot kernel at GQA groups 1, 4, 16 and 32 (padded to >= 16 query rows) and head dims
    128, 64 and 80 (padded): both products are tl.dot tiles with every dimension >= 16 (the
    elementwise kernel's Triton hazard, a dot with K < 8, cannot arise)."""
    from draft_circuit.kernels.decode_attention import DOT_MIN
    got = [line.split() for line in _compiled("_split_dot_kernel")]
    assert [(int(x[1]), int(x[3])) for x in got] == [(g, 2) for g in (1, 4, 16, 32)]
    assert all(int(x[5]) >= DOT_MIN for x in got), got  # every operand and result dim


@pytest.mark.parametrize("block_size", [8, 32])
def test_other_block_sizes_and_default_split(block_size: int) -> None:
    lengths = [1, 9, 33, 50]
    case = make_case(lengths, num_heads=4, num_kv_heads=1, head_dim=64, block_size=block_size,
                     dtype=torch.float32, tail=-1, seed=block_size)
    live_rows = torch.tensor(lengths, dtype=torch.int32) - 1
    attrs = dict(num_heads=4, num_kv_heads=1, head_dim=64, scale=0.3, row_offset=0)
    torch.testing.assert_close(run(case, live_rows, **attrs), reference(**case, live_rows=live_rows, **attrs),
                               atol=1e-5, rtol=1e-5)


def test_row_does_not_depend_on_batch() -> None:
    lengths = [40, 3, 17]
    case = make_case(lengths, num_heads=4, num_kv_heads=2, head_dim=80, block_size=16,
                     dtype=torch.float32, tail=-1, seed=3)
    live_rows = torch.tensor(lengths, dtype=torch.int32) - 1
    attrs = dict(num_heads=4, num_kv_heads=2, head_dim=80, scale=0.1, row_offset=0, split_rows=16)
    batch = run(case, live_rows, **attrs)
    alone = run({**case, "q": case["q"][:1].clone(), "block_tables": case["block_tables"][:1].clone()},
                live_rows[:1].clone(), **attrs)
    assert torch.equal(alone, batch[:1])


def test_workspace_passed_in() -> None:
    lengths = [20, 5]
    case = make_case(lengths, num_heads=2, num_kv_heads=1, head_dim=64, block_size=16,
                     dtype=torch.float32, tail=-1, seed=4)
    live_rows = torch.tensor(lengths, dtype=torch.int32) - 1
    attrs = dict(num_heads=2, num_kv_heads=1, head_dim=64, scale=0.125, row_offset=0)
    max_rows = case["block_tables"].shape[1] * 16
    workspace = torch.full(decode_attention_workspace_shape(2, 2, 64, max_rows, split_rows=16), float("nan"))
    out = run(case, live_rows, workspace=workspace, split_rows=16, **attrs)
    torch.testing.assert_close(out, reference(**case, live_rows=live_rows, **attrs), atol=1e-5, rtol=1e-5)
    with pytest.raises(KernelInputError, match="workspace"):
        run(case, live_rows, workspace=workspace[:, :, :1], split_rows=16, **attrs)


def test_zero_live_rows_write_zeros() -> None:
    # out of contract (L >= 1 by construction), but a padded row must still come out finite
    case = make_case([4, 4], num_heads=2, num_kv_heads=2, head_dim=64, block_size=16,
                     dtype=torch.float32, tail=-1, seed=5)
    live_rows = torch.tensor([3, -1], dtype=torch.int32)
    out = run(case, live_rows, num_heads=2, num_kv_heads=2, head_dim=64, scale=0.125, row_offset=0)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and torch.isfinite(out[0]).all()


def test_rejects_bad_inputs() -> None:
    case = make_case([4], num_heads=2, num_kv_heads=1, head_dim=64, block_size=16,
                     dtype=torch.float32, tail=-1, seed=6)
    attrs = dict(num_heads=2, num_kv_heads=1, head_dim=64, scale=0.125, row_offset=0)
    live_rows = torch.tensor([3], dtype=torch.int32)
    with pytest.raises(KernelInputError, match="block_tables"):
        run({**case, "block_tables": case["block_tables"].long()}, live_rows, **attrs)
    with pytest.raises(KernelInputError, match="live_rows"):
        run(case, live_rows.long(), **attrs)
    with pytest.raises(KernelInputError, match="k_cache"):
        run({**case, "k_cache": case["k_cache"].half()}, live_rows, **attrs)
    with pytest.raises(KernelInputError, match="num_kv_heads"):
        run(case, live_rows, **{**attrs, "num_kv_heads": 3})
    with pytest.raises(KernelInputError, match="split_rows"):
        run(case, live_rows, split_rows=20, **attrs)


# ---- GPU ---------------------------------------------------------------------------------------

def to_cuda(case: dict) -> dict:
    return {name: t.cuda() for name, t in case.items()}


@cuda
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(8, 8, 128), (16, 4, 80), (32, 8, 128), (16, 1, 64)])
def test_cuda_bf16_against_fp32_reference(num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    lengths = [1, 15, 16, 17, 40, 255, 256, 257, 1000]
    case = make_case(lengths, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                     block_size=16, dtype=torch.bfloat16, tail=10**6, seed=num_heads)
    live_rows = torch.tensor(lengths, dtype=torch.int32) - 3
    attrs = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                 scale=head_dim ** -0.5, row_offset=2)
    out = run(to_cuda(case), live_rows.cuda(), **attrs)
    ref = reference(**{name: t.float() if t.is_floating_point() else t for name, t in case.items()},
                    live_rows=live_rows, **attrs)
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)


@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_cuda_width_independence(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(7)
    num_heads, num_kv_heads, head_dim, block_size = 16, 4, 128, 16
    attrs = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, scale=head_dim ** -0.5,
                 row_offset=1)
    for n in torch.randint(2, 65, (10,), generator=gen).tolist() + [2, 64]:
        lengths = torch.randint(1, 700, (n,), generator=gen).tolist()
        case = to_cuda(make_case(lengths, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                 block_size=block_size, dtype=dtype, tail=-1, seed=n))
        live_rows = (torch.tensor(lengths, dtype=torch.int32) - 2).clamp(min=-1).cuda()
        batch = run(case, live_rows, **attrs)
        alone = run({**case, "q": case["q"][:1].clone(), "block_tables": case["block_tables"][:1].clone()},
                    live_rows[:1].clone(), **attrs)
        assert torch.equal(alone, batch[:1]), n


@pytest.mark.parametrize("split_programs", [1, 3, 5])
def test_fewer_split_programs_than_splits_give_the_same_bits(monkeypatch, split_programs: int) -> None:
    """The split axis of the grid follows n (SPLIT_PROGRAMS): programs then take every
    grid_splits-th live split of their row. Every split is computed as alone, so the output is
    bitwise the one-program-a-split launch's, at rows of 1 to 6 splits (and a row whose block
    table holds more splits than it lives)."""
    import draft_circuit.kernels.decode_attention as da
    lengths = [1, 16, 17, 50, 95]
    case = make_case(lengths, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                     dtype=torch.float32, tail=-1, seed=11, spare_blocks=3)
    live_rows = torch.tensor(lengths, dtype=torch.int32) - 1
    attrs = dict(num_heads=4, num_kv_heads=2, head_dim=64, scale=0.2, row_offset=0, split_rows=16)
    every = run(case, live_rows, **attrs)  # 5 rows x 2 heads x 8 splits < SPLIT_PROGRAMS: one each
    assert da.split_programs(5, 2, 8) == 8
    monkeypatch.setattr(da, "SPLIT_PROGRAMS", split_programs)
    assert da.split_programs(5, 2, 8) == 1
    monkeypatch.setattr(da, "SPLIT_PROGRAMS", split_programs * 10)
    assert da.split_programs(5, 2, 8) == min(8, -(-split_programs * 10 // 10))
    assert torch.equal(run(case, live_rows, **attrs), every)


def test_split_programs_follow_the_width() -> None:
    from draft_circuit.kernels.decode_attention import SPLIT_PROGRAMS, split_programs
    assert split_programs(1, 8, 32) == 32 and split_programs(8, 8, 32) == 32
    assert split_programs(64, 8, 32) == SPLIT_PROGRAMS // 512 == 4
    assert split_programs(4096, 8, 32) == 1 and split_programs(1, 1, 1) == 1
