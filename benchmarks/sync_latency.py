"""How long a model's host sync waits while an offload copy is in flight (GPU only).

A host sync such as an MoE router's ``.tolist()`` makes a small device-to-host copy to pageable
memory on the compute stream. This queues ``--mib`` MiB of device-to-host copies on a side
stream into pinned memory, issued as pieces of each size given (0: no offload copy, the idle
latency), waits ``--delay-us`` for them to start, and times ``.tolist()`` of 8 integers.

If the copy engine served other streams' copies between pieces, the latency would be about one
piece's transfer time; if it serves copies in the order queued, it is what remains of the whole
transfer whatever the piece size (docs/results/copy_chunks.md).

``--other-paths`` also tries the ways around the copy engine's queue: the same copy on a
side stream of the highest priority, the copy made by the GPU's cores instead of the copy
engine (a Triton kernel writing the pinned buffer through its device address, ``--sm-ctas``
thread blocks), and, for each, how much slower a stream of bf16 matmuls runs while 1 GiB goes
out beside it.

    python benchmarks/sync_latency.py
    python benchmarks/sync_latency.py --mib 256 --pieces 0 256 16 1
    python benchmarks/sync_latency.py --pieces 0 96 16 --other-paths
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch


Copy = Callable[[torch.Tensor, torch.Tensor], None]
"""``copy(dst, src)``: queue a device-to-host copy of ``src`` into the pinned ``dst`` on the
current stream."""


def pieces(piece_mib: int) -> Copy:
    """Copy-engine copies of at most ``piece_mib`` MiB each."""
    step = piece_mib << 20

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        for start in range(0, src.numel(), step):
            dst[start:start + step].copy_(src[start:start + step], non_blocking=True)
    return copy


def sm_copy(ctas: int) -> Copy:
    """The copy made by ``ctas`` thread blocks of a Triton kernel (the GPU's cores write the
    pinned buffer through its device address; the copy engine is not used). Needs Triton."""
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(dst, src, n, BLOCK: tl.constexpr):
        for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            mask = offsets < n
            tl.store(dst + offsets, tl.load(src + offsets, mask=mask), mask=mask)

    def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
        words_dst, words_src = dst.view(torch.int32), src.view(torch.int32)
        kernel[(ctas,)](words_dst, words_src, words_src.numel(), BLOCK=8192, num_warps=8)
    return copy


def latency_us(mib: int, copy: Copy | None, reps: int, delay_us: float, side: torch.cuda.Stream) -> list[float]:
    """``reps`` latencies of ``.tolist()`` behind ``mib`` MiB queued by ``copy`` on ``side``."""
    src = torch.randint(0, 256, (mib << 20,), dtype=torch.uint8, device="cuda")
    dst = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
    small = torch.ones(8, dtype=torch.int64, device="cuda")
    if copy is not None:  # once before timing: a Triton kernel compiles on its first call
        with torch.cuda.stream(side):
            copy(dst, src)
        torch.cuda.synchronize()
        if not torch.equal(dst, src.cpu()):
            raise SystemExit("the copy under test did not copy exactly")
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if copy is not None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                copy(dst, src)
        time.sleep(delay_us / 1e6)
        t0 = time.perf_counter()
        small.tolist()
        out.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return out


def matmul_ms(copy: Copy | None, side: torch.cuda.Stream, reps: int = 3) -> float:
    """Median time of one 8192^3 bf16 matmul while ``copy`` moves 1 GiB out on ``side`` (12
    matmuls, about as long as the copy at 55 GB/s)."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        torch.cuda.synchronize()
        if copy is not None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                copy(dst, src)
        start.record()
        for _ in range(12):
            torch.mm(a, b)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 12)
    return statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=96, help="MiB copied out per trial (default 96: a core_attn group)")
    p.add_argument("--pieces", type=int, nargs="+", default=[0, 96, 16, 4, 1], help="piece sizes in MiB (0: none)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--delay-us", type=float, default=200.0, help="between queueing the copy and the sync")
    p.add_argument("--other-paths", action="store_true",
                   help="also a side stream of the highest priority and a copy by the GPU's cores (needs Triton), "
                        "each with the slowdown of matmuls running beside it")
    p.add_argument("--sm-ctas", type=int, nargs="+", default=[4, 16], help="thread blocks of the cores' copy")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs CUDA: it times the copy engine")
    if args.mib < 1 or args.reps < 1 or any(x < 0 for x in args.pieces) or any(x < 1 for x in args.sm_ctas):
        p.error("--mib, --reps and --sm-ctas must be positive and --pieces >= 0")
    side = torch.cuda.Stream()
    paths: list[tuple[str, Copy | None, torch.cuda.Stream]] = [
        ("no offload copy" if piece == 0 else f"pieces of {piece} MiB", pieces(piece) if piece else None, side)
        for piece in args.pieces
    ]
    if args.other_paths:
        try:
            paths.append(("one copy, stream priority " + str(torch.cuda.Stream.priority_range()[1]), pieces(args.mib),
                          torch.cuda.Stream(priority=torch.cuda.Stream.priority_range()[1])))
            paths += [(f"cores' copy, {n} blocks", sm_copy(n), side) for n in args.sm_ctas]
        except ImportError:
            p.error("--other-paths needs Triton for the cores' copy")
    print(f"{torch.cuda.get_device_name()}: .tolist() of 8 int64 behind {args.mib} MiB device-to-host, "
          f"{args.delay_us:g} us after queueing, {args.reps} trials")
    for label, copy, stream in paths:
        lat = latency_us(args.mib, copy, args.reps, args.delay_us, stream)
        print(f"{label:>30}: median {statistics.median(lat):8.1f} us, max {max(lat):8.1f} us")
    if args.other_paths:
        alone = matmul_ms(None, side)
        print(f"one 8192^3 bf16 matmul: {alone:.3f} ms alone")
        for label, copy, stream in paths:
            if copy is not None:
                with_copy = matmul_ms(copy, stream)
                print(f"{'with 1 GiB out, ' + label:>46}: {with_copy:.3f} ms ({with_copy / alone - 1:+.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
