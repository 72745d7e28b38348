"""tools/profile_step.py: its summary of a profiler trace, on a trace made up here, and its
argument checks (the profiling itself needs CUDA: tests/test_errors.py checks that it says so),
and its --engine and --syncs timers, which run on the CPU too."""

from __future__ import annotations

import runpy
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tool():
    return runpy.run_path(str(ROOT / "tools/profile_step.py"))


def _kernel(stream, ts, dur, name="gemm"):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"stream": stream}}


def _copy(stream, ts, dur, correlation, name="Memcpy DtoH (Device -> Pinned)"):
    return {"ph": "X", "cat": "gpu_memcpy", "name": name, "ts": ts, "dur": dur,
            "args": {"stream": stream, "correlation": correlation}}


def _call(name, ts, dur, correlation):
    return {"ph": "X", "cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def test_summary_of_a_made_up_trace(tool):
    """Compute stream 7 runs two kernels with a 100 ms gap between them and a model's own D2H
    copy issued at 150 ms that starts at 400 ms; side stream 13 copies out from 350 to 420 ms, so
    that copy waited 250 ms to start, 50 of them while the side stream's copy ran."""
    ms = 1000.0
    events = [
        _kernel(7, 0, 100 * ms), _kernel(7, 200 * ms, 100 * ms), _copy(7, 400 * ms, 10 * ms, correlation=1),
        _copy(13, 350 * ms, 70 * ms, correlation=2),
        _call("cudaLaunchKernel", 110 * ms, 20 * ms, correlation=3),  # 20 ms inside the gap
        _call("cudaMemcpyAsync", 150 * ms, 260 * ms, correlation=1),  # 50 ms inside the gap
        _call("cudaMemcpyAsync", 340 * ms, 1 * ms, correlation=2),
        {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5},  # not CUDA activity: ignored
    ]
    lines = tool["summarize"](events)
    assert lines[0] == "window 420.0 ms"
    assert lines[1] == ("stream 7 (compute): n=3 busy 210.0 ms; kernel 200.0 ms; "
                        "Memcpy DtoH (Device -> Pinned) 10.0 ms")
    assert lines[2] == "stream 13: n=1 busy 70.0 ms; Memcpy DtoH (Device -> Pinned) 70.0 ms"
    assert lines[3] == "compute-stream gaps > 50 us: 2, total 200.0 ms"  # 100-200 and 300-400 ms
    assert lines[4] == "host runtime calls overlapping those gaps (ms): cudaMemcpyAsync 151.0; cudaLaunchKernel 20.0"
    assert lines[5] == "host runtime totals (ms, calls): cudaMemcpyAsync 261.0 (2); cudaLaunchKernel 20.0 (1)"
    assert lines[6] == ("compute-stream D2H copies: 1, issue to start 250.0 ms in all, "
                        "of which a side stream's D2H copy ran 50.0 ms")


def test_summary_without_cuda_activity_says_so(tool):
    assert tool["summarize"]([{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5}]) == [
        "no CUDA activity in the profiled steps"]


@pytest.mark.parametrize("argv, message", [
    (["--out", "o"], "no script: put it and its arguments after --"),
    (["--out", "o", "--first", "3", "--last", "3", "--", "train.py"], "need 1 <= --first < --last (got 3 and 3)"),
    (["--out", "o", "--first", "0", "--", "train.py"], "need 1 <= --first < --last (got 0 and 7)"),
    (["--out", "o", "--python", "--engine", "--", "train.py"], "argument --engine: not allowed with argument --python"),
])
def test_bad_arguments_are_refused_before_anything_runs(tool, argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        tool["main"](argv)
    assert info.value.code == 2 and message in capsys.readouterr().err


TRAIN = '''
import sys, warnings
import torch
import offload
from offload.testing import GPT_MAPPING, build_gpt
warnings.simplefilter("ignore")
model = build_gpt(32, 4, 2)
offload.configure("core_attn,fc1", min_tensor_bytes=0)
offload.attach(model, GPT_MAPPING)
opt = torch.optim.SGD(model.parameters(), lr=0.0)
x = torch.randn(8, 2, 32)
for _ in range(int(sys.argv[1])):
    model(x).sum().backward()
    opt.step()
    offload.end_iteration()
'''


def _table_of(tool: dict, tmp_path: Path, capsys: Any, script_text: str, mode: str, first: int, last: int,
              steps: int) -> str:
    """Run ``script_text`` (``steps`` optimizer steps) under the tool in ``mode`` (``--engine``,
    ``--syncs``) between steps ``first`` and ``last``; the table it wrote, checked as printed too."""
    script = tmp_path / "train.py"
    script.write_text(script_text)
    argv = [mode, "--first", str(first), "--last", str(last), "--out", str(tmp_path / "prof"), "--", str(script),
            str(steps)]
    assert tool["main"](argv) == 0
    table = (tmp_path / f"prof.{mode[2:]}.txt").read_text()
    assert table in capsys.readouterr().out
    return table


def test_engine_timers_of_a_training_script(tool, tmp_path, capsys):
    """``--engine`` runs on the CPU too: between optimizer steps 2 and 4 of a script whose steps
    run 2 layers of the 8 names `attach` maps (2 of them offloaded), the engine's entry points
    were called that often per step, the collector's line is there, and the wrappers are gone
    afterwards."""
    from offload.manager import PipelineOffloadManager

    pack = PipelineOffloadManager.__dict__["_pack"]
    table = _table_of(tool, tmp_path, capsys, TRAIN, "--engine", 2, 4, steps=5)
    assert table.startswith("python gc per step: gen0 ")
    rows = {line.split()[0]: line.split() for line in table.splitlines()[2:]}
    assert rows["PipelineOffloadManager.open_group"][3] == "16"  # calls per step
    assert rows["PipelineOffloadManager.close_group"][3] == "16"
    assert int(rows["PipelineOffloadManager._pack"][3]) > 4
    assert PipelineOffloadManager.__dict__["_pack"] is pack


SYNCING = """
import sys, time
import torch
w = torch.nn.Parameter(torch.ones(4))
opt = torch.optim.SGD([w], lr=0.0)
for _ in range(int(sys.argv[1])):
    (w * 2).sum().backward()
    for _ in range(3):
        (w * 1).cpu()
    w.sum().item()
    time.sleep(0.002)
    opt.step()
"""


def test_sync_timers_of_a_training_script(tool, tmp_path, capsys):
    """``--syncs`` runs on the CPU too: between optimizer steps 2 and 5 of a script that calls
    ``.cpu()`` three times and ``.item()`` once a step and sleeps 2 ms, three steps are measured,
    each call counted per step, the sleep in the wall time and not in the CPU time, and the
    wrappers are gone afterwards."""
    cpu = torch.Tensor.cpu
    table = _table_of(tool, tmp_path, capsys, SYNCING, "--syncs", 2, 5, steps=6)
    head, *rows = table.splitlines()
    assert head.startswith("3 steps, medians per step: wall ")
    wall = float(head.split("wall ")[1].split()[0])
    cpu_ms = float(head.split("CPU ")[1].split()[0])
    assert wall >= 2.0 and wall - cpu_ms >= 1.5
    calls = {r.split()[0]: r.split()[3] for r in rows}
    assert calls["Tensor.cpu"] == "3" and calls["Tensor.item"] == "1"
    assert torch.Tensor.cpu is cpu and "cpu" not in vars(torch.Tensor)  # inherited again


def test_engine_timers_with_too_few_steps_fail(tool, tmp_path, capsys):
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    assert tool["main"](["--engine", "--first", "2", "--last", "4", "--out", str(tmp_path / "p"), "--",
                         str(script), "3"]) == 1
    assert "fewer than --last 4" in capsys.readouterr().err
