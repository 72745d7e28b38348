"""One offload group: the tensors autograd saved during one named module invocation.

A group moves through an explicit state machine (the model is Transformer Engine's
per-layer state machine); `OffloadGroup.advance` is the only way to change its state, and
it checks the state being left:

    OPEN ──close──▶ PENDING ──launch──▶ OFFLOADING ──release──▶ OFFLOADED
                       │                      ▲                        │
                       │                      └──────second look───────┘
                       └──keep──▶ KEPT        (the chunk's backward came next)

* OPEN: the module's forward runs; the pack hook adds tensors.
* PENDING: forward done, offload not started. A group waits here until the next group of
  the same name closes (then it is not the chunk's last and is offloaded), or until the
  engine learns what follows the chunk's forward: its own backward (KEPT) or anything else
  (offloaded). This is how the last-layer rule is decided from what actually runs.
* OFFLOADING: device-to-host copies are queued on the D2H stream; the GPU tensors are still
  referenced, because their memory may be reused only after the copy read it.
* OFFLOADED: the copies are done (an event query, or a GPU-side wait of the compute stream)
  and the GPU references are dropped: the memory is free. Records that something else held
  when the copies were issued are still on the GPU; if the holder let go by a later group
  open or by the time the chunk's forward is over, they are copied then, and the group is
  OFFLOADING again, or still (Note [8] of `offload.copy_queue`).

The copies themselves, and the events that order them, are `offload.copy_queue`'s.
Reloads are tracked per record (`TensorRecord.dev`): the same host copy can be reloaded
again for a second backward (``retain_graph=True``).

Storage and views: a `TensorRecord` is one contiguous span of one storage, or the rows of a
view with gaps (Note [10] of `offload.copy_queue`), which are packed on the host only. Several saved
tensors that are views of the same storage share a record when its span covers them; a
view covering at least half of its storage is recorded as the whole storage; a span that goes
on from the group's last record of its storage extends that record. A record saved
by two groups (a module's output that the next module saves as its input) belongs to the
latest of them, whose backward needs it first; the other group holds it as borrowed. Each saved
tensor gets a `SavedHandle` with its own size, stride and offset, and is rebuilt with
``as_strided`` on the reloaded span, so aliasing between saved views survives the trip.
"""

from __future__ import annotations

import enum
import weakref
from typing import TYPE_CHECKING, Any, Iterator

import torch

from .errors import SavedTensorModifiedError
from .streams import Rows

if TYPE_CHECKING:
    from .chunk_handler import ChunkOffloadHandler
    from .pinned_pool import HostBuffer


class GroupState(enum.IntEnum):
    OPEN = 0
    PENDING = 1
    KEPT = 2
    OFFLOADING = 3
    OFFLOADED = 4


_use_count = torch._C._storage_Use_Count
_NO_WAITS: frozenset[int] = frozenset()

_NEXT_STATES = {  # state -> the states it may move to (the diagram above)
    GroupState.OPEN: {GroupState.PENDING},
    GroupState.PENDING: {GroupState.KEPT, GroupState.OFFLOADING},
    GroupState.OFFLOADING: {GroupState.OFFLOADED},
    GroupState.OFFLOADED: {GroupState.OFFLOADING},  # the second look (Note [8] of offload.copy_queue)
}


class TensorRecord:
    """One span of one storage saved in a group, and where its bytes are now.

    ``src`` is the GPU tensor (held until the D2H copy finished), ``host`` the pinned copy,
    ``dev`` the reloaded span (held only until every handle has been unpacked once; a record of
    rows is reloaded packed and spread over its span at its first unpack, Note [10] of
    offload.copy_queue).
    """

    __slots__ = (
        "group", "ptr", "src", "src_ref", "start", "numel", "dtype", "itemsize", "version",
        "host", "dev", "reload_group", "last_read", "handles", "alive", "unpacked",
        "modified", "width", "pitch",
    )

    def __init__(self, group: "OffloadGroup", src: torch.Tensor, ptr: int, start: int, numel: int,
                 version: int, itemsize: int, width: int = 0, pitch: int = 0) -> None:
        self.group = group
        self.ptr = ptr
        # A detached alias: same storage and version counter, but no grad_fn. Holding the saved
        # tensor itself would hold its grad_fn, whose graph holds our handle: a cycle through
        # C++ that keeps a dropped graph (a forward without backward) alive forever.
        self.src: torch.Tensor | None = src.detach()
        self.src_ref = weakref.ref(src)
        self.start = start
        self.numel = numel
        self.dtype = src.dtype
        self.itemsize = itemsize
        self.version = version
        self.host: HostBuffer | None = None
        self.dev: torch.Tensor | None = None
        self.reload_group: OffloadGroup | None = None
        self.last_read: Any = None
        self.handles = 0
        self.alive = 0
        self.unpacked = 0
        self.modified = False
        # Rows: ``numel`` elements in rows of ``width``, ``pitch`` apart from ``start`` on (a
        # view with gaps, Note [10] of offload.copy_queue), packed on the host; ``pitch`` 0: one
        # run of ``numel`` elements from ``start`` on.
        self.width = width
        self.pitch = pitch

    @property
    def end(self) -> int:
        """The storage element after the last one this record reads."""
        if self.pitch:
            return self.start + (self.numel // self.width - 1) * self.pitch + self.width
        return self.start + self.numel

    def rows(self) -> Rows | None:
        """What the copy of this record to the host moves (`offload.streams.CopyJob`): its rows,
        spaced on the device and packed on the host, or None for one run of elements. The copy
        back is always one run: rows come back packed (Note [10] of offload.copy_queue)."""
        if not self.pitch:
            return None
        return Rows(self.numel // self.width, self.width, self.pitch)

    @property
    def reloaded_packed(self) -> bool:
        """Whether ``dev`` holds this record's rows packed, not yet spread over its span."""
        return bool(self.pitch) and self.dev is not None and self.dev.numel() == self.numel

    def extend_to(self, end: int) -> None:
        """Make this span reach element ``end`` of its storage (only while its group is open,
        before anything was copied: the start, which saved handles' offsets count from, stays)."""
        self.numel = end - self.start

    def widen(self, storage_numel: int) -> None:
        """Make a record of rows one run over its whole storage (only while its group is open:
        another view of the storage was saved in the group, Note [10] of offload.copy_queue)."""
        self.start, self.numel, self.width, self.pitch = 0, storage_numel, 0, 0

    @property
    def nbytes(self) -> int:
        """The bytes of the span (what its copy moves and its host buffer holds)."""
        return self.numel * self.itemsize

    @property
    def needs_reload(self) -> bool:
        """Off the GPU, on the host, and still wanted by a live handle."""
        return self.src is None and self.dev is None and self.host is not None and self.alive > 0

    def host_view(self) -> torch.Tensor:
        return self.host.view(self.dtype, self.numel)

    def copy_frees_memory(self, our_aliases: int) -> bool:
        """Whether copying the storage out would free it: nothing besides our ``our_aliases``
        aliases holds it (not a module that saved it without offloading, nor a user reference),
        and it was not shrunk after it was saved (a recompute mechanism, megatron's
        ``CheckpointWithoutOutput``, freed it and refills it before backward needs it)."""
        storage = self.src.untyped_storage()
        return (_use_count(storage._cdata) - 1 <= our_aliases
                and storage.nbytes() >= self.end * self.itemsize)

    def storage_alive(self) -> bool:
        """Whether the saved storage provably still exists at this address (we hold it, or a
        weak reference to the saved tensor is alive and its storage did not move or shrink)."""
        t = self.src if self.src is not None else self.src_ref()
        return t is not None and t.untyped_storage().data_ptr() == self.ptr

    def covers(self, version: int, start: int, numel: int) -> bool:
        """Whether a tensor of ``version`` spanning [start, start+numel) of this record's storage
        can reuse this record. Ask only while `storage_alive`: an address reused after a free, or
        after the storage was shrunk (``resize_(0)`` by a recompute mechanism), is another tensor."""
        return (version == self.version and not self.pitch and self.start <= start
                and start + numel <= self.start + self.numel)

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


def gapped_rows(size: torch.Size, stride: tuple[int, ...]) -> tuple[int, int, int] | None:
    """``(rows, width, pitch)`` where a view of ``size`` and ``stride`` is rows of ``width``
    adjacent elements whose starts are ``pitch`` apart, and at least half of each row's pitch is
    a gap (a column block, one half of a GLU's input: Note [10] of offload.copy_queue); else None."""
    dims = [(n, s) for n, s in zip(size, stride) if n != 1]
    width, i = 1, len(dims)
    while i and dims[i - 1][1] == width:  # the contiguous inner block
        width *= dims[i - 1][0]
        i -= 1
    if not i or width == 1:
        return None  # contiguous, or no two elements adjacent
    pitch = dims[i - 1][1]
    rows = 1
    while i and dims[i - 1][1] == pitch * rows:  # the rows, evenly spaced
        rows *= dims[i - 1][0]
        i -= 1
    if i or 2 * width > pitch:
        return None
    return rows, width, pitch


class KeptTensor:
    """A saved tensor that stays where it is (not eligible), with its version for the check."""

    __slots__ = ("tensor", "version", "label")

    def __init__(self, tensor: torch.Tensor, label: str) -> None:
        # Without its grad_fn (see TensorRecord.__init__); a tensor that has none (a weight, an
        # input) is held as it is, which saves a detach per weight on the hook's path.
        self.tensor = tensor if tensor.grad_fn is None else tensor.detach()
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

    def __init__(self, record: TensorRecord, group: "OffloadGroup", size: torch.Size, stride: tuple[int, ...],
                 offset: int) -> None:
        self.record = record
        self.group = group  # the group that saved it (the record may belong to a later one)
        self.size = size
        self.stride = stride
        self.offset = offset

    def __del__(self) -> None:
        try:
            rec = self.record
            rec.alive -= 1
            if rec.alive == 0:
                if rec.src is not None and (rec.host is None or rec.group.state <= GroupState.KEPT):
                    rec.src = None  # no copy is reading it: free now, exactly as autograd would
                if rec.dev is not None and rec.group.capture is not None:
                    # Captured: the graph joined this reload before it ended, and a captured
                    # handler is never retired, so nothing else would let go of this memory.
                    rec.dev = None
            self.group.handler.handle_died()
        except Exception:  # interpreter shutdown: nothing left to account for
            pass


class OffloadGroup:
    """The records of one named module invocation and the events that order their copies
    (which `offload.copy_queue.CopyQueue` records and waits on)."""

    __slots__ = (
        "name", "layer", "label", "handler", "prev_same", "reloads_too", "records", "borrowed", "state",
        "stream", "ready", "d2h_done", "h2d_done", "alloc_stream", "waited", "capture", "packed_views",
        "__weakref__",
    )

    def __init__(self, name: str, layer: int, handler: "ChunkOffloadHandler", prev_same: "OffloadGroup | None",
                 capture: Any, packed_views: bool = False) -> None:
        self.name = name
        self.layer = layer
        self.handler = handler
        chunk = f"/c{handler.chunk_id}" if handler.chunk_id else ""
        self.label = f"{name}/L{layer}{chunk}/mb{handler.microbatch}"
        self.prev_same = prev_same
        # Groups whose next invocation of their name the policy declined: their reload is this
        # group's backward's to issue, with ``prev_same``'s (Note [11] of offload.copy_queue).
        self.reloads_too: tuple[OffloadGroup, ...] = ()
        self.records: list[TensorRecord] = []
        self.borrowed: list[TensorRecord] = []
        self.state = GroupState.OPEN
        self.stream: Any = None  # the compute stream the group's forward ran on
        self.ready: Any = None  # recorded on ``stream`` when the group closed (rule 1)
        self.d2h_done: Any = None  # recorded after the group's D2H copies
        self.h2d_done: Any = None  # recorded after the group's latest reload copies
        self.alloc_stream: Any = None  # the stream that allocated the reload buffers
        # The streams that waited on ``h2d_done`` (rule 4); a reload gives the group its own set.
        self.waited: set[int] | frozenset[int] = _NO_WAITS
        self.capture = capture  # the capture session this group's forward was captured in
        self.packed_views = packed_views  # its views with gaps come back packed (Note [10] of offload.copy_queue)

    def __repr__(self) -> str:
        return f"OffloadGroup({self.label}, {self.state.name}, records={len(self.records)})"

    def advance(self, new: GroupState) -> None:
        """Move to ``new``; anything but a move of the diagram above is an engine bug."""
        if new not in _NEXT_STATES.get(self.state, ()):
            raise AssertionError(f"offload: group {self.label} cannot go from {self.state.name} to {new.name}")
        self.state = new

    def all_records(self) -> Iterator[TensorRecord]:
        """Its own records, then those it borrowed from an earlier group."""
        yield from self.records
        yield from self.borrowed

    def to_reload(self) -> list[TensorRecord]:
        """The records (own and borrowed) that this group's backward needs back."""
        return [rec for rec in self.all_records() if rec.needs_reload]

    def release(self) -> None:
        """OFFLOADING -> OFFLOADED: drop the GPU references of records whose D2H copy is done
        (the caller made sure: an event query, or the compute stream waits on ``d2h_done``)."""
        for rec in self.records:
            if rec.src is not None and rec.host is not None:
                rec.note_version()
                rec.src = None
        self.advance(GroupState.OFFLOADED)
