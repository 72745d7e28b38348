"""GPU benchmark: host time per step, eager offloading vs offloading captured in CUDA graphs.

    python benchmarks/graphs_host_time.py --out docs/results

A layer stack small enough that the host matters (the regime where frameworks capture graphs),
graphed with `offload.graphs.make_graphed_callables` one layer per callable and several layers
per callable (``--layers-per-graph``), one microbatch per step. The configurations run in one
process, one after the other, each on a fresh model and engine after the previous one's graphs
were collected: eager, then graphed, without and with offloading. Per configuration: median host
time to issue a step (forward and backward, no synchronization inside), median GPU step time
(CUDA events, the GPU idle before each step), the saved-tensor hook calls per step (zero on
replay), and memory: peak allocated, peak reserved, and the graphs' private pool.

Graphed, a step's activations are not in ``max_memory_allocated``: they live in the graphs'
private pool (allocated and freed inside the captures, and kept reserved for the replays), so
the figure to compare is the peak reserved memory, which counts the pool.
Results: ``<out>/graphs_host_time.json`` and ``<out>/graphs_host_time.md``.
"""

from __future__ import annotations

import argparse
import gc
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a clone, no install

import torch  # noqa: E402

import offload  # noqa: E402
from offload.testing import GPT_MAPPING, build_gpt, graph_pool_bytes  # noqa: E402

NAMES = ["core_attn", "fc1", "mlp_act", "fc2"]


def run(args: argparse.Namespace, per_graph: int, offloading: bool) -> dict:
    """One configuration; ``per_graph`` layers per graphed callable (0: eager)."""
    gc.collect()  # the previous configuration's graphs (their callables hold reference cycles)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    graphed = per_graph > 0
    dtype = getattr(torch, args.dtype)
    model = build_gpt(args.hidden, args.heads, args.layers, dtype=dtype, device="cuda")
    manager = offload.configure(NAMES if offloading else [], device="cuda", timing=False)
    offload.attach(model, GPT_MAPPING)
    shape = (args.seq, args.batch, args.hidden)
    layers = list(model.layers)
    if graphed:
        blocks = tuple(torch.nn.Sequential(*layers[i:i + per_graph]) for i in range(0, len(layers), per_graph))
        sample = tuple((torch.randn(shape, device="cuda", dtype=dtype, requires_grad=True),) for _ in blocks)
        layers = list(offload.graphs.make_graphed_callables(blocks, sample))
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
    torch.cuda.empty_cache()  # what the warm-up and the captures cached but no longer use
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
    mode = f"graphed, {per_graph} layer{'s' if per_graph > 1 else ''} per graph" if graphed else "eager"
    record = {
        "config": f"{mode}, {'offload ' + ','.join(NAMES) if offloading else 'no offloading'}",
        "graphed": graphed, "layers_per_graph": per_graph, "offloading": offloading,
        "host_ms": statistics.median(host), "step_ms": statistics.median(gpu),
        "peak_allocated": torch.cuda.max_memory_allocated(), "peak_reserved": torch.cuda.max_memory_reserved(),
        "graph_pool": graph_pool_bytes(), "hook_calls_per_step": statistics.median(calls),
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
    p.add_argument("--layers-per-graph", type=int, nargs="+", default=[1, 4],
                   help="graphed configurations: layers per graphed callable")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="docs/results")
    args = p.parse_args(argv)
    records = []
    for per_graph in (0, *args.layers_per_graph):
        for offloading in (False, True):
            records.append(run(args, per_graph, offloading))
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
             "| configuration | host ms / step | GPU ms / step | peak allocated GiB | peak reserved GiB "
             "| graph pool GiB | hook calls / step | pinned MiB |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        lines.append(f"| {r['config']} | {r['host_ms']:.2f} | {r['step_ms']:.2f} | "
                     f"{r['peak_allocated'] / 2**30:.3f} | {r['peak_reserved'] / 2**30:.3f} | "
                     f"{r['graph_pool'] / 2**30:.3f} | {r['hook_calls_per_step']:.0f} | "
                     f"{r['pinned_bytes'] / 2**20:.0f} |")
    (out / "graphs_host_time.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
