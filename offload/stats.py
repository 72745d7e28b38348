"""Statistics of one iteration: per group name, plus the pinned pool and the streams."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, Iterable

if TYPE_CHECKING:
    from .copy_wait import CopyWaitProbe


@dataclass
class GroupStats:
    """What the groups of one name did in one iteration.

    Times are milliseconds measured with CUDA events, in the iterations that are timed (every
    one with ``timing=True``, else the three the copy-wait notice measures; zero in the others
    and on the CPU fallback). ``offload_wait_ms`` is the time the compute stream stood still waiting
    for device-to-host copies (the in-flight bound, and the forward's end), ``flush_wait_ms`` the
    part of it at the forward's end (the flush at its last group's close, or at a backward's
    start: the compute stream waits for every copy in flight so that the step's peak does not
    hold them), ``reload_wait_ms`` the time it waited for host-to-device copies that backward
    needed. ``reloads_on_demand`` counts reloads that
    backward asked for before anything had prefetched them (their copy could not overlap).
    ``bytes_held_elsewhere`` are bytes the groups saved that something else still held when
    their copy was due (typically a module that is not offloaded saved the same tensor):
    they stay on the GPU, because copying them would free nothing. ``groups_declined`` counts
    groups the configured `GroupPolicy` left on the GPU; ``groups_recomputed`` groups that
    opened inside a ``torch.utils.checkpoint`` region, which recomputes their tensors (so
    they are not offloaded).
    """

    groups: int = 0
    groups_offloaded: int = 0
    groups_kept: int = 0
    groups_declined: int = 0
    groups_recomputed: int = 0
    tensors_offloaded: int = 0
    bytes_offloaded: int = 0
    bytes_reloaded: int = 0
    bytes_held_elsewhere: int = 0
    reloads_prefetched: int = 0
    reloads_on_demand: int = 0
    d2h_ms: float = 0.0
    h2d_ms: float = 0.0
    offload_wait_ms: float = 0.0
    flush_wait_ms: float = 0.0
    reload_wait_ms: float = 0.0

    @classmethod
    def sum(cls, items: "Iterable[GroupStats]") -> "GroupStats":
        """Field-wise sum (over names, or over iterations)."""
        out = cls()
        for s in items:
            for f in fields(cls):
                setattr(out, f.name, getattr(out, f.name) + getattr(s, f.name))
        return out

    @property
    def d2h_gbps(self) -> float:
        return self.bytes_offloaded / self.d2h_ms / 1e6 if self.d2h_ms > 0 else 0.0

    @property
    def h2d_gbps(self) -> float:
        return self.bytes_reloaded / self.h2d_ms / 1e6 if self.h2d_ms > 0 else 0.0


@dataclass
class IterationStats:
    """Returned by ``end_iteration()``; ``by_name`` maps each group name to `GroupStats`.

    The ``pinned_*`` fields describe the pinned host pool since it was created: its bytes and
    buffers, the most bytes in use at once, and how many allocations it made and how long they
    took (pinning costs about 0.4 ms per MiB; in steady state the count stops growing).
    ``timed``: whether this iteration's copies and waits were timed (`GroupStats`' times).
    """

    iteration: int = 0
    by_name: dict[str, GroupStats] = field(default_factory=dict)
    pinned_bytes: int = 0
    pinned_buffers: int = 0
    pinned_peak_bytes_in_use: int = 0
    pinned_allocations: int = 0
    pinned_alloc_ms: float = 0.0
    pinned_failures: int = 0
    max_inflight_groups: int = 0
    handlers: int = 0
    timed: bool = False

    def total(self) -> GroupStats:
        """All names together."""
        return GroupStats.sum(self.by_name.values())

    def as_dict(self) -> dict:
        d = asdict(self)
        for name, s in self.by_name.items():
            d["by_name"][name]["d2h_gbps"] = s.d2h_gbps
            d["by_name"][name]["h2d_gbps"] = s.h2d_gbps
        return d


class StatsRecorder:
    """Collects one iteration's statistics as the engine runs; `collect` turns them into
    `IterationStats` (reading the CUDA timing events then) and starts the next iteration's.

    ``probe``: the copy-wait notice's `offload.copy_wait.CopyWaitProbe`, fed the groups' closes
    and the timed waits while it records, and each iteration's statistics; dropped once it is
    done (`for_engine` makes one where the engine can time its copies). ``always_timed``: time
    every iteration's copies and waits (``OffloadConfig.timing``), not only those the probe
    measures: see `timing`."""

    def __init__(self, probe: "CopyWaitProbe | None" = None, always_timed: bool = False) -> None:
        self.probe = probe
        self.always_timed = always_timed
        self._start()

    @classmethod
    def for_engine(cls, streams: Any, config: Any) -> "StatsRecorder":
        """A recorder for an engine on ``streams`` with ``config`` (an `OffloadConfig`), with
        a copy-wait probe where names are configured and copies can be timed (CUDA)."""
        from .copy_wait import CopyWaitProbe  # it imports this module

        probe = (CopyWaitProbe(streams, config.max_inflight_groups, config.copies_into_backward)
                 if streams.is_cuda and config.enabled else None)
        return cls(probe, always_timed=streams.is_cuda and config.timing)

    @property
    def timing(self) -> bool:
        """Whether the iteration in progress times its copies and waits with CUDA events: every
        iteration with ``always_timed``, else only those the copy-wait probe measures (three,
        early on). Each timed group costs a few events and `collect` a host wait for them, about
        10 ms per step for 112 groups on an H100 host (docs/megatron.md, the engine's host time)."""
        probe = self.probe
        return self.always_timed or (probe is not None and probe.recording)

    def _start(self) -> None:
        self.by_name: dict[str, GroupStats] = defaultdict(GroupStats)
        self._timings: list[tuple[str, str, Any, Any]] = []
        self._max_inflight = 0
        self.handlers = 0

    def clear(self) -> None:
        """Forget what was collected so far (`reset` after an aborted step): the probe does not
        measure this iteration."""
        if self.probe is not None:
            self.probe.abort()
        self._start()

    def __getitem__(self, name: str) -> GroupStats:
        return self.by_name[name]

    def closed(self, group: Any) -> None:
        """``group`` (an `OffloadGroup`) closed."""
        self.by_name[group.name].groups += 1
        probe = self.probe
        if probe is not None and probe.recording:
            probe.note_close(group)

    def time(self, kind: str, name: str, start: Any, end: Any, waiting: Any = None) -> None:
        """Add the time between two CUDA events to field ``kind`` of ``name``, at `collect`;
        ``waiting``: the stream that stood still between them, for a wait."""
        self._timings.append((kind, name, start, end))
        probe = self.probe
        if waiting is not None and probe is not None and probe.recording:
            probe.note_wait(waiting, start, end)

    def note_inflight(self, count: int) -> None:
        if count > self._max_inflight:
            self._max_inflight = count

    def collect(self, iteration: int, pool: Any) -> IterationStats:
        """This iteration's statistics (waits for its timing events: a host sync)."""
        for kind, name, start, end in self._timings:
            end.synchronize()
            stats = self.by_name[name]
            setattr(stats, kind, getattr(stats, kind) + start.elapsed_time(end))
        out = IterationStats(
            iteration=iteration,
            by_name=dict(self.by_name),
            pinned_bytes=pool.bytes_total,
            pinned_buffers=pool.num_buffers,
            pinned_peak_bytes_in_use=pool.peak_bytes_in_use,
            pinned_allocations=pool.allocations,
            pinned_alloc_ms=pool.alloc_seconds * 1e3,
            pinned_failures=pool.failures,
            max_inflight_groups=self._max_inflight,
            handlers=self.handlers,
            timed=self.timing,
        )
        self._start()
        if self.probe is not None and self.probe.end_iteration(out):
            self.probe = None
        return out
