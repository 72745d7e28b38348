"""`ChunkOffloadHandler`: the groups of one model chunk and one microbatch.

A handler is created when a chunk's forward for a microbatch begins (an explicit
``begin_chunk`` call, the root-module hook installed by `offload.attach`, or implicitly by
the first group after the previous handler's backward began). It

* numbers the invocations of each name (``core_attn/L0``, ``core_attn/L1``, ...) and links
  each offloaded group to the previous one of the same name, which is the group backward
  needs one layer later;
* holds the newest group of each name (``pending``) until it is known not to be the last of
  its name (Note [7] of `offload.copy_queue`), so the chunk's last group of each name is
  decided only when the engine sees what follows the chunk's forward (the last-layer rule);
* deduplicates saved storages among its live records, with an index by storage address;
* remembers the records left on the GPU because something else held them when their group's
  copies were issued (``held``), for a second look at later group opens, when the model's
  forward returns, when its forward is over and when its backward begins (Note [8] of
  `offload.copy_queue`);
* remembers whether the model said, in this forward, that it synchronized with the host
  (``host_syncs``): from then on its copies are issued after each such sync (Note [9] of
  `offload.copy_queue`);
* gives back what it holds when autograd has freed all its handles (`retire`).

Its phase moves FORWARD -> FORWARD_DONE -> BACKWARD, or FORWARD -> BACKWARD directly when the
chunk's backward immediately follows its forward, which is when the pending groups are kept;
any phase may end in RETIRED. `advance` is the only way to change it, and checks the move.
`offload.backward_order` keeps the handlers sorted by ``sort_key``, the position of their
backward in the rank's schedule.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Any, Callable

import torch

from .group import GroupState, OffloadGroup, TensorRecord
from .group_policy import GroupInfo

if TYPE_CHECKING:
    from .copy_queue import CopyQueue
    from .stats import StatsRecorder


class HandlerPhase(enum.IntEnum):
    FORWARD = 0
    FORWARD_DONE = 1
    BACKWARD = 2
    RETIRED = 3


_NEXT_PHASES = {  # phase -> the phases it may move to
    HandlerPhase.FORWARD: {HandlerPhase.FORWARD_DONE, HandlerPhase.BACKWARD, HandlerPhase.RETIRED},
    HandlerPhase.FORWARD_DONE: {HandlerPhase.BACKWARD, HandlerPhase.RETIRED},
    HandlerPhase.BACKWARD: {HandlerPhase.RETIRED},
}


class ChunkOffloadHandler:
    """The offload groups of one (model chunk, microbatch) forward."""

    def __init__(
        self,
        chunk_id: int,
        microbatch: int,
        iteration: int = 0,
        phase: str = "warmup",
        live: int = 1,
        sort_key: tuple = (),
        capture: Any = None,
        on_idle: Callable[["ChunkOffloadHandler"], None] | None = None,
        stats: "StatsRecorder | None" = None,
        own_backward_next: bool | None = None,
    ) -> None:
        self.chunk_id = chunk_id
        self.microbatch = microbatch
        self.iteration = iteration
        self.schedule_phase = phase
        self.live = live
        self.own_backward_next = own_backward_next  # the schedule's word (`offload.backward_order.ForwardSlot`)
        self.sort_key = sort_key
        self.capture = capture  # the capture session this forward was captured in, if any
        self._on_idle = on_idle  # told when autograd has freed every handle of this handler
        self._stats = stats  # where a held record taken over by a later group is uncounted (`_share`)
        self.phase = HandlerPhase.FORWARD
        self.invocations: dict[str, int] = {}
        self.groups: list[OffloadGroup] = []
        self.last_of_name: dict[str, OffloadGroup] = {}
        self.pending: dict[str, OffloadGroup] = {}
        self.unlinked: list[OffloadGroup] = []  # next invocation of their name declined: the next group reloads them
        self.last_closed: tuple[str, int] | None = None  # (name, layer) of the invocation that closed last here
        self._by_storage: dict[int, list[TensorRecord]] = {}  # storage address -> its records
        self.held: list[TensorRecord] = []  # not copied: held elsewhere then (Note [8] of offload.copy_queue)
        self.host_syncs = False  # the model said it synced with the host in this forward (Note [9] of offload.copy_queue)
        self.alive = 0
        self.graphable = False  # a group ran inside an `offload.graphs.region`: keep nothing

    def __repr__(self) -> str:
        return (
            f"ChunkOffloadHandler(chunk={self.chunk_id}, mb={self.microbatch}, it={self.iteration}, "
            f"phase={self.phase.name}, groups={len(self.groups)}, alive={self.alive})"
        )

    def advance(self, new: HandlerPhase) -> None:
        """Move to phase ``new``; a move not in the docstring's diagram is an engine bug."""
        if new not in _NEXT_PHASES.get(self.phase, ()):
            raise AssertionError(f"offload: {self!r} cannot go from {self.phase.name} to {new.name}")
        self.phase = new

    def group_info(self, name: str, layer: int, plan: Any) -> GroupInfo:
        """What a `GroupPolicy` decides from, for invocation ``layer`` of ``name`` here."""
        return GroupInfo(
            name=name, layer=layer, chunk_id=self.chunk_id, microbatch=self.microbatch,
            phase=self.schedule_phase,  # type: ignore[arg-type]
            live=self.live, max_live=plan.max_live if plan is not None else None, iteration=self.iteration,
        )

    def next_layer(self, name: str) -> int:
        """Count one more invocation of ``name`` in this chunk forward; return its index."""
        layer = self.invocations.get(name, 0)
        self.invocations[name] = layer + 1
        return layer

    def new_group(self, name: str, layer: int, packed_views: bool = False) -> OffloadGroup:
        """Open the offload group of invocation ``layer`` of ``name``, linked to the previous
        offloaded group of that name; ``packed_views`` as in `OffloadGroup`."""
        group = OffloadGroup(name, layer, self, self.last_of_name.get(name), self.capture, packed_views)
        if self.unlinked:
            group.reloads_too, self.unlinked = tuple(self.unlinked), []
        self.groups.append(group)
        self.last_of_name[name] = group
        return group

    def close_group(self, group: OffloadGroup, not_last: bool) -> list[OffloadGroup]:
        """Close ``group``; return the groups now known not to be the last of their name, to be
        offloaded (Note [7] of `offload.copy_queue`): the pending group of its name, which
        ``group`` replaces (deciding it only now, not when ``group`` opened, lets ``group`` take
        over the storages both saved: `_share`), and ``group`` itself when ``not_last`` (the
        chunk's previous forward had a later group of its name); else ``group`` is pending."""
        group.advance(GroupState.PENDING)
        previous = self.pending.pop(group.name, None)
        decided = [] if previous is None else [previous]
        if not_last:
            decided.append(group)
        else:
            self.pending[group.name] = group
        return decided

    def take_pending(self) -> list[OffloadGroup]:
        """The groups still waiting for the last-layer decision, which is now being made."""
        pending = list(self.pending.values())
        self.pending.clear()
        return pending

    def record_for(self, group: OffloadGroup, t: torch.Tensor, ptr: int, start: int, numel: int,
                   itemsize: int) -> TensorRecord:
        """The live record covering this span of this storage, or a new one owned by ``group``."""
        dtype = t.dtype
        version = t._version
        records = self._by_storage.get(ptr)
        if records is None:
            records = self._by_storage[ptr] = []
        stale = False
        for rec in records:
            # Only a storage that provably still exists: the allocator hands a freed address out
            # again (layer after layer), and a record of a storage that is gone can never match
            # again (it is dropped on the next miss, so it does not make every lookup longer).
            if not rec.storage_alive():
                stale = True
            elif rec.dtype is dtype and rec.covers(version, start, numel):
                if rec.group is not group:
                    self._share(rec, group)
                return rec
        if stale:
            records[:] = [rec for rec in records if rec.storage_alive()]
        if records:
            last = records[-1]
            if last.pitch and last.group is group and last.dtype is dtype and last.version == version:
                # A second view of a storage that this group saved as rows: one record of all of it
                # (Note [10] of offload.copy_queue); it covers the new span, as after an extension.
                last.widen(t.untyped_storage().nbytes() // itemsize)
                return last
            if (last.group is group and last.start <= start <= last.start + last.numel
                    and last.dtype is dtype and last.version == version):
                # A span that goes on from the group's last record of this storage: the pieces of
                # one tensor (a grouped GEMM saves its input split per expert), or the whole storage
                # after some of its pieces, become one record, so one copy each way and one buffer
                # instead of one per piece (docs/design.md, Views).
                last.extend_to(start + numel)
                return last
        return self._new_record(records, TensorRecord(group, t, ptr, start, numel, version, itemsize))

    def rows_record_for(self, group: OffloadGroup, t: torch.Tensor, ptr: int, start: int, rows: int,
                        width: int, pitch: int, itemsize: int) -> TensorRecord:
        """`record_for` a view of ``rows`` rows of ``width`` elements, ``pitch`` apart from
        ``start`` on, that leaves at least half of each row out (Note [10] of offload.copy_queue):
        a record that covers its span, the record of the same rows, or a new record of its rows
        alone; where ``group`` saved another view of the storage, one record of the whole storage."""
        records = self._by_storage.get(ptr)
        if records:
            version, dtype, numel = t._version, t.dtype, rows * width
            span = (rows - 1) * pitch + width
            for rec in records:
                if not rec.storage_alive() or rec.dtype is not dtype:
                    continue
                if rec.covers(version, start, span) or (
                        rec.pitch == pitch and rec.width == width and rec.start == start
                        and rec.numel == numel and rec.version == version):
                    if rec.group is not group:
                        self._share(rec, group)
                    return rec
            if any(rec.group is group and rec.storage_alive() for rec in records):
                return self.record_for(group, t, ptr, 0, t.untyped_storage().nbytes() // itemsize, itemsize)
        else:
            records = self._by_storage[ptr] = []
        return self._new_record(records, TensorRecord(group, t, ptr, start, rows * width, t._version, itemsize,
                                                      width, pitch))

    @staticmethod
    def _new_record(records: list[TensorRecord], rec: TensorRecord) -> TensorRecord:
        """``rec``, indexed under its storage (``records``) and owned by its group."""
        records.append(rec)
        rec.group.records.append(rec)
        return rec

    def live_aliases(self, ptr: int) -> int:
        """How many of our records still hold the storage at ``ptr`` (each holds one alias)."""
        count = 0
        for rec in self._by_storage.get(ptr, ()):
            if rec.src is not None:
                count += 1
        return count

    def _share(self, rec: TensorRecord, group: OffloadGroup) -> None:
        """``group`` saves a storage that an earlier group saved too. Backward needs it first
        for ``group``, so ``group`` decides its fate (offloaded with it, or kept with it) unless
        the earlier group's copy of it already started; the other group reloads it as borrowed.
        A record the earlier group left on the GPU because something else held it (``held``)
        is ``group``'s to decide too: that holder was often ``group`` itself, its input."""
        owner = rec.group
        if rec.host is None and (owner.state <= GroupState.PENDING or self._unhold(rec)):
            owner.records.remove(rec)
            owner.borrowed.append(rec)
            if rec in group.borrowed:
                group.borrowed.remove(rec)
            group.records.append(rec)
            rec.group = group
        elif rec not in group.borrowed:
            group.borrowed.append(rec)

    def _unhold(self, rec: TensorRecord) -> bool:
        """Take ``rec`` out of ``held`` (and its bytes out of its name's count); whether it was there."""
        if rec not in self.held:
            return False
        self.held.remove(rec)
        if self._stats is not None:
            self._stats[rec.group.name].bytes_held_elsewhere -= rec.nbytes
        return True

    def handle_died(self) -> None:
        """One of our handles was freed by autograd (called from its ``__del__``: only count)."""
        self.alive -= 1
        if self.alive == 0 and self._on_idle is not None:
            self._on_idle(self)

    def holds_no_device_memory(self) -> bool:
        """Whether retiring would free no GPU memory and wait on no event."""
        return all(
            group.state is not GroupState.OFFLOADING
            and all(rec.src is None and rec.dev is None for rec in group.all_records())
            for group in self.groups
        )

    def retire(self, copies: "CopyQueue") -> None:
        """Give back everything this handler holds: the copies are settled first (with the
        waits that make dropping their memory safe), then the pinned buffers go back to the
        pool. Its saved tensors can no longer be unpacked."""
        for group in self.groups:
            copies.settle(group)
            for rec in group.records:
                rec.dev = None
                rec.src = None
                if rec.host is not None:
                    copies.pool.release(rec.host, rec.last_read)
                    rec.host = None
            group.ready = None
        self.forget()

    def forget(self) -> None:
        """Drop the groups, after the caller gave back what their records held (`retire`, or
        for a captured handler, whose buffers are its graphs',
        `offload.capture.CaptureSessions.release_graphs`). Each group lets go of its records and
        of the group before it, so no reference cycle (group <-> record, handler <-> group) is
        left for Python's cyclic collector: the handler, its groups and their events are freed
        when the last reference goes, also with ``gc.disable()`` (Megatron's ``--manual-gc``)."""
        for group in self.groups:
            group.records.clear()
            group.borrowed.clear()
            group.prev_same = None
            group.reloads_too = ()
        self.groups.clear()
        self.unlinked.clear()
        self.invocations.clear()
        self.last_of_name.clear()
        self.pending.clear()
        self.last_closed = None
        self._by_storage.clear()
        self.held.clear()
        if self.phase is not HandlerPhase.RETIRED:
            self.advance(HandlerPhase.RETIRED)
