"""benchmarks/megatron_headtohead.py and the flags it drives in examples/megatron_gpt.py (CPU).

The GPU runs are not made here: the job list and commands, the records built from two runs'
JSON, the table, failures (exit status 1, no record), and one small job end to end through the
example on the CPU (local layer spec, gloo).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")

from offload.errors import OffloadError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CPU_EXAMPLE = f"{sys.executable} {ROOT / 'tests/integrations/megatron_cpu.py'}"
TINY = ("--transformer-impl local --layers 2 --hidden 64 --heads 4 --query-groups 2 --ffn 96 --seq 16 "
        "--vocab 128 --device cpu --offload-min-tensor-bytes 0")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def h2h():
    return _load("megatron_headtohead", ROOT / "benchmarks/megatron_headtohead.py")


@pytest.fixture
def example(megatron_cpu):
    return _load("megatron_gpt_example", ROOT / "examples/megatron_gpt.py")


def _run(loss_hex, step_ms, peak, pools=0, ok=True, device="NVIDIA H100 80GB HBM3", graph="none"):
    return {"ok": ok, "loss_hex": loss_hex, "device": device, "cuda_graph": graph,
            "median_step_time_ms": [step_ms], "per_rank": [{"peak_memory_bytes": peak, "graph_pool_bytes": pools}]}


# ----------------------------------------------------------------------------- the jobs
def test_jobs_cover_each_workload_and_system_with_megatrons_graph_modes(h2h):
    jobs = h2h.build_jobs(list(h2h.WORKLOADS.values()), ["offload", "megatron"])
    keys = [j.key for j in jobs]
    assert keys == ["dsv3_proxy-offload-none", "dsv3_proxy-offload-transformer_engine-attn",
                    "dsv3_proxy-megatron-none", "dsv3_proxy-megatron-transformer_engine-attn",
                    "dense_16k-offload-none", "dense_16k-offload-transformer_engine-attn",
                    "dense_16k-offload-transformer_engine-layer",
                    "dense_16k-megatron-none", "dense_16k-megatron-transformer_engine-attn",
                    "dense_16k-megatron-transformer_engine-layer",
                    "dense_16k_mlp_recompute-offload-none", "dense_16k_mlp_recompute-megatron-none",
                    "moe_act_vs_full_recompute-offload-none", "moe_act_vs_full_recompute-megatron-none"]
    labels = [h2h.graph_label(j.graph) for j in h2h.build_jobs([h2h.WORKLOADS["dense_16k"]], ["offload"])]
    assert labels == ["none", "transformer_engine:attn", "transformer_engine:layer"]
    assert len(h2h.build_jobs(list(h2h.WORKLOADS.values()), ["megatron"], graphs="none")) == 4
    recompute = h2h.Job(h2h.WORKLOADS["dense_16k_mlp_recompute"], "offload")
    mlp = ["--recompute-granularity", "selective", "--recompute-modules", "mlp"]
    assert all(" ".join(mlp) in " ".join(recompute.args(run)) for run in recompute.runs)  # both runs recompute
    assert "--offload-modules=qkv_linear,core_attn,attn_proj" in recompute.args("offload")
    only = h2h.build_jobs(list(h2h.WORKLOADS.values()), ["offload", "megatron"], graphs="only")
    assert [j.key for j in only] == [k for k in keys if not k.endswith("-none")]


def test_job_commands_differ_only_in_offloading(h2h):
    dense = h2h.Job(h2h.WORKLOADS["dense_16k"], "megatron", ("transformer_engine", "attn"), measured_steps=5)
    assert dense.runs == ("baseline", "offload")
    base, off = dense.args("baseline"), dense.args("offload")
    assert off == base + ["--offload-modules=qkv_linear,core_attn,attn_proj"]
    assert base[:4] == ["--model", "dense_16k", "--system", "megatron"]
    assert "--cuda-graph-modules=attn" in base and base[base.index("--warmup-steps") + 1] == "6"
    assert base[base.index("--steps") + 1] == "11"
    recompute = h2h.Job(h2h.WORKLOADS["moe_act_vs_full_recompute"], "offload")
    assert recompute.runs == ("baseline", "reference", "offload")
    base, ref, off = (recompute.args(run) for run in recompute.runs)
    assert "--recompute-granularity" in base and "full" in base and "--recompute-modules" not in base
    assert off[-3:] == ["--recompute-modules", "core_attn,layernorm,mla_up_proj", "--offload-modules=moe_act"]
    assert off == ref + ["--offload-modules=moe_act"]
    with pytest.raises(ValueError, match="no run 'reference'"):
        dense.args("reference")


def test_modules_replace_the_workloads_names_only_in_a_tagged_variant(h2h, capsys):
    jobs = h2h.build_jobs([h2h.WORKLOADS["dsv3_proxy"]], ["offload", "megatron"], graphs="none",
                          tag="fit", modules="attn_norm,mlp_norm,moe_act")
    assert [j.key for j in jobs] == ["dsv3_proxy-fit-offload-none", "dsv3_proxy-fit-megatron-none"]
    assert jobs[0].args("offload")[-1] == "--offload-modules=attn_norm,mlp_norm,moe_act"
    assert not any(a.startswith("--offload-modules") for a in jobs[0].args("baseline"))
    assert jobs[1].workload.module_list == ["attn_norm", "mlp_norm", "moe_act"]
    assert h2h.WORKLOADS["dsv3_proxy"].modules == "attn_norm,mlp_norm,expert_fc1,moe_act"
    with pytest.raises(ValueError, match="--tag"):
        h2h.build_jobs([h2h.WORKLOADS["dsv3_proxy"]], ["offload"], modules="moe_act")
    with pytest.raises(SystemExit):
        h2h.main(["--list", "--workloads", "dsv3_proxy", "--modules", "moe_act"])
    assert "give the variant a --tag" in capsys.readouterr().err
    for systems, bad, message in (("offload", "moe_actt", "moe_act"),  # a suggestion
                                  ("offload,megatron", "moe_act,router", "has no router"),
                                  ("megatron", "auto", "planner")):
        with pytest.raises(SystemExit) as exit_:
            h2h.main(["--list", "--workloads", "dsv3_proxy", "--systems", systems, "--modules", bad, "--tag", "x"])
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    assert h2h.main(["--list", "--workloads", "dsv3_proxy", "--systems", "offload", "--modules", "auto",
                     "--tag", "x"]) == 0
    assert "--offload-modules=auto" in capsys.readouterr().out


def test_losses_compare_with_the_reference_where_the_baseline_differs(h2h):
    job = h2h.Job(h2h.WORKLOADS["moe_act_vs_full_recompute"], "offload")
    full, same = _run([["0x1.8p+1"]], 120.0, 9 << 30), _run([["0x1.4p+1"]], 100.0, 10 << 30)
    record = h2h.build_record(job, [full], [same], "", references=[_run([["0x1.4p+1"]], 101.0, 11 << 30)])
    assert record["losses_bitwise"] is True
    assert (record["baseline_step_ms"], record["baseline_peak_bytes"]) == (120.0, 9 << 30)
    assert h2h.build_record(job, [full], [same], "")["losses_bitwise"] is False


# --------------------------------------------------------------------------- the records
def test_record_has_exactly_the_fields_and_counts_graph_pools(h2h):
    job = h2h.Job(h2h.WORKLOADS["dsv3_proxy"], "megatron", ("transformer_engine", "attn"))
    base = _run([["0x1.8p+1", "0x1.4p+1"]], 100.0, 10 << 30, pools=1 << 30, graph="transformer_engine:attn")
    off = _run([["0x1.8p+1", "0x1.4p+1"]], 101.5, 8 << 30, pools=1 << 30, graph="transformer_engine:attn")
    record = h2h.build_record(job, [base], [off], "python examples/megatron_gpt.py ...")
    assert tuple(record) == h2h.RECORD_FIELDS
    assert record == {
        "workload": "dsv3_proxy", "system": "megatron", "cuda_graph": "transformer_engine:attn",
        "modules": ["attn_norm", "mlp_norm", "expert_fc1", "moe_act"], "step_ms": 101.5, "peak_bytes": 9 << 30,
        "baseline_step_ms": 100.0, "baseline_peak_bytes": 11 << 30, "losses_bitwise": True,
        "device": "NVIDIA H100 80GB HBM3", "command": "python examples/megatron_gpt.py ...",
    }
    off["loss_hex"] = [["0x1.8p+1", "0x1.4000000000001p+1"]]
    assert h2h.build_record(job, [base], [off], "")["losses_bitwise"] is False
    assert h2h.losses_bitwise(_run([], 1, 1), _run([], 1, 1)) is False  # no losses: nothing shown equal


def test_rounds_pool_their_measured_steps_take_the_highest_peak_and_all_their_losses(h2h):
    """``--repeats``: the step time is the median of every round's measured steps together, per
    rank, the slowest rank's (not a median of medians); a run without per-step times counts by
    its own median; the peak is the highest; one round's losses that differ make it False."""
    job = h2h.Job(h2h.WORKLOADS["dense_16k"], "offload")  # 2 warm-up steps

    def timed(steps_per_rank, peak, loss="0x1p+0"):
        run = _run([[loss]], 0.0, peak)
        run["per_rank"] = [{"peak_memory_bytes": peak, "step_time_ms": steps} for steps in steps_per_rank]
        return run

    base = [timed([[900, 900, 100, 101, 102]], 5 << 30), timed([[900, 900, 110, 111, 112]], 5 << 30)]
    off = [timed([[900, 900, 100, 100, 130], [900, 900, 1, 1, 1]], 4 << 30),
           timed([[900, 900, 120, 120, 120], [900, 900, 1, 1, 1]], 3 << 30)]
    record = h2h.build_record(job, base, off, "")
    assert (record["baseline_step_ms"], record["step_ms"]) == (106.0, 120.0)  # not 110, a median of medians
    assert (record["peak_bytes"], record["baseline_peak_bytes"], record["losses_bitwise"]) == (4 << 30, 5 << 30, True)
    off[1]["loss_hex"] = [["0x1.0000000000001p+0"]]
    assert h2h.build_record(job, base, off, "")["losses_bitwise"] is False
    assert h2h.build_record(job, base[:1], off, "")["losses_bitwise"] is False  # a round without its baseline
    plain = [_run([["0x1p+0"]], ms, 1) for ms in (100.0, 130.0, 110.0)]
    assert h2h.pooled_step_ms(plain, 2) == 110.0


def test_run_failures_are_named(h2h):
    assert h2h.run_failure(0, _run([["0x1p+0"]], 1, 1)) is None
    assert h2h.run_failure(1, None) == "exit status 1"
    assert h2h.run_failure(0, None) == "no JSON written"
    error = "Traceback ...\nOffloadError: offload: Megatron's CUDA graphs are on"
    failed = {"ok": False, "per_rank": [{"error": error}]}
    assert h2h.run_failure(0, failed) == "OffloadError: offload: Megatron's CUDA graphs are on"


# Records whose runs' JSON were not kept in headtohead_runs/ (two H100 jobs with FP8 and graphs,
# one H200 job of the 16K sequence); every other record is checked against its runs.
RECORDS_WITHOUT_RUNS = {
    "dense_16k-fp8-delayed-offload-transformer_engine-attn",
    "dense_16k-fp8-delayed-offload-transformer_engine-layer",
    "dsv3_proxy-dsv3-widths-16k-capacity-into-backward-nondeterministic-offload-none",
}


def _rounds(h2h, runs_dir, key, run):
    found, round_ = [], 1
    while (path := h2h.run_path(runs_dir, key, run, round_)).exists():
        found.append(json.loads(path.read_text()))
        round_ += 1
    return found


def test_the_published_records_are_what_their_runs_json_give(h2h):
    """docs/results/megatron/headtohead.json, as checks read it: each record has exactly the
    fields, and its figures, device and command are the ones its committed runs' JSON give
    (every round of them, `--repeats`), so no figure is edited by hand or left from older runs;
    the table in docs/megatron.md and headtohead.md is the one the records give."""
    results = ROOT / "docs/results/megatron"
    records = json.loads((results / "headtohead.json").read_text())
    keys = [h2h.run_key(r["workload"], r["system"], r["cuda_graph"]) for r in records]
    assert len(set(keys)) == len(keys)
    checked = 0
    for key, record in zip(keys, records):
        assert tuple(record) == h2h.RECORD_FIELDS, key
        runs = {run: _rounds(h2h, results / "headtohead_runs", key, run) for run in ("baseline", "offload", "reference")}
        if key in RECORDS_WITHOUT_RUNS:
            assert not runs["offload"], f"{key} has its runs now: check it"
            continue
        assert runs["offload"] and len(runs["baseline"]) == len(runs["offload"]), key
        measured = h2h.measured_fields(runs["baseline"], runs["offload"], runs["reference"] or None,
                                       runs["offload"][0]["warmup_steps"])
        assert {field: record[field] for field in measured} == measured, key
        assert record["device"] == runs["offload"][0]["device"], key
        example_args = runs["offload"][0]["command"].split(" --json ")[0].split("examples/megatron_gpt.py ", 1)[1]
        if "batch-sync" in key and "overlap_p2p_comm" not in runs["offload"][0]:
            # run before commit 960bd30, when batched exchanges were the example's default: the
            # record names the flag that repeats them now (docs/megatron.md, *Pipeline parallelism*)
            example_args += " --no-overlap-p2p-communication"
        assert record["command"].endswith("examples/megatron_gpt.py " + example_args), key  # a launcher may lead
        checked += 1
    assert checked == len(records) - len(RECORDS_WITHOUT_RUNS)
    table = h2h.markdown_table(records)
    assert (results / "headtohead.md").read_text() == table
    page = (ROOT / "docs/megatron.md").read_text()
    assert page.split(h2h.MARKERS[0])[1].split(h2h.MARKERS[1])[0].strip() == table.strip()


def test_records_merge_by_key_and_the_table_goes_between_the_markers(h2h, tmp_path):
    job = h2h.Job(h2h.WORKLOADS["dense_16k"], "offload")
    old = h2h.build_record(job, [_run([["0x1p+0"]], 100.0, 4 << 30)], [_run([["0x1p+0"]], 200.0, 3 << 30)], "old")
    new = h2h.build_record(job, [_run([["0x1p+0"]], 100.0, 4 << 30)], [_run([["0x1p+0"]], 102.0, 3 << 30)], "new")
    other = dict(new, system="megatron")
    merged = h2h.merge_records([old, other], [new])
    assert [r["command"] for r in merged] == ["new", "new"] and [r["system"] for r in merged] == ["megatron", "offload"]
    table = h2h.markdown_table([new])
    assert ("| dense_16k | offload | none | qkv_linear,core_attn,attn_proj | 100.0 → 102.0 (+2.0%) | "
            "4.00 → 3.00 (-25.0%) | True |") in table
    doc = tmp_path / "doc.md"
    doc.write_text(f"intro\n{h2h.MARKERS[0]}\nstale\n{h2h.MARKERS[1]}\noutro\n")
    h2h.update_markdown(doc, table)
    assert doc.read_text() == f"intro\n{h2h.MARKERS[0]}\n{table}{h2h.MARKERS[1]}\noutro\n"
    (tmp_path / "bare.md").write_text("no markers\n")
    with pytest.raises(SystemExit, match="markers"):
        h2h.update_markdown(tmp_path / "bare.md", table)
    assert h2h.MARKERS[0] in (ROOT / "docs/megatron.md").read_text()


# ------------------------------------------------------------------------- the driver runs
def test_list_prints_each_run_and_runs_nothing(h2h, tmp_path, capsys):
    assert h2h.main(["--list", "--workloads", "dense_16k,moe_act_vs_full_recompute", "--systems", "offload",
                     "--out", str(tmp_path / "h2h.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "dense_16k-offload-none baseline", "dense_16k-offload-none offload",
        "dense_16k-offload-transformer_engine-attn baseline", "dense_16k-offload-transformer_engine-attn offload",
        "dense_16k-offload-transformer_engine-layer baseline", "dense_16k-offload-transformer_engine-layer offload",
        "moe_act_vs_full_recompute-offload-none baseline", "moe_act_vs_full_recompute-offload-none reference",
        "moe_act_vs_full_recompute-offload-none offload"]
    assert lines[1].endswith("python examples/megatron_gpt.py --model dense_16k --system offload --steps 22 "
                             "--warmup-steps 2 --offload-modules=qkv_linear,core_attn,attn_proj")
    assert not (tmp_path / "h2h.json").exists()


def test_a_failed_run_exits_1_and_writes_no_record(h2h, tmp_path, capsys):
    failing = f"{sys.executable} -c 'import sys; sys.exit(3)'"
    out = tmp_path / "h2h.json"
    rc = h2h.main(["--workloads", "dense_16k", "--systems", "offload", "--graphs", "none", "--example", failing,
                   "--runs-dir", str(tmp_path / "runs"), "--out", str(out), "--markdown", "-"])
    assert rc == 1
    assert json.loads(out.read_text()) == []
    assert "1 of 1 job(s) failed" in capsys.readouterr().err


FAKE_EXAMPLE = """
import json, re, sys
out = sys.argv[sys.argv.index("--json") + 1]
round_ = int(re.search(r"-r(\\d+)\\.json$", out).group(1)) if re.search(r"-r\\d+\\.json$", out) else 1
step = 100.0 * round_ + ("--offload-modules=qkv_linear,core_attn,attn_proj" in sys.argv)
json.dump({"ok": True, "loss_hex": [["0x1p+0"]], "device": "fake", "cuda_graph": "none",
           "per_rank": [{"peak_memory_bytes": 1 << 30, "step_time_ms": [900.0, 900.0, step, step]}]}, open(out, "w"))
"""


def test_rounds_run_one_sitting_at_a_time_and_pool_afterwards(h2h, tmp_path):
    """``--round K`` runs round K alone into ``-rK`` files (a record of that round); ``--reuse
    --repeats N`` then pools the N rounds from the files, running nothing; a round that is
    not one, or one given with ``--repeats``, is refused before any run."""
    fake = tmp_path / "fake_example.py"
    fake.write_text(FAKE_EXAMPLE)
    runs, out = tmp_path / "runs", tmp_path / "h2h.json"
    common = ["--workloads", "dense_16k", "--systems", "offload", "--graphs", "none", "--measured-steps", "2",
              "--runs-dir", str(runs), "--out", str(out), "--markdown", "-"]
    assert h2h.main([*common, "--example", f"{sys.executable} {fake}", "--round", "2"]) == 0
    assert sorted(p.name for p in runs.glob("*.json")) == [
        "dense_16k-offload-none-baseline-r2.json", "dense_16k-offload-none-offload-r2.json"]
    [record] = json.loads(out.read_text())
    assert (record["baseline_step_ms"], record["step_ms"]) == (200.0, 201.0)
    assert h2h.main([*common, "--example", f"{sys.executable} {fake}", "--round", "1"]) == 0
    [record] = json.loads(out.read_text())
    assert (record["baseline_step_ms"], record["step_ms"]) == (100.0, 101.0)
    failing = f"{sys.executable} -c 'import sys; sys.exit(3)'"  # nothing may run now
    assert h2h.main([*common, "--example", failing, "--reuse", "--repeats", "2"]) == 0
    [record] = json.loads(out.read_text())
    assert (record["baseline_step_ms"], record["step_ms"]) == (150.0, 151.0)
    for bad in (["--round", "0"], ["--round", "2", "--repeats", "2"]):
        with pytest.raises(SystemExit) as exc:
            h2h.parse_args([*common, *bad])
        assert exc.value.code == 2


def test_one_job_end_to_end_on_the_cpu(h2h, tmp_path):
    """One job through the example on the CPU: its two runs, each a process of its own, and the
    record from them (rounds: `test_rounds_run_one_sitting_at_a_time_and_pool_afterwards`)."""
    out, doc, runs = tmp_path / "h2h.json", tmp_path / "megatron.md", tmp_path / "runs"
    doc.write_text(f"{h2h.MARKERS[0]}\n{h2h.MARKERS[1]}\n")
    rc = h2h.main(["--workloads", "dense_16k", "--systems", "offload", "--graphs", "none", "--measured-steps", "2",
                   "--extra", TINY, "--example", CPU_EXAMPLE, "--runs-dir", str(runs), "--out", str(out),
                   "--markdown", str(doc)])
    assert rc == 0
    assert sorted(p.name for p in runs.glob("*.json")) == [
        "dense_16k-offload-none-baseline.json", "dense_16k-offload-none-offload.json"]
    rounds = [json.loads((runs / "dense_16k-offload-none-offload.json").read_text())]
    [record] = json.loads(out.read_text())
    assert record["step_ms"] == round(h2h.pooled_step_ms(rounds, 2), 3)
    assert record["workload"] == "dense_16k" and record["system"] == "offload" and record["cuda_graph"] == "none"
    assert record["losses_bitwise"] is True and record["device"] == "cpu" and record["step_ms"] > 0
    assert record["command"] == (f"python {ROOT / 'tests/integrations/megatron_cpu.py'} --model dense_16k --system "
                                 "offload --steps 4 --warmup-steps 2 --offload-modules=qkv_linear,core_attn,attn_proj "
                                 + TINY)
    assert rounds[0]["per_rank"][0]["offload"]["by_name"]["core_attn"]["bytes_offloaded"] > 0
    assert "| dense_16k | offload | none |" in doc.read_text()


# -------------------------------------------------------------------- the example's flags
def test_example_flags_that_need_transformer_engine_say_so(example, capsys):
    if example.transformer_engine_error() is None:
        pytest.skip("Transformer Engine imports here")
    for argv, message in [
        (["--model", "dense_16k"], "needs Transformer Engine, which does not import here"),
        (["--transformer-impl", "transformer_engine"], "install it (docs/te.md) or use --transformer-impl local"),
        (["--system", "megatron"], "--system megatron needs --transformer-impl transformer_engine"),
        (["--fp8", "current"], "--fp8 current needs --transformer-impl transformer_engine"),
    ]:
        with pytest.raises(SystemExit):
            example.parse_args([*argv, "--device", "cpu"])
        assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, overlap", [
    (["--pp", "2", "--vpp", "2"], True),
    (["--pp", "2", "--vpp", "2", "--no-overlap-p2p-communication"], False),
    (["--pp", "2", "--vpp", "1"], False),
    (["--pp", "2", "--vpp", "1", "--interleaved"], False),
    ([], False),
], ids=["vpp2", "vpp2-no-overlap", "vpp1", "interleaved-vpp1", "no-pipeline"])
def test_example_exchanges_pipeline_tensors_as_megatron_lm_trains(example, argv, overlap):
    """Megatron-LM's training overlaps the interleaved schedule's sends and receives with
    compute and batches the others (each batch followed by a device synchronize, which waits
    for offloading's copies too); the example's config does the same, and its JSON says which."""
    args = example.parse_args(["--device", "cpu", "--model", "gpt", *argv])
    kw = example.config_kwargs(args)
    assert (kw["overlap_p2p_comm"], kw["batch_p2p_comm"]) == (overlap, not overlap)


@pytest.mark.parametrize("argv, message", [
    (["--offload-modules=core_attn", "--system", "megatron"], "it needs --system offload and --offload-modules"),
    ([], "it needs --system offload and --offload-modules"),
    (["--offload-modules=core_attn", "--device", "cuda", "--cuda-graph-impl", "transformer_engine",
      "--warmup-steps", "5"], "cannot suspend groups captured in CUDA graphs"),
    (["--offload-modules=core_attn", "--steps", "3", "--warmup-steps", "2"], "needs at least 2 measured steps"),
], ids=["megatron", "no-names", "graphs", "one-step"])
def test_example_alternate_baseline_is_refused_where_it_cannot_compare(example, capsys, argv, message):
    with pytest.raises(SystemExit):
        example.parse_args(["--device", "cpu", *argv, "--alternate-baseline"])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--offload-copies-into-backward"], ["--offload-max-inflight-groups", "2"],
                                  ["--offload-policy", "warmup_only"]], ids=lambda f: f[0])
def test_example_refuses_this_librarys_engine_settings_for_megatrons_own_offloading(example, capsys, flag):
    """Megatron's own offloading has no such settings: `--system megatron` with them would measure
    a run that silently ignored them."""
    with pytest.raises(SystemExit):
        example.parse_args(["--device", "cpu", "--system", "megatron", "--offload-modules=core_attn", *flag])
    assert f"{flag[0]}: this library's engine settings; Megatron's own offloading" in capsys.readouterr().err
    assert example.parse_args(["--device", "cpu", "--offload-modules=core_attn", *flag])


@pytest.mark.parametrize("argv, message", [
    (["--device", "cpu"], "it needs --device cuda"),
    (["--device", "cuda", "--steps", "3", "--warmup-steps", "2"], "it needs at least 2 measured steps"),
], ids=["cpu", "one-step"])
def test_example_peak_trace_is_refused_where_it_cannot_record(example, capsys, argv, message, tmp_path):
    with pytest.raises(SystemExit):
        example.parse_args([*argv, "--peak-trace", str(tmp_path)])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--steps", "3", "--warmup-steps", "2"], "it needs at least 2 measured steps"),
    (["--device", "cuda", "--peak-trace", "x"], "--peak-trace and --profile-trace each record the last step"),
    (["--decision-log", "x"], "--profile-trace and --decision-log each record the last step"),
], ids=["one-step", "with-peak-trace", "with-decision-log"])
def test_example_profile_trace_is_refused_where_it_cannot_record(example, capsys, argv, message, tmp_path):
    with pytest.raises(SystemExit):
        example.parse_args(["--device", "cpu", *argv, "--profile-trace", str(tmp_path)])
    assert message in capsys.readouterr().err


def test_example_config_for_megatrons_own_offloading_fp8_recompute_and_graphs(example):
    args = example.parse_args(["--model", "dsv3_proxy", "--transformer-impl", "local", "--device", "cpu",
                               "--offload-modules=expert_fc1,moe_act", "--recompute-granularity", "full"])
    args.system, args.fp8 = "megatron", "current"  # past the Transformer Engine checks
    args.cuda_graph_impl, args.cuda_graph_modules = "transformer_engine", "attn,moe_router"
    kw = example.config_kwargs(args)
    assert kw["fine_grained_activation_offloading"] is True and kw["offload_modules"] == ["expert_fc1", "moe_act"]
    assert kw["min_offloaded_tensor_size"] == (1 << 20) // 4  # bytes -> fp32 elements on the CPU
    assert (kw["fp8"], kw["fp8_recipe"]) == ("hybrid", "tensorwise")
    assert (kw["recompute_method"], kw["recompute_num_layers"]) == ("uniform", 1)
    assert kw["cuda_graph_impl"] == "transformer_engine"
    assert kw.get("cuda_graph_modules", kw.get("cuda_graph_scope")) == ["attn", "moe_router"]
    assert kw["multi_latent_attention"] and kw["moe_grouped_gemm"] and kw["gated_linear_unit"]
    assert "cross_entropy_loss_fusion" not in kw
    args.cross_entropy_loss_fusion = True
    kw = example.config_kwargs(args)
    assert (kw["cross_entropy_loss_fusion"], kw["cross_entropy_fusion_impl"]) == (True, "native")
    args.offload_modules = ["fc1"]
    with pytest.raises(OffloadError, match="Megatron's own offloading .* has no fc1"):
        example.config_kwargs(args)


def test_example_drops_the_autograd_history_megatrons_dispatcher_keeps_before_a_capture(example):
    """After a step, Megatron's allgather dispatcher still holds the last microbatch's
    ``local_probs`` with its autograd graph (which keeps the attention parameters'
    ``AccumulateGrad`` nodes alive, and Transformer Engine's capture fails on them): the example
    detaches such attributes before ``create_cudagraphs``, leaving parameters and training as they are."""
    import torch
    from test_megatron import build, fb_no_pipelining, train

    model = build(moe=True, layers=2)
    train(model, fb_no_pipelining(), steps=1)
    dispatchers = [m.token_dispatcher for m in model.modules() if hasattr(m, "token_dispatcher")]
    kept = [(h, n) for h in [*model.modules(), *dispatchers] for n, v in vars(h).items()
            if isinstance(v, torch.Tensor) and v.grad_fn is not None]
    assert any(n == "local_probs" for _, n in kept), kept
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert example.drop_autograd_history_kept_by_modules([model]) == len(kept)
    assert all(getattr(m, n).grad_fn is None for m, n in kept)
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    assert example.drop_autograd_history_kept_by_modules([model]) == 0
    train(model, fb_no_pipelining(), steps=1)  # the next forward sets them again


def test_example_memory_counts_name_the_allocators_calls_and_the_pinned_pool(example):
    """``memory_counts_per_step``: the caching allocator's counters by the names the JSON gives
    them (absent counters count 0), and this library's pinned allocations, ``None`` without its
    statistics (Megatron's own offloading)."""
    from types import SimpleNamespace

    stats = {"num_device_alloc": 7, "num_device_free": 3, "num_alloc_retries": 1, "num_sync_all_streams": 2,
             "allocated_bytes.all.current": 5}
    counts = example.memory_counts(stats, SimpleNamespace(pinned_allocations=4))
    assert counts == {"device_allocs": 7, "device_frees": 3, "alloc_retries": 1, "syncs_all_streams": 2,
                      "pinned_allocations": 4}
    assert example.memory_counts({}, None) == {"device_allocs": 0, "device_frees": 0, "alloc_retries": 0,
                                               "syncs_all_streams": 0, "pinned_allocations": None}


def test_example_offload_summary_takes_the_waits_from_the_latest_timed_step(example):
    """``offload`` in the JSON: the last step's counts, and the waits and copy rates of the latest
    step the engine timed (the copy-wait notice's steps), named by ``timed_iteration``; none
    where no step was timed, the last step's own where it was."""
    from offload.stats import GroupStats, IterationStats

    def stats(iteration, timed, wait_ms):
        s = GroupStats(groups=4, groups_offloaded=3, bytes_offloaded=300, offload_wait_ms=wait_ms,
                       flush_wait_ms=wait_ms / 2, reload_wait_ms=1.5, d2h_ms=0.5 if timed else 0.0)
        return IterationStats(iteration=iteration, by_name={"moe_act": s}, timed=timed)

    last, timed = stats(12, False, 0.0), stats(5, True, 7.0)
    out = example.stats_summary(last, timed)
    got = out["by_name"]["moe_act"]
    assert out["timed_iteration"] == 5
    assert (got["groups_offloaded"], got["offload_wait_ms"], got["flush_wait_ms"], got["reload_wait_ms"]) == (3, 7.0, 3.5, 1.5)
    assert got["d2h_gbps"] == 300 / 0.5 / 1e6
    plain = example.stats_summary(last, None)
    assert plain["timed_iteration"] is None and "offload_wait_ms" not in plain["by_name"]["moe_act"]
    own = example.stats_summary(stats(12, True, 2.0), timed)
    assert own["timed_iteration"] == 12 and own["by_name"]["moe_act"]["offload_wait_ms"] == 2.0
    assert example.stats_summary(None, timed) == {}


def test_warmup_steps_replace_each_runs_warmup_and_graphed_runs_keep_their_capture(h2h, capsys):
    """``--warmup-steps`` sets both runs' ``--warmup-steps`` and lengthens ``--steps`` by as much;
    a graphed job refuses fewer warm-up steps than its capture needs, before any run."""
    job, = h2h.build_jobs([h2h.WORKLOADS["dsv3_proxy"]], ["offload"], graphs="none", measured_steps=10, warmup=8)
    for run in job.runs:
        args = job.args(run)
        assert args[args.index("--steps") + 1] == "18" and args[args.index("--warmup-steps") + 1] == "8"
    plain, graphed = h2h.build_jobs([h2h.WORKLOADS["dsv3_proxy"]], ["offload"], measured_steps=10)
    assert (plain.warmup_steps, graphed.warmup_steps) == (2, 6)
    with pytest.raises(ValueError, match="--warmup-steps 4: dsv3_proxy-offload-transformer_engine-attn needs at least 6"):
        h2h.build_jobs([h2h.WORKLOADS["dsv3_proxy"]], ["offload"], graphs="only", warmup=4)
    assert h2h.main(["--list", "--workloads", "dsv3_proxy", "--systems", "offload", "--warmup-steps", "4"]) == 2
    assert "needs at least 6" in capsys.readouterr().err
    assert h2h.main(["--list", "--workloads", "dsv3_proxy", "--systems", "offload", "--graphs", "none",
                     "--warmup-steps", "8", "--measured-steps", "10"]) == 0
    assert "--steps 18 --warmup-steps 8" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--device", "cpu", "--device-memory-gib", "60"], "it needs --device cuda"),
    (["--device", "cuda", "--device-memory-gib", "0"], "give a positive number of GiB"),
    (["--device", "cuda", "--device-memory-gib", "-1"], "give a positive number of GiB"),
    (["--device", "cpu", "--expandable-segments"], "sets the CUDA caching allocator: it needs --device cuda"),
], ids=["cpu", "zero", "negative", "expandable-on-cpu"])
def test_example_device_memory_cap_is_refused_where_it_cannot_hold(example, capsys, argv, message):
    """The cap and expandable segments are the CUDA caching allocator's; a run on the CPU, or a
    cap of nothing, would measure an unchanged allocator under a changed one's name."""
    with pytest.raises(SystemExit):
        example.parse_args(argv)
    assert message in capsys.readouterr().err
