"""The main job: train a small GPT layer stack with and without offloading, side by side.

    python -m offload.demo                      # GPU if there is one, else the CPU fallback
    python -m offload.demo --offload-modules core_attn,fc1 --steps 20 --json out.json

Both runs start from the same weights and see the same data; the demo prints peak memory,
memory saved, median step time, bytes offloaded per step and pinned host bytes, and checks
that the losses of every step are bitwise identical (exit code 1 if not).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field

from . import config as offload_defaults

DEFAULT_MODULES = "core_attn,fc1,mlp_act,fc2"


@dataclass
class RunResult:
    name: str
    losses: list[float] = field(default_factory=list)
    step_ms: float = 0.0
    peak_bytes: int | None = None
    offloaded_bytes_per_step: int = 0
    pinned_bytes: int = 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m offload.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--offload-modules", default=DEFAULT_MODULES,
                   help=f"group names to offload, 'a,b' or 'a b' (default {DEFAULT_MODULES})")
    p.add_argument("--hidden", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--batch", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--dtype", choices=["bf16", "fp32"])
    p.add_argument("--min-tensor-bytes", type=int,
                   help="saved tensors smaller than this stay on the GPU (default: the library's "
                        "1 MiB on GPU; 0 on CPU, where the demo model is tiny)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p.parse_args(argv)


def _defaults(args: argparse.Namespace, cuda: bool) -> None:
    gpu = dict(hidden=2048, heads=16, layers=8, seq=4096, batch=1, steps=10, dtype="bf16")
    cpu = dict(hidden=64, heads=4, layers=4, seq=128, batch=2, steps=4, dtype="fp32")
    gpu["min_tensor_bytes"] = offload_defaults.DEFAULT_MIN_TENSOR_BYTES
    cpu["min_tensor_bytes"] = 0
    for key, value in (gpu if cuda else cpu).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps < 3:
        raise SystemExit("--steps must be at least 3 (2 warm-up steps are not timed)")


def _train(name: str, modules: tuple[str, ...], args: argparse.Namespace, device: str) -> RunResult:
    import torch

    import offload
    from offload.testing import GPT_MAPPING, build_gpt

    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model = build_gpt(args.hidden, args.heads, args.layers, dtype=dtype, device=device, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    handle = None
    offload.configure(modules, device=device, min_tensor_bytes=args.min_tensor_bytes)
    if modules:
        handle = offload.attach(model, {k: v for k, v in GPT_MAPPING.items() if k in modules})
    gen = torch.Generator(device=device).manual_seed(1)
    shape = (args.seq, args.batch, args.hidden)
    data = [(torch.randn(shape, generator=gen, device=device, dtype=dtype),
             torch.randn(shape, generator=gen, device=device, dtype=dtype)) for _ in range(args.steps)]
    for p in model.parameters():  # persistent gradient buffers, as trainers keep them
        p.grad = torch.zeros_like(p)
    cuda = device == "cuda"
    result = RunResult(name)
    times = []
    for step, (x, target) in enumerate(data):
        if cuda and step == 2:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        end = torch.cuda.Event(enable_timing=True) if cuda else None
        t0 = time.perf_counter()
        if cuda:
            start.record()
        optimizer.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(x).float(), target.float())
        loss.backward()
        optimizer.step()
        if cuda:
            end.record()
        stats = offload.end_iteration()
        result.losses.append(loss.item())
        if step >= 2:
            times.append(start.elapsed_time(end) if cuda else (time.perf_counter() - t0) * 1e3)
            result.offloaded_bytes_per_step = stats.total().bytes_offloaded
            result.pinned_bytes = stats.pinned_bytes
    result.step_ms = statistics.median(times)
    if cuda:
        result.peak_bytes = torch.cuda.max_memory_allocated()
    if handle is not None:
        handle.remove()
    offload.reset(release_pool=True)
    return result


def _size(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**30:.2f} GiB" if abs(n) >= 2**30 else f"{n / 2**20:.1f} MiB"


def _report(args: argparse.Namespace, device: str, base: RunResult, off: RunResult) -> dict:
    same = base.losses == off.losses
    lines = [
        f"offload demo: GPT stack, {args.layers} layers, hidden {args.hidden}, seq {args.seq}, "
        f"batch {args.batch}, {args.dtype}, {args.steps} steps on {device}",
        f"offloaded modules: {','.join(args.modules)}",
        "",
        f"{'':28}{'no offloading':>16}{'offloading':>16}",
        f"{'peak memory':28}{_size(base.peak_bytes):>16}{_size(off.peak_bytes):>16}",
        f"{'median step time':28}{base.step_ms:>13.1f} ms{off.step_ms:>13.1f} ms",
        f"{'offloaded per step':28}{'-':>16}{_size(off.offloaded_bytes_per_step):>16}",
        f"{'pinned host memory':28}{'-':>16}{_size(off.pinned_bytes):>16}",
    ]
    if base.peak_bytes is not None:
        saved = base.peak_bytes - off.peak_bytes
        lines.append(f"{'memory saved':28}{_size(saved):>32} ({100 * saved / base.peak_bytes:.1f}% of peak)")
    lines.append(f"{'step time change':28}{100 * (off.step_ms / base.step_ms - 1):>+31.1f}%")
    if same:
        lines.append(f"losses: bitwise identical over {len(base.losses)} steps")
    else:
        diff = max(abs(a - b) for a, b in zip(base.losses, off.losses))
        lines.append(f"losses DIFFER: max abs difference {diff:g}")
    if device == "cpu":
        lines.append("note: no GPU here; the engine ran its CPU fallback (host copies), which saves no memory")
    print("\n".join(lines))
    return {
        "device": device, "command": " ".join(["python -m offload.demo", *sys.argv[1:]]),
        "config": {k: getattr(args, k) for k in ("hidden", "heads", "layers", "seq", "batch", "steps", "dtype")},
        "modules": list(args.modules), "losses_identical": same,
        "runs": [asdict(base), asdict(off)],
    }


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    # Deterministic cuBLAS must be chosen before CUDA starts: bitwise-equal losses need it.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import warnings

    import torch

    import offload

    cuda = torch.cuda.is_available() if args.device == "auto" else args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise SystemExit("--device cuda: CUDA is not available")
    device = "cuda" if cuda else "cpu"
    _defaults(args, cuda)
    args.modules = offload.parse_module_list(args.offload_modules)
    torch.use_deterministic_algorithms(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the CPU fallback's notice; said below
        base = _train("no offloading", (), args, device)
        off = _train("offloading", args.modules, args, device)
    record = _report(args, device, base, off)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0 if record["losses_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
