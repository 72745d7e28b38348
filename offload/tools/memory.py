"""Memory over one step, with and without offloading, by module and phase.

    python -m offload.tools.memory --modules core_attn --hidden 4096 --heads 32 --layers 8 \\
        --seq 4096 --out mem/            # records; writes mem/memory.json, .md, .png
    python -m offload.tools.memory --from mem/memory.json --out mem2/   # report again

For each run (no offloading, then ``--modules`` offloaded) one step after a warm-up is
recorded with ``torch.cuda.memory._record_memory_history`` (every allocation and free, no
stack traces), together with the boundaries of every named module's forward and backward
(host time and the exact ``memory_allocated()`` there). ``--pickle`` also keeps the raw
snapshots for https://pytorch.org/memory_viz.

The report attributes each allocation to the innermost module region (name, phase) running
when it was made (``(other)`` outside them) and gives per region: bytes allocated, bytes
freed, and, for forward, bytes still allocated when forward ended (what the module leaves for
backward: offloading should take it down); then the peak, where it happened, and the memory at
the end of forward, for both runs and their difference; and a plot of memory over the step.

The allocator stamps events with its own clock converted to wall time; the markers use wall
time. The report checks the two against each other: at every marker it compares the memory
rebuilt from the events with the exact figure (``alignment``).
"""

from __future__ import annotations

import argparse
import bisect
import pickle
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from . import plot
from .report import GIB, MIB, md_table, read_json, write_json

OTHER = "(other)"
ROOT = ""


def _now_us() -> float:
    return time.time_ns() / 1e3


def record_run(work: Any, modules: list[str], min_tensor_bytes: int, warmup: int,
               pickle_path: Path | None = None, max_inflight_groups: int = 1) -> dict[str, Any]:
    """One recorded step with ``modules`` offloaded (none: the baseline)."""
    import torch

    import offload

    from .boundaries import Boundaries

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        offload.configure(modules, min_tensor_bytes=min_tensor_bytes, max_inflight_groups=max_inflight_groups,
                          device=work.device)
    handle = offload.attach(work.model, {n: work.mapping[n] for n in modules}) if modules else None
    markers: list[list[Any]] = []
    try:
        for _ in range(warmup):
            work.step()
            offload.end_iteration()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()

        def mark(name: str, i: int, phase: str, edge: str) -> None:
            markers.append([_now_us(), name, i, phase, edge, torch.cuda.memory_allocated()])

        b = Boundaries(work.model, work.mapping, mark)
        torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=10_000_000)
        try:
            start_allocated = torch.cuda.memory_allocated()
            mark("step", 0, "step", "begin")
            work.step()
            offload.end_iteration()
            torch.cuda.synchronize()
            mark("step", 0, "step", "end")
            snap = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
            b.remove()
        peak = torch.cuda.max_memory_allocated()
    finally:
        if handle is not None:
            handle.remove()
        offload.reset(release_pool=True)
    if pickle_path is not None:
        pickle_path.parent.mkdir(parents=True, exist_ok=True)
        pickle_path.write_bytes(pickle.dumps(snap))
    trace = snap["device_traces"][torch.cuda.current_device()]
    events = [[e["time_us"], e["size"] if e["action"] == "alloc" else -e["size"], e["addr"]]
              for e in trace if e["action"] in ("alloc", "free_requested")]
    label = "offload " + ",".join(modules) if modules else "no offloading"
    if modules and max_inflight_groups != 1:
        label += f" (in flight {max_inflight_groups})"
    return {"label": label, "modules": modules, "max_inflight_groups": max_inflight_groups,
            "start_allocated": start_allocated, "peak_allocated": peak, "events": events, "markers": markers}


def _time_scale(run: dict[str, Any]) -> float:
    """Event times are microseconds; some builds stamp nanoseconds: detect it against the markers."""
    if not run["events"] or not run["markers"]:
        return 1.0
    ev, mk = run["events"][0][0], run["markers"][0][0]
    return 1e-3 if ev > 100 * mk else 1.0


class Step:
    """One recorded run: the memory curve and the module regions, times in ms from the step's start."""

    def __init__(self, run: dict[str, Any]) -> None:
        for key in ("events", "markers", "start_allocated", "peak_allocated", "label"):
            if key not in run:
                raise ValueError(f"not a recorded memory run: no {key!r}")
        self.run = run
        scale = _time_scale(run)
        begin = [m for m in run["markers"] if m[1] == "step" and m[4] == "begin"]
        if not begin:
            raise ValueError("the run has no step-begin marker")
        self.t0 = begin[0][0]
        self.events = sorted(((e[0] * scale - self.t0) / 1e3, int(e[1]), e[2]) for e in run["events"])
        self.markers = [((m[0] - self.t0) / 1e3, m[1], m[2], m[3], m[4], m[5]) for m in run["markers"]]
        self.times = [t for t, _, _ in self.events]
        self.values: list[int] = []
        level = run["start_allocated"]
        # events before the step's start marker are already in start_allocated
        for t, delta, _ in self.events:
            if t >= 0:
                level += delta
            self.values.append(level)
        spans: dict[tuple[str, int, str], list[float]] = {}
        for t, name, i, phase, edge, _ in self.markers:
            spans.setdefault((name, i, phase), [None, None])[0 if edge == "begin" else 1] = t
        self.regions = [(s, e, name, i, phase) for (name, i, phase), (s, e) in spans.items()
                        if s is not None and e is not None and name not in (ROOT, "step")]
        self.regions.sort(key=lambda r: r[1] - r[0])  # innermost first
        root = {phase: (s, e) for (name, _, phase), (s, e) in spans.items() if name == ROOT}
        self.forward_end = root.get("fwd", (None, None))[1]
        step = spans.get(("step", 0, "step"), [None, None])
        self.end = step[1] if step[1] is not None else (self.times[-1] if self.times else 0.0)

    def allocated_at(self, t: float) -> int:
        """Memory allocated just after time ``t`` (ms), rebuilt from the events."""
        i = bisect.bisect_right(self.times, t)
        return self.values[i - 1] if i else self.run["start_allocated"]

    def alignment(self) -> int:
        """Largest difference (bytes) between the rebuilt and the exact memory at the markers."""
        return max((abs(self.allocated_at(t) - exact) for t, *_, exact in self.markers), default=0)

    def region_of(self, t: float) -> tuple[str, str]:
        """(name, phase) of the innermost module region running at ``t``."""
        for s, e, name, _, phase in self.regions:
            if s <= t <= e:
                return name, phase
        if self.forward_end is None or t <= self.forward_end:
            return OTHER, "fwd"
        return OTHER, "bwd"

    def by_region(self) -> dict[tuple[str, str], dict[str, int]]:
        """Per (name, phase): bytes allocated, freed, and (forward) still allocated at forward's end."""
        out: dict[tuple[str, str], dict[str, int]] = {}
        live: dict[Any, tuple[int, tuple[str, str]]] = {}
        fwd_end = self.forward_end if self.forward_end is not None else float("inf")
        left_at_fwd_end: dict[tuple[str, str], int] = {}
        passed = False
        for t, delta, addr in self.events:
            if t < 0 or t > self.end:
                continue
            if not passed and t > fwd_end:
                passed = True
                for size, where in live.values():
                    left_at_fwd_end[where] = left_at_fwd_end.get(where, 0) + size
            where = self.region_of(t)
            acc = out.setdefault(where, {"allocated": 0, "freed": 0, "left_at_forward_end": 0})
            if delta > 0:
                acc["allocated"] += delta
                live[addr] = (delta, where)
            else:
                acc["freed"] -= delta
                live.pop(addr, None)
        if not passed:
            for size, where in live.values():
                left_at_fwd_end[where] = left_at_fwd_end.get(where, 0) + size
        for where, n in left_at_fwd_end.items():
            if where[1] == "fwd":
                out.setdefault(where, {"allocated": 0, "freed": 0, "left_at_forward_end": 0})
                out[where]["left_at_forward_end"] = n
        return out

    def summary(self) -> dict[str, Any]:
        inside = [(v, t) for t, v in zip(self.times, self.values) if 0 <= t <= self.end]
        peak, at = max(inside) if inside else (self.run["start_allocated"], 0.0)
        name, phase = self.region_of(at)
        return {"label": self.run["label"], "peak_allocated": self.run["peak_allocated"], "peak_rebuilt": peak,
                "peak_at_ms": at, "peak_in": f"{name} {phase}", "start_allocated": self.run["start_allocated"],
                "forward_end_ms": self.forward_end,
                "at_forward_end": self.allocated_at(self.forward_end) if self.forward_end is not None else None,
                "step_ms": self.end, "alignment_bytes": self.alignment()}


def compare(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Summaries and per-region figures of each run (the first is the reference)."""
    if len(runs) < 2:
        raise ValueError("comparing needs two runs (without and with offloading)")
    steps = [Step(r) for r in runs]
    regions = [s.by_region() for s in steps]
    order = [k for k in dict.fromkeys(k for r in regions for k in r)]
    rows = []
    for key in order:
        rows.append({"name": key[0], "phase": key[1], "runs": [r.get(key, {"allocated": 0, "freed": 0,
                                                                              "left_at_forward_end": 0})
                                                                for r in regions]})
    return {"summaries": [s.summary() for s in steps], "regions": rows}


def render(result: dict[str, Any]) -> str:
    """Markdown: the summary per run, then the regions whose figures differ between the runs."""
    sums = result["summaries"]
    a, b = sums[0], sums[1]

    def g(n: int | None) -> str:
        return "n/a" if n is None else f"{n / GIB:.3f}"

    srows = [[s["label"], g(s["peak_allocated"]), g(s["peak_rebuilt"]), f"{s['peak_at_ms']:.1f}", s["peak_in"],
              g(s["at_forward_end"]), f"{s['step_ms']:.1f}", f"{s['alignment_bytes'] / MIB:.2f}"] for s in sums]
    lines = [md_table(["run", "peak GiB", "peak GiB (events)", "peak at ms", "peak in", "at forward end GiB",
                       "step ms (host)", "alignment MiB"], srows, "lrrrlrrr"), "",
             f"Peak: {g(a['peak_allocated'])} -> {g(b['peak_allocated'])} GiB "
             f"({(b['peak_allocated'] - a['peak_allocated']) / GIB:+.3f} GiB); at the end of forward: "
             f"{g(a['at_forward_end'])} -> {g(b['at_forward_end'])} GiB.", ""]
    rows = []
    for r in result["regions"]:
        x, y = r["runs"][0], r["runs"][1]
        if x == y:
            continue
        rows.append([r["name"], r["phase"], f"{x['allocated'] / MIB:.1f}", f"{y['allocated'] / MIB:.1f}",
                     f"{x['freed'] / MIB:.1f}", f"{y['freed'] / MIB:.1f}",
                     f"{x['left_at_forward_end'] / MIB:.1f}", f"{y['left_at_forward_end'] / MIB:.1f}",
                     f"{(y['left_at_forward_end'] - x['left_at_forward_end']) / MIB:+.1f}"])
    lines.append("Regions whose figures differ (MiB; first the run without offloading, then with):")
    lines.append("")
    lines.append(md_table(["name", "phase", "allocated", "allocated", "freed", "freed", "left at fwd end",
                           "left at fwd end", "difference"], rows, "llrrrrrrr") if rows else "(none)")
    return "\n".join(lines)


def picture(runs: list[dict[str, Any]], path: str | Path) -> Path:
    """Memory allocated over the step, one line per run, with the end of forward marked."""
    steps = [Step(r) for r in runs]
    series, vlines = [], []
    for s in steps:
        pts = [(0.0, s.run["start_allocated"])] + [(t, v) for t, v in zip(s.times, s.values) if 0 <= t <= s.end]
        series.append((s.run["label"], [t for t, _ in pts], [v / GIB for _, v in pts]))
        if s.forward_end is not None:
            vlines.append((s.forward_end, f"forward end ({s.run['label']})"))
    return plot.lines(path, series, "Memory allocated over one step", "ms from the step's start (host time)",
                      "GiB", vlines)


def main(argv: list[str] | None = None) -> int:
    from .workload import add_workload_args, spec_from_args

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(p)
    p.add_argument("--modules", help="names to offload in the second run, e.g. core_attn,fc1")
    p.add_argument("--max-inflight-groups", type=int, default=1, help="the engine's max_inflight_groups")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--min-tensor-bytes", type=int, default=1 << 20)
    p.add_argument("--from", dest="source", help="report on a memory.json recorded before instead")
    p.add_argument("--pickle", action="store_true", help="also write the raw snapshots (for memory_viz)")
    p.add_argument("--out", default="memory", help="folder for memory.json, memory.md, memory.png")
    args = p.parse_args(argv)
    out = Path(args.out)
    if args.source:
        data = read_json(args.source, "--from")
    else:
        import torch

        import offload

        from .workload import build_workload

        if not args.modules:
            p.error("--modules is required to record (or give --from)")
        if not torch.cuda.is_available():
            p.error("recording needs CUDA (torch.cuda.memory history); use --from to report on a recording")
        spec = spec_from_args(args)
        work = build_workload(spec)
        modules = list(offload.parse_module_list(args.modules))
        runs = [record_run(work, mods, args.min_tensor_bytes, args.warmup,
                           out / f"snapshot_{'offload' if mods else 'none'}.pickle" if args.pickle else None,
                           args.max_inflight_groups)
                for mods in ([], modules)]
        data = {"tool": "memory", "workload": spec, "description": work.description,
                "device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": runs}
        write_json(out / "memory.json", data)
    try:
        result = compare(data["runs"])
    except (ValueError, KeyError) as e:
        p.error(f"cannot read the recording: {e}")
    text = render(result)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.md").write_text(text + "\n")
    write_json(out / "memory_report.json", result)
    written = picture(data["runs"], out / "memory.png")
    print(text)
    print(f"results: {out / 'memory.md'}, {out / 'memory_report.json'}, {written}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
