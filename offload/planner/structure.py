"""Where checkpointed regions can go in a model, and what the advisor needs to know about them.

A region is a module that runs under `torch.utils.checkpoint`: a named module of the mapping, or
a **container**, a module that holds instances of several names (a layer, its MLP). Checkpointing
a module alone frees only what nothing outside it saves (its output, saved by the next module,
stays), so the regions that free much are containers.

`find_containers` finds them: modules holding at least two mapped modules, no name twice (so a
layer, not the list of layers), the same names in every instance; of containers holding the
same names the outermost is kept. They are named after their last non-numeric path component
(``layers.3.mlp`` gives ``mlp``, ``layers.3`` gives ``layers``) and listed by their qualified
module names, since fnmatch's ``*`` would also match their submodules.

`record` runs one step with forward hooks on the named modules and the containers and a
saved-tensor hook, and gives the advisor (`offload.tools.advisor.CheckpointFacts`): which
container instances each instance lies in, the storages each instance takes as tensor inputs
(what its checkpoint would save), and the containers around every save made outside named
modules. Storages are the profile's (`offload.tools.profile_modules`), matched by the order in
which the step first saves them, which is checked (shapes and dtypes). What nothing saves is
added to the profile's storages as ``unsaved``: the inputs of instances (a checkpoint saves
them) and the outputs of named modules (a selective checkpoint that keeps the module holds them).
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..errors import OffloadValueError
from ..policy import TensorPolicy
from ..tools.boundaries import match_modules
from ..tools.profile_modules import engine_bytes, label


def find_containers(model: nn.Module, mapping: dict[str, str]) -> dict[str, list[str]]:
    """Container name -> the qualified names of its instances (module docstring)."""
    name_at = {qn: name for name, qn, _ in match_modules(model, mapping)}
    by_shape: dict[str, list[tuple[str, tuple[str, ...]]]] = {}
    for qn, _ in model.named_modules():
        if not qn or qn in name_at:
            continue
        inside = [n for q, n in name_at.items() if q.startswith(qn + ".")]
        if len(inside) >= 2 and len(set(inside)) == len(inside):
            shape = ".".join("#" if part.isdigit() else part for part in qn.split("."))
            by_shape.setdefault(shape, []).append((qn, tuple(sorted(inside))))
    out: dict[str, list[str]] = {}
    seen: set[tuple[str, ...]] = set()
    for shape, found in sorted(by_shape.items(), key=lambda kv: kv[0].count(".")):  # outermost first
        same_shape = [qn for qn, _ in model.named_modules()
                      if qn and ".".join("#" if p.isdigit() else p for p in qn.split(".")) == shape]
        names = {inside for _, inside in found}
        if len(names) != 1 or len(same_shape) != len(found) or names <= seen:
            continue  # instances that differ, or the same region as an outer container
        seen |= names
        base = next((p for p in reversed(shape.split(".")) if p != "#"), "region")
        name, k = base, 1
        while name in mapping or name in out:
            k += 1
            name = f"{base}_region{k if k > 2 else ''}"
        out[name] = [qn for qn, _ in found]
    return out


def resolve_containers(model: nn.Module, spec: dict[str, str | list[str]]) -> dict[str, list[str]]:
    """User-given containers (name -> fnmatch pattern or patterns) as qualified module names,
    the outermost matches only; `OffloadValueError` for a pattern that matches nothing."""
    qualnames = [qn for qn, _ in model.named_modules() if qn]
    out = {}
    for name, patterns in spec.items():
        patterns = [patterns] if isinstance(patterns, str) else list(patterns)
        hits = [qn for qn in qualnames if any(fnmatch.fnmatchcase(qn, p) for p in patterns)]
        if not hits:
            raise OffloadValueError(f"offload: region {name!r} ({patterns}) matches no submodule of {type(model).__name__}")
        out[name] = [qn for qn in hits if not any(qn.startswith(h + ".") for h in hits)]
    return out


def _key(t: torch.Tensor) -> int | None:
    """The storage of a saved tensor as the profile keys it (plain dense tensors only)."""
    if type(t) is torch.Tensor and t.layout is torch.strided and t.numel():
        return t.untyped_storage().data_ptr()
    return None


def record(model: nn.Module, mapping: dict[str, str], containers: dict[str, list[str]],
           step: Callable[[], None], profile: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Run ``step()`` once and return ``profile["regions"]`` (module docstring); adds the inputs
    and the named modules' outputs that nothing saves to ``profile["storages"]``."""
    storages = profile["storages"]
    regions = {id(m): name for name, _, m in match_modules(model, mapping)}
    for name, qns in containers.items():
        for qn in qns:
            regions[id(model.get_submodule(qn))] = name
    policy = TensorPolicy(lambda t: t.device.type == device.type, profile["min_tensor_bytes"])
    policy.block_parameters(model.parameters())
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    counts: dict[str, int] = {}
    stack: list[tuple[str, int]] = []
    within: dict[str, list[str]] = {}
    inputs: dict[str, list[int]] = {}
    order: dict[int, int] = {}  # storage -> first-save index
    first: list[tuple[list[int], str]] = []  # shape and dtype at the first save
    other: dict[int, set[tuple[str, ...]]] = {}
    extra: dict[int, dict[str, Any]] = {}  # inputs and outputs, until known to be saved or not
    keep: list[torch.Tensor] = []  # no address is reused within the step

    def forward_not_recompute() -> bool:
        return torch._C._current_graph_task_id() == -1

    def tensors(values: Any) -> list[tuple[int, torch.Tensor]]:
        """The activation storages among ``values``, once each, kept alive for the step."""
        out: dict[int, torch.Tensor] = {}
        for t in tree_leaves(values):
            k = _key(t) if isinstance(t, torch.Tensor) else None
            if k is not None and k not in params and k not in out:
                out[k] = t
                keep.append(t)
        return list(out.items())

    def unsaved(t: torch.Tensor, created_in: str | None) -> dict[str, Any]:
        return {"bytes": engine_bytes(t), "eligible": policy.admits(t), "savers": [], "shape": list(t.shape),
                "dtype": str(t.dtype).replace("torch.", ""), "created_in": created_in, "unsaved": True}

    def pre(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not forward_not_recompute():
            return
        name = regions[id(module)]
        i = counts.get(name, 0)
        counts[name] = i + 1
        here = label(name, i)
        around = [label(*x) for x in stack if x[0] in containers]
        if around:
            within[here] = around
        found = tensors((args, kwargs))
        for k, t in found:
            extra.setdefault(k, unsaved(t, None))
        inputs[here] = [k for k, _ in found]
        stack.append((name, i))

    def post(module: nn.Module, args: tuple, output: Any) -> None:
        if not forward_not_recompute():
            return
        name, i = stack.pop()
        if name in containers:
            return
        here = label(name, i)
        for k, t in tensors(output):
            if k not in inputs[here] and k not in order:  # made here, not saved (yet)
                extra.setdefault(k, unsaved(t, here))

    def pack(t: torch.Tensor) -> torch.Tensor:
        k = _key(t)
        if k is None or k in params:
            return t
        if k not in order:
            order[k] = len(order)
            first.append((list(t.shape), str(t.dtype).replace("torch.", "")))
        if not stack or stack[-1][0] in containers:  # a save outside every named module
            other.setdefault(k, set()).add(tuple(label(*x) for x in stack))
        keep.append(t)
        return t

    handles = [h for module in model.modules() if id(module) in regions
               for h in (module.register_forward_pre_hook(pre, with_kwargs=True),
                         module.register_forward_hook(post, always_call=True))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            step()
    finally:
        keep.clear()  # the step's tensors, then the hooks
        for h in handles:
            h.remove()
    expected = [(list(s["shape"]), s["dtype"]) for s in storages if not s.get("unsaved")]
    if first != expected:
        raise OffloadValueError(
            "offload: the step saved different tensors in two runs (profile and region pass), so the "
            "regions cannot be matched to the profile; plan with regions=None (names only), or make the step "
            "deterministic in what it saves")
    for k, rec in extra.items():
        if k not in order:
            order[k] = len(storages)
            storages.append(rec)
    return {
        "containers": {c: {"modules": qns, "members": _members(model, mapping, qns),
                           "instances": counts.get(c, 0)} for c, qns in containers.items()},
        "within": within,
        "inputs": {here: [order[k] for k in keys] for here, keys in inputs.items()},
        "other": {str(order[k]): [list(st) for st in sorted(stacks)] for k, stacks in other.items()},
    }


def _members(model: nn.Module, mapping: dict[str, str], qualnames: list[str]) -> list[str]:
    """The names of the mapped modules inside the modules ``qualnames``, in mapping order."""
    inside = {name for name, qn, _ in match_modules(model, mapping)
              if any(qn.startswith(q + ".") for q in qualnames)}
    return [n for n in mapping if n in inside]
