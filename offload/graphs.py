"""Offloading inside CUDA graphs: captured mode, graph regions, and graphed callables.

A CUDA graph replays the kernels and copies recorded during its capture, at the addresses
recorded then, and runs no Python. So the engine does its work during the capture and the
graph repeats it: the hooks run while a region is captured, its device-to-host copies, the
side-stream forks and joins and the events go into the graph, and every replay copies that
replay's activations into the same pinned buffers (and its backward graph copies them back).

What this needs, and what this module provides:

* **A plan frozen in eager warm-up.** A graphable *region* (`region`) runs eagerly first; the
  groups it offloads and the bytes each saves become its plan, and the pinned buffers they
  used stay in the pool. Under capture the same groups must come (else `OffloadError`: the
  shape or group structure changed), and every buffer must come from the pool (a pinned
  allocation during capture raises `OffloadError`).
* **Copies that run under the next graph.** A capture must join what it forked before it ends,
  so a region's capture joins only the copies it issued and carries the groups it has not
  copied yet to the next capture: a forward region copies them under its compute and frees
  them at its end; a backward keeps them (the last-layer rule). A graphed callable's backward
  graph reloads its groups at its start and joins the reloads at its end, through identity
  autograd nodes on the callable's outputs and inputs. An event recorded in one capture is
  never waited on in another: graphs that share a pool replay in capture order. (Notes [C1]
  and [C2] of `offload.capture`.)
* **Copies issued after a replay.** The callables `make_graphed_callables` returns tell the
  engine when their graph replayed, and then the copies carried out of that graph are issued
  eagerly after it, so they also run under eager work between graphs (Note [C3]).
* **No garbage collected inside a capture.** A CUDA graph destroyed during another capture
  invalidates it, and dead graphs wait in reference cycles for the collector, which PyTorch
  no longer runs before capturing: `graph` and `make_graphed_callables` collect first and keep
  the collector off until their captures end (`offload.streams.no_collection_during_capture`).
* **Buffers owned by graphs.** A captured group's pinned buffers never return to the pool
  (every replay writes them); `CaptureSessions.release_graphs` gives them back once the
  graphs are gone.

Entry points: `graph` (``torch.cuda.graph`` whose body is a region), `make_graphed_callables`
(torch's, or Transformer Engine's through ``graph_api=``, over callables that become regions,
after an eager pass in capture order that sizes the pinned pool), `region` and `join` for
other capture code. Tensors saved by eager code between graphs are offloaded eagerly, as
anywhere else (boundary mode). What `torch.compile`d code saves is not offloaded (the engine
steps aside while Dynamo traces); eager code around it is (docs/compile.md).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
import inspect
import itertools
from typing import Any, Callable, Iterator, Sequence

import torch

from .errors import OffloadError
from .manager import PipelineOffloadManager
from .streams import no_collection_during_capture

__all__ = ["region", "join", "graph", "make_graphed_callables"]

_region_ids = itertools.count()


@contextlib.contextmanager
def region(key: Any) -> Iterator[None]:
    """A graphable region named ``key``: run eagerly, it records its plan (the groups it
    offloads and their sizes); under capture, it checks the capture against that plan and, at
    its end, joins the copies it issued into the capturing stream (so the capture can end) and
    carries the groups it has not copied yet to the next capture (Note [C1] of
    `offload.capture`)."""
    manager = PipelineOffloadManager.get()
    manager.captures.enter_region(key)
    try:
        yield
    finally:
        manager.captures.exit_region(key)


def join() -> None:
    """Join the offload and reload copies of the capture in progress into the current stream.

    Call it as the last step inside a ``torch.cuda.graph`` capture that offloads without
    `region`/`graph`; outside a capture it does nothing."""
    PipelineOffloadManager.get().captures.join()


@contextlib.contextmanager
def graph(cuda_graph: torch.cuda.CUDAGraph, key: Any = "graph", **graph_kwargs: Any) -> Iterator[None]:
    """``torch.cuda.graph(cuda_graph, **graph_kwargs)`` whose body is the region ``key``.

    Run the same body eagerly inside ``offload.graphs.region(key)`` at least once before (the
    warm-up that PyTorch asks for anyway); this synchronizes the device before capturing, as
    a capture must not depend on eager copies still in flight, and collects Python's garbage,
    keeping the collector off during the capture (a dead graph destroyed inside it would
    invalidate it)."""
    torch.cuda.synchronize()
    with no_collection_during_capture(), torch.cuda.graph(cuda_graph, **graph_kwargs):
        with region(key):
            yield


class _RegionEdge(torch.autograd.Function):
    """Identity on the tensors crossing a graphed callable's edge; its backward tells the
    engine that the callable's backward reached that edge (Note [C2] of `offload.capture`):
    on the outputs, that it begins; on the inputs, that it ends."""

    @staticmethod
    def forward(ctx: Any, on_backward: Callable[[], None], *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.on_backward = on_backward
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.on_backward()
        return (None, *grads)


def _through_edge(values: Any, on_backward: Callable[[], None]) -> Any:
    """``values`` (any pytree) with its tensors that need a gradient passed through `_RegionEdge`."""
    leaves, spec = torch.utils._pytree.tree_flatten(values)
    at = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.requires_grad]
    if not at or not torch.is_grad_enabled():
        return values
    for i, t in zip(at, _RegionEdge.apply(on_backward, *(leaves[i] for i in at))):
        leaves[i] = t
    return torch.utils._pytree.tree_unflatten(leaves, spec)


def _run_region(fn: Callable, key: Any, args: tuple, kwargs: dict[str, Any]) -> Any:
    """``fn(*args, **kwargs)`` as the region ``key``, with edges that let its backward graph
    reload before it needs the data and join its reloads before it ends (Note [C2])."""
    manager = PipelineOffloadManager.get()
    if manager.suspended:  # a graph API's own warm-up, after ours (`_capture`)
        return fn(*args, **kwargs)
    captures = manager.captures
    args, kwargs = _through_edge((args, kwargs), lambda: captures.join_backward(key))
    captures.enter_region(key)
    try:
        outputs = fn(*args, **kwargs)
    finally:
        handler = captures.exit_region(key)
    return _through_edge(outputs, lambda: captures.prefetch_region(handler, key))


class _RegionModule(torch.nn.Module):
    """A module whose forward is a region; what `make_graphed_callables` graphs. With several
    ``keys``, its calls take them in turn: the k-th forward pass of one callable (its k-th
    microbatch, in Transformer Engine's ``_order``) is a region of its own."""

    def __init__(self, module: torch.nn.Module, keys: Sequence[Any]) -> None:
        super().__init__()
        self.module = module
        self._keys = itertools.cycle(keys)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return _run_region(self.module, next(self._keys), args, kwargs)


def _pass_key(key: Any, microbatch: int, passes: int) -> Any:
    """The region of a callable's run for ``microbatch`` (of ``passes`` per iteration)."""
    return key if passes == 1 else (key, microbatch)


def _as_region(fn: Callable, key: Any, passes: int = 1) -> Callable:
    """``fn`` as a region named ``key`` (with ``passes`` > 1: the regions ``(key, 0)``,
    ``(key, 1)``, ... for its successive calls, in turn)."""
    keys = [_pass_key(key, k, passes) for k in range(passes)]
    if isinstance(fn, torch.nn.Module):
        return _RegionModule(fn, keys)
    turns = itertools.cycle(keys)

    def run(*args: Any, **kwargs: Any) -> Any:
        return _run_region(fn, next(turns), args, kwargs)

    return run


def _forward_passes(order: Sequence[float], callables: int, samples: int,
                   layers_per_chunk: Sequence[int] | int | None = None) -> tuple[list[int], int]:
    """Transformer Engine's ``_order`` (1-based model chunks, ``+c`` a forward of chunk c, ``-c``
    its backward; a fractional entry is a weight-gradient pass) read as forward passes: the
    index into ``callables`` of each forward pass, in the order of ``sample_args`` (chunk by
    chunk, microbatch by microbatch, layer by layer, as TE lays them out), and the number of
    microbatches. Raises `OffloadError` where the counts do not add up."""
    forwards = [int(c) for c in order if c > 0 and int(c) == c]
    backwards = [c for c in order if c < 0 and int(c) == c]
    chunks = max(forwards, default=0)
    if not chunks or len(forwards) != len(backwards) or len(forwards) % chunks:
        raise OffloadError(f"offload: _order {list(order)} is not a forward and a backward of each "
                           "model chunk per microbatch")
    microbatches = len(forwards) // chunks
    if layers_per_chunk is None:
        layers_per_chunk = callables // chunks
    if isinstance(layers_per_chunk, int):
        layers_per_chunk = [layers_per_chunk] * chunks
    if len(layers_per_chunk) != chunks or sum(layers_per_chunk) != callables \
            or callables * microbatches != samples:
        raise OffloadError(
            f"offload: _order has {chunks} model chunk(s) and {microbatches} microbatch(es): "
            f"{callables} callables in chunks of {list(layers_per_chunk)} layers need "
            f"{callables * microbatches} sample_args tuples (got {samples})")
    first = list(itertools.accumulate([0, *layers_per_chunk]))
    passes = [first[c] + layer for c in range(chunks) for _ in range(microbatches)
              for layer in range(layers_per_chunk[c])]
    return passes, microbatches


def _prepare(callables: Sequence[Callable], sample_args: Sequence[tuple], sample_kwargs: Sequence[dict],
             iterations: int) -> None:
    """The warm-up, ours rather than the graph API's: ``iterations`` eager passes over the
    forward passes (every forward, then every backward in reverse) on a side stream, as
    torch's own warm-up does. Each region records its plan, the pinned pool ends up holding a
    buffer for every group all the captures offload, and every handler is retired before the
    first capture."""
    manager = PipelineOffloadManager.get()
    torch.cuda.synchronize()
    with torch.cuda.stream(torch.cuda.Stream()):
        for _ in range(max(1, iterations)):
            runs = []
            for fn, args, kwargs in zip(callables, sample_args, sample_kwargs):
                outputs = tuple(o for o in torch.utils._pytree.tree_leaves(fn(*args, **kwargs))
                                if isinstance(o, torch.Tensor) and o.requires_grad)
                surface = tuple(a for a in torch.utils._pytree.tree_leaves((args, kwargs))
                                if isinstance(a, torch.Tensor) and a.requires_grad)
                if isinstance(fn, torch.nn.Module):
                    surface += tuple(p for p in fn.parameters() if p.requires_grad)
                runs.append((outputs, surface))
            manager.finish_forward()
            for outputs, surface in reversed(runs):
                if outputs and surface:
                    torch.autograd.grad(outputs, surface, tuple(torch.zeros_like(o) for o in outputs),
                                        allow_unused=True)
            del runs
    torch.cuda.synchronize()
    manager.end_iteration(check_names=False)  # names that only run outside the graphs come later


def make_graphed_callables(
    callables: Callable | Sequence[Callable],
    sample_args: tuple | Sequence[tuple],
    *,
    graph_api: Callable | None = None,
    **graph_kwargs: Any,
) -> Any:
    """``torch.cuda.make_graphed_callables`` with offloading captured in the graphs.

    Each callable becomes a region whose carried groups are copied out after each replay of its
    forward graph and whose first reloads are issued after the backward replay of the graph
    captured before it (Notes [C3], [C4] of `offload.capture`); ``num_warmup_iters``
    eager passes (our warm-up; the API runs one of its own) record the regions' plans and size
    the pinned pool; then ``graph_api`` (default ``torch.cuda.make_graphed_callables``; pass
    ``transformer_engine.pytorch.make_graphed_callables`` for TE) captures them, with
    ``graph_kwargs`` passed through (TE's ``sample_kwargs``, one dict per ``sample_args`` tuple,
    go to our warm-up too). With TE's ``_order`` (per-microbatch graphs in pipeline order, as
    Megatron builds them), each callable's run for each microbatch is a region of its own
    (`_forward_passes`); the captures then follow ``_order``, and so must the replays.
    Where the API takes a ``pre_warmup_hook`` (TE's), our warm-up runs in it, so under the
    autocast TE wraps the callables in (FP8 saves other tensors than bf16 does). Returns what
    ``graph_api`` returns, for the wrapped callables (call those, not the originals), each
    also reporting its replays: the copies the next graph would carry are issued eagerly
    after them (Note [C3]). Python's garbage is collected before the API's captures and the
    collector stays off while they run (a dead graph destroyed inside a capture invalidates
    it). Modules must not carry hooks of their own at the top (PyTorch refuses them); groups
    attached to submodules are what offloading uses.
    """
    single = callable(callables) and not isinstance(callables, (tuple, list))
    fns = (callables,) if single else tuple(callables)
    args = (sample_args,) if single else tuple(sample_args)
    order = graph_kwargs.get("_order")
    if order is None:
        if len(fns) != len(args):
            raise OffloadError(f"offload: {len(fns)} callables but {len(args)} sample_args tuples")
        passes, microbatches = list(range(len(fns))), 1
    else:  # TE: each callable runs once per microbatch, and each run is a region of its own
        passes, microbatches = _forward_passes(order, len(fns), len(args),
                                              graph_kwargs.get("_num_layers_per_chunk"))
    kwargs = graph_kwargs.get("sample_kwargs")
    if kwargs is None:
        kwargs = tuple({} for _ in args)
    elif single and isinstance(kwargs, dict):
        kwargs = (kwargs,)
    else:
        kwargs = tuple(kwargs)
    if len(kwargs) != len(args) or not all(isinstance(k, dict) for k in kwargs):
        raise OffloadError(f"offload: sample_kwargs must be one dict per sample_args tuple ({len(args)}); "
                           f"got {graph_kwargs.get('sample_kwargs')!r:.200}")
    if not torch.cuda.is_available():
        raise OffloadError("offload: CUDA graphs need a CUDA device")
    manager = PipelineOffloadManager.get()
    schedule = manager.schedule
    if schedule is not None:
        manager.set_schedule(None)  # the warm-up and captures run outside the training schedule
    suspended = manager.suspended
    try:
        return _capture(fns, args, kwargs, single, passes, microbatches, graph_api, graph_kwargs)
    finally:
        manager.suspended = suspended  # also where the API failed between its warm-up hooks
        # the captures were an iteration of their own: its statistics stay readable
        manager.captures.capture_stats = manager.end_iteration(check_names=False)
        if schedule is not None:
            manager.set_schedule(schedule.order)


def _capture(fns: tuple, args: tuple, kwargs: tuple, single: bool, passes: list[int], microbatches: int,
             graph_api: Callable | None, graph_kwargs: dict[str, Any]) -> Any:
    """`make_graphed_callables` past its checks: regions, our warm-up, the API's capture."""
    manager = PipelineOffloadManager.get()
    base = next(_region_ids)
    wrapped = tuple(_as_region(fn, ("graphed", base, i), microbatches) for i, fn in enumerate(fns))
    api = graph_api if graph_api is not None else torch.cuda.make_graphed_callables
    own_api = api is torch.cuda.make_graphed_callables
    iterations = graph_kwargs.pop("num_warmup_iters", 3)

    def warm_up() -> None:
        _prepare([wrapped[i] for i in passes], args, kwargs, iterations)

    try:
        takes = inspect.signature(api).parameters
    except (TypeError, ValueError):  # a callable without a signature Python can read
        takes = {}
    if "pre_warmup_hook" in takes:
        user_pre = graph_kwargs.pop("pre_warmup_hook", None)
        suspend = "post_warmup_hook" in takes

        def pre_warmup_hook() -> None:
            if user_pre is not None:
                user_pre()
            warm_up()
            if suspend:  # the API's own warm-up runs without offloading: its handlers would
                manager.suspended += 1  # hold pinned buffers the captures need (`_prepare` sized the pool)

        graph_kwargs["pre_warmup_hook"] = pre_warmup_hook
        if suspend:
            user_post = graph_kwargs.pop("post_warmup_hook", None)

            def post_warmup_hook() -> None:
                manager.suspended -= 1
                if user_post is not None:
                    user_post()

            graph_kwargs["post_warmup_hook"] = post_warmup_hook
    else:
        warm_up()
    # what the API returns, one per forward pass: the regions they replay
    runs: Counter[int] = Counter()
    keys = []
    for i in passes:
        keys.append(_pass_key(("graphed", base, i), runs[i], microbatches))
        runs[i] += 1
    manager.captures.prepare_replays(keys)
    # torch's API needs no warm-up after ours; Transformer Engine's records per-callable state
    # in its own (which runs with the engine suspended, above).
    with no_collection_during_capture():  # no earlier graph may die inside these captures
        graphed = api(wrapped[0] if single else wrapped, args[0] if single else args,
                      num_warmup_iters=0 if own_api else 1, **graph_kwargs)
    if single:
        return _reporting_replays(graphed, keys[0])
    return tuple(_reporting_replays(fn, key) for fn, key in zip(graphed, keys))


def _reporting_replays(graphed: Any, key: Any) -> Any:
    """``graphed`` (a function, or a module whose ``forward`` the API replaced) calling
    `CaptureSessions.after_replay` for ``key`` after each call that replayed its graph (one
    that entered no region: the API's eager fallback runs the region instead), and after its
    backward where reloads wait for that (Notes [C3], [C4] of `offload.capture`). The API's
    attributes on it (TE's ``reset``, ``backward_dw``) stay reachable."""
    if isinstance(graphed, torch.nn.Module):
        graphed.forward = _reporting_replays(graphed.forward, key)
        return graphed

    @functools.wraps(graphed)
    def replay(*args: Any, **kwargs: Any) -> Any:
        captures = PipelineOffloadManager.get().captures
        runs = captures.region_runs
        grad = torch.is_grad_enabled()
        reloads = captures.backward_replays.get(key)
        if grad and reloads is not None and reloads.groups:
            _after_backward(args, kwargs, key, lambda _grad: captures.after_replay(key, backward=True))
        outputs = graphed(*args, **kwargs)
        if captures.region_runs == runs:
            captures.after_replay(key)
            owed = captures.reloaded_by.get(key)
            if grad and owed is not None:
                _check_reloads_issued(outputs, key, owed)
        return outputs

    return replay


def _first_tensor(tree: Any, wanted: Callable[[torch.Tensor], bool]) -> torch.Tensor | None:
    """The first tensor in ``tree`` (a tensor, or containers of them) that is ``wanted``: the
    common shapes (a tensor, a tuple of them) without pytree's cost on the replay path."""
    if isinstance(tree, torch.Tensor):
        return tree if wanted(tree) else None
    if type(tree) is tuple:
        found = next((t for t in tree if isinstance(t, torch.Tensor) and wanted(t)), None)
        if found is not None:
            return found
    return next((t for t in torch.utils._pytree.tree_leaves(tree) if isinstance(t, torch.Tensor) and wanted(t)),
                None)


def _check_reloads_issued(outputs: Any, key: Any, owed: Any) -> None:
    """Before the backward graph of region ``key`` replays (a pre-hook on the API's autograd
    node, which runs after the tensor hooks that issue reloads), raise `OffloadError` unless
    the reloads it waits for (``owed``, a `offload.capture.ReplayCopies`) were issued since this
    forward replay (Note [C4])."""
    first = _first_tensor(outputs, lambda t: t.grad_fn is not None)
    if first is None:
        return
    mark = owed.issues

    def check(_grads: Any) -> None:
        if owed.issues == mark:
            raise OffloadError(
                f"offload: the backward graph of region {key!r} is about to replay, but the backward "
                "graph captured before it has not replayed since its forward: its reloads were "
                "not issued (Note [C4] of offload.capture). Replay the graphs' backward in the "
                "order they were captured")

    first.grad_fn.register_prehook(check)


def _needs_grad(t: torch.Tensor) -> bool:
    return t.requires_grad


def _after_backward(args: tuple, kwargs: dict, key: Any, hook: Callable[[torch.Tensor], None]) -> None:
    """Run ``hook`` once the gradient of the first input that needs one is computed, i.e. after
    the backward of the graph these inputs go into (Note [C4] of `offload.capture`). The hook
    removes itself when it runs: an input that outlives the step (a leaf the caller keeps)
    would otherwise gather one hook per replay, each issuing the reloads again."""
    first = _first_tensor(args, _needs_grad)
    if first is None and kwargs:
        first = _first_tensor(kwargs, _needs_grad)
    if first is None:
        raise OffloadError(
            f"offload: graph region {key!r} was called with no input that needs a gradient, but the "
            "backward graph after its own reads what is reloaded once its backward ran (Note [C4] "
            "of offload.capture): call it with the inputs it was captured with")

    def once(grad: torch.Tensor) -> None:
        handle.remove()
        hook(grad)

    handle = first.register_hook(once)
