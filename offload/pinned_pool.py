"""A pool of page-locked (pinned) host buffers, reused across iterations.

Why not ``torch.empty(..., pin_memory=True)``: PyTorch's caching host allocator rounds every
request up to a power of two (up to ~2x the bytes), and a fresh ``cudaHostAlloc`` costs
milliseconds, which ruins overlap if it happens on the hot path. This pool

* maps each buffer with anonymous ``mmap`` (page-aligned, so no two buffers share a page)
  and pins it with ``cudaHostRegister``: the bytes pinned are the bytes asked for, rounded
  to a size class at most 1/32 larger;
* allocates only on a miss: in steady state (same activation sizes every iteration) it
  allocates nothing after the first iteration. Sizes that change every iteration (a mixture of
  experts' per-expert inputs, whose token counts follow the routing) take the smallest free
  buffer of at most twice their size class, so the pool stops growing once it holds buffers
  for the largest sizes seen, instead of allocating (milliseconds each) every iteration;
* remembers, for each buffer, the event of the last host-to-device copy that read it, so
  the next device-to-host copy into it waits for that read on the GPU (no host sync).

On the CPU fallback the buffers are ordinary (pageable) host tensors.
"""

from __future__ import annotations

import bisect
import mmap
import time
import warnings
from typing import Any

import torch

from .errors import OffloadError

_PAGE = mmap.PAGESIZE


def size_class(nbytes: int) -> int:
    """Round ``nbytes`` up to its pool size class: a page multiple, at most ~3% larger."""
    if nbytes <= _PAGE:
        return _PAGE
    granule = max(_PAGE, 1 << max(0, nbytes.bit_length() - 6))
    return -(-nbytes // granule) * granule


class HostBuffer:
    """One pinned buffer: a flat ``uint8`` tensor plus the event of its last reader."""

    __slots__ = ("tensor", "nbytes", "last_read", "_mapping", "_registered", "_view", "_view_dtype", "_view_numel")

    def __init__(self, tensor: torch.Tensor, mapping: Any, registered: bool) -> None:
        self.tensor = tensor
        self.nbytes = tensor.numel()
        self.last_read = None
        self._mapping = mapping
        self._registered = registered
        self._view: torch.Tensor | None = None
        self._view_dtype: torch.dtype | None = None
        self._view_numel = -1

    def view(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The first ``numel`` elements of the buffer, as ``dtype`` (the last view is kept: a
        buffer is reused by tensors of the same shape step after step)."""
        if self._view_dtype is not dtype or self._view_numel != numel:
            self._view = self.tensor[: numel * dtype.itemsize].view(dtype)
            self._view_dtype = dtype
            self._view_numel = numel
        return self._view


class PinnedHostPool:
    """Free lists of `HostBuffer` by size class, with statistics on what was pinned."""

    def __init__(self, pin: bool, max_bytes: int | None = None) -> None:
        self.pin = pin
        self.max_bytes = max_bytes
        self._free: dict[int, list[HostBuffer]] = {}
        self._classes: list[int] = []  # the keys of `_free`, sorted
        self._all: list[HostBuffer] = []
        self.bytes_total = 0
        self.bytes_in_use = 0
        self.peak_bytes_in_use = 0
        self.allocations = 0
        self.alloc_seconds = 0.0
        self.failures = 0
        self._warned = False

    def acquire(self, nbytes: int, capturing: bool = False) -> HostBuffer | None:
        """A free buffer of at least ``nbytes``, or ``None`` when none can be had.

        ``None`` means: keep the tensor on the GPU. That happens when pinning fails or when the
        pool's cap would be passed. During a CUDA graph capture a miss raises `OffloadError`:
        the graph would bake in a buffer allocated on the capture's critical path (or, before
        torch 2.11, fail the capture), so every buffer a capture uses must exist before it, from
        an eager warm-up of the same region (see `offload.graphs`).
        """
        cls = _PAGE if nbytes <= _PAGE else size_class(nbytes)
        free = self._free.get(cls)
        if not free:  # a capture takes any larger buffer rather than fail
            free = self._smallest_larger(cls, None if capturing else 2 * cls)
        if free:
            buf = free.pop()
        else:
            if capturing:
                raise OffloadError(
                    f"offload: a pinned host buffer of {nbytes} bytes was needed while a CUDA graph "
                    "was being captured, and the pool has none free of that size. Run the captured "
                    "region eagerly with the same shapes first (offload.graphs.make_graphed_callables "
                    "does), so the buffers exist before the capture."
                )
            if self.max_bytes is not None and self.bytes_total + cls > self.max_bytes:
                self._fail(f"the pinned pool would pass its cap of {self.max_bytes} bytes")
                return None
            buf = self._allocate(cls)
            if buf is None:
                return None
        self.bytes_in_use += buf.nbytes
        if self.bytes_in_use > self.peak_bytes_in_use:
            self.peak_bytes_in_use = self.bytes_in_use
        return buf

    def release(self, buf: HostBuffer, last_read: Any = None) -> None:
        """Return ``buf``; ``last_read`` is the event of the last copy that read it, if any."""
        if last_read is not None:
            buf.last_read = last_read
        self.bytes_in_use -= buf.nbytes
        free = self._free.get(buf.nbytes)
        if free is None:
            free = self._free[buf.nbytes] = []
            bisect.insort(self._classes, buf.nbytes)
        free.append(buf)

    def _smallest_larger(self, cls: int, limit: int | None) -> list[HostBuffer] | None:
        """The free list of the smallest class above ``cls`` (and at most ``limit``) that has a
        free buffer, or ``None``."""
        classes = self._classes
        for i in range(bisect.bisect_right(classes, cls), len(classes)):
            c = classes[i]
            if limit is not None and c > limit:
                return None
            if self._free[c]:
                return self._free[c]
        return None

    @property
    def num_buffers(self) -> int:
        return len(self._all)

    def close(self) -> None:
        """Unpin and free every buffer. Only call this when no copy can still use them."""
        for buf in self._all:
            if buf._registered:
                torch.cuda.cudart().cudaHostUnregister(buf.tensor.data_ptr())
            buf.tensor = None
            buf._mapping = None
        self._all.clear()
        self._free.clear()
        self._classes.clear()
        self.bytes_total = self.bytes_in_use = 0

    def _allocate(self, nbytes: int) -> HostBuffer | None:
        start = time.perf_counter()
        try:
            if self.pin:
                mapping = mmap.mmap(-1, nbytes)
                tensor = torch.frombuffer(mapping, dtype=torch.uint8)
                err = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), nbytes, 0)
                if int(err) != 0:
                    raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with {err}")
                buf = HostBuffer(tensor, mapping, registered=True)
            else:
                buf = HostBuffer(torch.empty(nbytes, dtype=torch.uint8), None, registered=False)
        except (RuntimeError, OSError, ValueError) as exc:
            self._fail(f"allocating {nbytes} bytes of pinned host memory failed: {exc}")
            return None
        self.alloc_seconds += time.perf_counter() - start
        self.allocations += 1
        self.bytes_total += nbytes
        self._all.append(buf)
        return buf

    def _fail(self, why: str) -> None:
        self.failures += 1
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"offload: {why}; the tensors concerned stay on the GPU (said once).",
                RuntimeWarning,
                stacklevel=4,
            )
