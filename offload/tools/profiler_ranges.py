"""The engine's NVTX ranges, mirrored as ``torch.profiler`` ranges.

``torch.profiler`` does not record NVTX ranges, so a trace alone cannot say which copy belongs
to which group. Inside ``with profiler_ranges():`` every range the engine opens through
`offload.nvtx` (``offload/core_attn/L3/mb0``, ``reload/...``) is also a ``record_function``
range of the same name; the NVTX range is still pushed, for nsys. Ranges are per thread (the
engine reloads from autograd's backward thread too).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator

from torch.autograd.profiler import record_function

from .. import nvtx


@contextmanager
def profiler_ranges() -> Iterator[None]:
    """Mirror `offload.nvtx` ranges into ``torch.profiler`` while the block runs."""
    orig_push, orig_pop = nvtx.push, nvtx.pop
    local = threading.local()

    def push(message: str) -> None:
        orig_push(message)
        rf = record_function(message)
        rf.__enter__()
        local.__dict__.setdefault("stack", []).append(rf)

    def pop() -> None:
        local.stack.pop().__exit__(None, None, None)
        orig_pop()

    nvtx.push, nvtx.pop = push, pop
    try:
        yield
    finally:
        nvtx.push, nvtx.pop = orig_push, orig_pop
