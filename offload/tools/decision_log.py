"""The engine's decisions over one step, each with the allocator's counters: where a step's
peak falls and what the engine held there.

`offload.tools.peak_live` names the allocation sites live at a peak, but a site is not a group:
two reloads of 128 MiB at this library's copy site may be any two groups. This log says which.
Inside `record`, every reload the engine issues, every group backward that ends, and the first
unpack of each group append an entry: the event, the group's label, `memory_allocated` and
`max_memory_allocated` in MiB (0 on the CPU), the groups whose reloaded records are on the GPU
and not yet handed to autograd (``reloaded``; a record a later group shares, as ``attn_proj``
shares ``core_attn``'s output, counts under both), and the MiB of records whose GPU source the
engine still holds (kept by the last-layer rule, held elsewhere, or copying out: ``sources``,
by group and state, at each first unpack). Where megatron-core's fine-grained offloading is
imported, its reloads, backward commits and offloads are logged too, by group name, so that
the two systems' runs line up. The wrappers cost microseconds per call: read the order and the
memory from a logged step, not its time (the example leaves it out of the times).

`record` logs one step (it puts the wrappers on and takes them off); `summarize` cuts the entries
around the first one at which ``max_memory_allocated`` reached the step's peak (the peak came
after the entry before it):

    python examples/megatron_gpt.py ... --decision-log DIR     # DIR/decisions_rank<R>.json
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Any, Callable, Iterator

import torch

from offload.group import TensorRecord
from offload.manager import PipelineOffloadManager

MIB = 2**20


def _memory() -> tuple[int, int]:
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0, 0
    return round(torch.cuda.memory_allocated() / MIB), round(torch.cuda.max_memory_allocated() / MIB)


def engine_residency(manager: PipelineOffloadManager) -> tuple[dict[str, int], dict[str, int]]:
    """MiB per group of the handlers not yet retired: reloaded records still the engine's
    (``rec.dev``), and records whose GPU source the engine holds (``rec.src``), keyed
    ``label:STATE``. Read only: not `PipelineOffloadManager.live_handlers`, which retires the
    idle handlers first (a log that did changed what the engine prefetched)."""
    reloaded: dict[str, int] = {}
    sources: dict[str, int] = {}
    for handler in manager.order.handlers:
        for group in handler.groups:
            dev = sum(rec.nbytes for rec in group.all_records() if rec.dev is not None)
            src = sum(rec.nbytes for rec in group.records if rec.src is not None)
            if dev:
                reloaded[group.label] = round(dev / MIB)
            if src:
                sources[f"{group.label}:{group.state.name}"] = round(src / MIB)
    return reloaded, sources


class DecisionLog:
    """Wrappers on the engine's (and Megatron's) decision points that append to `entries`
    while `recording`; `install` puts them on, `remove` takes them off."""

    def __init__(self) -> None:
        self.entries: list[dict[str, Any]] = []
        self.recording = False
        self._seen: set[str] = set()
        self._undo: list[tuple[type, str, Any]] = []

    def _add(self, kind: str, label: str, manager: PipelineOffloadManager | None = None, **extra: Any) -> None:
        if not self.recording:
            return
        allocated, peak = _memory()
        entry: dict[str, Any] = {"event": kind, "group": label, "allocated_mib": allocated, "max_mib": peak, **extra}
        if manager is not None:
            reloaded, sources = engine_residency(manager)
            entry["reloaded"] = reloaded
            entry["sources_mib"] = sum(sources.values())
            if kind == "unpack":
                entry["sources"] = sources
        self.entries.append(entry)

    def _before(self, cls: type, name: str, note: Callable[..., None]) -> None:
        """Have ``cls.name`` call ``note`` with its arguments first (it logs only while recording)."""
        real = getattr(cls, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            note(*args, **kwargs)
            return real(*args, **kwargs)

        self._undo.append((cls, name, real))
        setattr(cls, name, wrapper)

    def _first_unpack(self, record: TensorRecord, label: str) -> None:
        # Each unpack begins with its record's version check; the manager's own hooks are bound
        # when it is made, so the log cannot wrap them.
        if self.recording and label not in self._seen:
            self._seen.add(label)
            self._add("unpack", label, PipelineOffloadManager._instance)

    def install(self) -> "DecisionLog":
        manager = PipelineOffloadManager
        self._before(manager, "reload", lambda m, group, prefetch, replay=None:
                     self._add("reload", group.label, m, prefetch=prefetch))
        self._before(manager, "on_group_backward_done", lambda m, group: self._add("backward_done", group.label, m))
        self._before(TensorRecord, "check_version", self._first_unpack)
        try:
            fgao = importlib.import_module("megatron.core.pipeline_parallel.fine_grained_activation_offload")
        except ImportError:  # megatron-core absent, or older than its offloading
            fgao = None
        chunk = getattr(fgao, "ChunkOffloadHandler", None)
        if chunk is not None:
            self._before(chunk, "bulk_reload_group", lambda c: self._add("megatron_reload", c._groups_to_reload[-1]._name))
            self._before(chunk, "on_group_commit_backward", lambda c, name: self._add("megatron_commit_backward", name))
            self._before(chunk, "bulk_offload", lambda c, name, *rest: self._add("megatron_offload", name))
        return self

    def remove(self) -> None:
        while self._undo:
            cls, name, real = self._undo.pop()
            setattr(cls, name, real)

    @contextlib.contextmanager
    def record(self) -> Iterator[list[dict[str, Any]]]:
        """Log inside the block (one step); yields the entries, which it starts afresh."""
        self.entries, self._seen = [], set()
        self.recording = True
        try:
            yield self.entries
        finally:
            self.recording = False


@contextlib.contextmanager
def record() -> Iterator[list[dict[str, Any]]]:
    """Put a `DecisionLog`'s wrappers on, log inside the block (one step) and take them off;
    yields the entries."""
    log = DecisionLog().install()
    try:
        with log.record() as entries:
            yield entries
    finally:
        log.remove()


def summarize(entries: list[dict[str, Any]], before: int = 8) -> dict[str, Any]:
    """The step's highest ``max_mib`` and the entries around the first that reached it: the
    ``before`` entries before it, it, and the next one."""
    if not entries:
        return {"entries": 0, "peak_mib": None, "peak_entry": None, "around_peak": []}
    peak = max(e["max_mib"] for e in entries)
    at = next(i for i, e in enumerate(entries) if e["max_mib"] == peak)
    return {"entries": len(entries), "peak_mib": peak, "peak_entry": at,
            "around_peak": entries[max(0, at - before):at + 2]}
