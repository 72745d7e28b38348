"""`CaptureSessions`: what the engine does while a CUDA graph is being captured.

A CUDA graph replays the kernels, copies and event edges recorded during its capture and runs
no Python, so the engine does its work during the capture and the graph repeats it (see
`offload.graphs` for the user side). This module owns the state that needs:

* **Sessions.** A session is one captured body: it starts at the first engine call seen while
  the stream captures (or at a region's start under capture) and ends at a region's end, at
  `join`, at the end of a region's backward (`join_backward`), or at the first call seen
  outside a capture. Groups, handlers and events made in a session are tagged with it; an
  event recorded in one session is never waited on in another (Note [3] of
  `offload.copy_queue`): graphs that share a pool replay in capture order, which orders them.
* **Regions and plans.** A graphable region (`offload.graphs.region`) records, when it runs
  eagerly, the groups it offloads and their sizes (its plan); under capture the same groups
  must come, else `OffloadError`.
* **Copies carried to the next graph** (Note [C1] below), **issued after the replay of the
  graph that saved them** where the engine sees that replay (Note [C3]), and **reloads issued
  at the start of a region's backward graph** (Note [C2]).
* **Graph-owned handlers.** A captured handler leaves the engine's queue when its session
  ends: its pinned buffers belong to its graphs (every replay writes them) until
  `release_graphs`.

Note [C1] Copies carried across a graph's edge. A capture must join every stream it forked
    before it ends, so a copy issued inside graph k makes graph k last until the copy is done.
    With one layer per graph the layer's last groups would copy after its compute instead of
    under the next layer's. So a region's capture joins only the copies it issued, and hands
    the groups it has not copied yet (those decided by Note [7] of `offload.copy_queue`, and
    the last of each name so far) to the next session, which decides them as the last-layer
    rule does eagerly: a forward region issues their copies at its start, so they run under
    its whole compute, and its end joins them and frees their memory inside the pool, for the
    captures after it to reuse (outside the in-flight bound: waiting for them at the graph's
    start would stall every replay); a backward (or eager code) keeps them on the GPU, in the pool.
    Their ``ready`` event is recorded again in the new session: the tensor was written by an
    earlier graph, which replays first.

Note [C2] Reloads at the start of a region's backward graph. A reload issued in graph k must
    be joined before graph k ends, so a reload for layer k-1 issued by layer k's backward graph
    would run after layer k's compute, not under it. So, under capture, a group reloads the
    previous group of its name only when both were captured in the same session; the first
    groups a region's backward needs (the last of each name) are reloaded when that backward
    graph begins (`prefetch_region`, from a hook on the region's outputs), under the compute
    that runs before them; and the region's backward joins its reloads where it ends
    (`join_backward`, from the region's inputs).

Note [C3] Copies issued after the replay of the graph that saved them. Under [C1] a carried
    group is copied inside the next graph, under that graph's compute alone; where eager work
    runs between two graphs (Megatron's attention-only graphs, the MLP eager) the copy cannot
    use it. So where the engine sees every replay (the callables `offload.graphs.
    make_graphed_callables` returns call `after_replay`), the next capture does not copy the
    carried groups: it hands them to the `ReplayCopies` of the region that saved them, and
    each replay of that region's graph, as it returns, issues their copies eagerly on the
    D2H stream, after the replay, from the blocks of the graph's pool into the groups' pinned
    buffers. The copies run under the eager work that follows and under the next graph. That
    next graph, at its end, waits on an external event recorded after the copies
    (``torch.cuda.Event(external=True)``: recorded outside the graph, waited on inside it) and
    then frees the blocks inside the pool, as under [C1]; until then they hold what the
    copies read, since only captures allocate from the pool. The event is recorded once
    before the captures: a CUDA event is created at its first record, and a wait on one that
    was never created is not captured. The copies and the record are the same after every
    replay, so they are issued as one launch of a small graph captured at the first replay
    (`CudaStreams.copy_program`). A call that ran the region eagerly instead of replaying (a
    module in another training mode than the one captured) issues nothing.
    Captures through `torch.cuda.graph` (`offload.graphs.graph`) replay out of the engine's
    sight and keep [C1].

Note [C4] Reloads issued after the backward replay of the graph before. Under [C2] a
    backward graph reloads its first groups at its own start, so their copies run under that
    graph alone, and its first kernel waits for the first of them; where eager work runs
    between two backward graphs (the eager MLP's backward) the copies cannot use it. So when
    a backward capture begins right after the backward capture of a region whose replays the
    engine sees, its reload buffers are still allocated at its start, in the pool, but not
    filled in it: the copies go to that region's `ReplayCopies` for backward, and each
    backward replay of that region, once done (a hook on the gradient of the first input of
    the callable the API returned), issues them eagerly on the H2D stream; the new backward
    graph waits on their external event before its first use of a reloaded tensor. The
    buffers hold nothing between the two replays: they were free in the pool when the capture
    began, and only captures allocate from it. A forward replay whose backward must issue
    such reloads raises `OffloadError` when none of its inputs needs a gradient while grad
    mode is on: that backward would not run, and the next backward graph would read what
    the previous step left in its buffers. And the backward graph that waits for them checks,
    from a pre-hook on the autograd node of its outputs, that they were issued since its forward replay
    (`ReplayCopies.issues`), else raises `OffloadError` before it replays: the graphs' backward
    did not run in capture order. A backward graph that reloads nothing waits on no replay and is
    not checked: its region's groups were all kept (Note [C1]: a pipeline order captures such a
    region's forward right before another backward), or copied nothing: what they saved was
    held elsewhere (Note [8] of `offload.copy_queue`; a captured group gets no second look), or
    was only the graph's static input, a leaf that requires grad, which the policy never
    copies. Megatron's attention-only graphs of an MoE model with ``attn_norm`` (whose norm
    saves the graph's input) were refused as out of order when such graphs were still
    registered as waiting.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

from . import nvtx
from .errors import OffloadError
from .group import GroupState, OffloadGroup, TensorRecord
from .streams import Rows

if TYPE_CHECKING:
    from .chunk_handler import ChunkOffloadHandler
    from .manager import PipelineOffloadManager


class CaptureSession:
    """One captured body: what groups and events recorded in it are tagged with."""

    __slots__ = ()


class ReplayCopies:
    """The copies issued eagerly after each replay of one graph: after a forward graph, its
    carried groups' copies out of its pool (Note [C3]); after a backward graph, the reloads
    the next backward graph reads (Note [C4]). Each span is a pinned buffer and an address in
    the graphs' pool."""

    def __init__(self, streams: Any, to_host: bool) -> None:
        self.to_host = to_host
        self.done = streams.event(external=True)  # what the next graph waits on
        self.done.record(streams.current())  # creates it, before any capture waits on it
        self._ready = streams.event()
        self.issues = 0  # replays that issued copies so far
        self._spans: list[tuple[Any, int, int, Rows | None]] = []  # (pinned buffer, device address, bytes, rows)
        self._program: Any = None  # the copies and the record of `done`, built at the first replay
        self._label = ""  # its NVTX range
        self.groups: list[OffloadGroup] = []

    def add(self, group: OffloadGroup, records: Iterable[TensorRecord]) -> None:
        """Copy ``records`` of ``group`` after each replay: to the host from the span each
        saved, or back into its reload buffer (``rec.dev``)."""
        self.groups.append(group)
        for rec in records:  # the span each reads on the device, in rows if it has gaps, or the
            # reload buffer it writes, packed (Note [10] of offload.copy_queue)
            if self.to_host:
                address, rows = rec.ptr + rec.start * rec.itemsize, rec.rows()
                nbytes = (rec.end - rec.start) * rec.itemsize
            else:
                address, nbytes, rows = rec.dev.data_ptr(), rec.nbytes, None
            if rows is not None:  # in bytes, as the spans are
                rows = Rows(rows.count, *(n * rec.itemsize for n in rows[1:]))
            self._spans.append((rec.host.tensor[:rec.nbytes], address, nbytes, rows))
        self._program = None

    def clear(self) -> None:
        self.groups.clear()
        self._spans.clear()
        self._program = None

    def issue(self, streams: Any, chunk_bytes: int) -> None:
        """After a replay: the copy stream waits for it, copies, and records `done` (one
        `streams.copy_program` call: its spans keep their addresses while the graphs live)."""
        if not self._spans:
            return
        self.issues += 1
        stream = streams.d2h if self.to_host else streams.h2d
        if self._program is None:
            jobs = []
            for host, address, nbytes, rows in self._spans:
                dev = streams.device_span(address, nbytes)
                jobs.append((host, dev, 0, rows) if self.to_host else (dev, host, 0, rows))
            self._program = streams.copy_program(stream, jobs, chunk_bytes, self.done)
            self._label = ("offload/after-replay/" if self.to_host else "reload/after-replay/") + self.groups[0].label
        self._ready.record(streams.current())
        stream.wait_event(self._ready)
        nvtx.push(self._label)
        self._program()
        nvtx.pop()


class CaptureSessions:
    """The capture session in progress, the regions' plans and the graph-owned handlers."""

    def __init__(self, engine: "PipelineOffloadManager") -> None:
        self._engine = engine
        self.session: CaptureSession | None = None
        self._reloads: list[Any] = []  # h2d events recorded in the session, joined at its end
        self._graveyard: list[OffloadGroup] = []  # retired during a capture: events die after it
        self._graph_handlers: list[ChunkOffloadHandler] = []
        self.capture_stats: Any = None  # `IterationStats` of the last offload.graphs.make_graphed_callables
        self._carried: list[OffloadGroup] = []  # not yet copied at a region's end: Note [C1]
        self._carried_from: Any = None  # the key of the region that carried them
        self.replays: dict[Any, ReplayCopies] = {}  # region key -> copies after its forward replays: Note [C3]
        self.backward_replays: dict[Any, ReplayCopies] = {}  # ... after its backward replays: Note [C4]
        self.reloaded_by: dict[Any, ReplayCopies] = {}  # region key -> what its backward graph waits on
        self.region_runs = 0  # regions entered so far; a replay enters none
        self._backward_ended: Any = None  # the region whose backward capture was the last session
        self.plans: dict[Any, list[tuple[str, tuple[int, ...]]]] = {}
        self._regions: list[tuple[Any, list[tuple[str, tuple[int, ...]]]]] = []

    @property
    def in_region(self) -> bool:
        return bool(self._regions)

    def sync(self) -> CaptureSession | None:
        """The session the current engine call belongs to (``None`` when not capturing)."""
        if not self._engine.streams.is_capturing():
            self._backward_ended = None
            if self.session is not None:
                self._end()
            if self._carried:  # eager code follows the graphs: Note [C1]
                self._engine.chunks.keep(self._take_carried())
            if self._graveyard:
                self._graveyard.clear()
            return None
        if self.session is None:
            self._begin(forward_region=False)
        return self.session

    def _begin(self, forward_region: bool) -> None:
        """Start a session. The eager forward's last groups stay on the GPU (a copy of them
        launched inside the capture would wait on an event recorded before it, which
        invalidates the capture); eager copies in flight are released without a wait, since a
        capture begins after a synchronize (PyTorch requires it after warm-up, and
        `offload.graphs` does it); idle handlers that hold no device memory give their buffers
        back (an eager warm-up right before a capture, such as the body run in
        `offload.graphs.region` before `offload.graphs.graph`, leaves its last handlers
        unretired), their groups and events kept until the capture is over, since an event
        destroyed during a capture invalidates it. The groups the previous region carried are
        copied now when this session is a forward region, else kept (Note [C1])."""
        engine = self._engine
        engine.chunks.retire_idle(graveyard=self._graveyard)
        engine.copies.drop_all()
        engine.chunks.keep(engine.copies.take_deferred())
        engine.chunks.end_forward(keep=True)
        self.session = CaptureSession()
        self._backward_ended = None
        replay = self.replays.get(self._carried_from)
        carried = self._take_carried()
        if not forward_region:
            engine.chunks.keep(carried)
            return
        current = engine.streams.current()
        for group in carried:  # written by an earlier graph, which replays first
            group.stream = current
            if replay is None:
                group.ready = engine.streams.event()
                group.ready.record(current)
        if replay is not None:
            replay.clear()
        engine.copies.carry_in(carried, replay)

    def _take_carried(self) -> list[OffloadGroup]:
        carried, self._carried, self._carried_from = self._carried, [], None
        return carried

    def prepare_replays(self, keys: Iterable[Any]) -> None:
        """The regions ``keys`` will be captured, and their graphs' replays reported through
        `after_replay`: their carried groups are copied after those replays (Note [C3]).
        Call before the captures."""
        streams = self._engine.streams
        for key in keys:
            self.replays[key] = ReplayCopies(streams, to_host=True)
            self.backward_replays[key] = ReplayCopies(streams, to_host=False)

    def after_replay(self, key: Any, backward: bool = False) -> None:
        """The forward (``backward``: the backward) graph of region ``key`` was just replayed:
        issue the copies it owes (Notes [C3], [C4])."""
        replay = (self.backward_replays if backward else self.replays).get(key)
        if replay is not None:
            replay.issue(self._engine.streams, self._engine.copies.chunk_bytes)

    def _end(self) -> None:
        """End the session in progress. Its offload copies must all have been joined into it
        (a region's end does it; see `join`), else CUDA has refused to end the capture and
        this says why; its handlers now belong to the graphs."""
        engine = self._engine
        old = self.session
        unjoined = engine.copies.forget_session(old)
        self._reloads.clear()
        forward = engine.chunks.forward
        if forward is not None and forward.capture is old:
            unjoined += engine.chunks.end_forward(keep=True)  # never copied by the graph
        self._graph_handlers += engine.order.take(lambda h: h.capture is old)
        self.session = None
        if unjoined:
            raise OffloadError(
                f"offload: a CUDA graph capture ended with the offload copies of {unjoined} not "
                "joined into it (started ones make CUDA fail the capture as 'unjoined'; the "
                "others were never copied by the graph). Capture through offload.graphs.graph "
                "/ make_graphed_callables, or call offload.graphs.join() as the last step "
                "inside the captured region."
            )

    def note_reload(self, event: Any) -> None:
        """A reload was issued in the session: `join` makes the capturing stream wait on it."""
        self._reloads.append(event)

    def _join_reloads(self) -> None:
        current = self._engine.streams.current()
        for event in self._reloads:
            current.wait_event(event)
        self._reloads.clear()

    def join(self) -> None:
        """Join every copy this session forked back into the current stream: the offloads in
        flight (then their GPU memory is released, inside the graph's pool) and the reloads
        not yet waited for. Must run inside the capture, after its last offloaded group;
        outside a capture it does nothing."""
        if self.sync() is None:
            return
        engine = self._engine
        forward = engine.chunks.forward
        if forward is not None and forward.capture is self.session:
            engine.chunks.end_forward(keep=False)  # its last groups too: nothing waits past the graph's end
        engine.copies.flush()
        self._join_reloads()
        self._end()  # the session ends; the capture may go on (a new session)

    def join_backward(self, key: Any) -> None:
        """Region ``key``'s backward reached the region's inputs: under capture, join the
        reloads its session issued and end the session (Note [C2]); eagerly, nothing."""
        if self.session is not None and self._engine.streams.is_capturing():
            self._join_reloads()
            self._end()
            self._backward_ended = key

    def prefetch_region(self, handler: "ChunkOffloadHandler | None", key: Any = None) -> None:
        """A region's backward graph begins (the gradient of its outputs arrived): under
        capture, reload the last offloaded group of each name it captured, the first its
        backward needs, last closed first (Note [C2]); after the backward replay of the
        region captured just before, where that replay is reported (Note [C4]). Eagerly,
        nothing (the eager rules prefetch)."""
        if handler is None:
            return
        fresh, previous = self.session is None, self._backward_ended  # before sync() begins a session
        if self.sync() is None:
            return
        replay = self.backward_replays.get(previous) if fresh else None
        last = [g for g in handler.groups if handler.last_of_name.get(g.name) is g]
        if replay is not None:
            replay.clear()
        for group in reversed(last):
            if group.state is GroupState.OFFLOADED:
                self._engine.reload(group, prefetch=True, replay=replay)
        if replay is not None and replay.groups:
            self.reloaded_by[key] = replay
        else:  # a graph that reloads nothing waits on no replay
            self.reloaded_by.pop(key, None)

    def enter_region(self, key: Any) -> None:
        """A graphable region begins: eagerly, it records the groups it offloads as its plan;
        under capture, it is a captured body of its own and is checked against that plan."""
        capturing = self._engine.streams.is_capturing()
        if capturing and key not in self.plans:
            raise OffloadError(
                f"offload: graph region {key!r} is being captured but never ran eagerly: run it "
                "once (same shapes) before capturing, so its plan and pinned buffers exist"
            )
        if capturing:
            if self.session is not None:
                self._end()
            self._begin(forward_region=True)
        self._regions.append((key, []))
        self.region_runs += 1

    def exit_region(self, key: Any) -> "ChunkOffloadHandler | None":
        """The region ends. Eagerly, its groups become its plan. Under capture, it is checked
        against its plan; the copies it issued and its reloads are joined, and the groups not
        yet copied are carried to the next session (Note [C1]). Returns the handler of the
        captured groups (``None`` eagerly), for `prefetch_region`."""
        if not self._regions or self._regions[-1][0] != key:
            raise OffloadError(f"offload: graph region {key!r} closed out of order")
        _, steps = self._regions.pop()
        engine = self._engine
        if not engine.streams.is_capturing():
            self.plans[key] = steps
            return None
        plan = self.plans[key]
        if len(steps) != len(plan):
            self.join()
            raise OffloadError(
                f"offload: graph region {key!r} offloaded {len(steps)} group(s) under capture, "
                f"but {len(plan)} in its eager warm-up: the group structure changed after the "
                "plan was frozen"
            )
        handler = engine.chunks.forward
        engine.copies.release_all()
        self._join_reloads()
        carried = engine.copies.take_deferred() + engine.chunks.hand_over_forward()
        self._end()
        self._carried, self._carried_from = carried, key
        return handler

    def plan_step(self, group: OffloadGroup) -> None:
        """Note ``group`` in the innermost region: its plan, or the check against it."""
        key, steps = self._regions[-1]
        step = (group.name, tuple(rec.nbytes for rec in group.records))
        if group.capture is not None:
            plan = self.plans[key]
            i = len(steps)
            expected = plan[i] if i < len(plan) else None
            if step != expected:
                had = "nothing more" if expected is None else f"{expected[0]!r} saving {list(expected[1])}"
                raise OffloadError(
                    f"offload: graph region {key!r}, group {i} under capture is {step[0]!r} saving "
                    f"{list(step[1])} bytes, but the eager warm-up had {had} bytes: a shape or the "
                    "group structure changed after the plan was frozen"
                )
        steps.append(step)

    @property
    def captured_groups(self) -> list[OffloadGroup]:
        """The groups captured into CUDA graphs, in capture order; each replay of a forward
        graph writes its records' pinned buffers (``rec.host``), its backward graph reads them."""
        return [g for h in self._graph_handlers for g in h.groups]

    def captured_summary(self) -> dict[str, dict[str, int]]:
        """Per group name, what the captured graphs hold: ``groups`` captured, ``groups_copied``
        (those with pinned buffers: the forward replay copies them out, the backward replay
        brings them back) and their ``bytes_copied`` when every graph replays once. Groups
        captured are not in `end_iteration`'s statistics: a replay runs no hook."""
        summary: dict[str, dict[str, int]] = {}
        for group in self.captured_groups:
            entry = summary.setdefault(group.name, {"groups": 0, "groups_copied": 0, "bytes_copied": 0})
            copied = sum(rec.nbytes for rec in group.records if rec.host is not None)
            entry["groups"] += 1
            entry["groups_copied"] += copied > 0
            entry["bytes_copied"] += copied
        return summary

    def release_graphs(self) -> None:
        """Give the captured graphs' pinned buffers back to the pool and forget their groups.
        Only once those graphs will never replay again."""
        pool = self._engine.pool
        for handler in self._graph_handlers:
            for group in handler.groups:
                for rec in group.records:
                    if rec.host is not None:
                        pool.release(rec.host)
                    rec.host = rec.src = rec.dev = None
            handler.forget()
        self._graph_handlers.clear()
        self.replays.clear()
        self.backward_replays.clear()
        self.reloaded_by.clear()

    def reset(self) -> None:
        """Forget the session in progress and the open regions (plans and graphs stay)."""
        self.session = None
        self._reloads.clear()
        self._regions.clear()
        self._take_carried()
        self._backward_ended = None
