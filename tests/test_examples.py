"""The examples and the main job run, and check themselves (they exit non-zero on mismatch)."""

from __future__ import annotations

import os
import re
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
    """No offloading, full recompute and the plan side by side; on CPU it says it saves nothing."""
    out = _run("-m", "offload.demo", "--device", "cpu", "--steps", "3")
    assert re.search(r"no offloading +full recompute +plan", out)
    assert "bitwise identical over all 3 steps of the three runs" in out
    assert "it saves no memory on CPU" in out and "Plan for a memory budget" in out


def test_readme_commands_work_as_pasted_and_ci_runs_the_test_command():
    """The README's two set-up commands carry the constraint file themselves (a note after them
    said to add it), each says how long it takes, and .ci/run installs and tests as command 2."""
    readme = (ROOT / "README.md").read_text()
    setup = readme[readme.index("## Run it"):readme.index("## Use it")]
    commands = re.findall(r"```bash\n(.+?)\n```", setup)
    assert [c.split(" && ")[-1] for c in commands] == ["python -m offload.demo", "python -m pytest -q tests"]
    assert all(" && pip install -c constraints.txt -e " in c for c in commands)
    assert len(re.findall(r"About \d+ (s|minutes?) on a fresh", setup)) == 2
    assert re.search(r"^torch==\S+$", (ROOT / "constraints.txt").read_text(), re.M)
    ci = (ROOT / ".ci" / "run").read_text()
    install = commands[1].split(" && ")[2].replace("pip install", "python -m pip install -q")
    assert install in ci and "python -m pytest -q tests" in ci
