"""Host time that offloading adds per group, and which engine entry point spends it.

    python tools/host_overhead.py --modules core_attn --layers 8

The GPU work is kept small (a small model; the GPU is synchronized after each step), so the
figures are host cost. Forward and backward are timed apart, and every engine entry point is
wrapped with a timer, which also covers the hooks that backward runs on autograd's own thread
(where a profiler of the main thread does not see them).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

import offload
from offload.chunk_lifecycle import ChunkLifecycle
from offload.copy_queue import CopyQueue
from offload.manager import PipelineOffloadManager
from offload.testing import GPT_MAPPING, build_gpt

ENTRY_POINTS = [
    (PipelineOffloadManager, ["open_group", "close_group", "_pack", "_unpack", "on_group_backward_done",
                              "begin_chunk"]),
    (CopyQueue, ["offload", "reload", "launch_deferred", "apply_bound", "poll", "release_all", "wait_reloaded"]),
    (ChunkLifecycle, ["begin_backward", "end_forward"]),
]


def _instrument(totals: dict[str, list[float]]) -> None:
    for owner, names in ENTRY_POINTS:
        for name in names:
            real = getattr(owner, name)

            def timed(self, *a, _real=real, _name=f"{owner.__name__}.{name}", **k):
                t0 = time.perf_counter()
                try:
                    return _real(self, *a, **k)
                finally:
                    totals[_name][0] += time.perf_counter() - t0
                    totals[_name][1] += 1

            setattr(owner, name, timed)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--modules", default="core_attn")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--timing", action="store_true", help="keep the engine's timing events on")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    modules = list(GPT_MAPPING) if args.modules == "all" else list(offload.parse_module_list(args.modules))
    model = build_gpt(args.hidden, 4, args.layers, device=device)
    x = torch.randn(args.seq, 1, args.hidden, device=device)
    g = torch.randn_like(x)

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        out = model(x)
        t1 = time.perf_counter()
        out.backward(g)
        t2 = time.perf_counter()
        offload.end_iteration()
        if device == "cuda":
            torch.cuda.synchronize()
        return t1 - t0, t2 - t1

    totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    medians = {}
    for mods in ([], modules):
        offload.configure(mods, min_tensor_bytes=0, timing=args.timing, device=device)
        handle = offload.attach(model, {k: GPT_MAPPING[k] for k in mods}) if mods else None
        for _ in range(5):
            step()
        if mods:
            _instrument(totals)
        fwd, bwd = zip(*(step() for _ in range(args.steps)))
        medians[bool(mods)] = (statistics.median(fwd), statistics.median(bwd))
        if handle:
            handle.remove()
    n_groups = args.layers * len(modules)
    (f0, b0), (f1, b1) = medians[False], medians[True]
    print(f"{','.join(modules)}: {n_groups} groups on {device}")
    print(f"  forward host time  {f0 * 1e3:7.2f} ms -> {f1 * 1e3:7.2f} ms  (+{(f1 - f0) / n_groups * 1e6:.0f} us per group)")
    print(f"  backward host time {b0 * 1e3:7.2f} ms -> {b1 * 1e3:7.2f} ms  (+{(b1 - b0) / n_groups * 1e6:.0f} us per group)")
    print("  per step, inside the engine (nested calls are counted in their callers too):")
    for name, (secs, calls) in sorted(totals.items(), key=lambda kv: -kv[1][0]):
        print(f"    {name:24} {secs / args.steps * 1e3:7.3f} ms  {calls / args.steps:6.0f} calls  "
              f"{secs / max(calls, 1) * 1e6:6.1f} us/call")


if __name__ == "__main__":
    main()
