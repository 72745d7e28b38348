"""The host-time benchmark (`benchmarks/host_time.py`) on CPU, in its quick mode: the JSON
schema, the Markdown, ``--merge``, and the exit status of a failure. No timing thresholds: the
targets are checked by the benchmark's report, not here."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import host_time  # noqa: E402

FIELDS = {"what", "records_per_handler", "microseconds", "device", "command"}


def test_quick_run_writes_records_and_merges_other_devices(tmp_path: Path) -> None:
    out = tmp_path / "results" / "host_time.json"
    out.parent.mkdir()
    device = host_time.device_label("cpu")
    other = {"what": "moe_step_host (moe-s, none)", "records_per_handler": None, "microseconds": 1234.5,
             "device": "NVIDIA H100 80GB HBM3", "command": "python benchmarks/host_time.py"}
    stale = {"what": "pack", "records_per_handler": None, "microseconds": 99.0, "device": device,
             "command": "an earlier run on this machine"}
    out.write_text(json.dumps({"records": [other, stale]}))

    argv = ["--quick", "--merge", "--out", str(out)]
    assert host_time.main(argv) == 0

    data = json.loads(out.read_text())
    assert set(data) == {"records"}
    records = data["records"]
    assert other in records, "--merge keeps the records of other devices"
    assert stale not in records, "--merge replaces the records of this run's device"
    mine = [r for r in records if r["device"] == device]
    assert {(r["what"], r["records_per_handler"]) for r in mine} == {
        ("pack", None), ("unpack", None), ("group_open_close", 128), ("group_open_close", 256)}
    for r in mine:
        assert set(r) == FIELDS
        assert isinstance(r["microseconds"], float) and math.isfinite(r["microseconds"]) and r["microseconds"] > 0
        assert r["command"] == "python benchmarks/host_time.py " + " ".join(argv)
        assert r["device"].startswith("cpu (CPU fallback), ")
    assert all(isinstance(r["records_per_handler"], int) for r in mine if r["what"] == "group_open_close")

    md = (out.parent / "host_time.md").read_text()
    assert f"## {device}" in md and "## NVIDIA H100 80GB HBM3" in md
    assert f"`{mine[0]['command']}`" in md
    assert "| group_open_close | 256 |" in md and "≤ 30, flat" in md


def test_a_failure_exits_non_zero_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "host_time.json"
    out.write_text("{not json")
    assert host_time.main(["--quick", "--merge", "--out", str(out)]) != 0
    assert out.read_text() == "{not json"
    assert not (tmp_path / "host_time.md").exists()
