"""The main job: train a small GPT layer stack three ways, side by side: without offloading or
recompute, with full recompute (every layer checkpointed), and with the plan that `offload.plan`
chooses for a memory budget.

    python -m offload.demo                                  # GPU if there is one, else CPU
    python -m offload.demo --memory-budget -4GiB --steps 20 --json out.json

The budget takes the planner's forms (docs/planner.md): ``20GiB``, ``-4GiB`` or ``-30%`` (below
the peak without a plan), ``fit:10%``. By default it is full recompute's measured peak: the plan
then shows what the same memory costs when offloading and recompute are mixed. The three runs
happen in this process, start from the same weights and see the same data. The demo prints the
step's peak memory, memory saved, median step time, the step time against full recompute, and
what the plan chose and why, and checks that the losses of every step are bitwise identical in
all three runs (exit code 1 if they are not). Without CUDA it runs the engine's CPU fallback,
which saves no memory: there the plan is made on the bytes the step saves, for ``-50%``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import warnings
from dataclasses import asdict, dataclass, field
from typing import Callable, NoReturn

import torch
import torch.nn.functional as F
from torch import nn

import offload
from offload.config import DEFAULT_MIN_TENSOR_BYTES
from offload.planner.budget import format_bytes as size
from offload.testing import GPT_MAPPING, Clock, build_gpt

WARMUP_STEPS = 2
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
GPU_DEFAULTS = dict(hidden=4096, heads=32, layers=4, seq=16384, batch=1, steps=10, dtype="bf16",
                    min_tensor_bytes=DEFAULT_MIN_TENSOR_BYTES)
"""A long sequence, where activations are large and a layer's compute hides its copies: what
the plan mixes (about 16 GiB at the peak without a plan). On short sequences and small layers
the step is bound by the host (Python, per module), which the planner's model does not cover:
there the plan can be slower than full recompute in training (docs/planner.md, Limits)."""
CPU_DEFAULTS = dict(hidden=64, heads=4, layers=4, seq=128, batch=2, steps=4, dtype="fp32",
                    min_tensor_bytes=0)  # the tiny CPU model's tensors are all under 1 MiB
CPU_BUDGET = "-50%"
CPU_NOTE = ("note: no CUDA here, so the engine ran its CPU fallback (host copies in place of device copies): "
            "it saves no memory on CPU, peak memory is n/a, and the plan was made on the bytes the step saves.")


@dataclass
class RunResult:
    """What one training run measured."""

    name: str
    losses: list[float]
    step_ms: float
    peak_bytes: int | None
    offloaded_bytes_per_step: int
    pinned_bytes: int
    plan: dict | None = field(default=None)


def _default_help(name: str) -> str:
    return f"default {GPU_DEFAULTS[name]} on GPU, {CPU_DEFAULTS[name]} on CPU"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    for i, arg in enumerate(argv[:-1]):  # "--memory-budget -30%": a value, not an option
        if arg == "--memory-budget" and argv[i + 1].startswith("-"):
            argv[i:i + 2] = [f"{arg}={argv[i + 1]}"]
            break
    p = argparse.ArgumentParser(prog="python -m offload.demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto")
    p.add_argument("--memory-budget", metavar="BUDGET",
                   help="the plan's budget: '20GiB', '-4GiB', '-30%%' or 'fit:10%%' (default: full recompute's "
                        f"peak on GPU, {CPU_BUDGET.replace('%', '%%')} on CPU)")
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
    """Pick the device, fill in the size defaults for it and check the budget."""
    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda, but CUDA is not available")
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    for key, value in (GPU_DEFAULTS if cuda else CPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.steps <= WARMUP_STEPS:
        fail(f"--steps must be more than the {WARMUP_STEPS} warm-up steps")
    if args.memory_budget is None and not cuda:
        args.memory_budget = CPU_BUDGET
    if args.memory_budget is not None:
        try:
            offload.Budget.parse(args.memory_budget)
        except offload.OffloadError as exc:
            fail(f"--memory-budget: {exc}")
    return torch.device("cuda" if cuda else "cpu")


Setup = Callable[[nn.Module, Callable[[], None]], "dict | None"]
"""Prepares the model of a run (checkpointing, a plan); gets a step to plan on; returns the plan."""


def no_setup(model: nn.Module, step: Callable[[], None]) -> None:
    offload.configure((), device=next(model.parameters()).device)


def full_recompute(model: nn.Module, step: Callable[[], None]) -> None:
    """Every layer checkpointed, nothing offloaded."""
    from offload.planner.apply import checkpoint_modules

    no_setup(model, step)
    checkpoint_modules(model, [f"layers.{i}" for i in range(len(model.layers))])


def planned(budget: str | int, min_tensor_bytes: int) -> Setup:
    def setup(model: nn.Module, step: Callable[[], None]) -> dict:
        plan = offload.plan(model, GPT_MAPPING, step, budget, min_tensor_bytes=min_tensor_bytes, verbose=False)
        return {"table": plan.table(), **plan.as_dict()}

    return setup


def train(args: argparse.Namespace, device: torch.device, name: str, setup: Setup) -> RunResult:
    """Train for ``args.steps`` steps after ``setup``; weights, data and seeds are the same in every run."""
    cuda = device.type == "cuda"
    dtype = DTYPES[args.dtype]
    model = build_gpt(args.hidden, args.heads, args.layers, dtype=dtype, device=device, seed=0)
    for p in model.parameters():  # persistent gradient buffers, as trainers keep them
        p.grad = torch.zeros_like(p)
    shape = (args.seq, args.batch, args.hidden)
    plan_gen = torch.Generator(device=device).manual_seed(2)
    plan_x = torch.randn(shape, generator=plan_gen, device=device, dtype=dtype)
    plan_target = torch.randn(shape, generator=plan_gen, device=device)

    def plan_step() -> None:  # forward and backward on a batch of its own; no optimizer step
        model.zero_grad(set_to_none=False)
        F.mse_loss(model(plan_x).float(), plan_target).backward()

    plan = None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device=device).manual_seed(1)
    target = torch.randn(shape, generator=gen, device=device)
    clock = Clock(cuda)
    losses: list[float] = []
    times: list[float] = []
    for step in range(args.steps):
        if step == 1:  # after the first optimizer step: the plan sees the memory of the optimizer state
            plan = setup(model, plan_step)
        x = torch.randn(shape, generator=gen, device=device, dtype=dtype)
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
    active = offload.planner.active_plan()
    if active is not None:
        active.remove()
    return RunResult(
        name=name, losses=losses, step_ms=statistics.median(times),
        peak_bytes=torch.cuda.max_memory_allocated() if cuda else None,
        offloaded_bytes_per_step=stats.total().bytes_offloaded, pinned_bytes=stats.pinned_bytes, plan=plan,
    )


def pct(x: float | None, base: float | None) -> str:
    return "-" if x is None or not base else f"{100 * (x / base - 1):+.1f}%"


def table(args: argparse.Namespace, device_name: str, runs: list[RunResult], budget: str) -> str:
    base, recompute, plan = runs
    row = "{:<30}{:>20}{:>20}{:>20}".format

    def saved(r: RunResult) -> str:
        if r.peak_bytes is None or base.peak_bytes is None:
            return "n/a"
        return f"{size(base.peak_bytes - r.peak_bytes)} ({100 * (1 - r.peak_bytes / base.peak_bytes):.1f}%)"

    p = plan.plan
    lines = [
        f"GPT layer stack: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, seq {args.seq}, "
        f"batch {args.batch}, {args.dtype}, {args.steps} steps ({WARMUP_STEPS} warm-up) on {device_name}",
        f"plan for a memory budget of {size(p['budget_bytes'])} ({budget}): "
        + offload.planner.describe(offload.planner.Assignment(
            tuple(p["checkpoint"]), tuple(p["offload"]), p["max_inflight_groups"], tuple(p["selective"]))),
        "",
        row("", *(r.name for r in runs)),
        row("peak memory (step)", *(size(r.peak_bytes) for r in runs)),
        row("memory saved", "-", saved(recompute), saved(plan)),
        row("median step time", *(f"{r.step_ms:.2f} ms" for r in runs)),
        row("step time vs no offloading", "-", pct(recompute.step_ms, base.step_ms), pct(plan.step_ms, base.step_ms)),
        row("step time vs full recompute", "-", "-", pct(plan.step_ms, recompute.step_ms)),
        row("offloaded per step", "-", "-", size(plan.offloaded_bytes_per_step)),
        row("predicted by the plan", "", "", f"{size(p['predicted_peak_bytes'])}, {p['predicted_step_ms']:.1f} ms"),
        "",
    ]
    if all(r.losses == base.losses for r in runs):
        lines.append(f"losses: bitwise identical over all {len(base.losses)} steps of the three runs")
    else:
        worst = max(abs(a - b) for r in runs for a, b in zip(base.losses, r.losses))
        lines.append(f"losses DIFFER: max abs difference {worst:g}")
    lines += ["", "what the plan chose and why (its own profile and check, before the training run):", "", p["table"]]
    if base.peak_bytes is None:
        lines += ["", CPU_NOTE]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    # Deterministic cuBLAS must be chosen before CUDA initializes: bitwise-equal losses need it.
    os.environ["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    args = parse_args(argv)
    device = resolve(args)
    torch.use_deterministic_algorithms(True)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="offload: no CUDA device", category=RuntimeWarning)
        base = train(args, device, "no offloading", no_setup)
        recompute = train(args, device, "full recompute", full_recompute)
        budget = args.memory_budget if args.memory_budget is not None else recompute.peak_bytes
        label = args.memory_budget or "full recompute's peak"
        plan = train(args, device, "plan", planned(budget, args.min_tensor_bytes))
    offload.reset(release_pool=True)
    runs = [base, recompute, plan]
    identical = all(r.losses == base.losses for r in runs)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(table(args, device_name, runs, label))
    if args.json:
        record = {
            "device": device.type, "device_name": device_name, "torch": torch.__version__,
            "command": shlex.join(["python", "-m", "offload.demo", *(sys.argv[1:] if argv is None else argv)]),
            "config": {k: getattr(args, k) for k in GPU_DEFAULTS}, "memory_budget": label,
            "losses_identical": identical, "runs": [asdict(r) for r in runs],
        }
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
