"""NVTX ranges for every offload and reload, named ``offload/<group label>`` and
``reload/<group label>`` (for example ``offload/core_attn/L3/mb2``), so an ``nsys`` timeline
shows which copy belongs to which module. Uses the ``nvtx`` package when installed, else
``torch.cuda.nvtx`` on CUDA builds, else nothing (a CPU build of torch raises on
``torch.cuda.nvtx``)."""

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

        return (lambda message: _nvtx.push_range(message, domain="offload")), (
            lambda: _nvtx.pop_range(domain="offload")
        )
    except ImportError:
        pass
    if torch.cuda.is_available():
        return torch.cuda.nvtx.range_push, torch.cuda.nvtx.range_pop
    return _noop, _noop_pop


push, pop = _pick()
