"""In which order the chunk backwards of an iteration will run: pure Python, no tensors.

Each (chunk, microbatch) forward gets a handler; `BackwardOrder` numbers the forwards,
checks them against the schedule when the framework handed one over (`set_schedule`), and
keeps the handlers in the order their backwards will run, so that after one chunk's backward
the engine can prefetch the last groups of the chunk whose backward runs next.

Without a schedule, the order is Megatron's rule for interleaved 1F1B: *reverse virtual stage,
forward microbatch* within each group of microbatches, where the group size is learned from
the forwards (how many microbatches chunk 0 runs before chunk 1 starts). With one chunk that
is simply the forward order.

What it stores of a handler: ``chunk_id``, ``microbatch``, ``iteration`` and the
``sort_key`` it gave it (`ForwardSlot`); anything with those attributes can be ordered, which
is how `tests/test_backward_order.py` tests it without an engine.
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .errors import OffloadError, OffloadValueError
from .schedules import SchedulePlan, check_order


@dataclass(frozen=True)
class ForwardSlot:
    """Where one chunk forward sits: its microbatch, the key that sorts its handler into
    backward order, the schedule phase it runs in, how many chunk forwards are live, and
    whether its own backward comes next (``None``: no schedule says)."""

    microbatch: int
    sort_key: tuple
    phase: str
    live: int
    own_backward_next: bool | None = None


class BackwardOrder:
    """The iteration's chunk forwards, and their handlers in backward order."""

    def __init__(self) -> None:
        self.plan: SchedulePlan | None = None
        self.iteration = 0
        self.handlers: deque[Any] = deque()  # sorted by ``sort_key``
        self._num_chunks = 0
        self._new_iteration()

    def _new_iteration(self) -> None:
        self._microbatches: dict[int, int] = defaultdict(int)
        self._by_key: dict[tuple[int, int], Any] = {}
        self.forwards = 0  # chunk forwards run in this iteration
        self._group_size: int | None = None
        self._max_table_key: tuple[int, int, int] | None = None
        self._live = 0
        self._backward_started = False

    def set_schedule(self, order: Sequence[int] | None) -> None:
        """Megatron's signed ``order`` for this and later iterations, or ``None`` to infer."""
        if self.forwards:
            raise OffloadError(
                f"offload: set_schedule() called after {self.forwards} chunk forward(s) of "
                "this iteration; call it before the iteration's first forward"
            )
        try:
            self.plan = None if order is None else SchedulePlan(check_order(order))
        except ValueError as exc:
            raise OffloadValueError(
                f"offload: set_schedule() got an order that is not a schedule: {exc}; make it with "
                "offload.schedules.schedule_order(pp, vpp, microbatches, rank)"
            ) from exc

    def next_forward(self, chunk_id: int, microbatch: int | None) -> ForwardSlot:
        """Number the chunk forward that begins, checking it against the schedule."""
        plan = self.plan
        step = None
        if plan is not None:
            i = self.forwards
            if i >= len(plan):
                raise OffloadError(
                    f"offload: chunk forward {i + 1} of this iteration began, but the schedule given "
                    f"to set_schedule() has {len(plan)}; pass this iteration's order (or None)"
                )
            step = plan.forwards[i]
            if chunk_id != step.chunk_id or microbatch not in (None, step.microbatch):
                got = f"chunk {chunk_id}" + ("" if microbatch is None else f", microbatch {microbatch}")
                raise OffloadError(
                    f"offload: forward {i} of the schedule is chunk {step.chunk_id}, microbatch "
                    f"{step.microbatch}, but {got} began: the order given to set_schedule() is "
                    "not what runs"
                )
            microbatch = step.microbatch
        if microbatch is None:
            microbatch = self._microbatches[chunk_id]
        self._microbatches[chunk_id] = microbatch + 1
        self.forwards += 1
        if chunk_id > 0 and self._group_size is None and self._microbatches.get(0):
            self._group_size = self._microbatches[0]
        self._num_chunks = max(self._num_chunks, chunk_id + 1)
        table_key = self._table_key(chunk_id, microbatch)
        if self._max_table_key is None or table_key > self._max_table_key:
            self._max_table_key = table_key
        self._live += 1
        if step is not None:
            return ForwardSlot(microbatch, (self.iteration, plan.backward_index[(chunk_id, microbatch)]),
                               step.phase, step.live, step.keeps_last_group)
        group = 0 if self._group_size is None else microbatch // self._group_size
        return ForwardSlot(microbatch, (self.iteration, group, -chunk_id, microbatch),
                           "steady" if self._backward_started else "warmup", self._live)

    def add(self, handler: Any) -> None:
        """Queue ``handler`` (made for the slot `next_forward` returned) in backward order."""
        bisect.insort(self.handlers, handler, key=_sort_key)
        self._by_key[(handler.chunk_id, handler.microbatch)] = handler

    def add_unordered(self, handler: Any) -> None:
        """Queue a handler that belongs to no iteration's order (a captured forward)."""
        self.handlers.append(handler)

    def remove(self, handler: Any) -> None:
        try:
            self.handlers.remove(handler)
        except ValueError:
            pass
        key = (handler.chunk_id, handler.microbatch)
        if self._by_key.get(key) is handler:
            del self._by_key[key]

    def take(self, which: Callable[[Any], bool]) -> list[Any]:
        """Remove and return the queued handlers for which ``which`` is true."""
        taken = [h for h in self.handlers if which(h)]
        for handler in taken:
            self.remove(handler)
        return taken

    def backward_began(self, handler: Any) -> None:
        """The first backward activity of ``handler``: one chunk forward fewer is live."""
        if handler.iteration == self.iteration:
            self._live -= 1
            self._backward_started = True

    def end_iteration(self) -> None:
        """Start the next iteration; raise if the schedule given did not match what ran."""
        ran, plan = self.forwards, self.plan
        self.iteration += 1
        self._new_iteration()
        if plan is not None and ran not in (0, len(plan)):
            raise OffloadError(
                f"offload: the iteration ran {ran} chunk forwards, but the schedule given to "
                f"set_schedule() has {len(plan)}; pass each iteration's order (or None)"
            )

    def reset(self) -> None:
        """Forget the handlers and this iteration's forwards (the schedule stays)."""
        self.handlers.clear()
        self._new_iteration()

    def _table_key(self, chunk_id: int, microbatch: int) -> tuple[int, int, int]:
        """Where a forward sits in the schedule table: groups of microbatches, chunk by chunk."""
        group = 0 if self._group_size is None else microbatch // self._group_size
        return (group, chunk_id, microbatch)

    def successor(self, handler: Any) -> Any | None:
        """The handler whose backward runs right after ``handler``'s, if it is known and exists.

        With a schedule this is a lookup. Without one, step through the backward order of
        the interleaved schedule (this group's chunks from the last to the first, each over
        the group's microbatches in order; then the next group) and take the first handler
        that exists; a candidate that does not exist is skipped only when a forward later in
        the schedule table already ran (so it never will), else the answer is unknown.
        """
        if handler.iteration != self.iteration:
            return None
        if self.plan is not None:
            key = self.plan.successor(handler.chunk_id, handler.microbatch)
            return self._by_key.get(key) if key is not None else None
        size, chunks = self._group_size, self._num_chunks
        chunk, mb = handler.chunk_id, handler.microbatch
        while True:
            if size is None:
                mb += 1
            else:
                first = mb // size * size
                if mb + 1 < first + size:
                    mb += 1
                elif chunk > 0:
                    chunk, mb = chunk - 1, first
                else:
                    chunk, mb = chunks - 1, first + size
            found = self._by_key.get((chunk, mb))
            if found is not None:
                return found
            if self._max_table_key is None or self._table_key(chunk, mb) >= self._max_table_key:
                return None


def _sort_key(handler: Any) -> tuple:
    return handler.sort_key
