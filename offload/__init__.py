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
See ``docs/design.md`` for how the engine works.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

from .chunk_handler import ChunkOffloadHandler
from .config import DEFAULT_MIN_TENSOR_BYTES, OffloadConfig, check_device, parse_module_list
from .errors import (OffloadError, OffloadTypeError, OffloadValueError, SavedTensorModifiedError,
                     UnknownModuleError)
from .group_policy import GroupInfo, GroupPolicy
from .manager import PipelineOffloadManager
from . import graphs, presets
from .regions import AttachHandle, attach, group, mark_not_offload, never_offload
from .stats import GroupStats, IterationStats

__version__ = "0.1.0"

__all__ = [
    "AttachHandle",
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
    "presets",
    "reset",
    "set_schedule",
]


def configure(
    modules: str | Iterable[str] = (),
    *,
    min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES,
    max_inflight_groups: int = 1,
    max_pinned_bytes: int | None = None,
    copy_chunk_bytes: int = 16 << 20,
    timing: bool = True,
    policy: GroupPolicy | None = None,
    device: torch.device | str | None = None,
) -> PipelineOffloadManager:
    """Install the process-wide engine with a new `OffloadConfig` (see its fields).

    ``modules`` takes ``"core_attn,expert_fc1"``, ``"core_attn expert_fc1"`` or a list.
    ``policy`` picks which of those groups to offload (`offload.group_policy`; default: all).
    ``device`` defaults to the current CUDA device, or the CPU fallback without CUDA.
    Bad arguments raise `OffloadTypeError` / `OffloadValueError` and leave the engine as it was.
    """
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
    )
    return PipelineOffloadManager.configure(config, device)


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


def reset(release_pool: bool = False) -> None:
    """Forget all groups (after an aborted step); optionally free the pinned pool."""
    PipelineOffloadManager.get().reset(release_pool)
