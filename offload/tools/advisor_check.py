"""The advisor's prediction against a real run.

    python -m offload.tools.advisor_check --profile profile.json --advice advice.json --out check.json

Rebuilds the profiled workload and trains it, in one process, without offloading (before and
after the others, to see the drift), with each module the advisor calls free alone, with the
whole free set (with the ``max_inflight_groups`` the advice gives it) and with the budget's
offload-only set. For each: median step time over ``--steps`` steps (GPU synchronized before
each, CUDA events read once the step's end event has completed) and the memory peak. Checks:

* predicted vs measured peak memory within ``--peak-tolerance`` (default 10%) of the measured;
* every module called free alone, and the free set, costs at most ``--free-cost-pct`` (default
  2%) of step time.

Exits with 1 if a check fails. A profile made on CPU is refused (host times, no memory peak:
nothing to check); `check` itself runs on CPU too (the tests use it there).
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import warnings
from typing import Any

import torch

import offload

from .advise import read_profile
from .advisor import Model
from .bandwidth import Bandwidth
from .report import gib, md_table, publish, read_json
from .workload import Workload, build_workload, describe_device


def run_config(work: Workload, modules: list[str], steps: int, warmup: int, min_tensor_bytes: int,
               max_inflight_groups: int = 1) -> dict[str, Any]:
    """Median step time, memory peak and the engine's statistics with ``modules`` offloaded."""
    cuda = work.device.type == "cuda"
    offload.configure(modules, min_tensor_bytes=min_tensor_bytes, max_inflight_groups=max_inflight_groups,
                      timing=True, device=work.device)
    handle = offload.attach(work.model, {n: work.mapping[n] for n in modules}) if modules else None
    try:
        for _ in range(warmup):
            work.step()
            offload.end_iteration()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times, stats = [], None
        for _ in range(steps):
            if cuda:
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                work.step()
                end.record()
                stats = offload.end_iteration()
                end.synchronize()  # elapsed_time needs both events completed
                times.append(start.elapsed_time(end))
            else:
                import time

                t0 = time.perf_counter()
                work.step()
                times.append((time.perf_counter() - t0) * 1e3)
                stats = offload.end_iteration()
    finally:
        if handle is not None:
            handle.remove()
        offload.reset(release_pool=True)
    total = stats.total()
    return {
        "modules": modules, "max_inflight_groups": max_inflight_groups,
        "step_ms": statistics.median(times), "step_ms_min": min(times),
        "peak_allocated": torch.cuda.max_memory_allocated() if cuda else None,
        "offloaded_bytes": total.bytes_offloaded,
        "offloaded_by_name": {n: s.bytes_offloaded for n, s in stats.by_name.items()},
        "held_elsewhere_bytes": total.bytes_held_elsewhere, "reloads_on_demand": total.reloads_on_demand,
        "d2h_gbps": total.d2h_gbps if cuda else None, "h2d_gbps": total.h2d_gbps if cuda else None,
        "wait_ms": total.offload_wait_ms + total.reload_wait_ms,
    }


def configs_from_advice(advice: dict[str, Any]) -> list[tuple[str, list[str], int, bool]]:
    """``(label, modules, max_inflight_groups, called free)`` for each configuration to run
    besides the baseline: each name of the free set alone, the free set, the budget's
    offload-only set."""
    free = list(advice["free"])
    inflight = int(advice.get("free_max_inflight_groups", 1))
    out = [(name, [name], 1, True) for name in free]
    if len(free) > 1:
        out.append(("free set", free, inflight, True))
    elif free and inflight != 1:
        out[0] = (free[0], free, inflight, True)
    b = advice.get("budget_offload_only")
    if b and b["prediction"]["offload"] and b["prediction"]["offload"] not in [m for _, m, _, _ in out]:
        out.append(("budget (offload only)", list(b["prediction"]["offload"]),
                    int(b["prediction"].get("max_inflight_groups", 1)), False))
    return out


def check(profile: dict[str, Any], advice: dict[str, Any], steps: int, warmup: int,
          peak_tolerance: float, free_cost_pct: float,
          extra: list[tuple[str, list[str], int]] = ()) -> dict[str, Any]:
    """Run every configuration (the advice's, then ``extra``: ``(label, modules,
    max_inflight_groups)``, whose peaks only are checked) and compare with the predictions."""
    work = build_workload(profile["workload"])
    model = Model(profile, Bandwidth.constant(1.0))  # peaks do not depend on bandwidth
    mtb = profile["min_tensor_bytes"]
    cuda = work.device.type == "cuda"

    def fresh() -> None:
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        first = run_config(work, [], steps, warmup, mtb)
        rows = []
        configs = configs_from_advice(advice) + [(label, list(m), k, False) for label, m, k in extra]
        for label, modules, inflight, called_free in configs:
            fresh()
            r = run_config(work, modules, steps, warmup, mtb, inflight)
            r.update(label=label, called_free=called_free)
            rows.append(r)
        fresh()
        last = run_config(work, [], steps, warmup, mtb)
    base_ms = (first["step_ms"] + last["step_ms"]) / 2
    base_peak = first["peak_allocated"]
    failures = []
    for r in rows:
        pred = model.predict(offload=r["modules"], max_inflight_groups=r["max_inflight_groups"])
        r["predicted_offloaded_bytes"] = pred.offloaded_bytes
        r["predicted_inflight_bytes"] = pred.inflight_bytes
        r["overhead_pct"] = 100 * (r["step_ms"] / base_ms - 1)
        # shift the profile's prediction by any difference between the two baselines
        if cuda and pred.peak_bytes is not None:
            r["predicted_peak"] = base_peak - pred.freed_at_peak
            r["predicted_freed"] = pred.freed_at_peak
            r["measured_freed"] = base_peak - r["peak_allocated"]
            r["peak_error_pct"] = 100 * (r["predicted_peak"] - r["peak_allocated"]) / r["peak_allocated"]
            r["peak_ok"] = abs(r["peak_error_pct"]) <= 100 * peak_tolerance
            if not r["peak_ok"]:
                failures.append(f"{r['label']}: predicted peak {gib(r['predicted_peak'])} GiB, measured "
                                f"{gib(r['peak_allocated'])} GiB ({r['peak_error_pct']:+.1f}%)")
        else:
            r["predicted_peak"] = r["peak_error_pct"] = r["peak_ok"] = None
            r["predicted_freed"] = r["measured_freed"] = None
        r["time_ok"] = r["overhead_pct"] <= free_cost_pct if r["called_free"] else None
        if r["time_ok"] is False:
            failures.append(f"{r['label']} is called free but costs {r['overhead_pct']:+.1f}% "
                            f"(limit {free_cost_pct:g}%)")
    return {
        "tool": "advisor_check", "workload": profile["workload"], "device": describe_device(work.device),
        "torch": torch.__version__, "steps": steps, "warmup": warmup, "peak_tolerance": peak_tolerance,
        "free_cost_pct": free_cost_pct, "profile_peak": profile.get("peak_allocated"),
        "baseline_first": first, "baseline_last": last, "baseline_step_ms": base_ms,
        "baseline_peak": base_peak, "rows": rows, "failures": failures, "passed": not failures,
    }


def render(result: dict[str, Any]) -> str:
    """The comparison as a Markdown table and the verdicts."""
    f, l = result["baseline_first"], result["baseline_last"]
    rows = [["none", "", f"{result['baseline_step_ms']:.2f}", "", gib(result["baseline_peak"]), "", "", "", "", ""]]
    for r in result["rows"]:
        m = r.get("max_inflight_groups", 1)
        rows.append([
            r["label"], ",".join(r["modules"]) + (f" (in flight {m})" if m != 1 else ""),
            f"{r['step_ms']:.2f}", f"{r['overhead_pct']:+.2f}%",
            gib(r["peak_allocated"]), gib(r["predicted_peak"]),
            "n/a" if r["peak_error_pct"] is None else f"{r['peak_error_pct']:+.1f}%",
            f"{gib(r.get('measured_freed'))} / {gib(r.get('predicted_freed'))}",
            f"{gib(r['offloaded_bytes'])} / {gib(r['predicted_offloaded_bytes'])}",
            ("free: " + ("ok" if r["time_ok"] else "FAIL")) if r["called_free"] else "",
        ])
    lines = [
        f"{result['device']}, torch {result['torch']}; median of {result['steps']} steps after "
        f"{result['warmup']} warm-up steps. Baseline {f['step_ms']:.2f} ms before the others, {l['step_ms']:.2f} ms "
        f"after (drift {100 * (l['step_ms'] / f['step_ms'] - 1):+.2f}%).", "",
        md_table(["config", "modules", "step ms", "overhead", "peak GiB", "predicted GiB", "peak error",
                  "freed GiB measured / predicted", "offloaded GiB measured / predicted", "check"], rows,
                 "llrrrrrrrl"), "",
        f"Checks: peak within {100 * result['peak_tolerance']:g}%, free modules and the free set within "
        f"{result['free_cost_pct']:g}%: " + ("PASSED" if result["passed"] else "FAILED"),
    ]
    lines += [f"* {x}" for x in result["failures"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True)
    p.add_argument("--advice", required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--peak-tolerance", type=float, default=0.10)
    p.add_argument("--free-cost-pct", type=float, default=2.0)
    p.add_argument("--out", default="check.json")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1, --warmup >= 0")
    profile = read_profile(args.profile)
    advice = read_json(args.advice, "--advice")
    result = check(profile, advice, args.steps, args.warmup, args.peak_tolerance, args.free_cost_pct)
    publish(args.out, result, render(result))
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
