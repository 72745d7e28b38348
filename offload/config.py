"""The user-facing configuration of the offloading engine."""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Iterable

import torch

from .errors import OffloadTypeError, OffloadValueError, UnknownModuleError
from .group_policy import GroupPolicy

_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")

DEFAULT_MIN_TENSOR_BYTES = 1 << 20
"""Tensors smaller than this stay on the GPU: each copy costs microseconds of launch time
and tiny copies run far below the link's bandwidth."""


def parse_module_list(spec: str | Iterable[str] | None) -> tuple[str, ...]:
    """Turn ``"core_attn,expert_fc1"``, ``"core_attn expert_fc1"`` or a list into names.

    Empty entries are dropped, order is kept and duplicates are removed.
    """
    if spec is None:
        return ()
    if isinstance(spec, str):
        items = re.split(r"[,\s]+", spec)
    elif isinstance(spec, Iterable) and not isinstance(spec, bytes):
        items = []
        for item in spec:
            items.extend(re.split(r"[,\s]+", check_str(item, "a module name")))
    else:
        raise OffloadTypeError(
            f"offload: module names must be a string such as 'core_attn,fc1' or a list of strings, got {spec!r}"
        )
    names: list[str] = []
    for item in items:
        if item and item not in names:
            if not _NAME_RE.match(item):
                raise OffloadValueError(
                    f"offload: {item!r} is not a valid module name "
                    "(letters, digits, '_', '.', '-'; not starting with a digit)"
                )
            names.append(item)
    return tuple(names)


def check_str(value: object, what: str) -> str:
    """``value`` if it is a string, else an `OffloadTypeError` that names it and says what
    ``what`` (a group name, a pattern, ...) has to be."""
    if not isinstance(value, str):
        raise OffloadTypeError(f"offload: {what} must be a string, got {value!r} ({type(value).__name__})")
    return value


def check_int(value: object, what: str, minimum: int = 0, none_ok: bool = False) -> int | None:
    """``value`` if it is an int (not a bool) of at least ``minimum`` (or ``None`` where
    ``none_ok``), else an `OffloadTypeError` or `OffloadValueError` that names it."""
    if value is None and none_ok:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise OffloadTypeError(f"offload: {what} must be an int, got {value!r} ({type(value).__name__})")
    if value < minimum:
        raise OffloadValueError(f"offload: {what} must be >= {minimum}, got {value}")
    return value


def check_device(device: object) -> torch.device:
    """``device`` as a `torch.device` the engine can run on (CUDA, present, or the CPU
    fallback), else an `OffloadValueError` that names it."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise OffloadValueError(
            f"offload: configure()'s device must be 'cuda', 'cuda:N', 'cpu' or None, got {device!r}"
        ) from exc
    if parsed.type not in ("cuda", "cpu"):
        raise OffloadValueError(f"offload: configure()'s device must be a CUDA device or 'cpu', got {device!r}")
    if parsed.type == "cuda" and not torch.cuda.is_available():
        raise OffloadValueError("offload: configure() asked for a CUDA device, but CUDA is not available; "
                                "device='cpu' (or None) runs the CPU fallback")
    return parsed


def check_known(names: Iterable[str], known: Iterable[str], where: str) -> None:
    """Raise `UnknownModuleError` for each name in ``names`` not in ``known``, with suggestions."""
    known = sorted(set(known))
    unknown = [n for n in names if n not in known]
    if not unknown:
        return
    lines = []
    for name in unknown:
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        lines.append(f"{name!r}{hint}")
    raise UnknownModuleError(
        f"offload: unknown module name(s) {', '.join(lines)} in {where}; "
        f"valid names: {', '.join(known) if known else '(none)'}"
    )


@dataclass(frozen=True)
class OffloadConfig:
    """What to offload and how much may be in flight.

    Attributes:
        modules: names of the groups whose saved tensors are offloaded (``core_attn``, ...).
            Groups with other names run normally. A string is split at commas and spaces.
        min_tensor_bytes: saved tensors whose storage is smaller than this stay on the GPU (a
            small view of a large storage is offloaded: kept, it would keep all of it).
        max_inflight_groups: at each group open, before that open issues the copies decided
            since the last one, the compute stream waits (on the GPU, never the host) for the
            oldest copies until at most this many groups have device-to-host copies in flight
            whose GPU memory is still held, so the memory bound holds even when the host runs
            far ahead of the GPU. A group's copies are issued at the group open after its own
            close (Note [7] of `offload.copy_queue`; after the model's next host sync where the
            model says where it syncs, Note [9]) and, with 1, must end by the open after the
            next one that issues copies: with one name, about a layer of compute; with several
            names a layer, what runs between their groups. Raise it when the host is the
            bottleneck and several names are offloaded per layer (waits show up as
            ``offload_wait_ms``); each extra group in flight costs its bytes at the peak.
            The last groups of a chunk, whose copies start when the chunk's forward is over,
            do not make the compute stream wait at once: the bound is applied to them when the
            next group opens, so a pipeline's backward never stalls on a copy just started.
        max_pinned_bytes: a cap on the pinned host pool; past it tensors stay on the GPU (with
            one warning). ``None`` means no cap.
        copy_chunk_bytes: each tensor's copy is issued in pieces of at most this many bytes
            (0: one copy per tensor); each piece is one more ``cudaMemcpyAsync`` call, about
            5 us of host time. Pieces do not shorten a model's own host sync: a small
            device-to-host copy (``.item()``, ``.tolist()``: MoE token counts) queued during an
            offload waits for the rest of the queued transfer, pieces or not, because the copy
            engine serves copies in the order they were queued (H100 measurements:
            docs/results/copy_chunks.md).
        timing: time every iteration's copies and waits with CUDA events, so that each
            iteration's statistics report copy bandwidth and the time the compute stream
            waited. Costs a few events per group and a host wait for them at
            ``end_iteration()``: about 10 ms of host time per step for 112 groups on an H100
            host (docs/megatron.md, the engine's host time). ``False`` (the default) times only
            the three early iterations the copy-wait notice measures (`offload.copy_wait`),
            whose statistics carry the times; the others report zero times.
        policy: which groups of the enabled names to offload, decided per group from its
            `GroupInfo` (layer, chunk, microbatch, schedule phase, live microbatches); see
            `offload.group_policy`. ``None`` offloads all of them.
        copies_into_backward: where the compute stream waits for the copies still in flight at
            the end of a chunk's forward that its own backward follows. ``False`` (the default):
            when the forward's last group closes, so their memory is free before the forward's
            tail (the last layer's remaining modules, the head, the loss), where a step's memory
            often peaks. ``True``: when the backward starts (its first group's backward), so the
            copies also run under the tail and the backward's first modules; their bytes are
            held through the tail, which costs nothing where the step's peak lies later in the
            backward (Transformer Engine's fused attention backward, for one) and costs up to
            those bytes where the forward's end is the peak (`offload.chunk_lifecycle`, The
            forward's end). For copies that need about as much time as the forward's compute.
    """

    modules: tuple[str, ...] = ()
    min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES
    max_inflight_groups: int = 1
    max_pinned_bytes: int | None = None
    copy_chunk_bytes: int = 16 << 20
    timing: bool = False
    policy: GroupPolicy | None = None
    copies_into_backward: bool = False
    enabled: frozenset = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", parse_module_list(self.modules))
        object.__setattr__(self, "enabled", frozenset(self.modules))
        check_int(self.min_tensor_bytes, "min_tensor_bytes")
        check_int(self.max_inflight_groups, "max_inflight_groups", 1)
        check_int(self.copy_chunk_bytes, "copy_chunk_bytes")
        check_int(self.max_pinned_bytes, "max_pinned_bytes (or None)", none_ok=True)
        if not isinstance(self.copies_into_backward, bool):
            raise OffloadTypeError(f"offload: copies_into_backward must be True or False, got "
                                   f"{self.copies_into_backward!r} ({type(self.copies_into_backward).__name__})")
        if self.policy is not None and not callable(self.policy):
            raise OffloadTypeError(
                f"offload: policy must be a callable (GroupInfo) -> bool or None, got {self.policy!r}"
            )
