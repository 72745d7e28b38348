"""Megatron's CUDA graphs with offloading: which modes work, and the hook that makes them work.

Megatron-core has three CUDA-graph implementations (``--cuda-graph-impl``):

* ``transformer_engine``: ``TECudaGraphHelper.create_cudagraphs()`` captures each
  ``TransformerLayer`` (its ``_te_cuda_graph_capture``: the whole layer, or only the regions
  that ``--cuda-graph-modules`` names, such as ``attn``, with the rest of the layer eager) per
  microbatch, through Transformer Engine's ``make_graphed_callables``, which it calls by the
  name it imported into ``megatron.core.transformer.cuda_graphs``. `route_te_graphs` rebinds
  that name to ``offload.graphs.make_graphed_callables(..., graph_api=<TE's function>)``, so
  each layer becomes a graph region: the offload groups inside the captured part are captured
  (their copies and reloads are issued after the replays, Notes [C3] and [C4] of
  `offload.capture`, so they also run under the eager part) and the groups in the eager part
  offload eagerly, as anywhere. Supported.
* ``local``: Megatron's own ``CudaGraphManager`` captures with its own runners, outside any
  offload region: refused. Its regions are not Transformer Engine's: with ``attn`` or ``mlp``
  named, megatron-core 0.19's ``TransformerLayer`` gives the whole layer one runner, experts
  included (tried on an H200, 2026-11-29: the GPT layer spec's MoE layers have no runner for
  ``moe_router`` alone, so no scope there leaves graphs with the experts eager).
* ``full_iteration``: one graph for the whole forward and backward: refused.

With ``transformer_engine``, expert-parallel overlap (``--overlap-moe-expert-parallel-comm``)
and delayed weight gradients (``--delay-wgrad-compute``) are refused too: they split a layer's
graphs into weight-gradient passes, which the offload regions do not follow.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from offload.errors import OffloadError

__all__ = ["CudaGraphMode", "check_cuda_graphs", "cuda_graph_mode", "route_te_graphs"]

# Which offload names each per-layer capture region of Megatron's CUDA graphs contains
# (TransformerLayer._forward_attention: input_layernorm .. self_attn_bda; _forward_mlp:
# pre_mlp_layernorm .. mlp_bda, or up to the router for moe_router).
_GRAPH_REGIONS: dict[str, tuple[str, ...]] = {
    "attn": ("attn_norm", "qkv_linear", "core_attn", "attn_proj"),
    "mlp": ("mlp_norm", "fc1", "mlp_act", "fc2"),
    "moe": ("mlp_norm", "router", "expert_fc1", "moe_act", "expert_fc2"),
    "moe_router": ("mlp_norm", "router"),
    "moe_preprocess": (),
    "mamba": (),
}


@dataclass(frozen=True)
class CudaGraphMode:
    """Megatron's CUDA-graph setting, as `cuda_graph_mode` reads it from a config.

    ``impl``: ``local``, ``transformer_engine`` or ``full_iteration``; ``modules``: the per-layer
    capture regions (``attn``, ``mlp``, ``moe``, ``moe_router``, ``moe_preprocess``, ``mamba``),
    empty for whole layers; ``whole_iteration``: one graph for the whole forward and backward;
    ``flags``: the command-line flags that set it, for messages.
    """

    impl: str
    modules: tuple[str, ...]
    whole_iteration: bool
    flags: str

    @property
    def label(self) -> str:
        """``full_iteration``, ``<impl>:layer`` (whole layers) or ``<impl>:<region>+<region>``."""
        if self.whole_iteration:
            return "full_iteration"
        return f"{self.impl}:{'+'.join(self.modules) or 'layer'}"

    @property
    def through_offload(self) -> bool:
        """Whether the graphs are captured by Transformer Engine's ``make_graphed_callables``,
        which `route_te_graphs` routes through ``offload.graphs``."""
        return self.impl == "transformer_engine" and not self.whole_iteration

    @property
    def whole_layers(self) -> bool:
        """Whether each transformer layer is captured whole: no regions named, or ``local`` with
        ``attn`` or ``mlp`` (its runner takes the layer's whole forward; module docstring)."""
        return not self.modules or (self.impl == "local" and bool(self.local_whole_layer_regions))

    @property
    def local_whole_layer_regions(self) -> list[str]:
        """Of the regions named, those for which ``local``'s runner takes each layer whole."""
        return [r for r in self.modules if r in ("attn", "mlp")]

    def captured(self, names: Iterable[str]) -> list[str]:
        """Those of ``names`` whose modules run inside the graphs."""
        if self.whole_iteration or self.whole_layers:
            return list(names)
        inside: set[str] = set()
        known = {n for region in _GRAPH_REGIONS.values() for n in region}
        for region in self.modules:
            inside.update(_GRAPH_REGIONS.get(region, known))  # a region we do not know: all
        return [n for n in names if n in inside]


def _region_names(value: Any) -> list[str]:
    """Capture regions from a config value: a list of enums or strings, a comma-separated
    string, or ``"full"``/empty (whole layers)."""
    if value is None:
        return []
    items = value if isinstance(value, (list, tuple)) else [value]
    out: list[str] = []
    for item in items:
        if isinstance(item, str):
            out.extend(part.strip() for part in item.split(",") if part.strip())
        else:
            out.append(str(getattr(item, "name", item)))
    return [] if out == ["full"] else out


def cuda_graph_mode(config: Any) -> CudaGraphMode | None:
    """Megatron's CUDA-graph setting in ``config`` (a ``TransformerConfig`` of megatron-core 0.16
    or 0.19, or Megatron-LM's args), or ``None`` when CUDA graphs are off.

    0.16 reads ``cuda_graph_impl`` (none, local, transformer_engine) and ``cuda_graph_scope``
    (``full_iteration`` there means one graph per iteration, with local); 0.19 adds the impl
    ``full_iteration`` and names the regions ``cuda_graph_modules`` (``cuda_graph_scope`` is its
    deprecated alias). The deprecated ``enable_cuda_graph`` and ``external_cuda_graph`` mean
    local and transformer_engine.
    """
    impl = getattr(config, "cuda_graph_impl", None) or "none"
    impl_flag = f"--cuda-graph-impl {impl}"
    if impl == "none":
        if getattr(config, "enable_cuda_graph", False):
            impl, impl_flag = "local", "--enable-cuda-graph (= --cuda-graph-impl local)"
        elif getattr(config, "external_cuda_graph", False):
            impl, impl_flag = "transformer_engine", "--external-cuda-graph (= --cuda-graph-impl transformer_engine)"
        else:
            return None
    if hasattr(config, "cuda_graph_modules"):  # 0.19
        flag, regions = "--cuda-graph-modules", _region_names(config.cuda_graph_modules)
        if not regions and getattr(config, "cuda_graph_scope", None) is not None:
            flag, regions = "--cuda-graph-scope", _region_names(config.cuda_graph_scope)
    else:  # 0.16
        flag, regions = "--cuda-graph-scope", _region_names(getattr(config, "cuda_graph_scope", None))
    flags = f"{impl_flag} {flag} {','.join(regions)}" if regions else impl_flag
    whole_iteration = impl == "full_iteration" or "full_iteration" in regions
    regions = [r for r in regions if r != "full_iteration"]
    return CudaGraphMode(impl=impl, modules=tuple(regions), whole_iteration=whole_iteration, flags=flags)


def check_cuda_graphs(config: Any, names: Iterable[str]) -> CudaGraphMode | None:
    """Raise `OffloadError` when ``config`` switches on a Megatron CUDA-graph mode that cannot
    offload ``names`` (the module docstring says which), naming the flags, the names inside the
    graphs and those outside them; return the mode (``None``: graphs off or nothing offloaded)."""
    names = list(names)
    mode = cuda_graph_mode(config)
    if mode is None or not names:
        return None
    if mode.through_offload:
        splits = [flag for flag, field in (("--overlap-moe-expert-parallel-comm", "overlap_moe_expert_parallel_comm"),
                                           ("--delay-wgrad-compute", "delay_wgrad_compute"))
                  if getattr(config, field, False)]
        if not splits:
            return mode
        raise OffloadError(
            f"offload: Megatron's CUDA graphs ({mode.flags}) with {' and '.join(splits)} split each layer's "
            "backward graph into a separate weight-gradient graph, which the offload regions do not follow. "
            f"Drop {' and '.join(splits)}, or use --cuda-graph-impl none with --offload-modules.")
    if mode.whole_iteration:
        what = "one graph for the whole forward and backward of an iteration"
    elif not mode.modules:
        what = "one graph per transformer layer, the whole layer"
    elif mode.whole_layers:
        named = " or ".join(mode.local_whole_layer_regions)
        what = f"Megatron's own runners, which take each transformer layer whole when {named} is named"
    else:
        what = f"graphs of {', '.join(mode.modules)} in each transformer layer, the rest eager"
    captured = mode.captured(names)
    eager = [n for n in names if n not in captured]
    parts = [f"offload: Megatron's CUDA graphs are on ({mode.flags}: {what})."]
    if captured:
        parts.append(f"Inside the graphs: {', '.join(captured)}.")
    if eager:
        parts.append(f"Outside them: {', '.join(eager)}.")
    parts.append(
        "This mode captures with Megatron's own runners, outside the offload graph regions, so a replay "
        "would neither offload nor reload. Use --cuda-graph-impl transformer_engine (whole layers, or "
        "--cuda-graph-modules attn for attention graphed and the rest eager), or --cuda-graph-impl none.")
    raise OffloadError(" ".join(parts))


def route_te_graphs() -> Callable[[], None]:
    """Make Megatron's ``TECudaGraphHelper`` capture through ``offload.graphs``: rebind the
    ``make_graphed_callables`` that ``megatron.core.transformer.cuda_graphs`` imported from
    Transformer Engine to a wrapper that passes TE's function as ``graph_api``. Returns the
    undo. Raises `OffloadError` where Megatron found no Transformer Engine graphs."""
    from megatron.core.transformer import cuda_graphs

    current = getattr(cuda_graphs, "make_graphed_callables", None)
    if current is None:
        raise OffloadError(
            "offload: --cuda-graph-impl transformer_engine needs Transformer Engine's make_graphed_callables, "
            "which megatron.core.transformer.cuda_graphs could not import (is transformer_engine installed?)")
    if getattr(current, "__offload_graph_api__", None) is not None:
        return lambda: None  # routed already (another handle): that one undoes it
    te_api = current

    @functools.wraps(te_api)
    def make_graphed_callables(callables: Any, sample_args: Any, **kwargs: Any) -> Any:
        from offload import graphs

        return graphs.make_graphed_callables(callables, sample_args, graph_api=te_api, **kwargs)

    make_graphed_callables.__offload_graph_api__ = te_api  # type: ignore[attr-defined]
    cuda_graphs.make_graphed_callables = make_graphed_callables

    def undo() -> None:
        if cuda_graphs.make_graphed_callables is make_graphed_callables:
            cuda_graphs.make_graphed_callables = te_api

    return undo
