"""The peer benchmark (`benchmarks/peers.py`) on CPU: a smoke run's JSON and Markdown, the
targets' arithmetic on records with known figures, the profiler-trace summary, the run order
and time budget, the MoE model's routing, and the torchtune loader (where torchtune is
installed; CI does not install it)."""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import peers, peers_report  # noqa: E402
from benchmarks.models import MoE, ModelSpec, build  # noqa: E402
from offload.tools.trace_events import GpuOp, Timeline  # noqa: E402

GIB = 2**30
SMOKE_SIZES = ["gpt-s", "moe-s"]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, str, subprocess.CompletedProcess]:
    """One smoke run in a fresh interpreter (its workers fork from it, not from pytest)."""
    out = tmp_path_factory.mktemp("peers")
    cmd = [sys.executable, "benchmarks/peers.py", "--smoke", "--sizes", *SMOKE_SIZES,
           "--sweep-seq", "32", "64", "--sweep-hidden", "32", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, json.loads((out / "peers.json").read_text()), (out / "peers.md").read_text(), proc


def _configs(data: dict, size: str) -> dict[str, dict]:
    return {r["config"]["name"]: r for r in data["records"] if r["kind"] == "config" and r["size"] == size}


def test_smoke_json_has_one_record_per_configuration(smoke):
    out, data, _, proc = smoke
    meta = data["meta"]
    assert meta["device"] == "cpu" and meta["torch"] == torch.__version__
    assert "--smoke" in meta["command"]
    ids = [r["id"] for r in data["records"]]
    assert len(ids) == len(set(ids))
    for r in data["records"]:
        assert r["status"] in ("ok", "not_run"), (r["id"], r.get("error"))
        assert r["device"] == "cpu" and r["torch"] == torch.__version__ and r["command"] == meta["command"]
    for size in SMOKE_SIZES:
        spec = next(s for s in peers.SMOKE_SIZES if s.name == size)
        rows = _configs(data, size)
        assert set(rows) == {c.name for c in peers.configs_for(spec)}
        for name, r in rows.items():
            if r["status"] != "ok":
                continue
            assert len(r["step_ms_all"]) == 2 and r["step_ms"] > 0
            assert abs(r["step_ms"] - statistics.median(r["step_ms_all"])) < 0.01
            assert r["throughput_rel"] == pytest.approx(rows["none"]["step_ms"] / r["step_ms"])
            if r["config"]["offload"]:
                by_name = r["engine"]["by_name"]
                assert set(by_name) == set(r["config"]["offload"])
                assert r["bytes_offloaded"] == sum(s["bytes_offloaded"] for s in by_name.values()) > 0
            else:
                assert "engine" not in r
        assert all(rows[n]["status"] == "ok" for n in rows if n not in ("torchtune", "te", "megatron"))
        if importlib.util.find_spec("transformer_engine") is None:
            assert rows["te"]["status"] == "not_run" and "Transformer Engine" in rows["te"]["reason"]
            assert rows["megatron"]["status"] == "not_run" and "megatron-core" in rows["megatron"]["reason"]
        tt = rows["torchtune"]
        assert tt["status"] == "not_run"
        if importlib.util.find_spec("torchtune") is None:
            assert "not importable" in tt["reason"]
        else:
            assert "needs CUDA" in tt["reason"] and tt["torchtune"]["file_matches_wheel_record"] is True
        # save_on_cpu copies every saved tensor, weights' views included: more than the mapped
        # modules save, and some of it weights (their GPU copy stays, so nothing is freed there).
        soc = rows["save_on_cpu"]["peer_copies"]
        assert soc["param_bytes"] > 0
        assert soc["bytes_offloaded"] > sum(rows["none"]["saved_bytes_by_name"].values())
    experts = _configs(data, "moe-s")["offload:experts"]["engine"]["by_name"]["expert_fc1"]
    assert experts["groups"] > 3  # several groups (experts) per layer, 3 layers
    assert {p.name for p in (out / "logs").iterdir()} >= {f"{r['id']}.log" for r in data["records"]
                                                          if r.get("wall_s") is not None}
    assert "Targets:" in proc.stdout


def test_smoke_markdown_and_plots(smoke):
    out, data, md, _ = smoke
    for size in SMOKE_SIZES:
        heading = next(line for line in md.splitlines() if line.startswith(f"## {size}:"))
        table = md.split(heading, 1)[1].split(peers_report.RULE, 1)[1].split("\n\n", 1)[0].strip().splitlines()
        assert len(table) == len(_configs(data, size))
    assert peers_report.HEADER in md
    assert "not run: " in md
    for text in peers_report.TARGET_TEXT.values():
        assert f"### {text}" in md
    sweep = md.split("## Scaling sweep", 1)[1].split("\n\n")[2].strip().splitlines()
    assert len(sweep) == 2 + 3  # header, rule, three points (seq 32 and 64 at hidden 64, hidden 32)
    points = peers_report.sweep_points(data["records"])
    assert [p["axis"] for p in points] == ["seq", "seq", "hidden"] and all("copy_ms" in p for p in points)
    if importlib.util.find_spec("matplotlib") is None:
        assert "Not made: matplotlib is not installed" in md
    else:
        for name in ("peers_memory_time.png", "peers_scaling.png"):
            assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert f"]({name})" in md


def _rec(size: str, name: str, family: str, step: float, peak: float | None, **kw) -> dict:
    cfg = {"name": name, "family": family, "label": name, "offload": kw.pop("offload", ()), "recompute": (),
           "peer": kw.pop("peer", "")}
    spec = {"name": size, "hidden": 8, "heads": 1, "layers": 4, "seq": 8, "batch": 1, "ffn": 0, "experts": 0,
            "top_k": 2}
    return {"kind": "config", "size": size, "id": f"{size}__{name}", "status": "ok", "config": cfg, "spec": spec,
            "step_ms": step, "peak_allocated": None if peak is None else peak * GIB, "host_ms": 1.0, **kw}


def _engine(**names: tuple[int, int, float]) -> dict:
    """name=(groups, groups_offloaded, GiB offloaded)."""
    return {"by_name": {n: {"groups": g, "groups_offloaded": o, "bytes_offloaded": b * GIB}
                        for n, (g, o, b) in names.items()}}


def test_targets_on_known_figures():
    # 4 layers, a 5 ms layer forward, a 50 GB/s link: 0.2 GB per layer copies in 4 ms (fits).
    per_layer = 0.2e9 / GIB
    records = [
        _rec("x", "none", "none", 100.0, 10.0, layer_forward_ms=5.0, bytes_offloaded=0),
        _rec("x", "offload:a", "offload", 100.5, 10.0 - 0.98 * 3 * per_layer, offload=("a",),
             engine=_engine(a=(4, 3, 3 * per_layer)), bytes_offloaded=3 * per_layer * GIB,
             pinned_bytes=1.03 * 3 * per_layer * GIB),
        _rec("x", "offload:b", "offload", 102.0, 9.0, offload=("b",),  # 4 groups a layer (experts)
             engine=_engine(b=(16, 13, 13 / 4 * per_layer)), bytes_offloaded=13 / 4 * per_layer * GIB,
             pinned_bytes=1.2 * 13 / 4 * per_layer * GIB),
        _rec("x", "offload:big", "offload", 150.0, 7.0, offload=("c",),
             engine=_engine(c=(4, 3, 3.0)), bytes_offloaded=3.0 * GIB, pinned_bytes=3.0 * GIB),
        _rec("x", "recompute:full", "recompute", 130.0, 6.0, bytes_offloaded=0),
        _rec("x", "offload+recompute:ok", "offload+recompute", 115.0, 5.9, offload=("a",),
             engine=_engine(a=(4, 3, 4.0)), bytes_offloaded=4.0 * GIB, pinned_bytes=4.0 * GIB),
        _rec("x", "offload+recompute:slow", "offload+recompute", 125.0, 5.5, offload=("a",),
             engine=_engine(a=(4, 3, 4.5)), bytes_offloaded=4.5 * GIB, pinned_bytes=4.5 * GIB),
        _rec("x", "save_on_cpu", "peer", 300.0, 7.0, peer="save_on_cpu", bytes_offloaded=9 * GIB),
        _rec("x", "torchtune", "peer", 200.0, 4.0, peer="torchtune", bytes_offloaded=9 * GIB),
    ]
    peers_report.evaluate(records, 50.0)
    by = {r["config"]["name"]: r for r in records}
    assert by["offload:a"]["copy_fit"]["layer_bytes"] == pytest.approx(0.2e9)
    assert by["offload:a"]["copy_fit"]["copy_ms"] == pytest.approx(4.0) and by["offload:a"]["copy_fit"]["fits"]
    assert by["offload:b"]["copy_fit"]["layer_bytes"] == pytest.approx(0.2e9)  # 13 groups = 3.25 layers
    assert not by["offload:big"]["copy_fit"]["fits"]
    assert by["offload:a"]["removed_over_offloaded"] == pytest.approx(0.98)
    v = peers_report.targets(records, ["x"])
    fit = {e["config"]: e for e in v["fit"]}
    assert fit["offload:a"]["verdict"] == "met"
    assert fit["offload:b"]["verdict"] == "not met" and fit["offload:b"]["time"] == "not met"
    assert fit["offload:big"]["verdict"] == "n/a" and "do not fit" in fit["offload:big"]["reason"]
    rec = {e["config"]: e["verdict"] for e in v["recompute"]}
    assert rec == {"offload+recompute:ok": "met", "offload+recompute:slow": "not met"}  # 1.13x vs 1.04x
    peer = {e["config"]: e for e in v["peers"]}
    assert peer["save_on_cpu"]["verdict"] == "met"  # removes 3 GiB; offload+recompute:ok removes 4.1 in 115 ms
    assert "offload+recompute:ok" in peer["save_on_cpu"]["reason"]
    assert peer["torchtune"]["verdict"] == "not met" and "no offload row removes" in peer["torchtune"]["reason"]
    pinned = {e["config"]: e["verdict"] for e in v["pinned"]}
    assert pinned["offload:a"] == "met" and pinned["offload:b"] == "not met"
    lines = peers_report.summary_lines(v)
    assert lines[0].startswith("* **NOT MET** (1 of 2 rows") and lines[3].startswith("* **NOT MET**")


def test_merged_rows_keep_their_own_runs_baseline():
    """A row merged from an earlier run is compared with that run's `none`, not the latest one."""
    import argparse

    first = [_rec("x", "none", "none", 100.0, 10.0, layer_forward_ms=5.0, bytes_offloaded=0),
             _rec("x", "offload:a", "offload", 101.0, 9.0, offload=("a",), engine=_engine(a=(4, 3, 1.0)),
                  bytes_offloaded=1.0 * GIB, pinned_bytes=1.0 * GIB)]
    for r in first:
        r["id"] = peers.job_id("x", r["config"]["name"])
    peers_report.stamp_baselines(first, "run 1")
    assert first[1]["baseline"]["step_ms"] == 100.0 and first[1]["baseline"]["date"] == "run 1"
    assert "baseline" not in first[0]
    second = [_rec("x", "none", "none", 90.0, 10.0, layer_forward_ms=5.0, bytes_offloaded=0)]
    second[0]["id"] = first[0]["id"]
    peers_report.stamp_baselines(second, "run 2")
    meta = {"device": "d", "command": "c2", "wall_s": 1.0}
    earlier = {"meta": {"device": "d", "command": "c1", "wall_s": 1.0}, "records": first}
    merged, meta, _ = peers.merge_runs(earlier, second, meta, argparse.Namespace(merge="m", smoke=False))
    peers_report.evaluate(merged, 50.0)
    by = {r["config"]["name"]: r for r in merged}
    assert by["none"]["step_ms"] == 90.0  # the latest run's none is shown
    assert by["offload:a"]["throughput_rel"] == pytest.approx(100.0 / 101.0)  # against its own run's
    assert by["offload:a"]["memory_removed"] == pytest.approx(1.0 * GIB)


def test_trace_summary_counts_copies_under_kernels():
    tl = Timeline(ops=[
        GpuOp(0.0, 10.0, 7, "kernel"), GpuOp(20.0, 30.0, 7, "kernel"),
        GpuOp(5.0, 15.0, 21, "memcpy", bytes=1_000_000, copy="d2h"),
        GpuOp(22.0, 24.0, 22, "memcpy", bytes=100_000, copy="h2d"),
    ])
    s = peers.summarize_trace(tl)
    assert s["d2h"]["gbps"] == pytest.approx(100.0)  # 1 MB in 10 us
    assert s["d2h"]["under_compute"] == pytest.approx(0.5)
    assert s["h2d"]["under_compute"] == pytest.approx(1.0) and s["h2d"]["streams"] == [22]
    assert s["span_ms"] == pytest.approx(0.030) and s["gpu_idle_ms"] == pytest.approx(0.005)
    assert s["compute_streams"] == [7]


def test_plan_order_and_time_budget(tmp_path):
    args = peers.parse(["--smoke", "--out", str(tmp_path), "--sweep-seq", "32", "--sweep-hidden", "32"])
    plan = peers.make_plan(args, peers.SMOKE_SIZES)
    order = [j["size"] for j in plan.jobs]
    first_sweep = next(i for i, j in enumerate(plan.jobs) if j["kind"] == "sweep")
    assert set(order[:first_sweep]) == set(args.large)  # the large sizes, then the sweep, then the rest
    assert set(order[first_sweep + 4:]) == {"gpt-s", "moe-s"}
    assert {r["config"]["name"] for r in plan.records} == {"te", "megatron"}
    assert not any(j["config"]["peer"] in ("te", "megatron") for j in plan.jobs)
    args.budget_s = 1e-9  # spent before the first job: nothing runs, every job says why
    records = peers.execute(plan, args)
    assert all(r["status"] == "not_run" and "time budget" in r["reason"] for r in records[: len(plan.jobs)])


def test_moe_routes_each_token_to_its_top_k_experts():
    torch.manual_seed(0)
    moe = MoE(hidden=16, ffn=24, experts=4, top_k=2).double()
    x = torch.randn(10, 2, 16, dtype=torch.float64)
    out = moe(x)
    flat = x.reshape(-1, 16)
    probs = torch.softmax(moe.router(flat), dim=-1)
    ref = torch.zeros_like(flat)
    for t in range(flat.shape[0]):
        w, e = probs[t].topk(2)
        w = w / w.sum()
        for wi, ei in zip(w, e):
            ref[t] += wi * moe.experts[int(ei)](flat[t : t + 1])[0]
    torch.testing.assert_close(out.reshape(-1, 16), ref)
    out.sum().backward()
    assert all(p.grad is not None for p in moe.parameters())


def test_build_puts_weights_on_the_device_with_the_dtype():
    model = build(ModelSpec("m", hidden=16, heads=2, layers=2, seq=8, ffn=16, experts=2), torch.bfloat16, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    names = {n for n, _ in model.named_modules()}
    assert {"layers.1.mlp.experts.0.linear_fc1", "layers.0.self_attention.core_attention"} <= names


@pytest.mark.skipif(importlib.util.find_spec("torchtune") is None, reason="torchtune is not installed")
def test_torchtune_loader_runs_their_file_unchanged():
    before = set(sys.modules)
    try:
        cls, info = peers.torchtune_offloader()
        assert cls.__name__ == "OffloadActivations"
        assert info["file"].endswith("torchtune/training/_activation_offloading.py")
        assert info["file_matches_wheel_record"] is True
    finally:
        for name in set(sys.modules) - before:
            if name == "torchtune" or name.startswith("torchtune."):
                del sys.modules[name]
