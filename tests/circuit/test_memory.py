"""The arena planner: invariants on random lifetime sets checked by brute force (no live overlap,
lower bound <= arena <= naive, determinism, order independence), then worked examples and errors."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from draft_circuit.circuit.memory import (
    STRATEGIES, Buffer, MemoryPlanError, Placement, check_placement, lower_bound, place_by_lifetime,
    place_greedy_by_size, plan_memory,
)

SETTINGS = settings(max_examples=200, deadline=None)


def _align_up(size: int, alignment: int) -> int:
    return -(-size // alignment) * alignment


@st.composite
def buffer_sets(draw, max_buffers: int = 60) -> list[Buffer]:
    spans = draw(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12),
                                    st.integers(0, 10**6) | st.sampled_from([0, 1, 255, 256, 257])),
                          max_size=max_buffers))
    return [Buffer(f"t{i}", size, first, first + length)
            for i, (first, length, size) in enumerate(spans)]


alignments = st.sampled_from([1, 8, 256, 4096])


def assert_sound(bufs: list[Buffer], offsets: dict[str, int], arena: int, alignment: int) -> None:
    """Brute force, independent of check_placement: every pair live together is byte-disjoint."""
    assert set(offsets) == {b.name for b in bufs}
    for b in bufs:
        assert offsets[b.name] % alignment == 0 and 0 <= offsets[b.name]
        assert offsets[b.name] + b.size_bytes <= arena
    for i, a in enumerate(bufs):
        for b in bufs[i + 1:]:
            if a.first <= b.last and b.first <= a.last and a.size_bytes and b.size_bytes:
                lo_a, lo_b = offsets[a.name], offsets[b.name]
                disjoint = lo_a + a.size_bytes <= lo_b or lo_b + b.size_bytes <= lo_a
                assert disjoint, (a, b, lo_a, lo_b)


def brute_lower_bound(bufs: list[Buffer], alignment: int) -> int:
    steps = {s for b in bufs for s in range(b.first, b.last + 1)}
    return max((sum(_align_up(b.size_bytes, alignment) for b in bufs if b.first <= s <= b.last)
                for s in steps), default=0)


def arena_of(bufs: list[Buffer], offsets: dict[str, int], alignment: int) -> int:
    return max((offsets[b.name] + _align_up(b.size_bytes, alignment) for b in bufs), default=0)


# --- properties ------------------------------------------------------------------------------


@SETTINGS
@given(bufs=buffer_sets(), alignment=alignments)
def test_plan_is_sound_and_within_bounds(bufs: list[Buffer], alignment: int) -> None:
    plan = plan_memory(bufs, alignment)
    assert_sound(bufs, plan.offsets, plan.arena_bytes, alignment)
    check_placement(bufs, plan)
    assert plan.lower_bound_bytes == lower_bound(bufs, alignment)
    assert plan.lower_bound_bytes == brute_lower_bound(bufs, alignment)
    assert plan.naive_bytes == sum(_align_up(b.size_bytes, alignment) for b in bufs)
    assert plan.lower_bound_bytes <= plan.arena_bytes <= plan.naive_bytes
    assert plan.arena_bytes % alignment == 0
    arenas = {name: arena_of(bufs, place(bufs, alignment), alignment)
              for name, place in STRATEGIES.items()}
    assert plan.arena_bytes == arenas[plan.strategy] == min(arenas.values())
    assert plan.offsets == STRATEGIES[plan.strategy](bufs, alignment)


@SETTINGS
@given(bufs=buffer_sets(), alignment=alignments)
def test_each_strategy_is_sound_on_its_own(bufs: list[Buffer], alignment: int) -> None:
    for place in (place_greedy_by_size, place_by_lifetime):
        offsets = place(bufs, alignment)
        assert_sound(bufs, offsets, arena_of(bufs, offsets, alignment), alignment)


@SETTINGS
@given(data=st.data(), bufs=buffer_sets(), alignment=alignments)
def test_plan_depends_only_on_the_set_of_buffers(data, bufs: list[Buffer], alignment: int) -> None:
    plan = plan_memory(bufs, alignment)
    shuffled = data.draw(st.permutations(bufs))
    again = plan_memory(shuffled, alignment)
    assert again == plan
    assert list(plan.offsets) == sorted(b.name for b in bufs)
    assert json.dumps(again.to_dict()) == json.dumps(plan.to_dict())  # key order too
    assert Placement.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


@SETTINGS
@given(data=st.data(), bufs=buffer_sets(max_buffers=20), alignment=alignments)
def test_check_placement_catches_any_forced_collision(data, bufs: list[Buffer],
                                                      alignment: int) -> None:
    pairs = [(a, b) for a in bufs for b in bufs if a.name < b.name and a.size_bytes and b.size_bytes
             and a.first <= b.last and b.first <= a.last]
    if not pairs:
        return
    a, b = data.draw(st.sampled_from(pairs))
    plan = plan_memory(bufs, alignment)
    # a roomy arena, so that only the collision can be at fault
    clash = _with(plan, offsets={**plan.offsets, b.name: plan.offsets[a.name]},
                  arena_bytes=2 * plan.naive_bytes)
    with pytest.raises(MemoryPlanError, match=r"overlap in the arena") as err:
        check_placement(bufs, clash)
    assert repr(a.name) in str(err.value) or repr(b.name) in str(err.value)


# --- worked examples -------------------------------------------------------------------------


def test_chain_reuses_the_first_buffer_for_the_third() -> None:
    # a -> b -> c: b is written at step 1 from a; c is written at step 2, after a is dead
    bufs = [Buffer("a", 1000, 0, 1), Buffer("b", 1000, 1, 2), Buffer("c", 1000, 2, 3)]
    plan = plan_memory(bufs)
    assert plan.offsets["a"] == plan.offsets["c"] != plan.offsets["b"]
    assert (plan.arena_bytes, plan.lower_bound_bytes, plan.naive_bytes) == (2048, 2048, 3072)
    assert plan.strategy == "greedy_by_size"  # both strategies find 2048: the tie goes to size


def test_buffers_live_together_get_distinct_aligned_slots() -> None:
    plan = plan_memory([Buffer("x", 1, 0, 0), Buffer("y", 1, 0, 0)], alignment=256)
    assert sorted(plan.offsets.values()) == [0, 256] and plan.arena_bytes == 512


def test_disjoint_lifetimes_all_share_offset_zero() -> None:
    bufs = [Buffer(f"t{i}", 100 * (i + 1), i, i) for i in range(5)]
    plan = plan_memory(bufs, alignment=1)
    assert set(plan.offsets.values()) == {0} and plan.arena_bytes == 500


def test_best_fit_takes_the_tightest_gap_not_the_lowest() -> None:
    # at steps 5..9 only p, r, v are live: gaps [100,150) (waste 30) and [190,215) (waste 5)
    bufs = [Buffer("p", 100, 0, 9), Buffer("q", 50, 0, 0), Buffer("r", 40, 0, 9),
            Buffer("s", 25, 0, 0), Buffer("v", 24, 0, 9), Buffer("t", 20, 5, 9)]
    assert place_greedy_by_size(bufs, 1)["t"] == 190
    assert plan_memory(bufs, alignment=1).offsets["t"] == 190


def test_plan_keeps_the_by_size_arena_when_it_is_smaller() -> None:
    bufs = [Buffer("a", 2, 1, 3), Buffer("b", 3, 4, 5), Buffer("c", 4, 2, 4)]
    assert arena_of(bufs, place_by_lifetime(bufs, 1), 1) == 9
    plan = plan_memory(bufs, alignment=1)
    assert (plan.strategy, plan.arena_bytes, plan.lower_bound_bytes) == ("greedy_by_size", 7, 7)


def test_plan_keeps_the_by_lifetime_arena_when_it_is_smaller() -> None:
    bufs = [Buffer("a", 2, 0, 1), Buffer("b", 2, 0, 3), Buffer("c", 2, 3, 5), Buffer("d", 3, 4, 6)]
    assert arena_of(bufs, place_greedy_by_size(bufs, 1), 1) == 6
    plan = plan_memory(bufs, alignment=1)
    assert (plan.strategy, plan.arena_bytes, plan.offsets["c"]) == ("by_lifetime", 5, 0)


def test_zero_size_buffers_get_a_valid_offset_and_cost_nothing() -> None:
    bufs = [Buffer("big", 512, 0, 3), Buffer("empty", 0, 1, 2)]
    plan = plan_memory(bufs)
    assert plan.offsets["empty"] == 0 and plan.arena_bytes == 512
    assert plan_memory([Buffer("z", 0, 0, 0)]).arena_bytes == 0


def test_empty_plan() -> None:
    plan = plan_memory([])
    assert plan.offsets == {}
    assert (plan.arena_bytes, plan.lower_bound_bytes, plan.naive_bytes) == (0, 0, 0)


# --- errors ----------------------------------------------------------------------------------


def test_duplicate_names_are_refused() -> None:
    with pytest.raises(MemoryPlanError, match=r"buffer 'h' is defined twice"):
        plan_memory([Buffer("h", 8, 0, 1), Buffer("h", 8, 2, 3)])


@pytest.mark.parametrize("args, message", [
    (("h", 8, 3, 2), r"buffer 'h': first step 3 > last step 2"),
    (("h", -1, 0, 0), r"buffer 'h': size_bytes -1 < 0"),
    (("h", 8.0, 0, 0), r"buffer 'h': size_bytes must be an int"),
    (("", 8, 0, 0), r"non-empty str"),
])
def test_malformed_buffers_are_refused(args, message) -> None:
    with pytest.raises(MemoryPlanError, match=message):
        Buffer(*args)


def test_bad_alignment_is_refused() -> None:
    with pytest.raises(MemoryPlanError, match=r"alignment must be an int >= 1, got 0"):
        plan_memory([Buffer("a", 1, 0, 0)], alignment=0)


def _plan_ab() -> tuple[list[Buffer], Placement]:
    bufs = [Buffer("a", 300, 0, 3), Buffer("b", 200, 2, 5)]
    return bufs, plan_memory(bufs)


def _with(plan: Placement, **changes) -> Placement:
    return Placement.from_dict({**plan.to_dict(), **changes})


def test_check_placement_names_both_overlapping_buffers() -> None:
    bufs, plan = _plan_ab()
    with pytest.raises(MemoryPlanError) as err:
        check_placement(bufs, _with(plan, offsets={"a": 0, "b": 256}))
    assert str(err.value) == ("buffers 'a' (bytes [0, 300), steps 0..3) and 'b' (bytes [256, 456), "
                              "steps 2..5) are both live at step 2 and overlap in the arena")


@pytest.mark.parametrize("offsets, message", [
    ({"a": 0}, r"buffer 'b' has no integer offset \(got None\)"),
    ({"a": 0, "b": 500}, r"buffer 'b': offset 500 is not a non-negative multiple of 256"),
    ({"a": 0, "b": -256}, r"buffer 'b': offset -256"),
    ({"a": 0, "b": 768}, r"buffer 'b': bytes \[768, 968\) run past the arena of 768"),
    ({"a": 0, "b": 512, "ghost": 0}, r"unknown buffers \['ghost'\]"),
])
def test_check_placement_refuses_missing_misaligned_or_stray_offsets(offsets, message) -> None:
    bufs, plan = _plan_ab()
    assert plan.arena_bytes == 768
    with pytest.raises(MemoryPlanError, match=message):
        check_placement(bufs, _with(plan, offsets=offsets))
