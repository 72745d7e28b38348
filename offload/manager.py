"""`PipelineOffloadManager`: the process-wide engine's entry points, hooks and wiring.

Frameworks call `begin_chunk`, `set_schedule`, `end_iteration`, `reset`; `offload.regions`
calls `open_group`/`close_group`; autograd calls the saved-tensor hooks (`_pack`, `_unpack`) and
`on_group_backward_done`. Each other concern has one module and owner (docs/design.md):

| concern | owner |
|---|---|
| copies, the events that order them, the in-flight bound | `copy_queue.CopyQueue` (`copies`) |
| chunk handlers from forward to retirement, the last-layer rule | `chunk_lifecycle.ChunkLifecycle` (`chunks`) |
| backward order of the chunk handlers, the schedule | `backward_order.BackwardOrder` (`order`) |
| one chunk forward's groups and records | `chunk_handler.ChunkOffloadHandler` |
| one group's state machine, records and handles | `group.OffloadGroup` |
| CUDA graph capture sessions and regions | `capture.CaptureSessions` (`captures`) |
| statistics of the iteration; the copy-wait notice | `stats.StatsRecorder` (`stats`); `copy_wait.CopyWaitProbe` |
| pinned host buffers | `pinned_pool.PinnedHostPool` (`pool`) |
| which saved tensors may leave the GPU | `policy.TensorPolicy` (`policy`) |
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch

from .backward_order import BackwardOrder
from .capture import CaptureSessions
from .chunk_handler import ChunkOffloadHandler, HandlerPhase
from .chunk_lifecycle import ChunkLifecycle
from .config import OffloadConfig, check_int, check_known, check_str
from .copy_queue import CopyQueue
from .errors import OffloadError
from .group import GroupState, KeptTensor, OffloadGroup, SavedHandle, gapped_rows
from .group_policy import inside_checkpoint
from .notices import names_that_free_nothing, say_once, warn_if_nothing_offloaded
from .pinned_pool import PinnedHostPool
from .policy import TensorPolicy
from .quantized import pack_quantized, splittable
from .schedules import SchedulePlan
from .stats import IterationStats, StatsRecorder
from .streams import make_streams

_Parameter = torch.nn.Parameter  # saved as weights by every linear layer: kept, and never split


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
        self.stats = StatsRecorder.for_engine(self.streams, config)
        self.copies = CopyQueue(self.streams, self.pool, self.stats, config.max_inflight_groups,
                                config.copy_chunk_bytes)
        self.order = BackwardOrder()
        self.chunks = ChunkLifecycle(self.order, self.copies, self.stats)
        self.captures = CaptureSessions(self)
        if not self.streams.is_cuda and config.enabled:
            say_once("cpu_fallback", "offload: no CUDA device; the CPU fallback runs the engine with host copies "
                     "in place of device copies and saves no memory (said once per process).", stacklevel=3)
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._open: list[OffloadGroup] = []  # enabled groups open, innermost last
        self._names_open: list[str] = []  # every group open, enabled or not
        # The open invocations the group policy declined: (depth in _names_open, handler, layer).
        self._declined: list[tuple[int, ChunkOffloadHandler, int]] = []
        self.declared_names: set[str] = set()
        self._names_checked = False
        self.hook_calls = 0  # saved-tensor hook calls, ever (a graph replay makes none)
        self.suspended = 0  # > 0: no group opens (`offload.suspended`, a graph API's own warm-up)

    # ------------------------------------------------------------------ framework entry points
    def begin_chunk(self, chunk_id: int = 0, microbatch: int | None = None) -> None:
        """Say that the forward of model chunk ``chunk_id`` for a new microbatch begins.

        Pipeline schedules call this before each chunk forward (`offload.attach` does it from
        the root module's forward pre-hook). ``microbatch`` defaults to the chunk's count of
        forwards in this iteration. Under ``no_grad`` it does nothing. With a schedule given
        (`set_schedule`), a chunk that is not the schedule's next forward raises `OffloadError`.
        """
        check_int(chunk_id, "begin_chunk()'s chunk_id (the model chunk: 0, or 0..vpp-1 in a pipeline)")
        check_int(microbatch, "begin_chunk()'s microbatch (or None to count them)", none_ok=True)
        if not torch.is_grad_enabled():
            return
        if self._open:
            raise OffloadError(f"offload: begin_chunk() called inside the open group {self._open[-1].label!r}")
        self._retire_idle()
        self.chunks.end_forward(keep=False)
        self.chunks.start(chunk_id, microbatch, self.captures.session)

    def set_schedule(self, order: Sequence[int] | None) -> None:
        """Hand over the rank's schedule, Megatron's signed ``order`` (`offload.schedules`), for
        this and later iterations, or ``None`` to infer it: with it every cross-chunk reload is
        prefetched and each chunk forward is checked against it (`offload.backward_order`)."""
        self.order.set_schedule(order)

    def end_iteration(self, check_names: bool = True) -> IterationStats:
        """Close the iteration: finish pending work, retire handlers whose graphs are gone,
        check the configured names, and return this iteration's statistics (with ``timing``,
        waiting for its timing events: a host sync where training loops usually sync anyway)."""
        if self._open:
            raise OffloadError(f"offload: end_iteration() called inside the open group {self._open[-1].label!r}")
        self.chunks.end_forward(keep=False)
        self._retire_idle()
        stats = self.stats.collect(self.order.iteration, self.pool)
        self.order.end_iteration()
        if check_names:
            self._check_names()
            if stats.iteration == 0:
                warn_if_nothing_offloaded(stats, self.config.modules, self.declared_names, self.policy.below_min,
                                          self.config.min_tensor_bytes)
            if stats.total().bytes_offloaded:  # else the first iteration's note said why
                for name, note in names_that_free_nothing(stats, self.config.modules).items():
                    say_once(f"frees-nothing:{name}", note, stacklevel=3)
        return stats

    def reset(self, release_pool: bool = False) -> None:
        """Forget every handler and group (their saved tensors can no longer be unpacked): after
        an aborted step. ``release_pool=True`` also unpins and frees the host pool."""
        if self.copies.inflight or self.order.handlers:
            current = self.streams.current()
            current.wait_stream(self.streams.d2h)
            current.wait_stream(self.streams.h2d)
        self.chunks.reset()
        if release_pool:
            self.streams.synchronize()  # no copy after a replay still runs (Note [C3] of offload.capture)
            self.captures.release_graphs()
        self.captures.reset()
        self.copies.reset()
        self._open.clear()
        self._names_open.clear()
        self._declined.clear()
        self.policy.never_offload_depth = 0
        if release_pool:
            self.pool.close()
        self.stats.clear()

    def declare_names(self, names: Iterable[str]) -> None:
        """Tell which group names the model has, so a configured name it lacks gets the list."""
        self.declared_names.update(names)

    # ------------------------------------------------------------------ group boundaries
    def open_group(self, name: str, packed_views: bool = False) -> OffloadGroup | None:
        """Start the group ``name``; returns ``None`` when it does not offload: the name is
        not enabled, no autograd graph is being recorded, the engine is ``suspended``, a
        recompute runs inside backward, the group is inside a ``torch.utils.checkpoint`` region
        (whose tensors are recomputed, not saved), or the group policy declines it.
        ``packed_views``: its views with gaps come back packed (Note [10] of offload.copy_queue)."""
        check_str(name, "a group name")
        if name in self._names_open:
            raise OffloadError(
                f"offload: group {name!r} opened inside a group of the same name; give nested regions different names"
            )
        self._names_open.append(name)
        self.declared_names.add(name)
        try:
            return self._open_enabled(name, packed_views)
        except BaseException:  # the group never opened: leave no trace of it
            self._names_open.pop()
            raise

    def _open_enabled(self, name: str, packed_views: bool) -> OffloadGroup | None:
        if name not in self.config.enabled or not torch.is_grad_enabled() or self.suspended:
            return None
        if torch.compiler.is_compiling():
            raise OffloadError(
                f"offload: group {name!r} runs inside torch.compile, which is not supported: saved-tensor "
                "hooks are disabled while compiling. Compile the modules between offloaded groups, or "
                "use offload.graphs for CUDA graphs."
            )
        if torch._C._current_graph_task_id() != -1:
            return None  # a recompute inside backward: what it saves is needed right away
        if inside_checkpoint():
            self.stats[name].groups_recomputed += 1
            return None
        self._retire_idle()
        handler = self.chunks.forward or self.chunks.start(0, None, self.captures.session)
        layer = handler.next_layer(name)
        policy = self.config.policy
        if policy is not None and not policy(handler.group_info(name, layer, self.order.plan)):
            self.stats[name].groups_declined += 1
            self._decline(handler, name, layer)
            self._declined.append((len(self._names_open), handler, layer))
            return None
        self._issue_decided(handler, name if handler.host_syncs else None)  # Notes [7], [9]
        if self.captures.in_region:
            handler.graphable = True
        group = handler.new_group(name, layer, packed_views)
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
            declined = self._declined
            if declined and declined[-1][0] == len(self._names_open) + 1:
                _, handler, layer = declined.pop()
                eager = handler.capture is None and not self.captures.in_region
                self._invocation_closed(handler, name, layer, eager)
            return
        if not self._open or self._open[-1] is not group:
            raise OffloadError(f"offload: group {group.label!r} closed out of order")
        self._hooks.__exit__(None, None, None)
        self._open.pop()
        group.ready = self.streams.event()
        group.ready.record(group.stream)
        self.stats.closed(group)
        if self.captures.in_region:
            self.captures.plan_step(group)
        not_last = group.capture is None and not self.captures.in_region and self.chunks.known_not_last(group)
        for decided in group.handler.close_group(group, not_last):
            self.copies.defer(decided)  # issued at the next group's open: Note [7] of offload.copy_queue
        self._invocation_closed(group.handler, name, group.layer, eager=group.capture is None)

    def _decline(self, handler: ChunkOffloadHandler, name: str, layer: int) -> None:
        """The group policy declined invocation ``layer`` of ``name``: as at any group open, the
        decided copies, if any, are issued; the name's pending group, which this invocation
        follows, is not the last of its chunk forward; and where the name's last group ran in the
        layer before, the next group to open issues its reload (Note [11] of offload.copy_queue)."""
        if not self.captures.in_region:  # a graph's copies and reloads are planned at its capture
            last_group = handler.last_of_name.get(name)
            if last_group is not None and last_group.layer == layer - 1:
                handler.unlinked.append(last_group)
            pending = handler.pending.pop(name, None)
            if pending is not None:
                self.copies.defer(pending)
        if self.copies.deferred:  # a forward the policy declines whole waits for nothing here
            self._issue_decided(handler, name if handler.host_syncs else None)  # Notes [7], [9]

    def _invocation_closed(self, handler: ChunkOffloadHandler, name: str, layer: int, eager: bool) -> None:
        """Invocation ``layer`` of ``name``, offloaded or declined, closed. If it closed last in
        its chunk's previous forward, this forward is at its end (`offload.chunk_lifecycle`):
        its records held elsewhere get a look and the copies in flight are waited for, where
        it offloaded anything. Copies found done are freed."""
        handler.last_closed = (name, layer)
        if eager and handler.groups and self.chunks.closes_forward(handler, name, layer):
            self.copies.offload_released(handler)  # Note [8] of offload.copy_queue
            if self.config.copies_into_backward:
                self.copies.launch_deferred(bound=False)  # waited for when the backward begins
            else:
                self.copies.flush()  # the forward's end: see offload.chunk_lifecycle
        self.copies.poll()

    def after_host_sync(self) -> None:
        """The model has just synchronized with the host (an MoE dispatcher read its token
        counts): issue the copies decided since the last issue now, and from now on in this
        chunk forward here rather than at each group open (Note [9] of offload.copy_queue).
        Does nothing outside a chunk forward that offloads, in a recompute, and under capture
        (a graph's copies are its own: Note [C3] of offload.capture)."""
        handler = self._eager_chunk_forward()
        if handler is None:
            return
        handler.host_syncs = True
        self._issue_decided(handler)

    def model_forward_returned(self) -> None:
        """The attached model's forward has returned (`offload.attach`'s forward hook): what it
        held in locals until then (Megatron's ``GPTModel.forward``: the embedding's output) gets
        a look now (Note [8] of offload.copy_queue), so its copies run under the loss head and
        the backward's first modules and are freed when the backward begins. Where the schedule
        says the chunk's own backward does not come next, the forward is over here: its last
        groups are offloaded now, not when the next chunk starts (`offload.chunk_lifecycle`,
        the forward's end). Does nothing outside a chunk forward, inside a group, in a
        recompute, and under capture."""
        handler = self._eager_chunk_forward()
        if handler is not None and not self._names_open:
            self.chunks.model_returned(handler)

    def _eager_chunk_forward(self) -> ChunkOffloadHandler | None:
        """The chunk forward in progress, where its copies are the engine's to issue now: not
        outside one, in a recompute, suspended, or under capture (a graph's copies are its own:
        Note [C3] of offload.capture)."""
        handler = self.chunks.forward
        if (handler is None or handler.capture is not None or self.captures.in_region or self.suspended
                or not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1):
            return None
        return handler

    def _issue_decided(self, handler: ChunkOffloadHandler, name: str | None = None) -> None:
        """Issue the copies decided since the last issue (only ``name``'s groups, if given):
        the in-flight bound first, then the second look at ``handler``'s held records (Note [8]
        of offload.copy_queue), then the deferred groups (Notes [7], [9])."""
        self.copies.apply_bound()
        self.copies.offload_released(handler)
        self.copies.launch_deferred(bound=False, name=name)

    def on_group_backward_done(self, group: OffloadGroup) -> None:
        """After a group's backward (its inputs' gradient hooks ran: Note [1] of
        offload.regions), reload the group that backward needs one layer later (same name),
        and those whose next invocation was declined (Note [11] of offload.copy_queue)."""
        handler = group.handler
        if handler.phase is HandlerPhase.RETIRED:
            return  # the engine was reset under this backward: nothing of it is left
        if handler.phase is not HandlerPhase.BACKWARD:
            self.chunks.begin_backward(handler)
        target = group.prev_same
        if target is None:
            successor = self.order.successor(handler)
            if successor is not None and successor.phase is HandlerPhase.FORWARD_DONE:
                target = successor.last_of_name.get(group.name)
                if target is not None and target.layer != successor.invocations[group.name] - 1:
                    target = None  # declined invocations follow it: a group of its own chunk reloads it
        for target in (target, *group.reloads_too):
            # A reload may not cross a graph's edge (Note [3] of offload.copy_queue).
            if target is not None and target.capture is group.capture and target.state is GroupState.OFFLOADED:
                self.reload(target, prefetch=True)
        self.copies.poll()

    # ------------------------------------------------------------------ saved-tensor hooks
    def _pack(self, t: torch.Tensor) -> Any:
        self.hook_calls += 1
        group = self._open[-1]
        cls = type(t)
        if cls is not torch.Tensor:
            if cls is not _Parameter and not self.policy.never_offload_depth and splittable(t):
                handle = pack_quantized(t, self._pack, self._unpack)  # offload/quantized.py
                if handle is not None:
                    return handle
            return KeptTensor(t, group.label)
        if self.policy.never_offload_depth or t.layout is not torch.strided:
            return KeptTensor(t, group.label)
        storage = t.untyped_storage()
        storage_bytes = storage.nbytes()
        if not self.policy.eligible(t, storage_bytes):
            return KeptTensor(t, group.label)
        itemsize = t.dtype.itemsize
        numel = t.numel()
        ptr = storage.data_ptr()
        if self.policy.blocked(ptr):
            return KeptTensor(t, group.label)
        offset = start = t.storage_offset()
        size, stride = t.size(), t.stride()
        handler = group.handler
        contiguous = t.is_contiguous()
        rows = None if contiguous else gapped_rows(size, stride)
        if rows is not None:  # Note [10] of offload.copy_queue
            rec = handler.rows_record_for(group, t, ptr, start, *rows, itemsize)
        else:
            if not contiguous:  # the span the view touches
                numel = 1 + sum((n - 1) * s for n, s in zip(size, stride))
            storage_numel = storage_bytes // itemsize
            if 2 * numel >= storage_numel:  # most of the storage: record all of it (docs/design.md, Views)
                start, numel = 0, max(storage_numel, start + numel)
            rec = handler.record_for(group, t, ptr, start, numel, itemsize)
        rec.handles += 1
        rec.alive += 1
        handler.alive += 1
        return SavedHandle(rec, group, size, stride, offset)

    def _unpack(self, h: Any) -> torch.Tensor:
        self.hook_calls += 1
        if type(h) is not SavedHandle:
            return h.unpack()
        rec, group = h.record, h.group
        phase = group.handler.phase
        if phase is not HandlerPhase.BACKWARD and phase is not HandlerPhase.RETIRED:
            self.captures.sync()
            self.chunks.begin_backward(group.handler)
        rec.check_version(group.label)
        if rec.src is not None:
            return rec.src.as_strided(h.size, h.stride, h.offset)
        if rec.dev is None:
            if rec.host is None:
                raise OffloadError(
                    f"offload: a saved tensor of group {group.label!r} is neither on the GPU nor on "
                    "the host; the manager was reset while the graph that saved it was alive"
                )
            self.reload(group, prefetch=False)
        self.copies.wait_reloaded(rec.reload_group)  # Note [4] of offload.copy_queue
        packed = rec.reloaded_packed
        if packed and group.packed_views:  # Note [10] of offload.copy_queue
            out = rec.dev.view(h.size)
        else:
            if packed:
                self.copies.spread(rec)
            out = rec.dev.as_strided(h.size, h.stride, h.offset - rec.start)
        rec.unpacked += 1
        if rec.unpacked >= rec.handles:
            rec.dev = None  # autograd holds `out`; a second backward reloads from the host
        return out

    # ------------------------------------------------------------------ wiring
    def finish_forward(self) -> None:
        """The forward in progress is over and not its own backward follows: offload its last
        groups now (`offload.graphs` sizes the pinned pool so for captures, which keep nothing)."""
        self.chunks.end_forward(keep=False)

    def _retire_idle(self) -> None:
        """Retire idle handlers, at a safe point outside any capture session."""
        if self.captures.sync() is None:
            self.chunks.retire_idle()

    def reload(self, group: OffloadGroup, prefetch: bool, replay: Any = None) -> None:
        """Issue ``group``'s reload in the capture session, if any, or via ``replay`` (Note [C4])."""
        session = self.captures.sync()
        if self.copies.reload(group, prefetch, session, replay) and session is not None and replay is None:
            self.captures.note_reload(group.h2d_done)

    def _check_names(self) -> None:
        """Raise `UnknownModuleError` for a configured name no attached module or group has yet."""
        if self._names_checked or not self.config.modules or not self.declared_names:
            return
        check_known(
            self.config.modules, self.declared_names,
            "the offload config (no attached module and no group of that name has run)",
        )
        self._names_checked = True  # names are only ever added: all known stays all known

    # ------------------------------------------------------------------ introspection
    iteration = property(lambda self: self.order.iteration)

    @property
    def schedule(self) -> SchedulePlan | None:
        """The schedule given to `set_schedule`, digested (``None`` if none)."""
        return self.order.plan

    @property
    def live_handlers(self) -> list[ChunkOffloadHandler]:
        """Handlers not yet retired (their saved tensors are still referenced by autograd),
        in the order their backwards run. It retires the idle ones first: read it between
        steps, not from a hook inside a backward, where a handler retired before its first
        layer's backward ended prefetches nothing for the chunk whose backward runs next
        (`offload.tools.decision_log` reads ``order.handlers`` instead)."""
        self._retire_idle()
        return list(self.order.handlers)

    @property
    def captured_groups(self) -> list[OffloadGroup]:
        """The groups captured into CUDA graphs (see `offload.capture`)."""
        return self.captures.captured_groups

    in_group = property(lambda self: bool(self._names_open), doc="Whether a group (enabled or not) is open.")
