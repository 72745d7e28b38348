"""examples/hf_finetune.py runs on the CPU and checks itself (it exits non-zero on a mismatch)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: E402

from offload import presets  # noqa: E402
from offload.presets import checkpoint_wraps_hooks  # noqa: E402
from offload.testing import free_port  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def example():
    """examples/hf_finetune.py as a module (its ``parse_args``)."""
    spec = importlib.util.spec_from_file_location("hf_finetune", ROOT / "examples" / "hf_finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _offloaded(stdout: str) -> str:
    """``stdout`` after checking that every run reports MiB offloaded per step."""
    moved = [float(line.split()[-1]) for line in stdout.splitlines() if line.startswith("offload ")]
    assert moved and all(m > 0 for m in moved), stdout  # MiB offloaded per step, per model
    return stdout


def _run(*args: str) -> str:
    """The example as a user runs it: each training run in a child process of its own."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "examples/hf_finetune.py", "--device", "cpu", *args], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return _offloaded(out.stdout)


def _run_here(example, capsys, monkeypatch, *args: str) -> str:
    """The example's ``main`` in this process, in the environment ``torchrun --nproc-per-node 1``
    gives its rank: both runs here (for the tests of a feature, without three interpreters to
    start). It destroys the process group it starts."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(free_port())).items():
        monkeypatch.setenv(key, value)
    rc = example.main(["--device", "cpu", *args])
    out = capsys.readouterr().out
    assert rc == 0, out
    return _offloaded(out)


def test_hf_finetune_runs_each_training_run_in_a_process_of_its_own():
    """As a user runs it: the run without offloading and the run with it, each a child process
    (about 6 s of imports each on the CI machine: one model here; both, in this process, next)."""
    out = _run("--model", "llama", "--steps", "1")
    assert out.count("losses and weights bitwise equal: True") == 1
    assert "offloaded names: core_attn,qkv_linear" in out


def test_hf_finetune_llama_and_qwen3_moe(example, capsys, monkeypatch, tmp_path):
    out = _run_here(example, capsys, monkeypatch, "--model", "all", "--steps", "2", "--json", str(tmp_path / "hf.json"))
    assert out.count("losses and weights bitwise equal: True") == 2
    assert "offloaded names: core_attn,qkv_linear,router,experts" in out
    records = json.loads((tmp_path / "hf.json").read_text())["records"]
    assert [r["model"].split()[0] for r in records] == ["llama", "qwen3_moe"]
    assert all(set(r) == {"model", "names", "step_ms", "peak_bytes", "baseline_step_ms", "baseline_peak_bytes",
                          "grads_bitwise", "device", "command"} for r in records)
    assert all(r["grads_bitwise"] is True and r["device"] == "cpu" and r["step_ms"] > 0 for r in records)


def test_hf_finetune_fsdp2(example, capsys, monkeypatch):
    out = _run_here(example, capsys, monkeypatch, "--model", "llama", "--fsdp2", "--steps", "2",
                    "--offload-modules", "core_attn,fc1,fc2")
    assert "FSDP2" in out and "losses and weights bitwise equal: True" in out


def test_hf_finetune_plan_at_a_budget(example, capsys, monkeypatch, tmp_path):
    out = _run_here(example, capsys, monkeypatch, "--model", "llama", "--steps", "3", "--memory-budget=-30%",
                    "--json", str(tmp_path / "hf.json"))
    assert "Plan for a memory budget" in out and "losses and weights bitwise equal: True" in out
    [record] = json.loads((tmp_path / "hf.json").read_text())["records"]
    assert record["names"].startswith("plan at -30% among attn_norm,core_attn,attn_proj,mlp_norm,mlp_act,fc2: offload ")
    assert record["grads_bitwise"] is True


@pytest.mark.skipif(checkpoint_wraps_hooks(GradientCheckpointingLayer), reason="transformers < 5.23 checkpoints the layer's hooks")
def test_hf_finetune_gradient_checkpointing_offloads_the_layer_inputs(example, capsys, monkeypatch):
    """Both runs checkpoint every layer; ``layer`` offloads what the checkpoints keep (4 layers:
    layer 0's input is held by the model's forward, layer 3's kept, two of [2, 16, 64] fp32)."""
    out = _run_here(example, capsys, monkeypatch, "--model", "llama", "--steps", "2", "--layers", "4",
                    "--gradient-checkpointing", "--offload-modules", "layer,core_attn")
    assert "gradient checkpointing; offloaded names: layer,core_attn" in out
    assert "losses and weights bitwise equal: True" in out
    assert [line.split()[-1] for line in out.splitlines() if line.startswith("offload ")] == [f"{16384 / 2**20:.2f}"]


@pytest.mark.parametrize("args, message", [
    (["--memory-budget=-30%", "--gradient-checkpointing"], "--memory-budget chooses what to recompute itself"),
    (["--steps", "0"], "--steps: must be 1 or more, got 0"),
    (["--layers", "-1"], "must be 1 or more, got -1"),
    (["--memory-budget=-30%", "--fsdp2"], "--memory-budget plans on one unsharded model: leave out --fsdp2"),
    (["--memory-budget=-30%", "--steps", "1"], "--memory-budget plans after the first step"),
    (["--memory-budget=lots"], "lots"),
])
def test_hf_finetune_arguments_are_checked_first(example, capsys, args, message):
    """``parse_args`` refuses them (exit 2) before any model or process exists."""
    with pytest.raises(SystemExit) as exit_:
        example.parse_args(["--device", "cpu", *args])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_hf_finetune_refuses_layer_where_checkpointing_wraps_the_hooks(example, monkeypatch, capsys):
    """transformers < 5.23: ``--offload-modules layer --gradient-checkpointing`` would offload
    nothing, so the arguments are refused (exit 2) before any run; without checkpointing they pass."""
    monkeypatch.setattr(presets, "checkpoint_wraps_hooks", lambda cls: True)
    assert example.parse_args(["--device", "cpu", "--offload-modules", "layer"]).offload_modules == "layer"
    with pytest.raises(SystemExit) as exit_:
        example.parse_args(["--device", "cpu", "--offload-modules", "core_attn,layer", "--gradient-checkpointing"])
    assert exit_.value.code == 2 and "needs transformers >= 5.23" in capsys.readouterr().err
