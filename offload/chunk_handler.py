"""`ChunkOffloadHandler`: the groups of one model chunk and one microbatch.

A handler is created when a chunk's forward for a microbatch begins (an explicit
``begin_chunk`` call, the root-module hook installed by `offload.attach`, or implicitly by
the first group after the previous handler's backward began). It

* numbers the invocations of each name (``core_attn/L0``, ``core_attn/L1``, ...) and links
  each offloaded group to the previous one of the same name, which is the group backward
  needs one layer later;
* defers the offload of the newest group of each name until the next group of that name
  closes, so the chunk's last group of each name is decided only when the engine sees what
  follows the chunk's forward (the last-layer rule);
* deduplicates saved storages among its live records.

Its phase moves FORWARD -> FORWARD_DONE -> BACKWARD, or FORWARD -> BACKWARD directly when the
chunk's backward immediately follows its forward, which is when the pending groups are kept.
The manager keeps its handlers sorted by ``sort_key``, the position of their backward in the
rank's schedule (see `PipelineOffloadManager`), so its deque lists them in backward order.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch

from .group import GroupState, OffloadGroup, TensorRecord

if TYPE_CHECKING:
    from .manager import PipelineOffloadManager


class HandlerPhase(enum.IntEnum):
    FORWARD = 0
    FORWARD_DONE = 1
    BACKWARD = 2
    RETIRED = 3


class ChunkOffloadHandler:
    """The offload groups of one (model chunk, microbatch) forward."""

    def __init__(
        self,
        manager: "PipelineOffloadManager",
        chunk_id: int,
        microbatch: int,
        iteration: int = 0,
        phase: str = "warmup",
        live: int = 1,
        sort_key: tuple = (),
    ) -> None:
        self.manager = manager
        self.chunk_id = chunk_id
        self.microbatch = microbatch
        self.iteration = iteration
        self.schedule_phase = phase
        self.live = live
        self.sort_key = sort_key
        self.phase = HandlerPhase.FORWARD
        self.invocations: dict[str, int] = {}
        self.groups: list[OffloadGroup] = []
        self.last_of_name: dict[str, OffloadGroup] = {}
        self.pending: dict[str, OffloadGroup] = {}
        self._records: dict[tuple[int, torch.dtype], list[TensorRecord]] = {}
        self.alive = 0
        self.capture = None  # the capture session this forward was captured in, if any
        self.graphable = False  # a group ran inside an `offload.graphs.region`: keep nothing

    def __repr__(self) -> str:
        return (
            f"ChunkOffloadHandler(chunk={self.chunk_id}, mb={self.microbatch}, it={self.iteration}, "
            f"phase={self.phase.name}, groups={len(self.groups)}, alive={self.alive})"
        )

    def next_layer(self, name: str) -> int:
        """Count one more invocation of ``name`` in this chunk forward; return its index."""
        layer = self.invocations.get(name, 0)
        self.invocations[name] = layer + 1
        return layer

    def new_group(self, name: str, layer: int) -> OffloadGroup:
        """Open the offload group of invocation ``layer`` of ``name``, linked to the previous
        offloaded group of that name."""
        prev = self.last_of_name.get(name)
        group = OffloadGroup(name, layer, self, prev)
        self.groups.append(group)
        self.last_of_name[name] = group
        return group

    def close_group(self, group: OffloadGroup) -> OffloadGroup | None:
        """Make ``group`` the pending group of its name; return the one it replaces, which is
        not the last of its name and can be offloaded now. Launching it only now (not when
        ``group`` opened) lets ``group`` take over the storages both saved (see `_share`)."""
        previous = self.pending.pop(group.name, None)
        group.state = GroupState.PENDING
        self.pending[group.name] = group
        return previous

    def find_or_add_record(self, group: OffloadGroup, t: torch.Tensor, ptr: int, start: int, numel: int) -> TensorRecord:
        """The live record covering this span of this storage, or a new one owned by ``group``."""
        key = (ptr, t.dtype)
        version = t._version
        records = self._records.get(key)
        if records is not None:
            for rec in records:
                if rec.covers(version, start, numel):
                    if rec.group is not group:
                        self._share(rec, group)
                    return rec
        else:
            records = self._records[key] = []
        rec = TensorRecord(group, t, ptr, start, numel, version)
        records.append(rec)
        group.records.append(rec)
        return rec

    def live_aliases(self, ptr: int) -> int:
        """How many of our records still hold the storage at ``ptr`` (each holds one alias)."""
        return sum(
            1 for (p, _), records in self._records.items() if p == ptr for rec in records if rec.src is not None
        )

    @staticmethod
    def _share(rec: TensorRecord, group: OffloadGroup) -> None:
        """``group`` saves a storage that an earlier group saved too. Backward needs it first
        for ``group``, so ``group`` decides its fate (offloaded with it, or kept with it) unless
        the earlier group's copy already started; the other group reloads it as borrowed."""
        owner = rec.group
        if rec.host is None and owner.state <= GroupState.PENDING:
            owner.records.remove(rec)
            owner.borrowed.append(rec)
            if rec in group.borrowed:
                group.borrowed.remove(rec)
            group.records.append(rec)
            rec.group = group
        elif rec not in group.borrowed:
            group.borrowed.append(rec)

    def on_handle_dead(self) -> None:
        self.alive -= 1
        if self.alive == 0:
            self.manager._retire_candidates.append(self)

    def clear(self) -> None:
        self.groups.clear()
        self.invocations.clear()
        self.last_of_name.clear()
        self.pending.clear()
        self._records.clear()
        self.phase = HandlerPhase.RETIRED
