"""GPU benchmark: a GPT-style layer stack with no offloading and with several module sets.

    python benchmarks/bench_layer_stack.py                       # the defaults below
    python benchmarks/bench_layer_stack.py --seq 4096 --configs none core_attn

Every (configuration, sequence length) runs in its own process, so that memory figures do
not leak between them. Per run: median step time (CUDA events around forward+backward, after
warm-up), peak allocated and reserved memory, bytes offloaded per step, achieved D2H and H2D
bandwidth, compute-stream wait time, pinned host bytes and host time per step. Results go to
``<out>/layer_stack.json`` (one record per run) and ``<out>/layer_stack.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

CONFIGS = {
    "none": [],
    "core_attn": ["core_attn"],
    "attn": ["qkv_linear", "core_attn", "attn_proj"],
    "mlp": ["fc1", "mlp_act", "fc2"],
    "all": ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "fc1", "mlp_act", "fc2"],
}
LINK_GBPS = 50.0  # the bandwidth the targets assume for "fits under compute"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=["none", "core_attn", "attn", "all"])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", default="docs/results")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def worker(args: argparse.Namespace, config: str, seq: int) -> dict:
    """One configuration at one sequence length, in this process."""
    import torch

    import offload
    from offload.testing import GPT_MAPPING, build_gpt

    cuda = args.device == "cuda"
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = build_gpt(args.hidden, args.heads, args.layers, dtype=dtype, device=args.device)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    modules = CONFIGS[config]
    offload.configure(modules, device=args.device, timing=True)
    if modules:
        offload.attach(model, {k: GPT_MAPPING[k] for k in modules})
    gen = torch.Generator(device=args.device).manual_seed(0)
    x = torch.randn(seq, args.batch, args.hidden, device=args.device, dtype=dtype, generator=gen)
    grad = torch.randn_like(x)

    def step() -> tuple[float, float]:
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        end = torch.cuda.Event(enable_timing=True) if cuda else None
        t0 = time.perf_counter()
        if cuda:
            start.record()
        model.zero_grad(set_to_none=False)
        model(x).backward(grad)
        if cuda:
            end.record()
        host_ms = (time.perf_counter() - t0) * 1e3
        return start, end, host_ms

    for _ in range(args.warmup):
        step()
        offload.end_iteration()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    step_ms, host_ms, per_step = [], [], []
    for _ in range(args.steps):
        start, end, host = step()
        stats = offload.end_iteration()  # timing=True: waits for this step's copies
        if cuda:
            end.synchronize()
        step_ms.append(start.elapsed_time(end) if cuda else host)
        host_ms.append(host)
        per_step.append(stats)
    total = per_step[-1].total()
    waits = statistics.median(s.total().offload_wait_ms + s.total().reload_wait_ms for s in per_step)
    return {
        "config": config,
        "modules": modules,
        "seq": seq,
        "step_ms": statistics.median(step_ms),
        "step_ms_min": min(step_ms),
        "host_ms": statistics.median(host_ms),
        "peak_allocated": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_reserved": torch.cuda.max_memory_reserved() if cuda else None,
        "offloaded_bytes": total.bytes_offloaded,
        "reloaded_bytes": total.bytes_reloaded,
        "reloads_on_demand": total.reloads_on_demand,
        "d2h_gbps": total.d2h_gbps,
        "h2d_gbps": total.h2d_gbps,
        "wait_ms": waits,
        "pinned_bytes": per_step[-1].pinned_bytes,
        "pinned_peak_in_use": per_step[-1].pinned_peak_bytes_in_use,
        "pinned_allocations_after_warmup": per_step[-1].pinned_allocations - per_step[0].pinned_allocations,
        "by_name": {k: v.bytes_offloaded for k, v in per_step[-1].by_name.items()},
    }


def run_all(args: argparse.Namespace, argv: list[str]) -> list[dict]:
    records = []
    runs = [(seq, cfg) for seq in args.seq for cfg in args.configs]
    for i, (seq, cfg) in enumerate(runs, 1):
        print(f"[{i}/{len(runs)}] seq {seq} config {cfg} ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, *argv, "--worker", f"{cfg}:{seq}"]
        out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if out.returncode != 0:
            raise SystemExit(f"worker {cfg}:{seq} failed:\n{out.stderr}")
        records.append(json.loads(out.stdout.strip().splitlines()[-1]))
    return records


def evaluate(records: list[dict], args: argparse.Namespace) -> None:
    """Add, to each record, the comparison with the no-offloading run of the same length and
    the issue's targets: where the bytes fit under compute at ~50 GB/s, step time within 2%;
    peak memory lower by >= 90% of the offloaded bytes."""
    base = {r["seq"]: r for r in records if r["config"] == "none"}
    for r in records:
        b = base.get(r["seq"])
        if b is None or r["config"] == "none":
            continue
        r["overhead_pct"] = 100 * (r["step_ms"] / b["step_ms"] - 1)
        offloaded_layers = max(args.layers - 1, 1)  # the last layer is kept on the GPU
        fwd_ms_per_layer = b["step_ms"] / 3 / args.layers  # backward ~ 2x forward
        copy_ms_per_layer = r["offloaded_bytes"] / offloaded_layers / (LINK_GBPS * 1e6)
        r["copy_ms_per_layer_at_50gbps"] = copy_ms_per_layer
        r["fwd_ms_per_layer"] = fwd_ms_per_layer
        r["fits_under_compute"] = copy_ms_per_layer <= fwd_ms_per_layer
        if b["peak_allocated"] is not None and r["offloaded_bytes"]:
            r["saved_bytes"] = b["peak_allocated"] - r["peak_allocated"]
            r["removed_over_offloaded"] = r["saved_bytes"] / r["offloaded_bytes"]
            r["target_memory_met"] = r["removed_over_offloaded"] >= 0.9
        r["target_time_met"] = r["overhead_pct"] <= 2.0 if r["fits_under_compute"] else None


def write(records: list[dict], args: argparse.Namespace, out_dir: Path, command: str, device: str, torch_version: str) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for r in records:
        r.update(device=device, torch=torch_version, command=command)
    (out_dir / "layer_stack.json").write_text(json.dumps(records, indent=2) + "\n")
    rows = [
        f"Measured on {device}, torch {torch_version}: GPT layer stack, {args.layers} layers, hidden {args.hidden}, "
        f"{args.heads} heads, batch {args.batch}, {args.dtype}; median of {args.steps} steps after {args.warmup} warm-up steps.",
        "",
        f"Command: `{command}`",
        "",
        "| seq | config | step ms | overhead | peak GiB | saved GiB | offloaded GiB/step | removed/offloaded "
        "| D2H GB/s | H2D GB/s | wait ms | pinned GiB | fits @50GB/s | time target | memory target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    rows += [_row(r) for r in records]
    (out_dir / "layer_stack.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f}"


def _verdict(value: bool | None) -> str:
    return "n/a" if value is None else ("met" if value else "not met")


def _row(r: dict) -> str:
    baseline = r["config"] == "none"
    cells = [
        str(r["seq"]), r["config"], f"{r['step_ms']:.1f}",
        "" if baseline else f"{r['overhead_pct']:+.1f}%",
        _gib(r["peak_allocated"]), _gib(r.get("saved_bytes")), _gib(r["offloaded_bytes"]),
        f"{100 * r['removed_over_offloaded']:.0f}%" if "removed_over_offloaded" in r else "",
        f"{r['d2h_gbps']:.1f}", f"{r['h2d_gbps']:.1f}", f"{r['wait_ms']:.2f}", _gib(r["pinned_bytes"]),
        "" if baseline else ("yes" if r["fits_under_compute"] else "no"),
        "" if baseline else _verdict(r.get("target_time_met")),
        "" if baseline else _verdict(r.get("target_memory_met")),
    ]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.worker:
        config, seq = args.worker.split(":")
        print(json.dumps(worker(args, config, int(seq))))
        return
    import torch

    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    records = run_all(args, argv)
    evaluate(records, args)
    command = "python benchmarks/bench_layer_stack.py " + " ".join(argv)
    write(records, args, Path(args.out), command.strip(), device, torch.__version__)


if __name__ == "__main__":
    main()
