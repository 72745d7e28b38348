"""The memory/time frontier: for memory budgets from full recompute's peak to no saving, the
plan's step time and peak (`offload.plan`) against full recompute, selective recompute and
offloading alone, on a GPT layer stack (hidden 4096, 32 heads, bf16).

    python benchmarks/frontier.py                                   # both workloads -> docs/results/
    python benchmarks/frontier.py --workloads seq8192 --budgets 8 --steps 20
    python benchmarks/frontier.py --device cpu --out /tmp/frontier  # functional check, tiny sizes

Workloads: ``seq8192`` (8 layers, seq 8192) and ``seq32768`` (4 layers, seq 32768). Strategies:

* ``none``: nothing offloaded or recomputed (the top of the frontier);
* ``full_recompute``: every layer checkpointed (non-reentrant `torch.utils.checkpoint`);
* ``selective:<policy>``: every layer checkpointed with a selective-checkpoint policy
  (`create_selective_checkpoint_contexts`) that saves the outputs of matmuls, of attention, or both,
  and recomputes the rest;
* ``offload:<set>``: module sets offloaded, nothing recomputed;
* ``plan``: `offload.plan` at each budget, from full recompute's measured peak to ``none``'s, on a
  profile and link probe made once per workload; the plan is applied, checked and re-planned as
  `offload.plan` does, then measured like every other strategy.

Each configuration runs in a fresh process (this script with the hidden ``--worker`` flag), so
memory figures do not leak between them. Every measurement is `bench_layer_stack.measure`'s:
median step time over ``--steps`` steps after ``--warmup``, the GPU synchronized before each, and
``max_memory_allocated`` over them, weights and gradients allocated before. Results:
``<out>/frontier.json`` (records: workload, strategy, budget_bytes, step_ms, peak_bytes,
predicted_step_ms, predicted_peak_bytes, device, command), ``<out>/frontier.md`` (a table per
workload and the targets) and ``<out>/frontier.png`` (``.svg`` without matplotlib): peak memory
against step time, a line per strategy. Without CUDA the script exits with 2, unless
``--device cpu`` (which needs ``--out``: its figures are host times, not results).
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a clone, no install

import torch  # noqa: E402

import offload  # noqa: E402
from benchmarks.bench_layer_stack import measure  # noqa: E402
from offload.config import DEFAULT_MIN_TENSOR_BYTES  # noqa: E402
from offload.planner.apply import checkpoint_modules  # noqa: E402
from offload.testing import GPT_MAPPING  # noqa: E402
from offload.tools import bandwidth as probe  # noqa: E402
from offload.tools.plot import lines  # noqa: E402
from offload.tools.report import md_table  # noqa: E402
from offload.tools.workload import build_gpt_workload  # noqa: E402

WORKLOADS: dict[str, dict[str, Any]] = {
    "seq8192": dict(hidden=4096, heads=32, layers=8, seq=8192, batch=1, dtype="bf16"),
    "seq32768": dict(hidden=4096, heads=32, layers=4, seq=32768, batch=1, dtype="bf16"),
}
CPU_WORKLOADS: dict[str, dict[str, Any]] = {  # the same shapes' structure, small enough for seconds
    "seq8192": dict(hidden=64, heads=4, layers=4, seq=64, batch=1, dtype="fp32"),
    "seq32768": dict(hidden=64, heads=4, layers=3, seq=128, batch=1, dtype="fp32"),
}
OFFLOAD_SETS: dict[str, list[str]] = {
    "core_attn": ["core_attn"],
    "attn": ["qkv_linear", "core_attn", "attn_proj"],
    "attn+mlp_act": ["qkv_linear", "core_attn", "attn_proj", "mlp_act"],
    "all": list(GPT_MAPPING),
}
SELECTIVE = ("matmul", "attention", "matmul+attention")
FIXED = ["none", "full_recompute", *(f"selective:{p}" for p in SELECTIVE), *(f"offload:{s}" for s in OFFLOAD_SETS)]
FIELDS = ("workload", "strategy", "budget_bytes", "step_ms", "peak_bytes", "predicted_step_ms",
          "predicted_peak_bytes", "device", "command")
PROBE_MIB = ["1", "4", "16", "64", "256", "1024"]
CPU_BUDGET_FRACTIONS = (0.3, 1.0)
"""On the CPU no peak is measured: budgets span this share of the bytes the step saves."""
GIB = 2**30


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    p.add_argument("--budgets", type=int, default=6, help="plan budgets per workload, at least 2 (default 6)")
    p.add_argument("--steps", type=int, default=10, help="measured steps per configuration")
    p.add_argument("--warmup", type=int, default=3, help="warm-up steps per configuration")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--out", help="folder for frontier.json, .md and the plot (default docs/results on cuda)")
    p.add_argument("--in-process", action="store_true",
                   help="run the configurations in this process (a functional check: memory figures leak)")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return args
    if args.budgets < 2 or args.steps < 1 or args.warmup < 0:
        p.error("--budgets must be >= 2, --steps >= 1 and --warmup >= 0")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("CUDA is not available: the frontier is measured on a GPU (--device cpu --out DIR for a "
                "functional check)")
    if args.out is None:
        if args.device == "cpu":
            p.error("--device cpu needs --out: its figures are host times, not results for docs/results")
        args.out = "docs/results"
    return args


# ---------------------------------------------------------------------------- worker
def selective_policy(name: str) -> Callable[[], Any]:
    """The ``context_fn`` of a selective-checkpoint policy that saves the outputs of matmuls,
    attention, or both (``name``), and recomputes everything else."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    aten = torch.ops.aten
    matmul = {aten.mm.default, aten.addmm.default, aten.bmm.default}
    attention = {getattr(aten, op).default for op in (
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu") if hasattr(aten, op)}
    saved = {"matmul": matmul, "attention": attention, "matmul+attention": matmul | attention}[name]

    def policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return functools.partial(create_selective_checkpoint_contexts, policy)


def worker(job: dict[str, Any]) -> dict[str, Any]:
    """One configuration of one workload in this process: the record's measured fields (and, for
    ``profile``, the planner's profile and link probe written where the job says)."""
    spec = {"entry": "gpt", "device": job["device"], **job["shape"]}
    work = build_gpt_workload(spec)
    cuda = job["device"] == "cuda"
    mtb = DEFAULT_MIN_TENSOR_BYTES if cuda else 0
    layers = [f"layers.{i}" for i in range(spec["layers"])]
    strategy = job["strategy"]
    out: dict[str, Any] = {"predicted_step_ms": None, "predicted_peak_bytes": None}
    offload.configure((), device=job["device"], min_tensor_bytes=mtb)
    if strategy == "profile":
        if cuda:
            probe.main(["--sizes-mib", *PROBE_MIB, "--no-pageable", "--out", job["bandwidth"]])
        plan = offload.plan(work.model, GPT_MAPPING, work.step, "1GiB", bandwidth=job["bandwidth"] if cuda else None,
                            apply=False, verbose=False)
        Path(job["profile"]).write_text(json.dumps(plan.profile))
        return {"peak_bytes": plan.profile["peak_allocated"], "step_ms": plan.profile["step_ms"]}
    if strategy == "full_recompute":
        checkpoint_modules(work.model, layers)
    elif strategy.startswith("selective:"):
        checkpoint_modules(work.model, layers, context_fn=selective_policy(strategy.split(":", 1)[1]))
    elif strategy.startswith("offload:"):
        names = OFFLOAD_SETS[strategy.split(":", 1)[1]]
        offload.configure(names, device=job["device"], min_tensor_bytes=mtb)
        offload.attach(work.model, {n: GPT_MAPPING[n] for n in names})
    elif strategy == "plan":
        plan = offload.plan(work.model, GPT_MAPPING, work.step, job["budget_bytes"], profile=job["profile"],
                            bandwidth=job["bandwidth"] if cuda else None, verbose=False)
        print(plan.table(), file=sys.stderr)
        out.update(predicted_step_ms=plan.predicted_step_ms, predicted_peak_bytes=plan.predicted_peak_bytes)
    elif strategy != "none":
        raise SystemExit(f"unknown strategy {strategy!r}")
    for _ in range(job["warmup"]):
        work.step()
        offload.end_iteration()
    m = measure(work.step, cuda, job["steps"])
    return {**out, "step_ms": m["step_ms"], "peak_bytes": m["peak_allocated"]}


# ---------------------------------------------------------------------------- parent
def run(job: dict[str, Any], in_process: bool) -> dict[str, Any]:
    """One job in a fresh process (its last stdout line is the JSON result), or in this one."""
    label = f"{job['workload']} {job['strategy']}" + (f" at {job['budget_bytes'] / GIB:.2f} GiB"
                                                      if job.get("budget_bytes") else "")
    print(f"{label} ...", end=" ", file=sys.stderr, flush=True)
    if in_process:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            result = worker(job)
        offload.reset(release_pool=True)
    else:
        proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(job)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{label} failed ({proc.returncode}):\n{proc.stderr}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{result['step_ms']:.1f} ms", file=sys.stderr, flush=True)
    if not in_process and job["strategy"] == "plan":  # the plan's table: what it chose, measured and kept
        lines = proc.stderr.splitlines()
        warned = {k for k, line in enumerate(lines) if "Warning:" in line}  # a warning and its source line
        print("\n".join("    " + line for k, line in enumerate(lines) if k not in warned and k - 1 not in warned),
              file=sys.stderr, flush=True)
    return result


def budgets(low: int, high: int, count: int) -> list[int]:
    """``count`` budgets from ``low`` to ``high`` bytes, evenly spaced, both ends included."""
    return [int(low + (high - low) * k / (count - 1)) for k in range(count)]


def frontier(args: argparse.Namespace, command: str, scratch: Path) -> list[dict[str, Any]]:
    """Every configuration of every workload: the records."""
    device = "cuda" if args.device == "cuda" else "cpu"
    device_name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    shapes = WORKLOADS if device == "cuda" else CPU_WORKLOADS
    records = []
    for w in args.workloads:
        base = {"workload": w, "device": device, "shape": shapes[w], "steps": args.steps, "warmup": args.warmup,
                "profile": str(scratch / f"{w}_profile.json"), "bandwidth": str(scratch / f"{w}_bandwidth.json")}
        profiled = run({**base, "strategy": "profile"}, args.in_process)
        fixed = {s: run({**base, "strategy": s}, args.in_process) for s in FIXED}
        if device == "cuda":
            low, high = fixed["full_recompute"]["peak_bytes"], fixed["none"]["peak_bytes"]
        else:
            low, high = (int(f * profiled["peak_bytes"]) for f in CPU_BUDGET_FRACTIONS)
        planned = [(b, run({**base, "strategy": "plan", "budget_bytes": b}, args.in_process))
                   for b in budgets(low, high, args.budgets)]
        rows = [(s, None, r) for s, r in fixed.items()] + [("plan", b, r) for b, r in planned]
        for strategy, budget, r in rows:
            records.append({"workload": w, "strategy": strategy, "budget_bytes": budget, "step_ms": r["step_ms"],
                            "peak_bytes": r["peak_bytes"], "predicted_step_ms": r.get("predicted_step_ms"),
                            "predicted_peak_bytes": r.get("predicted_peak_bytes"), "device": device_name,
                            "command": command})
    return records


def targets(records: list[dict[str, Any]]) -> list[str]:
    """The issue's targets, each with its verdict: at or below full recompute's peak, seq32768's
    plan at least 12% faster than full recompute; at every budget, seq8192's plan no slower than
    the best other strategy within it + 1%; predictions within 5% for every planned row."""
    out = []
    for w in sorted({r["workload"] for r in records}):
        rows = [r for r in records if r["workload"] == w]
        full = next(r for r in rows if r["strategy"] == "full_recompute")
        plans = [r for r in rows if r["strategy"] == "plan"]
        others = [r for r in rows if r["strategy"] != "plan"]
        if full["peak_bytes"] is None:
            out.append(f"{w}: no memory measured (CPU): no target evaluated")
            continue
        within = [r for r in plans if r["peak_bytes"] <= full["peak_bytes"]]
        if within:
            best = min(r["step_ms"] for r in within)
            gain = 100 * (1 - best / full["step_ms"])
            verdict = "met" if gain >= 12 else "NOT met"
            speed = f"{gain:.1f}% faster" if gain >= 0 else f"{-gain:.1f}% slower"
            out.append(f"{w}: at or below full recompute's peak the plan is {speed} than full recompute "
                       f"(target, seq32768: >= 12%: {verdict if w == 'seq32768' else 'n/a'})")
        else:
            out.append(f"{w}: no plan measured at or below full recompute's peak")
        for r in plans:
            fits = [o for o in others if o["peak_bytes"] <= r["budget_bytes"]]
            alt = min(fits, key=lambda o: o["step_ms"]) if fits else None
            slower = None if alt is None else 100 * (r["step_ms"] / alt["step_ms"] - 1)
            errs = [100 * (r["predicted_step_ms"] / r["step_ms"] - 1), 100 * (r["predicted_peak_bytes"] / r["peak_bytes"] - 1)]
            ok_pred = all(abs(e) <= 5 for e in errs)
            ok_time = slower is None or slower <= 1
            out.append(f"{w} budget {r['budget_bytes'] / GIB:.2f} GiB: plan {r['step_ms']:.1f} ms, peak "
                       f"{r['peak_bytes'] / GIB:.2f} GiB ({'within' if r['peak_bytes'] <= r['budget_bytes'] else 'OVER'} "
                       f"the budget); best other within it "
                       + ("none" if alt is None else f"{alt['strategy']} {alt['step_ms']:.1f} ms ({slower:+.1f}%: "
                                                      f"{'ok' if ok_time else 'NOT ok'})")
                       + f"; prediction error step {errs[0]:+.1f}%, peak {errs[1]:+.1f}% ({'ok' if ok_pred else 'NOT ok'})")
    return out


def _gib(n: int | None) -> str:
    return "" if n is None else f"{n / GIB:.2f}"


def report(records: list[dict[str, Any]]) -> str:
    """A table per workload (full recompute as the reference) and the targets."""
    commands = " and ".join(f"`{c}`" for c in dict.fromkeys(r["command"] for r in records))  # runs merged
    text = [f"# Memory/time frontier\n\n{commands} (each configuration in its own process) on "
            f"{records[0]['device']}.\n"]
    shapes = CPU_WORKLOADS if records[0]["device"] == "cpu" else WORKLOADS
    for w in sorted({r["workload"] for r in records}):
        rows = [r for r in records if r["workload"] == w]
        full = next(r for r in rows if r["strategy"] == "full_recompute")
        table = []
        order = {s: k for k, s in enumerate(FIXED)}
        for r in sorted(rows, key=lambda r: (order.get(r["strategy"], len(order)), r["budget_bytes"] or 0)):
            pred = r["predicted_step_ms"]
            table.append([r["strategy"], _gib(r["budget_bytes"]), f"{r['step_ms']:.1f}",
                          f"{100 * (r['step_ms'] / full['step_ms'] - 1):+.1f}%", _gib(r["peak_bytes"]),
                          "" if pred is None else f"{pred:.1f}", _gib(r["predicted_peak_bytes"])])
        text += [f"## {w}: {', '.join(f'{k} {v}' for k, v in shapes[w].items())}\n",
                 md_table(["strategy", "budget GiB", "step ms", "vs full recompute", "peak GiB",
                           "predicted step ms", "predicted peak GiB"], table, "llrrrrr"), ""]
    text += ["## Targets\n", *(f"* {t}" for t in targets(records)), ""]
    return "\n".join(text)


def family(strategy: str) -> str:
    if strategy in ("none", "full_recompute"):
        return "no saving / full recompute"
    return {"selective": "selective recompute", "offload": "offload only"}.get(strategy.split(":")[0], strategy)


def plot(records: list[dict[str, Any]], path: Path) -> Path | None:
    """Peak memory (share of no saving's) against step time (share of no saving's), a line per
    strategy family and workload, points sorted by peak: a staircase, each time holding from its
    peak up to the next."""
    series = []
    for w in sorted({r["workload"] for r in records}):
        rows = [r for r in records if r["workload"] == w and r["peak_bytes"]]
        none = next((r for r in rows if r["strategy"] == "none"), None)
        if none is None:
            continue
        for fam in dict.fromkeys(family(r["strategy"]) for r in rows):
            pts = sorted((100 * r["peak_bytes"] / none["peak_bytes"], 100 * r["step_ms"] / none["step_ms"])
                         for r in rows if family(r["strategy"]) == fam)
            series.append((f"{w}: {fam}", [x for x, _ in pts], [y for _, y in pts]))
    if not series:
        return None  # no memory measured (CPU)
    return lines(path, series, "Memory/time frontier (GPT stack, hidden 4096, bf16)",
                 "peak memory, % of no saving", "step time, % of no saving")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.worker:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            print(json.dumps(worker(json.loads(args.worker))))
        return 0
    command = shlex.join(["python", "benchmarks/frontier.py", *argv])
    with tempfile.TemporaryDirectory() as scratch:
        records = frontier(args, command, Path(scratch))
    assert all(tuple(r) == FIELDS for r in records)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "frontier.json").write_text(json.dumps(records, indent=1) + "\n")
    text = report(records)
    (out / "frontier.md").write_text(text)
    picture = plot(records, out / "frontier.png")
    print(text)
    print(f"results: {out / 'frontier.json'}, {out / 'frontier.md'}, "
          f"{picture or 'no plot (no memory measured)'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
