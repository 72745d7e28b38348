"""`CopyQueue`: every offload and reload copy, the events that order them, and the bound on
what is in flight. The engine's correctness rests on the notes below; the code refers back
to them by number. All are event edges: the host never waits for the GPU.

Note [1] Offload after the tensor exists. The D2H stream waits on the group's ``ready``
    event, recorded on the compute stream when the group closed.

Note [2] Reload after the memory it replaces is free, into memory the compute stream owns.
    A reload is issued from the backward of the group after it; its buffers are allocated
    on the current (compute) stream, so the caching allocator orders their reuse with that
    stream, and the H2D stream first waits on the compute stream at that point (one event
    the queue records again for each reload: a wait takes the event's state when it is
    issued, and ``Stream.wait_stream`` would create an event per reload on the hot path).

Note [3] Reload after the offload. The H2D stream waits on the D2H event of every group whose
    records it reads (Megatron-LM #7398 reloaded without this edge and read stale data).
    An offload captured in another CUDA graph is not waited on: it was joined into its own
    graph's stream before that graph ended, and replay order orders it.

Note [4] Backward after the reload. Before a reloaded tensor is handed to autograd, the
    current stream waits on the reload's event (once per group and stream). A tensor that
    nothing prefetched is reloaded on demand through the same path.

Note [5] A GPU tensor that was copied out is dropped only when its D2H copy is known done:
    an event query that says so, or after the compute stream was made to wait on the copy's
    event. Never ``record_stream``: it delays frees unpredictably and breaks under capture.

Note [6] A pinned buffer is written by a D2H copy only after the last H2D copy that read it
    (the buffer keeps that event). A buffer taken during a capture was last read eagerly,
    before the capture began (buffers a graph owns never return to the pool): waiting on that
    event would invalidate the capture, and the synchronize before a capture orders it.

Note [7] When a group's copies are issued. A group is offloaded once it is known not to be the
    last of its name in its chunk's forward: when it closes, if the chunk's previous forward had
    a later group of its name (`ChunkLifecycle.known_not_last`); in a chunk's first forward,
    when the next group of its name closes. Its copies are issued at the next group's open
    (`defer`, `launch_deferred`): a copy engine serves the copies queued on it in order, so a
    model's own small device-to-host copy between the two (an MoE router's ``.tolist()``, a
    host sync) would otherwise wait behind the whole group's copy, every layer. Issued at the
    open, the copy runs under the next group's compute instead. Deciding at the group's own
    close moves every copy a layer earlier: a copy runs under the next layer, and at the
    forward's end only the second-to-last layer's copies are still to be waited for, not the
    last two layers'. What the group saved and the next group saves too is the next group's
    to decide (`ChunkOffloadHandler._share`), also when the first group's copies were already
    issued without it because it was held elsewhere then (Note [8]): often the holder was the
    next group's own input. The previous forward is a guess: where a group policy or the
    model's control flow ends a name earlier this time, the group decided early was its last,
    and it is offloaded even when the chunk's own backward comes next (copied out and straight
    back: traffic, never a wrong value).

Note [8] A second look. A record whose storage something else holds when its group's copies
    are issued stays on the GPU: copying it would free nothing. Often the holder lets go soon
    (the code that called the module keeps its input in a local until it returns, a residual
    until the add), sometimes only at the forward's end (Megatron's ``GPTModel.forward`` keeps
    the embedding's output, the first layer's input, until it returns, unless the Megatron
    integration hands it to the decoder, `_hand_the_embedding_output_to_the_decoder`). So those records are
    checked again (`offload_released`) at every group open of their chunk's forward, when its
    last group closes, when the attached model's forward returns (`offload.attach`'s forward
    hook: `PipelineOffloadManager.model_forward_returned`), when the forward is over and not
    its own backward comes next, and last when the chunk's backward begins; the ones now only
    ours are copied as a group's copies are, the group OFFLOADING again, or still (its
    ``d2h_done`` becomes the new copies' event: the D2H stream runs in order, so it follows the
    first copies too, for Notes [3] and [5]), and freed by the in-flight queue as any other.
    The look at the model's return is for what its forward held in locals: its first layers'
    backward is the backward's end, and a step often peaks in its backward's first modules
    (a deterministic fused attention backward's workspace, in the last layer: Megatron's dense
    GPT at 16K), so the copies start under the loss head and the output layer's backward, and
    the compute stream waits for them when the chunk's backward begins, with the copies in
    flight then (`ChunkLifecycle.begin_backward`). The look at the backward's start is for
    what a caller holds past the model's return, or a forward without `offload.attach`
    (`begin_chunk` alone): it comes after that wait, its copies are not waited for, and the
    `poll` after each group's backward frees them. Where a chunk's backward needs one before
    its copy is done (a short backward), it is used where it is, a copy out for nothing
    (`bytes_reloaded` falls short of `bytes_offloaded` by it).

Note [9] Copies after a host sync. A model that synchronizes with the host every layer (an MoE
    token dispatcher reading how many tokens each expert got, with ``.cpu()``) makes a small
    device-to-host copy there, which the copy engine serves after every offload copy queued
    before it (Note [7]); on a step the host paces, the host, and with it the step, waits for
    the rest of those copies at every such sync. A model that says where it syncs
    (`PipelineOffloadManager.after_host_sync`, called right after the sync: the Megatron
    integration calls it as each MoE layer's experts start, after the dispatcher's sync) has
    its decided copies issued there instead, from its chunk forward's first such call on
    (``ChunkOffloadHandler.host_syncs``): a copy then has until the next sync, a layer later,
    to end. A group open then issues only the deferred groups of its own name: one is still
    deferred only when a whole layer went by without a sync (a dense layer of an MoE model),
    so no group waits for its issue longer than one layer.

Note [10] Views with gaps. A saved view whose elements are rows with gaps between them (one
    half of a GLU's input, ``torch.chunk(fc1_output, 2, dim=-1)[0]``: rows of ``f`` elements,
    ``2f`` apart) is recorded as those rows alone (`offload.group.gapped_rows`: at least half of
    each row's pitch a gap): copied to the host as rows (``cudaMemcpy2DAsync``), packed there,
    and reloaded packed, into a buffer of the rows alone. Recorded as the span, it moved the
    gaps too, both ways: Megatron's experts save only the activated half (the other one goes
    through ``x_linear + glu_linear_offset``), a fifth of what ``moe_act`` moved. The view
    comes back with the strides it was saved with: at its record's first unpack the rows are
    spread into a new buffer of the span, on the compute stream (`CopyQueue.spread`), the gaps
    unwritten, and the packed buffer is dropped. A view handed back packed would have other
    strides, and kernels do not all give the same bits for them (the CPU's SiLU does not), nor
    read a layout the same (Transformer Engine's fused attention derives one from the strides
    at forward time). So between the prefetch and the backward that needs it (the layer after
    it runs its backward then: where Megatron's MoE at DeepSeek-V3's widths peaks, in an
    attention backward), the record holds the rows' bytes, not the span's; for the one device
    copy of the spread, the two buffers are live together. A group opened with ``packed_views``
    (`offload.group`: its backward gives the same bits for the rows packed, as an activation's
    backward does in torch's CUDA kernels) gets them packed instead, as Megatron's offloading
    returns every view: no spread, and its backward's kernels read contiguous rows (DeepSeek-V3's
    widths at sequence 16384, H200: the spreads and the strided SiLU backward cost 7 ms of a
    1.65 s step). A second view of the same storage saved in the same group makes the record all
    of the storage (`TensorRecord.widen`): one copy each way, as before.

Note [11] Declined invocations. A group the policy declines (`offload.group_policy`) is an
    invocation of its name all the same, and the engine counts it so. Its backward runs before
    the backward of the name's groups before it: the name's pending group is not the last of its
    chunk forward and is decided there (and, from the chunk's next forward on, at its own close,
    `ChunkLifecycle.known_not_last` counting every invocation), so ``layers:0-1`` offloads both
    layers of a deeper model and not only the first (the second was kept by the last-layer rule,
    as if the chunk's backward followed it). A group's reload is issued by the backward of the
    next group of its name (``prev_same``); where the next invocation was declined, by the
    backward of the next group to open after that invocation, of any name (``reloads_too``): one
    layer ahead, as for the others, not on demand (where no group opens after it in its chunk
    forward, nothing signals: on demand, as for a group without inputs, Note [1] of
    `offload.regions`). A declined invocation's open issues the decided copies, where there are
    any, after the in-flight bound, and its close frees the copies found done, as a group's do
    (a forward the policy declines whole waits for nothing it did not before): the copies of the
    layers offloaded run under the declined layers after them. And the forward's end is the close
    of the invocation that closed last, offloaded or declined: the copies in flight are waited for
    there, not at the close of the last group offloaded, which would stall the compute stream on
    that group's own copies with the declined layers' compute still to come. Inside a CUDA-graph
    region a declined invocation decides nothing and links no reload: a graph's copies and
    reloads are planned at its capture (Notes [C1], [C2] of `offload.capture`).

The in-flight bound: when a group opens, the compute stream first waits for the oldest copies
until at most ``max_inflight_groups`` groups hold GPU memory while their copies run
(`apply_bound`), and only then are the copies decided since the last open issued; so each copy
runs under at least one group's compute before the bound can make the compute stream wait for
it, and the memory bound holds even when the host runs far ahead of the GPU. Groups a graph
copies for an earlier graph (`carry_in`, Note [C1] of `offload.capture`) are outside the
bound: the graph's end frees them, and a wait for them at its start would stall every replay.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from . import nvtx
from .group import GroupState, OffloadGroup, TensorRecord
from .pinned_pool import PinnedHostPool
from .stats import StatsRecorder

if TYPE_CHECKING:
    from .chunk_handler import ChunkOffloadHandler


class CopyQueue:
    """Issues the copies of groups on the side streams and tracks those in flight."""

    def __init__(self, streams: Any, pool: PinnedHostPool, stats: StatsRecorder, max_inflight: int,
                 chunk_bytes: int) -> None:
        self.streams = streams
        self.pool = pool
        self.stats = stats  # also says whether this iteration's copies and waits are timed
        self.max_inflight = max_inflight
        self.chunk_bytes = chunk_bytes
        self.inflight: deque[OffloadGroup] = deque()
        self.carried = 0  # the first ``carried`` groups in flight are outside the bound (`carry_in`)
        self.deferred: list[OffloadGroup] = []  # decided, not yet issued (Note [7])
        self._reload_after = streams.event()  # where the H2D stream waits for the compute stream (Note [2])

    # ------------------------------------------------------------------ offload
    def offload(self, group: OffloadGroup, bound: bool = True, replay: Any = None) -> None:
        """PENDING -> OFFLOADING: queue the D2H copies of ``group``'s live records that copying
        would free (a record whose storage something else holds stays on the GPU and is
        counted in ``bytes_held_elsewhere``). With ``bound``, apply the in-flight bound. With
        ``replay`` (a `offload.capture.ReplayCopies`), the copies are handed to it instead, to be
        issued after each replay of the graph that saved the group (Note [C3] of `offload.capture`)."""
        group.advance(GroupState.OFFLOADING)
        captured = group.capture is not None
        todo = []
        shared = 0
        aliases, acquire = group.handler.live_aliases, self.pool.acquire
        for rec in group.records:
            rec.note_version()
            if rec.src is None or rec.alive == 0:
                continue
            if not rec.copy_frees_memory(aliases(rec.ptr)):
                shared += rec.nbytes
                if not captured:
                    group.handler.held.append(rec)  # Note [8]
                continue
            rec.host = acquire(rec.nbytes, captured)
            if rec.host is not None:
                todo.append(rec)
        self.stats[group.name].bytes_held_elsewhere += shared
        if not todo:
            group.advance(GroupState.OFFLOADED)
            return
        self._count(group, todo, first=True)
        if replay is not None:
            group.d2h_done = replay.done
            replay.add(group, todo)
        else:
            self._issue(group, todo, captured)
        self.inflight.append(group)
        self.stats.note_inflight(len(self.inflight))
        if bound:
            self._bound()

    def offload_released(self, handler: "ChunkOffloadHandler") -> None:
        """Note [8]: copy the records of ``handler``'s offloaded groups that something else held
        when their copies were issued and that are now only ours; the others stay, to be looked
        at again."""
        if not handler.held:
            return
        held, handler.held = handler.held, []
        todo_of: dict[int, tuple[OffloadGroup, list]] = {}
        aliases = handler.live_aliases
        for rec in held:
            group = rec.group
            if (group.state < GroupState.OFFLOADING or rec.src is None or rec.alive == 0
                    or rec.host is not None or rec.dev is not None):
                continue
            if not rec.copy_frees_memory(aliases(rec.ptr)):
                handler.held.append(rec)  # still held: looked at again
                continue
            rec.note_version()
            rec.host = self.pool.acquire(rec.nbytes, False)
            if rec.host is not None:
                todo_of.setdefault(id(group), (group, []))[1].append(rec)
        for group, todo in todo_of.values():
            if group.state is GroupState.OFFLOADED:
                group.advance(GroupState.OFFLOADING)
                self.inflight.append(group)
            self.stats[group.name].bytes_held_elsewhere -= sum(rec.nbytes for rec in todo)
            self._count(group, todo, first=group.d2h_done is None)  # None: nothing of it was copied before
            self._issue(group, todo, False)
        if todo_of:
            self.stats.note_inflight(len(self.inflight))

    def _count(self, group: OffloadGroup, todo: list, first: bool) -> None:
        """Count the copies about to be issued for ``group`` (``first``: the group's first)."""
        stats = self.stats[group.name]
        stats.groups_offloaded += first
        stats.bytes_offloaded += sum(rec.nbytes for rec in todo)
        stats.tensors_offloaded += len(todo)

    def _issue(self, group: OffloadGroup, todo: list, captured: bool) -> None:
        streams, d2h = self.streams, self.streams.d2h
        timing = self.stats.timing and not captured  # a captured event cannot be timed
        nvtx.push("offload/" + group.label)
        group.d2h_done = streams.event(timing)
        d2h.wait_event(group.ready)  # Note [1]
        if not captured:
            seen = set()
            for rec in todo:  # Note [6]
                event = rec.host.last_read
                if event is not None and id(event) not in seen:
                    seen.add(id(event))
                    d2h.wait_event(event)
        start = self._timing_start(d2h, timing)
        streams.copy(d2h, [(rec.host_view(), rec.src, rec.start, rec.rows()) for rec in todo], self.chunk_bytes)
        group.d2h_done.record(d2h)
        nvtx.pop()
        if timing:
            self.stats.time("d2h_ms", group.name, start, group.d2h_done)

    def defer(self, group: OffloadGroup) -> None:
        """``group`` will be offloaded; its copies are issued by `launch_deferred` (Note [7])."""
        self.deferred.append(group)

    def launch_deferred(self, bound: bool = True, name: str | None = None) -> None:
        """Issue the copies of the groups `defer` holds (``name``: only that name's, Note [9])."""
        if name is not None:
            due = [g for g in self.deferred if g.name == name]
            if due:
                self.deferred = [g for g in self.deferred if g.name != name]
            for group in due:
                self.offload(group, bound)
            return
        while self.deferred:
            self.offload(self.deferred.pop(0), bound)

    def take_deferred(self) -> list[OffloadGroup]:
        """Hand over the groups `defer` holds without issuing their copies."""
        taken, self.deferred = self.deferred, []
        return taken

    def flush(self) -> None:
        """Issue every deferred copy, then free every group in flight: the compute stream
        waits for their copies on the GPU (the forward's end, a backward's start, a capture's
        join)."""
        self.launch_deferred()
        self.release_all(flush=True)

    def reset(self) -> None:
        """Forget every copy (the caller made the compute stream wait for the side streams)."""
        self.inflight.clear()
        self.carried = 0
        self.deferred.clear()

    def apply_bound(self) -> None:
        """Free what is done; then, past the bound, make the compute stream wait for the
        oldest copies (Note [5])."""
        self.poll()
        self._bound()

    def _bound(self) -> None:
        while len(self.inflight) - self.carried > self.max_inflight:
            oldest = self.inflight[self.carried]
            del self.inflight[self.carried]
            self._release(oldest, wait=True)

    def carry_in(self, groups: list[OffloadGroup], replay: Any = None) -> None:
        """Issue the copies of groups an earlier graph saved (Note [C1] of `offload.capture`),
        or hand them to ``replay`` (Note [C3]), outside the in-flight bound: the end of the
        graph being captured frees them."""
        for group in groups:
            self.offload(group, bound=False, replay=replay)
        self.carried = len(self.inflight)

    def poll(self) -> None:
        """Free the GPU memory of groups whose copies are done; never blocks (Note [5])."""
        if self.streams.is_capturing():
            return
        inflight = self.inflight
        while inflight and inflight[0].d2h_done.query():
            self._release(inflight.popleft(), wait=False)
            self.carried = max(0, self.carried - 1)

    def release_all(self, flush: bool = False) -> None:
        """Free every group in flight; the compute stream waits for their copies on the GPU
        (``flush``: at the forward's end, its waits counted in ``flush_wait_ms`` too)."""
        while self.inflight:
            self._release(self.inflight.popleft(), wait=True, flush=flush)
        self.carried = 0

    def drop_all(self) -> None:
        """Free every group in flight without a wait: only right after a device synchronize
        (a capture begins after one)."""
        while self.inflight:
            self.inflight.popleft().release()
        self.carried = 0

    def forget_session(self, session: Any) -> list[str]:
        """Stop tracking the copies captured in ``session``; return their labels."""
        labels = [g.label for g in (*self.inflight, *self.deferred) if g.capture is session]
        if labels:
            self.inflight = deque(g for g in self.inflight if g.capture is not session)
            self.carried = 0
            self.deferred = [g for g in self.deferred if g.capture is not session]
        return labels

    def _release(self, group: OffloadGroup, wait: bool, flush: bool = False) -> None:
        if wait:
            self.wait(group.stream, group.d2h_done, "offload_wait_ms", group.name,
                      "flush_wait_ms" if flush else None)
        group.release()

    # ------------------------------------------------------------------ reload
    def reload(self, group: OffloadGroup, prefetch: bool, session: Any = None, replay: Any = None) -> bool:
        """Queue H2D copies of every record ``group``'s backward needs back (``session``: the
        capture session this runs in, if any), or allocate their buffers and hand the copies to
        ``replay`` (Note [C4] of `offload.capture`); whether there were any."""
        todo = group.to_reload()
        if not todo:
            return False
        streams = self.streams
        timing = self.stats.timing and session is None
        current = streams.current()
        for rec in todo:
            rec.dev = streams.empty(rec.numel, rec.dtype)  # Note [2]; rows packed (Note [10])
        start = None
        if replay is not None:
            replay.add(group, todo)
            done = replay.done
        else:
            nvtx.push("reload/" + group.label)
            h2d = streams.h2d
            self._reload_after.record(current)  # Note [2]
            h2d.wait_event(self._reload_after)
            owners = {id(rec.group): rec.group for rec in todo}
            for owner in owners.values():
                if owner.capture is None or owner.capture is session:
                    h2d.wait_event(owner.d2h_done)  # Note [3]
            done = streams.event(timing)
            start = self._timing_start(h2d, timing)
            streams.copy(h2d, [(rec.dev, rec.host_view(), 0, None) for rec in todo], self.chunk_bytes)
            done.record(h2d)
            nvtx.pop()
        for rec in todo:
            rec.reload_group = group
            rec.last_read = done
            rec.unpacked = 0
        group.h2d_done = done
        group.alloc_stream = current
        group.waited = set()
        stats = self.stats[group.name]
        stats.bytes_reloaded += sum(rec.nbytes for rec in todo)
        if prefetch:
            stats.reloads_prefetched += 1
        else:
            stats.reloads_on_demand += 1
        if timing:
            self.stats.time("h2d_ms", group.name, start, done)
        return True

    def wait_reloaded(self, group: OffloadGroup) -> None:
        """Note [4]: the current stream waits for ``group``'s reload (once per stream)."""
        sid = self.streams.current_id()
        if sid not in group.waited:
            group.waited.add(sid)
            self.wait(self.streams.current(), group.h2d_done, "reload_wait_ms", group.name)

    def spread(self, rec: TensorRecord) -> None:
        """Note [10]: put a record of rows, reloaded packed, where its saved views read them, in
        a new buffer of its span (the gaps unwritten), on the current stream, which waited for
        the reload (Note [4]); the packed buffer is dropped, after that copy on its own stream."""
        streams = self.streams
        current = streams.current()
        span = streams.empty(rec.end - rec.start, rec.dtype)
        count, width, pitch = rec.rows()
        span.as_strided((count, width), (pitch, 1)).copy_(rec.dev.view(count, width))
        alloc = rec.reload_group.alloc_stream
        if alloc is not None and alloc is not current and not streams.is_capturing():
            spread = streams.event()
            spread.record(current)
            alloc.wait_event(spread)  # the packed buffer is reused in the allocator's order on ``alloc``
        rec.dev = span

    # ------------------------------------------------------------------ retirement
    def settle(self, group: OffloadGroup) -> None:
        """Make dropping ``group``'s memory safe: a copy out still running is waited for
        (Note [5]) and its group released; a reload whose buffers are still held is waited
        for on the stream that allocated them. Captured groups need no wait (their graphs
        order their copies) and allow none (their events belong to the capture)."""
        captured = group.capture is not None
        if group.state is GroupState.OFFLOADING:
            if group in self.inflight:
                self.inflight.remove(group)
                self.carried = min(self.carried, len(self.inflight))
            if not captured:
                group.stream.wait_event(group.d2h_done)
            group.release()
        if not captured and group.h2d_done is not None and group.alloc_stream is not None:
            if any(rec.dev is not None and rec.reload_group is group for rec in group.all_records()):
                group.alloc_stream.wait_event(group.h2d_done)

    # ------------------------------------------------------------------ waits
    def wait(self, stream: Any, event: Any, kind: str, name: str, part: str | None = None) -> None:
        """``stream`` waits on ``event`` on the GPU; with timing, measure how long it stood (in
        field ``kind``, and in ``part`` too: a share of ``kind`` counted on its own)."""
        if self.stats.timing and not self.streams.is_capturing():
            before = self.streams.event(timing=True)
            after = self.streams.event(timing=True)
            before.record(stream)
            stream.wait_event(event)
            after.record(stream)
            self.stats.time(kind, name, before, after, stream)
            if part is not None:
                self.stats.time(part, name, before, after)
        else:
            stream.wait_event(event)

    def _timing_start(self, stream: Any, timing: bool) -> Any:
        if not timing:
            return None
        start = self.streams.event(timing=True)
        start.record(stream)
        return start
