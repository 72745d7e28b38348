"""offload.tools.peak_live: the replay of an allocator history to its peak, on synthetic
histories with known answers (the recording itself needs CUDA: tests/test_cuda.py)."""

from __future__ import annotations

import json

import pytest

from conftest import requires_cuda
from offload.tools import peak_live

MEGATRON = {"filename": "/usr/lib/python3/site-packages/megatron/core/transformer/moe/experts.py",
            "line": 800, "name": "forward"}
TORCH = {"filename": "/usr/lib/python3/site-packages/torch/nn/modules/module.py", "line": 1, "name": "_call_impl"}
TE = {"filename": "/x/site-packages/transformer_engine/pytorch/module/grouped_linear.py", "line": 9, "name": "forward"}


def alloc(addr, size, *frames):
    return {"action": "alloc", "addr": addr, "size": size, "frames": list(frames), "time_us": addr}


def free(addr, size):
    return {"action": "free_requested", "addr": addr, "size": size, "time_us": addr}


def snapshot(*events):
    return {"device_traces": [list(events)], "segments": []}


def test_the_peak_and_what_is_live_there_by_site():
    events = [
        alloc(1, 100, TORCH, MEGATRON),       # site: experts.py, the torch frame skipped
        alloc(2, 50, TE),
        free(3, 30),                          # a block from before the recording
        alloc(4, 70, MEGATRON),
        {"action": "free_completed", "addr": 2, "size": 50, "time_us": 5},  # not counted: free_requested is
        free(2, 50),
        alloc(6, 20),                         # no frame: after the peak
    ]
    got = peak_live.summarize(snapshot(*events), start_bytes=1000)
    assert got["peak_bytes"] == 1000 + 100 + 50 - 30 + 70 == 1190
    assert got["peak_event"] == 3 and got["peak_allocation"]["size"] == 70
    sites = {s["site"]: (s["bytes"], s["blocks"]) for s in got["sites"]}
    assert sites == {"megatron/core/transformer/moe/experts.py:800 forward": (170, 2),
                     "transformer_engine/pytorch/module/grouped_linear.py:9 forward": (50, 1),
                     peak_live.BEFORE: (970, 0)}
    assert sum(s["bytes"] for s in got["sites"]) == got["peak_bytes"]
    assert {s["site"]: s["sizes"] for s in got["sites"]} == {
        "megatron/core/transformer/moe/experts.py:800 forward": [100, 70],
        "transformer_engine/pytorch/module/grouped_linear.py:9 forward": [50],
        peak_live.BEFORE: []}
    assert got["peak_at_fraction"] == pytest.approx(3 / 5)


def test_a_site_lists_its_largest_blocks():
    """Bytes at one site told apart block by block: the largest `SIZES_KEPT`, largest first."""
    many = [alloc(i, i, MEGATRON) for i in range(1, peak_live.SIZES_KEPT + 5)]
    (site,) = peak_live.summarize(snapshot(*many), start_bytes=0)["sites"]
    assert site["blocks"] == peak_live.SIZES_KEPT + 4
    assert site["sizes"] == list(range(peak_live.SIZES_KEPT + 4, 4, -1))


def test_sites_beyond_top_are_summed_and_a_cut_history_is_refused():
    events = [alloc(i, 10 * i, {"filename": f"/a/m{i}.py", "line": i, "name": "f"}) for i in range(1, 6)]
    got = peak_live.summarize(snapshot(*events), start_bytes=0, top=2)
    assert [s["bytes"] for s in got["sites"]] == [50, 40, 60]
    assert got["sites"][-1]["site"] == "(other sites)" and got["sites"][-1]["blocks"] == 3
    assert got["sites"][-1]["sizes"] == [30, 20, 10]
    assert peak_live.frame_site([TORCH]) == peak_live.NO_FRAME
    with pytest.raises(ValueError, match="history was cut"):
        peak_live.summarize(snapshot(free(1, 10)), start_bytes=5)


def test_compare_lines_sites_up_largest_difference_first(tmp_path, capsys):
    mib = 1 << 20
    a = peak_live.summarize(snapshot(alloc(1, 100 * mib, MEGATRON), alloc(2, 10 * mib, TE)), start_bytes=0)
    b = peak_live.summarize(snapshot(alloc(1, 40 * mib, MEGATRON), alloc(2, 20 * mib, TE)), start_bytes=0)
    rows = peak_live.compare(a, b)
    assert rows[0] == ("megatron/core/transformer/moe/experts.py:800 forward", 100 * mib, 40 * mib)
    assert rows[1][1:] == (10 * mib, 20 * mib) and rows[-1] == ("(other sites)", 0, 0)
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    assert peak_live.main([str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "| `megatron/core/transformer/moe/experts.py:800 forward` | 100.0 | 40.0 | -60.0 |" in out
    assert "peak: " in out and "0.11 GiB" in out and "(-0.05)" in out
    (tmp_path / "c.json").write_text("{}")
    with pytest.raises(SystemExit):
        peak_live.main([str(tmp_path / "a.json"), str(tmp_path / "c.json")])
    assert "not a summary of offload.tools.peak_live" in capsys.readouterr().err


@requires_cuda
def test_a_recorded_step_has_its_peak_where_max_memory_allocated_says():
    """On the GPU: `record` around a step whose peak is known; the replay finds the same peak as
    ``max_memory_allocated`` and names this file as the site of the blocks live there."""
    import torch

    keep = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")  # before the recording
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    with peak_live.record() as rec:
        a = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        b = torch.empty(32 << 20, dtype=torch.uint8, device="cuda")
        del keep, a
        c = torch.empty(16 << 20, dtype=torch.uint8, device="cuda")
        del b, c
    got = peak_live.summarize(rec["snapshot"], rec["start_bytes"], torch.cuda.current_device())
    assert got["peak_bytes"] == torch.cuda.max_memory_allocated()
    sites = {s["site"]: s["bytes"] for s in got["sites"]}
    mine = [site for site in sites if site.split(":")[0].endswith("tests/test_peak_live.py")]
    assert len(mine) == 2 and sorted(sites[s] for s in mine) == [32 << 20, 64 << 20]
    assert sites[peak_live.BEFORE] == rec["start_bytes"]
