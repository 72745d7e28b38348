"""Which modules to offload, which to recompute, for a memory budget: a table and the settings.

    python -m offload.tools.advise --profile profile.json --bandwidth bandwidth.json \\
        --budget-gib 8 --out advice.json

Reads a module profile (`offload.tools.profile_modules`) and a bandwidth probe
(`offload.tools.bandwidth`; or ``--link-gbps`` for a flat estimate), and prints per name:
bytes per group, copy time against a layer's compute, the predicted memory freed at the peak
and cost, alone, offloaded and recomputed, with a verdict. Then the free set and, with a
budget, the cheapest assignment that meets it, as ``--offload-modules=...`` (and
``--recompute-modules=...``). The free set is chosen for the names together (their copies share
one stream), never only name by name. The arithmetic is in `offload.tools.advisor`. A profile
made on CPU is refused: its times are host times and it has no memory peak.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from .advisor import DEFAULT_FREE_COST_PCT, DEFAULT_HEADROOM, advise
from .bandwidth import Bandwidth
from .report import GIB, gib, md_table, mib, publish, read_json


def read_profile(path: str) -> dict[str, Any]:
    """The module profile at ``path``; exits with a message if it was made on CPU, where every
    name would look free (host times, no memory peak)."""
    profile = read_json(path, "--profile")
    if profile.get("device") == "cpu":
        raise SystemExit(
            f"--profile: {path} was made on CPU, where module times are host times and there is no memory "
            "peak: a CPU profile cannot be advised on (every name would look free). Profile on the GPU: "
            "python -m offload.tools.profile_modules --device cuda ..."
        )
    return profile


def table(advice: dict[str, Any]) -> str:
    """One row per name: what offloading it alone and recomputing it alone would do."""
    rows = []
    for r in advice["modules"]:
        off, rec = r["offload"], r["recompute"]
        per_group = off["bytes_per_group"].get(r["name"], 0)
        rows.append([
            r["name"], mib(per_group), f"{off['d2h_ms_per_layer']:.2f}", f"{r['copy_fraction']:.0%}",
            mib(off["freed_at_peak"]), f"{off['cost_ms']:.2f}", mib(rec["freed_at_peak"]),
            f"{rec['cost_ms']:.2f}", f"**{r['verdict']}**",
        ])
    return md_table(["name", "MiB/group", "D2H ms/layer", "of compute", "offload frees MiB", "offload ms",
                     "recompute frees MiB", "recompute ms", "verdict (alone)"], rows, "lrrrrrrrl")


def render(advice: dict[str, Any]) -> str:
    """The whole report, in Markdown."""
    fp = advice["free_prediction"]
    free_pct = advice.get("free_cost_pct", DEFAULT_FREE_COST_PCT)
    lines = [
        f"{advice['layers']} layers; a layer's forward {advice['forward_window_ms']:.2f} ms, backward "
        f"{advice['backward_window_ms']:.2f} ms; step {advice['step_ms']:.2f} ms; compute slowdown under "
        f"copies {100 * advice['compute_slowdown']:.1f}%. Free = one layer's copies within "
        f"{advice['headroom']:.0%} of a layer's compute and a predicted cost within {free_pct:g}% of the step; "
        "the verdicts are for each name alone.", "", table(advice), "",
    ]
    if advice["free"]:
        m = advice.get("free_max_inflight_groups", 1)
        inflight = "" if m == 1 else (f" with max_inflight_groups={m} (one group in flight per name of a layer; "
                                      "with 1 the copies would wait for each other)")
        lines.append(
            f"Free set (the names together, one copy stream): `{advice['free_flags']}`{inflight}: one layer's copies "
            f"{fp['d2h_ms_per_layer']:.2f} ms ({advice.get('free_copy_fraction', 0):.0%} of its forward), frees "
            f"{gib(fp['freed_at_peak'])} GiB at the peak (predicted peak {gib(fp['peak_bytes'])} GiB of "
            f"{gib(advice['peak_allocated'])}), predicted cost {fp['cost_ms']:.2f} ms ({fp['cost_pct']:.1f}%).")
    else:
        lines.append(f"Free set: none: no name's copies fit a layer's compute within {free_pct:g}% of the step.")
    t = advice.get("free_alone_together")
    if t and sorted(t["offload"]) != sorted(advice["free"]):
        lines += ["", f"The names free alone, together (`{','.join(t['offload'])}`), are not: one layer's copies "
                      f"take {t['copy_fraction']:.0%} of its forward and they would cost {t['cost_pct']:.1f}%."]
    for key, title in (("budget", "Budget"), ("budget_offload_only", "Budget, offloading only")):
        b = advice.get(key)
        if b is None:
            continue
        p = b["prediction"]
        state = "meets it" if b["meets_budget"] else "does NOT meet it (the lowest peak reachable)"
        lines += ["", f"{title} {gib(b['budget_bytes'])} GiB: `{b['flags']}` {state}: predicted peak "
                      f"{gib(p['peak_bytes'])} GiB, frees {gib(p['freed_at_peak'])} GiB, predicted cost "
                      f"{p['cost_ms']:.2f} ms ({p['cost_pct']:.1f}%)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--profile", required=True, help="JSON from offload.tools.profile_modules")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--bandwidth", help="JSON from offload.tools.bandwidth")
    src.add_argument("--link-gbps", type=float, help="assume this bandwidth at every size instead")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--budget-gib", type=float, help="the memory peak to reach (GiB)")
    budget.add_argument("--budget-below-peak-gib", type=float,
                        help="the memory peak to reach, as GiB below the profile's measured peak")
    p.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM,
                   help="free = one layer's copies (all names) within this fraction of its compute "
                        f"(default {DEFAULT_HEADROOM})")
    p.add_argument("--free-cost-pct", type=float, default=DEFAULT_FREE_COST_PCT,
                   help=f"free = also a predicted cost within this %% of the step (default {DEFAULT_FREE_COST_PCT:g})")
    p.add_argument("--no-recompute", action="store_true", help="offloading only")
    p.add_argument("--out", default="advice.json")
    args = p.parse_args(argv)
    profile = read_profile(args.profile)
    try:
        bw = Bandwidth.load(args.bandwidth) if args.bandwidth else Bandwidth.constant(args.link_gbps)
        budget = None if args.budget_gib is None else int(args.budget_gib * GIB)
        if args.budget_below_peak_gib is not None:
            if profile.get("peak_allocated") is None:
                raise ValueError("--budget-below-peak-gib needs a profile with a measured peak (run it on the GPU)")
            budget = int(profile["peak_allocated"] - args.budget_below_peak_gib * GIB)
        advice = advise(profile, bw, budget, args.headroom, not args.no_recompute, args.free_cost_pct)
    except ValueError as e:
        p.error(str(e))
    advice["inputs"] = {"profile": args.profile, "bandwidth": args.bandwidth, "link_gbps": args.link_gbps}
    publish(args.out, advice, render(advice))
    return 0


if __name__ == "__main__":
    sys.exit(main())
