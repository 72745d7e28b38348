"""Megatron-core integration: ``--offload-modules=core_attn,expert_fc1`` without editing Megatron.

The pieces, each usable alone (this module attaches and wraps; the others are its parts):

* **Names → modules** (`offload.integrations.megatron_names`). `find_modules` walks a model
  chunk and finds, in every ``TransformerLayer``, the megatron-core modules behind each offload
  name (table below); `check_compatible` refuses a name that would offload nothing or break
  Megatron. `apply` configures the engine and attaches those groups to each model chunk
  (``offload.attach``, whose forward pre-hook on the chunk starts a chunk × microbatch handler).
* **The schedule.** `wrap_forward_backward_func` wraps the function that
  ``get_forward_backward_func()`` returns: before it runs, the rank's order of chunk forwards
  and backwards (Megatron's signed ``order``) goes to ``offload.set_schedule``; after it,
  ``offload.end_iteration()`` closes the iteration. For Megatron-LM's ``pretrain``, which
  fetches that function itself, `wrap_model_provider` installs the same wrapper by rebinding
  ``get_forward_backward_func`` in the loaded Megatron modules (in memory; no file changes).
* **The flags** (`offload.integrations.megatron_flags`). `add_arguments` (usable as
  Megatron's ``extra_args_provider``) adds ``--offload-modules`` (or reuses Megatron-LM's own
  flag of that name), the minimum tensor size, the in-flight bound and the policy;
  `apply_from_args` reads them.
* **The plan** (`offload.integrations.megatron_plan`). ``--offload-modules=auto
  --offload-memory-budget=-30%`` lets `offload.plan` choose, under the budget, which of the
  names below to offload and which containers (each ``TransformerLayer``, its
  ``self_attention``, its ``mlp``) to recompute. The wrapped ``forward_backward_func`` makes
  the plan on its first training call (`MegatronOffload.wrap`).
* **The embedding's output.** ``GPTModel.forward`` holds the first layer's input until it
  returns; `apply` lets its decoder drop that reference, as Megatron does in inference
  (`_hand_the_embedding_output_to_the_decoder`), so the first layer's groups copy it with their
  other copies instead of after the loss.

Names (relative to each ``TransformerLayer``; "saves" is what autograd keeps for backward):

============  =======================================================  ==========================================
name          module                                                   saves (local spec)
============  =======================================================  ==========================================
attn_norm     ``input_layernorm``                                      its input, the residual stream [s,b,h]
qkv_linear    ``self_attention.linear_qkv``; MLA: ``linear_q_proj`` /  its input, the normed hidden state [s,b,h]
              ``linear_q_down_proj``, ``linear_q_up_proj``,
              ``linear_kv_down_proj``, ``linear_kv_up_proj``,
              ``linear_qkv_down_proj`` (fused MLA down projection)
core_attn     ``self_attention.core_attention``                        q, k, v and the softmax probabilities
                                                                       [b,heads,s,s] (unfused attention)
attn_proj     ``self_attention.linear_proj``                           its input, the attention context [s,b,h]
mlp_norm      ``pre_mlp_layernorm``                                    its input, the residual stream [s,b,h]
fc1           ``mlp.linear_fc1`` (dense MLP)                           its input [s,b,h]
mlp_act       between ``mlp.linear_fc1`` and ``mlp.linear_fc2``        the fc1 output [s,b,ffn] (×2 with GLU)
fc2           ``mlp.linear_fc2`` (dense MLP)                           its input, the activation [s,b,ffn]
router        ``mlp.router`` (MoE)                                     its input [s·b,h] and small routing tensors
expert_fc1    ``mlp.experts`` (SequentialMLP: all experts' fc1, one     the routed tokens [tokens·topk,h]
              group per layer) or ``mlp.experts.linear_fc1`` (grouped)
moe_act       between the experts' fc1 and fc2                         the fc1 output and the routing probabilities
expert_fc2    ``mlp.experts.local_experts.*.linear_fc2`` (Sequential)  the weighted activation [tokens·topk,ffn]
              or ``mlp.experts.linear_fc2`` (grouped)
============  =======================================================  ==========================================

``mlp_act`` and ``moe_act`` are code, not modules: their group opens when fc1 returns and closes
when fc2 is called. With ``SequentialMLP``, every expert's fc1 input is a slice of one tensor
that the experts' forward holds until its last expert ran; one ``expert_fc1`` group per layer
(the experts module, whose activations and fc2s are their own groups or stay on the GPU) is
copied once the layer is done, where per-expert groups would find the tensor still in use.

Transformer Engine layer spec (``get_gpt_layer_with_transformer_engine_spec``). Modules are
recognised by their attributes, never by importing ``transformer_engine``:

* The attention norm is fused into ``self_attention.linear_qkv``, a
  ``TELayerNormColumnParallelLinear`` (one autograd function: it saves the norm's input, the
  normed output and the norm statistics together), and ``input_layernorm`` is an ``IdentityOp``.
  A fused module is one with a ``layer_norm_weight`` parameter. ``qkv_linear`` is then that
  module, norm included: what ``attn_norm`` and ``qkv_linear`` save in the local spec.
  ``attn_norm`` cannot be offloaded apart from it: alone it is an error that names
  ``qkv_linear``; next to ``qkv_linear`` it is accepted as covered (`ChunkModules.covered`).
  Megatron's own offloading drops ``attn_norm`` silently there
  (``transformer_layer.py``: ``"attn_norm" in offload_modules and not isinstance(
  self.input_layernorm, IdentityOp)``) and offloads ``linear_qkv`` under ``qkv_linear``.
* Dense layers fuse ``pre_mlp_layernorm`` into ``mlp.linear_fc1`` the same way: ``fc1`` covers
  ``mlp_norm``. MoE layers keep a separate ``pre_mlp_layernorm`` (``TENorm``): ``mlp_norm``
  is that module. MLA keeps a separate ``input_layernorm`` unless its down projections are
  fused (``mla_down_proj_fusion``: ``linear_qkv_down_proj`` covers ``attn_norm``).
* ``core_attn`` is ``TEDotProductAttention`` (fused or flash attention): it saves q, k, v, the
  output and the softmax statistics, no probabilities. Its output is ``attn_proj``'s input, so
  ``attn_proj`` alone frees nothing there (the engine reports it held elsewhere); Megatron's
  own offloading refuses ``attn_proj`` without ``core_attn`` for the same reason.
* ``TEGroupedMLP`` (``--moe-grouped-gemm``): ``expert_fc1`` and ``expert_fc2`` are its
  ``linear_fc1``/``linear_fc2`` (``TEColumnParallelGroupedLinear``/``TERowParallelGroupedLinear``,
  all local experts in one grouped GEMM), ``moe_act`` the code between them. With the
  operation fuser (``use_transformer_engine_op_fuser``, 0.19) fc1, activation and fc2 run as one
  fused op that never calls those submodules, and ``TEFusedMLP`` (``use_te_op_fuser``) does the
  same for a dense MLP: their names are errors (Megatron's name for the fused grouped MLP is
  ``fused_group_mlp``, which this integration does not map).

A name the model does not have (``expert_fc1`` in a dense model) is an error that says why.
Shared experts and the legacy ``GroupedMLP`` (one fused op, no fc1/fc2 submodules) are not
mapped.

Megatron's token dispatchers read the token counts per expert on the host before the experts
run (the allgather dispatcher's ``.cpu()``, the others' ``_maybe_dtoh_and_synchronize``): a host
sync per MoE layer. Each such layer's experts module is attached as a host sync
(``attach(..., host_syncs=...)``: its forward pre-hook calls `offload.after_host_sync`), so the
copies are issued right after that sync, not before it where the sync's own small copy would
wait behind them (Note [9] of `offload.copy_queue`). The all-to-all dispatcher that drops and
pads to capacity (``--moe-pad-expert-input-to-capacity``) never syncs
(`megatron_names.syncs_with_host`): its layers' copies are issued at group opens (Note [7]), and
the host may run ahead of the GPU through the whole forward.

Composition with selective recompute (``--recompute-granularity selective --recompute-modules``).
Megatron runs a recomputed region under ``torch.no_grad`` (``tensor_parallel.checkpoint`` for
``core_attn``, ``mlp``, ``moe``; ``CheckpointWithoutOutput`` for ``layernorm``, ``moe_act``,
``mla_up_proj``) and again inside backward; a group opened there offloads nothing. So:

* ``core_attn`` with ``core_attn``; ``attn_norm``/``mlp_norm`` with ``layernorm`` (where the norm
  is its own module: a fused norm is not recomputed); ``fc1``/``mlp_act``/``fc2`` with ``mlp``;
  ``router``/``expert_fc1``/``moe_act``/``expert_fc2`` with ``moe``: refused (`check_compatible`),
  recompute wins.
* ``moe_act`` with ``moe_act``: refused too. The region between fc1 and fc2 does contain the
  checkpoint, but what the checkpoint saves is its input ``detach()``-ed, a leaf that requires
  grad, which the engine never offloads (it takes such leaves for parameters), and the fc1
  output is still referenced by the experts' forward when the copy is due. Megatron's own
  offloading offloads it (it skips only ``nn.Parameter`` objects and force-frees the fc1 output).
* Neighbours compose: with ``layernorm`` recomputed, ``qkv_linear``'s saved input is the
  checkpoint's output, which ``CheckpointWithoutOutput`` holds and frees itself (the engine sees
  it held elsewhere and does not copy it); ``expert_fc2`` next to ``moe_act`` recompute likewise.
  With ``mla_up_proj``, ``qkv_linear``'s up projections are recomputed and only its down
  projections offload.
* Full recompute makes every group of a recomputed layer inert.

Megatron's CUDA graphs (`offload.integrations.megatron_graphs`): with ``--cuda-graph-impl
transformer_engine`` (whole layers, or ``--cuda-graph-modules attn`` and the other partial
scopes) `apply` routes Megatron's capture through ``offload.graphs``: the names inside the
graphs are captured, those in the eager part offload eagerly. ``local`` and
``full_iteration`` are refused with the flag and the names involved (`check_cuda_graphs`).
Megatron's own fine-grained offloading and its layer-level ``cpu_offloading`` are refused: they
hook the same saved tensors.

Versions. Tested with megatron-core 0.16.1 (CPU, CI) and 0.19.2 (GPU). What differs between
them is handled here: the schedules' keyword arguments (0.19 adds ``pg_collection`` paths and
``schedule_pg_collection``), the legacy ``GroupedMLP`` (present up to 0.18), the CUDA-graph
fields (0.16: ``cuda_graph_impl`` none/local/transformer_engine and ``cuda_graph_scope``, with
``full_iteration`` a scope of ``local``; 0.19: ``cuda_graph_impl`` adds ``full_iteration`` and
``cuda_graph_modules`` replaces ``cuda_graph_scope``, which ``__post_init__`` migrates and sets
to ``None``; both keep the deprecated booleans ``enable_cuda_graph`` = local and
``external_cuda_graph`` = transformer_engine), and the op fusers (0.19). Module paths and
``get_forward_backward_func``'s result are the same.
"""

from __future__ import annotations

import argparse
import functools
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

import offload
from offload import group_policy
from offload.config import DEFAULT_MIN_TENSOR_BYTES, parse_module_list
from offload.errors import OffloadError, OffloadValueError, UnknownModuleError
from offload.planner.budget import Budget
from offload.schedules import schedule_table, table_to_order
from offload.stats import IterationStats

from .megatron_flags import Options, add_arguments, check_auto_options, parse_policy
from .megatron_graphs import check_cuda_graphs, cuda_graph_mode, route_te_graphs
from .megatron_names import (AUTO, MEGATRON_OWN_NAMES, NAMES, ChunkModules, _ACT_NAMES, check_compatible,
                             find_modules, megatron_version, module_patterns, to_megatron_names)

if TYPE_CHECKING:
    from .megatron_plan import AutoSettings

try:
    from megatron.core import parallel_state
except ImportError as exc:  # pragma: no cover - exercised only without megatron-core
    raise ImportError(
        "offload.integrations.megatron needs megatron-core (pip install 'offload[megatron]')"
    ) from exc

__all__ = [
    "AUTO",
    "MEGATRON_OWN_NAMES",
    "NAMES",
    "MegatronOffload",
    "add_arguments",
    "apply",
    "apply_from_args",
    "check_auto_options",
    "check_compatible",
    "check_cuda_graphs",
    "cuda_graph_mode",
    "find_modules",
    "megatron_order",
    "megatron_version",
    "module_patterns",
    "parse_policy",
    "to_megatron_names",
    "unwrap",
    "wrap_forward_backward_func",
    "wrap_model_provider",
]


# ------------------------------------------------------------------------------ attaching
def unwrap(module: nn.Module) -> nn.Module:
    """The model inside DDP / Float16Module wrappers."""
    while isinstance(getattr(module, "module", None), nn.Module):
        module = module.module
    return module


def _act_region_hooks(name: str | None, mlp: nn.Module, fc1: nn.Module, fc2: nn.Module) -> list[Any]:
    """Make the code between ``fc1`` and ``fc2`` a group ``name`` (``None``: a never-offload
    region): it opens when fc1 returns (its output gets the group's backward marker) and
    closes when fc2 is called, or when the MLP returns if fc2 never ran (an exception)."""
    open_regions: list[Any] = []

    def after_fc1(module: nn.Module, args: tuple, output: Any) -> Any:
        first = output[0] if isinstance(output, tuple) else output
        if not isinstance(first, torch.Tensor):
            return None
        if name is None:
            region = offload.never_offload()
            region.__enter__()
            open_regions.append(region)
            return None
        # The one view with gaps saved here is the GLU's activated half (Megatron's experts and
        # unfused MLP compute ``act(x_glu) * (x_linear + offset)``), read only by the activation's
        # backward: torch's CUDA kernels give it the same bits packed, so it comes back packed,
        # as from Megatron's offloading, with no spread on the compute stream (Note [10] of
        # offload.copy_queue). Not on the CPU, whose SiLU gives other bits for it packed.
        region = offload.group(name, first, packed_views=first.is_cuda)
        marked = region.__enter__()
        open_regions.append(region)
        return (marked, *output[1:]) if isinstance(output, tuple) else marked

    def before_fc2(module: nn.Module, args: tuple) -> None:
        if open_regions:
            open_regions.pop().__exit__(None, None, None)

    def after_mlp(module: nn.Module, args: tuple, output: Any) -> None:
        while open_regions:
            open_regions.pop().__exit__(None, None, None)

    return [
        fc1.register_forward_hook(after_fc1),
        fc2.register_forward_pre_hook(before_fc2, prepend=True),  # before fc2's own group opens
        mlp.register_forward_hook(after_mlp, always_call=True),
    ]


def _hand_the_embedding_output_to_the_decoder(chunk: nn.Module) -> Callable[[], None] | None:
    """Let the decoder drop ``GPTModel.forward``'s reference to the embedding's output, the first
    layer's input, as Megatron does in inference (a ``WrappedTensor``, which ``TransformerBlock``
    unwraps); returns the undo, or None where it does not apply.

    In training ``GPTModel.forward`` holds that tensor until it returns, only to hand it to
    multi-token prediction, the config logger or an ``output_processor``; so the first layer's
    groups found it held elsewhere and copied it only when the model returned (Note [8] of
    `offload.copy_queue`), after a peak in the loss (DeepSeek-V3's widths at sequence 16384:
    224 MiB more than Megatron's offloading, which frees it under that reference by resizing
    its storage to zero). Left as it is where something reads it after the decoder: a model with
    multi-token prediction or the config logger, a call with an ``output_processor``."""
    from megatron.core.config_logger import has_config_logger_enabled
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.utils import WrappedTensor

    model = unwrap(chunk)
    if (not isinstance(model, GPTModel) or not model.pre_process or getattr(model, "mtp_process", False)
            or has_config_logger_enabled(model.config)):
        return None
    preprocess = model._preprocess
    reads_nothing_after = [False]  # this call's postprocess reads nothing of the decoder's input

    def before_forward(module: nn.Module, args: tuple, kwargs: dict) -> None:
        reads_nothing_after[0] = kwargs.get("output_processor") is None

    def handed_over(*args: Any, **kwargs: Any) -> Any:
        out = preprocess(*args, **kwargs)
        if reads_nothing_after[0] and isinstance(out[0], torch.Tensor):  # inference wraps it already
            out = (WrappedTensor(out[0]), *out[1:])
        return out

    hook = model.register_forward_pre_hook(before_forward, with_kwargs=True)
    before = model.__dict__.get("_preprocess")
    model._preprocess = handed_over

    def undo() -> None:
        hook.remove()
        if before is None:
            del model._preprocess  # the class's method again
        else:
            model._preprocess = before

    return undo


def _never_offload_hooks(module: nn.Module) -> list[Any]:
    """Nothing that ``module``'s forward saves is offloaded (it runs as a never-offload region)."""
    open_regions: list[offload.never_offload] = []

    def pre(mod: nn.Module, args: tuple) -> None:
        region = offload.never_offload()
        region.__enter__()
        open_regions.append(region)

    def post(mod: nn.Module, args: tuple, output: Any) -> None:
        open_regions.pop().__exit__(None, None, None)

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post, always_call=True)]


class MegatronOffload:
    """Offloading attached to a list of megatron-core model chunks; made by `apply`.

    ``mapping[i]`` is the name → module patterns given to `offload.attach` for chunk ``i``;
    ``last_stats`` the `IterationStats` of the latest wrapped ``forward_backward_func`` call.
    With no names, nothing is attached and `wrap` returns its function unchanged, so a script
    can call both unconditionally. With ``--offload-modules=auto`` (``auto`` set) nothing is
    attached until the wrapped function's first training call makes the plan; then ``plan`` is
    the `offload.planner.Plan`, ``names`` the names it offloads and ``regions`` the checkpointed
    containers whose inputs it offloads (name → qualified module names).
    """

    def __init__(self, names: tuple[str, ...], auto: AutoSettings | None = None) -> None:
        self.names = names
        self.auto = auto
        self.plan: Any = None  # offload.planner.Plan, once made
        self.regions: dict[str, list[str]] = {}
        self.mapping: list[dict[str, list[str]]] = []
        self.found: list[ChunkModules] = []
        self._hooks: list[Any] = []
        self._attached: list[Any] = []
        # the plan's checkpoints; the routing of Megatron's TE graphs; the embedding's output handed over
        self._undo: list[Callable[[], None]] = []

    @property
    def enabled(self) -> bool:
        return bool(self.names) or self.auto is not None

    @property
    def last_stats(self) -> IterationStats | None:
        return _last_stats[0]

    def attach_chunk(self, chunk: nn.Module, chunk_id: int, found: ChunkModules | None = None) -> ChunkModules:
        """Attach the configured names to one model chunk (its local virtual stage ``chunk_id``);
        ``found`` is its `find_modules` if already known."""
        found = find_modules(chunk) if found is None else found
        self.found.append(found)
        if not self.enabled:
            return found
        all_names = [qn for qn, _ in chunk.named_modules() if qn]
        mapping = {
            name: module_patterns(found.modules[name], all_names)
            for name in self.names if found.modules.get(name)
        }
        mapping.update({region: module_patterns(qns, all_names) for region, qns in self.regions.items()})
        # a covered norm has no group of its own: its covering name's groups hold what it saves
        offload.get_manager().declare_names(found.names | set(self.regions)
                                            | {n for n, by in found.covered.items() if by in self.names})
        # after the token dispatcher's host sync: Note [9] of offload.copy_queue
        syncs = module_patterns(found.experts, all_names) if found.experts else ()
        self._attached.append(offload.attach(chunk, mapping, chunk_id=chunk_id, host_syncs=syncs))
        self.mapping.append(mapping)
        undo = _hand_the_embedding_output_to_the_decoder(chunk)
        if undo is not None:
            self._undo.append(undo)
        modules = dict(chunk.named_modules())
        for name in _ACT_NAMES:
            if name in self.names:
                for mlp, fc1, fc2 in found.act_regions.get(name, ()):
                    self._hooks.extend(_act_region_hooks(name, modules[mlp], modules[fc1], modules[fc2]))
        if "expert_fc1" in self.names:
            # a SequentialMLP's expert_fc1 group holds only the fc1s: the activations and fc2s
            # inside it are their own groups or never-offload regions
            for mlp, fc1, fc2 in found.act_regions.get("moe_act", ()):
                if not mlp.startswith(tuple(f"{qn}." for qn in found.sequential_experts)):
                    continue
                if "moe_act" not in self.names:
                    self._hooks.extend(_act_region_hooks(None, modules[mlp], modules[fc1], modules[fc2]))
                if "expert_fc2" not in self.names:
                    self._hooks.extend(_never_offload_hooks(modules[fc2]))
        return found

    def check_names_exist(self) -> None:
        """Raise `UnknownModuleError` for configured names that no attached chunk has (a norm
        fused into the next linear layer counts where that layer's name is configured too)."""
        have = set().union(*(f.names for f in self.found)) if self.found else set()
        covered = {n for f in self.found for n, by in f.covered.items() if by in self.names}
        missing = [n for n in self.names if n not in have and n not in covered]
        if not missing:
            return
        reasons = {}
        for f in self.found:
            reasons.update(f.absent)
        lines = [f"{n!r}: {reasons.get(n, 'no transformer layer in the model chunks')}" for n in missing]
        raise UnknownModuleError(
            "offload: --offload-modules names a module this model does not have on this "
            f"pipeline rank: {'; '.join(lines)}. Names it has: {', '.join(sorted(have)) or '(none)'}"
        )

    def wrap(self, forward_backward_func: Callable[..., Any]) -> Callable[..., Any]:
        """`wrap_forward_backward_func` when offloading is on; the function itself otherwise.

        With ``--offload-modules=auto`` the wrapper's first call that trains (not
        ``forward_only``) makes the plan before it runs (`_plan_first_call`): the schedule's own
        arguments are the only place that knows how to run one step of this model (its
        ``forward_step_func``, data and sequence sizes), and planning there needs no change to the
        training loop. Later calls run as with names.
        """
        if not self.enabled:
            return forward_backward_func
        inner = wrap_forward_backward_func(forward_backward_func)
        if self.auto is None:
            return inner
        raw = getattr(inner, "__wrapped__", forward_backward_func)

        @functools.wraps(raw)
        def run(*args: Any, **kwargs: Any) -> Any:
            if self.plan is None and not kwargs.get("forward_only", False):
                kwargs = self._plan_first_call(raw, args, kwargs)
            return inner(*args, **kwargs)

        run.__offload_wrapped__ = True  # type: ignore[attr-defined]
        return run

    def remove(self) -> None:
        """Take every hook, the plan's checkpoints, the routing of Megatron's TE graphs and the
        handing over of the embedding's output away again (the engine stays configured)."""
        for handle in self._attached:
            handle.remove()
        for h in self._hooks:
            h.remove()
        for undo in reversed(self._undo):
            undo()
        self._attached.clear()
        self._hooks.clear()
        self._undo.clear()


    def _plan_first_call(self, forward_backward_func: Callable[..., Any], args: tuple,
                         kwargs: dict[str, Any]) -> dict[str, Any]:
        """Make the plan on this call's arguments, agree on it across ranks, apply it, check it;
        returns the arguments for the call itself.

        The planner's ``step()`` runs ``forward_backward_func`` with the same arguments and
        ``num_microbatches=1``, on a copy of the call's first microbatch: the no-pipelining
        schedule runs each microbatch's forward and backward before the next one's, so one
        microbatch has the step's peak, and the planner's model (one forward, then its
        backward) describes it. The call itself gets its data iterator back with that
        microbatch in front. Before each planning step the gradients are zeroed (Megatron's
        DDP: ``zero_grad_buffer()``, which also resets its buckets; otherwise in place), and
        afterwards `megatron_plan.Untouched` puts back what the steps changed: gradients (zero, or ``None``
        where they were), the random states (torch's, CUDA's, Megatron's RNG tracker), the
        chunk's buffers (a MoE router's token counts) and the MoE aux-loss
        tracker, so that training goes on as it would have without the plan.
        """
        from megatron.core.pipeline_parallel import schedules as msched

        from offload.planner.check import deviations, measure

        from . import megatron_plan
        from offload.planner.planning import CHECK_WARMUP
        from offload.planner.planning import plan as make_plan

        auto = self.auto
        if args:
            raise OffloadValueError(f"offload: --offload-modules={AUTO}: call forward_backward_func with keyword "
                                    "arguments, as megatron-core's schedules take them")
        if forward_backward_func is not msched.forward_backward_no_pipelining:
            raise OffloadError(
                f"offload: --offload-modules={AUTO} plans through megatron-core's forward_backward_no_pipelining "
                f"(pipeline parallel size 1); got {getattr(forward_backward_func, '__name__', forward_backward_func)}")
        models = kwargs.get("model")
        models = list(models) if isinstance(models, (list, tuple)) else [models]
        untouched = megatron_plan.Untouched(auto.chunk, models)
        first, data = megatron_plan.peek(kwargs.get("data_iterator"))
        device = torch.device(auto.device) if auto.device is not None else next(auto.chunk.parameters()).device
        cuda = device.type == "cuda"

        def step() -> None:
            untouched.zero_grads()
            data_once = megatron_plan.replay(kwargs.get("data_iterator"), first)
            kw = {**kwargs, "num_microbatches": 1, "data_iterator": data_once}
            if self._attached:  # the check's steps: the plan is applied
                offload.set_schedule(megatron_order(forward_backward_func, kw))
            forward_backward_func(**kw)

        try:
            plan = make_plan(auto.chunk, auto.mapping, step, auto.budget, regions="auto", device=device,
                             min_tensor_bytes=auto.min_tensor_bytes, bandwidth=auto.bandwidth, apply=False,
                             # no selective checkpointing: Transformer Engine's kernels run outside torch's
                             # dispatcher, where a selective-checkpoint policy cannot keep their outputs
                             check_steps=0, selective=False, verbose=False)
            megatron_plan.agree(plan)
            self._apply_plan(plan, device)
            plan.notes.extend(auto.notes())
            if auto.check_steps:
                plan.measured = measure(step, auto.check_steps, CHECK_WARMUP[device.type], cuda)
                devs = (deviations(plan.predicted_step_ms, plan.predicted_peak_bytes, plan.measured, plan.budget_bytes)
                        if cuda else [])
                if devs:
                    plan.notes.append("Not planned again (the Megatron integration plans once, with the same plan on "
                                      "every rank): " + "; ".join(devs) + ".")
        except BaseException:
            self.remove()
            offload.reset()
            untouched.restore()
            raise
        untouched.restore()
        plan.applied = self  # plan.remove() takes the hooks and checkpoints away
        self.plan = plan
        if auto.verbose and megatron_plan.rank() == 0:
            print(plan.table(), flush=True)
        return {**kwargs, "data_iterator": data}

    def _apply_plan(self, plan: Any, device: torch.device) -> None:
        """Checkpoint the plan's regions (with Megatron's RNG tracker restored for their
        recompute) and attach its offloaded names and regions to the chunk."""
        from offload.planner.apply import checkpoint_modules

        from . import megatron_plan

        auto = self.auto
        a = plan.assignment
        containers = {c: list(v["modules"]) for c, v in plan.profile.get("regions", {}).get("containers", {}).items()}
        where = {**{n: auto.found.modules[n] for n in auto.mapping}, **containers}
        self._undo.append(checkpoint_modules(auto.chunk, [qn for r in a.checkpoint for qn in where[r]],
                                             context_fn=megatron_plan.tracker_context))
        self.names = tuple(n for n in a.offload if n in NAMES)
        self.regions = {r: where[r] for r in a.offload if r not in NAMES}
        if not a.offload:
            return
        offload.configure(self.names + tuple(self.regions), min_tensor_bytes=auto.min_tensor_bytes,
                          max_inflight_groups=a.max_inflight_groups, device=device)
        self.attach_chunk(auto.chunk, 0, auto.found)
        self.check_names_exist()


def apply(
    model: nn.Module | Sequence[nn.Module],
    modules: str | Iterable[str],
    *,
    min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES,
    max_inflight_groups: int = 1,
    policy: str | group_policy.GroupPolicy | None = None,
    copies_into_backward: bool = False,
    device: torch.device | str | None = None,
    memory_budget: Budget | str | int | None = None,
    bandwidth: Any = None,
    check_steps: int = 3,
    verbose: bool = True,
) -> MegatronOffload:
    """Configure the engine for ``modules`` and attach them to each model chunk.

    ``model`` is a megatron-core model or the list of a rank's model chunks (virtual pipeline
    stages, in order), wrapped (DDP, ``Float16Module``) or not. ``policy`` is a
    `parse_policy` string or a `GroupPolicy`. Raises `UnknownModuleError` for a name that is
    not in `NAMES` or not in this model, `OffloadError` for a conflicting Megatron option
    (`check_compatible`). ``copies_into_backward`` is `offload.OffloadConfig`'s (where the compute
    stream waits for the copies in flight at a forward's end). Then wrap the
    ``forward_backward_func`` with ``.wrap(...)``. With
    Megatron's ``--cuda-graph-impl transformer_engine``, its ``TECudaGraphHelper`` captures
    through ``offload.graphs`` until `MegatronOffload.remove` (`megatron_graphs.route_te_graphs`).

    ``modules="auto"`` with ``memory_budget`` (`offload.Budget`'s forms) checks the model and
    its config at once (`megatron_plan.check_auto`, `megatron_plan.plan_mapping`) and attaches nothing: the wrapped
    function plans on its first training call (`MegatronOffload.wrap`). ``bandwidth`` (the
    planner's: a probe's JSON, a `Bandwidth` or GB/s; measured when ``None``), ``check_steps``
    (steps measured with the plan applied) and ``verbose`` (print the plan's table on rank 0)
    are for the plan only.
    """
    names = parse_module_list(modules)
    budget = check_auto_options(names, memory_budget, max_inflight_groups, policy, copies_into_backward)
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    if not chunks:
        raise ValueError("offload: apply() needs at least one model chunk")
    found = [find_modules(chunk) for chunk in chunks]
    if budget is not None:
        from . import megatron_plan

        settings = megatron_plan.auto_settings(chunks, found, budget, min_tensor_bytes=min_tensor_bytes, device=device,
                                               bandwidth=bandwidth, check_steps=check_steps, verbose=verbose)
        return MegatronOffload((), settings)
    graphed = False  # Megatron's TE graphs, to be captured through offload.graphs
    for chunk in chunks:
        config = getattr(unwrap(chunk), "config", None)
        if config is not None:
            check_compatible(config, names, found)
            mode = cuda_graph_mode(config)
            graphed |= bool(names) and mode is not None and mode.through_offload
    if isinstance(policy, str) or policy is None:
        policy = parse_policy(policy, names or None)
    handle = MegatronOffload(names)
    if names:
        offload.configure(names, min_tensor_bytes=min_tensor_bytes, max_inflight_groups=max_inflight_groups,
                          policy=policy, copies_into_backward=copies_into_backward, device=device)
    try:
        for i, chunk in enumerate(chunks):
            handle.attach_chunk(chunk, i, found[i])
        handle.check_names_exist()
        if graphed:
            handle._undo.append(route_te_graphs())
    except BaseException:
        handle.remove()
        raise
    return handle


def apply_from_args(model: nn.Module | Sequence[nn.Module], args: argparse.Namespace,
                    device: torch.device | str | None = None) -> MegatronOffload:
    """`apply` with the settings of the flags that `add_arguments` added."""
    opts = Options.from_args(args)
    return apply(model, opts.modules, device=device, memory_budget=opts.memory_budget, **opts.engine_settings())


# ------------------------------------------------------------------------------- schedule
def _pp_group_info(kwargs: Mapping[str, Any]) -> tuple[int, int]:
    """(pipeline size, pipeline rank) as the schedule function will see them."""
    p2p = kwargs.get("p2p_communicator")
    if p2p is not None and getattr(p2p, "pp_group", None) is not None:
        return p2p.pp_group.size(), p2p.pp_group.rank()
    pg = kwargs.get("pg_collection")
    if pg is not None and getattr(pg, "pp", None) is not None:
        return pg.pp.size(), pg.pp.rank()
    return (parallel_state.get_pipeline_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_rank())


def megatron_order(forward_backward_func: Callable[..., Any], kwargs: Mapping[str, Any]) -> list[int] | None:
    """The signed order of chunk forwards and backwards that ``forward_backward_func(**kwargs)``
    will run on this rank, or ``None`` when it is not one of Megatron's three schedules (or
    runs the combined 1F1B / forward-only paths), where the engine infers the order itself.

    Mirrors megatron-core: no pipelining runs F B per microbatch; 1F1B warms up with
    ``pp - rank - 1`` forwards; the interleaved schedule walks `schedule_table` and warms up
    with ``2 (pp - rank - 1) + (chunks - 1) · group`` forwards when the config has a virtual
    pipeline size, and ``pp - rank - 1`` when it has none.
    """
    from megatron.core.pipeline_parallel import schedules as msched
    from megatron.core.utils import get_model_config

    if kwargs.get("forward_only") or "model" not in kwargs or "num_microbatches" not in kwargs:
        return None
    fn = getattr(forward_backward_func, "__wrapped__", forward_backward_func)
    model = kwargs["model"]
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    n = int(kwargs["num_microbatches"])
    config = get_model_config(chunks[0])
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        return None  # the combined 1F1B path overlaps microbatches inside one step
    if fn is msched.forward_backward_no_pipelining:
        return [1, -1] * n
    pp, rank = _pp_group_info(kwargs)
    if fn is msched.forward_backward_pipelining_without_interleaving:
        return table_to_order([(mb, 0) for mb in range(n)], 1, min(pp - rank - 1, n))
    if fn is msched.forward_backward_pipelining_with_interleaving:
        group = config.microbatch_group_size_per_vp_stage or pp
        p2p = kwargs.get("p2p_communicator")
        virtual = (p2p.virtual_pipeline_model_parallel_size if p2p is not None
                   else config.virtual_pipeline_model_parallel_size)
        k = len(chunks)
        warmup = pp - rank - 1 if virtual is None else 2 * (pp - rank - 1) + (k - 1) * group
        return table_to_order(schedule_table(n, k, group), k, min(warmup, n * k))
    return None


_last_stats: list[IterationStats | None] = [None]


def wrap_forward_backward_func(forward_backward_func: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a megatron-core ``forward_backward_func`` so each call is one offload iteration.

    Before the call the rank's order goes to ``offload.set_schedule`` (``None`` for a schedule
    it does not know, and for ``forward_only``); after it ``offload.end_iteration()`` runs and
    its statistics are kept (`MegatronOffload.last_stats`). An exception resets the engine
    (``offload.reset()``) before it propagates. Wrapping twice returns the same wrapper.
    """
    if getattr(forward_backward_func, "__offload_wrapped__", False):
        return forward_backward_func

    @functools.wraps(forward_backward_func)
    def run(*args: Any, **kwargs: Any) -> Any:
        offload.set_schedule(megatron_order(forward_backward_func, kwargs))
        try:
            result = forward_backward_func(*args, **kwargs)
        except BaseException:
            offload.reset()
            raise
        _last_stats[0] = offload.end_iteration()
        return result

    run.__offload_wrapped__ = True  # type: ignore[attr-defined]
    return run


# ----------------------------------------------------------------------------- Megatron-LM
_SCHEDULE_HOOKS: list[tuple[Any, str, Any]] = []


def _install_schedule_hook() -> None:
    """Make ``get_forward_backward_func`` hand out wrapped functions, in every loaded Megatron
    module that imported it (Megatron-LM's ``training.py`` does). Rebinds names in memory only."""
    if _SCHEDULE_HOOKS:
        return
    from megatron.core.pipeline_parallel import schedules as msched

    original = msched.get_forward_backward_func

    @functools.wraps(original)
    def get_forward_backward_func(*args: Any, **kwargs: Any) -> Any:
        return wrap_forward_backward_func(original(*args, **kwargs))

    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("megatron") and getattr(mod, "get_forward_backward_func", None) is original:
            _SCHEDULE_HOOKS.append((mod, "get_forward_backward_func", original))
            setattr(mod, "get_forward_backward_func", get_forward_backward_func)


def _remove_schedule_hook() -> None:
    while _SCHEDULE_HOOKS:
        mod, attr, original = _SCHEDULE_HOOKS.pop()
        setattr(mod, attr, original)


def wrap_model_provider(
    model_provider: Callable[..., nn.Module],
    args: argparse.Namespace | Callable[[], argparse.Namespace] | None = None,
) -> Callable[..., nn.Module]:
    """For Megatron-LM's ``pretrain(..., model_provider, ...)``: attach offloading to every
    model chunk the provider builds, and hook the schedule.

    ``args`` defaults to ``megatron.training.get_args``. On the first call the engine is
    configured from the flags (`add_arguments`); each chunk is attached with its
    ``vp_stage`` as chunk id; the names are checked once the last virtual stage is built.
    Without ``--offload-modules`` the provider runs unchanged.
    """
    state: dict[str, Any] = {}

    @functools.wraps(model_provider)
    def provide(*pargs: Any, **kwargs: Any) -> nn.Module:
        chunk = model_provider(*pargs, **kwargs)
        ns = args() if callable(args) else args
        if ns is None:
            from megatron.training import get_args  # Megatron-LM, not megatron-core

            ns = get_args()
        if "handle" not in state:
            opts = Options.from_args(ns)
            if opts.auto:
                raise OffloadError(
                    f"offload: --offload-modules={AUTO} is not wired into Megatron-LM's pretrain yet (its plan is "
                    "made by the wrapped forward_backward_func of apply_from_args(...).wrap(...), in a training loop "
                    "of your own: examples/megatron_gpt.py); give names here")
            check_compatible(getattr(unwrap(chunk), "config", ns), opts.modules, [find_modules(chunk)])
            handle = MegatronOffload(opts.modules)
            if opts.modules:
                param = next(unwrap(chunk).parameters(), None)  # offload from where the model lives
                offload.configure(opts.modules, device=None if param is None else param.device,
                                  **opts.engine_settings())
                _install_schedule_hook()
            state["handle"] = handle
        handle = state["handle"]
        if not handle.enabled:
            return chunk
        vp_stage = kwargs.get("vp_stage", getattr(unwrap(chunk), "vp_stage", None))
        chunk_id = 0 if vp_stage is None else int(vp_stage)
        handle.attach_chunk(chunk, chunk_id)
        vpp = getattr(ns, "virtual_pipeline_model_parallel_size", None) or 1
        if chunk_id == vpp - 1:
            handle.check_names_exist()
        return chunk

    provide.offload_state = state  # type: ignore[attr-defined]
    return provide
