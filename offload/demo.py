"""The main job: train a small GPT layer stack without and with offloading, side by side.

    python -m offload.demo                                  # GPU if there is one, else CPU
    python -m offload.demo --offload-modules core_attn,fc1 --steps 20 --json out.json

Both runs happen in this process, start from the same weights and see the same data. The demo
prints the step's peak memory, memory saved, median step time, bytes offloaded per step and
pinned host bytes, and checks that the losses of every step are bitwise identical (exit code 1
if they are not). Without CUDA it runs the engine's CPU fallback, which saves no memory.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import warnings
from dataclasses import asdict, dataclass
from typing import NoReturn

import torch
import torch.nn.functional as F

import offload
from offload.config import DEFAULT_MIN_TENSOR_BYTES, check_known
from offload.testing import GPT_MAPPING, Clock, build_gpt

DEFAULT_MODULES = "core_attn,fc1,mlp_act,fc2"
WARMUP_STEPS = 2
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GPU_DEFAULTS = dict(hidden=2048, heads=16, layers=8, seq=4096, batch=1, steps=10, dtype="bf16",
                    min_tensor_bytes=DEFAULT_MIN_TENSOR_BYTES)
CPU_DEFAULTS = dict(hidden=64, heads=4, layers=4, seq=128, batch=2, steps=4, dtype="fp32",
                    min_tensor_bytes=0)  # the tiny CPU model's tensors are all under 1 MiB
CPU_NOTE = ("note: no CUDA here, so the engine ran its CPU fallback (host copies in place of "
            "device copies): it saves no memory on CPU, and peak memory is n/a.")


@dataclass
class RunResult:
    """What one training run measured."""

    name: str
    modules: list[str]
    losses: list[float]
    step_ms: float
    peak_bytes: int | None
    offloaded_bytes_per_step: int
    pinned_bytes: int


def _default_help(name: str) -> str:
    return f"default {GPU_DEFAULTS[name]} on GPU, {CPU_DEFAULTS[name]} on CPU"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m offload.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--offload-modules", nargs="+", default=[DEFAULT_MODULES], metavar="NAMES",
                   help=f"group names to offload, 'a,b' or 'a b' (default {DEFAULT_MODULES}); "
                        f"valid: {', '.join(GPT_MAPPING)}")
    for name in ("hidden", "heads", "layers", "seq", "batch", "steps"):
        p.add_argument(f"--{name}", type=int, help=_default_help(name))
    p.add_argument("--dtype", choices=list(DTYPES), help=_default_help("dtype"))
    p.add_argument("--min-tensor-bytes", type=int,
                   help="saved tensors smaller than this are not offloaded; " + _default_help("min_tensor_bytes"))
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p.parse_args(argv)


def fail(message: str) -> NoReturn:
    """A usage error: exit code 2 (1 is for losses that differ)."""
    print(f"offload.demo: {message}", file=sys.stderr)
    raise SystemExit(2)


def resolve(args: argparse.Namespace) -> torch.device:
    """Pick the device, fill in the size defaults for it and check the module names."""
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda, but CUDA is not available")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    for key, value in (GPU_DEFAULTS if cuda else CPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps <= WARMUP_STEPS:
        fail(f"--steps must be more than the {WARMUP_STEPS} warm-up steps")
    try:
        args.modules = list(offload.parse_module_list(args.offload_modules))
        check_known(args.modules, GPT_MAPPING, "--offload-modules")
    except (ValueError, offload.UnknownModuleError) as exc:
        fail(str(exc))
    if not args.modules:
        fail("--offload-modules names no module")
    return torch.device("cuda" if cuda else "cpu")


def train(args: argparse.Namespace, device: torch.device, modules: list[str]) -> RunResult:
    """Train for ``args.steps`` steps offloading ``modules`` (none if empty); seeds are fixed."""
    cuda = device.type == "cuda"
    model = build_gpt(args.hidden, args.heads, args.layers, dtype=DTYPES[args.dtype], device=device, seed=0)
    for p in model.parameters():  # persistent gradient buffers, as trainers keep them
        p.grad = torch.zeros_like(p)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    offload.configure(modules, min_tensor_bytes=args.min_tensor_bytes, timing=False, device=device)
    handle = offload.attach(model, {n: GPT_MAPPING[n] for n in modules}) if modules else None
    gen = torch.Generator(device=device).manual_seed(1)
    shape = (args.seq, args.batch, args.hidden)
    target = torch.randn(shape, generator=gen, device=device)
    clock = Clock(cuda)
    losses: list[float] = []
    times: list[float] = []
    for step in range(args.steps):
        x = torch.randn(shape, generator=gen, device=device, dtype=DTYPES[args.dtype])
        if cuda and step == WARMUP_STEPS:  # weights, gradients and AdamW state exist by now
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = clock.mark()
        optimizer.zero_grad(set_to_none=False)
        loss = F.mse_loss(model(x).float(), target)
        loss.backward()
        optimizer.step()
        end = clock.mark()
        stats = offload.end_iteration()
        losses.append(loss.item())
        if step >= WARMUP_STEPS:
            times.append(clock.ms(start, end))
    if handle is not None:
        handle.remove()
    return RunResult(
        name="offloading" if modules else "no offloading",
        modules=modules,
        losses=losses,
        step_ms=statistics.median(times),
        peak_bytes=torch.cuda.max_memory_allocated() if cuda else None,
        offloaded_bytes_per_step=stats.total().bytes_offloaded,
        pinned_bytes=stats.pinned_bytes,
    )


def size(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def compare(base: RunResult, off: RunResult) -> dict:
    """Memory saved, step-time change and the loss comparison of the two runs."""
    saved = None if base.peak_bytes is None else base.peak_bytes - off.peak_bytes
    identical = base.losses == off.losses
    return {
        "memory_saved_bytes": saved,
        "memory_saved_pct": None if saved is None else 100 * saved / base.peak_bytes,
        "step_time_change_pct": 100 * (off.step_ms / base.step_ms - 1),
        "losses_identical": identical,
        "max_abs_loss_difference": max(abs(a - b) for a, b in zip(base.losses, off.losses)),
    }


def table(args: argparse.Namespace, device_name: str, base: RunResult, off: RunResult, cmp: dict) -> str:
    row = "{:<26}{:>16}{:>16}".format
    saved = "n/a" if cmp["memory_saved_bytes"] is None else (
        f"{size(cmp['memory_saved_bytes'])} ({cmp['memory_saved_pct']:.1f}%)")
    lines = [
        f"GPT layer stack: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
        f"batch {args.batch}, {args.dtype}, {args.steps} steps ({WARMUP_STEPS} warm-up) on {device_name}",
        f"offloaded modules: {','.join(off.modules)}",
        "",
        row("", base.name, off.name),
        row("peak memory (step)", size(base.peak_bytes), size(off.peak_bytes)),
        row("memory saved", "", saved),
        row("median step time", f"{base.step_ms:.2f} ms", f"{off.step_ms:.2f} ms"),
        row("step time change", "", f"{cmp['step_time_change_pct']:+.1f}%"),
        row("offloaded per step", "-", size(off.offloaded_bytes_per_step)),
        row("pinned host memory", "-", size(off.pinned_bytes)),
        "",
    ]
    if cmp["losses_identical"]:
        lines.append(f"losses: bitwise identical over all {len(base.losses)} steps")
    else:
        lines.append(f"losses DIFFER: max abs difference {cmp['max_abs_loss_difference']:g}")
    if base.peak_bytes is None:
        lines.append(CPU_NOTE)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    # Deterministic cuBLAS must be chosen before CUDA initializes: bitwise-equal losses need it.
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    args = parse_args(argv)
    device = resolve(args)
    torch.use_deterministic_algorithms(True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="offload: no CUDA device", category=RuntimeWarning)
        base = train(args, device, [])
        off = train(args, device, args.modules)
    offload.reset(release_pool=True)
    cmp = compare(base, off)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(table(args, device_name, base, off, cmp))
    if args.json:
        record = {
            "device": device.type,
            "device_name": device_name,
            "torch": torch.__version__,
            "command": shlex.join(["python", "-m", "offload.demo", *(sys.argv[1:] if argv is None else argv)]),
            "config": {k: getattr(args, k) for k in GPU_DEFAULTS},
            "modules": args.modules,
            **cmp,
            "runs": [asdict(base), asdict(off)],
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0 if cmp["losses_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
