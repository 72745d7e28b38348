"""Which enabled groups to offload: a decision per group, from where it runs in the schedule.

The config's ``modules`` says which names *may* be offloaded. A group policy decides, for
each group of such a name as it opens, whether this one is: it sees a `GroupInfo` (name,
layer, chunk, microbatch, the schedule phase and how many chunk forwards are live) and
returns ``True`` to offload it, ``False`` to leave its tensors on the GPU.

The default (``policy=None``) offloads every group of an enabled name; only the last-layer
rule keeps groups back. It needs no tuning: each offloaded byte leaves the GPU while other
work runs, so a rank that holds more microbatches at its peak (the first pipeline ranks)
saves more, in proportion. A policy spends that differently: offload only where memory is
short, and keep the copy engine idle elsewhere. Any callable ``(GroupInfo) -> bool`` works;
the helpers below build common ones. A policy runs once per group opening, on the host.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Literal, Mapping

import torch

__all__ = ["GroupInfo", "GroupPolicy", "by_layer", "by_name", "min_live", "warmup_only"]


@dataclass(frozen=True)
class GroupInfo:
    """Where a group runs; what a `GroupPolicy` decides from.

    ``layer`` counts the invocations of ``name`` in this chunk forward (0, 1, ...), whether or
    not earlier ones were offloaded. ``phase`` is ``"warmup"`` before the rank's first backward
    of the iteration and ``"steady"`` after it. ``live`` is the number of chunk forwards whose
    backward has not run yet, this one included: the microbatch activations the rank holds.
    ``max_live`` is the most the rank holds in this iteration, known only when the schedule
    was given (``offload.set_schedule``); ``None`` otherwise.
    """

    name: str
    layer: int
    chunk_id: int
    microbatch: int
    phase: Literal["warmup", "steady"]
    live: int
    max_live: int | None
    iteration: int


GroupPolicy = Callable[[GroupInfo], bool]


def inside_checkpoint() -> bool:
    """Whether the innermost saved-tensor hooks are those of a non-reentrant
    `torch.utils.checkpoint` forward, which drops what is saved and recomputes it: a group
    there is not offloaded (a reentrant checkpoint's forward runs under ``no_grad``)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if top is None:
        return False
    pack = top[0]
    return getattr(pack, "__module__", None) == "torch.utils.checkpoint" and getattr(
        pack, "__qualname__", ""
    ).startswith("_checkpoint_hook.")


def by_layer(layers: Iterable[int] | Callable[[int], bool]) -> GroupPolicy:
    """Offload only the groups of these layers (a set of indices, or a predicate on them).

    ``by_layer(range(0, 6))`` offloads the first six invocations of each name per chunk.
    """
    if callable(layers):
        pred = layers
    else:
        allowed = frozenset(int(i) for i in layers)
        pred = allowed.__contains__
    return lambda info: bool(pred(info.layer))


def min_live(count: int) -> GroupPolicy:
    """Offload a chunk's groups only while at least ``count`` chunk forwards are live.

    The ranks at the end of a pipeline hold one or two microbatches and gain little; the
    first ones hold many. ``min_live(2)`` offloads only where a second microbatch's
    activations are also on the rank; with one chunk and no pipelining it offloads nothing.
    """
    if not isinstance(count, int) or count < 1:
        raise ValueError(f"offload: min_live needs an int >= 1, got {count!r}")
    return lambda info: info.live >= count


def warmup_only(info: GroupInfo) -> bool:
    """Offload the groups of warm-up forwards only (their activations wait longest)."""
    return info.phase == "warmup"


def by_name(policies: Mapping[str, GroupPolicy | None], default: GroupPolicy | None = None) -> GroupPolicy:
    """Each name its own policy (``None``: every group of it), ``default`` for the names not
    in ``policies`` (``None``: every group).

    ``by_name({"expert_fc1": by_layer({0})}, by_layer(range(3)))`` offloads the experts' fc1
    input of the first layer only and the other names' groups of the first three layers: a
    name whose copies take longer than the compute they run under, on fewer layers.
    """
    for name, policy in policies.items():
        if policy is not None and not callable(policy):
            raise TypeError(f"offload: by_name's policy for {name!r} must be a callable or None, got {policy!r}")
    if default is not None and not callable(default):
        raise TypeError(f"offload: by_name's default must be a callable or None, got {default!r}")
    table = dict(policies)

    def policy(info: GroupInfo) -> bool:
        chosen = table.get(info.name, default)
        return chosen is None or bool(chosen(info))

    return policy
