"""`offload` against what users would pick instead, on the same models and inputs, in one run.

    python benchmarks/peers.py --out /tmp/peers                 # GPU: every model, size, config, sweep
    python benchmarks/peers.py --smoke --out /tmp/peers         # CPU: tiny sizes, 2 steps, seconds

Models: a GPT layer stack and a MoE layer stack (`benchmarks/models.py`), each at two sizes.
Configurations on each: no offloading; full and selective recompute; `offload` with several
module sets; `offload` + recompute; ``torch.autograd.graph.save_on_cpu``; torchtune's
``OffloadActivations`` (their code, loaded from the installed wheel); Transformer Engine's
and Megatron's offloading (recorded as not run, with the reason, where TE is missing). Then a
scaling sweep over sequence length and hidden size. Every configuration runs in a process of
its own (forked from a fork server that never starts CUDA, or a fresh interpreter with
``--isolation subprocess``), so memory figures never leak between them.

Results: ``<out>/peers.json`` (one record per configuration), ``<out>/peers.md`` (tables and
the targets), ``<out>/peers_memory_time.png`` and ``<out>/peers_scaling.png``, per-process
logs under ``<out>/logs/`` and kept profiler traces under ``<out>/traces/``.
benchmarks/README.md explains every figure.
"""

from __future__ import annotations

import os

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() must not start CUDA before a fork

import argparse  # noqa: E402
import base64  # noqa: E402
import gzip  # noqa: E402
import hashlib  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import multiprocessing  # noqa: E402
import re  # noqa: E402
import shlex  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
import types  # noqa: E402
import warnings  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # run from a clone, no install

import torch  # noqa: E402
import torch.profiler  # noqa: E402,F401 - imported once here, not in every forked worker
import torch.utils.checkpoint  # noqa: E402,F401 - likewise
from torch import nn  # noqa: E402

import offload  # noqa: E402
from benchmarks.models import ModelSpec, build  # noqa: E402
from offload.config import DEFAULT_MIN_TENSOR_BYTES  # noqa: E402
from offload.stats import GroupStats, IterationStats  # noqa: E402
from offload.testing import Clock, recompute, saved_bytes_by_name  # noqa: E402
from offload.tools.intervals import Cover, length  # noqa: E402
from offload.tools.trace_events import load_torch_trace  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
EXTRA_MAPPING = {"mlp": "layers.*.mlp"}  # a group around the whole (recomputed) MLP or MoE block
TIMING_PASSES = 3  # forward passes timed in the baseline process (layer forward time)
TRACE_LIMIT_BYTES = 4 << 20  # a kept trace (gzipped) larger than this is dropped


# ----------------------------------------------------------------------------- configurations
@dataclass(frozen=True)
class Config:
    """One way to run a model: what is offloaded (and by whom) and what is recomputed."""

    name: str
    family: str  # none | recompute | offload | offload+recompute | peer
    label: str
    offload: tuple[str, ...] = ()  # offload group names
    recompute: tuple[str, ...] = ()  # module patterns run under torch.utils.checkpoint
    peer: str = ""  # save_on_cpu | torchtune | te | megatron


def configs_for(spec: ModelSpec) -> list[Config]:
    """Every configuration of the benchmark on ``spec``'s model family, baseline first."""
    if spec.experts:
        sets = [("core_attn", ("core_attn",)), ("expert_fc1", ("expert_fc1",)),
                ("experts", ("expert_fc1", "moe_act", "expert_fc2"))]
        block = "MoE block"
    else:
        sets = [("core_attn", ("core_attn",)), ("attn", ("qkv_linear", "core_attn", "attn_proj")),
                ("all", tuple(spec.mapping))]
        block = "MLP"
    out = [
        Config("none", "none", "no offloading"),
        Config("recompute:full", "recompute", "full recompute (every layer)", recompute=("layers.*",)),
        Config("recompute:mlp", "recompute", f"selective recompute ({block})", recompute=("layers.*.mlp",)),
    ]
    out += [Config(f"offload:{name}", "offload", f"offload {'+'.join(names)}", offload=names) for name, names in sets]
    out += [
        Config("offload+recompute:light", "offload+recompute",
               "offload all, recompute norms+activation (memory-free layer)",
               offload=tuple(spec.mapping), recompute=spec.light_modules),
        Config("offload+recompute:mlp", "offload+recompute", f"offload the rest, recompute {block}",
               offload=("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "mlp"),
               recompute=("layers.*.mlp",)),
        Config("save_on_cpu", "peer", "torch.autograd.graph.save_on_cpu(pin_memory=True)", peer="save_on_cpu"),
        Config("torchtune", "peer", "torchtune OffloadActivations (defaults)", peer="torchtune"),
        Config("te", "peer", "Transformer Engine get_cpu_offload_context", peer="te"),
        Config("megatron", "peer", "Megatron fine-grained activation offloading", peer="megatron"),
    ]
    return out


GPU_SIZES = [
    ModelSpec("gpt-s", hidden=2048, heads=16, layers=8, seq=8192),
    ModelSpec("gpt-l", hidden=4096, heads=32, layers=8, seq=8192),
    ModelSpec("moe-s", hidden=2048, heads=16, layers=8, seq=4096, ffn=4096, experts=8, top_k=2),
    ModelSpec("moe-l", hidden=4096, heads=32, layers=8, seq=4096, ffn=4096, experts=8, top_k=2),
]
SMOKE_SIZES = [
    ModelSpec("gpt-s", hidden=32, heads=2, layers=3, seq=32),
    ModelSpec("gpt-l", hidden=64, heads=4, layers=3, seq=32),
    ModelSpec("moe-s", hidden=32, heads=2, layers=3, seq=32, ffn=32, experts=4, top_k=2),
    ModelSpec("moe-l", hidden=64, heads=4, layers=3, seq=32, ffn=64, experts=4, top_k=2),
]
SWEEP_OFFLOAD = ("qkv_linear", "core_attn", "attn_proj")  # the `attn` set: crosses the fit line in range
# Megatron's fine-grained offloading knows only its own module names (TransformerConfig.offload_modules:
# attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1, moe_act, fused_group_mlp); of those,
# the attention ones wrap one module each of both stacks, as Megatron's Attention wraps them: the
# `offload:attn` row's set. (attn_norm/mlp_norm need Megatron's delayed commit after the residual
# add, which is inside Megatron's layer code, not at a module boundary of ours.)
MEGATRON_OFFLOAD = ("qkv_linear", "core_attn", "attn_proj")


# ----------------------------------------------------------------------------- peers' code
def torchtune_offloader() -> tuple[type, dict]:
    """torchtune's ``OffloadActivations`` class, their code unchanged, and how it was loaded.

    First the ordinary ``from torchtune.training import OffloadActivations``. torchtune's
    package ``__init__`` imports its datasets, models and tokenizers (``datasets``,
    ``huggingface_hub``, ``kagglehub``, ...), which are not on the GPU machine; if that import
    fails, the partial import is dropped and the one file that defines the class,
    ``torchtune/training/_activation_offloading.py``, is loaded from the installed package
    with its own imports satisfied by the package's own files: ``torchtune``,
    ``torchtune.modules``, ``torchtune.utils`` and ``torchtune.training`` become empty package
    objects whose ``__path__`` is the installed folder (so their ``__init__`` does not run),
    ``torchtune.modules.TiedLinear`` comes from ``torchtune/modules/tied_linear.py`` and
    ``torchtune.utils.get_logger`` from ``torchtune/utils/_logging.py``. ``torchao`` and
    ``psutil`` are imported for real. The file's SHA-256 is checked against the wheel's
    ``RECORD``.
    """
    from importlib import metadata

    info: dict[str, Any] = {}
    try:
        from torchtune.training import OffloadActivations  # type: ignore[import-not-found]

        info["loaded_via"] = "from torchtune.training import OffloadActivations"
    except Exception as exc:  # noqa: BLE001 - any failure of the package import: try the file
        if importlib.util.find_spec("torchtune") is None:
            raise
        info["package_import_error"] = f"{type(exc).__name__}: {exc}"
        for name in [n for n in sys.modules if n == "torchtune" or n.startswith("torchtune.")]:
            del sys.modules[name]
        root = Path(importlib.util.find_spec("torchtune").submodule_search_locations[0])
        for name, sub in (("torchtune", ""), ("torchtune.modules", "modules"), ("torchtune.utils", "utils"),
                          ("torchtune.training", "training")):
            package = types.ModuleType(name)
            package.__path__ = [str(root / sub)]
            package.__package__ = name
            sys.modules[name] = package
        sys.modules["torchtune.modules"].TiedLinear = importlib.import_module("torchtune.modules.tied_linear").TiedLinear
        sys.modules["torchtune.utils"].get_logger = importlib.import_module("torchtune.utils._logging").get_logger
        module = importlib.import_module("torchtune.training._activation_offloading")
        OffloadActivations = module.OffloadActivations
        info["loaded_via"] = ("torchtune/training/_activation_offloading.py from the installed package, "
                              "package __init__ files bypassed (see torchtune_offloader)")
    module_file = Path(sys.modules[OffloadActivations.__module__].__file__)
    info["file"] = str(module_file)
    try:
        dist = metadata.distribution("torchtune")
        info["version"] = dist.version
        record = next((f for f in dist.files or () if str(f).replace("\\", "/").endswith(
            "torchtune/training/_activation_offloading.py")), None)
        if record is not None and record.hash is not None:
            digest = base64.urlsafe_b64encode(hashlib.sha256(module_file.read_bytes()).digest()).rstrip(b"=").decode()
            info["file_matches_wheel_record"] = digest == record.hash.value
    except metadata.PackageNotFoundError:
        info["version"] = None
    return OffloadActivations, info


def not_run_reason(peer: str) -> str | None:
    """Why a peer that needs Transformer Engine cannot run here, or ``None`` if it could."""
    te = importlib.util.find_spec("transformer_engine") is not None
    if peer == "te":
        return None if te else ("Transformer Engine is not installed on this machine "
                                "(`import transformer_engine` has nothing to import)")
    if peer == "megatron":
        if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
            return "megatron-core is not installed on this machine"
        if not te:
            return ("needs Transformer Engine: megatron-core's fine-grained offloading "
                    "(megatron/core/pipeline_parallel/fine_grained_activation_offload.py) raises "
                    "'TE CPU offload is not available' without it; Transformer Engine is not installed")
        return None
    return None


# ----------------------------------------------------------------------------- worker side
class Tally:
    """What a peer's pack hook copied to the host in one step, observed from outside."""

    def __init__(self) -> None:
        self.bytes = 0
        self.tensors = 0
        self.param_bytes = 0
        self.duplicate_bytes = 0
        self._storages: set[int] = set()

    def add(self, saved: torch.Tensor, nbytes: int) -> None:
        self.bytes += nbytes
        self.tensors += 1
        base = saved._base
        if isinstance(saved, nn.Parameter) or isinstance(base, nn.Parameter):
            self.param_bytes += nbytes  # a weight (or weight.t()): the GPU copy stays, nothing freed
        ptr = saved.untyped_storage().data_ptr()
        if ptr in self._storages:
            self.duplicate_bytes += nbytes  # the same storage copied again
        self._storages.add(ptr)

    def as_dict(self) -> dict:
        return {"bytes_offloaded": self.bytes, "tensors": self.tensors, "param_bytes": self.param_bytes,
                "duplicate_bytes": self.duplicate_bytes}


def host_pinned_stats() -> dict:
    """PyTorch's caching host (pinned) allocator: the bytes it holds and its peak in use."""
    fn = getattr(torch.cuda, "host_memory_stats", None)
    if fn is None or not torch.cuda.is_initialized():
        return {}
    try:
        stats = {k: v for k, v in fn().items() if "bytes" in k}
    except RuntimeError as exc:
        return {"error": str(exc)}
    held = max(stats.get("reserved_bytes.current", 0), stats.get("allocated_bytes.current", 0))
    in_use = stats.get("active_bytes.peak", stats.get("allocated_bytes.peak", 0))
    return {"pinned_bytes": held, "pinned_peak_in_use": in_use, "raw": stats}


def summarize_trace(tl: Any) -> dict:
    """Copy and compute figures of one profiled step (a `offload.tools.trace_events.Timeline`).

    Per direction: bytes, copy time (sum of copy durations), the copy rate while copying, and
    the fraction of copy time during which a kernel ran (on any stream): a copy on the compute
    stream itself (``save_on_cpu``) has none. ``gpu_idle_ms``: time inside the step when the
    GPU ran neither a kernel nor a copy.
    """
    kernels = [(o.start, o.end) for o in tl.ops if o.kind == "kernel"]
    cover = Cover(kernels)
    out: dict[str, Any] = {}
    for kind in ("d2h", "h2d"):
        ops = [o for o in tl.ops if o.kind == "memcpy" and o.copy == kind]
        busy_us = sum(o.dur for o in ops)
        nbytes = sum(o.bytes for o in ops)
        out[kind] = {
            "copies": len(ops),
            "bytes": nbytes,
            "copy_ms": busy_us / 1e3,
            "gbps": nbytes / busy_us / 1e3 if busy_us > 0 else None,
            "under_compute": sum(cover.covered(o.start, o.end) for o in ops) / busy_us if busy_us > 0 else None,
            "streams": sorted({o.stream for o in ops}),
        }
    if tl.ops:
        span = max(o.end for o in tl.ops) - min(o.start for o in tl.ops)
        out["span_ms"] = span / 1e3
        out["kernel_busy_ms"] = length(kernels) / 1e3
        out["gpu_idle_ms"] = (span - length((o.start, o.end) for o in tl.ops)) / 1e3
        out["compute_streams"] = sorted({o.stream for o in tl.ops if o.kind == "kernel"})
    return out


def profile_step(step: Callable[[], None], cuda: bool, keep: Path | None) -> dict:
    """Run ``step`` once under ``torch.profiler`` and summarize its copies (`summarize_trace`)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        with profile(activities=activities) as prof:
            step()
            if cuda:
                torch.cuda.synchronize()
        prof.export_chrome_trace(str(path))
        summary = summarize_trace(load_torch_trace(path))
        if keep is not None:
            keep.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "rb") as src, gzip.open(keep, "wb", compresslevel=6) as dst:
                shutil.copyfileobj(src, dst)
            if keep.stat().st_size > TRACE_LIMIT_BYTES:
                summary["trace"] = f"dropped: {keep.stat().st_size} bytes gzipped > {TRACE_LIMIT_BYTES}"
                keep.unlink()
            else:
                summary["trace"] = keep.name
    return summary


def bandwidth_probe(cuda: bool, mib: int = 256, reps: int = 5) -> dict:
    """Pinned copy bandwidth each way (one direction at a time), CUDA events, ``mib`` MiB copies."""
    if not cuda:
        return {"status": "not_run", "reason": "no CUDA device (CPU run)"}
    n = mib << 20
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    out: dict[str, Any] = {"status": "ok", "copy_mib": mib, "device_name": torch.cuda.get_device_name(),
                           "cuda": torch.version.cuda}
    for kind, dst, src in (("d2h", host, dev), ("h2d", dev, host)):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        out[f"{kind}_gbps"] = reps * n / (start.elapsed_time(end) / 1e3) / 1e9
    return out


def _engine_figures(per_step: list[IterationStats], pinned_allocs_before: int, cuda: bool) -> dict:
    totals = [s.total() for s in per_step]
    whole = GroupStats.sum(totals)
    last = per_step[-1]
    layers_by_name = {}
    for name, s in last.by_name.items():
        layers_by_name[name] = {
            "groups": s.groups, "groups_offloaded": s.groups_offloaded, "groups_kept": s.groups_kept,
            "groups_recomputed": s.groups_recomputed, "bytes_offloaded": s.bytes_offloaded,
            "bytes_held_elsewhere": s.bytes_held_elsewhere,
        }
    return {
        "bytes_offloaded": totals[-1].bytes_offloaded,
        "bytes_reloaded": totals[-1].bytes_reloaded,
        "bytes_held_elsewhere": totals[-1].bytes_held_elsewhere,
        "reloads_on_demand": totals[-1].reloads_on_demand,
        "d2h_gbps": whole.d2h_gbps if cuda else None,
        "h2d_gbps": whole.h2d_gbps if cuda else None,
        "wait_ms": statistics.median(t.offload_wait_ms + t.reload_wait_ms for t in totals) if cuda else None,
        "pinned_bytes": last.pinned_bytes,
        "pinned_peak_in_use": last.pinned_peak_bytes_in_use,
        "pinned_allocations_after_warmup": last.pinned_allocations - pinned_allocs_before,
        "by_name": layers_by_name,
    }


def run_config(job: dict) -> dict:
    """One configuration of one model, measured in this process; returns its record."""
    spec = ModelSpec(**job["spec"])
    cfg = Config(**{**job["config"], "offload": tuple(job["config"]["offload"]),
                    "recompute": tuple(job["config"]["recompute"])})
    device = job["device"]
    cuda = device == "cuda"
    if cuda and not torch.cuda.is_available():
        raise RuntimeError("CUDA is not available in the worker")
    dtype = DTYPES[job["dtype"]]
    record: dict[str, Any] = {}

    tt_class = None
    if cfg.peer == "torchtune":
        try:
            tt_class, record["torchtune"] = torchtune_offloader()
        except ImportError as exc:
            return {"status": "not_run", "reason": f"torchtune is not importable: {exc}"}
        if not cuda:
            return {**record, "status": "not_run",
                    "reason": "needs CUDA: OffloadActivations creates CUDA streams (CPU run)"}

    model = build(spec, dtype, device)
    for p in model.parameters():  # persistent gradient buffers, allocated before the peak reset
        p.grad = torch.zeros_like(p)
    for pattern in cfg.recompute:
        recompute(model, pattern)
    handle = None
    if cfg.offload:
        mapping = {**spec.mapping, **EXTRA_MAPPING}
        offload.configure(cfg.offload, min_tensor_bytes=job["min_tensor_bytes"], timing=True, device=device,
                          **({} if job.get("copy_chunk_bytes") is None else {"copy_chunk_bytes": job["copy_chunk_bytes"]}))
        handle = offload.attach(model, {n: mapping[n] for n in cfg.offload})
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(spec.seq, spec.batch, spec.hidden, generator=gen, device=device, dtype=dtype)
    grad = torch.randn(x.shape, generator=gen, device=device, dtype=dtype)

    tt_ctx = tt_class() if tt_class is not None else None  # once, as torchtune's recipes do
    forward: Callable[[torch.Tensor], torch.Tensor] = model
    driver: Any = None
    if cfg.peer == "te":
        driver = te_offload_driver(model, spec)
        forward = driver.forward
        record["te"] = driver.info
    elif cfg.peer == "megatron":
        driver = megatron_offload_driver(model, spec)
        record["megatron"] = driver.info

    def forward_backward(context: Any) -> None:
        model.zero_grad(set_to_none=False)
        inp = x.detach().requires_grad_(True)  # a fresh leaf: its grad is not accumulated
        if context is None:
            out = forward(inp)
        else:
            with context:
                out = forward(inp)
        out.backward(grad)

    if cfg.peer == "save_on_cpu":
        def step() -> None:
            forward_backward(torch.autograd.graph.save_on_cpu(pin_memory=True))
    elif cfg.peer == "torchtune":
        def step() -> None:
            forward_backward(tt_ctx)
    elif cfg.peer == "megatron":
        def step() -> None:
            driver.begin_step()
            forward_backward(None)
            driver.end_step()
    else:
        def step() -> None:
            forward_backward(None)

    for _ in range(job["warmup"]):
        step()
        if cfg.offload:
            offload.end_iteration()
    clock = Clock(cuda)
    pinned_allocs_before = offload.get_manager().pool.allocations if cfg.offload else 0
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()  # weights, gradients and warm-up are behind us
        try:
            torch.cuda.reset_peak_host_memory_stats()
        except (AttributeError, RuntimeError):  # older torch, or no host allocation yet
            pass
    times: list[float] = []
    host_ms: list[float] = []
    per_step: list[IterationStats] = []
    for _ in range(job["steps"]):
        if cuda:
            torch.cuda.synchronize()  # every configuration starts each step on an idle GPU
        start, host_start = clock.mark(), time.perf_counter()
        step()
        end, host_end = clock.mark(), time.perf_counter()
        if cfg.offload:
            per_step.append(offload.end_iteration())  # timing=True: waits for the step's copy events
        times.append(clock.ms(start, end))
        host_ms.append((host_end - host_start) * 1e3)
    record.update({
        "status": "ok",
        "step_ms": statistics.median(times),
        "step_ms_min": min(times),
        "step_ms_all": [round(t, 3) for t in times],
        "host_ms": statistics.median(host_ms),
        "peak_allocated": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_reserved": torch.cuda.max_memory_reserved() if cuda else None,
    })
    if cfg.offload:
        record["engine"] = _engine_figures(per_step, pinned_allocs_before, cuda)
        record["bytes_offloaded"] = record["engine"]["bytes_offloaded"]
        record["pinned_bytes"] = record["engine"]["pinned_bytes"]
        record["d2h_gbps"], record["h2d_gbps"] = record["engine"]["d2h_gbps"], record["engine"]["h2d_gbps"]
        record["bandwidth_source"] = "engine statistics (CUDA events around each group's copies)"
    elif cfg.peer:
        record["host_pinned"] = host_pinned_stats()
        record["pinned_bytes"] = record["host_pinned"].get("pinned_bytes")
        record["peer_copies"] = observe_peer(cfg.peer, step, tt_ctx)
        record["bytes_offloaded"] = record["peer_copies"]["bytes_offloaded"]
        if cfg.peer == "megatron":
            record["megatron"]["offload_summary_total_bytes"] = driver.summary_bytes()
    else:
        record["bytes_offloaded"] = 0
    if job.get("profile_step") and (cfg.offload or cfg.peer):
        keep = Path(job["trace"]) if job.get("trace") else None
        record["profile"] = profile_step(step, cuda, keep)
        if cfg.offload:
            offload.end_iteration()
        if cfg.peer:
            record["d2h_gbps"] = record["profile"]["d2h"]["gbps"]
            record["h2d_gbps"] = record["profile"]["h2d"]["gbps"]
            record["bandwidth_source"] = "torch.profiler (one extra step): bytes / copy time"
    if handle is not None:
        handle.remove()
    if cfg.family == "none":  # after the measurement: these passes must not touch the peak
        record["saved_bytes_by_name"] = saved_bytes_by_name(model, spec.mapping, step)
        passes = []
        for _ in range(TIMING_PASSES):
            start = clock.mark()
            model(x)  # with grad, as in training; the graph is dropped at once
            passes.append(clock.ms(start, clock.mark()) / spec.layers)
        record["layer_forward_ms"] = statistics.median(passes)
    if cuda:
        record["device_name"] = torch.cuda.get_device_name()
    return record


def observe_peer(peer: str, step: Callable[[], None], tt_ctx: Any) -> dict:
    """Run one more (untimed) step with the peer's own pack hook wrapped, to count what it
    copies: the wrapper calls their hook unchanged and looks at its input and output."""
    tally = Tally()
    if peer == "save_on_cpu":
        original_cls = torch.autograd.graph.save_on_cpu

        class observed(original_cls):  # type: ignore[misc, valid-type]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                super().__init__(*args, **kwargs)
                theirs = self.pack_hook

                def pack(t: torch.Tensor) -> Any:
                    packed = theirs(t)
                    tally.add(t, packed[1].untyped_storage().nbytes())
                    return packed

                self.pack_hook = pack

        torch.autograd.graph.save_on_cpu = observed
        try:
            step()
        finally:
            torch.autograd.graph.save_on_cpu = original_cls
    elif peer == "torchtune":
        theirs = tt_ctx.pack_hook

        def pack(t: torch.Tensor) -> Any:
            tensor_id = theirs(t)
            held, copied = tt_ctx.tracker[tensor_id]
            if copied:  # True: a pinned host copy was made
                tally.add(t, held.untyped_storage().nbytes())
            return tensor_id

        tt_ctx.pack_hook = pack
        try:
            step()
        finally:
            tt_ctx.pack_hook = theirs
    elif peer == "te":
        from transformer_engine.pytorch.cpu_offload import OffloadableLayerState

        te_start = OffloadableLayerState.start_offload

        def start_offload(self: Any) -> None:
            te_start(self)  # theirs; afterwards the group holds the (deduplicated) tensors it copies
            for t in self.fwd_gpu_tensor_group.tensor_list:
                tally.add(t, t.numel() * t.element_size())

        OffloadableLayerState.start_offload = start_offload
        try:
            step()
        finally:
            OffloadableLayerState.start_offload = te_start
    elif peer == "megatron":
        from megatron.core.pipeline_parallel.fine_grained_activation_offload import ChunkOffloadHandler

        mc_offload = ChunkOffloadHandler.offload

        def offload_one(self: Any, src_tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            tally.add(src_tensor, src_tensor.numel() * src_tensor.element_size())
            return mc_offload(self, src_tensor, *args, **kwargs)

        ChunkOffloadHandler.offload = offload_one
        try:
            step()
        finally:
            ChunkOffloadHandler.offload = mc_offload
    return tally.as_dict()


class te_offload_driver:
    """Transformer Engine's ``get_cpu_offload_context`` on our layer stack, used as its docstring
    says: each layer's forward inside the context, its output through the synchronization
    function, then the stack's final norm (`GPTLayerStack` and `MoELayerStack` run exactly this
    loop in their own ``forward``). TE offloads every tensor saved inside the context (at least
    256 Ki elements) of layers ``0 .. num_layers-1``; ``num_layers`` is ``layers - 1``, the most
    its default schedule allows (the last layer stays, as `offload` keeps it), with TE's warning
    that so many leave its copies little room to overlap. ``NVTE_CPU_OFFLOAD_V1`` unset: its
    current code path."""

    def __init__(self, model: nn.Module, spec: ModelSpec) -> None:
        if os.environ.get("NVTE_CPU_OFFLOAD_V1", "0") == "1":
            raise RuntimeError("NVTE_CPU_OFFLOAD_V1=1 selects TE's legacy offloading; unset it for this row")
        from importlib import metadata

        from transformer_engine.pytorch.cpu_offload import get_cpu_offload_context

        layers = list(model.layers)  # type: ignore[attr-defined]
        self.final_norm = model.final_layernorm  # type: ignore[attr-defined]
        self.layers = layers
        num_layers = max(1, len(layers) - 1)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            self.context, self.sync = get_cpu_offload_context(
                enabled=True, num_layers=num_layers, model_layers=len(layers))
        self.info = {
            "version": metadata.version("transformer-engine"),
            "call": f"get_cpu_offload_context(enabled=True, num_layers={num_layers}, model_layers={len(layers)})",
            "num_layers": num_layers,
            "warnings": [str(w.message) for w in caught],
        }

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            with self.context:
                h = layer(h)
            h = self.sync(h)
        return self.final_norm(h)


class megatron_offload_driver:
    """Megatron-core's fine-grained activation offloading on our layer stack, driven through its
    interface (``FineGrainedActivationOffloadingInterface``) with the calls Megatron makes:

    * per forward of a model chunk, ``init_chunk_handler(pp_rank, vp_size, vp_stage, ...)`` (what
      ``GPTModel.preprocess_for_fine_grained_offloading`` does), and ``mark_not_offload`` on the
      parameters once;
    * around each offloaded module, as Megatron's ``Attention.forward`` does for ``qkv_linear``,
      ``core_attn`` and ``attn_proj``: ``manager = off_interface(True, input, name)``,
      ``with manager as input: output = module(input)``, then
      ``output = manager.group_offload(output, forced_released_tensors=[])`` (here as a forward
      pre-hook and a forward hook on the module; nothing holds the inputs after the module, so
      nothing needs a forced release);
    * after the step's backward, ``off_interface.reset()`` (what ``forward_backward_no_pipelining``
      does at its end); the first reset ends Megatron's warm-up iteration, in which it offloads
      every group (the last layer's too) to measure them, and prints its summary table, which needs
      ``torch.distributed``: a world of one (gloo, a file store) is set up for it.

    ``NVTE_CPU_OFFLOAD_V1=1`` is set before TE is imported (Megatron's entry uses TE's v1 offload
    flag). Megatron's default ``min_offloaded_tensor_size`` (1 Mi elements) applies."""

    def __init__(self, model: nn.Module, spec: ModelSpec) -> None:
        os.environ["NVTE_CPU_OFFLOAD_V1"] = "1"
        if "transformer_engine.pytorch" in sys.modules:
            import transformer_engine.pytorch.cpu_offload as te_offload

            if not te_offload.NVTE_CPU_OFFLOAD_V1:
                raise RuntimeError("TE was imported before NVTE_CPU_OFFLOAD_V1=1 was set in this process")
        import torch.distributed as dist
        from importlib import metadata

        from megatron.core.pipeline_parallel.fine_grained_activation_offload import (
            FineGrainedActivationOffloadingInterface as off_interface,
        )

        if not dist.is_initialized():
            self._store_dir = tempfile.mkdtemp(prefix="megatron-pg-")
            dist.init_process_group("gloo", init_method=f"file://{self._store_dir}/store", rank=0, world_size=1)
        off_interface.reset_instance()
        self.off = off_interface
        self.min_elements = 1024 * 1024  # TransformerConfig.min_offloaded_tensor_size
        self._params_marked = False
        self.model = model
        self.hooks = []
        wrapped: dict[str, int] = {}
        import fnmatch

        for name in MEGATRON_OFFLOAD:
            pattern = spec.mapping[name]
            for qn, module in model.named_modules():
                if qn and fnmatch.fnmatchcase(qn, pattern):
                    self.hooks += self._wrap(module, name)
                    wrapped[name] = wrapped.get(name, 0) + 1
        self.info = {
            "version": metadata.version("megatron-core"),
            "offload_modules": list(MEGATRON_OFFLOAD),
            "modules_wrapped": wrapped,
            "min_offloaded_tensor_size": self.min_elements,
            "NVTE_CPU_OFFLOAD_V1": os.environ["NVTE_CPU_OFFLOAD_V1"],
        }

    def _wrap(self, module: nn.Module, name: str) -> list[Any]:
        off = self.off
        stack: list[Any] = []

        def pre(mod: nn.Module, args: tuple) -> tuple:
            manager = off(True, args[0], name)
            first = manager.__enter__()
            stack.append(manager)
            return (first, *args[1:])

        def post(mod: nn.Module, args: tuple, output: Any) -> Any:
            manager = stack.pop()
            manager.__exit__(None, None, None)
            return manager.group_offload(output, forced_released_tensors=[])

        return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]

    def begin_step(self) -> None:
        self.off.init_chunk_handler(
            pp_rank=0, vp_size=None, vp_stage=None, min_offloaded_tensor_size=self.min_elements,
            delta_offload_bytes_across_pp_ranks=0, activation_offload_fraction=1.0,
        )
        if not self._params_marked:
            for p in self.model.parameters():
                self.off.mark_not_offload(p)
            self._params_marked = True

    def end_step(self) -> None:
        self.off.reset()

    def summary_bytes(self) -> int | None:
        from megatron.core.pipeline_parallel.fine_grained_activation_offload import PipelineOffloadManager

        return getattr(PipelineOffloadManager.get_instance(), "_offload_summary_total_bytes", None)


def run_job(job: dict) -> dict:
    """Entry point of a worker process: one job of the plan."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="offload: no CUDA device", category=RuntimeWarning)
        if job["kind"] == "probe":
            return bandwidth_probe(job["device"] == "cuda")
        return run_config(job)


# ----------------------------------------------------------------------------- parent side
def _child(job: dict, conn: Any, log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    try:
        result = run_job(job)
    except BaseException as exc:  # noqa: BLE001 - everything goes into the record
        traceback.print_exc()
        result = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:2000]}
    sys.stdout.flush()
    sys.stderr.flush()
    conn.send(result)
    conn.close()
    os._exit(0)


def _log_tail(log: Path, lines: int = 6) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def run_isolated(job: dict, log: Path, timeout_s: float, isolation: str) -> dict:
    """Run ``job`` in a process of its own; a crash or a timeout becomes an error record."""
    if isolation == "subprocess":
        with tempfile.TemporaryDirectory() as tmp:
            spec_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
            spec_path.write_text(json.dumps(job))
            with open(log, "w") as out:
                try:
                    proc = subprocess.run([sys.executable, __file__, "--worker-job", str(spec_path),
                                           "--worker-result", str(result_path)],
                                          stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    return {"status": "error", "error": f"timed out after {timeout_s:.0f} s"}
            if result_path.exists():
                return json.loads(result_path.read_text())
            return {"status": "error", "error": f"worker exited with {proc.returncode}: {_log_tail(log)}"}
    # A fork server, not a fork of this process: something in the parent (an import, a device
    # query) can initialise the CUDA driver without torch noticing, and a plain fork of such a
    # process fails its first CUDA call ("initialization error", seen on the H100 machine).
    ctx = multiprocessing.get_context("forkserver")
    # The server imports torch and offload once and each worker forks from it with them loaded
    # (by default every worker imported them again: 1.7 s a job on the 2-core CPU machine).
    # Importing them touches no device, so the fork server stays free of CUDA.
    ctx.set_forkserver_preload(["torch", "offload"])
    recv, send = ctx.Pipe(duplex=False)
    sys.stdout.flush()
    sys.stderr.flush()
    proc = ctx.Process(target=_child, args=(job, send, str(log)), daemon=True)
    proc.start()
    send.close()
    result = None
    if recv.poll(timeout_s):
        try:
            result = recv.recv()
        except EOFError:
            result = None
    else:
        proc.kill()
        proc.join(10)
        return {"status": "error", "error": f"timed out after {timeout_s:.0f} s: {_log_tail(log, 3)}"}
    proc.join(30)
    if proc.is_alive():
        proc.kill()
    if result is None:
        return {"status": "error", "error": f"worker died (exit code {proc.exitcode}): {_log_tail(log)}"}
    return result


class Progress:
    """A one-line progress bar on stderr (a line per job when stderr is not a terminal)."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.start = total, 0, time.perf_counter()
        self.tty = sys.stderr.isatty()

    def show(self, label: str, status: str = "") -> None:
        width = 30
        filled = int(width * self.done / max(self.total, 1))
        bar = "#" * filled + "-" * (width - filled)
        text = (f"[{bar}] {self.done:>3}/{self.total} {time.perf_counter() - self.start:6.0f}s  "
                f"{label} {status}")
        if self.tty:
            sys.stderr.write("\r" + text[:160].ljust(160))
        else:
            sys.stderr.write(text + "\n")
        sys.stderr.flush()

    def step(self, label: str, status: str) -> None:
        self.done += 1
        self.show(label, status)

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\n")


def job_id(*parts: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", "__".join(parts))


@dataclass
class Plan:
    """The jobs of a run, in order: the bandwidth probe, each size's configurations, the sweep."""

    jobs: list[dict] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)  # rows decided without a process


def sweep_specs(args: argparse.Namespace) -> list[tuple[str, ModelSpec]]:
    """(axis, spec) for each point of the scaling sweep: sequence lengths at the base hidden
    size, then hidden sizes at the base sequence length (the shared point once)."""
    points: list[tuple[str, ModelSpec]] = []

    def spec(hidden: int, seq: int) -> ModelSpec:
        return ModelSpec(f"sweep-h{hidden}-s{seq}", hidden=hidden, heads=max(1, hidden // args.sweep_head_dim),
                         layers=args.sweep_layers, seq=seq)

    for seq in args.sweep_seq:
        points.append(("seq", spec(args.sweep_base_hidden, seq)))
    for hidden in args.sweep_hidden:
        points.append(("hidden", spec(hidden, args.sweep_base_seq)))
    return points


def make_plan(args: argparse.Namespace, sizes: list[ModelSpec]) -> Plan:
    """The jobs in run order: the probe, the ``--large`` sizes, the sweep, the other sizes (so
    that a spent time budget cuts the small sizes first). TE and Megatron rows that cannot run
    here become records at once, with the reason."""
    plan = Plan()
    common = {"device": args.device, "dtype": args.dtype, "steps": args.steps, "warmup": args.warmup,
              "min_tensor_bytes": args.min_tensor_bytes, "copy_chunk_bytes": args.copy_chunk_bytes}
    if args.device == "cuda":
        plan.jobs.append({"kind": "probe", "id": "probe", **common})

    def size_jobs(spec: ModelSpec) -> None:
        for cfg in configs_for(spec):
            if args.configs and cfg.name not in args.configs and cfg.name != "none":
                continue
            base = {"kind": "config", "size": spec.name, "config": asdict(cfg), "spec": asdict(spec), **common}
            jid = job_id(spec.name, cfg.name)
            if cfg.peer in ("te", "megatron"):
                # No code of ours stands in for theirs: the row runs their code (`te_offload_driver`,
                # `megatron_offload_driver`) or says why it cannot.
                reason = not_run_reason(cfg.peer)
                if reason is None and args.device != "cuda":
                    reason = "needs CUDA: their offloading creates CUDA streams and events (CPU run)"
                if reason is not None:
                    plan.records.append({**base, "id": jid, "status": "not_run", "reason": reason})
                    continue
            moving = bool(cfg.offload or cfg.peer)
            profile = moving and (cfg.peer != "" or args.profile == "all" or
                                  (args.profile == "large" and spec.name in args.large))
            trace = str(Path(args.out) / "traces" / f"{jid}.json.gz") if profile and args.keep_traces else None
            plan.jobs.append({**base, "id": jid, "profile_step": profile, "trace": trace})

    def sweep_jobs() -> None:
        for axis, spec in sweep_specs(args):
            for cfg in (Config("none", "none", "no offloading"),
                        Config("offload:attn", "offload", "offload qkv_linear+core_attn+attn_proj",
                               offload=SWEEP_OFFLOAD)):
                plan.jobs.append({"kind": "sweep", "axis": axis, "size": spec.name, "config": asdict(cfg),
                                  "spec": asdict(spec), "id": job_id(spec.name, cfg.name), "profile_step": False,
                                  "trace": None, **common})

    for spec in sizes:
        if spec.name in args.large:
            size_jobs(spec)
    if not args.no_sweep:
        sweep_jobs()
    for spec in sizes:
        if spec.name not in args.large:
            size_jobs(spec)
    return plan


def execute(plan: Plan, args: argparse.Namespace) -> list[dict]:
    """Run every job in its own process, in order, within ``args.budget_s``; return all records."""
    logs = Path(args.out) / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    progress = Progress(len(plan.jobs))
    start = time.perf_counter()
    durations: list[float] = []
    records = []
    for job in plan.jobs:
        label = f"{job.get('size', '')} {job['config']['name'] if 'config' in job else job['kind']}".strip()
        progress.show(label, "...")
        elapsed = time.perf_counter() - start
        estimate = statistics.median(durations) if durations else 0.0
        if args.budget_s and elapsed + estimate > args.budget_s:
            result: dict = {"status": "not_run", "reason": f"time budget of {args.budget_s:.0f} s spent "
                                                           f"({elapsed:.0f} s elapsed)"}
        else:
            limit = args.worker_timeout_s
            if args.budget_s:
                limit = max(20.0, min(limit, args.budget_s - elapsed + 20.0))
            t0 = time.perf_counter()
            result = run_isolated(job, logs / f"{job['id']}.log", limit, args.isolation)
            if args.isolation == "fork" and "initialization error" in str(result.get("error", "")):
                args.isolation = "subprocess"  # forked workers cannot start CUDA here: fresh interpreters
                print("forked workers failed to start CUDA; every job now runs in a fresh interpreter",
                      flush=True)
                result = run_isolated(job, logs / f"{job['id']}.log", limit, args.isolation)
            result["wall_s"] = round(time.perf_counter() - t0, 2)
            durations.append(result["wall_s"])
        status = result.get("status", "error")
        progress.step(label, status if status == "ok" else f"{status}: {result.get('reason') or result.get('error')}")
        record = {k: v for k, v in job.items() if k not in ("trace",)}
        record.update(result)
        records.append(record)
    progress.close()
    return records + plan.records


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="CPU check: tiny sizes, 2 steps after 1 warm-up step")
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda, or cpu with --smoke")
    p.add_argument("--dtype", choices=list(DTYPES), help="default: bf16 (fp32 with --smoke)")
    p.add_argument("--sizes", nargs="+", help="model sizes to run (default all: gpt-s gpt-l moe-s moe-l)")
    p.add_argument("--configs", nargs="+", help="configurations to run besides none (default all)")
    p.add_argument("--steps", type=int, help="timed steps per configuration (default 20; 2 with --smoke)")
    p.add_argument("--warmup", type=int, help="warm-up steps per configuration (default 3; 1 with --smoke)")
    p.add_argument("--min-tensor-bytes", type=int, help=f"engine's min_tensor_bytes (default {DEFAULT_MIN_TENSOR_BYTES} "
                                                          "on cuda, 0 on cpu)")
    p.add_argument("--profile", choices=["peers", "large", "all"], default="large",
                   help="profile one extra step: of the peers only, also of every offload row of the "
                        "--large sizes (default), or of every row that moves bytes")
    p.add_argument("--large", nargs="+", default=["gpt-l", "moe-l"], help="sizes run first (before the sweep) and profiled with --profile large")
    p.add_argument("--keep-traces", action="store_true", help="keep the profiled steps' traces (gzipped)")
    p.add_argument("--no-sweep", action="store_true", help="skip the scaling sweep")
    p.add_argument("--sweep-seq", type=int, nargs="+", help="sweep: sequence lengths at --sweep-base-hidden")
    p.add_argument("--sweep-hidden", type=int, nargs="+", help="sweep: hidden sizes at --sweep-base-seq")
    p.add_argument("--sweep-base-hidden", type=int)
    p.add_argument("--copy-chunk-bytes", type=int, help="engine's copy_chunk_bytes (default: the engine's)")
    p.add_argument("--sweep-base-seq", type=int)
    p.add_argument("--sweep-layers", type=int)
    p.add_argument("--sweep-head-dim", type=int)
    p.add_argument("--budget-s", type=float, default=0.0, help="skip jobs that would start past this (0: none)")
    p.add_argument("--worker-timeout-s", type=float, default=240.0)
    p.add_argument("--isolation", choices=["fork", "subprocess"], default="fork",
                   help="fork from a fork server (torch already imported, CUDA never started) or start a "
                        "fresh interpreter per job (the fallback when forked workers cannot start CUDA)")
    p.add_argument("--merge", metavar="PEERS_JSON",
                   help="an earlier run's peers.json (same machine): its records join this run's, which win "
                        "where both ran a job; the report covers every size of either run")
    p.add_argument("--out", default="docs/results", help="folder for peers.json, peers.md, the plots, logs/")
    p.add_argument("--worker-job", help=argparse.SUPPRESS)
    p.add_argument("--worker-result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    smoke = args.smoke
    defaults = {
        "device": "cpu" if smoke else "cuda", "dtype": "fp32" if smoke else "bf16",
        "steps": 2 if smoke else 20, "warmup": 1 if smoke else 3,
        "sweep_seq": [32, 64] if smoke else [2048, 4096, 8192, 16384],
        "sweep_hidden": [32, 96] if smoke else [1024, 2048, 8192],
        "sweep_base_hidden": 64 if smoke else 4096, "sweep_base_seq": 32 if smoke else 4096,
        "sweep_layers": 3 if smoke else 4, "sweep_head_dim": 16 if smoke else 128,
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.min_tensor_bytes is None:
        args.min_tensor_bytes = DEFAULT_MIN_TENSOR_BYTES if args.device == "cuda" else 0
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    known = {s.name for s in GPU_SIZES}
    if args.sizes and not set(args.sizes) <= known:
        p.error(f"--sizes: unknown {sorted(set(args.sizes) - known)}; choose from {sorted(known)}")
    return args


def merge_runs(earlier: dict, records: list[dict], meta: dict,
               args: argparse.Namespace) -> tuple[list[dict], dict, list[ModelSpec]]:
    """One report from two runs on the same machine (a run that does not fit one device call):
    a job this run did not run (absent, or skipped for the time budget) keeps the earlier record;
    the meta names both commands."""
    if earlier["meta"]["device"] != meta["device"]:
        raise SystemExit(f"--merge: {args.merge} ran on {earlier['meta']['device']}, this run on {meta['device']}")
    ran = {r["id"]: r for r in records if r.get("id") and r.get("status") in ("ok", "error")}
    merged = [ran.get(r.get("id"), r) for r in earlier["records"]]
    ids = {r.get("id") for r in merged}
    merged += [r for r in records if r.get("id") not in ids]
    meta = {**meta, "command": f"{earlier['meta']['command']} ; {meta['command']}",
            "wall_s": round(earlier["meta"].get("wall_s", 0) + meta["wall_s"], 1)}
    sizes_run = {r.get("size") for r in merged}
    sizes = [s for s in (SMOKE_SIZES if args.smoke else GPU_SIZES) if s.name in sizes_run]
    return merged, meta, sizes


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse(argv)
    if args.worker_job:  # --isolation subprocess: one job in this fresh process
        job = json.loads(Path(args.worker_job).read_text())
        try:
            result = run_job(job)
        except BaseException as exc:  # noqa: BLE001
            traceback.print_exc()
            result = {"status": "error", "error": f"{type(exc).__name__}: {exc}"[:2000]}
        Path(args.worker_result).write_text(json.dumps(result))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("peers.py needs a CUDA device (--device cuda, the default); "
                         "--smoke runs a functional check on the CPU")
    from benchmarks import peers_report

    sizes = [s for s in (SMOKE_SIZES if args.smoke else GPU_SIZES) if not args.sizes or s.name in args.sizes]
    Path(args.out).mkdir(parents=True, exist_ok=True)
    plan = make_plan(args, sizes)
    t0 = time.perf_counter()
    records = execute(plan, args)
    probe = next((r for r in records if r["kind"] == "probe"), None)
    device = (probe or {}).get("device_name") or next((r["device_name"] for r in records if r.get("device_name")),
                                                      "cpu" if args.device == "cpu" else "unknown")
    meta = {
        "device": device,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "command": shlex.join(["python", "benchmarks/peers.py", *argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    failed = [r.get("id", "?") for r in records if r.get("status") == "error"]
    peers_report.stamp_baselines(records, meta["date"])
    for r in records:  # this run's own provenance, kept through later merges
        r.update(command=meta["command"], date=meta["date"])
    if args.merge:
        records, meta, sizes = merge_runs(json.loads(Path(args.merge).read_text()), records, meta, args)
    report = peers_report.finish(records, meta, sizes, Path(args.out))
    print(report["summary"])
    print(f"results: {', '.join(report['files'])}", file=sys.stderr)
    if failed:
        print(f"peers.py: {len(failed)} job(s) of this run failed (logs in {Path(args.out) / 'logs'}): "
              f"{', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
