"""Copy streams and events: the only place that talks to CUDA's stream API.

The engine orders its copies with events and stream waits alone (never a host
synchronization). `CudaStreams` does this on a CUDA device; `HostStreams` is the CPU
fallback with the same interface, where every operation completes at once, so the whole
engine's logic runs (and is tested) on machines without a GPU.

Never cache "the compute stream": frameworks and autograd switch streams, so the engine
reads `current()` at the moment it needs it, and never inside a ``with stream(s):`` block
(where the current stream is ``s`` itself, and a wait on it would be a no-op).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class _HostEvent:
    """An event of the CPU fallback: work is synchronous, so it is always complete."""

    __slots__ = ()

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "_HostEvent") -> float:
        return 0.0


class _HostStream:
    """A stream of the CPU fallback; waits are no-ops because copies complete at once."""

    __slots__ = ()

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass


class HostStreams:
    """CPU fallback of `CudaStreams`: host copies in place of device copies."""

    is_cuda = False

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.d2h = _HostStream()
        self.h2d = _HostStream()
        self._stream = _HostStream()
        self._event = _HostEvent()

    def current(self) -> _HostStream:
        return self._stream

    def current_id(self) -> int:
        return 0

    def event(self, timing: bool = False) -> _HostEvent:
        return self._event

    def use(self, stream: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def is_capturing(self) -> bool:
        return False


    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on the device this engine offloads from."""
        return tensor.device.type == "cpu"


class CudaStreams:
    """The device-to-host and host-to-device side streams of one CUDA device."""

    is_cuda = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self._index)
        self.d2h = torch.cuda.Stream(self.device)
        self.h2d = torch.cuda.Stream(self.device)
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._raw_current = (lambda: raw(self._index)) if raw is not None else (
            lambda: torch.cuda.current_stream(self._index).cuda_stream
        )
        # torch.cuda.current_stream() and torch.cuda.stream() cost tens of microseconds each
        # (device lookups through os.environ); the hooks call them for every group, so the hot
        # path calls the C functions behind them.
        self._streams: dict[int, torch.cuda.Stream] = {}  # stream id -> its Stream object
        self._switches: dict[int, _StreamSwitch] = {}  # stream id -> its reusable switch

    def current(self) -> torch.cuda.Stream:
        """The current stream of this device, read now (a cached object per stream id)."""
        sid, index, dtype = torch._C._cuda_getCurrentStream(self._index)
        stream = self._streams.get(sid)
        if stream is None:
            stream = self._streams[sid] = torch.cuda.Stream(stream_id=sid, device_index=index, device_type=dtype)
        return stream

    def current_id(self) -> int:
        """A cheap identity of the current stream (its raw handle), for the hot path."""
        return self._raw_current()

    def event(self, timing: bool = False) -> torch.cuda.Event:
        """A new event; ``timing=True`` for events whose elapsed time is read."""
        return torch.cuda.Event(enable_timing=timing)

    def use(self, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager:
        """Make ``stream`` (of this device) current inside a ``with`` block; not reentrant for
        the same stream, which the engine never needs."""
        switch = self._switches.get(stream.stream_id)
        if switch is None:
            switch = self._switches[stream.stream_id] = _StreamSwitch(stream, self._index)
        return switch

    def is_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def owns(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda and tensor.get_device() == self._index


class _StreamSwitch:
    """``torch.cuda.stream(stream)`` for one stream of one device, without its per-call device
    lookups: saves the device's current stream and the current device, restores both."""

    __slots__ = ("_ids", "_index", "_saved", "_device")

    def __init__(self, stream: torch.cuda.Stream, index: int) -> None:
        self._ids = (stream.stream_id, stream.device_index, stream.device_type)
        self._index = index

    def __enter__(self) -> None:
        self._device = torch._C._cuda_getDevice()
        self._saved = torch._C._cuda_getCurrentStream(self._index)
        sid, index, dtype = self._ids
        torch._C._cuda_setStream(stream_id=sid, device_index=index, device_type=dtype)

    def __exit__(self, *exc: Any) -> None:
        sid, index, dtype = self._saved
        torch._C._cuda_setStream(stream_id=sid, device_index=index, device_type=dtype)
        if self._device != self._index:  # setting a stream makes its device current
            torch._C._cuda_setDevice(self._device)


def make_streams(device: torch.device | str | None = None) -> CudaStreams | HostStreams:
    """`CudaStreams` for a CUDA device (the current one by default), else the CPU fallback."""
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("offload: a CUDA device was asked for, but CUDA is not available")
        return CudaStreams(device)
    if device.type == "cpu":
        return HostStreams()
    raise ValueError(f"offload: unsupported device {device}; use a CUDA device or 'cpu'")
