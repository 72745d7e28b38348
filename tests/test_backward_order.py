"""`offload.backward_order` on its own: no engine, no tensors, handlers as plain records."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from offload.backward_order import BackwardOrder
from offload.errors import OffloadError
from offload.schedules import backward_order, schedule_order


def _run_forwards(order: BackwardOrder, chunks: list[int]) -> list[SimpleNamespace]:
    """Number the chunk forwards ``chunks`` (in this order) and queue a handler for each."""
    handlers = []
    for chunk in chunks:
        slot = order.next_forward(chunk, None)
        h = SimpleNamespace(chunk_id=chunk, microbatch=slot.microbatch, iteration=order.iteration,
                            sort_key=slot.sort_key, phase=slot.phase, live=slot.live)
        order.add(h)
        handlers.append(h)
    return handlers


def _keys(handlers) -> list[tuple[int, int]]:
    return [(h.chunk_id, h.microbatch) for h in handlers]


@pytest.mark.parametrize("pp, vpp, m, rank", [(1, 1, 4, 0), (2, 1, 4, 0), (2, 2, 4, 0), (4, 2, 8, 1), (4, 2, 8, 3)])
def test_inferred_order_is_megatrons_backward_order(pp, vpp, m, rank):
    """Without a schedule, the handlers are queued in the order Megatron runs their backwards,
    and each one's successor is the next in that order."""
    order_list = schedule_order(pp, vpp, m, rank)
    order = BackwardOrder()
    _run_forwards(order, [c - 1 for c in order_list if c > 0])
    expected = backward_order(order_list)
    assert _keys(order.handlers) == expected
    queued = list(order.handlers)
    for h, nxt in zip(queued, queued[1:]):
        assert order.successor(h) is nxt
    assert order.successor(queued[-1]) is None


def test_schedule_checks_every_forward_and_the_count():
    order = BackwardOrder()
    order.set_schedule(schedule_order(2, 2, 4, 0))
    first = order.next_forward(0, None)
    assert first.microbatch == 0 and first.phase == "warmup"
    with pytest.raises(OffloadError, match="is chunk 0, microbatch 1, but chunk 1 began"):
        order.next_forward(1, None)
    with pytest.raises(OffloadError, match="set_schedule\\(\\) called after 1 chunk forward"):
        order.set_schedule(None)
    with pytest.raises(OffloadError, match="ran 1 chunk forwards, but the schedule"):
        order.end_iteration()
    assert order.forwards == 0 and order.iteration == 1  # the next iteration starts clean


def test_live_count_and_phase_follow_the_backwards():
    order = BackwardOrder()
    a, b = _run_forwards(order, [0, 0])
    assert (a.live, b.live) == (1, 2) and (a.phase, b.phase) == ("warmup", "warmup")
    order.backward_began(a)
    (c,) = _run_forwards(order, [0])
    assert c.live == 2 and c.phase == "steady"


def test_removed_and_taken_handlers_leave_the_order():
    order = BackwardOrder()
    a, b, c = _run_forwards(order, [0, 0, 0])
    order.remove(b)
    assert _keys(order.handlers) == [(0, 0), (0, 2)] and order.successor(a) is c
    captured = SimpleNamespace(chunk_id=0, microbatch=0, iteration=0, sort_key=(0, -1), capture=object())
    order.add_unordered(captured)
    assert order.take(lambda h: getattr(h, "capture", None) is not None) == [captured]
    assert captured not in order.handlers
    order.end_iteration()
    assert order.successor(a) is None  # a handler of an earlier iteration has no successor
