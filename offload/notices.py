"""What the engine tells the user without raising: warnings said once per process, and why
the first iteration offloaded nothing (docs/errors.md lists both)."""

from __future__ import annotations

import warnings
from typing import Iterable, Sequence

from .stats import IterationStats

_said: set[str] = set()


def say_once(key: str, message: str, stacklevel: int = 2) -> None:
    """Warn ``message`` (a `RuntimeWarning`) the first time this process says ``key``."""
    if key in _said:
        return
    _said.add(key)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel + 1)


def nothing_offloaded(stats: IterationStats, modules: Sequence[str], declared: Iterable[str],
                      below_min: Sequence[int], min_tensor_bytes: int) -> str | None:
    """Why an iteration (``stats``) offloaded nothing, with its numbers; ``None`` if it
    offloaded something or offloading is not in use (no name configured, none attached or
    opened). ``declared``: the group names the model has; ``below_min``: saved
    tensors and bytes of the enabled groups that were under ``min_tensor_bytes``."""
    total = stats.total()
    if total.bytes_offloaded:
        return None
    head = "offload: nothing was offloaded in the first iteration: "
    if not modules:
        names = ", ".join(sorted(declared))
        return None if not names else head + (
            f"no module name is configured (group names of the model: {names}); call "
            "offload.configure(modules=...) with the names to offload")
    reasons = []
    if total.groups:
        ran = [n for n in modules if n in stats.by_name and stats.by_name[n].groups]
        reasons.append(f"{total.groups} group(s) of {', '.join(ran)} ran")
    if total.groups_declined:
        reasons.append(f"the group policy declined {total.groups_declined} group(s)")
    if total.groups_recomputed:
        reasons.append(f"{total.groups_recomputed} group(s) ran inside torch.utils.checkpoint (recomputed, not saved)")
    if not reasons:
        return head + (f"no group of the configured names ({', '.join(modules)}) ran while autograd recorded "
                       "a graph outside torch.compile (under torch.no_grad(), as a reentrant checkpoint runs "
                       "its forward, or in code that torch.compile traces: docs/compile.md)")
    tensors, nbytes = below_min
    if tensors:
        reasons.append(f"{tensors} saved tensor(s) of them (storages of {nbytes} bytes in all) were under "
                       f"min_tensor_bytes={min_tensor_bytes}: lower it to offload them")
    if total.groups_kept:
        reasons.append(f"{total.groups_kept} group(s) stayed on the device as the last of their name "
                       "in a chunk (its backward comes next)")
    if total.bytes_held_elsewhere:
        reasons.append(f"{total.bytes_held_elsewhere} bytes stayed because a module that is not offloaded "
                       "saved the same tensors")
    if stats.pinned_failures:
        reasons.append(f"the pinned host pool refused {stats.pinned_failures} buffer(s) (max_pinned_bytes)")
    return head + "; ".join(reasons)


def names_that_free_nothing(stats: IterationStats, modules: Sequence[str]) -> dict[str, str]:
    """The configured names that copied nothing in ``stats`` because everything their groups
    saved was held by something else: per name, what to tell the user. (Groups inside CUDA
    graphs are not in a replayed iteration's statistics: `CaptureSessions.captured_summary`.)"""
    notes = {}
    for name in modules:
        s = stats.by_name.get(name)
        if s is None or s.bytes_offloaded or not s.bytes_held_elsewhere:
            continue
        notes[name] = (
            f"offload: {name!r} copied nothing in iteration {stats.iteration}: the {s.bytes_held_elsewhere} "
            f"bytes its {s.groups} group(s) saved were all held by something else as well (saved by a module "
            "that is not offloaded, or a CUDA graph's output), so copying them would free no device memory. "
            f"Offload what holds them, or drop {name!r} from the names.")
    return notes


def warn_if_nothing_offloaded(stats: IterationStats, modules: Sequence[str], declared: Iterable[str],
                              below_min: Sequence[int], min_tensor_bytes: int) -> None:
    """Warn (a `RuntimeWarning`) with `nothing_offloaded`'s reason, if there is one."""
    note = nothing_offloaded(stats, modules, declared, below_min, min_tensor_bytes)
    if note is not None:
        warnings.warn(note, RuntimeWarning, stacklevel=4)
