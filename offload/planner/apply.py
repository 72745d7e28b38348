"""A plan on a model: its regions run under `torch.utils.checkpoint`, its groups are offloaded.

Checkpointing patches the forward of each region's module instance: the module's own forward
runs inside non-reentrant `torch.utils.checkpoint` (what `offload.testing.Recomputed` does with
a wrapper module). The module, its parameters' names and its state dict stay as they are, and its
hooks run outside the checkpoint, so an offload group on a checkpointed module is open while the
checkpoint saves the module's inputs: offloading them is the "memory-free" layer. Recompute runs
the same forward with the same random state (``preserve_rng_state``), so gradients are bitwise
those of the model without it. The offloaded groups go through `offload.configure` and
`offload.attach`, as a user would call them.

A region whose plan keeps some names inside it (``selective``) is checkpointed with a
selective-checkpoint policy by module (`SavedModules`): the ops those modules run have their
outputs saved by the checkpoint and given back to its recompute instead of run again.
"""

from __future__ import annotations

import fnmatch
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..errors import OffloadValueError


def checkpoint_modules(model: nn.Module, qualnames: list[str],
                       context_fn: Callable[[], Any] | None = None) -> Callable[[], None]:
    """Run the forward of each module ``qualnames`` names under non-reentrant checkpointing
    (with ``context_fn``, a selective-checkpoint policy: `create_selective_checkpoint_contexts`);
    returns the function that undoes it."""
    undo = []
    for qn in qualnames:
        module = model.get_submodule(qn)
        if "forward" in module.__dict__ and getattr(module.__dict__["forward"], "_offload_checkpointed", False):
            raise OffloadValueError(f"offload: module {qn!r} is checkpointed already")
        undo.append((module, module.__dict__.get("forward")))
        module.forward = _checkpointed(module, context_fn)

    def restore() -> None:
        for module, before in reversed(undo):
            if before is None:
                del module.__dict__["forward"]
            else:
                module.forward = before
        undo.clear()

    return restore


def _checkpointed(module: nn.Module, context_fn: Callable[[], Any] | None) -> Callable[..., Any]:
    """``module``'s forward under checkpointing. It refers to ``module`` weakly: stored on the
    module, a strong reference would make a cycle that keeps the module (and what it holds on
    the GPU) alive after its last user lets it go, until the garbage collector runs.

    Every tensor among the arguments, keyword or nested ones included, reaches the checkpoint
    as a positional argument: non-reentrant checkpointing saves only its positional tensors
    (saved tensors, which the engine can offload) and takes the devices whose random state it
    restores from them; keyword tensors (megatron-core calls its layers with keywords only)
    would be held by a reference instead, out of the engine's reach, and a layer called with
    keywords alone would get its CUDA random state not restored in the recompute."""
    extra = {} if context_fn is None else {"context_fn": context_fn}
    own = module.__dict__.get("forward")  # a forward set on the instance (it holds the module itself)
    module_ref = weakref.ref(module)

    def run(*args: Any, **kwargs: Any) -> Any:
        forward = own if own is not None else type(module_ref()).forward.__get__(module_ref())
        leaves, spec = tree_flatten((args, kwargs))
        at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        template = [None if isinstance(x, torch.Tensor) else x for x in leaves]  # no reference to the tensors

        def call(*tensors: torch.Tensor) -> Any:
            filled = list(template)
            for i, t in zip(at, tensors):
                filled[i] = t
            a, kw = tree_unflatten(filled, spec)
            return forward(*a, **kw)

        return checkpoint(call, *(leaves[i] for i in at), use_reentrant=False, **extra)

    run._offload_checkpointed = True  # type: ignore[attr-defined]
    return run


class SavedModules:
    """Selective checkpointing by module: inside a checkpointed region, an op that runs within
    one of ``modules`` has its outputs saved (`CheckpointPolicy.MUST_SAVE`), every other op is
    recomputed. Views and in-place ops are recomputed everywhere: they cost nothing to run
    again, and a saved view would keep its base (perhaps the output of a module that is
    recomputed) alive. Forward hooks on the modules say which op runs where, in the forward and
    in the recompute alike (the recompute calls the same modules); `context` is the
    checkpoint's ``context_fn``."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.depth = 0  # how many of the modules are running now (they may be nested)
        self._aliases: dict[Any, bool] = {}  # op -> whether it returns a view or its input
        self._handles = [h for m in modules for h in (m.register_forward_pre_hook(self._enter),
                                                       m.register_forward_hook(self._leave, always_call=True))]

    def _enter(self, module: nn.Module, args: tuple) -> None:
        self.depth += 1

    def _leave(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.depth -= 1

    def policy(self, ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        if not self.depth:
            return CheckpointPolicy.PREFER_RECOMPUTE
        aliases = self._aliases.get(op)
        if aliases is None:
            aliases = self._aliases[op] = any(r.alias_info is not None for r in op._schema.returns)
        return CheckpointPolicy.PREFER_RECOMPUTE if aliases else CheckpointPolicy.MUST_SAVE

    def context(self) -> tuple[Any, Any]:
        return create_selective_checkpoint_contexts(self.policy)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()


def matching(model: nn.Module, pattern: str | list[str]) -> list[str]:
    """The qualified names of the modules a pattern (or list of them) matches, outermost only."""
    patterns = [pattern] if isinstance(pattern, str) else list(pattern)
    hits = [qn for qn, _ in model.named_modules() if qn and any(fnmatch.fnmatchcase(qn, p) for p in patterns)]
    return [qn for qn in hits if not any(qn.startswith(h + ".") for h in hits)]


def region_modules(model: nn.Module, mapping: dict[str, str], containers: dict[str, list[str]]) -> dict[str, list[str]]:
    """Every name of ``mapping`` and container of ``containers`` -> its modules' qualified names."""
    return {**{n: matching(model, p) for n, p in mapping.items()}, **containers}


def checkpoint_regions(model: nn.Module, where: dict[str, list[str]], checkpoint: tuple[str, ...],
                       selective: tuple[str, ...] = ()) -> Callable[[], None]:
    """Checkpoint the regions ``checkpoint`` (``where``: a name or container -> its modules'
    qualified names), those holding names of ``selective`` with `SavedModules` on those names'
    modules; returns the function that undoes it."""
    kept = [qn for n in selective for qn in where[n]]
    saved = SavedModules([model.get_submodule(qn) for qn in kept]) if kept else None
    undo = []

    def restore() -> None:
        for u in reversed(undo):
            u()
        undo.clear()
        if saved is not None:
            saved.remove()

    try:
        for region in checkpoint:
            for qn in where[region]:
                selective_here = saved is not None and any(k.startswith(qn + ".") for k in kept)
                undo.append(checkpoint_modules(model, [qn], saved.context if selective_here else None))
    except BaseException:
        restore()
        raise
    return restore


class Applied:
    """``checkpoint`` (names of ``mapping`` or ``containers``) checkpointed, keeping the names
    ``selective`` inside them, and ``offload`` offloaded on ``model``, with the engine configured
    by ``engine`` (`offload.configure`'s keyword arguments); `remove` takes all of it away and
    leaves an engine that offloads nothing."""

    def __init__(self, model: nn.Module, mapping: dict[str, str], containers: dict[str, list[str]],
                 checkpoint: tuple[str, ...], offload: tuple[str, ...], max_inflight_groups: int,
                 engine: dict[str, Any], selective: tuple[str, ...] = ()) -> None:
        import offload as api

        self.engine = engine
        where = region_modules(model, mapping, containers)
        self._restore = checkpoint_regions(model, where, checkpoint, selective)
        self.handle = None
        try:
            api.configure(list(offload), max_inflight_groups=max_inflight_groups, **engine)
            if offload:
                self.handle = api.attach(model, {g: mapping.get(g, where[g]) for g in offload})
        except BaseException:
            self._restore()
            raise

    def remove(self) -> None:
        import offload as api

        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        self._restore()
        api.configure((), device=self.engine.get("device"))
