"""How user code marks offload groups: a context manager, module hooks, never-offload marks.

A group needs two things from the code it wraps:

* its extent in forward, to collect the tensors autograd saves inside it (the manager pushes
  its saved-tensor hooks while the group is open);
* a signal in backward when the group's backward is over, so the engine can reload the group
  that comes next without doubling the memory peak (Note [1]).

Without inputs (``with offload.group("x"):`` alone) a group still offloads and stays
correct, but nothing prefetches the group before it, which is then reloaded when backward
first needs it (not overlapped). `attach` passes the module's tensor arguments for you.

Note [1]: the backward signal adds no autograd node.
    A gradient hook on each of the group's inputs that require grad (`_BackwardSignal`) runs
    once that input's gradient is complete, just before its producer's backward: after the
    group's whole backward. When the hooks of all the inputs have run, the engine hears that
    the group's backward is over. An identity autograd function on the inputs would say the
    same, but as a node of its own it changes the order in which autograd sums the gradient of
    an input with three or more consumers (transformers' RMSNorm in fp32), and so the last bit
    of the gradients even with nothing offloaded.
    The hooks count per backward pass (graph task), so a second backward through a retained
    graph signals again. An input whose gradient is never computed (it does not reach the loss
    through differentiable ops) leaves its group without a signal: that group's successor is
    then reloaded on demand, correct but not overlapped. The hooks hold only a weak reference
    to the group; when the group is gone, a callback removes them, so a leaf input (whose hooks
    live on the tensor, not in the graph) does not collect them across iterations.

Note [2]: a checkpointed module signals when its backward starts.
    Under ``torch.utils.checkpoint`` a module's group holds only the inputs the checkpoint keeps,
    and its backward begins by recomputing the forward from all of them. Signalled at its end,
    the group's predecessor (the same name one layer earlier) would be reloaded just when its
    own recompute reads it, with nothing to overlap the copy. So where the module's hooks run
    outside the checkpoint (`_forward_is_checkpointed`), `attach` hooks the gradients of the
    module's outputs instead of its inputs: the predecessor's reload runs under this module's
    whole recompute and backward, for one more group of inputs held at a time.
"""

from __future__ import annotations

import difflib
import fnmatch
import re
import warnings
import weakref
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch import nn

from .config import check_int, check_str
from .errors import OffloadError, OffloadTypeError, OffloadValueError, UnknownModuleError
from .manager import PipelineOffloadManager


class _BackwardSignal:
    """Tells ``manager`` that ``group``'s backward is over once every input's gradient hook
    has run in a backward pass (Note [1])."""

    __slots__ = ("manager", "group_ref", "inputs", "pending", "graph_task")

    def __init__(self, manager: PipelineOffloadManager, group: Any, tensors: list[torch.Tensor]) -> None:
        self.manager = manager
        self.inputs = self.pending = len(tensors)
        self.graph_task = None
        handles = [t.register_hook(self.on_gradient) for t in tensors]
        self.group_ref = weakref.ref(group, lambda _, handles=handles: [h.remove() for h in handles])

    def on_gradient(self, grad: torch.Tensor | None) -> None:
        task = torch._C._current_graph_task_id()
        if task != self.graph_task:  # a new backward pass
            self.graph_task, self.pending = task, self.inputs
        self.pending -= 1
        if self.pending == 0:
            group = self.group_ref()
            if group is not None:
                self.manager.on_group_backward_done(group)


def _forward_is_checkpointed(module: nn.Module) -> bool:
    """Whether ``module``'s forward runs under ``torch.utils.checkpoint`` with the module's hooks
    outside it (Note [2]): a region the planner checkpoints (`offload.planner.apply`), or a
    transformers decoder layer with gradient checkpointing on (from transformers 5.23)."""
    if getattr(module.__dict__.get("forward"), "_offload_checkpointed", False):
        return True
    return bool(module.training and getattr(module, "gradient_checkpointing", False))


def _signal_backward_done(group: Any, tensors: Iterable[Any]) -> None:
    """Hook the tensors among ``tensors`` that require grad so that the end of ``group``'s
    backward reaches the engine (Note [1]); the tensors themselves are left as they are."""
    inputs = [t for t in tensors if isinstance(t, torch.Tensor) and t.requires_grad]
    if inputs:
        _BackwardSignal(PipelineOffloadManager.get(), group, inputs)


class group:
    """Offload what autograd saves inside this region under the group name ``name``.

    ``with offload.group("core_attn", q, k, v) as (q, k, v): out = attention(q, k, v)``

    Pass the region's input tensors: when their gradients are complete, the engine knows that
    the group's backward is over (Note [1]). They are returned unchanged, as the context value:
    ``None`` without inputs, the tensor for one input, else a tuple.
    If ``name`` is not in the config's ``modules`` or no graph is recorded (``no_grad``), the
    region runs exactly as without it. Opening a group inside a group of the same name raises.

    ``packed_views=True`` says that the region's backward gives the same bits for a packed copy
    of a saved view as for the view: a view with gaps (one half of a GLU's input) then comes back
    as its rows packed, with other strides, instead of spread over a new buffer of its span on
    the compute stream (Note [10] of offload.copy_queue). True of an activation's backward in
    torch's CUDA kernels, which compute each element alike whatever the strides; not of the
    CPU's SiLU, whose vectorized loop and scalar tail differ, nor of a kernel that reads a
    layout from strides (Transformer Engine's fused attention).
    """

    __slots__ = ("name", "tensors", "packed_views", "_group", "_manager")

    def __init__(self, name: str, *tensors: torch.Tensor, packed_views: bool = False) -> None:
        self.name = check_str(name, "a group name")
        self.tensors = tensors
        if not isinstance(packed_views, bool):
            raise OffloadTypeError(f"offload: group()'s packed_views must be a bool, got {packed_views!r}")
        self.packed_views = packed_views
        self._group = None
        self._manager = None

    def __enter__(self) -> Any:
        if not torch.compiler.is_compiling():  # traced by torch.compile: no group (docs/compile.md)
            _open_eagerly(self)
        tensors = self.tensors
        if not tensors:
            return None
        return tensors[0] if len(tensors) == 1 else tensors

    def __exit__(self, *exc: Any) -> None:
        if not torch.compiler.is_compiling():
            _close_eagerly(self)

    def _open(self) -> None:
        self._manager = manager = PipelineOffloadManager.get()
        self._group = g = manager.open_group(self.name, self.packed_views)
        if g is not None and self.tensors:
            _signal_backward_done(g, self.tensors)

    def _close(self) -> None:
        self._manager.close_group(self._group, self.name)
        self._group = None
        self.tensors = ()  # hold no activation past the region


# Run where Dynamo is active but not tracing (between compiled frames), the engine's code must
# not be traced either: under torch.compiler.disable it runs as plain Python.
_open_eagerly = torch.compiler.disable(group._open)
_close_eagerly = torch.compiler.disable(group._close)


class never_offload:
    """Within this region, nothing is offloaded (tensors are still saved normally). Traced by
    torch.compile it does nothing: compiled code offloads nothing anyway (docs/compile.md)."""

    def __enter__(self) -> None:
        if not torch.compiler.is_compiling():
            _never_offload_depth(+1)

    def __exit__(self, *exc: Any) -> None:
        if not torch.compiler.is_compiling():
            _never_offload_depth(-1)


@torch.compiler.disable
def _never_offload_depth(step: int) -> None:
    PipelineOffloadManager.get().policy.never_offload_depth += step


def mark_not_offload(*tensors: torch.Tensor) -> None:
    """Never offload these tensors' storages (any view of them) while they live."""
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            raise OffloadTypeError(f"offload: mark_not_offload takes tensors, got {type(t).__name__}")
    if not torch.compiler.is_compiling():  # traced tensors have no storage to mark
        _block_storages(tensors)


@torch.compiler.disable
def _block_storages(tensors: tuple[torch.Tensor, ...]) -> None:
    policy = PipelineOffloadManager.get().policy
    for t in tensors:
        policy.block_storage_of(t)


_attached: "weakref.WeakKeyDictionary[nn.Module, tuple[AttachHandle, str]]" = weakref.WeakKeyDictionary()
"""Every module an `attach` hooked (its root and its group modules): the handle, and what it is."""

_first_forward_pending: "weakref.WeakSet[AttachHandle]" = weakref.WeakSet()
"""Attached roots whose forward has not ended yet: once none is left, the names are checked."""


class AttachHandle:
    """Returned by `attach`; `remove()` takes every hook away again."""

    def __init__(self, matched: dict[str, list[str]]) -> None:
        self._hooks: list[Any] = []
        self.matched = matched

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        for module in [m for m, (handle, _) in _attached.items() if handle is self]:
            del _attached[module]
        _first_forward_pending.discard(self)


def _module_hooks(module: nn.Module, name: str) -> list[Any]:
    # One entry per invocation whose pre-hook ran: its region, or None where opening the
    # group raised. Torch calls the forward hook (always_call) after such an error too; it
    # must then close nothing, so that the error that stopped the forward surfaces alone.
    # Traced by torch.compile, both hooks do nothing (docs/compile.md).
    # (the region, whether its forward is checkpointed) per invocation.
    stack: list[tuple[group, bool] | None] = []

    @torch.compiler.disable
    def open_region(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        checkpointed = _forward_is_checkpointed(mod)  # signals from its outputs instead (Note [2])
        region = group(name) if checkpointed else group(name, *args, *kwargs.values())
        try:
            region._open()  # a failed open leaves nothing open (`open_group` undoes itself)
        except BaseException:
            stack.append(None)
            raise
        stack.append((region, checkpointed))

    @torch.compiler.disable
    def close_region(output: Any) -> None:
        if not stack:
            return  # an earlier pre-hook raised before ours ran: nothing was opened
        entry = stack.pop()
        if entry is None:
            return
        region, checkpointed = entry
        if checkpointed and region._group is not None:
            _signal_backward_done(region._group, torch.utils._pytree.tree_leaves(output))
        region._close()

    def pre(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.compiler.is_compiling():
            open_region(mod, args, kwargs)

    def post(mod: nn.Module, args: tuple, output: Any) -> None:
        if not torch.compiler.is_compiling():
            close_region(output)

    return [
        module.register_forward_pre_hook(pre, with_kwargs=True),
        module.register_forward_hook(post, always_call=True),
    ]


def attach(
    model: nn.Module,
    mapping: Mapping[str, str | Iterable[str]] | str | Sequence[str],
    chunk_id: int = 0,
    host_syncs: str | Iterable[str] = (),
) -> AttachHandle:
    """Make submodules of ``model`` offload groups, without editing the model's code.

    ``mapping`` maps a group name to one or more patterns over qualified module names
    (``fnmatch`` style, ``*`` matches across dots), e.g.
    ``{"core_attn": "layers.*.attn.core", "expert_fc1": "layers.*.mlp.experts.*.fc1"}``.
    For a Hugging Face ``transformers`` model it may be just the names (``"core_attn,mlp_act"``
    or a list): their patterns come from `offload.presets` (docs/hf.md).
    Each matched module's forward becomes a group (its tensor arguments get the backward
    marker). ``model``'s own forward starts a new chunk/microbatch handler (``chunk_id``).
    The model's parameters are registered as never-offload storages. ``host_syncs``: patterns of
    modules whose forward starts right after a host sync the model makes every layer (an MoE
    block's experts, after its router's ``.tolist()``); their forward pre-hook calls
    `offload.after_host_sync`, so that copies are issued after that sync, not queued before it
    (Note [9] of `offload.copy_queue`).

    Raises at once (docs/errors.md): `UnknownModuleError` when a pattern matches nothing,
    `OffloadError` when a module is matched twice, when a name's modules nest in each other
    (``"blocks.*"`` also matches every submodule of each block) or when ``model`` or a module of
    it is already attached; `OffloadTypeError` for arguments of the wrong type. A configured
    name that neither ``mapping`` nor any group in the code provides raises
    `UnknownModuleError` once the model's first forward is over (every attached model has run
    one), when the gradient reaches the model's output, and at each `end_iteration` until fixed;
    if it is close to an attached name, `attach` warns at once.
    """
    if not isinstance(model, nn.Module):
        raise OffloadTypeError(f"offload: attach() takes a torch.nn.Module, got {type(model).__name__}")
    if isinstance(mapping, (str, list, tuple)):  # offload names of a transformers model
        from . import presets

        try:
            presets.architecture_of(model)
        except OffloadError as exc:
            raise OffloadTypeError(
                "offload: attach()'s mapping must be a dict of group name -> module pattern(s), such as "
                f"{{'fc1': 'layers.*.mlp.fc1'}}; names alone ({mapping!r}) work for a transformers model "
                f"with a preset only: {exc}"
            ) from exc
        mapping = presets.mapping_for(model, mapping)
    if not isinstance(mapping, Mapping):
        raise OffloadTypeError(
            "offload: attach()'s mapping must be a dict of group name -> module pattern(s), such as "
            f"{{'fc1': 'layers.*.mlp.fc1'}}, or the names of a transformers model's preset; got {mapping!r}"[:300]
        )
    check_int(chunk_id, "attach()'s chunk_id (the model chunk: 0, or 0..vpp-1 in a pipeline)")
    _check_not_attached(model)
    qualnames = {qn: m for qn, m in model.named_modules() if qn}
    owner = _match(model, qualnames, mapping)
    syncs = _match_host_syncs(model, qualnames, host_syncs)
    matched = {name: sorted(qn for qn, n in owner.items() if n == name) for name in mapping}
    manager = PipelineOffloadManager.get()
    _warn_unattached(manager.config.modules, set(matched) | manager.declared_names)
    manager.declare_names(matched)
    manager.policy.block_parameters(model.parameters())

    handle = AttachHandle(matched)
    for qn, name in owner.items():
        handle._hooks.extend(_module_hooks(qualnames[qn], name))
        _attached[qualnames[qn]] = (handle, f"as a module of group {name!r}")
    for qn in syncs:
        handle._hooks.append(qualnames[qn].register_forward_pre_hook(_after_host_sync, prepend=True))
    _attached[model] = (handle, f"with the groups {', '.join(matched) or '(none)'}")
    _first_forward_pending.add(handle)

    @torch.compiler.disable
    def begin_chunk() -> None:
        manager = PipelineOffloadManager.get()
        if not manager.in_group:  # called inside a group: part of the enclosing chunk
            manager.begin_chunk(chunk_id)

    @torch.compiler.disable
    def forward_done(output: Any) -> None:
        _first_forward_pending.discard(handle)
        manager = PipelineOffloadManager.get()
        manager.model_forward_returned()
        if _first_forward_pending or manager.in_group or manager.captures.in_region:
            return
        try:
            manager._check_names()
        except UnknownModuleError:
            _check_names_at_backward(output)

    def begin(mod: nn.Module, args: tuple) -> None:
        if not torch.compiler.is_compiling():
            begin_chunk()

    def end(mod: nn.Module, args: tuple, output: Any) -> None:
        if not torch.compiler.is_compiling():
            forward_done(output)

    handle._hooks.append(model.register_forward_pre_hook(begin))
    handle._hooks.append(model.register_forward_hook(end))
    return handle


def _check_names_at_backward(output: Any) -> None:
    """A configured name is unknown when the model's forward ends: groups that the code opens
    after the model (a loss head) may still declare it, so check again when the gradient
    reaches the model's output, before any of the model's backward and the optimizer step."""
    tensors = [t for t in torch.utils._pytree.tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
    checked: list[bool] = []

    def check(grad: torch.Tensor) -> None:
        if not checked:
            checked.append(True)
            PipelineOffloadManager.get()._check_names()  # raises out of backward: docs/errors.md

    for t in tensors:
        t.register_hook(check)


def _match(model: nn.Module, qualnames: dict[str, nn.Module],
           mapping: Mapping[str, str | Iterable[str]]) -> dict[str, str]:
    """Qualified module name -> its group name, for every module the patterns match."""
    owner: dict[str, str] = {}
    for name, patterns in mapping.items():
        check_str(name, "a group name (a key of the mapping given to attach())")
        if isinstance(patterns, (str, bytes)) or not isinstance(patterns, Iterable):
            patterns = [patterns]  # one pattern (anything but a string is refused below)
        hits: dict[str, str] = {}  # module -> the pattern that matched it
        for pattern in patterns:
            check_str(pattern, f"a module pattern of group {name!r} in attach() (fnmatch over module names)")
            found = _matching(model, qualnames, pattern, f"for group {name!r}")
            hits.update((qn, pattern) for qn in found if qn not in hits)
        _check_not_nested(name, hits)
        for qn in hits:
            if qn in owner and owner[qn] != name:
                raise OffloadError(
                    f"offload: module {qn!r} is matched by both {owner[qn]!r} and {name!r}"
                )
            owner[qn] = name
    return owner


def _matching(model: nn.Module, qualnames: dict[str, nn.Module], pattern: str, what: str) -> list[str]:
    """The qualified names ``pattern`` matches; `UnknownModuleError` (with close paths) if none."""
    found = [qn for qn in qualnames if fnmatch.fnmatchcase(qn, pattern)]
    if not found:
        close = difflib.get_close_matches(pattern, list(qualnames), n=3)
        hint = f"; close module paths: {', '.join(close)}" if close else ""
        raise UnknownModuleError(f"offload: pattern {pattern!r} {what} matches no submodule of "
                                 f"{type(model).__name__}{hint}")
    return found


def _match_host_syncs(model: nn.Module, qualnames: dict[str, nn.Module], host_syncs: str | Iterable[str]) -> list[str]:
    """The modules ``host_syncs`` matches (attach()'s argument: a pattern or several)."""
    if isinstance(host_syncs, str) or not isinstance(host_syncs, Iterable):
        host_syncs = [host_syncs]  # type: ignore[list-item]
    found: dict[str, None] = {}
    for pattern in host_syncs:
        check_str(pattern, "a module pattern of attach()'s host_syncs (fnmatch over module names)")
        found.update(dict.fromkeys(_matching(model, qualnames, pattern, "in host_syncs")))
    return list(found)


def _after_host_sync(module: nn.Module, args: tuple) -> None:
    """A ``host_syncs`` module's forward starts: the model has just synced with the host.
    Traced by torch.compile, it does nothing (as the groups' hooks)."""
    if not torch.compiler.is_compiling():
        _report_host_sync()


@torch.compiler.disable
def _report_host_sync() -> None:
    PipelineOffloadManager.get().after_host_sync()


def _check_not_nested(name: str, hits: dict[str, str]) -> None:
    """Refuse a group whose matched modules (``hits``: module -> pattern) contain each other:
    its group would open inside itself in forward."""
    inner = {qn: outer for qn in hits for outer in _ancestors(qn) if outer in hits}
    if not inner:
        return
    qn, outer = next(iter(inner.items()))
    by = (f"pattern {hits[outer]!r} of group {name!r} matches" if hits[qn] == hits[outer]
          else f"patterns {hits[outer]!r} and {hits[qn]!r} of group {name!r} match")
    tops = [m for m in hits if m not in inner]
    raise OffloadValueError(
        f"offload: attach(): {by} {outer!r} and its submodule {qn!r} "
        f"({len(inner)} matched modules lie inside other matched ones), so group {name!r} would open "
        "inside itself. fnmatch's '*' matches '.' too: match only the outer modules, e.g. with "
        f"{_outer_patterns(tops)}"
    )


def exact_pattern(qualname: str) -> str:
    """The `attach` pattern that matches the module ``qualname`` alone (fnmatch's ``*``, ``?``
    and ``[`` escaped)."""
    return re.sub(r"([*?\[])", r"[\1]", qualname)


def _ancestors(qn: str) -> Iterable[str]:
    parts = qn.split(".")
    return (".".join(parts[:i]) for i in range(1, len(parts)))


def _outer_patterns(tops: list[str]) -> list[str]:
    """Patterns that match the modules ``tops`` and none of their submodules."""
    parents = {qn.rpartition(".")[0] for qn in tops}
    if len(parents) == 1 and all(qn.rpartition(".")[2].isdigit() for qn in tops):
        prefix = parents.pop()
        prefix = f"{prefix}." if prefix else ""
        return [prefix + "[0-9]" * width for width in sorted({len(qn.rpartition(".")[2]) for qn in tops})]
    return sorted(tops)


def _check_not_attached(model: nn.Module) -> None:
    """Refuse a model that an earlier `attach` hooked, or that holds or lies in one that was."""
    for qn, module in model.named_modules():
        if module in _attached:
            what = _attached[module][1]
            where = f"{type(model).__name__}" if not qn else f"its submodule {qn!r}"
            raise OffloadError(
                f"offload: attach(): {where} is already attached ({what}, by an earlier attach()); "
                "call remove() on the handle that attach() returned first, or attach once with one mapping"
            )


def _warn_unattached(modules: Iterable[str], known: set[str]) -> None:
    """Warn at once of a configured name that is not attached but close to one that is (a
    typo, unless a group in the code opens it: the first backward tells)."""
    for name in modules:
        close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8) if name not in known else []
        if close:
            warnings.warn(
                f"offload: configured name {name!r} is not attached (did you mean {close[0]!r}?); unless a "
                f"group in the code opens {name!r}, the model's first backward raises UnknownModuleError",
                RuntimeWarning, stacklevel=3,
            )
