"""Host time inside the engine's entry points, and in Python's cyclic garbage collector.

A diagnostic for host-bound steps (`tools/host_overhead.py`, ``tools/profile_step.py --engine``):
every entry point in `ENTRY_POINTS` is wrapped with a ``perf_counter`` timer, which also sees
the hooks that backward runs on autograd's own thread (a profiler of the main thread does not),
and a ``gc.callbacks`` entry times each collection by generation. A call nested in another entry
point is counted in both. The wrappers cost about a microsecond per call, so compare two runs
under the timers, not a run under them with one without.
"""

from __future__ import annotations

import gc
import threading
import time
from collections import defaultdict
from typing import Any

from offload.chunk_lifecycle import ChunkLifecycle
from offload.copy_queue import CopyQueue
from offload.manager import PipelineOffloadManager
from offload.stats import StatsRecorder

ENTRY_POINTS: list[tuple[type, list[str]]] = [
    (PipelineOffloadManager, ["open_group", "close_group", "_pack", "_unpack", "on_group_backward_done",
                              "after_host_sync", "begin_chunk", "end_iteration"]),
    (CopyQueue, ["offload", "reload", "launch_deferred", "apply_bound", "poll", "release_all", "wait_reloaded"]),
    (ChunkLifecycle, ["begin_backward", "end_forward", "retire"]),
    (StatsRecorder, ["collect"]),
]
"""The (class, method names) timed."""


def timed(real: Any, totals: dict[str, list[float]], label: str, thread: int | None = None) -> Any:
    """``real`` wrapped to add its ``perf_counter`` seconds and one call to ``totals[label]``
    (``[seconds, calls]``); with ``thread``, only calls made on that thread are counted."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if thread is not None and threading.get_ident() != thread:
            return real(*args, **kwargs)
        t0 = time.perf_counter()
        try:
            return real(*args, **kwargs)
        finally:
            entry = totals[label]
            entry[0] += time.perf_counter() - t0
            entry[1] += 1

    return wrapper


class EngineTimers:
    """Install with `install`, mark each step's end with `step`, read per-step totals with
    `table`, take the wrappers off with `remove`. `clear` starts a new window (the totals so far
    are dropped). The same window interface as `offload.tools.sync_timers.SyncTimers`."""

    kind = "engine"  # tools/profile_step.py writes OUT.engine.txt

    def __init__(self) -> None:
        self.totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])  # name -> [seconds, calls]
        self.steps = 0  # steps ended in the window
        self.gc_collections = [0, 0, 0]
        self.gc_seconds = [0.0, 0.0, 0.0]
        self._originals: list[tuple[type, str, Any]] = []
        self._gc_start = 0.0

    def install(self) -> "EngineTimers":
        for owner, names in ENTRY_POINTS:
            for name in names:
                real = owner.__dict__[name]
                self._originals.append((owner, name, real))
                setattr(owner, name, timed(real, self.totals, f"{owner.__name__}.{name}"))
        gc.callbacks.append(self._on_gc)
        return self

    def remove(self) -> None:
        for owner, name, real in reversed(self._originals):
            setattr(owner, name, real)
        self._originals.clear()
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def clear(self) -> None:
        self.totals.clear()
        self.steps = 0
        self.gc_collections = [0, 0, 0]
        self.gc_seconds = [0.0, 0.0, 0.0]

    def step(self) -> None:
        """A step of the window ended."""
        self.steps += 1

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        else:
            generation = info["generation"]
            self.gc_collections[generation] += 1
            self.gc_seconds[generation] += time.perf_counter() - self._gc_start

    def table(self, steps: int | None = None) -> str:
        """Per-step totals over ``steps`` steps (default: those `step` counted): the collector's,
        then each entry point's."""
        steps = steps or self.steps
        if not steps:
            return "no complete step in the window"
        lines = ["python gc per step: " + "; ".join(
            f"gen{g} {self.gc_collections[g] / steps:.2f} collections {self.gc_seconds[g] / steps * 1e3:.2f} ms"
            for g in range(3))]
        lines.append("engine entry points per step (a nested call counts in its caller too):")
        for name, (seconds, calls) in sorted(self.totals.items(), key=lambda kv: -kv[1][0]):
            lines.append(f"  {name:46} {seconds / steps * 1e3:8.3f} ms {calls / steps:8.0f} calls "
                         f"{seconds / max(calls, 1) * 1e6:7.1f} us/call")
        return "\n".join(lines)
