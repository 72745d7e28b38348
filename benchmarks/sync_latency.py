"""How long a model's host sync waits while an offload copy is in flight (GPU only).

A host sync such as an MoE router's ``.tolist()`` makes a small device-to-host copy to pageable
memory on the compute stream. This queues ``--mib`` MiB of device-to-host copies on a side
stream into pinned memory, issued as pieces of each size given (0: no offload copy, the idle
latency), waits ``--delay-us`` for them to start, and times ``.tolist()`` of 8 integers.

If the copy engine served other streams' copies between pieces, the latency would be about one
piece's transfer time; if it serves copies in the order queued, it is what remains of the whole
transfer whatever the piece size (docs/results/copy_chunks.md).

    python benchmarks/sync_latency.py
    python benchmarks/sync_latency.py --mib 256 --pieces 0 256 16 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def latency_us(mib: int, piece_mib: int, reps: int, delay_us: float) -> list[float]:
    """``reps`` latencies of ``.tolist()`` behind ``mib`` MiB queued in pieces of ``piece_mib``."""
    src = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty(mib << 20, dtype=torch.uint8, pin_memory=True)
    small = torch.ones(8, dtype=torch.int64, device="cuda")
    side = torch.cuda.Stream()
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        if piece_mib:
            side.wait_stream(torch.cuda.current_stream())
            step = piece_mib << 20
            with torch.cuda.stream(side):
                for start in range(0, src.numel(), step):
                    dst[start:start + step].copy_(src[start:start + step], non_blocking=True)
        time.sleep(delay_us / 1e6)
        t0 = time.perf_counter()
        small.tolist()
        out.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=96, help="MiB copied out per trial (default 96: a core_attn group)")
    p.add_argument("--pieces", type=int, nargs="+", default=[0, 96, 16, 4, 1], help="piece sizes in MiB (0: none)")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--delay-us", type=float, default=200.0, help="between queueing the copy and the sync")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs CUDA: it times the copy engine")
    if args.mib < 1 or args.reps < 1 or any(x < 0 for x in args.pieces):
        p.error("--mib and --reps must be positive and --pieces >= 0")
    print(f"{torch.cuda.get_device_name()}: .tolist() of 8 int64 behind {args.mib} MiB device-to-host, "
          f"{args.delay_us:g} us after queueing, {args.reps} trials")
    for piece in args.pieces:
        lat = latency_us(args.mib, piece, args.reps, args.delay_us)
        label = "no offload copy" if piece == 0 else f"pieces of {piece} MiB"
        print(f"{label:>18}: median {statistics.median(lat):8.1f} us, max {max(lat):8.1f} us")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
