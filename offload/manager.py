"""`PipelineOffloadManager`: the process-wide owner of the offloading engine.

It owns the copy streams, the pinned host pool, the tensor policy, the deque of
`ChunkOffloadHandler`s in backward order, the statistics, and the two saved-tensor hooks.
Frameworks talk to it through a handful of entry points: `begin_chunk`, `set_schedule`,
`end_iteration`, `reset` (and the region API in `offload.regions`, which calls
`open_group`/`close_group`).

Pipeline schedules. Each (chunk, microbatch) forward gets a handler; the deque keeps them in
the order their backwards will run: the schedule's own order when the framework handed it
over (`set_schedule`), otherwise Megatron's rule for interleaved 1F1B, *reverse virtual
stage, forward microbatch* within each group of microbatches (the group size is learned from
the forwards: how many microbatches chunk 0 runs before chunk 1 starts). After a chunk's
backward the engine prefetches the last groups of the chunk whose backward runs next, so a
chunk's reloads overlap the next chunk's forward and its offloads.

The forward's end. A chunk's group is offloaded when the next group of its name closes, so
when the last one closes the one before it has only just been launched; left in flight, it
would hold its memory through the forward's end and the start of backward, where the step's
memory peaks. The engine learns from a chunk's previous forward which group is the last of
each name; at its close, the compute stream waits for every copy in flight (each started on
the GPU when its own group ended, a group of that name earlier) and their memory is freed.

The four synchronization rules (all with events; the host never waits):

1. a group's D2H copies start after the module's forward produced the tensors: the D2H
   stream waits on an event recorded on the compute stream when the group closed;
2. a reload starts after the backward that precedes it freed its memory: the H2D stream
   waits on the compute stream when the reload is issued (after a group's backward);
3. a reload starts after the matching offload finished: the H2D stream waits on the D2H
   event of every record it reads;
4. a module's backward starts after its tensors are back: the unpack hook makes the current
   stream wait on the reload event before returning the tensor.

And: a GPU tensor that was copied out is dropped only when its D2H copy is known to be done
(an event query) or after the compute stream was made to wait for it; no ``record_stream``.
"""

from __future__ import annotations

import bisect
import warnings
from collections import defaultdict, deque
from typing import Any, Iterable, Sequence

import torch

from . import nvtx
from .chunk_handler import ChunkOffloadHandler, HandlerPhase
from .config import OffloadConfig, check_known
from .errors import OffloadError
from .group import GroupState, KeptTensor, OffloadGroup, SavedHandle
from .group_policy import GroupInfo
from .pinned_pool import PinnedHostPool
from .policy import TensorPolicy
from .quantized import pack_quantized, splittable
from .schedules import ForwardStep, SchedulePlan
from .stats import GroupStats, IterationStats
from .streams import make_streams


class PipelineOffloadManager:
    """The offloading engine. Use `get()` for the process-wide instance."""

    _instance: "PipelineOffloadManager | None" = None

    @classmethod
    def get(cls) -> "PipelineOffloadManager":
        """The process-wide manager, created with an empty config on first use."""
        if cls._instance is None:
            cls._instance = cls(OffloadConfig())
        return cls._instance

    @classmethod
    def configure(cls, config: OffloadConfig, device: torch.device | str | None = None) -> "PipelineOffloadManager":
        """Install a new process-wide manager with ``config`` (the old one is reset first)."""
        if cls._instance is not None:
            cls._instance.reset(release_pool=True)
        cls._instance = cls(config, device)
        return cls._instance

    def __init__(self, config: OffloadConfig, device: torch.device | str | None = None) -> None:
        self.config = config
        self.streams = make_streams(device)
        self.device = self.streams.device
        self.pool = PinnedHostPool(pin=self.streams.is_cuda, max_bytes=config.max_pinned_bytes)
        self.policy = TensorPolicy(self.streams.owns, config.min_tensor_bytes)
        self._timing = config.timing and self.streams.is_cuda
        self._enabled = config.enabled
        self._policy = config.policy
        if not self.streams.is_cuda and config.enabled:
            warnings.warn(
                "offload: no CUDA device; the CPU fallback runs the engine with host copies "
                "in place of device copies and saves no memory (said once).",
                RuntimeWarning,
                stacklevel=3,
            )
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._handlers: deque[ChunkOffloadHandler] = deque()
        self._forward: ChunkOffloadHandler | None = None
        self._open: list[OffloadGroup] = []
        self._names_open: list[str] = []
        self._inflight: deque[OffloadGroup] = deque()
        self._retire_candidates: list[ChunkOffloadHandler] = []
        self._suppress = 0
        self._plan: SchedulePlan | None = None
        self._num_chunks = 0
        self.declared_names: set[str] = set()
        self._names_checked = False
        self.iteration = 0
        self.hook_calls = 0  # saved-tensor hook calls, ever (a graph replay makes none)
        self._capture: Any = None  # the capture session in progress (`_sync_capture`)
        self._capture_reloads: list[Any] = []  # h2d_done events recorded in that capture
        self._graveyard: list[OffloadGroup] = []  # retired during a capture: events die after it
        self._graph_handlers: list[ChunkOffloadHandler] = []  # captured: owned by their graphs
        self._region_plans: dict[Any, list[tuple[str, tuple[int, ...]]]] = {}
        self._last_layers: dict[tuple[int, str], int] = {}  # (chunk, name) -> its last group's layer
        self._regions: list[tuple[Any, list[tuple[str, tuple[int, ...]]]]] = []
        self._new_iteration_state()
        self._new_iteration_stats()

    # ------------------------------------------------------------------ framework entry points
    def begin_chunk(self, chunk_id: int = 0, microbatch: int | None = None) -> None:
        """Say that the forward of model chunk ``chunk_id`` for a new microbatch begins.

        Pipeline schedules call this before each chunk forward (`offload.attach` does it from
        the root module's forward pre-hook). ``microbatch`` defaults to the chunk's count of
        forwards in this iteration. Under ``no_grad`` it does nothing. With a schedule given
        (`set_schedule`), a chunk that is not the schedule's next forward raises `OffloadError`.
        """
        if not torch.is_grad_enabled():
            return
        if self._open:
            raise OffloadError(
                f"offload: begin_chunk() called inside the open group {self._open[-1].label!r}"
            )
        self._sync_capture()
        self._process_retired()
        if self._forward is not None:
            self._finish_forward(self._forward)
        self._forward = self._start_chunk(chunk_id, microbatch)

    def set_schedule(self, order: Sequence[int] | None) -> None:
        """Hand over the rank's schedule: Megatron's ``order`` of signed chunk ids (``+c``
        forward of chunk ``c - 1``, ``-c`` its backward; see `offload.schedules`), or ``None``.

        It holds for every following iteration until replaced. With it the engine knows, not
        guesses, which chunk's backward runs next (so every cross-chunk reload is prefetched),
        gives policies each forward's phase and the rank's peak of live microbatches, and
        checks that the chunk forwards that run are the ones the order says (`OffloadError`
        otherwise). Iterations under ``no_grad`` (evaluation) are not counted. Without it the
        engine infers the backward order from the forwards (see the module docstring).
        """
        if self._forward_index:
            raise OffloadError(
                f"offload: set_schedule() called after {self._forward_index} chunk forward(s) of "
                "this iteration; call it before the iteration's first forward"
            )
        self._plan = None if order is None else SchedulePlan(order)

    def end_iteration(self, check_names: bool = True) -> IterationStats:
        """Close the iteration: finish pending work, retire handlers whose graphs are gone,
        check the configured names, and return this iteration's statistics.

        With ``timing=True`` this waits for the iteration's timing events (a host sync at the
        iteration boundary, where training loops usually sync anyway).
        """
        if self._open:
            raise OffloadError(
                f"offload: end_iteration() called inside the open group {self._open[-1].label!r}"
            )
        if self._forward is not None:
            self._finish_forward(self._forward)
            self._forward = None
        self._process_retired()
        ran, plan = self._forward_index, self._plan
        stats = self._collect_stats()
        self.iteration += 1
        self._new_iteration_state()
        self._new_iteration_stats()
        if plan is not None and ran not in (0, len(plan)):
            raise OffloadError(
                f"offload: the iteration ran {ran} chunk forwards, but the schedule given to "
                f"set_schedule() has {len(plan)}; pass each iteration's order (or None)"
            )
        if check_names:
            self._check_names()
        return stats

    def reset(self, release_pool: bool = False) -> None:
        """Forget every handler and group (their saved tensors can no longer be unpacked).

        Use after an aborted step if graphs that hold offloaded tensors are being dropped.
        ``release_pool=True`` also unpins and frees the host pool.
        """
        if self.streams.is_cuda and (self._inflight or self._handlers):
            self.streams.current().wait_stream(self.streams.d2h)
            self.streams.current().wait_stream(self.streams.h2d)
        for handler in list(self._handlers):
            self._retire(handler)
        self._handlers.clear()
        if release_pool:
            self.release_graphs()
        self._capture = None
        self._capture_reloads.clear()
        self._regions.clear()
        self._inflight.clear()
        self._retire_candidates.clear()
        self._forward = None
        self._open.clear()
        self._names_open.clear()
        self._suppress = 0
        self._last_layers.clear()
        self._new_iteration_state()
        if release_pool:
            if self.streams.is_cuda:
                torch.cuda.synchronize(self.device)
            self.pool.close()
        self._new_iteration_stats()

    def declare_names(self, names: Iterable[str]) -> None:
        """Tell the manager which group names the model has (integrations do this), so that a
        configured name the model lacks is reported with the list of valid ones."""
        self.declared_names.update(names)

    # ------------------------------------------------------------------ group boundaries
    def open_group(self, name: str) -> OffloadGroup | None:
        """Start the group ``name``; returns ``None`` when it does not offload: the name is
        not enabled, no autograd graph is being recorded, a recompute runs inside backward,
        the group is inside a ``torch.utils.checkpoint`` region (whose tensors are recomputed,
        not saved), or the group policy declines it."""
        if name in self._names_open:
            raise OffloadError(
                f"offload: group {name!r} opened inside a group of the same name; "
                "give nested regions different names"
            )
        self._names_open.append(name)
        self.declared_names.add(name)
        if name not in self._enabled or not torch.is_grad_enabled():
            return None
        if torch.compiler.is_compiling():
            raise OffloadError(
                f"offload: group {name!r} runs inside torch.compile, which is not supported: "
                "saved-tensor hooks are disabled while compiling and its CUDA graphs "
                "(mode='reduce-overhead') cannot hold our copies. Compile the modules between "
                "offloaded groups, or use offload.graphs for CUDA graphs."
            )
        if torch._C._current_graph_task_id() != -1:
            return None  # a recompute inside backward: what it saves is needed right away
        if _inside_checkpoint():
            self._stats[name].groups_recomputed += 1
            return None
        token = self._sync_capture()
        if token is None:
            self._process_retired()
        handler = self._forward
        if handler is None:
            handler = self._forward = self._start_chunk(0, None)
        elif handler.phase is not HandlerPhase.FORWARD:
            raise AssertionError(f"forward handler in phase {handler.phase.name}")
        layer = handler.next_layer(name)
        if self._policy is not None and not self._policy(self._group_info(handler, name, layer)):
            self._stats[name].groups_declined += 1
            return None
        self._poll_inflight()
        while len(self._inflight) > self.config.max_inflight_groups:
            self._release(self._inflight.popleft(), wait=True)
        if self._regions:
            handler.graphable = True
        group = handler.new_group(name, layer)
        group.stream = self.streams.current()
        group.capture = token
        self._open.append(group)
        self._hooks.__enter__()
        return group

    def close_group(self, group: OffloadGroup | None, name: str) -> None:
        """End the group opened by `open_group` (``group`` may be ``None``)."""
        if not self._names_open or self._names_open[-1] != name:
            raise OffloadError(f"offload: group {name!r} closed out of order (open: {self._names_open})")
        self._names_open.pop()
        if group is None:
            return
        if not self._open or self._open[-1] is not group:
            raise OffloadError(f"offload: group {group.label!r} closed out of order")
        self._hooks.__exit__(None, None, None)
        self._open.pop()
        group.ready = self.streams.event()
        group.ready.record(group.stream)
        self._stats[name].groups += 1
        if self._regions:
            self._plan_step(group)
        previous = group.handler.close_group(group)
        if previous is not None:
            self._launch(previous)
        if group.capture is None and self._last_layers.get((group.handler.chunk_id, name)) == group.layer:
            self._release_inflight()  # the chunk's last group of this name: see the module docstring
        self._poll_inflight()

    def on_group_backward_done(self, group: OffloadGroup) -> None:
        """Called after a group's backward finished (its start marker's backward ran):
        reload the group that backward needs one layer later (same name)."""
        handler = group.handler
        if handler.phase is not HandlerPhase.BACKWARD:
            self._begin_backward(handler)
        target = group.prev_same
        if target is None:
            nxt = self._backward_successor(handler)
            if nxt is not None and nxt.phase is HandlerPhase.FORWARD_DONE:
                target = nxt.last_of_name.get(group.name)
        if (
            target is not None
            and target.capture is group.capture  # a reload may not cross a graph's edge
            and target.state is GroupState.OFFLOADED
            and target.needs_reload()
        ):
            self._sync_capture()
            self._reload(target, prefetch=True)
        self._poll_inflight()

    # ------------------------------------------------------------------ saved-tensor hooks
    def _pack(self, t: torch.Tensor) -> Any:
        self.hook_calls += 1
        group = self._open[-1]
        if type(t) is not torch.Tensor and not self._suppress and splittable(t):
            handle = pack_quantized(t, self._pack, self._unpack)  # offload/quantized.py
            if handle is not None:
                return handle
        if self._suppress or not self.policy.eligible(t):
            return KeptTensor(t, group.label)
        storage = t.untyped_storage()
        if t.is_contiguous():
            start, numel = t.storage_offset(), t.numel()
        else:
            start = t.storage_offset()
            numel = 1
            for size, stride in zip(t.size(), t.stride()):
                numel += (size - 1) * stride
        storage_numel = storage.nbytes() // t.element_size()
        if 2 * numel >= storage_numel:
            start, numel = 0, max(storage_numel, start + numel)
        handler = group.handler
        rec = handler.find_or_add_record(group, t, storage.data_ptr(), start, numel)
        rec.handles += 1
        rec.alive += 1
        handler.alive += 1
        return SavedHandle(rec, group, t)

    def _unpack(self, h: Any) -> torch.Tensor:
        self.hook_calls += 1
        if type(h) is not SavedHandle:
            return h.unpack()
        rec = h.record
        group = h.group
        if group.handler.phase is not HandlerPhase.BACKWARD:
            self._sync_capture()
            self._begin_backward(group.handler)
        rec.check_version(group.label)
        src = rec.src
        if src is not None:
            return src.as_strided(h.size, h.stride, h.offset)
        if rec.dev is None:
            if rec.host is None:
                raise OffloadError(
                    f"offload: a saved tensor of group {group.label!r} is neither on the GPU nor on "
                    "the host; the manager was reset while the graph that saved it was alive"
                )
            self._sync_capture()
            self._reload(group, prefetch=False)
        loader = rec.reload_group
        sid = self.streams.current_id()
        if sid not in loader.waited:
            loader.waited.add(sid)
            self._wait(self.streams.current(), loader.h2d_done, "reload_wait_ms", loader.name)
        out = rec.dev.as_strided(h.size, h.stride, h.offset - rec.start)
        rec.unpacked += 1
        if rec.unpacked >= rec.handles:
            rec.dev = None  # autograd holds `out`; a second backward reloads from the host
        return out

    # ------------------------------------------------------------------ internals
    def _new_iteration_state(self) -> None:
        """Forget what the current iteration's schedule looked like (not its handlers)."""
        self._microbatches: dict[int, int] = defaultdict(int)
        self._by_key: dict[tuple[int, int], ChunkOffloadHandler] = {}
        self._forward_index = 0
        self._group_size: int | None = None
        self._max_table_key: tuple[int, int, int] | None = None
        self._live = 0
        self._backward_started = False

    def _start_chunk(self, chunk_id: int, microbatch: int | None) -> ChunkOffloadHandler:
        """A new chunk forward: check it against the schedule, make and queue its handler.
        Under capture the handler is the graph's own: no schedule bookkeeping (a graph is
        captured once and replayed in many iterations)."""
        if self._capture is not None:
            handler = ChunkOffloadHandler(self, chunk_id, microbatch or 0, self.iteration, "captured", 1,
                                          (self.iteration, -1))
            handler.capture = self._capture
            self._handlers.append(handler)
            self._stats_handlers += 1
            return handler
        step: ForwardStep | None = None
        plan = self._plan
        if plan is not None:
            i = self._forward_index
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
        self._forward_index += 1
        if chunk_id > 0 and self._group_size is None and self._microbatches.get(0):
            self._group_size = self._microbatches[0]
        self._num_chunks = max(self._num_chunks, chunk_id + 1)
        table_key = self._table_key(chunk_id, microbatch)
        if self._max_table_key is None or table_key > self._max_table_key:
            self._max_table_key = table_key
        self._live += 1
        if plan is not None:
            sort_key: tuple = (self.iteration, plan.backward_index[(chunk_id, microbatch)])
        else:
            group = 0 if self._group_size is None else microbatch // self._group_size
            sort_key = (self.iteration, group, -chunk_id, microbatch)
        handler = ChunkOffloadHandler(
            self, chunk_id, microbatch, self.iteration,
            step.phase if step else ("steady" if self._backward_started else "warmup"),
            step.live if step else self._live,
            sort_key,
        )
        bisect.insort(self._handlers, handler, key=_sort_key)
        self._by_key[(chunk_id, microbatch)] = handler
        self._stats_handlers += 1
        return handler

    def _table_key(self, chunk_id: int, microbatch: int) -> tuple[int, int, int]:
        """Where a forward sits in the schedule table: groups of microbatches, chunk by chunk."""
        group = 0 if self._group_size is None else microbatch // self._group_size
        return (group, chunk_id, microbatch)

    def _backward_successor(self, handler: ChunkOffloadHandler) -> ChunkOffloadHandler | None:
        """The handler whose backward runs right after ``handler``'s, if it is known and exists.

        With a schedule this is a lookup. Without one, step through the backward order of
        the interleaved schedule (this group's chunks from the last to the first, each over
        the group's microbatches in order; then the next group) and take the first handler
        that exists; a candidate that does not exist is skipped only when a forward later in
        the schedule table already ran (so it never will), else the answer is unknown.
        """
        if handler.iteration != self.iteration:
            return None
        if self._plan is not None:
            key = self._plan.successor(handler.chunk_id, handler.microbatch)
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

    def _group_info(self, handler: ChunkOffloadHandler, name: str, layer: int) -> GroupInfo:
        return GroupInfo(
            name=name,
            layer=layer,
            chunk_id=handler.chunk_id,
            microbatch=handler.microbatch,
            phase=handler.schedule_phase,  # type: ignore[arg-type]
            live=handler.live,
            max_live=self._plan.max_live if self._plan is not None else None,
            iteration=handler.iteration,
        )

    def _finish_forward(self, handler: ChunkOffloadHandler) -> None:
        """Something other than this chunk's own backward follows its forward: offload the
        groups it kept pending. Their copies just started, so the compute stream does not wait
        for them here; the in-flight bound applies to them when the next group opens."""
        if handler.phase is HandlerPhase.FORWARD:
            self._learn_last_layers(handler)
            handler.phase = HandlerPhase.FORWARD_DONE
            pending = list(handler.pending.values())
            handler.pending.clear()
            for group in pending:
                self._launch(group, bound=False)
        if self._forward is handler:
            self._forward = None

    def _begin_backward(self, handler: ChunkOffloadHandler) -> None:
        """The first backward activity of ``handler``. If its forward was the last thing that
        ran, its pending groups (the last group of each name) stay on the GPU. The copies in
        flight, started during the last forward, are waited for (on the GPU) so the backward
        starts with that memory freed; then any other handler still in forward is finished,
        and its last groups copy out while this backward runs."""
        self._release_inflight()
        if handler.phase is HandlerPhase.FORWARD and handler.graphable:
            self._finish_forward(handler)  # planned as it will be captured: nothing kept
        elif handler.phase is HandlerPhase.FORWARD:
            self._learn_last_layers(handler)
            for group in handler.pending.values():
                group.state = GroupState.KEPT
                self._stats[group.name].groups_kept += 1
            handler.pending.clear()
            if self._forward is handler:
                self._forward = None
        elif self._forward is not None:
            self._finish_forward(self._forward)
        handler.phase = HandlerPhase.BACKWARD
        if handler.iteration == self.iteration:
            self._live -= 1
            self._backward_started = True

    def _learn_last_layers(self, handler: ChunkOffloadHandler) -> None:
        """Remember which group was the last of each name in this chunk's forward; the next
        forward of the chunk releases the copies in flight when that group closes."""
        for name, group in handler.last_of_name.items():
            self._last_layers[handler.chunk_id, name] = group.layer

    def _launch(self, group: OffloadGroup, bound: bool = True) -> None:
        timing = self._timing and group.capture is None  # a captured event cannot be timed
        nvtx.push("offload/" + group.label)
        nbytes, shared = group.launch_offload(self.streams, self.pool, timing, self.config.copy_chunk_bytes)
        nvtx.pop()
        stats = self._stats[group.name]
        stats.bytes_held_elsewhere += shared
        if nbytes == 0:
            group.state = GroupState.OFFLOADED
            return
        stats.groups_offloaded += 1
        stats.bytes_offloaded += nbytes
        stats.tensors_offloaded += sum(1 for r in group.records if r.host is not None)
        if timing:
            self._pending_timings.append(("d2h_ms", group.name, group.d2h_timing, group.d2h_done))
        self._inflight.append(group)
        if len(self._inflight) > self._stats_max_inflight:
            self._stats_max_inflight = len(self._inflight)
        while bound and len(self._inflight) > self.config.max_inflight_groups:
            self._release(self._inflight.popleft(), wait=True)

    def _poll_inflight(self) -> None:
        """Free the GPU memory of groups whose copies are done; never blocks."""
        if self.streams.is_capturing():
            return
        inflight = self._inflight
        while inflight and inflight[0].d2h_done.query():
            self._release(inflight.popleft(), wait=False)

    def _release_inflight(self) -> None:
        """Free every group in flight; the compute stream waits for their copies on the GPU."""
        while self._inflight:
            self._release(self._inflight.popleft(), wait=True)

    def _release(self, group: OffloadGroup, wait: bool) -> None:
        if wait:
            self._wait(group.stream, group.d2h_done, "offload_wait_ms", group.name)
        group.release()

    def _reload(self, group: OffloadGroup, prefetch: bool) -> None:
        capture = self._capture
        timing = self._timing and capture is None
        nvtx.push("reload/" + group.label)
        nbytes = group.launch_reload(self.streams, timing, self.config.copy_chunk_bytes, capture)
        nvtx.pop()
        if capture is not None and group.h2d_done is not None:
            self._capture_reloads.append(group.h2d_done)
        if nbytes:
            stats = self._stats[group.name]
            stats.bytes_reloaded += nbytes
            if prefetch:
                stats.reloads_prefetched += 1
            else:
                stats.reloads_on_demand += 1
            if timing:
                self._pending_timings.append(("h2d_ms", group.name, group.h2d_timing, group.h2d_done))

    def _wait(self, stream: Any, event: Any, kind: str, name: str) -> None:
        """``stream`` waits on ``event`` on the GPU; with timing, measure how long it stood."""
        if self._timing and not self.streams.is_capturing():
            before = self.streams.event(timing=True)
            after = self.streams.event(timing=True)
            before.record(stream)
            stream.wait_event(event)
            after.record(stream)
            self._pending_timings.append((kind, name, before, after))
        else:
            stream.wait_event(event)

    def _process_retired(self) -> None:
        """Retire handlers whose saved tensors were all freed by autograd. Runs only at safe
        points (never from a handle's ``__del__``), and never on the chunk still in forward."""
        if not self._retire_candidates or self._capture is not None:
            return
        candidates, self._retire_candidates = self._retire_candidates, []
        for handler in candidates:
            if handler.alive != 0 or handler.phase is HandlerPhase.RETIRED or handler.capture is not None:
                continue  # a captured handler's buffers belong to its graphs (`release_graphs`)
            if handler is self._forward:
                self._retire_candidates.append(handler)  # retire once its forward is over
            else:
                self._retire(handler)

    def _retire(self, handler: ChunkOffloadHandler) -> None:
        """Give back everything ``handler`` holds, with the waits that make that safe (none
        for captured groups: their graphs order their copies, and their events cannot be used
        outside the capture)."""
        for group in handler.groups:
            captured = group.capture is not None
            if group.state is GroupState.OFFLOADING:
                if group in self._inflight:
                    self._inflight.remove(group)
                if not captured:
                    group.stream.wait_event(group.d2h_done)
                group.release()
            if not captured and group.h2d_done is not None and group.alloc_stream is not None:
                if any(rec.dev is not None and rec.reload_group is group for rec in group.records + group.borrowed):
                    group.alloc_stream.wait_event(group.h2d_done)
            for rec in group.records:
                rec.dev = None
                rec.src = None
                if rec.host is not None:
                    self.pool.release(rec.host, rec.last_read)
                    rec.host = None
            group.ready = None
        handler.clear()
        try:
            self._handlers.remove(handler)
        except ValueError:
            pass
        key = (handler.chunk_id, handler.microbatch)
        if self._by_key.get(key) is handler:
            del self._by_key[key]

    def _check_names(self) -> None:
        if self._names_checked or not self.config.modules:
            return
        if not self.declared_names:
            return
        self._names_checked = True
        check_known(
            self.config.modules, self.declared_names,
            "the offload config (no attached module and no group of that name ran this iteration)",
        )

    # ------------------------------------------------------------------ CUDA graphs
    def _sync_capture(self) -> Any:
        """The capture session the current call belongs to (``None`` when not capturing).

        A session is one captured body: it starts at the first call seen while the stream
        captures (or at a region's start under capture) and ends at a region's end, at
        `join_capture`, or at the first call seen outside a capture. Consecutive backward
        captures without a region or join share a session; that is harmless, since backward
        only reloads, and reloads never cross a forward capture's edge (see `_reload`)."""
        if not self.streams.is_capturing():
            if self._capture is not None:
                self._switch_capture(None)
            if self._graveyard:
                self._graveyard.clear()
            return None
        if self._capture is None:
            self._switch_capture(_CaptureSession())
        return self._capture

    def _switch_capture(self, token: Any) -> None:
        """End the capture session in progress, if any, and start ``token`` (a new session,
        or ``None`` outside a capture).

        Leaving a capture: its offload copies must all have been joined into it (the region's
        end does it; see `join_capture`), else CUDA has refused to end the capture and this
        says why. Its handlers now belong to the graphs: kept out of the deque, never retired
        into the pool. Entering one: the eager forward's groups still waiting for a decision
        stay on the GPU (a copy of them launched inside the capture would wait on an event
        recorded before it, which invalidates the capture); the eager copies in flight are
        released without a wait, since a capture begins after a synchronize (PyTorch requires
        it after warm-up, and `offload.graphs` does it).
        """
        old = self._capture
        if old is not None:
            unjoined = [g.label for g in self._inflight if g.capture is old]
            self._inflight = deque(g for g in self._inflight if g.capture is not old)
            self._capture_reloads.clear()
            if self._forward is not None and self._forward.capture is old:
                unjoined += [g.label for g in self._forward.pending.values()]
                for group in self._forward.pending.values():
                    group.state = GroupState.KEPT  # never copied by the graph: stays on the GPU
                self._forward.pending.clear()
                self._forward.phase = HandlerPhase.FORWARD_DONE
                self._forward = None
            for handler in [h for h in self._handlers if h.capture is old]:
                self._handlers.remove(handler)
                self._graph_handlers.append(handler)
            self._capture = None
            if unjoined:
                raise OffloadError(
                    f"offload: a CUDA graph capture ended with the offload copies of {unjoined} not "
                    "joined into it (started ones make CUDA fail the capture as 'unjoined'; the "
                    "others were never copied by the graph). Capture through offload.graphs.graph "
                    "/ make_graphed_callables, or call offload.graphs.join() as the last step "
                    "inside the captured region."
                )
        if token is not None:
            # Handlers whose backward is over give their buffers back now: the capture wants
            # them, and a graph API's own warm-up leaves its last handlers unretired. Only those
            # that hold no device memory (freeing memory inside a capture is not allowed), and
            # their groups (with their CUDA events) are kept until the capture is over: an event
            # destroyed while a capture runs invalidates it.
            for handler in self._retire_candidates:
                if handler.alive == 0 and handler.capture is None and handler is not self._forward \
                        and _holds_no_device_memory(handler):
                    self._graveyard.extend(handler.groups)
                    self._retire(handler)
            self._retire_candidates = [h for h in self._retire_candidates if h.phase is not HandlerPhase.RETIRED]
            while self._inflight:
                self._inflight.popleft().release()
            if self._forward is not None:
                for group in self._forward.pending.values():
                    group.state = GroupState.KEPT
                    self._stats[group.name].groups_kept += 1
                self._forward.pending.clear()
                self._forward.phase = HandlerPhase.FORWARD_DONE
                self._forward = None
        self._capture = token

    def join_capture(self) -> None:
        """Join every copy this capture forked back into the current stream: the offloads in
        flight (then their GPU memory is released, inside the graph's pool) and the reloads
        not yet waited for. Must run inside the capture, after its last offloaded group;
        outside a capture it does nothing."""
        if self._sync_capture() is None:
            return
        forward = self._forward
        if forward is not None and forward.capture is self._capture:
            # Its last groups too: nothing may wait for a decision past the graph's end.
            self._finish_forward(forward)
        current = self.streams.current()
        self._release_inflight()
        for event in self._capture_reloads:
            current.wait_event(event)
        self._capture_reloads.clear()
        self._switch_capture(None)  # the session ends; the capture may go on (a new session)

    def enter_region(self, key: Any) -> None:
        """A graphable region begins (`offload.graphs.region`): eagerly, record the groups it
        offloads as its plan; under capture, check them against that plan."""
        capturing = self.streams.is_capturing()
        if capturing and key not in self._region_plans:
            raise OffloadError(
                f"offload: graph region {key!r} is being captured but never ran eagerly: run it "
                "once (same shapes) before capturing, so its plan and pinned buffers exist"
            )
        if capturing:  # a region under capture is a whole captured body: its own session
            if self._capture is not None:
                self._switch_capture(None)
            self._switch_capture(_CaptureSession())
        self._regions.append((key, []))

    def exit_region(self, key: Any) -> None:
        """The region ends: under capture, join its copies and check it ran its whole plan;
        eagerly, its groups become its plan."""
        if not self._regions or self._regions[-1][0] != key:
            raise OffloadError(f"offload: graph region {key!r} closed out of order")
        _, steps = self._regions.pop()
        if self.streams.is_capturing():
            self.join_capture()
            plan = self._region_plans[key]
            if len(steps) != len(plan):
                raise OffloadError(
                    f"offload: graph region {key!r} offloaded {len(steps)} group(s) under capture, "
                    f"but {len(plan)} in its eager warm-up: the group structure changed after the "
                    "plan was frozen"
                )
        else:
            self._region_plans[key] = steps

    def _plan_step(self, group: OffloadGroup) -> None:
        """Note ``group`` in the innermost region: its plan, or the check against it."""
        key, steps = self._regions[-1]
        step = (group.name, tuple(rec.nbytes for rec in group.records))
        if group.capture is not None:
            plan = self._region_plans[key]
            i = len(steps)
            expected = plan[i] if i < len(plan) else None
            if step != expected:
                raise OffloadError(
                    f"offload: graph region {key!r}, group {i} under capture is {step[0]!r} saving "
                    f"{list(step[1])} bytes, but the eager warm-up had "
                    f"{'nothing more' if expected is None else repr(expected[0]) + ' saving ' + str(list(expected[1]))}"
                    " bytes: a shape or the group structure changed after the plan was frozen"
                )
        steps.append(step)

    def finish_forward(self) -> None:
        """The forward in progress is over and something other than its own backward follows:
        offload its last groups now (the last-layer rule keeps them only when the backward
        follows at once). `offload.graphs.make_graphed_callables` uses it so that its eager
        pass sizes the pinned pool for captures, which keep nothing."""
        if self._forward is not None:
            self._finish_forward(self._forward)

    @property
    def captured_groups(self) -> list[OffloadGroup]:
        """The groups captured into CUDA graphs, in capture order; each replay of a forward
        graph writes its records' pinned buffers (``rec.host``), its backward graph reads them."""
        return [g for h in self._graph_handlers for g in h.groups]

    def release_graphs(self) -> None:
        """Give the captured graphs' pinned buffers back to the pool and forget their groups.
        Only once those graphs will never replay again."""
        for handler in self._graph_handlers:
            for group in handler.groups:
                for rec in group.records:
                    if rec.host is not None:
                        self.pool.release(rec.host)
                    rec.host = rec.src = rec.dev = None
            handler.clear()
        self._graph_handlers.clear()

    # ------------------------------------------------------------------ statistics
    def _new_iteration_stats(self) -> None:
        self._stats: dict[str, GroupStats] = defaultdict(GroupStats)
        self._pending_timings: list[tuple[str, str, Any, Any]] = []
        self._stats_max_inflight = 0
        self._stats_handlers = 0

    def _collect_stats(self) -> IterationStats:
        for kind, name, start, end in self._pending_timings:
            end.synchronize()
            setattr(self._stats[name], kind, getattr(self._stats[name], kind) + start.elapsed_time(end))
        pool = self.pool
        return IterationStats(
            iteration=self.iteration,
            by_name=dict(self._stats),
            pinned_bytes=pool.bytes_total,
            pinned_buffers=pool.num_buffers,
            pinned_peak_bytes_in_use=pool.peak_bytes_in_use,
            pinned_allocations=pool.allocations,
            pinned_alloc_ms=pool.alloc_seconds * 1e3,
            pinned_failures=pool.failures,
            max_inflight_groups=self._stats_max_inflight,
            handlers=self._stats_handlers,
        )

    # ------------------------------------------------------------------ introspection
    @property
    def schedule(self) -> SchedulePlan | None:
        """The schedule given to `set_schedule`, digested (``None`` if none)."""
        return self._plan

    @property
    def live_handlers(self) -> list[ChunkOffloadHandler]:
        """Handlers not yet retired (their saved tensors are still referenced by autograd),
        in the order their backwards run."""
        self._process_retired()
        return list(self._handlers)

    @property
    def in_group(self) -> bool:
        """Whether a group (enabled or not) is open on this manager."""
        return bool(self._names_open)


def _holds_no_device_memory(handler: ChunkOffloadHandler) -> bool:
    """Whether retiring ``handler`` would free no GPU memory and wait on no event."""
    return all(
        group.state is not GroupState.OFFLOADING
        and all(rec.src is None and rec.dev is None for rec in (*group.records, *group.borrowed))
        for group in handler.groups
    )


class _CaptureSession:
    """One captured body (see `PipelineOffloadManager._sync_capture`): what groups and events
    recorded in it are tagged with."""

    __slots__ = ()


def _sort_key(handler: ChunkOffloadHandler) -> tuple:
    return handler.sort_key


def _inside_checkpoint() -> bool:
    """Whether the innermost saved-tensor hooks are those of a non-reentrant
    `torch.utils.checkpoint` forward, which drops what is saved and recomputes it (a reentrant
    checkpoint's forward runs under ``no_grad`` and needs no check)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None:
        return False
    pack = top[0]
    return getattr(pack, "__module__", None) == "torch.utils.checkpoint" and getattr(
        pack, "__qualname__", ""
    ).startswith("_checkpoint_hook.")
