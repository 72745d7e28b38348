"""A GPU timeline read from a ``torch.profiler`` trace or an ``nsys`` SQLite export.

Both sources give the same three things, which is all the overlap report needs:

* GPU operations (kernels, memory copies, memsets) with their stream and times;
* the host calls that launched them (a correlation id, a thread and a time);
* named host ranges: ``record_function`` ranges in a ``torch.profiler`` trace, NVTX push/pop
  ranges in an nsys export. The engine's ranges are named ``offload/<label>`` and
  ``reload/<label>`` (`offload.nvtx`); a copy belongs to the range in which it was launched.

Times are microseconds. torch.profiler traces may be gzipped (``.json.gz``).
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

COPY_KINDS = {"dtoh": "d2h", "htod": "h2d", "dtod": "d2d", "htoh": "h2h"}
# CUPTI_ACTIVITY_MEMCPY_KIND_*: 1 HtoD, 2 DtoH, 8 DtoD, 9 HtoH, 10 PtoP
NSYS_COPY_KINDS = {1: "h2d", 2: "d2h", 8: "d2d", 9: "h2h", 10: "p2p"}
NSYS_NVTX_PUSH_POP = 59


@dataclass
class GpuOp:
    start: float
    end: float
    stream: int
    kind: str  # kernel, memcpy, memset
    name: str = ""
    correlation: int | None = None
    bytes: int = 0
    copy: str | None = None  # d2h, h2d, d2d, ... for memcpy

    @property
    def dur(self) -> float:
        return self.end - self.start


@dataclass
class HostRange:
    start: float
    end: float
    thread: Any
    name: str


@dataclass
class Timeline:
    """GPU operations, launches by correlation id (thread, time), and host ranges."""

    ops: list[GpuOp] = field(default_factory=list)
    launches: dict[int, tuple[Any, float]] = field(default_factory=dict)
    ranges: list[HostRange] = field(default_factory=list)
    source: str = ""

    def range_at(self, thread: Any, t: float, prefixes: tuple[str, ...]) -> HostRange | None:
        """The innermost range on ``thread`` whose name starts with one of ``prefixes`` and which
        contains time ``t``."""
        index = self._index(prefixes)
        starts, ranges = index.get(thread, ([], []))
        i = bisect.bisect_right(starts, t)
        while i > 0:  # ranges of these names do not nest; look back a few for safety
            i -= 1
            r = ranges[i]
            if r.start <= t <= r.end:
                return r
            if t - r.start > 1e7:
                break
        return None

    def _index(self, prefixes: tuple[str, ...]) -> dict[Any, tuple[list[float], list[HostRange]]]:
        cache = self.__dict__.setdefault("_cache", {})
        if prefixes not in cache:
            by: dict[Any, list[HostRange]] = {}
            for r in self.ranges:
                if r.name.startswith(prefixes):
                    by.setdefault(r.thread, []).append(r)
            cache[prefixes] = {k: ([r.start for r in sorted(v, key=lambda r: r.start)],
                                   sorted(v, key=lambda r: r.start)) for k, v in by.items()}
        return cache[prefixes]


def _copy_kind(name: str) -> str | None:
    m = re.search(r"Memcpy\s+(\w+)", name)
    return COPY_KINDS.get(m.group(1).lower(), m.group(1).lower()) if m else None


def load_torch_trace(path: str | Path) -> Timeline:
    """A Chrome trace written by ``torch.profiler`` (``export_chrome_trace``)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not a readable torch.profiler trace ({e})") from None
    events = data["traceEvents"] if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise ValueError(f"{path}: no traceEvents list")
    return timeline_from_torch_events(events, f"torch.profiler trace {path.name}")


def timeline_from_torch_events(events: list[dict[str, Any]], source: str = "") -> Timeline:
    """The `Timeline` of a ``torch.profiler`` trace's ``traceEvents`` already in memory."""
    tl = Timeline(source=source)
    for e in events:
        cat, args = e.get("cat"), e.get("args") or {}
        if e.get("ph") != "X":
            continue
        if cat in ("kernel", "gpu_memcpy", "gpu_memset"):
            kind = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}[cat]
            start = float(e["ts"])
            tl.ops.append(GpuOp(start, start + float(e.get("dur", 0)), int(args.get("stream", -1)), kind,
                                e.get("name", ""), args.get("correlation"), int(args.get("bytes", 0) or 0),
                                _copy_kind(e.get("name", "")) if kind == "memcpy" else None))
        elif cat in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            tl.launches[int(args["correlation"])] = ((e.get("pid"), e.get("tid")), float(e["ts"]))
        elif cat == "user_annotation":
            start = float(e["ts"])
            tl.ranges.append(HostRange(start, start + float(e.get("dur", 0)), (e.get("pid"), e.get("tid")),
                                       e.get("name", "")))
    tl.ops.sort(key=lambda o: o.start)
    return tl


def _tables(db: sqlite3.Connection) -> set[str]:
    return {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def load_nsys_sqlite(path: str | Path) -> Timeline:
    """An ``nsys export --type sqlite`` database (tables are created lazily: missing ones are empty)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path} does not exist")
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = _tables(db)
        if not tables:
            raise ValueError(f"{path}: not an nsys SQLite export (no tables)")
        strings = dict(db.execute("SELECT id, value FROM StringIds")) if "StringIds" in tables else {}
        tl = Timeline(source=f"nsys export {path.name}")
        if "CUPTI_ACTIVITY_KIND_KERNEL" in tables:
            for start, end, stream, corr, name in db.execute(
                    "SELECT start, end, streamId, correlationId, shortName FROM CUPTI_ACTIVITY_KIND_KERNEL"):
                tl.ops.append(GpuOp(start / 1e3, end / 1e3, stream, "kernel", strings.get(name, str(name)), corr))
        if "CUPTI_ACTIVITY_KIND_MEMCPY" in tables:
            for start, end, stream, corr, nbytes, kind in db.execute(
                    "SELECT start, end, streamId, correlationId, bytes, copyKind FROM CUPTI_ACTIVITY_KIND_MEMCPY"):
                copy = NSYS_COPY_KINDS.get(kind, f"kind{kind}")
                tl.ops.append(GpuOp(start / 1e3, end / 1e3, stream, "memcpy", f"Memcpy {copy}", corr, nbytes, copy))
        if "CUPTI_ACTIVITY_KIND_MEMSET" in tables:
            for start, end, stream, corr in db.execute(
                    "SELECT start, end, streamId, correlationId FROM CUPTI_ACTIVITY_KIND_MEMSET"):
                tl.ops.append(GpuOp(start / 1e3, end / 1e3, stream, "memset", "Memset", corr))
        if "CUPTI_ACTIVITY_KIND_RUNTIME" in tables:
            for start, tid, corr in db.execute(
                    "SELECT start, globalTid, correlationId FROM CUPTI_ACTIVITY_KIND_RUNTIME"):
                tl.launches[corr] = (tid, start / 1e3)
        if "NVTX_EVENTS" in tables:
            for start, end, tid, text, text_id in db.execute(
                    "SELECT start, end, globalTid, text, textId FROM NVTX_EVENTS "
                    "WHERE eventType = ? AND end IS NOT NULL", (NSYS_NVTX_PUSH_POP,)):
                name = text if text is not None else strings.get(text_id, "")
                tl.ranges.append(HostRange(start / 1e3, end / 1e3, tid, name))
    except sqlite3.DatabaseError as e:
        raise ValueError(f"{path}: not an nsys SQLite export ({e})") from None
    finally:
        db.close()
    tl.ops.sort(key=lambda o: o.start)
    return tl


def load(path: str | Path) -> Timeline:
    """By file name: ``.sqlite`` is an nsys export, anything else a torch.profiler trace."""
    return load_nsys_sqlite(path) if str(path).endswith((".sqlite", ".db")) else load_torch_trace(path)
