"""Host time the main thread spends waiting for the GPU in a training script's host syncs.

A diagnostic for host-paced steps (``tools/profile_step.py --syncs``). The host-sync calls in
`SYNC_CALLS` (``Tensor.cpu()``, ``.item()``, ``.tolist()``, ``bool(tensor)``, and the stream,
event and device ``synchronize``) are wrapped with a ``perf_counter`` timer counted on the thread
that installed it (the training loop's: autograd's backward thread is not), and each step's wall
time and that thread's CPU time are kept too. A sync that waits behind an offload copy (a copy
engine serves its queue in order: Note [9] of `offload.copy_queue`) shows here as a longer
wait per step than without offloading, which neither the engine's timers nor the copy-wait
notice (the compute stream's waits) see. A sync spins, so its wait counts as CPU time too.
``.cpu()`` of a CPU tensor is counted as well (it costs next to nothing).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import defaultdict
from typing import Any

import torch

from offload.tools.engine_timers import timed

SYNC_CALLS: list[tuple[Any, str, str]] = [
    (torch.Tensor, "cpu", "Tensor.cpu"),
    (torch.Tensor, "item", "Tensor.item"),
    (torch.Tensor, "tolist", "Tensor.tolist"),
    (torch.Tensor, "__bool__", "bool(Tensor)"),
    (torch.cuda.Stream, "synchronize", "Stream.synchronize"),
    (torch.cuda.Event, "synchronize", "Event.synchronize"),
    (torch.cuda, "synchronize", "torch.cuda.synchronize"),
]
"""The (owner, attribute, label) wrapped."""


class SyncTimers:
    """Install with `install` (on the training loop's thread), mark each step's end with `step`,
    read the per-step figures with `table`, take the wrappers off with `remove`; `clear` starts a
    new window. The same window interface as `offload.tools.engine_timers.EngineTimers`."""

    kind = "syncs"  # tools/profile_step.py writes OUT.syncs.txt

    def __init__(self) -> None:
        self.totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])  # label -> [seconds, calls]
        self.steps: list[tuple[float, float, float]] = []  # per step: wall, thread CPU, in syncs (seconds)
        self._thread = threading.get_ident()
        self._originals: list[tuple[Any, str, Any]] = []  # (owner, name, its own attribute or None: inherited)
        self._mark: tuple[float, float, float] | None = None

    def install(self) -> "SyncTimers":
        self._thread = threading.get_ident()
        for owner, name, label in SYNC_CALLS:
            self._originals.append((owner, name, vars(owner).get(name)))
            setattr(owner, name, timed(getattr(owner, name), self.totals, label, self._thread))
        return self

    def remove(self) -> None:
        for owner, name, own in reversed(self._originals):
            if own is None:
                delattr(owner, name)  # inherited (``Tensor.cpu`` is ``TensorBase``'s): inherit again
            else:
                setattr(owner, name, own)
        self._originals.clear()

    def clear(self) -> None:
        self.totals.clear()
        self.steps.clear()
        self._mark = self._now()

    def step(self) -> None:
        """A step ended: record its wall time, CPU time and time in syncs since the last mark."""
        now = self._now()
        if self._mark is not None:
            self.steps.append(tuple(b - a for a, b in zip(self._mark, now)))  # type: ignore[arg-type]
        self._mark = now

    def _now(self) -> tuple[float, float, float]:
        return time.perf_counter(), time.thread_time(), sum(seconds for seconds, _ in self.totals.values())

    def table(self) -> str:
        """Medians per step (wall, the thread's CPU, in syncs), then each call's total per step."""
        n = len(self.steps)
        if not n:
            return "no complete step in the window"
        wall, cpu, syncs = (statistics.median(s[i] for s in self.steps) * 1e3 for i in range(3))
        lines = [f"{n} steps, medians per step: wall {wall:.1f} ms, the training loop thread's CPU {cpu:.1f} ms, "
                 f"in host syncs {syncs:.1f} ms"]
        for label, (seconds, calls) in sorted(self.totals.items(), key=lambda kv: -kv[1][0]):
            lines.append(f"  {label:24} {seconds / n * 1e3:8.2f} ms {calls / n:7.0f} calls per step")
        return "\n".join(lines)
