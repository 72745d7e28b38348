"""The 1F1B / interleaved pipeline schedule of one rank (offload.schedules).

Hand-checked small cases, invariants over a grid of schedules, the last-layer rule against
a counting definition, and, where megatron-core is importable, equality with Megatron's own
``get_schedule_table`` / ``get_pp_rank_microbatches`` / ``convert_schedule_table_to_order``.
"""

from __future__ import annotations

import random
from collections import Counter
from types import SimpleNamespace

import pytest

from offload.schedules import (
    backward_order,
    kept_last_group,
    num_warmup_microbatches,
    schedule_events,
    schedule_order,
    schedule_table,
    table_to_order,
)


def _valid_groups(pp: int, vpp: int, m: int) -> list[int]:
    """Every microbatch group size Megatron accepts for these parameters."""
    if vpp == 1:
        return [pp]
    return [g for g in range(pp, m + 1) if not 0 < m % g < pp]


# (pp, vpp, M, rank, group) over PP {1,2,4,8} x VPP {1,2,4} x M {PP,2PP,4PP} x every rank,
# default group; pp=1 only with one chunk (Megatron runs no chunks without pipelining).
GRID = [
    (pp, vpp, m, rank, pp)
    for pp in (1, 2, 4, 8)
    for vpp in (1, 2, 4)
    if pp > 1 or vpp == 1
    for m in (pp, 2 * pp, 4 * pp)
    for rank in range(pp)
]
# Plus every non-default group size Megatron accepts, and a few microbatch counts that are
# not multiples of pp (allowed without interleaving, or with a suitable group size).
EXTRA = [
    (pp, vpp, m, rank, g)
    for pp, vpp, m in [(2, 2, 5), (2, 2, 7), (2, 4, 8), (4, 2, 8), (4, 2, 11), (4, 4, 16)]
    + [(3, 2, 7)]
    for g in _valid_groups(pp, vpp, m)
    if g != pp or m % pp
    for rank in range(pp)
] + [(pp, 1, m, rank, pp) for pp, m in [(2, 1), (4, 3), (8, 5), (3, 7)] for rank in range(pp)]
ALL = GRID + EXTRA


def _ids(case: tuple[int, ...]) -> str:
    return "pp{}-vpp{}-m{}-r{}-g{}".format(*case)


def _order(case: tuple[int, int, int, int, int]) -> list[int]:
    pp, vpp, m, rank, group = case
    return schedule_order(pp, vpp, m, rank, group)


def _kept_by_counting(order: list[int]) -> list[bool]:
    """Direct definition: position i is a forward of chunk c, position i+1 a backward of c,
    and that backward is for the same microbatch, i.e. as many forwards of c came before
    i as backwards of c came before i + 1 (each chunk runs microbatches in order)."""
    kept = []
    for i, entry in enumerate(order):
        follows = i + 1 < len(order) and entry > 0 and order[i + 1] == -entry
        kept.append(follows and order[:i].count(entry) == order[: i + 1].count(-entry))
    return kept


def _events_from_table(case: tuple[int, int, int, int, int]) -> list[tuple[str, int, int]]:
    """What each entry of the order means, read off Megatron's table: the k-th forward is
    table entry k; the k-th backward is entry k's microbatch on the mirrored chunk."""
    pp, vpp, m, rank, group = case
    table = schedule_table(m, vpp, group)
    order = _order(case)
    nf = nb = 0
    events = []
    for entry in order:
        if entry > 0:
            mb, chunk = table[nf]
            nf += 1
            assert entry == chunk + 1
            events.append(("F", chunk, mb))
        else:
            mb, chunk = table[nb]
            nb += 1
            assert entry == -(vpp - chunk)
            events.append(("B", vpp - 1 - chunk, mb))
    return events


# ---------------------------------------------------------------- hand-checked cases
def test_no_pipelining_alternates_forward_and_backward():
    order = schedule_order(1, 1, 4, 0)
    assert order == [1, -1, 1, -1, 1, -1, 1, -1]
    assert schedule_events(order) == [
        ("F", 0, 0), ("B", 0, 0), ("F", 0, 1), ("B", 0, 1),
        ("F", 0, 2), ("B", 0, 2), ("F", 0, 3), ("B", 0, 3),
    ]  # fmt: skip
    assert kept_last_group(order) == [True, False] * 4


def test_pp2_plain_1f1b():
    order = schedule_order(2, 1, 4, 0)
    assert num_warmup_microbatches(2, 1, 4, 0) == 1
    assert order == [1, 1, -1, 1, -1, 1, -1, -1]
    assert schedule_events(order) == [
        ("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2),
        ("B", 0, 1), ("F", 0, 3), ("B", 0, 2), ("B", 0, 3),
    ]  # fmt: skip
    assert kept_last_group(order) == [False] * 8
    # The last stage has no warm-up: each forward is directly followed by its backward.
    assert schedule_order(2, 1, 4, 1) == [1, -1] * 4
    assert kept_last_group(schedule_order(2, 1, 4, 1)) == [True, False] * 4


def test_pp2_vpp2_interleaved_by_hand():
    # Groups of pp=2 microbatches: chunk 0 runs mb 0,1, chunk 1 runs mb 0,1, then mb 2,3.
    assert schedule_table(4, 2, 2) == [
        (0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)
    ]  # fmt: skip
    # Rank 0: warm-up 2*(2-0-1) + (2-1)*2 = 4 forwards, then 4 (F, B) pairs, then 4 B's;
    # the k-th backward is table entry k on the mirrored chunk (chunk 0 -> 1, 1 -> 0).
    assert num_warmup_microbatches(2, 2, 4, 0) == 4
    order = schedule_order(2, 2, 4, 0)
    assert order == [1, 1, 2, 2, 1, -2, 1, -2, 2, -1, 2, -1, -2, -2, -1, -1]
    assert schedule_events(order) == [
        ("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1),
        ("F", 0, 2), ("B", 1, 0), ("F", 0, 3), ("B", 1, 1),
        ("F", 1, 2), ("B", 0, 0), ("F", 1, 3), ("B", 0, 1),
        ("B", 1, 2), ("B", 1, 3), ("B", 0, 2), ("B", 0, 3),
    ]  # fmt: skip
    assert backward_order(order) == [(1, 0), (1, 1), (0, 0), (0, 1), (1, 2), (1, 3), (0, 2), (0, 3)]
    assert kept_last_group(order) == [False] * 16
    # Rank 1: warm-up 0 + 2 = 2 forwards.
    order = schedule_order(2, 2, 4, 1)
    assert order == [1, 1, 2, -2, 2, -2, 1, -1, 1, -1, 2, -2, 2, -2, -1, -1]
    kept = [i for i, k in enumerate(kept_last_group(order)) if k]
    assert kept == [2, 4, 10, 12]  # F(1,0) B(1,0), F(1,1) B(1,1), F(1,2) B(1,2), F(1,3) B(1,3)


def test_megatron_docstring_examples():
    # PP2, 5 microbatches, VP2, groups of 3 (Megatron's schedule-table docstring).
    table = schedule_table(5, 2, 3)
    assert [mb for mb, _ in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for _, c in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert table_to_order(table, 2, 5) == [
        1, 1, 1, 2, 2, 2, -2, 1, -2, 1, -2, 2, -1, 2, -1, -1, -2, -2, -1, -1
    ]  # fmt: skip


def test_all_warmup_when_capped():
    # pp=4, vpp=2, M=4, rank 0: 2*3 + 1*4 = 10 > 8 forwards, so all forwards come first.
    assert num_warmup_microbatches(4, 2, 4, 0) == 8
    order = schedule_order(4, 2, 4, 0)
    assert order == [1] * 4 + [2] * 4 + [-2] * 4 + [-1] * 4
    # The last forward (chunk 1, mb 3) is followed by a backward of chunk 1, but of mb 0.
    assert order[7:9] == [2, -2] and not any(kept_last_group(order))


def test_single_microbatch_forward_then_backward():
    order = schedule_order(2, 1, 1, 0)  # warm-up capped at 1: F then B of the same mb
    assert order == [1, -1] and kept_last_group(order) == [True, False]


# ---------------------------------------------------------------- invariants
def _assert_valid_order(case: tuple[int, int, int, int, int], order: list[int]) -> None:
    """``order`` is a valid schedule for ``case``: every (chunk, microbatch) runs one forward
    and, later, one backward; warm-up forwards, strict F/B alternation, then only backwards;
    each entry means what Megatron's table says."""
    pp, vpp, m, rank, group = case
    events = schedule_events(order)
    assert len(order) == len(events) == 2 * m * vpp
    counts = Counter(events)
    every = {(c, mb) for c in range(vpp) for mb in range(m)}
    assert {(c, mb) for kind, c, mb in counts if kind == "F"} == every
    assert {(c, mb) for kind, c, mb in counts if kind == "B"} == every
    assert set(counts.values()) == {1}
    where = {e: i for i, e in enumerate(events)}
    assert all(where[("F", c, mb)] < where[("B", c, mb)] for c, mb in every)
    # Warm-up forwards, then strict F/B alternation, then only backwards.
    warmup = num_warmup_microbatches(pp, vpp, m, rank, group)
    steady = m * vpp - warmup
    assert all(e > 0 for e in order[:warmup])
    assert all(order[warmup + 2 * k] > 0 > order[warmup + 2 * k + 1] for k in range(steady))
    assert all(e < 0 for e in order[warmup + 2 * steady :])
    # The order means what Megatron's table says it means.
    assert events == _events_from_table(case)
    assert backward_order(order) == [(c, mb) for kind, c, mb in events if kind == "B"]


@pytest.mark.parametrize("case", ALL, ids=_ids)
def test_invariants(case):
    _assert_valid_order(case, _order(case))


@pytest.mark.parametrize("case", ALL, ids=_ids)
def test_warmup_formula(case):
    pp, vpp, m, rank, group = case
    if pp == 1:
        expected = 0
    elif vpp == 1:
        expected = pp - rank - 1
    else:
        expected = (pp - rank - 1) * 2 + (vpp - 1) * group
    assert num_warmup_microbatches(pp, vpp, m, rank, group) == min(expected, m * vpp)


def test_last_stage_keeps_its_first_steady_forward():
    # On the last rank the first steady forward is chunk vpp-1 on mb 0, and the first
    # backward is the same chunk and microbatch: the last-layer rule applies.
    for pp, vpp, m in [(2, 2, 4), (4, 4, 8), (8, 2, 16)]:
        order = schedule_order(pp, vpp, m, pp - 1)
        warmup = num_warmup_microbatches(pp, vpp, m, pp - 1)
        assert kept_last_group(order)[warmup]
        assert schedule_events(order)[warmup] == ("F", vpp - 1, 0)


# ---------------------------------------------------------------- the last-layer rule
def _random_order(rng: random.Random, chunks: int, m: int) -> list[int]:
    """A random valid order: each chunk's forwards and backwards, any interleaving in which
    no backward runs before its forward."""
    done = {c: [0, 0] for c in range(chunks)}  # forwards, backwards so far
    order = []
    while len(order) < 2 * chunks * m:
        c = rng.randrange(chunks)
        f, b = done[c]
        if f < m and (b == f or rng.random() < 0.5):
            done[c][0] += 1
            order.append(c + 1)
        elif b < f:
            done[c][1] += 1
            order.append(-(c + 1))
    return order


def test_kept_last_group_matches_definition_on_schedules():
    for case in ALL:
        order = _order(case)
        assert kept_last_group(order) == _kept_by_counting(order), case


def test_kept_last_group_matches_definition_on_random_orders():
    rng = random.Random(0)
    for _ in range(300):
        order = _random_order(rng, rng.randint(1, 4), rng.randint(1, 6))
        kept = kept_last_group(order)
        assert kept == _kept_by_counting(order), order
        assert not any(k for k, e in zip(kept, order) if e < 0)


# ---------------------------------------------------------------- argument checks
@pytest.mark.parametrize(
    "args, match",
    [
        ((0, 1, 4, 0), "pp_size"),
        ((2, 0, 4, 0), "vpp_size"),
        ((2, 1, 0, 0), "num_microbatches"),
        ((2, 1, 4, 2), "rank"),
        ((2, 1, 4, -1), "rank"),
        ((1, 2, 4, 0), "pipelining"),
        ((4, 2, 2, 0), "microbatch_group_size"),  # default group 4 > M = 2
        ((4, 2, 6, 0), "last group"),  # 6 % 4 = 2 < pp
        ((4, 2, 8, 0, 3), "microbatch_group_size"),  # group < pp
        ((4, 2, 8, 0, 9), "microbatch_group_size"),  # group > M
        ((2, 1, 4, 0, 0), "microbatch_group_size"),
    ],
)
def test_bad_arguments(args, match):
    with pytest.raises(ValueError, match=match):
        schedule_order(*args)
    with pytest.raises(ValueError, match=match):
        num_warmup_microbatches(*args)


def test_interleaved_accepts_what_megatron_accepts():
    """Group sizes and microbatch counts that the default (groups of pp) would refuse, but
    Megatron accepts, give valid orders of the right shape."""
    one_group = schedule_order(4, 2, 6, 0, 6)  # one group of 6
    _assert_valid_order((4, 2, 6, 0, 6), one_group)
    # warm-up 2 * 3 + 6 = 12 = every forward: chunk 0 on mb 0-5, chunk 1 on mb 0-5, then the
    # backwards, chunk 1 first
    assert one_group == [1] * 6 + [2] * 6 + [-2] * 6 + [-1] * 6
    last_group_of_pp = schedule_order(4, 2, 9, 0, 5)  # groups of 5, the last one of 4 = pp
    _assert_valid_order((4, 2, 9, 0, 5), last_group_of_pp)
    # forwards chunk 0 mb 0-4, chunk 1 mb 0-4, chunk 0 mb 5-8, chunk 1 mb 5-8; warm-up 6 + 5
    assert last_group_of_pp == [1] * 5 + [2] * 5 + [1] + [1, -2] * 3 + [2, -2] * 2 + [2, -1] * 2 \
        + [-1] * 3 + [-2] * 4 + [-1] * 4
    no_interleaving = schedule_order(4, 1, 6, 0)  # no interleaving: any M
    _assert_valid_order((4, 1, 6, 0, 4), no_interleaving)
    assert no_interleaving == [1] * 3 + [1, -1] * 3 + [-1] * 3  # warm-up pp - rank - 1 = 3


def test_bad_tables_and_orders():
    with pytest.raises(ValueError, match="num_warmup"):
        table_to_order(schedule_table(2, 1, 1), 1, 3)
    with pytest.raises(ValueError, match="num_model_chunks"):
        schedule_table(2, 0, 1)
    with pytest.raises(ValueError, match="before its forward"):
        schedule_events([1, -2])
    with pytest.raises(ValueError, match="is 0"):
        kept_last_group([1, 0])


# ---------------------------------------------------------------- megatron-core itself
def _megatron():
    """megatron-core's table, warm-up count and order converter (skip when absent)."""
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")
    convert = getattr(schedules, "convert_schedule_table_to_order", None)
    if convert is None:  # megatron-core >= 0.14 keeps it with the CUDA-graph code
        convert = pytest.importorskip("megatron.core.transformer.cuda_graphs")
        convert = convert.convert_schedule_table_to_order
    return schedules.get_schedule_table, schedules.get_pp_rank_microbatches, convert


def test_matches_megatron_core():
    get_table, rank_microbatches, convert = _megatron()
    for case in ALL:
        pp, vpp, m, rank, group = case
        # Megatron reads the pipeline layout from a communicator; vpp None = not interleaved.
        comm = SimpleNamespace(
            pp_group=SimpleNamespace(size=lambda pp=pp: pp, rank=lambda rank=rank: rank),
            virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        )
        _, _, warmup, _ = rank_microbatches(m, vpp, group, p2p_communicator=comm)
        table = get_table(m, vpp, group)
        assert schedule_table(m, vpp, group) == table, case
        assert num_warmup_microbatches(pp, vpp, m, rank, group) == warmup, case
        assert _order(case) == convert(warmup, vpp, table), case
    # The converter alone, for every warm-up length.
    for m, vpp, group in [(4, 2, 2), (5, 2, 3), (8, 4, 4), (6, 1, 2)]:
        table = get_table(m, vpp, group)
        for warmup in range(len(table) + 1):
            assert table_to_order(table, vpp, warmup) == convert(warmup, vpp, table)
