"""GPU benchmark: host time per step, eager offloading vs offloading captured in CUDA graphs.

    python benchmarks/graphs_host_time.py --out docs/results

A layer stack small enough that the host matters (the regime where frameworks capture graphs),
each layer one graphed callable (`offload.graphs.make_graphed_callables`), one microbatch per
step. Four configurations in one process, each on a fresh model and engine: eager and graphed,
without and with offloading. Per configuration: median host time to issue a step (forward and
backward, no synchronization inside), median GPU step time (CUDA events, the GPU idle before
each step), peak allocated memory, and the saved-tensor hook calls per step (zero on replay).
Results: ``<out>/graphs_host_time.json`` and ``<out>/graphs_host_time.md``.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a clone, no install

import torch  # noqa: E402

import offload  # noqa: E402
from offload.testing import GPT_MAPPING, build_gpt  # noqa: E402

NAMES = ["core_attn", "fc1", "mlp_act", "fc2"]


def run(args: argparse.Namespace, graphed: bool, offloading: bool) -> dict:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    dtype = getattr(torch, args.dtype)
    model = build_gpt(args.hidden, args.heads, args.layers, dtype=dtype, device="cuda")
    manager = offload.configure(NAMES if offloading else [], device="cuda", timing=False)
    offload.attach(model, GPT_MAPPING)
    shape = (args.seq, args.batch, args.hidden)
    layers = list(model.layers)
    if graphed:
        sample = tuple((torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True),) for _ in layers)
        layers = list(offload.graphs.make_graphed_callables(tuple(layers), sample))
    x = torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True)
    g = torch.randn(shape, device="cuda", dtype=dtype)

    def step() -> None:
        h = x
        for layer in layers:
            h = layer(h)
        h.backward(g)

    for _ in range(args.warmup):
        step()
        offload.end_iteration()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    host, gpu, calls = [], [], []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before = manager.hook_calls
        start.record()
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end))
        calls.append(manager.hook_calls - before)
        offload.end_iteration()
    stats = offload.end_iteration()
    held = sum(rec.nbytes for grp in manager.captured_groups for rec in grp.records
               if rec.src is not None or rec.dev is not None)
    record = {
        "config": f"{'graphed' if graphed else 'eager'}, {'offload ' + ','.join(NAMES) if offloading else 'no offloading'}",
        "graphed": graphed, "offloading": offloading,
        "host_ms": statistics.median(host), "step_ms": statistics.median(gpu),
        "peak_allocated": torch.cuda.max_memory_allocated(), "hook_calls_per_step": statistics.median(calls),
        "pinned_bytes": stats.pinned_bytes,
        "captured_groups": len(manager.captured_groups),
        "captured_bytes_held_on_gpu": held,
    }
    offload.reset(release_pool=True)
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="docs/results")
    args = p.parse_args(argv)
    records = []
    for graphed in (False, True):
        for offloading in (False, True):
            records.append(run(args, graphed, offloading))
            print(json.dumps(records[-1]), flush=True)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "command": shlex.join(["python", "benchmarks/graphs_host_time.py", *(argv or sys.argv[1:])]),
            "model": f"{args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
                     f"batch {args.batch}, {args.dtype}",
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "graphs_host_time.json").write_text(json.dumps({"meta": meta, "records": records}, indent=1) + "\n")
    lines = ["# Host time per step: eager vs captured offloading", "",
             f"{meta['device']}, torch {meta['torch']}, {meta['date']}; model: {meta['model']}; "
             f"median of {args.steps} steps after {args.warmup} warm-up. Command: `{meta['command']}`", "",
             "| configuration | host ms / step | GPU ms / step | peak allocated GiB | hook calls / step | pinned MiB |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in records:
        lines.append(f"| {r['config']} | {r['host_ms']:.2f} | {r['step_ms']:.2f} | "
                     f"{r['peak_allocated'] / 2**30:.3f} | {r['hook_calls_per_step']:.0f} | "
                     f"{r['pinned_bytes'] / 2**20:.0f} |")
    (out / "graphs_host_time.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
