"""Does one layer's offload copy fit under that layer's compute? (CUDA only)

Issue 17's time target holds "where the copies fit under compute: one layer's copy <= its
forward at the measured link rate". This measures both sides for one GPT layer
(`offload.testing.build_gpt`, bf16, batch 1): the layer's forward and backward alone; the
device-to-host copy of what the named modules save (and the host-to-device copy back) alone, in
16 MiB pieces on a side stream as the engine issues them; and both at once. The bytes are what
autograd saves inside the named modules (`offload.testing.saved_bytes_by_name`), an upper bound
of what the engine offloads per layer (it skips small tensors and shared storages).

    python benchmarks/copy_fit.py                                  # hidden 4096, seq 4096 and 8192
    python benchmarks/copy_fit.py --hidden 2048 --seq 4096 --names core_attn

Each row prints the medians of ``--steps`` measured rounds after ``--warmup``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offload.testing import GPT_MAPPING, build_gpt, saved_bytes_by_name  # noqa: E402

PIECE = 16 << 20


def _timed(stream: torch.cuda.Stream, work: Callable[[], None]) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        work()
        end.record(stream)
    return start, end


def measure(hidden: int, seq: int, names: list[str], steps: int, warmup: int) -> dict[str, float]:
    """Milliseconds (medians) of compute and copy, alone and together, for forward and backward."""
    model = build_gpt(hidden, hidden // 128, 1, dtype=torch.bfloat16, device="cuda")
    x = torch.randn(seq, 1, hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn_like(x)
    per_name = saved_bytes_by_name(model, GPT_MAPPING, lambda: model(x).backward(g))
    nbytes = sum(per_name[n] for n in names)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def d2h() -> None:
        for o in range(0, nbytes, PIECE):
            host[o:o + PIECE].copy_(dev[o:o + PIECE], non_blocking=True)

    def h2d() -> None:
        for o in range(0, nbytes, PIECE):
            dev[o:o + PIECE].copy_(host[o:o + PIECE], non_blocking=True)

    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    out: dict[str, float] = {"bytes": float(nbytes)}
    for phase, copy in (("fwd", d2h), ("bwd", h2d)):
        rounds: dict[str, list[float]] = {k: [] for k in ("compute", "copy", "compute_both", "copy_both")}
        def compute() -> None:  # the layer's forward, or the backward of the forward just run
            if phase == "fwd":
                model(x)
            else:
                y.backward(g)

        for step in range(warmup + steps):
            y = model(x)
            torch.cuda.synchronize()
            alone_k = _timed(main, compute)
            torch.cuda.synchronize()
            alone_c = _timed(side, copy)
            torch.cuda.synchronize()
            y = model(x)
            torch.cuda.synchronize()
            both_c = _timed(side, copy)
            both_k = _timed(main, compute)
            torch.cuda.synchronize()
            if step >= warmup:
                for key, (a, b) in (("compute", alone_k), ("copy", alone_c), ("compute_both", both_k),
                                    ("copy_both", both_c)):
                    rounds[key].append(a.elapsed_time(b))
            y = None
        for key, values in rounds.items():
            out[f"{phase}_{key}"] = statistics.median(values)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--names", nargs="+", default=["core_attn", "qkv_linear,core_attn,attn_proj"],
                        help="module sets, each comma-separated (offload.testing.GPT_MAPPING names)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/copy_fit.py needs a CUDA device")
    unknown = sorted({n for names in args.names for n in names.split(",")} - set(GPT_MAPPING))
    if unknown:
        sys.exit(f"benchmarks/copy_fit.py: unknown names {unknown}; known: {sorted(GPT_MAPPING)}")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; hidden {args.hidden}, batch 1, bf16; "
          f"medians of {args.steps} rounds\n")
    print("| seq | names | MiB saved / layer | forward ms | D2H ms (GB/s) | D2H / forward | forward ms, copying "
          "| backward ms | H2D ms | H2D / backward |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for seq in args.seq:
        for names in args.names:
            r = measure(args.hidden, seq, names.split(","), args.steps, args.warmup)
            print(f"| {seq} | {names} | {r['bytes'] / 2**20:.0f} | {r['fwd_compute']:.2f} | {r['fwd_copy']:.2f} "
                  f"({r['bytes'] / r['fwd_copy'] / 1e6:.1f}) | {r['fwd_copy_both'] / r['fwd_compute']:.2f} "
                  f"| {r['fwd_compute_both']:.2f} | {r['bwd_compute']:.2f} | {r['bwd_copy']:.2f} "
                  f"| {r['bwd_copy_both'] / r['bwd_compute']:.2f} |", flush=True)
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
