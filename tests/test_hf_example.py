"""examples/hf_finetune.py runs on the CPU and checks itself (it exits non-zero on a mismatch)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "examples/hf_finetune.py", "--device", "cpu", *args], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    moved = [float(line.split()[-1]) for line in out.stdout.splitlines() if line.startswith("offload ")]
    assert moved and all(m > 0 for m in moved), out.stdout  # MiB offloaded per step, per model
    return out.stdout


def test_hf_finetune_llama_and_qwen3_moe(tmp_path):
    out = _run("--model", "all", "--steps", "2", "--json", str(tmp_path / "hf.json"))
    assert out.count("losses and weights bitwise equal: True") == 2
    assert "offloaded names: core_attn,qkv_linear,router,experts" in out
    records = json.loads((tmp_path / "hf.json").read_text())["records"]
    assert [r["model"].split()[0] for r in records] == ["llama", "qwen3_moe"]
    assert all(set(r) == {"model", "names", "step_ms", "peak_bytes", "baseline_step_ms", "baseline_peak_bytes",
                          "grads_bitwise", "device", "command"} for r in records)
    assert all(r["grads_bitwise"] is True and r["device"] == "cpu" and r["step_ms"] > 0 for r in records)


def test_hf_finetune_fsdp2():
    out = _run("--model", "llama", "--fsdp2", "--steps", "2", "--offload-modules", "core_attn,fc1,fc2")
    assert "FSDP2" in out and "losses and weights bitwise equal: True" in out


def test_hf_finetune_plan_at_a_budget(tmp_path):
    out = _run("--model", "llama", "--steps", "3", "--memory-budget=-30%", "--json", str(tmp_path / "hf.json"))
    assert "Plan for a memory budget" in out and "losses and weights bitwise equal: True" in out
    [record] = json.loads((tmp_path / "hf.json").read_text())["records"]
    assert record["names"].startswith("plan at -30% among attn_norm,core_attn,attn_proj,mlp_norm,mlp_act,fc2: offload ")
    assert record["grads_bitwise"] is True


@pytest.mark.parametrize("args, message", [
    (["--memory-budget=-30%", "--fsdp2"], "--memory-budget plans on one unsharded model: leave out --fsdp2"),
    (["--memory-budget=-30%", "--steps", "1"], "--memory-budget plans after the first step"),
    (["--memory-budget=lots"], "lots"),
])
def test_hf_finetune_budget_arguments_are_checked_first(args, message):
    out = subprocess.run([sys.executable, "examples/hf_finetune.py", "--device", "cpu", *args], cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and message in out.stderr, out.stderr
