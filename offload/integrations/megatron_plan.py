"""``--offload-modules=auto`` in the Megatron integration: what the plan may choose, what it
cannot plan yet, and the machinery of planning inside the first ``forward_backward_func`` call.

`offload.integrations.megatron.MegatronOffload` owns the plan and its hooks; this module gives
it the pieces (docs/megatron.md, "--offload-modules=auto"):

* `check_auto`: the configurations a plan cannot handle yet, refused with the flag named;
* `plan_mapping`: the integration's names that the planner can choose (one module per layer);
* `auto_settings`: what `apply` checks for ``auto`` before the first call (`AutoSettings`);
* `Untouched`, `peek`/`replay`: planning steps that leave no trace on training (gradients,
  random states, buffers, the MoE aux-loss tracker; the call's first microbatch put back);
* `agree`: rank 0's plan on every rank; `tracker_context`: Megatron's RNG tracker restored for
  the plan's recompute.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

import offload
from offload.errors import OffloadError, OffloadValueError, UnknownModuleError
from offload.planner.budget import Budget

from .megatron import unwrap
from .megatron_graphs import cuda_graph_mode
from .megatron_names import AUTO, NAMES, ChunkModules, find_modules, module_patterns

__all__ = ["AutoSettings", "Untouched", "agree", "auto_settings", "check_auto", "peek", "plan_mapping", "rank",
           "replay", "tracker_context"]


def check_auto(config: Any, chunks: int = 1) -> None:
    """Raise `OffloadError`, naming the flags, when ``config`` (a megatron-core
    ``TransformerConfig`` or Megatron-LM's args) asks for what ``--offload-modules=auto``
    cannot plan yet; ``chunks`` is the number of model chunks on this rank.

    The plan is made on one microbatch of the no-pipelining schedule and modelled as one
    forward followed by its backward (`MegatronOffload.wrap`), and its recompute
    runs through ``torch.utils.checkpoint``. So: no pipeline or virtual pipeline (several
    microbatches in flight), no Megatron recompute (the plan chooses recompute), no CUDA graphs
    (a replayed graph runs without the plan's hooks and checkpoints), no FP8 (a checkpoint's
    recompute does not re-enter Transformer Engine's FP8 autocast), no MoE expert bias (the
    recompute would count the router's tokens twice), no combined-1F1B MoE overlap (two
    microbatches at once), and none of Megatron's own offloading.
    """
    flag = f"--offload-modules={AUTO}"
    for attr, why in _REFUSED_SWITCHES:
        if getattr(config, attr, None):
            raise OffloadError(f"offload: {flag}{why}")
    pp = getattr(config, "pipeline_model_parallel_size", 1) or 1
    vpp = getattr(config, "virtual_pipeline_model_parallel_size", None)
    if pp > 1 or vpp is not None or chunks > 1:
        what = (f"--pipeline-model-parallel-size {pp}" if pp > 1 else
                f"--virtual-pipeline-model-parallel-size {vpp or chunks}")
        raise OffloadError(
            f"offload: {flag} cannot plan a pipeline yet ({what}; --pp/--vpp in examples/megatron_gpt.py): the "
            "plan models one microbatch's forward followed by its backward, and a pipeline schedule keeps several "
            "microbatches in flight. Give names (--offload-modules core_attn,fc1) with pipelining.")
    mode = cuda_graph_mode(config)
    if mode is not None:
        raise OffloadError(
            f"offload: {flag}: Megatron's CUDA graphs are on ({mode.flags}); a replayed graph runs without the "
            f"plan's offload hooks and checkpoints. Use --cuda-graph-impl none with {flag}.")
    granularity = getattr(config, "recompute_granularity", None)
    if granularity:
        raise OffloadError(
            f"offload: {flag} chooses what to recompute itself (torch.utils.checkpoint on the layers' "
            f"containers); --recompute-granularity {granularity} would recompute under it. Drop "
            f"--recompute-granularity/--recompute-modules, or give names instead of {AUTO}.")


_REFUSED_SWITCHES = (
    ("fine_grained_activation_offloading",
     " plans this library's offloading, and Megatron's own fine-grained activation offloading "
     "(--fine-grained-activation-offloading; --system megatron in examples/megatron_gpt.py) is on: both would "
     "hook the same saved tensors. Switch Megatron's off."),
    ("cpu_offloading",
     ": Megatron's layer-level CPU offloading (--cpu-offloading) is on; it hooks the same saved tensors. Use one "
     "of the two."),
    ("fp8",
     " with FP8 (--fp8-format; --fp8 in examples/megatron_gpt.py): the plan's recompute runs through "
     "torch.utils.checkpoint, which does not re-enter Transformer Engine's FP8 autocast, so a recomputed layer "
     "would not compute what its forward did. Give names instead of auto with FP8."),
    ("moe_router_enable_expert_bias",
     " with --moe-router-enable-expert-bias: the router counts tokens per expert whenever it runs with gradients "
     "on, and a torch.utils.checkpoint recompute runs it so a second time (Megatron's own recompute runs the "
     "first pass without gradients), which would skew the expert bias. Give names instead of auto."),
    ("overlap_moe_expert_parallel_comm",
     ": --overlap-moe-expert-parallel-comm runs two microbatches at once (the combined 1F1B path); the plan "
     "models one. Drop one of the two."),
)
"""Config switches that `check_auto` refuses: (attribute, the error after the flag)."""


_LEFT_OUT_ACT = ("code between fc1 and fc2, not a module: the planner times and attributes saves by module; "
                 "recomputing a container around it covers it")


def plan_mapping(chunk: nn.Module, found: ChunkModules | None = None) -> tuple[dict[str, str], dict[str, str]]:
    """The names of `NAMES` the planner can choose for ``chunk``, each as the one module pattern
    `offload.plan` takes (relative to ``chunk``), and the names ``chunk`` has that it cannot,
    with why.

    A name is plannable when it is one module per transformer layer whose group is that module:
    ``mlp_act``/``moe_act`` are code, not modules; a SequentialMLP's ``expert_fc1`` group holds
    only the experts' fc1s, not the module the planner would profile; ``expert_fc2`` of a
    SequentialMLP and MLA's ``qkv_linear`` are several modules per layer.
    """
    found = find_modules(chunk) if found is None else found
    all_names = [qn for qn, _ in chunk.named_modules() if qn]
    mapping: dict[str, str] = {}
    left: dict[str, str] = {}
    for name in NAMES:
        if name not in found.names:
            continue
        qns = found.modules.get(name, [])
        if name in found.act_regions:
            left[name] = _LEFT_OUT_ACT
        elif name == "expert_fc1" and found.sequential_experts:
            left[name] = ("a SequentialMLP's expert_fc1 group holds only the experts' fc1s, not the experts module "
                          "the planner would profile")
        elif len(qns) != found.num_layers:
            left[name] = f"{len(qns)} modules in {found.num_layers} layers; the planner takes one module per layer"
        else:
            patterns = module_patterns(qns, all_names)
            if len(patterns) == 1:
                mapping[name] = patterns[0]
            else:
                left[name] = "no single module pattern matches exactly its modules"
    return mapping, left


@dataclass
class AutoSettings:
    """What `apply` checked for ``--offload-modules=auto``, for the plan on the first call."""

    chunk: nn.Module
    found: ChunkModules
    mapping: dict[str, str]
    left_out: dict[str, str]
    budget: Budget
    min_tensor_bytes: int
    device: torch.device | str | None
    bandwidth: Any
    check_steps: int
    verbose: bool

    def notes(self) -> list[str]:
        """What the table says about how the Megatron plan was made."""
        out = [f"Megatron: planned on one microbatch of forward_backward_no_pipelining (each microbatch's forward "
               f"and backward run before the next one's, so its peak is the step's), before the optimizer's first "
               f"step allocates its states; the names it could choose: {', '.join(self.mapping)}."]
        if self.left_out:
            out.append("Not planned: " + "; ".join(f"{n} ({why})" for n, why in self.left_out.items()) + ".")
        return out


def auto_settings(chunks: list[nn.Module], found: list[ChunkModules], budget: Budget, *, min_tensor_bytes: int,
                  device: torch.device | str | None, bandwidth: Any, check_steps: int, verbose: bool) -> AutoSettings:
    """`apply` for ``auto``: check everything that can be checked before the first call, and
    configure an engine that offloads nothing until the plan is made."""
    for chunk in chunks:
        config = getattr(unwrap(chunk), "config", None)
        if config is not None:
            check_auto(config, len(chunks))
    if len(chunks) > 1:
        check_auto(None, len(chunks))
    if isinstance(check_steps, bool) or not isinstance(check_steps, int) or check_steps < 0:
        raise OffloadValueError(f"offload: apply()'s check_steps must be an int >= 0, got {check_steps!r}")
    mapping, left = plan_mapping(chunks[0], found[0])
    if not mapping:
        why = "; ".join(f"{n}: {w}" for n, w in left.items()) or "no transformer layer in the model chunk"
        raise UnknownModuleError(f"offload: --offload-modules={AUTO} finds no module name to plan in this "
                                 f"model ({why})")
    offload.configure((), min_tensor_bytes=min_tensor_bytes, device=device)
    return AutoSettings(chunks[0], found[0], mapping, left, budget, min_tensor_bytes, device, bandwidth, check_steps,
                        verbose)


def rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def agree(plan: Any) -> None:
    """Give every rank rank 0's assignment: recomputing different regions on the ranks of a
    tensor-parallel group would run different collectives in backward. Each rank keeps its own
    profile, so its prediction is made again for rank 0's choice."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    box = [plan.assignment]
    dist.broadcast_object_list(box, src=0)
    if box[0] == plan.assignment:
        return
    from offload.planner.check import predicted_step_ms
    from offload.planner.planning import describe
    from offload.planner.search import explain
    from offload.tools.advisor import Model

    model = Model(plan.profile, plan.bandwidth)
    own = describe(plan.assignment)
    plan.assignment = box[0]
    plan.prediction = box[0].predict(model)
    plan.predicted_step_ms = predicted_step_ms(plan.profile, plan.prediction)
    plan.predicted_peak_bytes = plan.prediction.peak_bytes
    plan.rows = explain(model, box[0], plan.prediction)
    plan.notes.append(f"Rank 0's plan, applied on every rank (this rank's own profile chose: {own}).")


def tracker_context() -> tuple[Any, Any]:
    """``context_fn`` for the plan's checkpoints: their recompute sees Megatron's model-parallel
    RNG tracker as their forward saw it (dropout inside ``get_cuda_rng_tracker().fork()``, as in
    core attention), which ``torch.utils.checkpoint`` alone does not restore. Megatron's own
    ``tensor_parallel.checkpoint`` does the same."""
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    tracker = get_cuda_rng_tracker()
    at_forward = tracker.get_states()

    @contextlib.contextmanager
    def recompute() -> Any:
        now = tracker.get_states()
        tracker.set_states(dict(at_forward))  # a copy: the recompute's forks write into it
        try:
            yield
        finally:
            tracker.set_states(now)

    return contextlib.nullcontext(), recompute()


class Untouched:
    """What the planning steps change and `restore` puts back (`MegatronOffload.wrap`).

    Refuses to start from gradients that are not zero: the steps zero them, and a call that
    accumulates into earlier gradients would lose them.
    """

    def __init__(self, chunk: nn.Module, models: list[Any]) -> None:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        self.models = [m for m in models if isinstance(m, nn.Module)]
        self.params = list(chunk.parameters())
        grads = [(n, g) for n, p in chunk.named_parameters()
                 for g in (p.grad, getattr(p, "main_grad", None)) if isinstance(g, torch.Tensor)]
        if grads:
            nonzero = torch.stack([g.ne(0).any() for _, g in grads]).tolist()
            dirty = [n for (n, _), bad in zip(grads, nonzero) if bad]
            if dirty:
                raise OffloadError(
                    f"offload: --offload-modules={AUTO} plans on the first call of forward_backward_func, running "
                    "extra forward and backward passes and zeroing the gradients after them, and this call starts "
                    f"with gradients that are not zero ({', '.join(dirty[:3])}{', ...' if len(dirty) > 3 else ''}). "
                    "Zero them before the call (optimizer.zero_grad(), or zero_grad_buffer() with Megatron's DDP).")
        self.had_grad = [p.grad is not None for p in self.params]
        # through _buffers: Megatron's DDP has an attribute `buffers` (its gradient buffers)
        self.buffers = [(b, b.detach().clone()) for m in chunk.modules() for b in m._buffers.values() if b is not None]
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self.tracker = get_cuda_rng_tracker()
        self.tracker_states = self.tracker.get_states()
        self.aux = _aux_losses()
        self.aux_values = {name: entry["values"].clone() for name, entry in self.aux.items()}

    def zero_grads(self) -> None:
        """Zero the gradients as a training loop does before a step."""
        for m in self.models:
            if callable(getattr(m, "zero_grad_buffer", None)):
                m.zero_grad_buffer()  # Megatron's DDP: main_grad buffers and bucket state
        for p in self.params:
            if p.grad is not None:
                p.grad.zero_()

    def restore(self) -> None:
        self.zero_grads()
        for p, had in zip(self.params, self.had_grad):
            if not had:
                p.grad = None
        with torch.no_grad():
            for b, saved in self.buffers:
                b.copy_(saved)
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state_all(self.cuda_rng)
        self.tracker.set_states(dict(self.tracker_states))
        for name, entry in self.aux.items():
            if name in self.aux_values:
                entry["values"].copy_(self.aux_values[name])
            else:
                entry["values"].zero_()


def _aux_losses() -> dict[str, Any]:
    """Megatron's MoE aux-loss logging tracker (name -> entry with ``values``), or ``{}``."""
    try:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker
    except ImportError:  # pragma: no cover - megatron-core without MoE utils
        return {}
    return get_moe_layer_wise_logging_tracker()


class _Replay:
    """A data iterator that yields a copy of one microbatch every time (the planning steps) and
    otherwise behaves like the iterator it stands for (attributes are the original's)."""

    def __init__(self, item: Any, source: Any) -> None:
        self._item, self._source = item, source

    def __iter__(self) -> "_Replay":
        return self

    def __next__(self) -> Any:
        try:
            return copy.deepcopy(self._item)
        except (TypeError, copy.Error):  # not copyable: the item itself
            return self._item

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)


class _Prepend:
    """The call's data iterator with the microbatch taken from it for planning put back in front."""

    def __init__(self, item: Any, source: Any) -> None:
        self._first, self._source = [item], source

    def __iter__(self) -> "_Prepend":
        return self

    def __next__(self) -> Any:
        return self._first.pop() if self._first else next(self._source)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._source, name)


def peek(data: Any) -> tuple[Any, Any]:
    """(the first microbatch, the data iterator for the call itself). ``None`` stays ``None``
    (ranks that get their data from another rank); a list holds one iterator per chunk."""
    if isinstance(data, list):
        if len(data) != 1:
            raise OffloadValueError(f"offload: --offload-modules={AUTO} plans one model chunk; got {len(data)} "
                                    "data iterators")
        first, rest = peek(data[0])
        return first, [rest]
    if data is None:
        return None, None
    first = next(data)
    return first, _Prepend(first, data)


def replay(data: Any, first: Any) -> Any:
    """A planning step's data iterator, shaped like the call's (`peek`)."""
    if isinstance(data, list):
        return [replay(data[0], first)]
    return None if data is None else _Replay(first, data)
