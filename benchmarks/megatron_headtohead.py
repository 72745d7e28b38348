"""This library's offloading against Megatron's own, on the same megatron-core model and flags.

    python benchmarks/megatron_headtohead.py                     # every job -> docs/results/megatron/headtohead.json
    python benchmarks/megatron_headtohead.py --workloads dense_16k --systems offload --graphs none
    python benchmarks/megatron_headtohead.py --list              # the jobs and their commands; runs nothing
    python benchmarks/megatron_headtohead.py --table-only        # the table in docs/megatron.md from the JSON

A job is one (workload, system, CUDA-graph mode). It runs ``examples/megatron_gpt.py`` twice,
each in a process of its own: the baseline (the same system and flags with offloading off) and
the run with ``--offload-modules``; a workload whose baseline has flags of its own (full
recompute) runs a third time, its offloading flags with offloading off, for the losses. ``--system offload`` is this library
(``offload.integrations.megatron``); ``--system megatron`` is Megatron's own
``--fine-grained-activation-offloading`` with the same names. Each job becomes one record of
``--out`` (merged by workload, system and CUDA-graph mode into what the file holds) with exactly
the fields `RECORD_FIELDS`; per-run JSON files and logs go to ``--runs-dir``. A Markdown table of
all records replaces the one between the ``headtohead`` markers of docs/megatron.md
(``--markdown``). Any failed run makes the script exit 1, and a failed job writes no record.
With ``--repeats N`` a job's runs go N times, alternating (baseline, offloading, baseline, ...),
each in a process of its own: the record's step times are the medians of all the rounds'
measured steps together (a host-paced step varies between processes by more than a few percent),
its peaks the highest, and its losses bitwise only if every round's are. Rounds too long for one
sitting (a device call) run one at a time with ``--round K`` (files ``-r<K>``, a record of that
round alone); ``--reuse --repeats N`` over a runs dir holding all N then pools them, running
nothing. ``--warmup-steps N``
leaves each run's first N steps out of its times and peaks (default 2, or 6 with CUDA graphs).
Variants (FP8, pipeline parallelism) go through ``--extra`` and get a ``--tag``:

    python benchmarks/megatron_headtohead.py --extra "--fp8 current" --tag fp8-current
    python benchmarks/megatron_headtohead.py --tag pp2-vpp2 --extra "--pp 2 --vpp 2 --microbatches 8" \\
        --example "python -m torch.distributed.run --standalone --nproc-per-node 2 examples/megatron_gpt.py"

Another set of names is a variant too (``--modules``, which needs a ``--tag``):

    python benchmarks/megatron_headtohead.py --workloads dsv3_proxy --modules attn_norm,mlp_norm,moe_act --tag fit

Workloads (`WORKLOADS`; the model presets are in examples/megatron_gpt.py, sized for one 80 GB
H100, Transformer Engine layer spec, bf16):

* ``dsv3_proxy``: a DeepSeek-V3-like MoE (multi-latent attention, 32 fine-grained experts, top-4,
  grouped GEMM), offloading ``expert_fc1,moe_act`` and the two norms; with CUDA graphs: attention
  graphed by Transformer Engine, MoE eager (``transformer_engine:attn``).
* ``dense_16k``: a dense GPT at sequence 16384 offloading ``qkv_linear,core_attn,attn_proj``; with
  CUDA graphs: attention only, and whole layers.
* ``dense_16k_mlp_recompute``: the same dense GPT and names with the MLP recomputed in both runs
  (``--recompute-granularity selective --recompute-modules mlp``), as the article's Qwen3 run
  recomputed its MoE: the names' share of what a layer keeps bounds how much of the peak
  offloading them can remove, and without the recompute the SwiGLU MLP keeps most of a layer's
  bytes. With ``--extra=--no-deterministic`` the peak leaves out deterministic fused attention's
  backward workspace (quadratic in the sequence, about 13 GiB of this model's deterministic peak).
* ``moe_act_vs_full_recompute``: the MoE with ``moe_act`` offloaded and the rest recomputed
  (``--recompute-modules core_attn,layernorm,mla_up_proj``); its baseline is full recompute
  (``--recompute-granularity full``, uniform, one layer per unit) without offloading, and its
  losses are compared with the same selective recompute without offloading.

Both systems run the graph modes: this library captures its groups inside Megatron's
Transformer Engine graphs (`offload.integrations.megatron_graphs`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORD_FIELDS = ("workload", "system", "cuda_graph", "modules", "step_ms", "peak_bytes", "baseline_step_ms",
                 "baseline_peak_bytes", "losses_bitwise", "device", "command")
SYSTEMS = ("offload", "megatron")
MARKERS = ("<!-- headtohead:begin -->", "<!-- headtohead:end -->")
MODULES_NEED_A_TAG = "--modules offloads other names than the workload's: give the variant a --tag"


@dataclass(frozen=True)
class Workload:
    """A model and what to offload. ``offload_args`` go to the offloading run only, ``baseline_args``
    to the baseline only (both to both runs when equal); ``graphs`` are the (impl, regions) CUDA-graph
    modes to run besides none (``""``: whole layers)."""

    name: str
    model_args: tuple[str, ...]
    modules: str
    offload_args: tuple[str, ...] = ()
    baseline_args: tuple[str, ...] | None = None
    graphs: tuple[tuple[str, str], ...] = ()

    @property
    def module_list(self) -> list[str]:
        return [m for m in self.modules.split(",") if m]


WORKLOADS: dict[str, Workload] = {w.name: w for w in (
    Workload("dsv3_proxy", ("--model", "dsv3_proxy"), "attn_norm,mlp_norm,expert_fc1,moe_act",
             graphs=(("transformer_engine", "attn"),)),
    Workload("dense_16k", ("--model", "dense_16k"), "qkv_linear,core_attn,attn_proj",
             graphs=(("transformer_engine", "attn"), ("transformer_engine", ""))),
    Workload("dense_16k_mlp_recompute", ("--model", "dense_16k"), "qkv_linear,core_attn,attn_proj",
             offload_args=("--recompute-granularity", "selective", "--recompute-modules", "mlp")),
    Workload("moe_act_vs_full_recompute", ("--model", "dsv3_proxy"), "moe_act",
             offload_args=("--recompute-modules", "core_attn,layernorm,mla_up_proj"),
             baseline_args=("--recompute-granularity", "full", "--recompute-method", "uniform",
                            "--recompute-num-layers", "1")),
)}


def run_key(workload: str, system: str, cuda_graph: str) -> str:
    """The stem of a job's per-run files, from the names its record gives: workload (with its
    ``/<tag>``), system and CUDA-graph label."""
    return f"{workload.replace('/', '-')}-{system}-{cuda_graph.replace(':', '-').replace('+', '-')}"


def run_path(runs_dir: Path, key: str, run: str, round_: int = 1) -> Path:
    """Where round ``round_`` of a job's ``run`` keeps its JSON (`--repeats`: ``-r<k>`` after the first)."""
    return runs_dir / f"{key}-{run}{'' if round_ == 1 else f'-r{round_}'}.json"


def graph_label(graph: tuple[str, str] | None) -> str:
    """How records name a CUDA-graph mode (as `offload.integrations.megatron.CudaGraphMode.label`)."""
    if graph is None:
        return "none"
    impl, regions = graph
    return f"{impl}:{regions.replace(',', '+') or 'layer'}"


@dataclass(frozen=True)
class Job:
    """One (workload, system, CUDA-graph mode): a baseline run and an offloading run."""

    workload: Workload
    system: str
    graph: tuple[str, str] | None = None
    measured_steps: int = 20
    extra: tuple[str, ...] = field(default=())
    tag: str = ""
    warmup: int | None = None

    def __post_init__(self) -> None:
        if self.warmup is not None and self.warmup < self.fewest_warmup_steps:
            raise ValueError(f"--warmup-steps {self.warmup}: {self.key} needs at least {self.fewest_warmup_steps} "
                             "(with CUDA graphs: their 3 warm-up steps, the capture and one more)")

    @property
    def name(self) -> str:
        """The workload as records name it: with ``/<tag>`` for a variant (``--tag fp8-current``)."""
        return f"{self.workload.name}/{self.tag}" if self.tag else self.workload.name

    @property
    def key(self) -> str:
        return run_key(self.name, self.system, graph_label(self.graph))

    @property
    def fewest_warmup_steps(self) -> int:
        return 1 if self.graph is None else 3 + 3  # the graphs' 3 warm-up steps, the capture, one more

    @property
    def warmup_steps(self) -> int:
        """Steps left out of times and peaks: ``warmup`` if given, else 2 without graphs, 6 with them."""
        if self.warmup is not None:
            return self.warmup
        return 2 if self.graph is None else self.fewest_warmup_steps

    @property
    def runs(self) -> tuple[str, ...]:
        """The job's runs: the baseline and the offloading run, and where the baseline has flags
        of its own (full recompute), the ``reference``: the offloading run's flags with
        offloading off, which its losses must equal bitwise."""
        return ("baseline", "offload") if self.workload.baseline_args is None else ("baseline", "reference", "offload")

    def args(self, run: str) -> list[str]:
        """The example's arguments for one of `runs`."""
        if run not in self.runs:
            raise ValueError(f"{self.key}: no run {run!r} (runs: {', '.join(self.runs)})")
        w = self.workload
        out = [*w.model_args, "--system", self.system,
               "--steps", str(self.warmup_steps + self.measured_steps), "--warmup-steps", str(self.warmup_steps)]
        if self.graph is not None:
            impl, regions = self.graph
            out += ["--cuda-graph-impl", impl, f"--cuda-graph-modules={regions}"]
        out += list(w.baseline_args if run == "baseline" and w.baseline_args is not None else w.offload_args)
        if run == "offload":
            out.append(f"--offload-modules={w.modules}")
        return out + list(self.extra)


def build_jobs(workloads: list[Workload], systems: list[str], graphs: str = "all",
               measured_steps: int = 20, extra: tuple[str, ...] = (), tag: str = "",
               modules: str = "", warmup: int | None = None) -> list[Job]:
    """The jobs: each workload × system without graphs (``graphs`` ``all`` or ``none``), and with
    each of the workload's graph modes (``all`` or ``only``). ``modules``, when given, replaces the
    workloads' offloaded names; such a variant needs a ``tag``, so that its records do not take the
    place of the workload's own. ``warmup`` replaces each run's warm-up steps (`Job.warmup_steps`)."""
    if modules and not tag:
        raise ValueError(MODULES_NEED_A_TAG)
    jobs = []
    for w in workloads:
        if modules:
            w = replace(w, modules=modules)
        for system in systems:
            modes: list[tuple[str, str] | None] = [] if graphs == "only" else [None]
            if graphs != "none":
                modes += list(w.graphs)
            jobs += [Job(w, system, g, measured_steps, tuple(extra), tag, warmup) for g in modes]
    return jobs


def _ranks_max(run: dict, key: str) -> float | None:
    values = [v for v in run.get(key) or [] if v is not None]
    return max(values) if values else None


def peak_bytes(run: dict) -> int | None:
    """The run's peak: allocated memory plus the CUDA graphs' private pools, on its fullest rank."""
    per_rank = run.get("per_rank") or []
    totals = [(r.get("peak_memory_bytes") or 0) + (r.get("graph_pool_bytes") or 0)
              for r in per_rank if r.get("peak_memory_bytes") is not None]
    return max(totals) if totals else None


def losses_bitwise(baseline: dict, offloaded: dict) -> bool:
    """Whether every microbatch loss of every step is the same float (``loss_hex``)."""
    return bool(baseline.get("loss_hex")) and baseline.get("loss_hex") == offloaded.get("loss_hex")


def pooled_step_ms(runs: list[dict], warmup_steps: int) -> float | None:
    """The median step time of ``runs`` (rounds of one run, `--repeats`): per rank, the median of
    every round's measured steps together; the slowest rank's. Runs without per-step times give
    the median of their own medians."""
    by_rank: dict[int, list[float]] = {}
    for run in runs:
        for i, rank in enumerate(run.get("per_rank") or []):
            by_rank.setdefault(i, []).extend((rank.get("step_time_ms") or [])[warmup_steps:])
    medians = [statistics.median(times) for times in by_rank.values() if times]
    if medians:
        return max(medians)
    own = [m for m in (_ranks_max(run, "median_step_time_ms") for run in runs) if m is not None]
    return statistics.median(own) if own else None


def _highest(values: list[int | None]) -> int | None:
    known = [v for v in values if v is not None]
    return max(known) if known else None


def build_record(job: Job, baselines: list[dict], offloaded: list[dict], command: str,
                 references: list[dict] | None = None) -> dict:
    """The job's record (`RECORD_FIELDS`) from its runs' JSON, one per round (`--repeats`): step
    time and peak against the baseline's, losses against the ``references`` where the job has
    them (`Job.runs`), round by round."""
    measured = measured_fields(baselines, offloaded, references, job.warmup_steps)
    return {
        "workload": job.name,
        "system": job.system,
        "cuda_graph": offloaded[0].get("cuda_graph") or graph_label(job.graph),
        "modules": job.workload.module_list,
        **measured,
        "device": offloaded[0].get("device"),
        "command": command,
    }


def measured_fields(baselines: list[dict], offloaded: list[dict], references: list[dict] | None,
                    warmup_steps: int) -> dict:
    """The record's measured fields (`RECORD_FIELDS` from ``step_ms`` to ``losses_bitwise``) from
    its runs' JSON, one per round."""
    step = pooled_step_ms(offloaded, warmup_steps)
    base_step = pooled_step_ms(baselines, warmup_steps)
    compared = baselines if references is None else references
    return {
        "step_ms": None if step is None else round(step, 3),
        "peak_bytes": _highest([peak_bytes(run) for run in offloaded]),
        "baseline_step_ms": None if base_step is None else round(base_step, 3),
        "baseline_peak_bytes": _highest([peak_bytes(run) for run in baselines]),
        "losses_bitwise": len(compared) == len(offloaded) and all(
            losses_bitwise(ref, off) for ref, off in zip(compared, offloaded)),
    }


def run_failure(rc: int | None, result: dict | None) -> str | None:
    """Why a run failed (exit status, missing JSON, ``ok`` false), or ``None``."""
    if rc not in (0, None):
        return f"exit status {rc}"
    if result is None:
        return "no JSON written"
    if not result.get("ok"):
        errors = [r.get("error", "") for r in result.get("per_rank") or [] if r.get("error")]
        return (errors[0].strip().splitlines() or ["ok is false"])[-1] if errors else "ok is false"
    return None


def shown_command(example: list[str], args: list[str]) -> str:
    """The command a record shows: ``python`` for this interpreter, without the output path."""
    return shlex.join(["python" if part == sys.executable else part for part in example] + args)


def run_example(example: list[str], args: list[str], out: Path, timeout: float) -> tuple[int | None, dict | None]:
    """Run the example once (its own process); (exit status, its JSON or None)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.unlink(missing_ok=True)
    cmd = [*example, *args, "--json", str(out)]
    log = out.with_suffix(".log")
    t0 = time.time()
    with log.open("w") as fh:
        try:
            rc: int | None = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT,
                                            timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    result = json.loads(out.read_text()) if out.exists() else None
    print(f"  {out.stem}: rc={rc} in {time.time() - t0:.0f} s", file=sys.stderr, flush=True)
    return rc, result


def run_job(job: Job, example: list[str], runs_dir: Path, timeout: float, reuse: bool,
            repeats: int = 1, only_round: int | None = None) -> tuple[dict | None, str | None]:
    """Run (or, with ``reuse``, read back) a job's runs (`Job.runs`), ``repeats`` rounds of them,
    or round ``only_round`` alone (the first round's files are ``<key>-<run>.json``, round k's
    ``<key>-<run>-r<k>.json``); (record, failure)."""
    results: dict[str, list[dict]] = {run: [] for run in job.runs}
    for round_ in [only_round] if only_round else range(1, repeats + 1):
        for run in job.runs:
            out = run_path(runs_dir, job.key, run, round_)
            cached = json.loads(out.read_text()) if reuse and out.exists() else None
            if cached is not None and cached.get("ok"):
                results[run].append(cached)
                continue
            rc, result = run_example(example, job.args(run), out, timeout)
            why = run_failure(rc, result)
            if why is not None:
                return None, f"{out.stem}: {why} (log: {out.with_suffix('.log')})"
            results[run].append(result)
    command = shown_command(example, job.args("offload"))
    return build_record(job, results["baseline"], results["offload"], command, results.get("reference")), None


def record_key(record: dict) -> tuple[str, str, str]:
    return record["workload"], record["system"], record["cuda_graph"]


def merge_records(existing: list[dict], new: list[dict]) -> list[dict]:
    """``existing`` with ``new`` in place of records of the same workload, system and graph mode."""
    by_key = {record_key(r): r for r in existing}
    by_key.update({record_key(r): r for r in new})
    return sorted(by_key.values(), key=record_key)


def _gib(n: int | None) -> str:
    return "–" if n is None else f"{n / 2**30:.2f}"


def _change(base: float | None, value: float | None) -> str:
    return "" if not base or value is None else f" ({100 * (value / base - 1):+.1f}%)"


def markdown_table(records: list[dict]) -> str:
    """One row per record: step time and peak, baseline → offloading."""
    lines = ["| workload | system | CUDA graphs | modules | step ms, baseline → offload | "
             "peak GiB, baseline → offload | losses bitwise | device |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        step = f"{r['baseline_step_ms']} → {r['step_ms']}{_change(r['baseline_step_ms'], r['step_ms'])}"
        peak = (f"{_gib(r['baseline_peak_bytes'])} → {_gib(r['peak_bytes'])}"
                f"{_change(r['baseline_peak_bytes'], r['peak_bytes'])}")
        lines.append(f"| {r['workload']} | {r['system']} | {r['cuda_graph']} | {','.join(r['modules'])} | {step} | "
                     f"{peak} | {r['losses_bitwise']} | {r['device']} |")
    return "\n".join(lines) + "\n"


def update_markdown(path: Path, table: str) -> None:
    """Replace what lies between the ``headtohead`` markers of ``path`` with ``table``."""
    text = path.read_text()
    begin, end = MARKERS
    if begin not in text or end not in text:
        raise SystemExit(f"{path}: no {begin} ... {end} markers to put the table between")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{table}{end}{tail}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma-separated, of: " + ", ".join(WORKLOADS))
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated, of: offload, megatron")
    p.add_argument("--graphs", choices=["all", "none", "only"], default="all",
                   help="all: without and with each workload's CUDA-graph modes; none: without; only: with")
    p.add_argument("--measured-steps", type=int, default=20, help="timed steps per run, after the warm-up")
    p.add_argument("--warmup-steps", type=int, default=None,
                   help="steps per run left out of times and peaks (default: 2, or 6 with CUDA graphs); at "
                        "DeepSeek-V3's widths the steps shorten over a run's first ten")
    p.add_argument("--extra", default="", help="appended to every run's arguments (e.g. '--fp8 current')")
    p.add_argument("--modules", default="",
                   help="offload these names instead of the workload's (needs --tag), e.g. attn_norm,mlp_norm,moe_act")
    p.add_argument("--tag", default="", help="a variant's name: records say <workload>/<tag> (e.g. fp8-current)")
    p.add_argument("--example", default=f"{shlex.quote(sys.executable)} examples/megatron_gpt.py",
                   help="the command that runs the example (default: this Python)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of each job's runs, alternating, each run in its own process; the record pools them")
    p.add_argument("--round", type=int, default=None, metavar="K",
                   help="run round K of --repeats alone (its files -rK): rounds over several sittings, "
                        "pooled afterwards by --reuse --repeats N")
    p.add_argument("--runs-dir", type=Path, default=ROOT / "docs/results/megatron/headtohead_runs")
    p.add_argument("--out", type=Path, default=ROOT / "docs/results/megatron/headtohead.json")
    p.add_argument("--markdown", type=Path, default=ROOT / "docs/megatron.md",
                   help="the file whose headtohead markers get the table ('-': none)")
    p.add_argument("--reuse", action="store_true", help="read back runs whose JSON in --runs-dir is ok")
    p.add_argument("--list", action="store_true", help="print the jobs and their commands; run nothing")
    p.add_argument("--table-only", action="store_true", help="only write the table from --out")
    args = p.parse_args(argv)
    unknown = [w for w in args.workloads.split(",") if w not in WORKLOADS]
    unknown += [s for s in args.systems.split(",") if s not in SYSTEMS]
    if unknown:
        p.error(f"unknown workload or system: {', '.join(unknown)}")
    if args.repeats < 1:
        p.error(f"--repeats must be at least 1, got {args.repeats}")
    if args.round is not None and (args.round < 1 or args.repeats > 1):
        p.error(f"--round {args.round}: give one round, at least 1, without --repeats (which pools them afterwards)")
    if args.modules:
        if not args.tag:
            p.error(MODULES_NEED_A_TAG)
        refused = refused_modules(args.modules, args.systems.split(","))
        if refused:
            p.error(refused)
    return args


def refused_modules(modules: str, systems: list[str]) -> str | None:
    """Why ``modules`` cannot run, before any run starts: a name the integration does not have,
    or (``megatron`` among ``systems``) one Megatron's own offloading does not share; else None."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from offload.config import check_known, parse_module_list
    from offload.errors import OffloadError
    from offload.integrations.megatron_names import AUTO, NAMES, to_megatron_names

    try:
        if "megatron" in systems:
            to_megatron_names(modules)
        else:
            check_known(parse_module_list(modules), [*NAMES, AUTO], "--modules")
    except OffloadError as exc:
        return str(exc)
    return None


def write_outputs(out: Path, records: list[dict], markdown: Path | None) -> None:
    existing = json.loads(out.read_text()) if out.exists() else []
    merged = merge_records(existing, records)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(merged, indent=1) + "\n")
    table = markdown_table(merged)
    out.with_suffix(".md").write_text(table)
    if markdown is not None:
        update_markdown(markdown, table)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    markdown = None if str(args.markdown) == "-" else args.markdown
    if args.table_only:
        write_outputs(args.out, [], markdown)
        return 0
    try:
        jobs = build_jobs([WORKLOADS[w] for w in args.workloads.split(",")], args.systems.split(","), args.graphs,
                          args.measured_steps, tuple(shlex.split(args.extra)), args.tag, args.modules,
                          args.warmup_steps)
    except ValueError as exc:  # a job refused its settings before any run
        print(f"megatron_headtohead.py: {exc}", file=sys.stderr)
        return 2
    example = shlex.split(args.example)
    if args.list:
        for job in jobs:
            for run in job.runs:
                print(f"{job.key} {run}: {shown_command(example, job.args(run))}")
        return 0
    records, failures = [], []
    for job in jobs:
        print(f"{job.key}:", file=sys.stderr, flush=True)
        record, failure = run_job(job, example, args.runs_dir, args.timeout, args.reuse, args.repeats, args.round)
        if record is not None:
            records.append(record)
        else:
            failures.append(failure)
    write_outputs(args.out, records, markdown)
    print(markdown_table(records), end="")
    if failures:
        print(f"megatron_headtohead.py: {len(failures)} of {len(jobs)} job(s) failed:\n  " + "\n  ".join(failures),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
