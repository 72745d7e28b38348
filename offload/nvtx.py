"""NVTX ranges for every offload and reload, named ``offload/<group label>`` and
``reload/<group label>`` (for example ``offload/core_attn/L3/mb2``), so an ``nsys`` timeline
shows which copy belongs to which module. Uses the ``nvtx`` package when installed (nothing
when no tool is attached), else ``torch.cuda.nvtx`` where CUDA is available, else nothing (a
CPU build of torch raises on ``torch.cuda.nvtx``); picked at the first range, not at import."""

from __future__ import annotations

from typing import Callable

import torch


def _noop(message: str) -> None:
    pass


def _noop_pop() -> None:
    pass


def _pick() -> tuple[Callable[[str], None], Callable[[], None]]:
    try:
        import nvtx as _nvtx
    except ImportError:
        pass
    else:
        # What `nvtx.push_range(..., domain="offload")` looks up on every call, looked up once:
        # a domain, or a dummy when no tool is attached (decided once per process either way).
        domain = _nvtx.get_domain("offload")
        if not isinstance(domain, _nvtx.Domain):
            return _noop, _noop_pop
        return (lambda message: domain.push_range(message=message, color="blue")), domain.pop_range
    if torch.cuda.is_available():
        return torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    return _noop, _noop_pop


_backend: tuple[Callable[[str], None], Callable[[], None]] | None = None


def push(message: str) -> None:
    """Open the range ``message``. The first range picks the backend: importing ``offload``
    must not query CUDA (that starts the driver, and a process forked afterwards cannot use it)."""
    (_backend or _bind())[0](message)


def pop() -> None:
    """Close the innermost range."""
    (_backend or _bind())[1]()


def _bind() -> tuple[Callable[[str], None], Callable[[], None]]:
    global _backend
    _backend = _pick()
    return _backend
