"""Do the copies overlap compute? Per copy stream and per group name, from a GPU timeline.

    # record a few steps with torch.profiler, then report
    python -m offload.tools.overlap record --modules core_attn --hidden 4096 --heads 32 \\
        --layers 8 --seq 4096 --steps 3 --out trace.json.gz
    python -m offload.tools.overlap report trace.json.gz --png timeline.png
    python -m offload.tools.overlap report profile.sqlite            # an nsys SQLite export
    python -m offload.tools.overlap kernels a.json.gz b.json.gz      # whose compute stream did more

The report gives, over the trace:

* per stream: busy time (union of its operations), kernels and copies; the compute stream is
  the one with the most kernel time;
* per group name and direction (``offload`` = device-to-host, ``reload`` = host-to-device):
  copies, bytes, copy time and GB/s, the fraction of copy time during which a kernel ran on any
  stream (overlapped), and the time the compute stream waited for those copies;
* a picture of one layer: the compute stream's kernels and the copy streams, around the copies
  of the chosen layer index (``--layer``; by default the middle one), forward and backward.

A copy belongs to the engine range (``offload/...``, ``reload/...``) on whose thread, and within
which, it was launched. The compute stream *waited* for a copy when it stood idle with its next
operation already launched, and that operation started within ``--tolerance-us`` of the copy's
end: the idle time from launch (or the previous operation's end) to the start counts.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import plot
from .intervals import Cover, length
from .report import md_table, write_json
from .trace_events import GpuOp, Timeline, load

ENGINE_PREFIXES = ("offload/", "reload/")
DEFAULT_TOLERANCE_US = 50.0


@dataclass
class Copy:
    op: GpuOp
    direction: str  # offload / reload / other
    name: str  # group name, or "(other copies)"
    layer: int | None
    label: str


def parse_range_name(text: str) -> tuple[str, str, int | None]:
    """``offload/core_attn/L3/mb0`` -> ``("offload", "core_attn", 3)``."""
    parts = text.split("/")
    if len(parts) < 2 or parts[0] not in ("offload", "reload"):
        raise ValueError(f"not an engine range: {text!r}")
    layer = None
    for p in parts[2:]:
        if len(p) > 1 and p[0] == "L" and p[1:].isdigit():
            layer = int(p[1:])
    return parts[0], parts[1], layer


def copies(tl: Timeline) -> list[Copy]:
    """Every device<->host copy, attributed to the engine range it was launched in."""
    out = []
    for op in tl.ops:
        if op.kind != "memcpy" or op.copy not in ("d2h", "h2d"):
            continue
        launch = tl.launches.get(op.correlation) if op.correlation is not None else None
        r = tl.range_at(launch[0], launch[1], ENGINE_PREFIXES) if launch else None
        if r is None:
            out.append(Copy(op, "other", "(other copies)", None, ""))
        else:
            direction, name, layer = parse_range_name(r.name)
            out.append(Copy(op, direction, name, layer, r.name[len(direction) + 1:]))
    return out


def compute_stream(tl: Timeline) -> int | None:
    """The stream with the most kernel time."""
    per: dict[int, float] = {}
    for op in tl.ops:
        if op.kind == "kernel":
            per[op.stream] = per.get(op.stream, 0.0) + op.dur
    return max(per, key=per.get) if per else None


def waits(tl: Timeline, cps: list[Copy], stream: int, tolerance_us: float) -> dict[tuple[str, str], float]:
    """Microseconds the compute stream waited, per (direction, name) of the copy it waited for."""
    ops = sorted((o for o in tl.ops if o.stream == stream), key=lambda o: o.start)
    ends = sorted(((c.op.end, c) for c in cps if c.direction != "other"), key=lambda x: x[0])
    end_times = [e for e, _ in ends]
    out: dict[tuple[str, str], float] = {}
    for prev, nxt in zip(ops, ops[1:]):
        if nxt.start - prev.end <= 0 or nxt.correlation not in tl.launches:
            continue
        ready = max(prev.end, tl.launches[nxt.correlation][1])
        if nxt.start - ready <= 0:
            continue
        i = bisect.bisect_right(end_times, nxt.start) - 1
        if i < 0:
            continue
        end, c = ends[i]
        if end >= ready and nxt.start - end <= tolerance_us:
            key = (c.direction, c.name)
            out[key] = out.get(key, 0.0) + (nxt.start - ready)
    return out


def analyze(tl: Timeline, tolerance_us: float = DEFAULT_TOLERANCE_US) -> dict[str, Any]:
    """Streams, per-name copy overlap and waits, as a JSON-ready dict (times in ms)."""
    if not tl.ops:
        raise ValueError(f"{tl.source}: no GPU operations in the trace (recorded without CUDA?)")
    cps = copies(tl)
    kernels = Cover((o.start, o.end) for o in tl.ops if o.kind == "kernel")
    main = compute_stream(tl)
    t0 = min(o.start for o in tl.ops)
    t1 = max(o.end for o in tl.ops)
    streams = []
    for s in sorted({o.stream for o in tl.ops}):
        ops = [o for o in tl.ops if o.stream == s]
        d2h = [c for c in cps if c.op.stream == s and c.op.copy == "d2h"]
        h2d = [c for c in cps if c.op.stream == s and c.op.copy == "h2d"]
        role = "compute" if s == main else ("D2H copies" if d2h and not h2d else "H2D copies" if h2d and not d2h
                                           else "copies" if d2h or h2d else "other")
        streams.append({
            "stream": s, "role": role, "ops": len(ops),
            "busy_ms": length((o.start, o.end) for o in ops) / 1e3,
            "kernel_ms": length((o.start, o.end) for o in ops if o.kind == "kernel") / 1e3,
            "copy_ms": length((c.op.start, c.op.end) for c in d2h + h2d) / 1e3,
        })
    waited = waits(tl, cps, main, tolerance_us) if main is not None else {}
    groups: dict[tuple[str, str], dict[str, Any]] = {}
    for c in cps:
        g = groups.setdefault((c.direction, c.name), {"direction": c.direction, "name": c.name, "copies": 0,
                                                       "bytes": 0, "copy_ms": 0.0, "overlapped_ms": 0.0})
        g["copies"] += 1
        g["bytes"] += c.op.bytes
        g["copy_ms"] += c.op.dur / 1e3
        g["overlapped_ms"] += kernels.covered(c.op.start, c.op.end) / 1e3
    for key, g in groups.items():
        g["gbps"] = g["bytes"] / (g["copy_ms"] * 1e6) if g["copy_ms"] > 0 else None
        g["overlap"] = g["overlapped_ms"] / g["copy_ms"] if g["copy_ms"] > 0 else None
        g["compute_wait_ms"] = waited.get(key, 0.0) / 1e3
    engine = [c for c in cps if c.direction != "other"]
    total_copy = sum(c.op.dur for c in engine)
    return {
        "source": tl.source, "span_ms": (t1 - t0) / 1e3, "compute_stream": main,
        "tolerance_us": tolerance_us, "streams": streams,
        "groups": sorted(groups.values(), key=lambda g: (g["direction"] == "other", g["direction"], g["name"])),
        "engine_copy_ms": total_copy / 1e3,
        "engine_overlap": (sum(kernels.covered(c.op.start, c.op.end) for c in engine) / total_copy
                           if total_copy else None),
        "engine_wait_ms": sum(v for k, v in waited.items()) / 1e3,
        "kernel_busy_ms": length(kernels.parts) / 1e3,
        "layers_seen": sorted({c.layer for c in engine if c.layer is not None}),
    }


def render(result: dict[str, Any], engine_stats: dict[str, Any] | None = None) -> str:
    """Markdown tables of the analysis; with the engine's own statistics if given."""
    srows = [[s["stream"], s["role"], s["ops"], f"{s['busy_ms']:.2f}", f"{s['kernel_ms']:.2f}", f"{s['copy_ms']:.2f}"]
             for s in result["streams"]]
    grows = []
    for g in result["groups"]:
        grows.append([g["direction"], g["name"], g["copies"], f"{g['bytes'] / 2**20:.1f}", f"{g['copy_ms']:.2f}",
                      "n/a" if g["gbps"] is None else f"{g['gbps']:.1f}",
                      "n/a" if g["overlap"] is None else f"{g['overlap']:.1%}", f"{g['compute_wait_ms']:.3f}"])
    ov = result["engine_overlap"]
    lines = [
        f"{result['source']}: {result['span_ms']:.1f} ms of GPU time, kernels busy {result['kernel_busy_ms']:.1f} ms; "
        f"compute stream {result['compute_stream']}.", "",
        md_table(["stream", "role", "ops", "busy ms", "kernel ms", "copy ms"], srows, "rlrrrr"), "",
        md_table(["direction", "name", "copies", "MiB", "copy ms", "GB/s", "overlapped", "compute waited ms"],
                 grows, "llrrrrrr"), "",
        f"Engine copies: {result['engine_copy_ms']:.2f} ms, "
        + ("none found (were the ranges recorded? see docs/tools.md)" if ov is None else f"{ov:.1%} overlapped with kernels")
        + f"; the compute stream waited {result['engine_wait_ms']:.3f} ms for them "
        f"(tolerance {result['tolerance_us']:g} us).",
    ]
    if engine_stats:
        w = [(n, s["offload_wait_ms"], s["reload_wait_ms"]) for n, s in engine_stats["by_name"].items()]
        lines += ["", "The engine's own wait times for the same steps (IterationStats, CUDA events): "
                  + ", ".join(f"{n} {o:.3f} ms offload / {r:.3f} ms reload" for n, o, r in w) + "."]
    return "\n".join(lines)


def layer_picture(tl: Timeline, path: str | Path, layer: int | None = None) -> Path | None:
    """The timeline around the copies of one layer index, forward (offload) and backward (reload)
    side by side in one picture; ``None`` if the trace has no engine copies."""
    cps = [c for c in copies(tl) if c.direction != "other" and c.layer is not None]
    if not cps:
        return None
    layers = sorted({c.layer for c in cps})
    if layer is None:
        layer = layers[len(layers) // 2]
    if layer not in layers:
        raise ValueError(f"no engine copies of layer {layer}; layers with copies: {layers}")
    # the first step's copies of that layer: split per direction, take the first burst of each
    windows = []
    for direction in ("offload", "reload"):
        mine = sorted((c for c in cps if c.layer == layer and c.direction == direction), key=lambda c: c.op.start)
        if not mine:
            continue
        burst = [mine[0]]
        for c in mine[1:]:
            if c.op.start - burst[-1].op.end > 5 * max(c.op.dur for c in burst) + 1000:
                break
            burst.append(c)
        s, e = burst[0].op.start, max(c.op.end for c in burst)
        pad = max(e - s, 500.0)
        windows.append((direction, s - pad, e + pad))
    main = compute_stream(tl)
    names = sorted({c.name for c in cps})
    colors = {n: plot.PALETTE[i % len(plot.PALETTE)] for i, n in enumerate(names)}
    rows = []
    for direction, ws, we in windows:
        kern = [plot.Bar((o.start - ws) / 1e3, (o.end - ws) / 1e3) for o in tl.ops
                if o.stream == main and o.end > ws and o.start < we]
        rows.append((f"{direction}: compute", kern))
        for stream in sorted({c.op.stream for c in cps}):
            bars = [plot.Bar((c.op.start - ws) / 1e3, (c.op.end - ws) / 1e3, colors[c.name], c.label)
                    for c in cps if c.op.stream == stream and c.op.end > ws and c.op.start < we]
            if bars:
                rows.append((f"{direction}: stream {stream}", bars))
    legend = [("kernels", plot.GRAY)] + [(n, colors[n]) for n in names]
    return plot.timeline(path, rows, f"Layer {layer}: copies against compute (ms from the window's start)",
                         legend=legend)


def record(argv: list[str]) -> int:
    """Train the workload with offloading under torch.profiler; write the trace and the engine's stats."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    import offload

    from .profiler_ranges import profiler_ranges
    from .workload import add_workload_args, build_workload, spec_from_args

    p = argparse.ArgumentParser(prog="python -m offload.tools.overlap record")
    add_workload_args(p)
    p.add_argument("--modules", required=True, help="names to offload, e.g. core_attn,fc1")
    p.add_argument("--max-inflight-groups", type=int, default=1,
                   help="the engine's max_inflight_groups (the advice's free set may ask for more than 1)")
    p.add_argument("--steps", type=int, default=3, help="profiled steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--min-tensor-bytes", type=int, default=None)
    p.add_argument("--out", default="trace.json.gz", help=".json or .json.gz")
    args = p.parse_args(argv)
    spec = spec_from_args(args)
    work = build_workload(spec)
    cuda = work.device.type == "cuda"
    modules = list(offload.parse_module_list(args.modules))
    mtb = args.min_tensor_bytes if args.min_tensor_bytes is not None else (1 << 20 if cuda else 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        offload.configure(modules, min_tensor_bytes=mtb, max_inflight_groups=args.max_inflight_groups,
                          timing=True, device=work.device)  # the statistics' waits, every step
    handle = offload.attach(work.model, {n: work.mapping[n] for n in modules})
    for _ in range(args.warmup):
        work.step()
        offload.end_iteration()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    stats = []
    with profiler_ranges(), profile(activities=activities) as prof:
        for _ in range(args.steps):
            work.step()
            stats.append(offload.end_iteration().as_dict())
        if cuda:
            torch.cuda.synchronize()
    handle.remove()
    out = Path(args.out)
    export_trace(prof, out)
    summed: dict[str, dict[str, float]] = {}
    for s in stats:
        for n, g in s["by_name"].items():
            acc = summed.setdefault(n, {"offload_wait_ms": 0.0, "reload_wait_ms": 0.0, "bytes_offloaded": 0})
            for k in acc:
                acc[k] += g[k]
    write_json(str(out) + ".stats.json", {"workload": spec, "modules": modules, "steps": args.steps,
                                          "per_step": stats, "by_name": summed})
    print(f"trace: {out}; engine statistics: {out}.stats.json", file=sys.stderr)
    return 0


def export_trace(prof: Any, out: Path) -> None:
    """Write a ``torch.profiler`` profile's chrome trace to ``out`` (``.json``, or gzipped where
    it ends in ``.gz``), the form `report` reads."""
    out.parent.mkdir(parents=True, exist_ok=True)
    raw = out.with_suffix("") if out.suffix == ".gz" else out
    prof.export_chrome_trace(str(raw))
    if out.suffix == ".gz":
        with open(raw, "rb") as f, gzip.open(out, "wb") as g:
            shutil.copyfileobj(f, g)
        raw.unlink()


def report(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m offload.tools.overlap report")
    p.add_argument("trace", help="torch.profiler trace (.json, .json.gz) or nsys export (.sqlite)")
    p.add_argument("--stats", help="the engine statistics written by 'record' (default: TRACE.stats.json if present)")
    p.add_argument("--tolerance-us", type=float, default=DEFAULT_TOLERANCE_US)
    p.add_argument("--png", help="picture of one layer's copies against compute")
    p.add_argument("--layer", type=int, help="layer index for the picture (default: the middle one)")
    p.add_argument("--json", help="write the analysis here")
    args = p.parse_args(argv)
    try:
        tl = load(args.trace)
        result = analyze(tl, args.tolerance_us)
    except ValueError as e:
        p.error(str(e))
    stats_path = args.stats or (args.trace + ".stats.json")
    stats = json.loads(Path(stats_path).read_text()) if Path(stats_path).is_file() else None
    print(render(result, stats))
    if args.json:
        write_json(args.json, result)
    if args.png:
        written = layer_picture(tl, args.png, args.layer)
        print(f"picture: {written}" if written else "picture: none (no engine copies in the trace)", file=sys.stderr)
    return 0


def compute_kernels(tl: Timeline, width: int = 160) -> dict[str, tuple[int, float]]:
    """Per kernel name (its first ``width`` characters): how many ran on the compute stream and
    their milliseconds."""
    main = compute_stream(tl)
    out: dict[str, tuple[int, float]] = {}
    for op in tl.ops:
        if op.stream == main and op.kind == "kernel":
            count, ms = out.get(op.name[:width], (0, 0.0))
            out[op.name[:width]] = (count + 1, ms + op.dur / 1e3)
    return out


def kernel_difference(a: Timeline, b: Timeline, top: int = 20) -> str:
    """A table of the compute stream's kernels of ``a`` against ``b``, the ``top`` names whose
    time differs most first: where one run's compute stream did more work than the other's
    (a copy kernel, a kernel on other strides)."""
    ka, kb = compute_kernels(a), compute_kernels(b)
    total_a, total_b = (sum(ms for _, ms in k.values()) for k in (ka, kb))
    both = [(name, ka.get(name, (0, 0.0)), kb.get(name, (0, 0.0))) for name in set(ka) | set(kb)]
    both.sort(key=lambda item: -abs(item[1][1] - item[2][1]))
    rows = [[f"{ta - tb:+.2f}", str(ca), f"{ta:.2f}", str(cb), f"{tb:.2f}", f"`{name}`"]
            for name, (ca, ta), (cb, tb) in both]
    head = (f"compute-stream kernels: A {total_a:.2f} ms ({a.source}), B {total_b:.2f} ms ({b.source}), "
            f"A - B {total_a - total_b:+.2f} ms")
    return head + "\n\n" + md_table(["A - B ms", "A count", "A ms", "B count", "B ms", "kernel"], rows[:top], "rrrrrl")


def kernels(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="python -m offload.tools.overlap kernels")
    p.add_argument("a", help="a trace, as for 'report'")
    p.add_argument("b", help="the trace to compare it with")
    p.add_argument("--top", type=int, default=20, help="kernel names shown")
    args = p.parse_args(argv)
    if args.top < 1:
        p.error(f"--top {args.top}: show at least 1 kernel name")
    try:
        a, b = load(args.a), load(args.b)
        a.source, b.source = args.a, args.b
        print(kernel_difference(a, b, args.top))
    except ValueError as e:
        p.error(str(e))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"record": record, "report": report, "kernels": kernels}
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="'COMMAND --help' lists a command's options.")
    p.add_argument("command", choices=commands, help="record: train under torch.profiler and write a trace; "
                                                     "report: analyze a trace; kernels: compare two traces' "
                                                     "compute-stream kernels")
    command = p.parse_args(argv[:1]).command
    return commands[command](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
