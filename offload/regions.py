"""How user code marks offload groups: a context manager, module hooks, never-offload marks.

A group needs two things from the code it wraps:

* its extent in forward, to collect the tensors autograd saves inside it (the manager pushes
  its saved-tensor hooks while the group is open);
* a signal in backward when the group's backward is over, so the engine can reload the group
  that comes next without doubling the memory peak. That signal is an identity autograd
  function applied to the group's inputs (`_GroupStart`): its backward runs once the
  gradients of all those inputs exist, i.e. after the group's whole backward.

Without inputs (``with offload.group("x"):`` alone) a group still offloads and stays
correct, but nothing prefetches the group before it, which is then reloaded when backward
first needs it (not overlapped). `attach` passes the module's tensor arguments for you.
"""

from __future__ import annotations

import fnmatch
import difflib
from typing import Any, Iterable, Mapping

import torch
from torch import nn

from .config import check_str
from .errors import OffloadError, UnknownModuleError
from .manager import PipelineOffloadManager


class _GroupStart(torch.autograd.Function):
    """Identity on the group's inputs; its backward marks the end of the group's backward."""

    @staticmethod
    def forward(ctx: Any, manager: PipelineOffloadManager, group: Any, *tensors: torch.Tensor) -> Any:
        ctx.manager = manager
        ctx.group = group
        return tensors if len(tensors) > 1 else tensors[0]

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> Any:
        ctx.manager.on_group_backward_done(ctx.group)
        return (None, None, *grads)


def _mark_inputs(group: Any, tensors: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    """Apply the start marker to the tensors that require grad; others pass unchanged."""
    idx = [i for i, t in enumerate(tensors) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not idx:
        return tensors
    marked = _GroupStart.apply(PipelineOffloadManager.get(), group, *(tensors[i] for i in idx))
    if len(idx) == 1:
        marked = (marked,)
    out = list(tensors)
    for i, t in zip(idx, marked):
        out[i] = t
    return tuple(out)


class group:
    """Offload what autograd saves inside this region under the group name ``name``.

    ``with offload.group("core_attn", q, k, v) as (q, k, v): out = attention(q, k, v)``

    Pass the region's input tensors and use the returned ones inside the region: their
    backward tells the engine that the group's backward is over (see the module docstring).
    The context value is ``None`` without inputs, the tensor for one input, else a tuple.
    If ``name`` is not in the config's ``modules`` or no graph is recorded (``no_grad``), the
    region runs exactly as without it. Opening a group inside a group of the same name raises.
    """

    __slots__ = ("name", "tensors", "_group", "_manager")

    def __init__(self, name: str, *tensors: torch.Tensor) -> None:
        self.name = check_str(name, "a group name")
        self.tensors = tensors
        self._group = None
        self._manager = None

    def __enter__(self) -> Any:
        self._manager = manager = PipelineOffloadManager.get()
        self._group = g = manager.open_group(self.name)
        tensors = self.tensors
        if g is not None and tensors:
            tensors = _mark_inputs(g, tensors)
        if not tensors:
            return None
        return tensors[0] if len(tensors) == 1 else tensors

    def __exit__(self, *exc: Any) -> None:
        self._manager.close_group(self._group, self.name)
        self._group = None
        self.tensors = ()  # hold no activation past the region


class never_offload:
    """Within this region, nothing is offloaded (tensors are still saved normally)."""

    def __enter__(self) -> None:
        PipelineOffloadManager.get().policy.never_offload_depth += 1

    def __exit__(self, *exc: Any) -> None:
        PipelineOffloadManager.get().policy.never_offload_depth -= 1


def mark_not_offload(*tensors: torch.Tensor) -> None:
    """Never offload these tensors' storages (any view of them) while they live."""
    policy = PipelineOffloadManager.get().policy
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"offload: mark_not_offload takes tensors, got {type(t).__name__}")
        policy.block_storage_of(t)


class AttachHandle:
    """Returned by `attach`; `remove()` takes every hook away again."""

    def __init__(self, hooks: list[Any], matched: dict[str, list[str]]) -> None:
        self._hooks = hooks
        self.matched = matched

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def _module_hooks(module: nn.Module, name: str) -> list[Any]:
    # One entry per invocation whose pre-hook ran: its region, or None where opening the
    # group raised. Torch calls the forward hook (always_call) after such an error too; it
    # must then close nothing, so that the error that stopped the forward surfaces alone.
    stack: list[group | None] = []

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        region = group(name)
        try:
            region.__enter__()  # a failed open leaves nothing open (`open_group` undoes itself)
        except BaseException:
            stack.append(None)
            raise
        stack.append(region)
        g = region._group
        if g is None:
            return args, kwargs
        keys = [k for k, v in kwargs.items() if isinstance(v, torch.Tensor) and v.requires_grad]
        flat = (*args, *(kwargs[k] for k in keys))
        marked = _mark_inputs(g, flat)
        new_kwargs = dict(kwargs)
        for k, t in zip(keys, marked[len(args):]):
            new_kwargs[k] = t
        return marked[: len(args)], new_kwargs

    def post(mod: nn.Module, args: tuple, output: Any) -> None:
        if not stack:
            return  # an earlier pre-hook raised before ours ran: nothing was opened
        region = stack.pop()
        if region is not None:
            region.__exit__(None, None, None)

    return [
        module.register_forward_pre_hook(pre, with_kwargs=True),
        module.register_forward_hook(post, always_call=True),
    ]


def attach(
    model: nn.Module,
    mapping: Mapping[str, str | Iterable[str]],
    chunk_id: int = 0,
) -> AttachHandle:
    """Make submodules of ``model`` offload groups, without editing the model's code.

    ``mapping`` maps a group name to one or more patterns over qualified module names
    (``fnmatch`` style, ``*`` matches across dots), e.g.
    ``{"core_attn": "layers.*.attn.core", "expert_fc1": "layers.*.mlp.experts.*.fc1"}``.
    Each matched module's forward becomes a group (its tensor arguments get the backward
    marker). ``model``'s own forward starts a new chunk/microbatch handler (``chunk_id``).
    The model's parameters are registered as never-offload storages.

    Raises `UnknownModuleError` when a pattern matches nothing, `OffloadError` when a module is
    matched twice. A configured name that neither ``mapping`` nor any group in the code provides
    raises `UnknownModuleError` at the end of the first iteration (when every chunk has run).
    """
    manager = PipelineOffloadManager.get()
    qualnames = {qn: m for qn, m in model.named_modules() if qn}
    owner: dict[str, str] = {}
    matched: dict[str, list[str]] = {}
    for name, patterns in mapping.items():
        check_str(name, "a group name (a key of the mapping given to attach())")
        if isinstance(patterns, (str, bytes)) or not isinstance(patterns, Iterable):
            patterns = [patterns]  # one pattern (anything but a string is refused below)
        else:
            patterns = list(patterns)
        hits: list[str] = []
        for pattern in patterns:
            check_str(pattern, f"a module pattern of group {name!r} in attach() (fnmatch over module names)")
            found = [qn for qn in qualnames if fnmatch.fnmatchcase(qn, pattern)]
            if not found:
                close = difflib.get_close_matches(pattern, list(qualnames), n=3)
                hint = f"; close module paths: {', '.join(close)}" if close else ""
                raise UnknownModuleError(
                    f"offload: pattern {pattern!r} for group {name!r} matches no submodule of "
                    f"{type(model).__name__}{hint}"
                )
            hits.extend(found)
        for qn in hits:
            if qn in owner and owner[qn] != name:
                raise OffloadError(
                    f"offload: module {qn!r} is matched by both {owner[qn]!r} and {name!r}"
                )
            owner[qn] = name
        matched[name] = sorted(set(hits))
    manager.declare_names(matched)
    manager.policy.block_parameters(model.parameters())

    hooks: list[Any] = []
    for qn, name in owner.items():
        hooks.extend(_module_hooks(qualnames[qn], name))

    def begin(mod: nn.Module, args: tuple) -> None:
        manager = PipelineOffloadManager.get()
        if not manager.in_group:  # called inside a group: part of the enclosing chunk
            manager.begin_chunk(chunk_id)

    hooks.append(model.register_forward_pre_hook(begin))
    return AttachHandle(hooks, matched)
