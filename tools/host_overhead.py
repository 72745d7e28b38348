"""Host time that offloading adds per group: forward+backward launch time with and without
offloading, and where it goes (cProfile of the offloading run).

    python tools/host_overhead.py --modules core_attn --layers 8

The GPU work is kept tiny (the model is small and the GPU is synchronized after each step),
so the figures are host cost, not GPU time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

import offload
from offload.testing import GPT_MAPPING, build_gpt


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

    def step() -> float:
        t0 = time.perf_counter()
        model(x).backward(g)
        host = time.perf_counter() - t0
        offload.end_iteration()
        if device == "cuda":
            torch.cuda.synchronize()
        return host

    results = {}
    for mods in ([], modules):
        offload.configure(mods, min_tensor_bytes=0, timing=args.timing, device=device)
        handle = offload.attach(model, {k: GPT_MAPPING[k] for k in mods}) if mods else None
        for _ in range(5):
            step()
        results[bool(mods)] = statistics.median(step() for _ in range(args.steps))
        if mods:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(5):
                step()
            prof.disable()
        if handle:
            handle.remove()
    n_groups = args.layers * len(modules)
    extra = results[True] - results[False]
    print(f"host time per step: {results[False] * 1e3:.2f} ms without, {results[True] * 1e3:.2f} ms with "
          f"offloading {','.join(modules)} ({n_groups} groups): {extra / n_groups * 1e6:.0f} us per group")
    pstats.Stats(prof).sort_stats("tottime").print_stats(20)


if __name__ == "__main__":
    main()
