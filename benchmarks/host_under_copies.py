"""Does the host run slower while offload copies stream through pinned memory? (CUDA only.)

A host-paced step (an MoE whose router syncs with the host every layer, a GPU mostly idle)
takes as long as the host's Python and kernel launches. If copies between the GPU and pinned
host memory slowed the host down (the DMA sharing the host's memory with the CPU, the driver's
launch path sharing the PCIe link), offloading would cost such a step more than the engine's
own host time, however well its copies hide on the GPU. This times three pieces of host work
with the copy engines idle, copying device-to-host, host-to-device, and both ways at once:

* ``python``: interpreter-bound Python (dict and tuple churn, as a training loop's glue);
* ``launch``: small CUDA kernels launched back to back (``Tensor.add_`` on 1024 elements;
  the host's launch path, not the GPU, paces them);
* ``host memcpy``: a 64 MiB copy between two host tensors (the host's memory bandwidth).

Each round runs the four conditions in turn, each condition's copies queued first (``--queue-gib``
GiB per direction, pieces of 256 MiB between one device buffer and one pinned buffer) so that
they stream during all of its work; a condition whose copies ended before its work did is
reported, and its round left out. Medians over ``--rounds`` rounds, microseconds per repetition.

    python benchmarks/host_under_copies.py
    python benchmarks/host_under_copies.py --rounds 9 --json /tmp/host_under_copies.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Callable

import torch

CONDITIONS = ("idle", "d2h", "h2d", "both")


def python_work() -> int:
    """Interpreter-bound work of about 100 microseconds."""
    table: dict[int, tuple[int, str]] = {}
    for i in range(600):
        table[i & 255] = (i, "x" * (i & 7))
    return len(table)


def timed(work: Callable[[], object], reps: int) -> float:
    """Median microseconds of ``reps`` calls of ``work``."""
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        work()
        samples.append((time.perf_counter() - start) * 1e6)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7, help="rounds of the four conditions (default: %(default)s)")
    p.add_argument("--queue-gib", type=int, default=12, help="GiB queued per direction per condition")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.queue_gib < 1:
        p.error("--rounds and --queue-gib must be at least 1")
    if not torch.cuda.is_available():
        raise SystemExit("host_under_copies.py needs a CUDA device")

    piece = 256 << 20
    dev_out = torch.empty(piece, dtype=torch.uint8, device="cuda")
    dev_in = torch.empty(piece, dtype=torch.uint8, device="cuda")
    host_out = torch.empty(piece, dtype=torch.uint8, pin_memory=True)
    host_in = torch.empty(piece, dtype=torch.uint8, pin_memory=True)
    streams = {"d2h": torch.cuda.Stream(), "h2d": torch.cuda.Stream()}
    small = torch.zeros(1024, device="cuda")
    mem_a = torch.ones(64 << 20, dtype=torch.uint8)
    mem_b = torch.empty_like(mem_a)

    def launches() -> None:
        for _ in range(100):
            small.add_(1.0)

    works = {
        "python": (python_work, 200),
        "launch": (launches, 40),  # 100 launches per repetition
        "host memcpy": (lambda: mem_b.copy_(mem_a), 20),
    }

    def queue(direction: str) -> torch.cuda.Event:
        stream = streams[direction]
        dst, src = (host_out, dev_out) if direction == "d2h" else (dev_in, host_in)
        with torch.cuda.stream(stream):
            for _ in range(args.queue_gib * 4):
                dst.copy_(src, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        return done

    for _ in range(2):  # warm up every path
        for work, _reps in works.values():
            work()
        for direction in streams:
            queue(direction).synchronize()
    torch.cuda.synchronize()

    results: dict[str, dict[str, list[float]]] = {c: {w: [] for w in works} for c in CONDITIONS}
    ended_early = {c: 0 for c in CONDITIONS}
    for _ in range(args.rounds):
        for condition in CONDITIONS:
            torch.cuda.synchronize()
            directions = {"idle": (), "d2h": ("d2h",), "h2d": ("h2d",), "both": ("d2h", "h2d")}[condition]
            done = [queue(d) for d in directions]
            time.sleep(0.002)  # the copies have started
            round_times = {name: timed(work, reps) for name, (work, reps) in works.items()}
            if any(event.query() for event in done):
                ended_early[condition] += 1
                continue
            for name, value in round_times.items():
                results[condition][name].append(value)
    torch.cuda.synchronize()

    summary = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "rounds": args.rounds,
        "queue_gib": args.queue_gib,
        "rounds_left_out": ended_early,
        "us_per_repetition": {c: {w: (statistics.median(v) if v else None) for w, v in per.items()}
                              for c, per in results.items()},
    }
    print(f"{summary['device']}, torch {summary['torch']}: host work while pinned copies stream, "
          f"median microseconds per repetition over {args.rounds} rounds (against idle)")
    print(f"  {'condition':9s}" + "".join(f"{w:>22s}" for w in works))
    idle = summary["us_per_repetition"]["idle"]
    for condition in CONDITIONS:
        row = summary["us_per_repetition"][condition]
        cells = []
        for w in works:
            if row[w] is None or idle[w] is None:
                cells.append(f"{'-':>22s}")
            else:
                cells.append(f"{row[w]:11.1f} ({row[w] / idle[w] - 1:+6.1%})")
        print(f"  {condition:9s}" + "".join(f"{c:>22s}" for c in cells))
    if any(ended_early.values()):
        print(f"  rounds left out (copies ended before the work did): {ended_early}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=1) + "\n")
    valid = all(results[c]["python"] for c in CONDITIONS)
    return 0 if valid else 1


if __name__ == "__main__":
    raise SystemExit(main())
