"""Where is the memory peak of a step? Prints allocated memory at the end of forward and after
each offload group's backward, with and without offloading (a diagnostic for the engine).

    python tools/memory_timeline.py --hidden 1024 --layers 6 --seq 2048 --modules all
"""

from __future__ import annotations

import argparse

import torch

import offload
from offload.manager import PipelineOffloadManager
from offload.testing import GPT_MAPPING, build_gpt


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--modules", default="all")
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA device: it reads torch.cuda.memory_allocated() (the CPU fallback allocates nothing)")
    modules = list(GPT_MAPPING) if args.modules == "all" else list(offload.parse_module_list(args.modules))
    model = build_gpt(args.hidden, args.heads, args.layers, dtype=torch.bfloat16, device="cuda")
    for prm in model.parameters():
        prm.grad = torch.zeros_like(prm)
    x = torch.randn(args.seq, 1, args.hidden, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(x)
    mib = lambda n: f"{n / 2**20:8.1f}"  # noqa: E731
    marks: list[tuple[str, int]] = []
    real = PipelineOffloadManager.on_group_backward_done

    def traced(self, group):
        marks.append((f"bwd done {group.label}", torch.cuda.memory_allocated()))
        real(self, group)
        marks.append(("  after prefetch", torch.cuda.memory_allocated()))

    PipelineOffloadManager.on_group_backward_done = traced
    for mods in ([], modules):
        offload.configure(mods)
        h = offload.attach(model, {k: GPT_MAPPING[k] for k in mods}) if mods else None
        for it in range(3):
            marks.clear()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            out = model(x)
            marks.append(("forward end", torch.cuda.memory_allocated()))
            out.backward(g)
            del out
            marks.append(("backward end", torch.cuda.memory_allocated()))
            stats = offload.end_iteration()
        print(f"== modules {mods or 'none'}: base {mib(base)} MiB, peak {mib(torch.cuda.max_memory_allocated())} MiB, "
              f"offloaded {mib(stats.total().bytes_offloaded)} MiB")
        for label, n in marks:
            print(f"   {label:40} {mib(n)}")
        if h:
            h.remove()


if __name__ == "__main__":
    main()
