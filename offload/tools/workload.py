"""What the tools run: a model, its offload-name mapping and one training step.

A workload is either the built-in GPT layer stack of `offload.testing` (``--hidden``,
``--layers``, ...) or a user entry point ``--entry pkg.module:function`` called with the
``--entry-arg key=value`` pairs (strings) and ``device=``; it returns a `Workload` or a
``(model, mapping, step)`` tuple, where ``step()`` runs one forward and backward. The spec (the
arguments) is stored in every tool's output, so that a later tool can rebuild the same workload.
"""

from __future__ import annotations

import argparse
import importlib
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from ..testing import GPT_MAPPING, GPTLayerStack

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class Workload:
    """``step()`` runs one forward and backward of ``model``; ``mapping`` maps offload names to
    module patterns (as for `offload.attach`). Parameter gradients should exist before the first
    measured step (persistent buffers, zeroed in place), so that a peak is activations."""

    model: nn.Module
    mapping: dict[str, str]
    step: Callable[[], None]
    device: torch.device
    description: str = ""


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The workload options every tool takes."""
    g = p.add_argument_group("workload")
    g.add_argument("--entry", help="pkg.module:function returning a Workload or (model, mapping, step); "
                                   "default: the GPT layer stack of offload.testing")
    g.add_argument("--entry-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument (a string) for --entry; repeat for several")
    g.add_argument("--hidden", type=int, default=1024)
    g.add_argument("--heads", type=int, default=8)
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--seq", type=int, default=1024)
    g.add_argument("--batch", type=int, default=1)
    g.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    g.add_argument("--device", default=None, help="cuda (default when available) or cpu")


def spec_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """The JSON-serializable description of the workload chosen on the command line."""
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.entry:
        kwargs = {}
        for item in args.entry_arg:
            key, sep, value = item.partition("=")
            if not sep or not key:
                raise SystemExit(f"--entry-arg {item!r}: expected KEY=VALUE")
            kwargs[key] = value
        return {"entry": args.entry, "kwargs": kwargs, "device": device}
    return {"entry": "gpt", "device": device, "hidden": args.hidden, "heads": args.heads,
            "layers": args.layers, "seq": args.seq, "batch": args.batch, "dtype": args.dtype}


def build_gpt_workload(spec: dict[str, Any]) -> Workload:
    """The GPT layer stack, built directly on the device (fast for billion-parameter stacks)."""
    device = torch.device(spec["device"])
    dtype = DTYPES[spec["dtype"]]
    torch.manual_seed(0)
    with torch.device(device):
        model = GPTLayerStack(spec["hidden"], spec["heads"], spec["layers"])
    model.to(dtype)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    gen = torch.Generator(device=device).manual_seed(0)
    shape = (spec["seq"], spec["batch"], spec["hidden"])
    x = torch.randn(shape, generator=gen, device=device, dtype=dtype)
    grad = torch.randn(shape, generator=gen, device=device, dtype=dtype)

    def step() -> None:
        model.zero_grad(set_to_none=False)
        model(x.detach().requires_grad_(True)).backward(grad)

    desc = (f"GPT layer stack: {spec['layers']} layers, hidden {spec['hidden']}, {spec['heads']} heads, "
            f"seq {spec['seq']}, batch {spec['batch']}, {spec['dtype']}")
    return Workload(model, dict(GPT_MAPPING), step, device, desc)


def build_workload(spec: dict[str, Any]) -> Workload:
    """Build the workload a spec describes (see `spec_from_args`)."""
    if spec.get("entry") == "gpt":
        return build_gpt_workload(spec)
    target = spec.get("entry") or ""
    module_name, sep, fn_name = target.partition(":")
    if not sep or not module_name or not fn_name:
        raise SystemExit(f"--entry {target!r}: expected pkg.module:function")
    try:
        fn = getattr(importlib.import_module(module_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise SystemExit(f"--entry {target!r}: cannot load it ({e})") from None
    out = fn(device=spec["device"], **spec.get("kwargs", {}))
    if isinstance(out, Workload):
        return out
    if isinstance(out, tuple) and len(out) == 3:
        model, mapping, step = out
        return Workload(model, dict(mapping), step, torch.device(spec["device"]), target)
    raise SystemExit(f"--entry {target!r} returned {type(out).__name__}; expected a Workload or "
                     "(model, mapping, step)")


def describe_device(device: torch.device) -> str:
    """The device's name, for reports."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"
