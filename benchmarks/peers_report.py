"""Figures, targets, tables and plots of a `benchmarks/peers.py` run (no torch needed here).

`evaluate` adds the derived figures to each record (throughput against no offloading, memory
removed, whether the copies fit under compute) and `targets` checks the issue's four targets;
`markdown` and `plot` present them; `finish` writes ``peers.json``, ``peers.md`` and the PNGs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

GIB = 2**30
MIB = 2**20
LINK_FALLBACK_GBPS = 50.0  # used for "fits" and predictions when the run has no bandwidth probe
TIME_TARGET_PCT = 1.0  # where copies fit: step time within this of no offloading
MEMORY_TARGET = 0.95  # peak lower by this fraction of the bytes offloaded
RECOMPUTE_SPEEDUP = 1.10  # offload + selective recompute: this much throughput of full recompute
EQUAL_REMOVED = 0.98  # "equal memory removed": at least this fraction of the peer's
PINNED_TARGET = 1.05  # pinned host bytes / peak offloaded bytes
OURS = ("offload", "offload+recompute")


def _ok(r: dict | None) -> bool:
    return r is not None and r.get("status") == "ok"


def link_gbps(records: list[dict]) -> tuple[float, str]:
    """The link rate for predictions: the run's own probe (D2H), else the fallback."""
    probe = next((r for r in records if r.get("kind") == "probe" and _ok(r)), None)
    if probe and probe.get("d2h_gbps"):
        return probe["d2h_gbps"], f"measured at the start of this run ({probe['copy_mib']} MiB pinned copies)"
    return LINK_FALLBACK_GBPS, "assumed (no bandwidth probe in this run)"


def per_layer_bytes(record: dict, layers: int) -> float | None:
    """Offloaded bytes of one layer: for each name, its bytes over the layers it offloaded
    (a name may run several groups per layer, e.g. one per expert)."""
    engine = record.get("engine")
    if not engine:
        return None
    total = 0.0
    for s in engine["by_name"].values():
        if s["groups_offloaded"] and s["groups"]:
            per_layer_groups = s["groups"] / layers
            total += s["bytes_offloaded"] / (s["groups_offloaded"] / per_layer_groups)
    return total


BASELINE_FIELDS = ("step_ms", "peak_allocated", "peak_reserved", "host_ms", "layer_forward_ms")


def stamp_baselines(records: list[dict], date: str | None = None) -> None:
    """Give every row of one run a copy of that run's no-offloading figures (``baseline``), so
    that it keeps its own reference when the report merges it with rows of other runs."""
    base = {(r["kind"], r["size"]): r for r in records
            if r.get("kind") in ("config", "sweep") and r["config"]["name"] == "none" and _ok(r)}
    for r in records:
        b = base.get((r.get("kind"), r.get("size")))
        if b is not None and b is not r and _ok(r):
            r["baseline"] = {**{k: b.get(k) for k in BASELINE_FIELDS}, "date": date}


def evaluate(records: list[dict], link: float) -> None:
    """Add derived figures to every ``ok`` record of a configuration or sweep point, in place."""
    base = {(r["kind"], r["size"]): r for r in records
            if r.get("kind") in ("config", "sweep") and r["config"]["name"] == "none" and _ok(r)}
    for r in records:
        if r.get("kind") not in ("config", "sweep") or not _ok(r):
            continue
        # a row is compared with the no-offloading row of its own run (merged reports hold rows
        # of several runs, and step times drift between runs more than the targets allow)
        b = r.get("baseline") or base.get((r["kind"], r["size"]))
        if b is None:
            continue
        layers = r["spec"]["layers"]
        on_gpu = r.get("peak_allocated") is not None and b.get("peak_allocated") is not None
        r["throughput_rel"] = b["step_ms"] / r["step_ms"]
        r["overhead_pct"] = 100 * (r["step_ms"] / b["step_ms"] - 1)
        r["memory_removed"] = b["peak_allocated"] - r["peak_allocated"] if on_gpu else None
        moved = r.get("bytes_offloaded") or 0
        r["removed_over_offloaded"] = r["memory_removed"] / moved if on_gpu and moved else None
        pinned = r.get("pinned_bytes")
        r["pinned_over_offloaded"] = pinned / moved if pinned is not None and moved else None
        lb = per_layer_bytes(r, layers)
        if lb is not None and b.get("layer_forward_ms"):
            copy_ms = lb / (link * 1e9) * 1e3
            r["copy_fit"] = {"layer_bytes": lb, "copy_ms": copy_ms, "layer_forward_ms": b["layer_forward_ms"],
                             "link_gbps": link, "fits": copy_ms <= b["layer_forward_ms"]}
            r["extra_ms_per_layer"] = (r["step_ms"] - b["step_ms"]) / layers


def _gib(x: float | None, digits: int = 2) -> str:
    return "n/a" if x is None else f"{x / GIB:.{digits}f}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.0%}"


def _find(records: list[dict], size: str, name: str) -> dict | None:
    return next((r for r in records if r.get("kind") == "config" and r["size"] == size
                 and r["config"]["name"] == name), None)


def targets(records: list[dict], sizes: Iterable[str]) -> dict[str, list[dict]]:
    """The issue's four targets, one verdict per row where each applies:
    ``{"target": [{"size", "config", "verdict": met | not met | n/a, "reason"}]}``."""
    out: dict[str, list[dict]] = {"fit": [], "recompute": [], "peers": [], "pinned": []}
    for size in sizes:
        rows = [r for r in records if r.get("kind") == "config" and r["size"] == size]
        ours = [r for r in rows if r["config"]["family"] in OURS and _ok(r) and r.get("memory_removed") is not None]
        for r in rows:
            name, family = r["config"]["name"], r["config"]["family"]
            if family == "offload":
                if not _ok(r):
                    out["fit"].append({"size": size, "config": name, "verdict": "n/a",
                                       "reason": f"{r.get('status')}: {r.get('reason') or r.get('error')}"})
                    continue
                fit = r.get("copy_fit")
                if fit is None or r.get("memory_removed") is None:
                    out["fit"].append({"size": size, "config": name, "verdict": "n/a",
                                       "reason": "no GPU figures (CPU run)"})
                    continue
                copy = (f"one layer's {fit['layer_bytes'] / MIB:.0f} MiB take {fit['copy_ms']:.2f} ms at "
                        f"{fit['link_gbps']:.0f} GB/s against a {fit['layer_forward_ms']:.2f} ms layer forward")
                if not fit["fits"]:
                    out["fit"].append({"size": size, "config": name, "verdict": "n/a",
                                       "reason": f"copies do not fit: {copy}; step {r['overhead_pct']:+.1f}%"})
                    continue
                ratio = r["removed_over_offloaded"]
                time_ok = r["overhead_pct"] <= TIME_TARGET_PCT
                mem_ok = ratio is not None and ratio >= MEMORY_TARGET
                out["fit"].append({
                    "size": size, "config": name, "verdict": "met" if time_ok and mem_ok else "not met",
                    "reason": (f"fits ({copy}); step {r['overhead_pct']:+.2f}% "
                               f"({'≤' if time_ok else '>'} {TIME_TARGET_PCT:g}%); removed "
                               f"{_gib(r['memory_removed'])} of {_gib(r['bytes_offloaded'])} GiB offloaded = "
                               f"{_pct(ratio)} ({'≥' if mem_ok else '<'} {MEMORY_TARGET:.0%})"),
                    "time": "met" if time_ok else "not met", "memory": "met" if mem_ok else "not met"})
            elif family == "offload+recompute":
                full = _find(records, size, "recompute:full")
                if not (_ok(r) and _ok(full)) or r.get("peak_allocated") is None:
                    out["recompute"].append({"size": size, "config": name, "verdict": "n/a",
                                             "reason": "not measured on a GPU" if _ok(r) and _ok(full) else
                                             f"row or full recompute not run ({r.get('status')})"})
                    continue
                speed = full["step_ms"] / r["step_ms"]
                mem_ok = r["peak_allocated"] <= full["peak_allocated"]
                fast_ok = speed >= RECOMPUTE_SPEEDUP
                out["recompute"].append({
                    "size": size, "config": name, "verdict": "met" if mem_ok and fast_ok else "not met",
                    "reason": (f"peak {_gib(r['peak_allocated'])} vs full recompute {_gib(full['peak_allocated'])} "
                               f"GiB ({'≤' if mem_ok else '>'}); step {r['step_ms']:.1f} vs {full['step_ms']:.1f} ms = "
                               f"{speed:.2f}x full recompute's throughput ({'≥' if fast_ok else '<'} "
                               f"{RECOMPUTE_SPEEDUP:.2f}x)")})
            elif r["config"]["peer"] in ("save_on_cpu", "torchtune"):
                if not _ok(r) or r.get("memory_removed") is None:
                    out["peers"].append({"size": size, "config": name, "verdict": "n/a",
                                         "reason": f"peer {r.get('status')}: {r.get('reason') or r.get('error')}"
                                         if not _ok(r) else "no GPU figures (CPU run)"})
                    continue
                need = EQUAL_REMOVED * r["memory_removed"]
                candidates = [o for o in ours if o["memory_removed"] >= need]
                if not candidates:
                    best = max(ours, key=lambda o: o["memory_removed"], default=None)
                    out["peers"].append({"size": size, "config": name, "verdict": "not met", "reason": (
                        f"{name} removes {_gib(r['memory_removed'])} GiB; no offload row removes "
                        f"≥ {EQUAL_REMOVED:.0%} of that" + (f" (most: {best['config']['name']}, "
                                                           f"{_gib(best['memory_removed'])} GiB)" if best else ""))})
                    continue
                best = min(candidates, key=lambda o: o["step_ms"])
                faster = best["step_ms"] < r["step_ms"]
                out["peers"].append({
                    "size": size, "config": name, "verdict": "met" if faster else "not met",
                    "reason": (f"{best['config']['name']} removes {_gib(best['memory_removed'])} GiB "
                               f"(≥ {EQUAL_REMOVED:.0%} of {name}'s {_gib(r['memory_removed'])}) in "
                               f"{best['step_ms']:.1f} ms vs {r['step_ms']:.1f} ms "
                               f"({r['step_ms'] / best['step_ms']:.2f}x)")})
        for r in rows:
            if r["config"]["family"] not in OURS or not _ok(r) or not r.get("bytes_offloaded"):
                continue
            name, ratio = r["config"]["name"], r.get("pinned_over_offloaded")
            if r.get("peak_allocated") is None or ratio is None:
                out["pinned"].append({"size": size, "config": name, "verdict": "n/a",
                                      "reason": "CPU run: the pool's buffers are not pinned there"})
                continue
            verdict = "met" if ratio <= PINNED_TARGET else "not met"
            out["pinned"].append({"size": size, "config": name, "verdict": verdict, "reason": (
                f"pinned {_gib(r['pinned_bytes'], 3)} GiB for {_gib(r['bytes_offloaded'], 3)} GiB offloaded "
                f"per step = {ratio:.3f}x ({'≤' if verdict == 'met' else '>'} {PINNED_TARGET:g}x)")})
    return out


TARGET_TEXT = {
    "fit": f"Where copies fit under compute: step time within {TIME_TARGET_PCT:g}% of no offloading, and peak "
           f"memory lower by ≥ {MEMORY_TARGET:.0%} of the bytes offloaded (`offload` rows with one module set)",
    "recompute": f"`offload` + selective recompute: peak memory at or below full recompute, and at least "
                 f"{RECOMPUTE_SPEEDUP - 1:.0%} faster (throughput ≥ {RECOMPUTE_SPEEDUP:.2f}x full recompute's)",
    "peers": f"Faster than `save_on_cpu` and torchtune at equal memory removed (the fastest `offload` row that "
             f"removes ≥ {EQUAL_REMOVED:.0%} of what the peer removes)",
    "pinned": f"Pinned host bytes at most {PINNED_TARGET:g}x the peak offloaded bytes (every `offload` row)",
}


def summary_lines(verdicts: dict[str, list[dict]]) -> list[str]:
    lines = []
    for key, text in TARGET_TEXT.items():
        rows = verdicts[key]
        applies = [v for v in rows if v["verdict"] != "n/a"]
        met = sum(v["verdict"] == "met" for v in applies)
        state = "no row where it applies" if not applies else (
            "MET" if met == len(applies) else "NOT MET")
        lines.append(f"* **{state}** ({met} of {len(applies)} rows where it applies, {len(rows) - len(applies)} n/a): "
                     f"{text}")
    return lines


HEADER = ("| config | what | step ms | throughput | peak GiB | reserved GiB | removed GiB | offloaded GiB "
          "| removed/offloaded | D2H / H2D GB/s | pinned GiB | pinned/offloaded | host ms | copies fit |")
RULE = "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|:-:|"


def row(r: dict) -> str:
    name, label = r["config"]["name"], r["config"]["label"]
    if not _ok(r):
        why = r.get("reason") or r.get("error") or ""
        return f"| {name} | {label} | {r.get('status', 'error').replace('_', ' ')}: {why} |" + " |" * 11
    base = r["config"]["family"] == "none"
    bw = "" if base else (
        f"{r['d2h_gbps']:.1f} / {r['h2d_gbps']:.1f}" if r.get("d2h_gbps") and r.get("h2d_gbps") else "n/a")
    fit = r.get("copy_fit")
    cells = [
        name, label, f"{r['step_ms']:.1f}", "" if base else f"{r.get('throughput_rel', 0):.3f}",
        _gib(r.get("peak_allocated")), _gib(r.get("peak_reserved")),
        "" if base else _gib(r.get("memory_removed")),
        "" if base else _gib(r.get("bytes_offloaded"), 3),
        "" if base or not r.get("bytes_offloaded") else _pct(r.get("removed_over_offloaded")),
        bw, "" if base else _gib(r.get("pinned_bytes"), 3),
        "" if not r.get("pinned_over_offloaded") else f"{r['pinned_over_offloaded']:.3f}",
        f"{r['host_ms']:.1f}", "" if fit is None else ("yes" if fit["fits"] else "no"),
    ]
    return "| " + " | ".join(cells) + " |"


def sweep_points(records: list[dict]) -> list[dict]:
    """One entry per sweep point with a baseline and an offload row, in run order."""
    points = []
    for b in records:
        if b.get("kind") != "sweep" or b["config"]["name"] != "none":
            continue
        o = next((r for r in records if r.get("kind") == "sweep" and r["size"] == b["size"]
                  and r["config"]["name"] != "none"), None)
        spec = b["spec"]
        point = {"axis": b["axis"], "size": b["size"], "seq": spec["seq"], "hidden": spec["hidden"],
                 "layers": spec["layers"], "none": b, "offload": o}
        if _ok(b) and _ok(o) and o.get("copy_fit"):
            point.update(layer_forward_ms=o["copy_fit"]["layer_forward_ms"], copy_ms=o["copy_fit"]["copy_ms"],
                         layer_mib=o["copy_fit"]["layer_bytes"] / MIB, overhead_pct=o["overhead_pct"],
                         extra_ms_per_layer=o["extra_ms_per_layer"], d2h_gbps=o.get("d2h_gbps"))
        points.append(point)
    return points


def markdown(records: list[dict], meta: dict, sizes: list[Any], verdicts: dict, link: tuple[float, str],
             plots: list[str]) -> str:
    """The whole ``peers.md``."""
    configs = [r for r in records if r.get("kind") == "config"]
    any_ok = next((r for r in configs if _ok(r)), None)
    steps = any_ok["steps"] if any_ok else "?"
    warmup = any_ok["warmup"] if any_ok else "?"
    lines = [
        "# `offload` against its peers",
        "",
        f"{meta['device']}, torch {meta['torch']}, Python {meta['python']}, {meta['date']}; the whole run took "
        f"{meta['wall_s']:.0f} s. Command: `{meta['command']}`",
        "",
        f"Each configuration ran in a process of its own: median of {steps} timed steps (CUDA events around "
        f"forward+backward, the GPU idle before each step; perf_counter on CPU) after {warmup} warm-up steps. Link rate for \"copies fit\" "
        f"and the sweep's prediction: {link[0]:.1f} GB/s device-to-host, {link[1]}. Columns and method: "
        "[benchmarks/README.md](../../benchmarks/README.md#peerspy-offload-against-its-peers).",
        "",
        "Rows merged from several runs (`--merge`) are each compared with the `none` row of their own run "
        "(`baseline` in the JSON, with its date): step times drift between runs on the same machine by more "
        "than the 1% target. The `none` row shown is the latest run's.",
        "",
    ]
    for spec in sizes:
        rows = [r for r in configs if r["size"] == spec.name]
        if not rows:
            continue
        lines += [f"## {spec.name}: {'MoE' if spec.experts else 'GPT'} stack, {spec.describe()}", "",
                  HEADER, RULE, *(row(r) for r in rows), ""]
        profiled = [r for r in rows if _ok(r) and r.get("profile", {}).get("d2h")]
        if profiled:
            lines += [
                "One extra step under `torch.profiler` (CUDA activity): copies per direction, the share of copy "
                "time during which a kernel ran, and the time the GPU ran nothing inside the step.",
                "",
                "| config | D2H MiB | D2H ms | D2H GB/s | D2H under compute | H2D MiB | H2D ms | H2D GB/s "
                "| H2D under compute | kernel busy ms | GPU idle ms | trace |",
                "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
            ]
            for r in profiled:
                pr = r["profile"]
                cells = [r["config"]["name"]]
                for kind in ("d2h", "h2d"):
                    d = pr[kind]
                    cells += [f"{d['bytes'] / MIB:.0f}", f"{d['copy_ms']:.1f}",
                              "n/a" if d["gbps"] is None else f"{d['gbps']:.1f}", _pct(d["under_compute"])]
                cells += ["n/a" if pr.get("kernel_busy_ms") is None else f"{pr['kernel_busy_ms']:.1f}",
                          "n/a" if pr.get("gpu_idle_ms") is None else f"{pr['gpu_idle_ms']:.1f}",
                          f"`traces/{pr['trace']}`" if str(pr.get("trace", "")).endswith(".gz")
                          else (pr.get("trace") or "not kept")]
                lines.append("| " + " | ".join(cells) + " |")
            lines.append("")
        for r in rows:
            peer = r.get("peer_copies")
            if _ok(r) and peer and peer["bytes_offloaded"]:
                lines.append(f"* `{r['config']['name']}` copied {_gib(peer['bytes_offloaded'], 3)} GiB in "
                             f"{peer['tensors']} tensors per step, of which {_gib(peer['param_bytes'], 3)} GiB were "
                             f"weights (views such as `weight.t()`, saved by the matmuls; their GPU copy stays) and "
                             f"{_gib(peer['duplicate_bytes'], 3)} GiB storages copied a second time.")
        lines.append("")
    lines += ["## Targets", "", *summary_lines(verdicts), ""]
    for key, text in TARGET_TEXT.items():
        lines += [f"### {text}", ""]
        if not verdicts[key]:
            lines += ["No row.", ""]
        for v in verdicts[key]:
            lines.append(f"* {v['size']} `{v['config']}`: **{v['verdict']}**: {v['reason']}")
        lines.append("")
    points = sweep_points(records)
    if points:
        lines += [
            "## Scaling sweep: where copies stop hiding behind compute",
            "",
            "GPT stack, offloading `qkv_linear`, `core_attn`, `attn_proj`. Per layer: the forward time of the "
            "baseline, the prediction `bytes / bandwidth` for the layer's offloaded bytes, and the measured extra "
            "step time per layer ((offload step - baseline step) / layers).",
            "",
            "| axis | seq | hidden | layer forward ms | offloaded MiB/layer | predicted copy ms | copies fit "
            "| measured extra ms/layer | overhead | D2H GB/s |",
            "|---|---:|---:|---:|---:|---:|:-:|---:|---:|---:|",
        ]
        for p in points:
            if "copy_ms" not in p:
                bad = p["offload"] if p["offload"] and not _ok(p["offload"]) else p["none"]
                why = "" if bad is None else f"{bad.get('status')}: {bad.get('reason') or bad.get('error') or ''}"
                lines.append(f"| {p['axis']} | {p['seq']} | {p['hidden']} | {why} |" + " |" * 6)
                continue
            lines.append(
                f"| {p['axis']} | {p['seq']} | {p['hidden']} | {p['layer_forward_ms']:.2f} | {p['layer_mib']:.0f} "
                f"| {p['copy_ms']:.2f} | {'yes' if p['copy_ms'] <= p['layer_forward_ms'] else 'no'} "
                f"| {p['extra_ms_per_layer']:.2f} | {p['overhead_pct']:+.1f}% "
                f"| {'n/a' if not p['d2h_gbps'] else format(p['d2h_gbps'], '.1f')} |")
        lines.append("")
    if plots:
        lines += ["## Plots", ""] + [f"![{Path(p).stem}]({Path(p).name})" for p in plots] + [""]
    else:
        lines += ["## Plots", "", "Not made: matplotlib is not installed where this ran.", ""]
    return "\n".join(lines)


FAMILY_STYLE = {
    "none": ("black", "o"), "recompute": ("tab:gray", "s"), "offload": ("tab:blue", "o"),
    "offload+recompute": ("tab:green", "D"), "peer": ("tab:red", "^"),
}


def plot(records: list[dict], sizes: list[Any], out: Path) -> list[str]:
    """``peers_memory_time.png`` (peak memory against step time, one panel per size) and
    ``peers_scaling.png`` (the sweep); returns the files written ([] without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    files = []
    panels = [s for s in sizes if any(r.get("kind") == "config" and r["size"] == s.name and _ok(r) for r in records)]
    if panels:
        cols = 2 if len(panels) > 1 else 1
        rows_n = (len(panels) + cols - 1) // cols
        fig, axes = plt.subplots(rows_n, cols, figsize=(7.5 * cols, 5.2 * rows_n), squeeze=False)
        for ax, spec in zip(axes.flat, panels):
            rows = [r for r in records if r.get("kind") == "config" and r["size"] == spec.name and _ok(r)]
            gpu = all(r.get("peak_allocated") is not None for r in rows)
            for family, (color, marker) in FAMILY_STYLE.items():
                pts = [r for r in rows if r["config"]["family"] == family]
                if not pts:
                    continue
                ys = [(r["peak_allocated"] if gpu else 0) / GIB for r in pts]
                ax.scatter([r["step_ms"] for r in pts], ys, c=color, marker=marker, s=46, label=family, zorder=3)
                for i, (r, y) in enumerate(zip(pts, ys)):  # alternate the offsets: fewer overlapping labels
                    ax.annotate(r["config"]["name"], (r["step_ms"], y), textcoords="offset points",
                                xytext=(5, 4 if i % 2 == 0 else -11), fontsize=7.5)
            base = next((r for r in rows if r["config"]["family"] == "none"), None)
            if base is not None:
                ax.axvline(base["step_ms"], color="black", lw=0.8, ls=":", zorder=1)
                if gpu:
                    ax.axhline(base["peak_allocated"] / GIB, color="black", lw=0.8, ls=":", zorder=1)
            ax.set_title(f"{spec.name}: {spec.describe()}", fontsize=9)
            ax.set_xlabel("step time, ms (median)")
            ax.set_ylabel("peak allocated, GiB" if gpu else "peak allocated (not measured on CPU)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7.5, loc="best")
        for ax in list(axes.flat)[len(panels):]:
            ax.axis("off")
        fig.suptitle("Peak memory vs step time, per configuration (lower left is better)", fontsize=11)
        fig.tight_layout()
        path = out / "peers_memory_time.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(str(path))
    points = [p for p in sweep_points(records) if "copy_ms" in p]
    if points:
        axes_names = [a for a in ("seq", "hidden") if any(p["axis"] == a for p in points)]
        fig, axes = plt.subplots(1, len(axes_names), figsize=(7 * len(axes_names), 4.8), squeeze=False)
        for ax, axis in zip(axes.flat, axes_names):
            pts = sorted((p for p in points if p["axis"] == axis), key=lambda p: p[axis])
            xs = [p[axis] for p in pts]
            ax.plot(xs, [p["layer_forward_ms"] for p in pts], "o-", color="black", label="layer forward (compute)")
            ax.plot(xs, [p["copy_ms"] for p in pts], "s--", color="tab:blue", label="predicted copy: bytes / bandwidth")
            ax.plot(xs, [max(p["extra_ms_per_layer"], 0.0) for p in pts], "^-", color="tab:red",
                    label="measured extra step time per layer")
            for p in pts:
                ax.annotate(f"{p['overhead_pct']:+.1f}%", (p[axis], max(p["extra_ms_per_layer"], 0.0)),
                            textcoords="offset points", xytext=(4, 6), fontsize=8, color="tab:red")
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels([str(x) for x in xs])
            other = "hidden" if axis == "seq" else "seq"
            ax.set_xlabel(f"{'sequence length' if axis == 'seq' else 'hidden size'} ({other} {pts[0][other]}, "
                          f"{pts[0]['layers']} layers)")
            ax.set_ylabel("ms per layer")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=8)
        fig.suptitle("Offloading qkv_linear+core_attn+attn_proj: copies hide while the blue line stays under "
                     "the black one", fontsize=10)
        fig.tight_layout()
        path = out / "peers_scaling.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(str(path))
    return files


def finish(records: list[dict], meta: dict, sizes: list[Any], out: Path) -> dict:
    """Evaluate, then write ``peers.json``, the plots and ``peers.md`` under ``out``."""
    link = link_gbps(records)
    evaluate(records, link[0])
    verdicts = targets(records, [s.name for s in sizes])
    for r in records:  # a row merged from an earlier run keeps its own command and date
        for key in ("device", "torch", "python", "command", "date"):
            r.setdefault(key, meta[key])
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers.json").write_text(json.dumps({"meta": {**meta, "link_gbps": link[0], "link_source": link[1]},
                                                "targets": verdicts, "records": records}, indent=1) + "\n")
    plots = plot(records, sizes, out)
    (out / "peers.md").write_text(markdown(records, meta, sizes, verdicts, link, plots) + "\n")
    failed = [r for r in records if r.get("status") == "error"]
    summary = ["Targets:", *summary_lines(verdicts)]
    if failed:
        summary.append(f"{len(failed)} job(s) failed: " + ", ".join(r.get("id", "?") for r in failed))
    return {"summary": "\n".join(summary), "files": [str(out / "peers.json"), str(out / "peers.md"), *plots],
            "targets": verdicts}
