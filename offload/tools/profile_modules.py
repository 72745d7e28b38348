"""Per named module: forward and backward time, and the bytes it saves for backward.

    python -m offload.tools.profile_modules --hidden 4096 --heads 32 --layers 8 --seq 4096 \\
        --out profile.json

Runs the workload without offloading and records, in three passes after a warm-up:

* the step: median time over ``--steps`` steps (GPU synchronized before each), the memory
  peak (``max_memory_allocated``, parameter gradients already allocated), the memory
  allocated before the step and (in the saved-tensor pass) when the model's forward returned;
* time: forward and backward of every instance of every named module, and of the whole
  model, with CUDA events at the module boundaries (`boundaries.Boundaries`);
* saved tensors: every tensor autograd saves, by storage: its bytes (as the engine would
  record it: a view of at least half its storage counts the whole storage), whether the
  engine could offload it (`offload.policy.TensorPolicy`), which module instances saved it,
  in order, and in which instance it was created (a module's own output or internal tensor).

The advisor (`offload.tools.advise`) reads the JSON this writes. Times come from
``perf_counter`` on CPU, where they mean little; the structure is the same.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from typing import Any

import torch

from ..config import DEFAULT_MIN_TENSOR_BYTES
from ..policy import TensorPolicy
from .boundaries import Boundaries
from .report import gib, md_table, mib, publish
from .workload import Workload, add_workload_args, build_workload, describe_device, spec_from_args

OTHER = "(other)"


def label(name: str, instance: int) -> str:
    """``fc1:3``: instance 3 of the name ``fc1``."""
    return f"{name}:{instance}"


def split_label(text: str) -> tuple[str, int]:
    """Inverse of `label`."""
    name, _, i = text.rpartition(":")
    if not name or not i.isdigit():
        raise ValueError(f"not a module instance label: {text!r}")
    return name, int(i)


def engine_bytes(t: torch.Tensor) -> int:
    """The bytes the engine would copy for ``t``: its whole storage when ``t`` covers at least
    half of it, else its span (docs/design.md, *Views*)."""
    span = (1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))) * t.element_size()
    whole = t.untyped_storage().nbytes()
    return whole if 2 * span >= whole else span


def saver_name(saver: str) -> str:
    """The name of a saver label (`OTHER` for saves outside every named module)."""
    return OTHER if saver == OTHER else split_label(saver)[0]


class _Timer:
    """Timestamps at the boundaries: CUDA events on the current stream, or ``perf_counter``."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda
        self.marks: dict[tuple[str, int, str, str], Any] = {}

    def __call__(self, name: str, i: int, phase: str, edge: str) -> None:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            self.marks[(name, i, phase, edge)] = ev
        else:
            self.marks[(name, i, phase, edge)] = time.perf_counter()

    def spans(self) -> dict[tuple[str, int, str], float]:
        """Milliseconds between the begin and the end of each (name, instance, phase)."""
        if self.cuda:
            torch.cuda.synchronize()
        out = {}
        for (name, i, phase, edge), start in self.marks.items():
            end = self.marks.get((name, i, phase, "end"))
            if edge != "begin" or end is None:
                continue
            out[(name, i, phase)] = start.elapsed_time(end) if self.cuda else (end - start) * 1e3
        return out


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def measure_step(work: Workload, steps: int) -> dict[str, Any]:
    """Median step time, the memory peak and the memory allocated before a step."""
    cuda = work.device.type == "cuda"
    _sync(cuda)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated() if cuda else None
    times = []
    for _ in range(steps):
        _sync(cuda)
        t = _Timer(cuda)
        t("step", 0, "all", "begin")
        work.step()
        t("step", 0, "all", "end")
        times.append(t.spans()[("step", 0, "all")])
    return {"step_ms": statistics.median(times), "step_ms_min": min(times),
            "peak_allocated": torch.cuda.max_memory_allocated() if cuda else None, "base_allocated": base}


def measure_times(work: Workload, steps: int) -> tuple[dict[str, dict[str, list]], dict[str, float], list]:
    """Per name: forward and backward ms of each instance (median over ``steps``); the whole
    model's forward and backward ms; the order in which instances closed in forward. Without a
    backward end marker (no input requires grad) the backward is the rest of each timed step:
    taken from the same step as its forward, it cannot come out negative, as a difference with
    `measure_step`'s separately timed steps could on a busy host."""
    cuda = work.device.type == "cuda"
    samples: dict[tuple[str, int, str], list[float]] = {}
    close_order: list = []
    for _ in range(steps):
        timer = _Timer(cuda)
        b = Boundaries(work.model, work.mapping, timer)
        try:
            _sync(cuda)
            timer("", 0, "step", "begin")
            work.step()
            timer("", 0, "step", "end")
            close_order = [list(x) for x in b.close_order if x[0]]
        finally:
            b.remove()
        spans = timer.spans()
        if ("", 0, "bwd") not in spans and ("", 0, "fwd") in spans:
            spans[("", 0, "bwd")] = spans[("", 0, "step")] - spans[("", 0, "fwd")]
        del spans[("", 0, "step")]
        for key, ms in spans.items():
            samples.setdefault(key, []).append(ms)
    per: dict[str, dict[str, list]] = {}
    for (name, i, phase), v in sorted(samples.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        if not name:
            continue
        entry = per.setdefault(name, {"fwd_ms": [], "bwd_ms": []})
        lst = entry[f"{phase}_ms"]
        while len(lst) <= i:
            lst.append(None)
        lst[i] = statistics.median(v)
    whole = {phase: statistics.median(samples[("", 0, phase)]) for phase in ("fwd", "bwd")
             if ("", 0, phase) in samples}
    for entry in per.values():  # instances without a backward end stay None
        n = max(len(entry["fwd_ms"]), len(entry["bwd_ms"]))
        for k in ("fwd_ms", "bwd_ms"):
            entry[k] += [None] * (n - len(entry[k]))
    return per, whole, close_order


def record_saved(work: Workload, min_tensor_bytes: int) -> tuple[list[dict[str, Any]], int | None]:
    """Every storage autograd saves in one step: bytes, engine eligibility, savers, creator; and
    the memory allocated when the model's forward returned (CUDA; ``None`` on CPU)."""
    policy = TensorPolicy(lambda t: t.device.type == work.device.type, min_tensor_bytes)
    policy.block_parameters(work.model.parameters())
    stack: list[str] = []
    inputs: dict[str, set[int]] = {}
    created: dict[int, str] = {}
    storages: dict[int, dict[str, Any]] = {}
    keep_alive: list[torch.Tensor] = []  # no address is reused within the step

    forward_end: list[int] = []

    def on_boundary(name: str, i: int, phase: str, edge: str) -> None:
        if not name and phase == "fwd" and edge == "end" and work.device.type == "cuda":
            forward_end.append(torch.cuda.memory_allocated(work.device))
        if name and phase == "fwd":
            if edge == "begin":
                stack.append(label(name, i))
            else:
                stack.pop()

    def on_tensors(name: str, i: int, kind: str, tensors: list) -> None:
        if not name:
            return
        here = label(name, i)
        keys = {t.untyped_storage().data_ptr() for t in tensors}
        if kind == "inputs":
            inputs[here] = keys
        else:
            keep_alive.extend(tensors)
            for k in keys - inputs.get(here, set()):
                created.setdefault(k, here)

    params = {p.untyped_storage().data_ptr() for p in work.model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if type(t) is torch.Tensor and t.layout is torch.strided and t.numel():
            st = t.untyped_storage()
            key = st.data_ptr()
            if key in params:  # weights (and weight.t()) are not activation memory
                return t
            here = stack[-1] if stack else OTHER
            nbytes = engine_bytes(t)
            if key not in created and here != OTHER and key not in inputs.get(here, set()):
                created[key] = here
            rec = storages.setdefault(key, {"bytes": 0, "eligible": False, "savers": [],
                                            "shape": list(t.shape), "dtype": str(t.dtype).replace("torch.", "")})
            rec["bytes"] = max(rec["bytes"], nbytes)
            rec["eligible"] = rec["eligible"] or policy.admits(t)
            if here not in rec["savers"]:
                rec["savers"].append(here)
            keep_alive.append(t)
        return t

    b = Boundaries(work.model, work.mapping, on_boundary, on_tensors)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            work.step()
    finally:
        b.remove()
    keep_alive.clear()
    out = []
    for key, rec in storages.items():
        rec["created_in"] = created.get(key)
        out.append(rec)
    return out, (forward_end[-1] if forward_end else None)


def profile(work: Workload, spec: dict[str, Any], steps: int, warmup: int, time_steps: int,
            min_tensor_bytes: int) -> dict[str, Any]:
    """All three passes; the JSON-ready result."""
    for _ in range(warmup):
        work.step()
    step = measure_step(work, steps)
    modules, whole, close_order = measure_times(work, time_steps)
    saved, forward_end = record_saved(work, min_tensor_bytes)
    names = [n for n in dict.fromkeys(n for n, _ in close_order)]
    return {
        "tool": "profile_modules", "workload": spec, "description": work.description,
        "device": describe_device(work.device), "torch": torch.__version__,
        "min_tensor_bytes": min_tensor_bytes, "steps": steps, "warmup": warmup, "time_steps": time_steps,
        **step, "forward_end_allocated": forward_end, "forward_ms": whole.get("fwd"),
        "backward_ms": whole.get("bwd"),
        "names": names, "close_order": close_order, "modules": modules, "storages": saved,
    }


def table(prof: dict[str, Any]) -> str:
    """Per name: instances, forward and backward ms (all instances), bytes saved and of them
    eligible for offloading, and bytes saved that another module saves too."""
    rows = []
    for name in prof["names"]:
        m = prof["modules"].get(name, {"fwd_ms": [], "bwd_ms": []})
        saved = [s for s in prof["storages"] if any(saver_name(x) == name for x in s["savers"])]
        shared = [s for s in saved if any(saver_name(x) != name for x in s["savers"])]
        fwd = sum(v for v in m["fwd_ms"] if v is not None)
        bwd = sum(v for v in m["bwd_ms"] if v is not None)
        rows.append([name, len(m["fwd_ms"]), f"{fwd:.2f}", f"{bwd:.2f}",
                     mib(sum(s["bytes"] for s in saved)),
                     mib(sum(s["bytes"] for s in saved if s["eligible"])),
                     mib(sum(s["bytes"] for s in shared))])
    return md_table(["name", "instances", "fwd ms", "bwd ms", "saved MiB", "eligible MiB", "shared MiB"], rows)


def summary(prof: dict[str, Any]) -> str:
    """The header lines and the table."""
    fwd, bwd = prof["forward_ms"], prof["backward_ms"]
    lines = [f"{prof['description']} on {prof['device']} (torch {prof['torch']})", "",
             f"step {prof['step_ms']:.2f} ms (median of {prof['steps']}), forward {fwd:.2f} ms, backward "
             f"{bwd:.2f} ms; peak allocated {gib(prof['peak_allocated'])} GiB, before the step "
             f"{gib(prof['base_allocated'])} GiB", "", table(prof)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_workload_args(p)
    p.add_argument("--steps", type=int, default=10, help="timed steps (median)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--time-steps", type=int, default=3, help="steps with per-module events (median)")
    p.add_argument("--min-tensor-bytes", type=int, default=None,
                   help=f"the engine's threshold (default {DEFAULT_MIN_TENSOR_BYTES} on cuda, 0 on cpu)")
    p.add_argument("--out", default="profile.json")
    args = p.parse_args(argv)
    if args.steps < 1 or args.time_steps < 1 or args.warmup < 0:
        p.error("--steps and --time-steps must be >= 1, --warmup >= 0")
    spec = spec_from_args(args)
    if spec["device"].startswith("cuda") and not torch.cuda.is_available():
        p.error("CUDA is not available (use --device cpu)")
    mtb = args.min_tensor_bytes
    if mtb is None:
        mtb = DEFAULT_MIN_TENSOR_BYTES if spec["device"].startswith("cuda") else 0
    work = build_workload(spec)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        prof = profile(work, spec, args.steps, args.warmup, args.time_steps, mtb)
    prof["command"] = "python -m offload.tools.profile_modules " + " ".join(argv if argv is not None else sys.argv[1:])
    publish(args.out, prof, summary(prof))
    return 0


if __name__ == "__main__":
    sys.exit(main())
