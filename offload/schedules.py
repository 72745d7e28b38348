"""The 1F1B pipeline schedule of one pipeline rank, as Megatron-core runs it.

Fine-grained offloading has to know, on each pipeline rank, in which order the forwards and
backwards of its model chunks run: which activations will be needed soon (keep them), and
which wait a long time (offload them). This module rebuilds that order from the schedule's
parameters alone, with the same conventions as megatron-core (checked against megatron-core
0.16.1 in ``tests/test_schedules.py``):

* `schedule_table`: the (microbatch, chunk) pairs in the order the rank runs its forwards;
* `num_warmup_microbatches`: how many forwards run before the first backward;
* `table_to_order` / `schedule_order`: the rank's *order*, a list of signed chunk ids
  (``+c``: forward of local chunk ``c - 1``; ``-c``: its backward), in the format that
  Transformer Engine's ``make_graphed_callables`` and Megatron's CUDA graphs use;
* `schedule_events`, `backward_order`, `kept_last_group`: what an order means;
* `SchedulePlan`: all of that for one order, in the form the engine looks it up at run time
  (``offload.set_schedule(order)``).

Terms: ``pp_size`` pipeline ranks; ``vpp_size`` model chunks per rank (virtual pipeline
size; 1 is the plain, non-interleaved 1F1B schedule); ``num_microbatches`` microbatches per
iteration; ``microbatch_group_size`` the number of consecutive microbatches that one chunk
runs before the next chunk takes over (Megatron's ``microbatch_group_size_per_vp_stage``,
default ``pp_size``).
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral
from typing import Literal, Sequence

from .errors import OffloadTypeError

__all__ = [
    "SchedulePlan",
    "backward_order",
    "check_order",
    "kept_last_group",
    "num_warmup_microbatches",
    "schedule_events",
    "schedule_order",
    "schedule_table",
    "table_to_order",
]

Event = tuple[Literal["F", "B"], int, int]


def _at_least_one(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def schedule_table(
    num_microbatches: int, num_model_chunks: int, microbatch_group_size: int
) -> list[tuple[int, int]]:
    """The (microbatch_id, model_chunk_id) pairs in the order a rank runs its forwards.

    Microbatches are taken in consecutive groups of ``microbatch_group_size`` (the last group
    may be shorter); within a group every chunk in turn runs all of the group's microbatches.
    For 5 microbatches, 2 chunks and groups of 3::

        microbatch | 0 1 2 0 1 2 3 4 3 4
        chunk      | 0 0 0 1 1 1 0 0 1 1

    Each chunk thus sees the microbatches in increasing order.
    """
    _at_least_one(num_microbatches=num_microbatches, num_model_chunks=num_model_chunks,
                  microbatch_group_size=microbatch_group_size)
    table = []
    for first in range(0, num_microbatches, microbatch_group_size):
        group = range(first, min(first + microbatch_group_size, num_microbatches))
        table.extend((mb, chunk) for chunk in range(num_model_chunks) for mb in group)
    return table


def table_to_order(
    table: list[tuple[int, int]], num_model_chunks: int, num_warmup: int
) -> list[int]:
    """Turn a forward table into a signed order: warm-up, steady 1F1B, cool-down.

    The first ``num_warmup`` forwards run alone; then each further forward is followed by
    one backward; the backwards left over end the order. The k-th backward mirrors the
    k-th table entry: entry ``(mb, c)`` gives the backward of chunk
    ``num_model_chunks - 1 - c``, because gradients flow through the chunks in reverse.
    Same result as Megatron's ``convert_schedule_table_to_order``.
    """
    if not 0 <= num_warmup <= len(table):
        raise ValueError(f"num_warmup must lie in [0, {len(table)}], got {num_warmup}")
    forwards = [chunk + 1 for _, chunk in table]
    backwards = [-(num_model_chunks - chunk) for _, chunk in table]
    num_steady = len(table) - num_warmup
    order = forwards[:num_warmup]
    for k in range(num_steady):
        order += [forwards[num_warmup + k], backwards[k]]
    return order + backwards[num_steady:]


def num_warmup_microbatches(
    pp_size: int,
    vpp_size: int,
    num_microbatches: int,
    rank: int,
    microbatch_group_size: int | None = None,
) -> int:
    """How many forwards ``rank`` runs before its first backward (Megatron's count).

    Without pipelining (``pp_size == 1``) every forward is directly followed by its backward:
    0. Plain 1F1B: ``pp_size - rank - 1``, one per later stage still to be filled.
    Interleaved: ``2 * (pp_size - rank - 1) + (vpp_size - 1) * microbatch_group_size``, since
    every chunk but the last must first run a whole group. Capped at the number of forwards.
    """
    group = _check(pp_size, vpp_size, num_microbatches, rank, microbatch_group_size)
    return _warmup(pp_size, vpp_size, num_microbatches, rank, group)


def schedule_order(
    pp_size: int,
    vpp_size: int,
    num_microbatches: int,
    rank: int,
    microbatch_group_size: int | None = None,
) -> list[int]:
    """The signed order of forwards (``+c``) and backwards (``-c``) that ``rank`` runs.

    ``c`` is 1-based: ``+c`` is a forward of local chunk ``c - 1``. This is the order that
    Megatron-core derives with ``get_schedule_table``, ``get_pp_rank_microbatches`` and
    ``convert_schedule_table_to_order``. For example pp=2, vpp=1, 4 microbatches, rank 0:
    ``[1, 1, -1, 1, -1, 1, -1, -1]``. ``microbatch_group_size`` only matters when
    ``vpp_size > 1``: with one chunk the table is the microbatches in order.
    """
    group = _check(pp_size, vpp_size, num_microbatches, rank, microbatch_group_size)
    warmup = _warmup(pp_size, vpp_size, num_microbatches, rank, group)
    return table_to_order(schedule_table(num_microbatches, vpp_size, group), vpp_size, warmup)


def check_order(order: object) -> list[int]:
    """``order`` (a sequence of integers) as a list of ints, else `OffloadTypeError` saying
    what an order is."""
    if isinstance(order, Sequence) and not isinstance(order, (str, bytes)):
        if all(isinstance(c, Integral) and not isinstance(c, bool) for c in order):
            return [int(c) for c in order]
    raise OffloadTypeError(
        f"offload: a schedule is Megatron's signed order, a list of ints (+c: a forward of chunk c-1, -c: its "
        f"backward; offload.schedules.schedule_order makes it), or None; got {order!r}"[:400]
    )


def schedule_events(order: list[int]) -> list[Event]:
    """Expand an order into ``("F" | "B", chunk_id, microbatch_id)`` events, chunk 0-based.

    Each chunk runs its forwards on microbatches 0, 1, 2, ... and its backwards in that
    same order, so the k-th ``+c`` (and the k-th ``-c``) is microbatch k of chunk ``c - 1``.
    Raises ValueError for a 0 entry or a backward whose forward has not run yet.
    """
    forwards: dict[int, int] = {}
    backwards: dict[int, int] = {}
    events: list[Event] = []
    for pos, entry in enumerate(order):
        if entry == 0:
            raise ValueError(f"order[{pos}] is 0; entries are +c or -c with c >= 1")
        chunk = abs(entry) - 1
        if entry > 0:
            mb = forwards.get(chunk, 0)
            forwards[chunk] = mb + 1
            events.append(("F", chunk, mb))
        else:
            mb = backwards.get(chunk, 0)
            if mb >= forwards.get(chunk, 0):
                raise ValueError(
                    f"order[{pos}] is the backward of chunk {chunk}, microbatch {mb} "
                    "before its forward"
                )
            backwards[chunk] = mb + 1
            events.append(("B", chunk, mb))
    return events


def backward_order(order: list[int]) -> list[tuple[int, int]]:
    """The (chunk_id, microbatch_id) pairs in the order their backwards run."""
    return [(chunk, mb) for kind, chunk, mb in schedule_events(order) if kind == "B"]


def kept_last_group(order: list[int]) -> list[bool]:
    """For each position of ``order``: is it a forward directly followed by its own backward?

    This is the last-layer rule of fine-grained offloading. When the very next step after a
    chunk's forward on a microbatch is the backward of that same chunk and microbatch, the
    activations of the chunk's last layer are needed again at once: offloading them would
    only copy them out and straight back, so they stay on the GPU. True only at such
    forward positions; False at every other forward and at every backward.
    """
    events = schedule_events(order)
    return [
        kind == "F" and pos + 1 < len(events) and events[pos + 1] == ("B", chunk, mb)
        for pos, (kind, chunk, mb) in enumerate(events)
    ]


@dataclass(frozen=True)
class ForwardStep:
    """What the schedule says about one chunk forward of a rank's order."""

    chunk_id: int
    microbatch: int
    phase: Literal["warmup", "steady"]
    """``warmup`` before the rank's first backward of the iteration, ``steady`` after it."""
    live: int
    """Chunk forwards whose backward has not run yet, this one included."""
    keeps_last_group: bool
    """The chunk's own backward comes next (the last-layer rule keeps its last groups)."""


class SchedulePlan:
    """A rank's order, digested for the engine: each forward's position and phase, and the
    backward order of the (chunk, microbatch) pairs with each one's successor.

    The engine checks the forwards it sees against `forwards`, and after a chunk's backward
    prefetches the first groups of `successor` (the chunk whose backward runs next).
    """

    def __init__(self, order: Sequence[int]) -> None:
        order = [int(c) for c in order]
        events = schedule_events(order)
        forwards = {(c, m) for kind, c, m in events if kind == "F"}
        backwards = {(c, m) for kind, c, m in events if kind == "B"}
        if forwards != backwards:
            missing = sorted(forwards - backwards)
            raise ValueError(
                f"order runs forwards without their backwards (chunk, microbatch): {missing[:4]}"
            )
        kept = kept_last_group(order)
        self.order = order
        self.forwards: list[ForwardStep] = []
        self.backwards: list[tuple[int, int]] = []
        live = 0
        for (kind, chunk, mb), keep in zip(events, kept):
            if kind == "F":
                live += 1
                phase: Literal["warmup", "steady"] = "steady" if self.backwards else "warmup"
                self.forwards.append(ForwardStep(chunk, mb, phase, live, keep))
            else:
                live -= 1
                self.backwards.append((chunk, mb))
        self.max_live = max((f.live for f in self.forwards), default=0)
        self.backward_index = {key: i for i, key in enumerate(self.backwards)}
        self.num_chunks = 1 + max((abs(c) - 1 for c in order), default=0)

    def successor(self, chunk_id: int, microbatch: int) -> tuple[int, int] | None:
        """The (chunk, microbatch) whose backward runs right after this one's, if any."""
        i = self.backward_index.get((chunk_id, microbatch))
        if i is None or i + 1 >= len(self.backwards):
            return None
        return self.backwards[i + 1]

    def __len__(self) -> int:
        return len(self.forwards)

    def __repr__(self) -> str:
        return f"SchedulePlan(forwards={len(self.forwards)}, chunks={self.num_chunks}, max_live={self.max_live})"


def _warmup(pp_size: int, vpp_size: int, num_microbatches: int, rank: int, group: int) -> int:
    """`num_warmup_microbatches` for parameters already checked."""
    if pp_size == 1:
        warmup = 0
    elif vpp_size == 1:
        warmup = pp_size - rank - 1
    else:
        warmup = 2 * (pp_size - rank - 1) + (vpp_size - 1) * group
    return min(warmup, num_microbatches * vpp_size)


def _check(
    pp_size: int,
    vpp_size: int,
    num_microbatches: int,
    rank: int,
    microbatch_group_size: int | None,
) -> int:
    """Validate schedule parameters as Megatron-core does; return the group size to use.

    Megatron runs ``pp_size == 1`` without pipelining, which supports one chunk only. Its
    interleaved schedule (``vpp_size > 1``) needs ``pp_size <= group <= num_microbatches``
    and a last group that is full or holds at least ``pp_size`` microbatches; with the
    default group (``pp_size``) this means ``num_microbatches`` is a multiple of ``pp_size``.
    """
    _at_least_one(pp_size=pp_size, vpp_size=vpp_size, num_microbatches=num_microbatches)
    if not 0 <= rank < pp_size:
        raise ValueError(f"rank must lie in [0, {pp_size - 1}] for pp_size={pp_size}, got {rank}")
    group = pp_size if microbatch_group_size is None else microbatch_group_size
    if group < 1:
        raise ValueError(f"microbatch_group_size must be >= 1, got {group}")
    if vpp_size > 1:
        if pp_size == 1:
            raise ValueError(
                f"vpp_size={vpp_size} needs pipelining: without it (pp_size=1) Megatron runs "
                "one model chunk only"
            )
        if not pp_size <= group <= num_microbatches:
            raise ValueError(
                f"microbatch_group_size must lie in [pp_size={pp_size}, "
                f"num_microbatches={num_microbatches}] for an interleaved schedule, got {group}"
            )
        last = num_microbatches % group
        if 0 < last < pp_size:
            raise ValueError(
                f"num_microbatches={num_microbatches} leaves a last group of {last} < "
                f"pp_size={pp_size} microbatches (groups of {group}); this adds pipeline "
                "bubbles, so Megatron refuses it: use a multiple of the group size or a "
                "remainder >= pp_size"
            )
    return group
