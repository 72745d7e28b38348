"""Host time to issue one group's copies, through the CUDA runtime directly, through
``Tensor.copy_``, and as a copy program (CUDA only).

    python benchmarks/copy_issue.py

`offload.streams.CudaStreams.copy` issues a group's device-to-host copies either as direct
``cudaMemcpyAsync`` calls from the storages' addresses (the default where torch's CUDA runtime
is a shared library of the process) or through ``Tensor.copy_`` on views (the fallback, also
used under the CUDA stream sanitizer). This times one ``copy`` call of a group shaped like a
``core_attn`` group of a GPT layer at hidden 2048, seq 4096, bf16 (one 48 MiB q/k/v storage,
one 16 MiB output, one 64 KiB log-sum-exp) in pieces of ``--chunk-mib`` MiB, each call on its
own (the stream is synchronized between calls, untimed, so the copy queue never fills), and
prints the median host microseconds per call and per piece for each path, alternating them.
The third path is what a graph replay issues after it (Note [C3] of `offload.capture`): the
same copies and an event record captured once by `CudaStreams.copy_program`, then one launch
of that small graph per call.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload.pinned_pool import PinnedHostPool  # noqa: E402
from offload.streams import CudaStreams  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--chunk-mib", type=int, default=16, help="piece size (the engine's copy_chunk_bytes)")
    p.add_argument("--calls", type=int, default=200, help="timed calls per path")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("copy_issue.py needs a CUDA device")
    streams = CudaStreams(torch.device("cuda"))
    if streams._memcpy is None:
        raise SystemExit("copy_issue.py: torch's CUDA runtime is not a shared library here; only one path exists")
    sizes = (48 << 20, 16 << 20, 64 << 10)
    pool = PinnedHostPool(pin=True)
    jobs = []
    for nbytes in sizes:
        src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        jobs.append((pool.acquire(nbytes).view(torch.bfloat16, src.numel()), src, 0, None))
    chunk = args.chunk_mib << 20
    pieces = sum(max(1, -(-n // chunk)) for n in sizes)
    runtime = streams._memcpy
    done = torch.cuda.Event(external=True)
    done.record()
    program = streams.copy_program(streams.d2h, jobs, chunk, done)
    program()  # captured here, untimed

    def copy() -> None:
        streams.copy(streams.d2h, jobs, chunk)

    paths = {"runtime": (runtime, copy), "Tensor.copy_": (None, copy), "copy program": (runtime, program)}
    times: dict[str, list[float]] = {name: [] for name in paths}
    for i in range(args.calls + 10):
        for name, (memcpy, call) in paths.items():
            streams._memcpy = memcpy
            streams.d2h.synchronize()
            start = time.perf_counter()
            call()
            elapsed = time.perf_counter() - start
            if i >= 10:
                times[name].append(elapsed * 1e6)
    streams.synchronize()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: one copy() of {len(sizes)} tensors "
          f"({sum(sizes) >> 20} MiB) in {pieces} pieces of at most {args.chunk_mib} MiB, median of {args.calls}")
    for name, values in times.items():
        per_call = statistics.median(values)
        print(f"  {name:13s} {per_call:8.1f} us per call, {per_call / pieces:6.1f} us per piece")
    return 0


if __name__ == "__main__":
    sys.exit(main())
