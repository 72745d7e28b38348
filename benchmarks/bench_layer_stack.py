"""GPU benchmark: a GPT-style layer stack without offloading and with several module sets.

    python benchmarks/bench_layer_stack.py                                  # the defaults below
    python benchmarks/bench_layer_stack.py --seq 4096 --configs core_attn all
    python benchmarks/bench_layer_stack.py --device cpu --hidden 64 --heads 4 --layers 2 \\
        --seq 64 --steps 3 --warmup 1 --out /tmp/bench                      # end-to-end check

Every (configuration, sequence length) runs in a subprocess of its own (this script with the
hidden ``--worker`` flag), so memory figures do not leak between runs; ``none`` always runs, it
is the baseline. Results go to ``<out>/layer_stack.json`` and ``<out>/layer_stack.md``;
benchmarks/README.md explains every column and the targets.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a clone, no install

import torch  # noqa: E402
from torch import nn  # noqa: E402

import offload  # noqa: E402
from offload.config import DEFAULT_MIN_TENSOR_BYTES  # noqa: E402
from offload.stats import GroupStats, IterationStats  # noqa: E402
from offload.testing import GPT_MAPPING, Clock, build_gpt, saved_bytes_by_name  # noqa: E402

CONFIGS: dict[str, list[str]] = {
    "none": [],
    "core_attn": ["core_attn"],
    "attn": ["qkv_linear", "core_attn", "attn_proj"],
    "mlp": ["fc1", "mlp_act", "fc2"],
    "all": list(GPT_MAPPING),
}
DEFAULT_CONFIGS = ["none", "core_attn", "attn", "all"]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LINK_GBPS = 50.0  # the link bandwidth the time target assumes
TIME_TARGET_PCT = 2.0  # step time within this of no offloading ...
MEMORY_TARGET = 0.9  # ... and peak memory lower by this fraction of the offloaded bytes
TIMING_PASSES = 3  # forward passes timed in the baseline worker
GIB = 2**30


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192], help="one run per length")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=DEFAULT_CONFIGS,
                   help=f"module sets to offload (default {' '.join(DEFAULT_CONFIGS)}; none always runs)")
    p.add_argument("--steps", type=int, default=20, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=5, help="warm-up steps per run, not measured")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--min-tensor-bytes", type=int,
                   help=f"saved tensors smaller than this stay put (default {DEFAULT_MIN_TENSOR_BYTES} "
                        "on cuda, 0 on cpu)")
    p.add_argument("--out", default="docs/results", help="folder for layer_stack.json and .md")
    p.add_argument("--worker", choices=list(CONFIGS), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available (use --device cpu for a functional check)")
    if args.min_tensor_bytes is None:
        args.min_tensor_bytes = DEFAULT_MIN_TENSOR_BYTES if args.device == "cuda" else 0
    return args


# ---------------------------------------------------------------------------- worker process
def measure(step: Callable[[], None], cuda: bool, steps: int) -> dict:
    """Step time, peak memory and the engine's statistics over ``steps`` measured steps."""
    clock = Clock(cuda)
    pinned_allocations = offload.get_manager().pool.allocations  # those of the warm-up
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()  # weights and gradients are allocated already
    times: list[float] = []
    host_ms: list[float] = []
    per_step: list[IterationStats] = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()  # every configuration starts each step on an idle GPU
        start, host_start = clock.mark(), time.perf_counter()
        step()
        end, host_end = clock.mark(), time.perf_counter()
        per_step.append(offload.end_iteration())  # timing=True: waits for the step's copy events
        times.append(clock.ms(start, end))
        host_ms.append((host_end - host_start) * 1e3)
    totals = [s.total() for s in per_step]
    whole = GroupStats.sum(totals)
    last = per_step[-1]
    return {
        "step_ms": statistics.median(times),
        "step_ms_min": min(times),
        "host_ms": statistics.median(host_ms),
        "peak_allocated": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_reserved": torch.cuda.max_memory_reserved() if cuda else None,
        "offloaded_bytes": totals[-1].bytes_offloaded,
        "reloaded_bytes": totals[-1].bytes_reloaded,
        "held_elsewhere_bytes": totals[-1].bytes_held_elsewhere,
        "reloads_on_demand": totals[-1].reloads_on_demand,
        "d2h_gbps": whole.d2h_gbps if cuda else None,
        "h2d_gbps": whole.h2d_gbps if cuda else None,
        "wait_ms": statistics.median(t.offload_wait_ms + t.reload_wait_ms for t in totals) if cuda else None,
        "pinned_bytes": last.pinned_bytes,
        "pinned_peak_in_use": last.pinned_peak_bytes_in_use,
        "pinned_allocations_after_warmup": last.pinned_allocations - pinned_allocations,
        "by_name": {
            name: {
                "bytes_offloaded": s.bytes_offloaded,
                "groups_offloaded": s.groups_offloaded,
                "groups_kept": s.groups_kept,
                "bytes_per_group": s.bytes_offloaded // s.groups_offloaded if s.groups_offloaded else 0,
            }
            for name, s in last.by_name.items()
        },
    }


def layer_forward_ms(model: nn.Module, x: torch.Tensor, clock: Clock, layers: int) -> float:
    """Forward time per layer without offloading (median of a few passes)."""
    passes = []
    for _ in range(TIMING_PASSES):
        start = clock.mark()
        model(x)  # with grad, as in training; the graph is dropped at once
        end = clock.mark()
        passes.append(clock.ms(start, end) / layers)
    return statistics.median(passes)


def worker(args: argparse.Namespace, config: str) -> dict:
    """One configuration at one sequence length (``args.seq[-1]``), in this process."""
    seq = args.seq[-1]
    cuda = args.device == "cuda"
    dtype = DTYPES[args.dtype]
    model = build_gpt(args.hidden, args.heads, args.layers, dtype=dtype, device=args.device)
    for p in model.parameters():  # persistent gradient buffers, allocated before the peak reset
        p.grad = torch.zeros_like(p)
    names = CONFIGS[config]
    offload.configure(names, min_tensor_bytes=args.min_tensor_bytes, timing=True, device=args.device)
    handle = offload.attach(model, {n: GPT_MAPPING[n] for n in names}) if names else None
    gen = torch.Generator(device=args.device).manual_seed(0)
    x = torch.randn(seq, args.batch, args.hidden, generator=gen, device=args.device, dtype=dtype)
    grad = torch.randn(x.shape, generator=gen, device=args.device, dtype=dtype)

    def step() -> None:
        model.zero_grad(set_to_none=False)
        model(x).backward(grad)

    for _ in range(args.warmup):
        step()
        offload.end_iteration()
    record = {"config": config, "modules": names, "seq": seq, **measure(step, cuda, args.steps)}
    if handle is not None:
        handle.remove()
    if config == "none":  # after the measurement: these passes must not touch the peak
        record["saved_bytes_by_name"] = saved_bytes_by_name(model, GPT_MAPPING, step)
        record["layer_forward_ms"] = layer_forward_ms(model, x, Clock(cuda), args.layers)
    return record


# ---------------------------------------------------------------------------- parent process
def run_worker(argv: list[str], config: str, seq: int) -> dict:
    """Run one configuration in a fresh process; its last stdout line is the JSON record."""
    cmd = [sys.executable, __file__, *argv, "--worker", config, "--seq", str(seq)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"worker {config} at seq {seq} failed ({proc.returncode}):\n{proc.stderr}")
    sys.stderr.write(proc.stderr)  # warnings, e.g. a failed pinned allocation
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_all(args: argparse.Namespace, argv: list[str]) -> list[dict]:
    configs = ["none", *(c for c in args.configs if c != "none")]
    runs = [(seq, config) for seq in args.seq for config in configs]
    records = []
    for i, (seq, config) in enumerate(runs, 1):
        print(f"[{i}/{len(runs)}] seq {seq}, config {config} ...", end=" ", file=sys.stderr, flush=True)
        record = run_worker(argv, config, seq)
        print(f"{record['step_ms']:.1f} ms/step", file=sys.stderr, flush=True)
        records.append(record)
    return records


def copy_fit(record: dict, layer_forward_ms: float) -> dict:
    """Whether one layer's offloaded groups copy at `LINK_GBPS` within one layer's forward.

    The D2H stream copies the groups one after another behind compute (a group's copy can
    start once its module's forward is done), so in steady state one layer's copies must fit
    under one layer's forward; the reloads then fit under its backward, about twice as long.
    """
    layer_bytes = sum(s["bytes_per_group"] for s in record["by_name"].values())
    copy_ms = layer_bytes / (LINK_GBPS * 1e6)
    return {"bytes_per_layer": layer_bytes, "copy_ms_per_layer": copy_ms,
            "layer_forward_ms": layer_forward_ms, "fits": copy_ms <= layer_forward_ms}


def verdict(applies: bool, met: bool) -> str:
    return ("met" if met else "not met") if applies else "n/a"


def evaluate(records: list[dict]) -> None:
    """Add the comparison with the baseline of the same length, and the issue's targets."""
    base = {r["seq"]: r for r in records if r["config"] == "none"}
    for r in records:
        b = base[r["seq"]]
        r["group_saved_bytes"] = sum(b["saved_bytes_by_name"][n] for n in r["modules"])
        if r["config"] == "none":
            continue
        r["overhead_pct"] = 100 * (r["step_ms"] / b["step_ms"] - 1)
        on_gpu = b["peak_allocated"] is not None
        r["memory_removed"] = b["peak_allocated"] - r["peak_allocated"] if on_gpu else None
        moved = r["offloaded_bytes"]
        r["removed_over_offloaded"] = r["memory_removed"] / moved if on_gpu and moved else None
        r["copy_fit"] = copy_fit(r, b["layer_forward_ms"])
        r["fits_under_compute"] = r["copy_fit"]["fits"]
        r["time_target"] = verdict(on_gpu and r["fits_under_compute"], r["overhead_pct"] <= TIME_TARGET_PCT)
        r["memory_target"] = verdict(on_gpu and moved > 0, (r["removed_over_offloaded"] or 0) >= MEMORY_TARGET)


def fmt(value: float | None, spec: str, scale: float = 1.0) -> str:
    return "n/a" if value is None else format(value / scale, spec)


def row(r: dict) -> str:
    base = r["config"] == "none"
    cells = [
        r["config"], str(r["seq"]), fmt(r["step_ms"], ".1f"),
        "" if base else f"{r['overhead_pct']:+.1f}%",
        fmt(r["peak_allocated"], ".2f", GIB), fmt(r["peak_reserved"], ".2f", GIB),
        "" if base else fmt(r["memory_removed"], ".2f", GIB),
        fmt(r["offloaded_bytes"], ".3g", GIB), fmt(r["group_saved_bytes"], ".3g", GIB),
        "" if base else fmt(r["removed_over_offloaded"], ".0%"),
        "" if base else fmt(r["d2h_gbps"], ".1f"), "" if base else fmt(r["h2d_gbps"], ".1f"),
        fmt(r["wait_ms"], ".2f"),
        fmt(r["pinned_bytes"], ".3g", GIB),
        "" if base else ("yes" if r["fits_under_compute"] else "no"),
        "" if base else r["time_target"], "" if base else r["memory_target"],
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = [
    "| config | seq | step ms | overhead | peak GiB | reserved GiB | saved GiB | offloaded GiB/step "
    "| groups save GiB | removed/offloaded | D2H GB/s | H2D GB/s | wait ms | pinned GiB "
    f"| fits @{LINK_GBPS:.0f} GB/s | time target | memory target |",
    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|:-:|:-:|",
]


def summary(records: list[dict]) -> list[str]:
    """One line per target: in how many rows it applies and is met."""
    lines = []
    for key, text in (
        ("time_target", f"step time within {TIME_TARGET_PCT:g}% of no offloading, where the copies fit "
                        f"under compute at {LINK_GBPS:g} GB/s"),
        ("memory_target", f"peak memory lower by >= {MEMORY_TARGET:.0%} of the bytes offloaded"),
    ):
        verdicts = [r[key] for r in records if key in r]
        applies = [v for v in verdicts if v != "n/a"]
        lines.append(f"* {text}: met in {applies.count('met')} of {len(applies)} rows where it applies "
                     f"({len(verdicts) - len(applies)} n/a)")
    return lines


def write(records: list[dict], args: argparse.Namespace, meta: dict) -> str:
    """Write ``layer_stack.json`` and ``layer_stack.md`` under ``args.out``; return the Markdown."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for r in records:
        r.update(meta)
    (out / "layer_stack.json").write_text(json.dumps(records, indent=2) + "\n")
    s = meta["settings"]
    lines = [
        "# Layer-stack benchmark",
        "",
        f"{meta['device']}, torch {meta['torch']}. GPT layer stack: {s['layers']} layers, hidden {s['hidden']}, "
        f"{s['heads']} heads, batch {s['batch']}, {s['dtype']}, min_tensor_bytes {s['min_tensor_bytes']}. "
        f"Forward+backward, median of {s['steps']} steps after {s['warmup']} warm-up steps, "
        "engine statistics with timing=True. Columns: benchmarks/README.md.",
        "",
        f"Command: `{meta['command']}`",
        "",
        *HEADER,
        *(row(r) for r in records),
        "",
        "Targets:",
        "",
        *summary(records),
    ]
    text = "\n".join(lines) + "\n"
    (out / "layer_stack.md").write_text(text)
    return text


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.worker:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="offload: no CUDA device", category=RuntimeWarning)
            record = worker(args, args.worker)
        print(json.dumps(record))
        return
    records = run_all(args, argv)
    evaluate(records)
    meta = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "command": shlex.join(["python", sys.argv[0], *argv]),
        "settings": {k: getattr(args, k) for k in
                     ("hidden", "heads", "layers", "batch", "dtype", "steps", "warmup", "min_tensor_bytes")},
    }
    print(write(records, args, meta), end="")
    print(f"results: {Path(args.out) / 'layer_stack.json'}, {Path(args.out) / 'layer_stack.md'}", file=sys.stderr)


if __name__ == "__main__":
    main()
