"""Fine-grained activation offloading for PyTorch training.

Choose modules by name; the tensors autograd saves inside them go to pinned host memory
during forward (on a side stream, behind compute) and come back just before backward needs
them, with gradients bitwise identical to training without offloading.

    import offload
    offload.configure(modules="core_attn,expert_fc1")
    offload.attach(model, {"core_attn": "layers.*.attn.core", "expert_fc1": "layers.*.mlp.fc1"})
    for batch in data:
        loss = model(batch).sum()
        loss.backward()
        stats = offload.end_iteration()

or around any code: ``with offload.group("core_attn", q, k, v) as (q, k, v): ...``.
Or give a memory budget and let the planner choose what to offload and what to recompute:
``offload.plan(model, mapping, step, memory_budget="-4GiB")`` (docs/planner.md).
See ``docs/design.md`` for how the engine works.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import torch
from torch import nn

from .chunk_handler import ChunkOffloadHandler
from .config import DEFAULT_MIN_TENSOR_BYTES, OffloadConfig, check_device, parse_module_list
from .errors import (OffloadError, OffloadTypeError, OffloadValueError, SavedTensorModifiedError,
                     UnknownModuleError)
from .group_policy import GroupInfo, GroupPolicy
from .manager import PipelineOffloadManager
from .planner.budget import Budget
from . import graphs, presets
from .regions import AttachHandle, attach, group, mark_not_offload, never_offload
from .stats import GroupStats, IterationStats

__version__ = "0.1.0"

__all__ = [
    "AttachHandle",
    "Budget",
    "ChunkOffloadHandler",
    "GroupInfo",
    "GroupPolicy",
    "GroupStats",
    "IterationStats",
    "OffloadConfig",
    "OffloadError",
    "OffloadTypeError",
    "OffloadValueError",
    "PipelineOffloadManager",
    "SavedTensorModifiedError",
    "UnknownModuleError",
    "after_host_sync",
    "attach",
    "begin_chunk",
    "configure",
    "end_iteration",
    "get_manager",
    "graphs",
    "group",
    "mark_not_offload",
    "never_offload",
    "parse_module_list",
    "plan",
    "presets",
    "reset",
    "set_schedule",
    "suspended",
]


def configure(
    modules: str | Iterable[str] = (),
    *,
    min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES,
    max_inflight_groups: int = 1,
    max_pinned_bytes: int | None = None,
    copy_chunk_bytes: int = 16 << 20,
    timing: bool = False,
    policy: GroupPolicy | None = None,
    copies_into_backward: bool = False,
    device: torch.device | str | None = None,
    memory_budget: Budget | str | int | None = None,
    model: nn.Module | None = None,
    mapping: Mapping[str, str] | str | Sequence[str] | None = None,
    step: Callable[[], None] | None = None,
) -> PipelineOffloadManager:
    """Install the process-wide engine with a new `OffloadConfig` (see its fields).

    ``modules`` takes ``"core_attn,expert_fc1"``, ``"core_attn expert_fc1"`` or a list.
    ``policy`` picks which of those groups to offload (`offload.group_policy`; default: all).
    ``device`` defaults to the current CUDA device, or the CPU fallback without CUDA.

    ``modules="auto"`` lets the planner choose, for ``memory_budget`` (``"20GiB"``, ``"-4GiB"``,
    ``"-30%"``, ``"fit:10%"``: `Budget`), which of ``mapping``'s modules of ``model`` to
    offload and which regions to recompute, by profiling ``step()`` (one forward and backward);
    it applies the plan (``attach`` included), prints why, and `offload.planner.active_plan()`
    returns it. The same as `offload.plan` (docs/planner.md), which returns the plan.

    Bad arguments raise `OffloadTypeError` / `OffloadValueError` and leave the engine as it was.
    """
    if isinstance(modules, str) and modules.strip() == "auto":
        if copies_into_backward:
            raise OffloadValueError("offload: with modules='auto' the plan frees the copies in flight when the "
                                    "forward's last group closes, as its memory model assumes; leave "
                                    "copies_into_backward unset")
        _plan_automatically(memory_budget, model, mapping, step, min_tensor_bytes, max_inflight_groups,
                            max_pinned_bytes, copy_chunk_bytes, timing, policy, device)
        return PipelineOffloadManager.get()
    if memory_budget is not None or model is not None or mapping is not None or step is not None:
        raise OffloadValueError("offload: configure()'s memory_budget, model, mapping and step are for "
                                "modules='auto' (the planner); with module names, attach() the model yourself")
    if device is not None:
        device = check_device(device)
    config = OffloadConfig(
        modules=modules,
        min_tensor_bytes=min_tensor_bytes,
        max_inflight_groups=max_inflight_groups,
        max_pinned_bytes=max_pinned_bytes,
        copy_chunk_bytes=copy_chunk_bytes,
        timing=timing,
        policy=policy,
        copies_into_backward=copies_into_backward,
    )
    return PipelineOffloadManager.configure(config, device)


def _plan_automatically(memory_budget: Any, model: Any, mapping: Any, step: Any, min_tensor_bytes: int,
                        max_inflight_groups: int, max_pinned_bytes: int | None, copy_chunk_bytes: int,
                        timing: bool, policy: Any, device: Any) -> None:
    """``configure(modules="auto", ...)``: check the arguments at once, then `plan`."""
    if memory_budget is None:
        raise OffloadValueError("offload: configure(modules='auto') needs memory_budget= ('20GiB', '-4GiB', "
                                "'-30%' or 'fit:10%')")
    Budget.parse(memory_budget)
    missing = [k for k, v in (("model", model), ("mapping", mapping), ("step", step)) if v is None]
    if missing:
        raise OffloadValueError(f"offload: configure(modules='auto') plans on a step of the model: give "
                                f"{', '.join(f'{k}=' for k in missing)} (or call offload.plan(model, mapping, step, budget))")
    if max_inflight_groups != 1 or policy is not None:
        raise OffloadValueError("offload: with modules='auto' the plan chooses max_inflight_groups and offloads "
                                "every group of its names; leave max_inflight_groups and policy unset")
    from .planner import plan as make_plan

    make_plan(model, mapping, step, memory_budget, device=device, min_tensor_bytes=min_tensor_bytes,
              engine={"max_pinned_bytes": max_pinned_bytes, "copy_chunk_bytes": copy_chunk_bytes, "timing": timing})


def __getattr__(name: str) -> Any:
    """`plan` is imported on first use: it brings the workflow tools, which the engine does not need."""
    if name == "plan":
        from .planner import plan

        return plan
    raise AttributeError(f"module 'offload' has no attribute {name!r}")


def get_manager() -> PipelineOffloadManager:
    """The process-wide `PipelineOffloadManager`."""
    return PipelineOffloadManager.get()


def begin_chunk(chunk_id: int = 0, microbatch: int | None = None) -> None:
    """The forward of a model chunk for a new microbatch begins (for pipeline schedules)."""
    PipelineOffloadManager.get().begin_chunk(chunk_id, microbatch)


def set_schedule(order: Sequence[int] | None) -> None:
    """Hand over this rank's pipeline schedule (Megatron's signed ``order``), or ``None``.

    Optional: without it the engine infers the backward order from the chunk forwards.
    With it, every cross-chunk reload is prefetched and the forwards are checked against it.
    `offload.schedules.schedule_order` makes the order from (PP, VPP, microbatches, rank).
    """
    PipelineOffloadManager.get().set_schedule(order)


def end_iteration() -> IterationStats:
    """Close the training iteration and return its statistics."""
    return PipelineOffloadManager.get().end_iteration()


def after_host_sync() -> None:
    """Say that the model has just synchronized with the host (``.cpu()``, ``.item()``,
    ``.tolist()`` of a GPU tensor: an MoE dispatcher reading its token counts). Call it right
    after a sync the model makes every layer: the copies decided since are issued there, so a
    copy has until the next sync to end, and the sync does not wait behind it in the copy
    engine's queue (Note [9] of `offload.copy_queue`). ``attach(..., host_syncs=patterns)`` calls
    it as the matched modules' forward starts, the Megatron integration as each MoE layer's
    experts start. Outside a forward that offloads it does nothing."""
    PipelineOffloadManager.get().after_host_sync()


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """Open no offload group inside the block: the tensors autograd saves there stay on the GPU,
    as without offloading. For a step that must not offload, or the baseline of a step-time
    comparison made in one process (``examples/megatron_gpt.py --alternate-baseline``). Groups
    already open go on, and groups captured in CUDA graphs copy as captured when replayed."""
    manager = PipelineOffloadManager.get()
    manager.suspended += 1
    try:
        yield
    finally:
        manager.suspended -= 1


def reset(release_pool: bool = False) -> None:
    """Forget all groups (after an aborted step); optionally free the pinned pool."""
    PipelineOffloadManager.get().reset(release_pool)
