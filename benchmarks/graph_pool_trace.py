"""Where a CUDA-graph pool's memory goes, capture by capture (CUDA only).

8 GPT layers (bf16, batch 1) graphed with `offload.graphs.make_graphed_callables`, one graph pool
shared by all captures (torch's default). After each capture (each forward, then each backward
graph), this prints the pool's size (the sum of the private pools' segments) and its active
bytes (blocks allocated), from ``torch.cuda.memory._snapshot()``. The pool is what the graphs
hold for good; the gap between the two is memory the pool holds but cannot hand out.

    python benchmarks/graph_pool_trace.py                        # offloading core_attn
    python benchmarks/graph_pool_trace.py --names ""             # the same graphs without offloading
    python benchmarks/graph_pool_trace.py --reload-buffers-outside-pool 2048   # experiments below
    python benchmarks/graph_pool_trace.py --frozen-params

Two experiments, not modes of the engine, each telling whether one kind of allocation is what
fragments the pool (docs/graphs.md, Limitations):

* ``--reload-buffers-outside-pool MIB``: reload buffers allocated during a capture come from one
  static device slab of MIB MiB made before the captures (each its own slice, never reused), so
  they take no block of the pool;
* ``--frozen-params``: the parameters need no gradient, so the backward graphs allocate no
  static parameter gradients in the pool (as when gradients go to buffers outside it).
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import offload  # noqa: E402
from offload.streams import CudaStreams  # noqa: E402
from offload.testing import GPT_MAPPING, build_gpt, graph_pool_segments  # noqa: E402


def pool_state() -> tuple[int, int, dict[int, int]]:
    """Bytes of the private pools' segments, bytes of their active blocks, and the active blocks'
    sizes (MiB -> count)."""
    segments = graph_pool_segments()
    active = [b["size"] for s in segments for b in s["blocks"] if b["state"] == "active_allocated"]
    return sum(s["total_size"] for s in segments), sum(active), dict(collections.Counter(a >> 20 for a in active))


def reload_buffers_from_slab(mib: int) -> None:
    """The experiment: capture-time reload buffers from one static slab, outside the pool."""
    slab = torch.empty(mib << 20, dtype=torch.uint8, device="cuda")
    at = [0]
    eager_empty = CudaStreams.empty

    def empty(self: CudaStreams, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if not torch.cuda.is_current_stream_capturing():
            return eager_empty(self, numel, dtype)
        start = (at[0] + 511) // 512 * 512
        at[0] = start + numel * dtype.itemsize
        if at[0] > slab.numel():
            raise SystemExit(f"--reload-buffers-outside-pool {mib} is too small")
        return slab[start:at[0]].view(dtype)

    CudaStreams.empty = empty


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--names", default="core_attn", help="offloaded names, comma-separated ('' for none)")
    p.add_argument("--per-graph", type=int, default=1, help="layers per graphed callable")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--reload-buffers-outside-pool", type=int, metavar="MIB", default=0)
    p.add_argument("--frozen-params", action="store_true")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("graph_pool_trace.py needs a CUDA device")
    names = [n for n in args.names.split(",") if n]
    if args.reload_buffers_outside_pool:
        reload_buffers_from_slab(args.reload_buffers_outside_pool)

    trace = []
    capture_end = torch.cuda.CUDAGraph.capture_end

    def traced_capture_end(self: torch.cuda.CUDAGraph) -> None:
        capture_end(self)
        total, active, sizes = pool_state()
        trace.append((total, active))
        top = dict(sorted(sizes.items(), reverse=True)[:6])
        print(f"capture {len(trace) - 1:2d}: pool {total >> 20:5d} MiB, active {active >> 20:5d} MiB, "
              f"active blocks MiB:count {top}", flush=True)

    torch.cuda.CUDAGraph.capture_end = traced_capture_end
    model = build_gpt(args.hidden, 32, args.layers, dtype=torch.bfloat16, device="cuda")
    if args.frozen_params:
        model.requires_grad_(False)
    manager = offload.configure(names, device="cuda")
    offload.attach(model, GPT_MAPPING)
    layers = list(model.layers)
    blocks = tuple(torch.nn.Sequential(*layers[i:i + args.per_graph]) for i in range(0, len(layers), args.per_graph))
    sample = tuple((torch.randn(args.seq, 1, args.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True),)
                   for _ in blocks)
    offload.graphs.make_graphed_callables(blocks, sample)
    offloaded = sum(rec.nbytes for g in manager.captured_groups for rec in g.records if rec.host is not None)
    print(f"final pool {trace[-1][0] >> 20} MiB; most active after a capture {max(a for _, a in trace) >> 20} MiB; "
          f"offloaded per step {offloaded >> 20} MiB ({args.names or 'nothing'}, {args.per_graph} layer(s) per graph, "
          f"hidden {args.hidden}, seq {args.seq})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
