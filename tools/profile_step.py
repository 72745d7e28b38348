"""Where a training script's steps spend their time, on the GPU and on the host: the steps between
two optimizer steps profiled and summarized (a diagnostic for host-bound models, such as an MoE
whose router syncs with the host every layer).

    python tools/profile_step.py --first 5 --last 7 --out /tmp/dsv3_off -- examples/megatron_gpt.py \\
        --model dsv3_proxy --steps 9 --offload-modules=attn_norm,mlp_norm,expert_fc1,moe_act
    python tools/profile_step.py --python --first 5 --last 6 --out /tmp/dsv3_off -- examples/megatron_gpt.py ...

SCRIPT runs in this process with its arguments. A hook after every optimizer step (all optimizers
counted together) starts profiling after step ``--first`` and stops after step ``--last``.

* Default: ``torch.profiler`` with CPU and CUDA activity. ``OUT.txt`` (also printed): the window,
  each CUDA stream's busy time by kind (kernels, each copy direction), the compute stream's idle
  gaps over 50 us and which host runtime calls overlapped them, the host's runtime-call totals,
  and how long the model's own device-to-host copies on the compute stream waited to start while
  a side stream's device-to-host copy ran (a copy engine serves its queue in order: Note [7] of
  `offload.copy_queue`). The trace is ``OUT.json.gz`` (Perfetto, chrome://tracing).
* ``--python``: cProfile of the same steps instead, ``OUT.cprof.txt`` (also printed): the host's
  functions by own time, then this library's by cumulative time. cProfile slows every Python
  call, so compare two runs under it, not a run under it with one without.
* ``--engine``: the host time of the same steps inside each of the engine's entry points (also
  on autograd's backward thread) and in Python's garbage collector, per step, with
  `offload.tools.engine_timers`, instead: ``OUT.engine.txt`` (also printed). Its timers cost
  about a microsecond per call: compare two runs under them.
* ``--syncs``: how long the training loop's thread waits in host syncs (``.cpu()``, ``.item()``,
  ``.tolist()``, ``synchronize``) per step, with its wall and CPU time, with
  `offload.tools.sync_timers`, instead: ``OUT.syncs.txt`` (also printed). A sync that waits
  behind an offload copy in the copy engine's queue (Note [9] of `offload.copy_queue`) shows
  here, and nowhere else.

The compute stream is the one with the most kernel time. The profiler's own overhead lengthens
the window on the host side, alike with and without offloading: compare two runs of this tool.
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gzip
import io
import json
import pstats
import runpy
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from offload.tools.engine_timers import EngineTimers
from offload.tools.sync_timers import SyncTimers
from offload.tools.intervals import Cover, length, union
from offload.tools.overlap import compute_stream
from offload.tools.trace_events import GpuOp, timeline_from_torch_events

GAP_US = 50


def _ms(us: float) -> str:
    return f"{us / 1e3:.1f}"


def summarize(events: list[dict[str, Any]]) -> list[str]:
    """The summary lines for a profiler trace's ``traceEvents`` (times in microseconds)."""
    timeline = timeline_from_torch_events(events)
    if not timeline.ops:
        return ["no CUDA activity in the profiled steps"]
    compute = compute_stream(timeline)
    if compute is None:  # copies only: the stream of the first
        compute = timeline.ops[0].stream
    runtime = [e for e in events if e.get("cat") == "cuda_runtime" and "dur" in e]
    by_stream: dict[int, list[GpuOp]] = collections.defaultdict(list)
    for op in timeline.ops:
        by_stream[op.stream].append(op)
    lines = [f"window {_ms(max(o.end for o in timeline.ops) - timeline.ops[0].start)} ms"]
    for stream, ops in sorted(by_stream.items(), key=lambda kv: -len(kv[1])):
        kinds: collections.Counter = collections.Counter()
        for op in ops:
            kinds["kernel" if op.kind == "kernel" else op.name] += op.dur
        lines.append(f"stream {stream}{' (compute)' if stream == compute else ''}: n={len(ops)} "
                     f"busy {_ms(length((o.start, o.end) for o in ops))} ms; "
                     + "; ".join(f"{k} {_ms(v)} ms" for k, v in kinds.most_common(6)))
    ordered = by_stream[compute]  # the timeline's operations are sorted by start
    busy = union((o.start, o.end) for o in ordered)
    gaps = [(end, start) for (_, end), (start, _) in zip(busy, busy[1:]) if start - end > GAP_US]
    lines.append(f"compute-stream gaps > {GAP_US} us: {len(gaps)}, total {_ms(sum(b - a for a, b in gaps))} ms")
    idle = Cover(gaps)
    during: collections.Counter = collections.Counter()
    total: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for e in runtime:
        name = e["name"]
        during[name] += idle.covered(e["ts"], e["ts"] + e["dur"])
        total[name] += e["dur"]
        count[name] += 1
    lines.append("host runtime calls overlapping those gaps (ms): "
                 + "; ".join(f"{k} {_ms(v)}" for k, v in during.most_common(8) if v > 0))
    lines.append("host runtime totals (ms, calls): "
                 + "; ".join(f"{k} {_ms(v)} ({count[k]})" for k, v in total.most_common(10)))
    side_d2h = Cover((o.start, o.end) for s, ops in by_stream.items() if s != compute for o in ops if o.copy == "d2h")
    n = waited = behind = 0
    for op in ordered:
        launch = timeline.launches.get(op.correlation)
        if op.copy != "d2h" or launch is None:
            continue
        issued = launch[1]
        n += 1
        waited += max(0.0, op.start - issued)
        behind += side_d2h.covered(issued, op.start)
    lines.append(f"compute-stream D2H copies: {n}, issue to start {_ms(waited)} ms in all, "
                 f"of which a side stream's D2H copy ran {_ms(behind)} ms")
    return lines


def python_table(profile: cProfile.Profile) -> str:
    """cProfile's tables: every function by own time, this library's by cumulative time."""
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(40)
    out.write("\n==== offload/ by cumulative time\n")
    stats.sort_stats("cumulative").print_stats("offload/", 40)
    return out.getvalue()


class StepWindow:
    """Starts profiling after optimizer step ``first`` and stops after step ``last``."""

    def __init__(self, first: int, last: int, out: Path, python: bool,
                 timers: EngineTimers | SyncTimers | None = None) -> None:
        self.first, self.last, self.out, self.python = first, last, out, python
        self.timers = timers  # --engine, --syncs: installed before the script runs, read here
        self.steps = 0
        self.profiler: Any = None
        self.done = False

    def __call__(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self.steps += 1
        if self.timers is not None:
            if self.steps == self.first:
                self.timers.clear()
            elif self.first < self.steps <= self.last:
                self.timers.step()
            if self.steps == self.last:
                self._write(self.out.with_name(f"{self.out.name}.{self.timers.kind}.txt"), self.timers.table() + "\n")
                self.done = True
            return
        if self.steps == self.first:
            torch.cuda.synchronize()
            if self.python:
                self.profiler = cProfile.Profile()
                self.profiler.enable()
            else:
                activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
                self.profiler = torch.profiler.profile(activities=activities)
                self.profiler.__enter__()
        elif self.steps == self.last and self.profiler is not None:
            torch.cuda.synchronize()
            if self.python:
                self.profiler.disable()
                self._write(self.out.with_name(self.out.name + ".cprof.txt"), python_table(self.profiler))
            else:
                self.profiler.__exit__(None, None, None)
                trace = self.out.with_name(self.out.name + ".json")
                self.profiler.export_chrome_trace(str(trace))
                events = json.loads(trace.read_text())["traceEvents"]
                with trace.open("rb") as src, gzip.open(f"{trace}.gz", "wb") as dst:
                    shutil.copyfileobj(src, dst)
                trace.unlink()
                self._write(self.out.with_name(self.out.name + ".txt"), "\n".join(summarize(events)) + "\n")
            self.done = True

    @staticmethod
    def _write(path: Path, text: str) -> None:
        path.write_text(text)
        print(f"profile_step: {path}\n{text}", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], usage="%(prog)s [options] -- SCRIPT [ARGS]")
    p.add_argument("--first", type=int, default=5, help="start after this optimizer step (1 = the first)")
    p.add_argument("--last", type=int, default=7, help="stop after this optimizer step")
    p.add_argument("--out", type=Path, required=True, help="path prefix of what is written")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--python", action="store_true", help="cProfile of the host's Python instead")
    mode.add_argument("--engine", action="store_true",
                      help="host time in the engine's entry points and in the garbage collector instead")
    mode.add_argument("--syncs", action="store_true",
                      help="the training loop's wait in host syncs per step, with its wall and CPU time, instead")
    args = p.parse_args(argv[:split])
    script = argv[split + 1:]
    if not script:
        p.error("no script: put it and its arguments after --")
    if not 1 <= args.first < args.last:
        p.error(f"need 1 <= --first < --last (got {args.first} and {args.last})")
    if not torch.cuda.is_available() and not (args.engine or args.syncs):
        p.exit(2, "profile_step.py: needs CUDA: it profiles the steps' CUDA streams (--engine and --syncs do not)\n")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    timers = EngineTimers().install() if args.engine else SyncTimers().install() if args.syncs else None
    window = StepWindow(args.first, args.last, args.out, args.python, timers)
    hook = register_optimizer_step_post_hook(window)
    sys.argv = script
    sys.path.insert(0, str(Path(script[0]).resolve().parent))  # as `python SCRIPT` does
    status: Any = 0
    try:
        runpy.run_path(script[0], run_name="__main__")
    except SystemExit as exc:
        status = exc.code
    finally:
        hook.remove()
        if timers is not None:
            timers.remove()
    if not window.done:
        print(f"profile_step.py: the script made {window.steps} optimizer step(s), fewer than --last "
              f"{args.last}: nothing profiled", file=sys.stderr)
        return 1
    return 0 if status in (0, None) else (status if isinstance(status, int) else 1)


if __name__ == "__main__":
    sys.exit(main())
