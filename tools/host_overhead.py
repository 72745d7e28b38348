"""Host time that offloading adds per group, and which engine entry point spends it.

    python tools/host_overhead.py --modules core_attn --layers 8

The GPU work is kept small (a small model; the GPU is synchronized after each step), so the
figures are host cost. Forward and backward are timed apart, and every engine entry point is
timed by `offload.tools.engine_timers` (which also covers the hooks that backward runs on
autograd's own thread, where a profiler of the main thread does not see them), and so is Python's
garbage collector. ``tools/profile_step.py --engine`` gives the same table for any training script.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import offload
from offload.testing import GPT_MAPPING, build_gpt
from offload.tools.engine_timers import EngineTimers


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

    medians = {}
    for mods in ([], modules):
        timers = EngineTimers().install() if mods else None  # before configure: the hooks bind then
        offload.configure(mods, min_tensor_bytes=0, timing=args.timing, device=device)
        handle = offload.attach(model, {k: GPT_MAPPING[k] for k in mods}) if mods else None
        for _ in range(5):
            step()
        if timers:
            timers.clear()
        fwd, bwd = zip(*(step() for _ in range(args.steps)))
        medians[bool(mods)] = (statistics.median(fwd), statistics.median(bwd))
        if handle:
            handle.remove()
        if timers:
            timers.remove()
            table = timers.table(args.steps)
    n_groups = args.layers * len(modules)
    (f0, b0), (f1, b1) = medians[False], medians[True]
    print(f"{','.join(modules)}: {n_groups} groups on {device}")
    print(f"  forward host time  {f0 * 1e3:7.2f} ms -> {f1 * 1e3:7.2f} ms  (+{(f1 - f0) / n_groups * 1e6:.0f} us per group)")
    print(f"  backward host time {b0 * 1e3:7.2f} ms -> {b1 * 1e3:7.2f} ms  (+{(b1 - b0) / n_groups * 1e6:.0f} us per group)")
    print(table)


if __name__ == "__main__":
    main()
