"""Host time of the engine's hot paths: per saved tensor pack and unpack, per group open+close
at 128 to 2048 records per handler, and (on a CUDA machine) the MoE stack's training step.

    python benchmarks/host_time.py                          # -> docs/results/host_time.{json,md}
    python benchmarks/host_time.py --merge                  # keep other devices' records
    python benchmarks/host_time.py --quick --out /tmp/ht.json   # seconds: a functional check

It drives the engine only through ``offload.configure``, ``offload.get_manager()`` (``open_group``,
``close_group``, and the saved-tensor hook functions ``_pack`` / ``_unpack``),
``offload.begin_chunk``, ``offload.end_iteration`` and ``offload.reset`` (plus ``offload.attach``
for the MoE step), so it measures any engine that keeps those names. Every measurement starts
from a fresh engine (``offload.reset(release_pool=True)``, then ``configure``). Times come from
``time.perf_counter_ns``, after warm-up, and each figure is a median in microseconds.

* ``pack``: one iteration is one chunk forward of ``LAYERS`` groups of ``TENSORS_PER_GROUP``
  fresh tensors (distinct storages of 64 bytes, ``min_tensor_bytes=0``), each packed while its
  group is open, then that forward's backward. Each ``_pack`` call is timed on its own.
* ``unpack``: the same flow; the forward drops its own references, so the autograd handles are
  the tensors' only holders, as in training. Each close decides a group of the name: in the
  chunk's first forward the one before it, later (the previous forward says which layer is
  last) the closing one itself; its copies are issued at the next open (on the CPU fallback a
  host copy, Note [7] of offload.copy_queue), so at the forward's end every group but the last is
  offloaded and the last one pending; the first unpack begins the chunk's backward, which keeps
  the last group (the last-layer rule). The handles are then unpacked layer by layer from the
  last, each ``_unpack`` call timed on its own: the kept group's calls take the resident path,
  and the first call in each offloaded group reloads the whole group on demand (nothing
  prefetches here: that needs the region markers' backward), the other calls find it reloaded.
  The engine's statistics of every iteration are checked against this flow.
* ``group_open_close`` at ``records_per_handler`` R: a chunk forward first fills its handler with
  R records (groups named ``fill`` of 16 tensors each, untimed), then runs groups named ``timed``
  of 4 tensors each; only ``open_group`` + ``close_group`` of those are timed (their packs are
  not). A close decides a ``timed`` group (as above), an open issues its copies after waiting,
  past the in-flight bound, for the copy before it; only such steady-state groups are counted
  (not a round's first two, nor its last, which is the forward's end: it waits for every copy
  in flight). The timed groups of a round add at most R/8 records; then the iteration ends and
  a new round refills a fresh handler.
* ``moe_step_host`` / ``moe_step_gpu`` (CUDA only): training steps of the MoE stacks of
  ``benchmarks/peers.py`` (bf16) with no offloading and with ``offload:core_attn``: host time
  is ``perf_counter`` around forward+backward with no synchronization inside it (the model's
  router syncs once per layer for its expert counts, as Megatron's does), GPU time is CUDA
  events around the same span; the GPU is idle before each step, ``end_iteration`` runs after.

Results: ``{"records": [...]}`` with ``what``, ``records_per_handler`` (null where not
applicable), ``microseconds``, ``device``, ``command`` (a MoE record's ``what`` names its size and configuration, e.g.
``moe_step_gpu (moe-l, offload:core_attn)``), and
a Markdown table next to it (same name, ``.md``) with the targets. ``--merge`` keeps the records
of other devices already in the JSON. Exits non-zero on any failure (targets missed are not
failures: they are reported).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import shlex
import statistics
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a clone, no install

import torch  # noqa: E402

import offload  # noqa: E402

TENSOR_NUMEL = 16  # float32: 64 bytes per saved tensor (min_tensor_bytes=0)
LAYERS = 8  # groups per chunk forward in the pack/unpack flow
TENSORS_PER_GROUP = 16  # saved tensors per group in the pack/unpack flow and the handler fill
OPEN_CLOSE_TENSORS = 4  # saved tensors of each timed group of group_open_close
RECORDS_PER_HANDLER = (128, 256, 512, 1024, 2048)
QUICK_RECORDS_PER_HANDLER = (128, 256)
MOE_CONFIGS = ("none", "offload:core_attn")
FIELDS = ("what", "records_per_handler", "microseconds", "device", "command")
TARGETS_US = {"pack": 3.0, "unpack": 3.0, "group_open_close": 30.0}
FLAT_RATIO = 1.25  # "flat": the largest open+close median is at most this times the smallest
DEFAULT_OUT = "docs/results/host_time.json"

now = time.perf_counter_ns


# ----------------------------------------------------------------------------- helpers
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_label(engine_device: str) -> str:
    """The ``device`` of the pack/unpack/open+close records (the MoE records carry the GPU's name)."""
    if engine_device == "cuda":
        return f"{torch.cuda.get_device_name()} (engine on CUDA), {cpu_model()}"
    return f"cpu (CPU fallback), {cpu_model()}"


def fresh_engine(modules: list[str], device: str, **kw: Any) -> Any:
    """Forget the previous engine and its pool, and install a new one; returns its manager."""
    offload.reset(release_pool=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the CPU fallback says it saves no memory
        offload.configure(modules, device=device, **kw)
    return offload.get_manager()


def us(ns: list[int]) -> float:
    return statistics.median(ns) / 1e3


def timer_overhead_us() -> float:
    """Median of two back-to-back ``perf_counter_ns`` calls: included in every per-call figure."""
    samples = []
    for _ in range(20000):
        t0 = now()
        t1 = now()
        samples.append(t1 - t0)
    return us(samples)


class FlowError(RuntimeError):
    """The engine did not do what the measured flow assumes (the figures would be wrong)."""


def _check(stats: Any, name: str, **expected: int) -> None:
    got = stats.by_name.get(name)
    if got is None:
        raise FlowError(f"no statistics for group {name!r} (by_name: {sorted(stats.by_name)})")
    wrong = {k: (getattr(got, k), v) for k, v in expected.items() if getattr(got, k) != v}
    if wrong:
        raise FlowError(f"group {name!r}: (got, expected) {wrong}; the measured flow is not the assumed one")


# ----------------------------------------------------------------------------- (a), (b)
def _pack_fresh(m: Any, device: str, k: int, samples: list[int] | None, numel: int = TENSOR_NUMEL) -> list[Any]:
    """Pack ``k`` fresh tensors into the innermost open group; time each ``_pack`` call into
    ``samples`` (if given). The tensors' only holders afterwards are the engine's records, as for
    activations that autograd saved."""
    pack = m._pack
    tensors = [torch.empty(numel, device=device) for _ in range(k)]
    handles = []
    if samples is None:
        for t in tensors:
            handles.append(pack(t))
    else:
        for t in tensors:
            t0 = now()
            h = pack(t)
            t1 = now()
            handles.append(h)
            samples.append(t1 - t0)
    return handles


def _forward_backward(m: Any, device: str, pack_ns: list[int] | None, unpack_ns: list[int] | None,
                      first_unpack_ns: list[int] | None) -> None:
    """One iteration of the pack/unpack flow (see the module docstring), checked against the
    engine's statistics."""
    offload.begin_chunk(0)
    layers: list[list[Any]] = []
    for _ in range(LAYERS):
        group = m.open_group("bench")
        if group is None:
            raise FlowError("open_group('bench') returned None: the group does not offload")
        layers.append(_pack_fresh(m, device, TENSORS_PER_GROUP, pack_ns))
        m.close_group(group, "bench")
    unpack = m._unpack
    outs = []
    for layer, handles in enumerate(reversed(layers)):
        for i, h in enumerate(handles):
            t0 = now()
            out = unpack(h)
            t1 = now()
            outs.append(out)
            if unpack_ns is not None:
                unpack_ns.append(t1 - t0)
                if first_unpack_ns is not None and i == 0 and layer > 0:
                    first_unpack_ns.append(t1 - t0)
    stats = offload.end_iteration()
    del outs, layers
    _check(stats, "bench", groups=LAYERS, groups_offloaded=LAYERS - 1, groups_kept=1,
           tensors_offloaded=(LAYERS - 1) * TENSORS_PER_GROUP, reloads_on_demand=LAYERS - 1,
           bytes_held_elsewhere=0)


def measure_pack_unpack(args: argparse.Namespace) -> dict[str, Any]:
    """``pack`` and ``unpack`` medians (microseconds per call), each from a fresh engine, plus
    figures for the notes."""
    out: dict[str, Any] = {}
    for what in ("pack", "unpack"):
        m = fresh_engine(["bench"], args.engine_device, min_tensor_bytes=0)
        samples: list[int] = []
        first: list[int] = []
        for i in range(args.warmup + args.iterations):
            keep = i >= args.warmup
            _forward_backward(
                m, args.engine_device,
                samples if keep and what == "pack" else None,
                samples if keep and what == "unpack" else None,
                first if keep else None,
            )
            gc.collect()  # untimed: groups and records reference each other
        out[what] = us(samples)
        out[f"{what}_mean"] = statistics.fmean(samples) / 1e3
        out[f"{what}_calls"] = len(samples)
        if what == "unpack":
            out["unpack_first_of_offloaded_group"] = us(first)
    offload.reset(release_pool=True)
    return out


# ----------------------------------------------------------------------------- (c)
def measure_open_close(args: argparse.Namespace, records: int) -> tuple[float, dict[str, Any]]:
    """Median open+close time (microseconds) of a group of ``OPEN_CLOSE_TENSORS`` tensors in a
    handler holding ``records`` records."""
    if records % TENSORS_PER_GROUP:
        raise ValueError(f"records per handler must be a multiple of {TENSORS_PER_GROUP}, got {records}")
    m = fresh_engine(["fill", "timed"], args.engine_device, min_tensor_bytes=0)
    fill_groups = records // TENSORS_PER_GROUP
    per_round = max(8, records // (8 * OPEN_CLOSE_TENSORS))  # adds at most records/8 (but 8 at 128)
    open_ns: list[int] = []
    close_ns: list[int] = []
    samples: list[int] = []
    rounds = 0
    while len(samples) < args.samples:
        warm = rounds < args.warmup_rounds
        offload.begin_chunk(0)
        handles: list[Any] = []
        for _ in range(fill_groups):
            group = m.open_group("fill")
            if group is None:
                raise FlowError("open_group('fill') returned None: the group does not offload")
            handles += _pack_fresh(m, args.engine_device, TENSORS_PER_GROUP, None)
            m.close_group(group, "fill")
        for i in range(per_round):
            t0 = now()
            group = m.open_group("timed")
            t1 = now()
            handles += _pack_fresh(m, args.engine_device, OPEN_CLOSE_TENSORS, None)
            t2 = now()
            m.close_group(group, "timed")
            t3 = now()
            if group is None:
                raise FlowError("open_group('timed') returned None: the group does not offload")
            # Steady state only: the first timed close offloads no previous group, the second
            # has nothing over the in-flight bound yet, and the last is the forward's end (it
            # waits for every copy in flight, learned from the previous round).
            if 1 < i < per_round - 1 and not warm:
                open_ns.append(t1 - t0)
                close_ns.append(t3 - t2)
                samples.append(t1 - t0 + t3 - t2)
        stats = offload.end_iteration()
        del handles
        gc.collect()  # untimed
        _check(stats, "fill", groups=fill_groups, groups_offloaded=fill_groups, bytes_held_elsewhere=0)
        _check(stats, "timed", groups=per_round, groups_offloaded=per_round, bytes_held_elsewhere=0)
        rounds += 1
    offload.reset(release_pool=True)
    return us(samples), {"open": us(open_ns), "close": us(close_ns), "samples": len(samples),
                         "rounds": rounds - args.warmup_rounds, "timed_groups_per_round": per_round}


# ----------------------------------------------------------------------------- (d)
def measure_moe(args: argparse.Namespace, command: str) -> list[dict[str, Any]]:
    """Host and GPU time per training step of the MoE stacks, without and with offloading."""
    from benchmarks.models import MOE_MAPPING, build
    from benchmarks.peers import DTYPES, GPU_SIZES

    specs = {s.name: s for s in GPU_SIZES}
    records = []
    device = torch.cuda.get_device_name()
    for size in args.moe_sizes:
        spec = specs[size]
        for cfg in MOE_CONFIGS:
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            model = build(spec, DTYPES["bf16"], "cuda")
            for p in model.parameters():  # persistent gradient buffers, zeroed in place each step
                p.grad = torch.zeros_like(p)
            offloading = cfg != "none"
            fresh_engine(["core_attn"] if offloading else [], "cuda")
            handle = offload.attach(model, {"core_attn": MOE_MAPPING["core_attn"]}) if offloading else None
            gen = torch.Generator(device="cuda").manual_seed(0)
            x = torch.randn(spec.seq, spec.batch, spec.hidden, generator=gen, device="cuda", dtype=DTYPES["bf16"])
            grad = torch.randn(x.shape, generator=gen, device="cuda", dtype=x.dtype)

            def step() -> None:
                model.zero_grad(set_to_none=False)
                model(x.detach().requires_grad_(True)).backward(grad)

            host: list[float] = []
            gpu: list[float] = []
            for i in range(args.moe_warmup + args.moe_steps):
                torch.cuda.synchronize()  # each step starts on an idle GPU
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                t0 = time.perf_counter()
                step()
                t1 = time.perf_counter()
                end.record()
                end.synchronize()
                offload.end_iteration()
                if i >= args.moe_warmup:
                    host.append((t1 - t0) * 1e6)
                    gpu.append(start.elapsed_time(end) * 1e3)
            if handle is not None:
                handle.remove()
            offload.reset(release_pool=True)
            del model, x, grad
            config = f"{spec.name}, {cfg}"
            for what, values in (("moe_step_host", host), ("moe_step_gpu", gpu)):
                records.append({"what": f"{what} ({config})", "records_per_handler": None,
                                "microseconds": statistics.median(values), "device": device,
                                "command": command})
            print(f"  {config}: host {statistics.median(host) / 1e3:.2f} ms, GPU {statistics.median(gpu) / 1e3:.2f} ms "
                  f"per step (median of {len(host)})", flush=True)
    return records


# ----------------------------------------------------------------------------- output
def validate(records: list[dict[str, Any]]) -> None:
    for r in records:
        extra = set(r) - set(FIELDS)
        missing = set(FIELDS) - set(r)
        if extra or missing:
            raise ValueError(f"record {r}: fields missing {sorted(missing)}, unexpected {sorted(extra)}")
        v = r["microseconds"]
        if not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ValueError(f"record {r}: microseconds must be a positive number")


def flat_ratio(rows: list[dict[str, Any]]) -> float | None:
    vals = [r["microseconds"] for r in rows]
    return max(vals) / min(vals) if len(vals) > 1 else None


def markdown(records: list[dict[str, Any]], notes: dict[str, list[str]]) -> str:
    lines = ["# Host time of the engine's hot paths", "",
             "Written by `benchmarks/host_time.py` (how it measures: its docstring and benchmarks/README.md). "
             "Medians in microseconds: per `_pack` / `_unpack` call, per `open_group` + `close_group` "
             "of a 4-tensor group in a handler of `records_per_handler` records, per MoE training step.",
             "",
             f"Targets (checked here, not asserted in tests): pack ≤ {TARGETS_US['pack']:g} µs and unpack ≤ "
             f"{TARGETS_US['unpack']:g} µs per saved tensor; group open+close ≤ {TARGETS_US['group_open_close']:g} µs "
             f"and flat from 128 to 2048 records per handler (flat here: largest ≤ {FLAT_RATIO} × smallest), "
             "on the CPU fallback, same machine, one run."]
    devices = list(dict.fromkeys(r["device"] for r in records))
    for device in devices:
        rows = [r for r in records if r["device"] == device]
        commands = list(dict.fromkeys(r["command"] for r in rows))
        oc = [r for r in rows if r["what"] == "group_open_close"]
        ratio = flat_ratio(oc)
        flat_ok = ratio is not None and ratio <= FLAT_RATIO
        lines += ["", f"## {device}", "", "Command: " + ", ".join(f"`{c}`" for c in commands), "",
                  "| what | records per handler | µs | target | met |",
                  "|---|---:|---:|---|---|"]
        for r in rows:
            what, v = r["what"], r["microseconds"]
            target, met = "", ""
            if what in ("pack", "unpack"):
                target = f"≤ {TARGETS_US[what]:g}"
                met = "yes" if v <= TARGETS_US[what] else "no"
            elif what == "group_open_close":
                target = f"≤ {TARGETS_US[what]:g}, flat"
                met = ("yes" if v <= TARGETS_US[what] else "no") + (", flat" if flat_ok else ", not flat")
            rph = "" if r["records_per_handler"] is None else str(r["records_per_handler"])
            shown = f"{v:.2f}" if v < 1000 else f"{v:,.0f}"
            lines.append(f"| {what} | {rph} | {shown} | {target} | {met} |")
        if ratio is not None:
            lo = min(oc, key=lambda r: r["records_per_handler"])
            hi = max(oc, key=lambda r: r["records_per_handler"])
            lines += ["", f"Open+close from {lo['records_per_handler']} to {hi['records_per_handler']} records per "
                          f"handler: {lo['microseconds']:.2f} → {hi['microseconds']:.2f} µs; largest/smallest = "
                          f"{ratio:.2f} ({'flat' if flat_ok else 'not flat'})."]
        if notes.get(device):
            lines += ["", "Notes from this run:", ""] + [f"* {n}" for n in notes[device]]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- main
def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT, help="the JSON file; the Markdown goes next to it (.md)")
    p.add_argument("--merge", action="store_true",
                   help="keep the records of other devices already in --out (replace only this run's devices)")
    p.add_argument("--quick", action="store_true",
                   help="a functional check in seconds: few repetitions, records per handler 128 and 256")
    p.add_argument("--records-per-handler", type=int, nargs="+", default=None)
    p.add_argument("--iterations", type=int, default=None, help="timed pack/unpack iterations (default 60)")
    p.add_argument("--warmup", type=int, default=None, help="untimed pack/unpack iterations first (default 3)")
    p.add_argument("--samples", type=int, default=None, help="timed open+close per records_per_handler (default 600)")
    p.add_argument("--warmup-rounds", type=int, default=None, help="untimed open+close rounds first (default 1)")
    p.add_argument("--engine-device", choices=["cpu", "cuda"], default="cpu",
                   help="the engine's device for pack/unpack/open+close (default: the CPU fallback)")
    p.add_argument("--no-moe", action="store_true", help="skip the MoE step (run only where CUDA is present)")
    p.add_argument("--moe-sizes", nargs="+", default=None, choices=["moe-s", "moe-l"],
                   help="MoE sizes of benchmarks/peers.py (default: both; --quick: moe-s)")
    p.add_argument("--moe-steps", type=int, default=None, help="timed MoE steps per config (default 10)")
    p.add_argument("--moe-warmup", type=int, default=None, help="untimed MoE steps first (default 3)")
    args = p.parse_args(argv)
    q = args.quick
    defaults = {"records_per_handler": list(QUICK_RECORDS_PER_HANDLER if q else RECORDS_PER_HANDLER),
                "iterations": 2 if q else 60, "warmup": 1 if q else 3, "samples": 20 if q else 600,
                "warmup_rounds": 1, "moe_sizes": ["moe-s"] if q else ["moe-s", "moe-l"],
                "moe_steps": 2 if q else 10, "moe_warmup": 1 if q else 3}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    command = shlex.join(["python", "benchmarks/host_time.py", *argv])
    out = Path(args.out)
    md_path = out.with_suffix(".md")
    try:
        earlier: list[dict[str, Any]] = []
        if args.merge and out.exists():
            earlier = json.loads(out.read_text())["records"]
            validate(earlier)
        if args.engine_device == "cuda" and not torch.cuda.is_available():
            raise RuntimeError("--engine-device cuda: CUDA is not available")
        device = device_label(args.engine_device)
        records: list[dict[str, Any]] = []

        def add(what: str, rph: int | None, value: float) -> None:
            records.append({"what": what, "records_per_handler": rph, "microseconds": value,
                            "device": device, "command": command})

        gc_was = gc.isenabled()
        gc.disable()  # collections only between iterations (untimed), never inside a timed call
        try:
            overhead = timer_overhead_us()
            print(f"{device}; perf_counter_ns overhead {overhead:.3f} µs (included in each per-call figure)", flush=True)
            pu = measure_pack_unpack(args)
            add("pack", None, pu["pack"])
            add("unpack", None, pu["unpack"])
            print(f"  pack   {pu['pack']:.3f} µs per call (median of {pu['pack_calls']}; mean {pu['pack_mean']:.3f})")
            print(f"  unpack {pu['unpack']:.3f} µs per call (median of {pu['unpack_calls']}; mean "
                  f"{pu['unpack_mean']:.3f}; first unpack of an offloaded group, which reloads it: "
                  f"{pu['unpack_first_of_offloaded_group']:.3f})", flush=True)
            oc_detail = {}
            for rph in args.records_per_handler:
                value, detail = measure_open_close(args, rph)
                oc_detail[rph] = detail
                add("group_open_close", rph, value)
                print(f"  open+close at {rph:5d} records per handler: {value:.3f} µs (open {detail['open']:.3f}, "
                      f"close {detail['close']:.3f}; median of {detail['samples']})", flush=True)
        finally:
            if gc_was:
                gc.enable()
        notes = [
            f"perf_counter_ns overhead, included in each per-call figure: {overhead:.3f} µs.",
            f"pack: mean {pu['pack_mean']:.3f} µs over {pu['pack_calls']} calls.",
            f"unpack: mean {pu['unpack_mean']:.3f} µs over {pu['unpack_calls']} calls; the first unpack of each "
            f"offloaded group, which reloads its {TENSORS_PER_GROUP} records on demand: median "
            f"{pu['unpack_first_of_offloaded_group']:.3f} µs.",
            "open+close split (median open / median close, µs): " + "; ".join(
                f"{r}: {d['open']:.2f} / {d['close']:.2f}" for r, d in oc_detail.items()),
        ]
        all_notes = {device: notes}
        if args.no_moe:
            print("MoE step: skipped (--no-moe)")
        elif not torch.cuda.is_available():
            print("MoE step: skipped (no CUDA device; it runs on a GPU machine only)")
        else:
            print("MoE step:", flush=True)
            moe = measure_moe(args, command)
            records += moe
            all_notes.setdefault(moe[0]["device"], []).append(
                "MoE step host time includes the router's host sync (one per layer, for the expert counts); "
                "`end_iteration` runs after the timed span.")
        validate(records)
        mine = {r["device"] for r in records}
        merged = [r for r in earlier if r["device"] not in mine] + records
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"records": merged}, indent=1) + "\n")
        md_path.write_text(markdown(merged, all_notes))
        print(f"wrote {out} and {md_path}")
        return 0
    except Exception:
        traceback.print_exc()
        print("host_time: FAILED (nothing written)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
