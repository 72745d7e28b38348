"""`PipelineOffloadManager`: the process-wide owner of the offloading engine.

It owns the copy streams, the pinned host pool, the tensor policy, the deque of
`ChunkOffloadHandler`s in backward order, the statistics, and the two saved-tensor hooks.
Frameworks talk to it through a handful of entry points: `begin_chunk`, `end_iteration`,
`reset` (and the region API in `offload.regions`, which calls `open_group`/`close_group`).

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

import warnings
from collections import defaultdict, deque
from typing import Any, Iterable

import torch

from . import nvtx
from .chunk_handler import ChunkOffloadHandler, HandlerPhase
from .config import OffloadConfig, check_known
from .errors import OffloadError
from .group import GroupState, KeptTensor, OffloadGroup, SavedHandle
from .pinned_pool import PinnedHostPool
from .policy import TensorPolicy
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
        self._microbatches: dict[int, int] = defaultdict(int)
        self.declared_names: set[str] = set()
        self._names_checked = False
        self.iteration = 0
        self._new_iteration_stats()

    # ------------------------------------------------------------------ framework entry points
    def begin_chunk(self, chunk_id: int = 0, microbatch: int | None = None) -> None:
        """Say that the forward of model chunk ``chunk_id`` for a new microbatch begins.

        Pipeline schedules call this before each chunk forward (`offload.attach` does it from
        the root module's forward pre-hook). Under ``no_grad`` it does nothing.
        """
        if not torch.is_grad_enabled():
            return
        if self._open:
            raise OffloadError(
                f"offload: begin_chunk() called inside the open group {self._open[-1].label!r}"
            )
        self._process_retired()
        if self._forward is not None:
            self._finish_forward(self._forward)
        self._forward = self._new_handler(chunk_id, microbatch)

    def end_iteration(self) -> IterationStats:
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
        self._check_names()
        stats = self._collect_stats()
        self._microbatches.clear()
        self.iteration += 1
        self._new_iteration_stats()
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
        self._inflight.clear()
        self._retire_candidates.clear()
        self._forward = None
        self._open.clear()
        self._names_open.clear()
        self._suppress = 0
        self._microbatches.clear()
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
        """Start the group ``name``; returns ``None`` when it does not offload (name not
        enabled, no autograd graph is being recorded, or a recompute runs inside backward)."""
        if name in self._names_open:
            raise OffloadError(
                f"offload: group {name!r} opened inside a group of the same name; "
                "give nested regions different names"
            )
        self._names_open.append(name)
        self.declared_names.add(name)
        if name not in self._enabled or not torch.is_grad_enabled():
            return None
        if torch._C._current_graph_task_id() != -1:
            return None  # a recompute inside backward: what it saves is needed right away
        self._process_retired()
        handler = self._forward
        if handler is None:
            handler = self._forward = self._new_handler(0, None)
        elif handler.phase is not HandlerPhase.FORWARD:
            raise AssertionError(f"forward handler in phase {handler.phase.name}")
        group = handler.new_group(name)
        group.stream = self.streams.current()
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
        previous = group.handler.close_group(group)
        if previous is not None:
            self._launch(previous)
        self._poll_inflight()

    def on_group_backward_done(self, group: OffloadGroup) -> None:
        """Called after a group's backward finished (its start marker's backward ran):
        reload the group that backward needs one layer later (same name)."""
        handler = group.handler
        if handler.phase is not HandlerPhase.BACKWARD:
            self._begin_backward(handler)
        target = group.prev_same
        if target is None:
            nxt = self._next_in_backward_order(handler)
            target = nxt.last_of_name.get(group.name) if nxt is not None else None
        if target is not None and target.state is GroupState.OFFLOADED and target.needs_reload():
            self._reload(target, prefetch=True)

    # ------------------------------------------------------------------ saved-tensor hooks
    def _pack(self, t: torch.Tensor) -> Any:
        group = self._open[-1]
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
        if type(h) is not SavedHandle:
            return h.unpack()
        rec = h.record
        group = h.group
        if group.handler.phase is not HandlerPhase.BACKWARD:
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
    def _new_handler(self, chunk_id: int, microbatch: int | None) -> ChunkOffloadHandler:
        if microbatch is None:
            microbatch = self._microbatches[chunk_id]
        self._microbatches[chunk_id] = microbatch + 1
        handler = ChunkOffloadHandler(self, chunk_id, microbatch)
        self._handlers.append(handler)
        self._stats_handlers += 1
        return handler

    def _finish_forward(self, handler: ChunkOffloadHandler) -> None:
        """Something other than this chunk's own backward follows its forward: offload the
        groups it kept pending."""
        if handler.phase is HandlerPhase.FORWARD:
            handler.phase = HandlerPhase.FORWARD_DONE
            pending = list(handler.pending.values())
            handler.pending.clear()
            for group in pending:
                self._launch(group)
        if self._forward is handler:
            self._forward = None

    def _begin_backward(self, handler: ChunkOffloadHandler) -> None:
        """The first backward activity of ``handler``. If its forward was the last thing that
        ran, its pending groups (the last group of each name) stay on the GPU. Any other
        handler still in forward is finished, and every copy still in flight is waited for
        (on the GPU) so the backward starts with the offloaded memory freed."""
        if handler.phase is HandlerPhase.FORWARD:
            for group in handler.pending.values():
                group.state = GroupState.KEPT
                self._stats[group.name].groups_kept += 1
            handler.pending.clear()
            if self._forward is handler:
                self._forward = None
        elif self._forward is not None:
            self._finish_forward(self._forward)
        handler.phase = HandlerPhase.BACKWARD
        while self._inflight:
            self._release(self._inflight.popleft(), wait=True)

    def _launch(self, group: OffloadGroup) -> None:
        nvtx.push("offload/" + group.label)
        nbytes, shared = group.launch_offload(self.streams, self.pool, self._timing)
        nvtx.pop()
        stats = self._stats[group.name]
        stats.bytes_held_elsewhere += shared
        if nbytes == 0:
            group.state = GroupState.OFFLOADED
            return
        stats.groups_offloaded += 1
        stats.bytes_offloaded += nbytes
        stats.tensors_offloaded += sum(1 for r in group.records if r.host is not None)
        if self._timing:
            self._pending_timings.append(("d2h_ms", group.name, group.d2h_timing, group.d2h_done))
        self._inflight.append(group)
        if len(self._inflight) > self._stats_max_inflight:
            self._stats_max_inflight = len(self._inflight)
        while len(self._inflight) > self.config.max_inflight_groups:
            self._release(self._inflight.popleft(), wait=True)

    def _poll_inflight(self) -> None:
        """Free the GPU memory of groups whose copies are done; never blocks."""
        if self.streams.is_capturing():
            return
        inflight = self._inflight
        while inflight and inflight[0].d2h_done.query():
            self._release(inflight.popleft(), wait=False)

    def _release(self, group: OffloadGroup, wait: bool) -> None:
        if wait:
            self._wait(group.stream, group.d2h_done, "offload_wait_ms", group.name)
        group.release()

    def _reload(self, group: OffloadGroup, prefetch: bool) -> None:
        nvtx.push("reload/" + group.label)
        nbytes = group.launch_reload(self.streams, self._timing)
        nvtx.pop()
        if nbytes:
            stats = self._stats[group.name]
            stats.bytes_reloaded += nbytes
            if prefetch:
                stats.reloads_prefetched += 1
            else:
                stats.reloads_on_demand += 1
            if self._timing:
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

    def _next_in_backward_order(self, handler: ChunkOffloadHandler) -> ChunkOffloadHandler | None:
        handlers = self._handlers
        for i, h in enumerate(handlers):
            if h is handler:
                for nxt in list(handlers)[i + 1:]:
                    if nxt.phase is HandlerPhase.FORWARD_DONE:
                        return nxt
                return None
        return None

    def _process_retired(self) -> None:
        """Retire handlers whose saved tensors were all freed by autograd. Runs only at safe
        points (never from a handle's ``__del__``), and never on the chunk still in forward."""
        if not self._retire_candidates:
            return
        candidates, self._retire_candidates = self._retire_candidates, []
        for handler in candidates:
            if handler.alive != 0 or handler.phase is HandlerPhase.RETIRED:
                continue
            if handler is self._forward:
                self._retire_candidates.append(handler)  # retire once its forward is over
            else:
                self._retire(handler)

    def _retire(self, handler: ChunkOffloadHandler) -> None:
        """Give back everything ``handler`` holds, with the waits that make that safe."""
        for group in handler.groups:
            if group.state is GroupState.OFFLOADING:
                if group in self._inflight:
                    self._inflight.remove(group)
                group.stream.wait_event(group.d2h_done)
                group.release()
            if group.h2d_done is not None and group.alloc_stream is not None:
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
    def live_handlers(self) -> list[ChunkOffloadHandler]:
        """Handlers not yet retired (their saved tensors are still referenced by autograd)."""
        self._process_retired()
        return list(self._handlers)

    @property
    def in_group(self) -> bool:
        """Whether a group (enabled or not) is open on this manager."""
        return bool(self._names_open)
