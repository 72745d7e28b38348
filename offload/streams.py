"""Copy streams and events: the only place that talks to CUDA's stream API.

The engine orders its copies with events and stream waits alone (never a host
synchronization). `CudaStreams` does this on a CUDA device. `HostStreams` is the CPU
fallback with the same interface, and it is built to fail loudly where the GPU would fail
quietly: its side-stream copies run late (see `HostStreams`), so the CPU test suite catches
a missing event edge instead of passing because every copy was already done.

Never cache "the compute stream": frameworks and autograd switch streams, so the engine
reads `current()` at the moment it needs it, and never inside a ``with stream(s):`` block
(where the current stream is ``s`` itself, and a wait on it would be a no-op).
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import sys
import weakref
from collections import deque
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import torch

class Rows(NamedTuple):
    """``count`` rows of ``width`` elements, ``pitch`` elements apart in the source and packed
    in the destination: a saved view with gaps on its way to the host (Note [10] of
    `offload.copy_queue`; it comes back packed, as one run)."""

    count: int
    width: int
    pitch: int


CopyJob = tuple[torch.Tensor, torch.Tensor, int, "Rows | None"]
"""``(dst, src, start, rows)``: copy ``dst.numel()`` elements of ``src``'s storage from element
``start`` on into the flat tensor ``dst`` (``rows`` None), or the `Rows` ``rows`` from there
into ``dst``'s."""


def copy_in_pieces(dst: torch.Tensor, src: torch.Tensor, chunk_bytes: int) -> None:
    """``dst.copy_(src)`` for flat tensors or tensors of rows, issued as copies of at most
    ``chunk_bytes`` each, whole rows (all of it at once when ``chunk_bytes`` is 0 or larger
    than the tensor)."""
    if not chunk_bytes or dst.nbytes <= chunk_bytes:
        dst.copy_(src, non_blocking=True)
        return
    step = max(1, chunk_bytes // (dst.nbytes // dst.shape[0]))
    for start in range(0, dst.shape[0], step):
        dst[start:start + step].copy_(src[start:start + step], non_blocking=True)


def _span(src: torch.Tensor, start: int, numel: int) -> torch.Tensor:
    return src.as_strided((numel,), (1,), start)


def _job_views(dst: torch.Tensor, src: torch.Tensor, start: int,
               rows: Rows | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A `CopyJob`'s destination and source as tensors of the same shape, for ``copy_``."""
    if rows is None:
        return dst, _span(src, start, dst.numel())
    shape = (rows.count, rows.width)
    return (dst.as_strided(shape, (rows.width, 1), dst.storage_offset()),
            src.as_strided(shape, (rows.pitch, 1), start))


_set_fills_new_memory = torch._C._set_deterministic_fill_uninitialized_memory


def _fills_new_memory() -> bool:
    """Whether ``torch.empty`` writes NaN into what it returns (deterministic algorithms on)."""
    return torch._C._get_deterministic_algorithms() and torch._C._get_deterministic_fill_uninitialized_memory()


_CUDA_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction follows from the (unified) addresses
_MAX_PITCH_BYTES = (1 << 31) - 1  # cudaMemcpy2DAsync refuses a larger pitch (cudaDevAttrMaxPitch)


def _runtime_memcpy() -> Any:
    """``cudaMemcpyAsync(dst, src, nbytes, stream)`` of the CUDA runtime that torch loaded (the
    one library of torch's CUDA major version mapped into this process), called directly, or
    ``None`` where there is no such single shared library; its attribute ``rows`` is
    ``cudaMemcpy2DAsync(dst, dst_pitch, src, src_pitch, row_bytes, count, stream)``.

    Why: through ``Tensor.copy_`` and the views it needs, a piece costs 10.5 us of host time,
    the direct call 4.8 us (H100 host, torch 2.11, ``python benchmarks/copy_issue.py``); the
    engine issues a copy per piece of every saved tensor, on the hot path of host-bound models
    (an MoE layer's host sync). The copies are the same ``cudaMemcpyAsync`` calls torch makes,
    on the same streams, captured alike by a CUDA graph."""
    major = (torch.version.cuda or "").split(".")[0]
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if f"/libcudart.so.{major}" in line}
    except OSError:
        return None
    if len(paths) != 1:
        return None
    try:
        runtime = ctypes.CDLL(paths.pop())
    except OSError:
        return None
    call = runtime.cudaMemcpyAsync
    call.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    call.restype = ctypes.c_int
    describe = runtime.cudaGetErrorString
    describe.argtypes = [ctypes.c_int]
    describe.restype = ctypes.c_char_p

    call2d = runtime.cudaMemcpy2DAsync
    call2d.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    call2d.restype = ctypes.c_int

    def memcpy(dst: int, src: int, nbytes: int, stream: int) -> None:
        err = call(dst, src, nbytes, _CUDA_MEMCPY_DEFAULT, stream)
        if err:
            raise RuntimeError(f"offload: cudaMemcpyAsync of {nbytes} bytes failed: {describe(err).decode()}")

    def rows(dst: int, dst_pitch: int, src: int, src_pitch: int, row_bytes: int, count: int, stream: int) -> None:
        err = call2d(dst, dst_pitch, src, src_pitch, row_bytes, count, _CUDA_MEMCPY_DEFAULT, stream)
        if err:
            raise RuntimeError(f"offload: cudaMemcpy2DAsync of {count} rows of {row_bytes} bytes failed: "
                               f"{describe(err).decode()}")

    memcpy.rows = rows  # type: ignore[attr-defined]
    return memcpy


def _sanitizer_watches() -> bool:
    """Whether PyTorch's CUDA stream sanitizer is on: it sees only what goes through torch's
    dispatcher, so the engine then copies with ``Tensor.copy_`` for it to check every copy."""
    module = sys.modules.get("torch.cuda._sanitizer")
    return module is not None and module.cuda_sanitizer.enabled


@contextlib.contextmanager
def no_collection_during_capture(collect_first: bool = True) -> Iterator[None]:
    """Keep Python's cyclic garbage collector off while CUDA graphs are captured inside the
    block, after one collection first (``collect_first``).

    A CUDA graph destroyed while another graph is being captured invalidates that capture
    (``cudaErrorStreamCaptureInvalidated``: a captured graph and its output, collected inside
    a capture of torch 2.11, do it), and graphs often die in reference cycles
    (``torch.cuda.make_graphed_callables`` builds its autograd functions around them), that
    is whenever the collector happens to run. Since ``torch.cuda.graph`` no longer collects
    before it captures (PyTorch's ``torch.compiler.config.force_cudagraph_gc``, default off),
    a dead graph from an earlier capture could break a later one at a point that depends on
    allocation counts."""
    if collect_first:
        gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# ---------------------------------------------------------------------------- CUDA
class CudaStreams:
    """The device-to-host and host-to-device side streams of one CUDA device."""

    is_cuda = True

    def __init__(self, device: torch.device) -> None:
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", self._index)
        self.d2h = torch.cuda.Stream(self.device)
        self.h2d = torch.cuda.Stream(self.device)
        # torch.cuda.current_stream() and torch.cuda.stream() cost tens of microseconds each
        # (device lookups through os.environ); the hooks call them for every group, so the hot
        # path calls the C functions behind them.
        self._streams: dict[int, torch.cuda.Stream] = {}  # stream id -> its Stream object
        self._switches: dict[int, _StreamSwitch] = {}  # stream id -> its reusable switch
        self._memcpy = _runtime_memcpy()

    def current(self) -> torch.cuda.Stream:
        """The current stream of this device, read now (a cached object per stream id)."""
        sid, index, dtype = torch._C._cuda_getCurrentStream(self._index)
        stream = self._streams.get(sid)
        if stream is None:
            stream = self._streams[sid] = torch.cuda.Stream(stream_id=sid, device_index=index, device_type=dtype)
        return stream

    def current_id(self) -> int:
        """A cheap identity of the current stream (its id), for the hot path."""
        return torch._C._cuda_getCurrentStream(self._index)[0]

    def event(self, timing: bool = False, external: bool = False) -> torch.cuda.Event:
        """A new event; ``timing=True`` for events whose elapsed time is read, ``external=True``
        for one recorded eagerly and waited on inside a CUDA graph (Note [C3] of `offload.capture`)."""
        return torch.cuda.Event(enable_timing=timing, external=external)

    def device_span(self, address: int, nbytes: int) -> torch.Tensor:
        """A flat uint8 tensor over ``nbytes`` of this device's memory at ``address`` that does not
        keep that memory allocated: for memory whose lifetime the caller knows (a block of a
        CUDA graph's pool, which the graph's replays rewrite)."""
        return torch.as_tensor(_DeviceMemory(address, nbytes), device=self.device)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A flat device tensor for a reload, allocated on the current stream. Never filled, also
        where deterministic algorithms fill new memory: the copy writes all of it before any
        use, and a fill captured in a backward graph would overwrite a reload issued before
        that graph's replay (Note [C4] of `offload.capture`)."""
        if not _fills_new_memory():
            return torch.empty(numel, dtype=dtype, device=self.device)
        _set_fills_new_memory(False)
        try:
            return torch.empty(numel, dtype=dtype, device=self.device)
        finally:
            _set_fills_new_memory(True)

    def copy(self, stream: torch.cuda.Stream, jobs: Sequence[CopyJob], chunk_bytes: int) -> None:
        """Issue the copies ``jobs`` on ``stream`` (see `CopyJob`), in pieces of at most
        ``chunk_bytes``. The caller has made ``stream`` wait for whatever the copies depend on."""
        if self._memcpy is not None and torch._C._cuda_getDevice() == self._index and not _sanitizer_watches():
            self._memcpy_jobs(stream.cuda_stream, jobs, chunk_bytes)  # the stream is an argument: no switch
            return
        with self.use(stream):  # the stream current (torch's copies) and its device (the runtime's)
            self._copy_on_current(stream, jobs, chunk_bytes)

    def _copy_on_current(self, stream: torch.cuda.Stream, jobs: Sequence[CopyJob], chunk_bytes: int) -> None:
        if self._memcpy is None or _sanitizer_watches():
            for dst, src, start, rows in jobs:
                copy_in_pieces(*_job_views(dst, src, start, rows), chunk_bytes)
            return
        self._memcpy_jobs(stream.cuda_stream, jobs, chunk_bytes)

    def _memcpy_jobs(self, handle: int, jobs: Sequence[CopyJob], chunk_bytes: int) -> None:
        memcpy = self._memcpy
        for dst, src, start, rows in jobs:
            nbytes = dst.nbytes
            to = dst.data_ptr()
            itemsize = src.itemsize
            frm = src.untyped_storage().data_ptr() + start * itemsize
            if rows is not None:
                self._memcpy_rows(handle, to, frm, rows, itemsize, chunk_bytes)
                continue
            step = chunk_bytes if 0 < chunk_bytes < nbytes else max(nbytes, 1)
            for offset in range(0, nbytes, step):
                memcpy(to + offset, frm + offset, min(step, nbytes - offset), handle)

    def _memcpy_rows(self, handle: int, to: int, frm: int, rows: Rows, itemsize: int, chunk_bytes: int) -> None:
        """`Rows` from ``frm`` to ``to``: ``cudaMemcpy2DAsync`` in pieces of whole rows of at most
        ``chunk_bytes``, or one copy per row where a pitch is past its largest."""
        memcpy = self._memcpy
        row_bytes = rows.width * itemsize
        src_pitch = rows.pitch * itemsize
        if src_pitch > _MAX_PITCH_BYTES:
            for row in range(rows.count):
                memcpy(to + row * row_bytes, frm + row * src_pitch, row_bytes, handle)
            return
        step = max(1, chunk_bytes // row_bytes) if 0 < chunk_bytes < rows.count * row_bytes else rows.count
        for first in range(0, rows.count, step):
            memcpy.rows(to + first * row_bytes, row_bytes, frm + first * src_pitch, src_pitch, row_bytes,
                        min(step, rows.count - first), handle)

    def copy_program(self, stream: torch.cuda.Stream, jobs: Sequence[CopyJob], chunk_bytes: int,
                     done: torch.cuda.Event) -> Callable[[], None]:
        """The copies ``jobs`` on ``stream`` followed by a record of ``done`` there, as one call to
        repeat (Note [C3] of `offload.capture`: the same copies after every replay of a graph).

        Captured once, at the first call, into a small CUDA graph of its own: each later call is
        one graph launch instead of a runtime call per piece and per record, on the host path of
        every replay. ``jobs`` must keep their addresses for the program's life (a graph pool's
        blocks and pinned buffers do). The caller orders ``stream`` after what the copies read
        first, as for `copy`. Where PyTorch's stream sanitizer watches, each call issues the
        copies through torch instead, for it to check them, and so does a call inside another
        capture, which records them into that one."""
        graph: torch.cuda.CUDAGraph | None = None
        switch = self.use(stream)

        def run() -> None:
            nonlocal graph
            if _sanitizer_watches() or self.is_capturing():
                self.copy(stream, jobs, chunk_bytes)
                done.record(stream)
                return
            if graph is None:
                captured = torch.cuda.CUDAGraph()
                with switch, no_collection_during_capture(collect_first=False):
                    captured.capture_begin(capture_error_mode="thread_local")
                    try:
                        self._copy_on_current(stream, jobs, chunk_bytes)
                        done.record(stream)
                    finally:
                        captured.capture_end()
                graph = captured
            with switch:
                graph.replay()

        return run

    def use(self, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager:
        """Make ``stream`` (of this device) current inside a ``with`` block; not reentrant for
        the same stream (that raises: the inner exit would leave ``stream`` current)."""
        switch = self._switches.get(stream.stream_id)
        if switch is None:
            switch = self._switches[stream.stream_id] = _StreamSwitch(stream, self._index)
        return switch

    def is_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on the device this engine offloads from."""
        return tensor.is_cuda and tensor.get_device() == self._index

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


class _DeviceMemory:
    """Raw device memory described by the CUDA array interface, for `CudaStreams.device_span`."""

    __slots__ = ("__cuda_array_interface__",)

    def __init__(self, address: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "strides": None, "version": 3, "stream": None}


class _StreamSwitch:
    """``torch.cuda.stream(stream)`` for one stream of one device, without its per-call device
    lookups: saves the device's current stream and the current device, restores both."""

    __slots__ = ("_ids", "_index", "_saved", "_device")

    def __init__(self, stream: torch.cuda.Stream, index: int) -> None:
        self._ids = (stream.stream_id, stream.device_index, stream.device_type)
        self._index = index
        self._saved: tuple | None = None

    def __enter__(self) -> None:
        if self._saved is not None:  # a nested use would restore the side stream, not the caller's
            raise RuntimeError("offload: a stream switch was entered again inside itself")
        self._device = torch._C._cuda_getDevice()
        self._saved = torch._C._cuda_getCurrentStream(self._index)
        sid, index, dtype = self._ids
        torch._C._cuda_setStream(stream_id=sid, device_index=index, device_type=dtype)

    def __exit__(self, *exc: Any) -> None:
        sid, index, dtype = self._saved
        self._saved = None
        torch._C._cuda_setStream(stream_id=sid, device_index=index, device_type=dtype)
        if self._device != self._index:  # setting a stream makes its device current
            torch._C._cuda_setDevice(self._device)


# ---------------------------------------------------------------------------- CPU fallback
class MissingEventEdge(AssertionError):
    """The CPU fallback saw memory given up while a copy that uses it had not run: on a GPU
    that memory could be reused under the copy (a missing event edge in the engine)."""


class _HostEvent:
    """A point in one host stream's queue: complete once the stream ran up to it."""

    __slots__ = ("clock", "stream", "position", "due")

    def __init__(self, clock: "HostStreams") -> None:
        self.clock = clock
        self.stream: _HostStream | None = None
        self.position = 0
        self.due = 0

    def record(self, stream: "_HostStream") -> None:
        self.stream = stream
        self.position = stream.issued
        self.due = self.clock.ticks + self.clock.COPY_TICKS

    def query(self) -> bool:
        """Whether the work before the event ran: only once `HostStreams.COPY_TICKS` more
        events were made since it was recorded (then that work runs now)."""
        stream = self.stream
        if stream is None or stream.executed >= self.position:
            return True
        if self.clock.ticks < self.due:
            return False
        stream.run_until(self.position)
        return True

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.run_until(self.position)


class _HostStream:
    """A queue of deferred operations. The compute stream is the host itself (``eager``):
    its work is done when issued, and a wait on it runs the awaited work at once."""

    __slots__ = ("name", "eager", "ops", "issued", "executed", "_running", "__weakref__")

    def __init__(self, name: str, eager: bool) -> None:
        self.name = name
        self.eager = eager
        self.ops: deque[Any] = deque()
        self.issued = 0
        self.executed = 0
        self._running = False

    def enqueue(self, op: Any) -> None:
        self.ops.append(op)
        self.issued += 1

    def run_until(self, position: int) -> None:
        if self.executed >= position:
            return
        if self._running:
            raise MissingEventEdge(f"offload CPU fallback: the {self.name} stream waits on itself (a cycle of waits)")
        self._running = True
        try:
            while self.executed < position:
                self.ops.popleft()()
                self.executed += 1
        finally:
            self._running = False

    def wait_event(self, event: _HostEvent) -> None:
        """Wait for the work before ``event`` as it is now: recording the event again later
        moves no wait already issued, as on a GPU."""
        stream = event.stream
        if stream is None or stream is self or stream.eager:  # the compute stream's work is done
            return
        if self.eager:
            event.synchronize()
        else:
            position = event.position
            self.enqueue(lambda: stream.run_until(position))

    def wait_stream(self, stream: "_HostStream") -> None:
        if stream.eager or stream is self:
            return
        if self.eager:
            stream.run_until(stream.issued)
        else:
            position = stream.issued
            self.enqueue(lambda: stream.run_until(position))


class _HostCopy:
    """Deferred copies. Device memory they use (a D2H copy's sources, an H2D copy's
    destinations) is held weakly, as a GPU holds nothing: if the engine lets go of it
    before the copy ran, that is reported as `MissingEventEdge`."""

    __slots__ = ("streams", "jobs", "d2h", "chunk_bytes", "done")

    def __init__(self, streams: "HostStreams", jobs: Sequence[CopyJob], d2h: bool, chunk_bytes: int) -> None:
        self.streams = streams
        self.chunk_bytes = chunk_bytes
        self.done = False
        self.d2h = d2h
        watch = self._let_go
        if d2h:  # the sources are device memory
            self.jobs = [(dst, weakref.ref(src, watch), start, rows) for dst, src, start, rows in jobs]
        else:  # the destinations are
            self.jobs = [(weakref.ref(dst, watch), src, start, rows) for dst, src, start, rows in jobs]

    def _let_go(self, _ref: Any) -> None:
        if not self.done:
            held = "source" if self.d2h else "destination"
            self.streams.violations.append(
                f"the engine let go of a copy's {held} before the copy ran (a missing event edge)"
            )

    def __call__(self) -> None:
        self.done = True
        d2h, chunk_bytes = self.d2h, self.chunk_bytes
        for dst, src, start, rows in self.jobs:
            if d2h:
                src = src()
            else:
                dst = dst()
            if dst is not None and src is not None:
                _host_copy(dst, src, start, rows, chunk_bytes)
        self.jobs = ()


_memmove = ctypes.memmove


def _host_copy(dst: torch.Tensor, src: torch.Tensor, start: int, rows: Rows | None, chunk_bytes: int) -> None:
    """`copy_in_pieces` of a `CopyJob` into the flat host tensor ``dst``; a byte copy (a
    third of the time of a view and ``copy_``) where that is the same: one run of elements, one
    piece, one dtype, no conjugate or negative bit, and a span inside the storage."""
    nbytes = dst.nbytes
    storage = src.untyped_storage()
    offset = start * src.itemsize
    if (rows is None and (not chunk_bytes or nbytes <= chunk_bytes) and dst.dtype is src.dtype
            and not src.is_conj() and not src.is_neg() and storage.nbytes() >= offset + nbytes):
        _memmove(dst.data_ptr(), storage.data_ptr() + offset, nbytes)
    else:
        copy_in_pieces(*_job_views(dst, src, start, rows), chunk_bytes)


class HostStreams:
    """The CPU fallback of `CudaStreams`, with copies that complete late.

    The compute stream is the host (its work is done when issued). The D2H and H2D streams are
    queues: a copy issued on them runs only when something waits for it (a wait by the
    compute stream, an event's ``synchronize``, a side stream's queued wait being run), or when
    an event after it is queried once the engine has made `COPY_TICKS` more events since it was
    recorded: copies take time, about two groups' worth of engine work, and a query before
    then says "not done". So:

    * a tensor used before the wait that should order it reads what its copy has not yet
      written (reload buffers and new host buffers start as 0xFF bytes: NaN for floats);
    * a GPU tensor dropped before the copy that reads it ran, or a reload buffer before the
      copy that writes it, is reported: the next call of this object raises
      `MissingEventEdge` (on a GPU that memory could be reused under the copy).

    Rule 2 (a reload waits for the compute stream) cannot be caught here: the host's own work
    is always done. The engine logic is the same as on a GPU; no memory is saved.
    """

    is_cuda = False
    COPY_TICKS = 4

    def __init__(self) -> None:
        self.ticks = 0  # events made so far: the clock that copies take time on
        self.device = torch.device("cpu")
        self.d2h = _HostStream("d2h", eager=False)
        self.h2d = _HostStream("h2d", eager=False)
        self._compute = _HostStream("compute", eager=True)
        self.violations: list[str] = []

    def _report(self) -> None:
        """Raise what `_HostCopy` saw; callers test ``violations`` first (every engine call does)."""
        found, self.violations = self.violations, []
        raise MissingEventEdge("offload CPU fallback: " + "; ".join(found))

    def current(self) -> _HostStream:
        if self.violations:
            self._report()
        return self._compute

    def current_id(self) -> int:
        return 0

    def event(self, timing: bool = False, external: bool = False) -> _HostEvent:
        if self.violations:
            self._report()
        self.ticks += 1
        return _HostEvent(self)

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A reload buffer, filled with 0xFF bytes until its copy runs."""
        out = torch.empty(numel, dtype=dtype)
        out.view(torch.uint8).fill_(0xFF)
        return out

    def device_span(self, address: int, nbytes: int) -> torch.Tensor:
        """A flat uint8 tensor over ``nbytes`` of host memory at ``address`` that does not keep
        it allocated (`CudaStreams.device_span`)."""
        return torch.frombuffer((ctypes.c_uint8 * nbytes).from_address(address), dtype=torch.uint8)

    def copy(self, stream: _HostStream, jobs: Sequence[CopyJob], chunk_bytes: int) -> None:
        if self.violations:
            self._report()
        stream.enqueue(_HostCopy(self, jobs, stream is self.d2h, chunk_bytes))

    def copy_program(self, stream: _HostStream, jobs: Sequence[CopyJob], chunk_bytes: int,
                     done: _HostEvent) -> Callable[[], None]:
        """`CudaStreams.copy_program`: here `copy` and a record of ``done`` at each call."""
        def run() -> None:
            self.copy(stream, jobs, chunk_bytes)
            done.record(stream)

        return run

    def is_capturing(self) -> bool:
        return False

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` lives on the device this engine offloads from."""
        return tensor.is_cpu

    def synchronize(self) -> None:
        self.d2h.run_until(self.d2h.issued)
        self.h2d.run_until(self.h2d.issued)
        if self.violations:
            self._report()


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
