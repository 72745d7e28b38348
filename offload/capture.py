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
* **Copies carried to the next graph** (Note [C1] below) and **reloads issued at the start of
  a region's backward graph** (Note [C2]).
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
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import OffloadError
from .group import GroupState, OffloadGroup

if TYPE_CHECKING:
    from .chunk_handler import ChunkOffloadHandler
    from .manager import PipelineOffloadManager


class CaptureSession:
    """One captured body: what groups and events recorded in it are tagged with."""

    __slots__ = ()


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
        self.plans: dict[Any, list[tuple[str, tuple[int, ...]]]] = {}
        self._regions: list[tuple[Any, list[tuple[str, tuple[int, ...]]]]] = []

    @property
    def in_region(self) -> bool:
        return bool(self._regions)

    def sync(self) -> CaptureSession | None:
        """The session the current engine call belongs to (``None`` when not capturing)."""
        if not self._engine.streams.is_capturing():
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
        carried = self._take_carried()
        if not forward_region:
            engine.chunks.keep(carried)
            return
        current = engine.streams.current()
        for group in carried:  # written by an earlier graph, which replays first
            group.stream = current
            group.ready = engine.streams.event()
            group.ready.record(current)
        engine.copies.carry_in(carried)

    def _take_carried(self) -> list[OffloadGroup]:
        carried, self._carried = self._carried, []
        return carried

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

    def join_backward(self) -> None:
        """A region's backward reached the region's inputs: under capture, join the reloads
        its session issued and end the session (Note [C2]); eagerly, nothing."""
        if self.session is not None and self._engine.streams.is_capturing():
            self._join_reloads()
            self._end()

    def prefetch_region(self, handler: "ChunkOffloadHandler | None") -> None:
        """A region's backward graph begins (the gradient of its outputs arrived): under
        capture, reload the last offloaded group of each name it captured, the first its
        backward needs (Note [C2]); eagerly, nothing (the eager rules prefetch)."""
        if handler is None or self.sync() is None:
            return
        for group in handler.last_of_name.values():
            if group.state is GroupState.OFFLOADED:
                self._engine.reload(group, prefetch=True)

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
        self._carried = carried
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

    def reset(self) -> None:
        """Forget the session in progress and the open regions (plans and graphs stay)."""
        self.session = None
        self._reloads.clear()
        self._regions.clear()
        self._carried.clear()
