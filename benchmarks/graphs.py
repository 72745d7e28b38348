"""GPU benchmark: offloading captured in per-layer CUDA graphs, against the same graphs without it.

    python benchmarks/graphs.py --out docs/results

A GPT layer stack (`offload.testing.build_gpt`, bf16, batch 1) run eagerly and as graphed
callables of 1, 2 or 4 layers each (`offload.graphs.make_graphed_callables`, all graphs in one
memory pool, captured all forwards then all backwards, as torch captures them), with and
without offloading the names given. Each configuration runs in a Python process of its own.
Per configuration: the median GPU time of a step (CUDA events, the GPU idle
before each step) and the median host time to issue it; the graphs' private pool
(`offload.testing.graph_pool_bytes`) and the peak allocated outside it
(``max_memory_allocated`` over the timed steps); the bytes offloaded per step (graphed: what
every replay copies out, the captured groups' buffers; eager: the engine's count).

Writes ``<out>/graphs.json`` (``{"records": [...]}``, one record per configuration with exactly
the fields `FIELDS`) and ``<out>/graphs.md``, whose table adds, per graphed configuration with
offloading, its step time against the same graphs without offloading and the share of the
offloaded bytes that left the GPU's memory: (pool + peak without) - (pool + peak with), over
the bytes offloaded per step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a clone, no install

import torch  # noqa: E402

FIELDS = ("mode", "layers_per_graph", "names", "offload", "hidden", "seq", "step_ms", "host_ms",
          "graph_pool_bytes", "peak_allocated_bytes", "offloaded_bytes", "device", "command")
NAME_SETS = ("core_attn", "qkv_linear,core_attn,attn_proj")


def measure(config: dict, args: argparse.Namespace) -> dict:
    """Run one configuration (in its own process) and return its record."""
    import offload
    from offload.group import GroupState
    from offload.testing import GPT_MAPPING, build_gpt, graph_pool_bytes

    hidden, seq, per_graph = config["hidden"], config["seq"], config["layers_per_graph"]
    names = config["names"].split(",") if config["offload"] else []
    dtype = torch.bfloat16
    model = build_gpt(hidden, hidden // 128, args.layers, dtype=dtype, device="cuda")
    manager = offload.configure(names, device="cuda", timing=False)
    offload.attach(model, GPT_MAPPING)
    shape = (seq, 1, hidden)
    layers = list(model.layers)
    if per_graph:
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
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    host, gpu, offloaded = [], [], []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        step()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
        end.synchronize()
        gpu.append(start.elapsed_time(end))
        offloaded.append(offload.end_iteration().total().bytes_offloaded)
    if per_graph:  # what the replays copy out is what the captures planned: the captured groups' buffers
        per_step = sum(rec.nbytes for grp in manager.captured_groups if grp.state is GroupState.OFFLOADED
                       for rec in grp.records if rec.host is not None)
    else:
        per_step = int(statistics.median(offloaded))
    record = {
        "mode": "graphed" if per_graph else "eager", "layers_per_graph": per_graph,
        "names": config["names"], "offload": config["offload"], "hidden": hidden, "seq": seq,
        "step_ms": round(statistics.median(gpu), 3), "host_ms": round(statistics.median(host), 3),
        "graph_pool_bytes": graph_pool_bytes(), "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
        "offloaded_bytes": per_step, "device": torch.cuda.get_device_name(), "command": args.command,
    }
    return record


def run_isolated(config: dict, args: argparse.Namespace) -> dict:
    """`measure` in a fresh Python process (this file with ``--one``)."""
    command = [sys.executable, __file__, "--one", json.dumps(config), "--layers", str(args.layers),
               "--steps", str(args.steps), "--warmup", str(args.warmup), "--command", args.command]
    proc = subprocess.run(command, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"configuration {config} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def table(records: list[dict]) -> list[str]:
    """The Markdown table: one row per record, graphed-with-offloading rows compared with
    the same graphs without offloading."""
    def key(r: dict, offloading: bool) -> tuple:
        return (r["mode"], r["layers_per_graph"], r["names"], offloading, r["hidden"], r["seq"])

    by_key = {key(r, r["offload"]): r for r in records}
    lines = ["| mode | layers/graph | names | offload | hidden | seq | step ms | vs. no offload | host ms "
             "| graph pool GiB | peak allocated GiB | offloaded GiB/step | share of offloaded bytes saved |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in records:
        base = by_key.get(key(r, False)) if r["offload"] else None
        vs = saved = "-"
        if base is not None:
            vs = f"{100 * (r['step_ms'] / base['step_ms'] - 1):+.1f}%"
            if r["offloaded_bytes"]:
                freed = (base["graph_pool_bytes"] + base["peak_allocated_bytes"]
                         - r["graph_pool_bytes"] - r["peak_allocated_bytes"])
                saved = f"{100 * freed / r['offloaded_bytes']:.0f}%"
        lines.append(
            f"| {r['mode']} | {r['layers_per_graph']} | {r['names']} | {'yes' if r['offload'] else 'no'} | "
            f"{r['hidden']} | {r['seq']} | {r['step_ms']:.2f} | {vs} | {r['host_ms']:.2f} | "
            f"{r['graph_pool_bytes'] / 2**30:.3f} | {r['peak_allocated_bytes'] / 2**30:.3f} | "
            f"{r['offloaded_bytes'] / 2**30:.3f} | {saved} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--names", nargs="+", default=list(NAME_SETS), help="comma-separated offload names, one set each")
    p.add_argument("--layers-per-graph", type=int, nargs="+", default=[1, 2, 4],
                   help="graphed configurations (0 adds nothing: the eager rows always run)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="docs/results")
    p.add_argument("--append", action="store_true",
                   help="keep the records of <out>/graphs.json for configurations this run does not measure")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a configuration (JSON), measured in this process
    p.add_argument("--command", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("graphs.py needs a CUDA device (it measures CUDA graphs on the GPU)")
    if args.one:
        print(json.dumps(measure(json.loads(args.one), args)), flush=True)
        return 0
    args.command = shlex.join(["python", "benchmarks/graphs.py", *(sys.argv[1:] if argv is None else argv)])
    per_graphs = [0, *sorted(set(args.layers_per_graph) - {0})]
    records = []
    for hidden, seq, names, per_graph in itertools.product(args.hidden, args.seq, args.names, per_graphs):
        for offloading in (False, True):
            config = {"hidden": hidden, "seq": seq, "names": names, "layers_per_graph": per_graph,
                      "offload": offloading}
            records.append(run_isolated(config, args))
            print(json.dumps(records[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.append and (out / "graphs.json").exists():
        def key(r: dict) -> tuple:
            return tuple(r[f] for f in FIELDS[:6])

        ran = {key(r) for r in records}
        kept = [r for r in json.loads((out / "graphs.json").read_text())["records"] if key(r) not in ran]
        records = sorted(kept + records, key=lambda r: (r["hidden"], r["seq"], r["names"], r["layers_per_graph"],
                                                          r["offload"]))
    assert all(tuple(r) == FIELDS for r in records)
    (out / "graphs.json").write_text(json.dumps({"records": records}, indent=1) + "\n")
    lines = ["# Offloading in per-layer CUDA graphs", "",
             f"{records[0]['device']}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}; {args.layers} GPT "
             f"layers, batch 1, bf16, heads = hidden / 128; median of {args.steps} steps after {args.warmup} "
             "warm-up, each configuration in its own process. Commands (each record has its own):", "",
             *sorted({f"    {r['command']}" for r in records}), "",
             *table(records)]
    (out / "graphs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
