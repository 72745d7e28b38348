"""One offload group: the tensors autograd saved during one named module invocation.

A group moves through an explicit state machine (the model is Transformer Engine's
per-layer state machine):

    OPEN ──close──▶ PENDING ──launch──▶ OFFLOADING ──release──▶ OFFLOADED
                       │
                       └──keep──▶ KEPT        (the chunk's backward came next)

* OPEN: the module's forward runs; the pack hook adds tensors.
* PENDING: forward done, offload not started. A group waits here until the next group of
  the same name closes (then it is not the chunk's last and is offloaded), or until the
  engine learns what follows the chunk's forward: its own backward (KEPT) or anything else
  (offloaded). This is how the last-layer rule is decided from what actually runs.
* OFFLOADING: device-to-host copies are queued on the D2H stream; the GPU tensors are still
  referenced, because their memory may be reused only after the copy read it.
* OFFLOADED: the copies are done (an event query, or a GPU-side wait of the compute stream)
  and the GPU references are dropped: the memory is free.

Reloads are tracked per record (`TensorRecord.dev`): the same host copy can be reloaded
again for a second backward (``retain_graph=True``).

Storage and views: a `TensorRecord` is one contiguous span of one storage. Several saved
tensors that are views of the same storage share a record when its span covers them; a
view covering at least half of its storage is recorded as the whole storage. A record saved
by two groups (a module's output that the next module saves as its input) belongs to the
latest of them, whose backward needs it first; the other group holds it as borrowed. Each saved
tensor gets a `SavedHandle` with its own size, stride and offset, and is rebuilt with
``as_strided`` on the reloaded span, so aliasing between saved views survives the trip.
"""

from __future__ import annotations

import enum
import weakref
from typing import TYPE_CHECKING, Any

import torch

from .errors import SavedTensorModifiedError

if TYPE_CHECKING:
    from .chunk_handler import ChunkOffloadHandler
    from .pinned_pool import HostBuffer


class GroupState(enum.IntEnum):
    OPEN = 0
    PENDING = 1
    KEPT = 2
    OFFLOADING = 3
    OFFLOADED = 4


class TensorRecord:
    """One span of one storage saved in a group, and where its bytes are now.

    ``src`` is the GPU tensor (held until the D2H copy finished), ``host`` the pinned copy,
    ``dev`` the reloaded span (held only until every handle has been unpacked once).
    """

    __slots__ = (
        "group", "ptr", "src", "src_ref", "start", "numel", "dtype", "version", "nbytes",
        "host", "dev", "reload_group", "last_read", "handles", "alive", "unpacked", "modified",
    )

    def __init__(self, group: "OffloadGroup", src: torch.Tensor, ptr: int, start: int, numel: int, version: int) -> None:
        self.group = group
        self.ptr = ptr
        # A detached alias: same storage and version counter, but no grad_fn. Holding the saved
        # tensor itself would hold its grad_fn, whose graph holds our handle: a cycle through
        # C++ that keeps a dropped graph (a forward without backward) alive forever.
        self.src = src.detach()
        self.src_ref = weakref.ref(src)
        self.start = start
        self.numel = numel
        self.dtype = src.dtype
        self.version = version
        self.nbytes = numel * src.element_size()
        self.host: HostBuffer | None = None
        self.dev: torch.Tensor | None = None
        self.reload_group: OffloadGroup | None = None
        self.last_read = None
        self.handles = 0
        self.alive = 0
        self.unpacked = 0
        self.modified = False

    def held_elsewhere(self, our_aliases: int) -> bool:
        """Whether anything besides our ``our_aliases`` aliases holds the storage (a module
        that saved it without offloading, a user reference): copying it would free nothing."""
        storage = self.src.untyped_storage()
        return torch._C._storage_Use_Count(storage._cdata) - 1 > our_aliases

    def discarded(self) -> bool:
        """Whether the storage was shrunk after it was saved: a recompute mechanism (megatron's
        ``CheckpointWithoutOutput``) freed it and refills it before backward needs it."""
        return self.src.untyped_storage().nbytes() < (self.start + self.numel) * self.src.element_size()

    def source_span(self) -> torch.Tensor:
        return self.src.as_strided((self.numel,), (1,), self.start)

    def covers(self, version: int, start: int, numel: int) -> bool:
        """Whether a tensor of ``version`` spanning [start, start+numel) can reuse this record.

        Only while the storage is provably alive (we hold it, or a weak reference to the saved
        tensor is alive) and still at this address: an address reused after a free, or after
        the storage was shrunk (``resize_(0)`` by a recompute mechanism), is another tensor.
        """
        if version != self.version or start < self.start or start + numel > self.start + self.numel:
            return False
        t = self.src if self.src is not None else self.src_ref()
        return t is not None and t.untyped_storage().data_ptr() == self.ptr

    def check_version(self, label: str) -> None:
        """Raise if the saved tensor was changed in place since it was saved."""
        if self.modified:
            self._raise(label, None)
        t = self.src if self.src is not None else self.src_ref()
        if t is not None and t._version != self.version:
            self._raise(label, t._version)

    def note_version(self) -> None:
        """Remember a change made before our copy read the tensor (checked again at unpack)."""
        if self.src is not None and self.src._version != self.version:
            self.modified = True

    def _raise(self, label: str, now: int | None) -> None:
        where = f"is at version {now}; expected version {self.version} instead" if now is not None else (
            f"was modified after version {self.version}, before or while it was copied to the host"
        )
        raise SavedTensorModifiedError(
            f"offload: one of the variables needed for gradient computation has been modified by an "
            f"inplace operation: a {self.dtype} tensor of {self.nbytes} bytes saved in group "
            f"{label!r} {where}. Autograd forbids this; without offloading it raises the same error."
        )


class KeptTensor:
    """A saved tensor that stays where it is (not eligible), with its version for the check."""

    __slots__ = ("tensor", "version", "label")

    def __init__(self, tensor: torch.Tensor, label: str) -> None:
        self.tensor = tensor.detach()  # no grad_fn: see TensorRecord.__init__
        self.version = tensor._version
        self.label = label

    def unpack(self) -> torch.Tensor:
        t = self.tensor
        if t._version != self.version:
            raise SavedTensorModifiedError(
                f"offload: one of the variables needed for gradient computation has been modified by an "
                f"inplace operation: a {t.dtype} tensor of shape {list(t.shape)} saved in group "
                f"{self.label!r} is at version {t._version}; expected version {self.version} instead."
            )
        return t


class SavedHandle:
    """What autograd holds in place of an offloaded tensor: its record and its geometry.

    When autograd frees it (after backward, or when the graph is dropped) the record and the
    handler learn it, so memory follows autograd's own lifetimes (``retain_graph`` included).
    """

    __slots__ = ("record", "group", "size", "stride", "offset")

    def __init__(self, record: TensorRecord, group: "OffloadGroup", t: torch.Tensor) -> None:
        self.record = record
        self.group = group
        self.size = t.size()
        self.stride = t.stride()
        self.offset = t.storage_offset()

    def __del__(self) -> None:
        try:
            rec = self.record
            rec.alive -= 1
            if rec.alive == 0 and rec.src is not None and (rec.host is None or rec.group.state <= GroupState.KEPT):
                rec.src = None  # no copy is reading it: free now, exactly as autograd would
            if rec.alive == 0 and rec.dev is not None and rec.group.capture is not None:
                # Captured: the graph joined this reload before it ended, and a captured
                # handler is never retired, so nothing else would let go of this memory.
                rec.dev = None
            self.group.handler.on_handle_dead()
        except Exception:  # interpreter shutdown: nothing left to account for
            pass


def copy_in_pieces(dst: torch.Tensor, src: torch.Tensor, chunk_bytes: int) -> None:
    """``dst.copy_(src)`` for flat tensors, issued as copies of at most ``chunk_bytes`` each
    (all of it at once when ``chunk_bytes`` is 0 or larger than the tensor)."""
    step = chunk_bytes // dst.element_size() if chunk_bytes else 0
    n = dst.numel()
    if step <= 0 or n <= step:
        dst.copy_(src, non_blocking=True)
        return
    for start in range(0, n, step):
        dst[start:start + step].copy_(src[start:start + step], non_blocking=True)


class OffloadGroup:
    """The records of one named module invocation and the events that order their copies."""

    __slots__ = (
        "name", "layer", "label", "handler", "prev_same", "records", "borrowed", "state",
        "stream", "ready", "d2h_done", "d2h_timing", "h2d_done", "h2d_timing", "alloc_stream",
        "waited", "alive", "capture", "__weakref__",
    )

    def __init__(self, name: str, layer: int, handler: "ChunkOffloadHandler", prev_same: "OffloadGroup | None") -> None:
        self.name = name
        self.layer = layer
        self.handler = handler
        chunk = f"/c{handler.chunk_id}" if handler.chunk_id else ""
        self.label = f"{name}/L{layer}{chunk}/mb{handler.microbatch}"
        self.prev_same = prev_same
        self.records: list[TensorRecord] = []
        self.borrowed: list[TensorRecord] = []
        self.state = GroupState.OPEN
        self.stream: Any = None
        self.ready: Any = None
        self.d2h_done: Any = None
        self.d2h_timing: Any = None
        self.h2d_done: Any = None
        self.h2d_timing: Any = None
        self.alloc_stream: Any = None
        self.waited: set[int] = set()
        self.capture: Any = None  # the capture session this group's forward was captured in

    # -- forward ---------------------------------------------------------------------------
    def launch_offload(self, streams: Any, pool: Any, timing: bool, chunk_bytes: int = 0) -> tuple[int, int]:
        """Queue the D2H copies of this group's live records that copying would free.

        Returns (bytes queued, bytes left on the GPU because something else holds them).
        Rule 1: the D2H stream waits on ``ready``, recorded on the compute stream when the
        module's forward finished. A reused pinned buffer is written only after the last
        H2D copy that read it (its ``last_read`` event).
        """
        todo = []
        shared = 0
        for rec in self.records:
            rec.note_version()
            if rec.src is None or rec.alive == 0:
                continue
            if rec.discarded() or rec.held_elsewhere(self.handler.live_aliases(rec.ptr)):
                shared += rec.nbytes
                continue
            rec.host = pool.acquire(rec.nbytes, self.capture is not None)
            if rec.host is not None:
                todo.append(rec)
        self.state = GroupState.OFFLOADING
        if not todo:
            return 0, shared
        d2h = streams.d2h
        self.d2h_done = streams.event(timing)
        d2h.wait_event(self.ready)
        seen = set()
        for rec in todo:
            ev = rec.host.last_read
            # A buffer taken by a capture was last read eagerly (buffers a graph owns never
            # return to the pool), before the capture began: waiting on that event would
            # invalidate the capture, and the synchronize that precedes a capture orders it.
            if ev is not None and id(ev) not in seen and self.capture is None:
                seen.add(id(ev))
                d2h.wait_event(ev)
        with streams.use(d2h):
            if timing:
                self.d2h_timing = streams.event(timing=True)
                self.d2h_timing.record(d2h)
            for rec in todo:
                copy_in_pieces(rec.host.view(rec.dtype, rec.numel), rec.source_span(), chunk_bytes)
            self.d2h_done.record(d2h)
        return sum(rec.nbytes for rec in todo), shared

    def release(self) -> None:
        """Drop the GPU references of records whose D2H copy is done (the caller made sure:
        an event query, or the compute stream waits on ``d2h_done``)."""
        for rec in self.records:
            if rec.host is not None and rec.src is not None:
                rec.note_version()
                rec.src = None
        self.state = GroupState.OFFLOADED

    # -- backward --------------------------------------------------------------------------
    def needs_reload(self) -> bool:
        for rec in self.records:
            if rec.src is None and rec.dev is None and rec.host is not None and rec.alive > 0:
                return True
        for rec in self.borrowed:
            if rec.src is None and rec.dev is None and rec.host is not None and rec.alive > 0:
                return True
        return False

    def launch_reload(self, streams: Any, timing: bool, chunk_bytes: int = 0, capture: Any = None) -> int:
        """Queue H2D copies of every record this group needs back. Returns the bytes queued.

        The device buffers are allocated on the current (compute) stream, so the caching
        allocator reuses them only in that stream's order. Rule 2: the H2D stream waits on the
        compute stream (the module whose backward just ran has freed its memory). Rule 3: it
        waits on the D2H event of every record's offload. Rule 4 is in `wait_reloaded`.
        """
        todo = [
            rec for rec in (*self.records, *self.borrowed)
            if rec.src is None and rec.dev is None and rec.host is not None and rec.alive > 0
        ]
        if not todo:
            return 0
        cur = streams.current()
        h2d = streams.h2d
        device = streams.device
        for rec in todo:
            rec.dev = torch.empty(rec.numel, dtype=rec.dtype, device=device)
        h2d.wait_stream(cur)
        owners = {id(rec.group): rec.group for rec in todo}
        for owner in owners.values():
            # An offload captured in another graph (a forward graph, when this is its backward
            # graph) was joined into that graph's stream before it ended; the replay order of
            # the graphs orders it, and its event cannot be waited on here.
            if owner.capture is None or owner.capture is capture:
                h2d.wait_event(owner.d2h_done)
        done = streams.event(timing)
        with streams.use(h2d):
            if timing:
                self.h2d_timing = streams.event(timing=True)
                self.h2d_timing.record(h2d)
            for rec in todo:
                copy_in_pieces(rec.dev, rec.host.view(rec.dtype, rec.numel), chunk_bytes)
                rec.reload_group = self
                rec.last_read = done
                rec.unpacked = 0
            done.record(h2d)
        self.h2d_done = done
        self.alloc_stream = cur
        self.waited = set()
        return sum(rec.nbytes for rec in todo)
