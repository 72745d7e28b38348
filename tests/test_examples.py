"""The examples and the main job run, and check themselves (they exit non-zero on mismatch)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_custom_model_example():
    out = _run("examples/custom_model.py")
    assert out.count("gradients bitwise equal: True") == 3


def test_main_job_runs_and_losses_match():
    out = _run("-m", "offload.demo", "--device", "cpu", "--steps", "3")
    assert "bitwise identical" in out
