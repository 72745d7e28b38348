"""Copy bandwidth between the GPU and host memory, as the engine sees it.

    python -m offload.tools.bandwidth --out bandwidth.json
    python -m offload.tools.bandwidth --sizes-mib 1 16 256 --no-pageable --no-slowdown

Measures device-to-host, host-to-device and both at once (two streams), into pinned and into
pageable host memory, over a range of sizes, timed with CUDA events on the copy streams (what
``nvbandwidth`` reports, from PyTorch). Also measures how much a compute-bound matmul slows
down while copies run both ways on side streams (``compute_slowdown``), which the advisor
uses to price copies that do overlap compute. Prints a table and writes JSON; `Bandwidth` reads
it back and interpolates the bandwidth at any size.
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .report import md_table, publish, read_json

DIRECTIONS = ("d2h", "h2d", "both")
DEFAULT_SIZES_MIB = [0.25, 1, 4, 16, 64, 256, 1024]


def _copy_pair(size: int, pinned: bool, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    dev = torch.empty(size, dtype=torch.uint8, device=device)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=pinned)
    dev.fill_(1)
    host.fill_(2)
    return dev, host


def measure_copy(size: int, direction: str, pinned: bool, repeats: int, device: torch.device) -> dict[str, Any]:
    """GB/s of ``repeats`` copies of ``size`` bytes (median over repeats). ``both`` runs a D2H and
    an H2D copy of ``size`` bytes each at once on two streams and reports their sum."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction must be one of {DIRECTIONS}, got {direction!r}")
    dev, host = _copy_pair(size, pinned, device)
    dev2, host2 = _copy_pair(size, pinned, device) if direction == "both" else (None, None)
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)
    times = []
    for i in range(repeats + 1):  # the first is a warm-up
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(s1)
        s2.wait_event(start)
        with torch.cuda.stream(s1):
            if direction == "h2d":
                dev.copy_(host, non_blocking=True)
            else:
                host.copy_(dev, non_blocking=True)
        if direction == "both":
            with torch.cuda.stream(s2):
                dev2.copy_(host2, non_blocking=True)
            s1.wait_stream(s2)
        end.record(s1)
        end.synchronize()
        if i:
            times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    moved = size * (2 if direction == "both" else 1)
    return {"direction": direction, "pinned": pinned, "bytes": size, "ms": ms, "gbps": moved / ms / 1e6}


def measure_slowdown(device: torch.device, copy_bytes: int = 256 << 20, n: int = 8192, iters: int = 20) -> dict[str, Any]:
    """How much slower a bf16 ``n``x``n`` matmul stream runs while D2H and H2D copies of
    ``copy_bytes`` run on two side streams the whole time (memory and link contention)."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    d2h_dev, d2h_host = _copy_pair(copy_bytes, True, device)
    h2d_dev, h2d_host = _copy_pair(copy_bytes, True, device)
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

    reps = [4]

    def run(with_copies: bool) -> float:
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        if with_copies:
            s1.wait_event(start)
            s2.wait_event(start)
            with torch.cuda.stream(s1):
                for _ in range(reps[0]):
                    d2h_host.copy_(d2h_dev, non_blocking=True)
            with torch.cuda.stream(s2):
                for _ in range(reps[0]):
                    h2d_dev.copy_(h2d_host, non_blocking=True)
        for _ in range(iters):
            torch.mm(a, b)
        end.record()
        end.synchronize()
        ms = start.elapsed_time(end)
        torch.cuda.synchronize(device)
        return ms

    run(False)
    alone = statistics.median(run(False) for _ in range(3))
    # copies for about twice the matmuls' time (at ~50 GB/s), so that every matmul overlaps copies
    reps[0] = max(4, int(2 * alone / (copy_bytes / 50e6)) + 1)
    shared = statistics.median(run(True) for _ in range(3))
    return {"matmul_n": n, "iters": iters, "alone_ms": alone, "with_copies_ms": shared,
            "slowdown": max(0.0, shared / alone - 1)}


@dataclass
class Bandwidth:
    """Measured pinned bandwidth per direction, interpolated (log-linear in size) between sizes
    and held constant beyond the smallest and largest measured size."""

    points: dict[str, list[tuple[int, float]]]
    compute_slowdown: float = 0.0

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Bandwidth":
        """From the probe's JSON (pinned records only)."""
        if "records" not in data:
            raise ValueError("not a bandwidth probe result: no 'records'")
        points: dict[str, list[tuple[int, float]]] = {}
        for r in data["records"]:
            if r["pinned"]:
                points.setdefault(r["direction"], []).append((int(r["bytes"]), float(r["gbps"])))
        for d in ("d2h", "h2d"):
            if not points.get(d):
                raise ValueError(f"the bandwidth probe result has no pinned {d} records")
        for v in points.values():
            v.sort()
        slowdown = (data.get("compute_slowdown") or {}).get("slowdown", 0.0)
        return cls(points, float(slowdown))

    @classmethod
    def load(cls, path: str | Path) -> "Bandwidth":
        return cls.from_json(read_json(path, "bandwidth"))

    @classmethod
    def constant(cls, gbps: float, compute_slowdown: float = 0.0) -> "Bandwidth":
        """A link of ``gbps`` at every size (for estimates without a measurement)."""
        if gbps <= 0:
            raise ValueError(f"bandwidth must be > 0, got {gbps}")
        return cls({"d2h": [(1, gbps)], "h2d": [(1, gbps)]}, compute_slowdown)

    def gbps(self, direction: str, size: int) -> float:
        """GB/s of one copy of ``size`` bytes in ``direction`` (``d2h`` or ``h2d``)."""
        import math

        pts = self.points[direction]
        sizes = [s for s, _ in pts]
        if size <= sizes[0]:
            return pts[0][1]
        if size >= sizes[-1]:
            return pts[-1][1]
        i = bisect.bisect_right(sizes, size)
        (s0, g0), (s1, g1) = pts[i - 1], pts[i]
        w = (math.log(size) - math.log(s0)) / (math.log(s1) - math.log(s0))
        return g0 + w * (g1 - g0)

    def copy_ms(self, direction: str, size: int) -> float:
        """Milliseconds to copy ``size`` bytes in ``direction``."""
        return size / self.gbps(direction, size) / 1e6 if size > 0 else 0.0


def table(data: dict[str, Any]) -> str:
    """The probe's result as a Markdown table: one row per size, one column per direction/memory."""
    cols = [(d, p) for p in (True, False) for d in DIRECTIONS
            if any(r["direction"] == d and r["pinned"] == p for r in data["records"])]
    by = {(r["bytes"], r["direction"], r["pinned"]): r["gbps"] for r in data["records"]}
    sizes = sorted({r["bytes"] for r in data["records"]})
    headers = ["size"] + [f"{d.upper()} {'pinned' if p else 'pageable'} GB/s" for d, p in cols]
    rows = []
    for s in sizes:
        label = f"{s / 2**20:g} MiB"
        rows.append([label] + [f"{by[(s, d, p)]:.1f}" if (s, d, p) in by else "" for d, p in cols])
    text = md_table(headers, rows)
    sd = data.get("compute_slowdown")
    if sd:
        text += (f"\n\nA {sd['matmul_n']}x{sd['matmul_n']} bf16 matmul stream: {sd['alone_ms']:.1f} ms alone, "
                 f"{sd['with_copies_ms']:.1f} ms with copies both ways on side streams "
                 f"(slowdown {100 * sd['slowdown']:.1f}%).")
    return text


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mib", type=float, nargs="+", default=DEFAULT_SIZES_MIB)
    p.add_argument("--repeats", type=int, default=10, help="copies per measurement (median)")
    p.add_argument("--no-pageable", action="store_true", help="pinned host memory only")
    p.add_argument("--no-slowdown", action="store_true", help="skip the compute-slowdown measurement")
    p.add_argument("--out", default="bandwidth.json")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device: there is no link to measure on a CPU-only machine")
    if args.repeats < 1 or any(s <= 0 for s in args.sizes_mib):
        p.error("--repeats must be >= 1 and every size > 0")
    device = torch.device("cuda", torch.cuda.current_device())
    records = []
    for pinned in (True,) if args.no_pageable else (True, False):
        for mib_ in args.sizes_mib:
            size = int(mib_ * 2**20)
            for d in DIRECTIONS:
                # pageable copies are slow: fewer repeats for large sizes
                repeats = args.repeats if pinned or size <= 64 << 20 else max(1, args.repeats // 5)
                records.append(measure_copy(size, d, pinned, repeats, device))
                print(f"{d:4} {'pinned' if pinned else 'pageable'} {mib_:8g} MiB {records[-1]['gbps']:6.1f} GB/s",
                      file=sys.stderr)
    data: dict[str, Any] = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__,
                            "command": "python -m offload.tools.bandwidth " + " ".join(argv or sys.argv[1:]),
                            "records": records}
    if not args.no_slowdown:
        data["compute_slowdown"] = measure_slowdown(device)
    publish(args.out, data, f"# Copy bandwidth, {data['device']}\n\n{table(data)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
