"""`CaptureSessions`: what the engine does while a CUDA graph is being captured.

A CUDA graph replays the kernels, copies and event edges recorded during its capture and runs
no Python, so the engine does its work during the capture and the graph repeats it (see
`offload.graphs` for the user side). This module owns the state that needs:

* **Sessions.** A session is one captured body: it starts at the first engine call seen while
  the stream captures (or at a region's start under capture) and ends at a region's end, at
  `join`, or at the first call seen outside a capture. Groups, handlers and events made in a
  session are tagged with it; an event recorded in one session is never waited on in another
  (Note [3] of `offload.copy_queue`). Consecutive backward captures without a region or join
  share a session; that is harmless, since backward only reloads.
* **Regions and plans.** A graphable region (`offload.graphs.region`) records, when it runs
  eagerly, the groups it offloads and their sizes (its plan); under capture the same groups
  must come, else `OffloadError`.
* **Graph-owned handlers.** A captured handler leaves the engine's queue when its session
  ends: its pinned buffers belong to its graphs (every replay writes them) until
  `release_graphs`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import OffloadError
from .group import OffloadGroup

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
        self.plans: dict[Any, list[tuple[str, tuple[int, ...]]]] = {}
        self._regions: list[tuple[Any, list[tuple[str, tuple[int, ...]]]]] = []

    @property
    def in_region(self) -> bool:
        return bool(self._regions)

    def sync(self) -> CaptureSession | None:
        """The session the current engine call belongs to (``None`` when not capturing)."""
        if not self._engine.streams.is_capturing():
            if self.session is not None:
                self._switch(None)
            if self._graveyard:
                self._graveyard.clear()
            return None
        if self.session is None:
            self._switch(CaptureSession())
        return self.session

    def _switch(self, new: CaptureSession | None) -> None:
        """End the session in progress, if any, and start ``new`` (or none).

        Leaving a session: its offload copies must all have been joined into it (a region's
        end does it; see `join`), else CUDA has refused to end the capture and this says why;
        its handlers now belong to the graphs. Entering one: the eager forward's last groups
        stay on the GPU (a copy of them launched inside the capture would wait on an event
        recorded before it, which invalidates the capture); eager copies in flight are
        released without a wait, since a capture begins after a synchronize (PyTorch requires
        it after warm-up, and `offload.graphs` does it); idle handlers that hold no device
        memory give their buffers back (a graph API's own warm-up leaves its last handlers
        unretired), their groups and events kept until the capture is over, since an event
        destroyed during a capture invalidates it.
        """
        engine = self._engine
        old = self.session
        if old is not None:
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
        if new is not None:
            engine.chunks.retire_idle(graveyard=self._graveyard)
            engine.copies.drop_all()
            engine.chunks.keep(engine.copies.take_deferred())  # their copy may not start inside the capture
            engine.chunks.end_forward(keep=True)
        self.session = new

    def note_reload(self, event: Any) -> None:
        """A reload was issued in the session: `join` makes the capturing stream wait on it."""
        self._reloads.append(event)

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
        current = engine.streams.current()
        for event in self._reloads:
            current.wait_event(event)
        self._reloads.clear()
        self._switch(None)  # the session ends; the capture may go on (a new session)

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
                self._switch(None)
            self._switch(CaptureSession())
        self._regions.append((key, []))

    def exit_region(self, key: Any) -> None:
        """The region ends: under capture, join its copies and check it ran its whole plan;
        eagerly, its groups become its plan."""
        if not self._regions or self._regions[-1][0] != key:
            raise OffloadError(f"offload: graph region {key!r} closed out of order")
        _, steps = self._regions.pop()
        if not self._engine.streams.is_capturing():
            self.plans[key] = steps
            return
        self.join()
        plan = self.plans[key]
        if len(steps) != len(plan):
            raise OffloadError(
                f"offload: graph region {key!r} offloaded {len(steps)} group(s) under capture, "
                f"but {len(plan)} in its eager warm-up: the group structure changed after the "
                "plan was frozen"
            )

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
