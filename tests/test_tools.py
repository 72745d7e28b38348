"""The workflow tools (offload.tools): parsing, tables and the advisor's arithmetic on CPU, on
small synthetic inputs with known answers and on recorded fixtures (tests/fixtures/tools/).

Fixtures named ``*_cpu*`` were recorded on CPU (the engine's CPU fallback); those named
``*_gpu*``, ``bandwidth.json`` and ``check.json`` come from ``tools/gpu_session.sh`` on the GPU
machine, and their tests are skipped until they are there. ``*_h100_derived.json`` are NOT
recordings: they were synthesized from what came back of one H100 run of that script (its
advice.json and the bandwidth probe's printed GB/s; see their ``derived`` field), to check the
advice's arithmetic on that run's figures.
"""

from __future__ import annotations

import contextlib
import json
import sqlite3
import warnings
from pathlib import Path

import pytest
import torch

import offload
from conftest import attention_output_stays, requires_cuda
from offload.tools import bandwidth, memory, nsys_run, overlap, profile_modules
from offload.tools.advisor import Model, advise, classify, free_set, search
from offload.tools.bandwidth import Bandwidth
from offload.tools.boundaries import Boundaries
from offload.tools.intervals import Cover, length, union
from offload.tools.report import md_table
from offload.tools.trace_events import GpuOp, HostRange, Timeline, load, load_nsys_sqlite
from offload.tools.workload import build_workload

FIX = Path(__file__).parent / "fixtures" / "tools"


def fixture(name: str) -> Path:
    path = FIX / name
    if not path.exists():
        pytest.skip(f"{name} is recorded on the GPU machine by tools/gpu_session.sh")
    return path


def load_fixture(name: str) -> dict:
    return json.loads(fixture(name).read_text())


# ------------------------------------------------------------------ helpers
def test_md_table_checks_columns():
    text = md_table(["a", "b"], [[1, 2]])
    assert text.splitlines() == ["| a | b |", "|---|---:|", "| 1 | 2 |"]
    with pytest.raises(ValueError, match="2 columns"):
        md_table(["a", "b"], [[1]])


def test_intervals():
    assert union([(3, 4), (0, 1), (0.5, 2), (5, 5)]) == [(0, 2), (3, 4)]
    assert length([(0, 2), (1, 3), (10, 11)]) == 4
    cover = Cover([(0, 2), (5, 6)])
    assert cover.covered(1, 5.5) == pytest.approx(1.5)
    assert cover.covered(2, 5) == 0
    assert cover.covered(-1, 10) == 3


# ------------------------------------------------------------------ bandwidth
BW_JSON = {"records": [
    {"direction": "d2h", "pinned": True, "bytes": 2**20, "ms": 0.1, "gbps": 10.0},
    {"direction": "d2h", "pinned": True, "bytes": 4 * 2**20, "ms": 0.1, "gbps": 40.0},
    {"direction": "h2d", "pinned": True, "bytes": 2**20, "ms": 0.1, "gbps": 20.0},
    {"direction": "d2h", "pinned": False, "bytes": 2**20, "ms": 1.0, "gbps": 1.0},
    {"direction": "both", "pinned": True, "bytes": 2**20, "ms": 0.1, "gbps": 30.0},
], "compute_slowdown": {"matmul_n": 8, "iters": 1, "alone_ms": 1.0, "with_copies_ms": 1.05, "slowdown": 0.05}}


def test_bandwidth_interpolates_in_log_size_and_clamps():
    bw = Bandwidth.from_json(BW_JSON)
    assert bw.compute_slowdown == 0.05
    assert bw.gbps("d2h", 2**20) == 10.0
    assert bw.gbps("d2h", 2 * 2**20) == pytest.approx(25.0)  # halfway in log size
    assert bw.gbps("d2h", 1) == 10.0 and bw.gbps("d2h", 2**40) == 40.0
    assert bw.copy_ms("h2d", 20 * 10**6) == pytest.approx(1.0)
    assert bw.copy_ms("h2d", 0) == 0.0
    text = bandwidth.table(BW_JSON)
    assert "| 1 MiB | 10.0 | 20.0 | 30.0 | 1.0 |" in text and "slowdown 5.0%" in text
    with pytest.raises(ValueError, match="no pinned h2d"):
        Bandwidth.from_json({"records": [r for r in BW_JSON["records"] if r["direction"] != "h2d"]})
    with pytest.raises(ValueError, match="> 0"):
        Bandwidth.constant(0)


def test_bandwidth_fixture_from_the_gpu():
    data = load_fixture("bandwidth.json")
    bw = Bandwidth.from_json(data)
    for d in ("d2h", "h2d"):
        assert 1 < bw.gbps(d, 256 * 2**20) < 200
    assert bandwidth.table(data).count("\n") >= len({r["bytes"] for r in data["records"]}) + 1


# ------------------------------------------------------------------ advisor arithmetic
def synthetic_profile() -> dict:
    """Three names, three instances each; bytes chosen so that every figure is known."""
    order = [[n, i] for i in range(3) for n in ("a", "b", "c")]
    st = []
    for i in range(3):
        st.append({"bytes": 4_000_000, "eligible": True, "savers": [f"a:{i}"], "created_in": f"a:{i}"})
        st.append({"bytes": 1_000_000, "eligible": True, "savers": [f"a:{i}", f"b:{i}"], "created_in": f"a:{i}"})
        st.append({"bytes": 100_000, "eligible": True, "savers": [f"c:{i}"], "created_in": f"c:{i}"})
    st.append({"bytes": 500_000, "eligible": False, "savers": ["b:0"], "created_in": "b:0"})
    st.append({"bytes": 250_000, "eligible": True, "savers": ["b:1", "(other)"], "created_in": "b:1"})
    return {
        "names": ["a", "b", "c"], "close_order": order, "step_ms": 20.0, "forward_ms": 6.0, "backward_ms": 12.0,
        "peak_allocated": 100_000_000,
        "modules": {"a": {"fwd_ms": [1.0] * 3, "bwd_ms": [2.0] * 3}, "b": {"fwd_ms": [0.1] * 3, "bwd_ms": [0.2] * 3},
                    "c": {"fwd_ms": [0.5] * 3, "bwd_ms": [1.0] * 3}},
        "storages": st,
    }


def test_offloaded_bytes_follow_the_engine_rules():
    m = Model(synthetic_profile(), Bandwidth.constant(1.0, compute_slowdown=0.1))
    p = m.predict(offload=["a"])
    # a:0 and a:1 (a:2 is the last, kept); the storage shared with b stays
    assert p.offloaded_by_name == {"a": 8_000_000}
    # Forward, module times scaled by 6/4.8 = 1.25: a 1.25, b 0.125, c 0.625 ms; a layer 2 ms.
    # a:0 is known not to be the last at its close (1.25: from the previous forward) and issued
    # at a:1's open (2.0); issued early, it starts when a:0 closed and ends at 5.25. a:1 (closed
    # at 3.25) is issued at a:2's open (4.0), after the bound (one group in flight: a:0, not
    # waited for), queued behind a:0 (5.25 to 9.25). a:2's close (5.25) is the flush: it waits
    # for both (4 ms). Held then: a:0 and a:1, 8 MB; the rest of the forward saves only c:2's
    # 0.1 MB and the profile has no backward buffers, so 7.9 MB of them count at the peak.
    assert p.forward_wait_ms == pytest.approx(4.0) and p.forward_wait_by_name == {"a": pytest.approx(4.0)}
    assert p.inflight_bytes == 7_900_000
    assert p.freed_at_peak == 100_000 and p.peak_bytes == 99_900_000
    # reloads: h2d 4 ms per layer against a 4 ms backward: nothing exposed; 2 layers
    assert p.backward_exposed_ms == 0 and p.exposed_ms == pytest.approx(4.0)
    assert p.slowdown_ms == pytest.approx(2 * 0.1 * (2 + 4))
    assert p.cost_pct == pytest.approx(100 * 5.2 / 20)
    # with 8 MB of buffers in the backward's first steps (the peak 8 MB over the forward's
    # end), what the flush frees never reaches the peak: all of a's bytes are gone
    buffered = synthetic_profile()
    buffered["forward_end_allocated"] = buffered["peak_allocated"] - 8_000_000
    free = Model(buffered, Bandwidth.constant(1.0, compute_slowdown=0.1)).predict(offload=["a"])
    assert free.inflight_bytes == 0 and free.freed_at_peak == 8_000_000 and free.cost_ms == pytest.approx(5.2)
    both = m.predict(offload=["a", "b"])
    assert both.offloaded_by_name == {"a": 8_000_000, "b": 2_000_000}  # shared storages owned by b
    # one copy stream, in issue order: a:0 (issued at b:0's open, 1.25 to 5.25), b:0 (at a:1's
    # open, 2.0, queued behind it: 5.25 to 6.25). With max_inflight_groups=1 the bound at each
    # open waits for all but the newest copy before issuing: at b:1's open (3.25) for a:0
    # (2.0 ms), then a:1 is issued (6.25 to 10.25); at a:2's open (6.0) for b:0 (0.25), then b:1
    # (10.25 to 11.25); at b:2's open (7.5) for a:1 (2.75). a:2 is not the forward's last
    # group: no flush at its close. The flush is at b:2's close (10.375), the forward's last
    # group: it waits for b:1 (0.875). Held then: b:1, 1 MB, less c:2's 0.1 MB.
    assert both.forward_wait_by_name == {"a": pytest.approx(2.0 + 2.75), "b": pytest.approx(0.25 + 0.875)}
    assert both.inflight_bytes == 900_000 and both.freed_at_peak == 9_100_000
    assert both.backward_exposed_ms == pytest.approx(2 * (5 - 4)) and both.cost_ms == pytest.approx(9.075)
    # two groups in flight: the bound first waits at a:2's open (4.0), for a:0 (1.25); b:2's
    # open finds b:0 done; the flush (b:2's close, 6.625) holds a:1 and b:1 (5 MB) and waits
    # for a:1 (3.625) and b:1 (1.0): more held at the peak for no less waiting
    two = m.predict(offload=["a", "b"], max_inflight_groups=2)
    assert two.inflight_bytes == 4_900_000 and two.freed_at_peak == 5_100_000
    assert two.forward_wait_by_name == {"a": pytest.approx(1.25 + 3.625), "b": pytest.approx(1.0)}
    assert two.cost_ms == pytest.approx(9.075)
    # the flush is at the forward's last offloaded group, so offloading c (whose group closes
    # last) moves it after c:2, and c's groups open between a's: the bound waits for a:0 at
    # c:1's open (3.375, 1.875 ms) and for a:1 at c:2's open (7.25, 2.1 ms); the flush finds
    # c:1 done
    ac = m.predict(offload=["a", "c"])
    assert ac.forward_wait_by_name == {"a": pytest.approx(1.875 + 2.1)}
    rec = m.predict(recompute=["b"])
    assert rec.recomputed_bytes == 750_000 and rec.recompute_ms == pytest.approx(0.3)
    assert m.predict(offload=["b"]).offloaded_bytes == 0
    with pytest.raises(ValueError, match="unknown module"):
        m.predict(offload=["z"])
    with pytest.raises(ValueError, match="both offloaded and recomputed"):
        m.predict(offload=["a"], recompute=["a"])


def buffered_profile() -> dict:
    """`synthetic_profile` with 8 MB of backward buffers: its peak 8 MB over the forward's end."""
    prof = synthetic_profile()
    prof["forward_end_allocated"] = prof["peak_allocated"] - 8_000_000
    return prof


def test_verdicts_and_budget_search():
    m = Model(buffered_profile(), Bandwidth.constant(1.0, compute_slowdown=0.1))
    verdicts = {n: classify(m, n, 0.7)["verdict"] for n in m.names}
    assert verdicts == {"a": "recompute", "b": "nothing", "c": "free"}
    best, fits = search(m, 95_000_000, allow_recompute=True)
    assert fits and best.recompute == ["a"] and best.offload == [] and best.cost_ms == pytest.approx(3.0)
    # offloading only: a alone frees its 8 MB (nothing in flight reaches the peak) for 5.2 ms;
    # a and c free 8.2 MB for 5.375 ms (a's copies wait 0.025 ms less, c's reloads cost 0.2 ms),
    # a and b 10 MB for 9.075 ms
    assert m.predict(offload=["a", "c"]).cost_ms == pytest.approx(5.375)
    best, fits = search(m, 95_000_000, allow_recompute=False)
    assert fits and best.offload == ["a"] and best.cost_ms == pytest.approx(5.2)
    assert best.freed_at_peak == 8_000_000
    best, fits = search(m, 50_000_000, allow_recompute=False)
    assert not fits and best.offload == ["a", "b", "c"]  # the most memory it can free
    out = advise(buffered_profile(), Bandwidth.constant(1.0, 0.1), budget=95_000_000)
    assert out["free"] == ["c"] and out["free_flags"] == "--offload-modules=c"
    assert out["budget"]["flags"] == "--recompute-modules=a"
    assert out["budget_offload_only"]["flags"] == "--offload-modules=a"
    # without backward buffers the peak is the first flush, where a's groups are in flight:
    # offloading frees almost nothing there, and c nothing at all
    bare = Model(synthetic_profile(), Bandwidth.constant(1.0, compute_slowdown=0.1))
    assert bare.predict(offload=["a"]).freed_at_peak == 100_000
    assert advise(synthetic_profile(), Bandwidth.constant(1.0, 0.1), budget=95_000_000)["free"] == []
    with pytest.raises(ValueError, match="headroom"):
        advise(synthetic_profile(), Bandwidth.constant(1.0), headroom=0)


def two_close_names_profile() -> dict:
    """x and y right after one another (0.1 ms each), then z (1.8 ms); 4 layers; x and y save
    0.5 MB per layer each (0.5 ms at 1 GB/s): together 1 ms of copies per 2 ms layer."""
    names = ["x", "y", "z"]
    st = [{"bytes": 500_000, "eligible": True, "savers": [f"{n}:{i}"], "created_in": f"{n}:{i}"}
          for i in range(4) for n in ("x", "y")]
    return {"names": names, "close_order": [[n, i] for i in range(4) for n in names], "step_ms": 20.0,
            "forward_ms": 8.0, "backward_ms": 12.0, "peak_allocated": 10_000_000,
            "modules": {"x": {"fwd_ms": [0.1] * 4, "bwd_ms": [0.2] * 4},
                        "y": {"fwd_ms": [0.1] * 4, "bwd_ms": [0.2] * 4},
                        "z": {"fwd_ms": [1.8] * 4, "bwd_ms": [2.6] * 4}},
            "storages": st}


def test_free_set_is_free_together_and_keeps_one_group_in_flight():
    m = Model(two_close_names_profile(), Bandwidth.constant(1.0))
    # x and y, 0.1 ms apart, 0.5 ms of copies each in a 2 ms layer. Their copies start when
    # their groups close and are issued a layer later (x:i at y:i+1's open, y:i at x:i+2's):
    # with max_inflight_groups=1 the copy waited for at each issue ended long before. Free.
    one = m.predict(offload=["x", "y"])
    assert m.copy_fraction(one) == pytest.approx(0.5) and one.forward_wait_ms == 0 and one.cost_ms == 0
    # the flush, at y:3's close (the forward's last group), holds y:2 (issued at x:3's open; x:2
    # was let go by the bound at y:3's open); nothing is saved after it and the profile has no
    # backward buffers, so it counts at the peak. Two groups in flight buy no time and hold one more.
    assert one.inflight_bytes == 500_000
    two = m.predict(offload=["x", "y"], max_inflight_groups=2)
    assert two.cost_ms == 0 and two.inflight_bytes == one.inflight_bytes + 500_000
    # z moves nothing; offloading it would only move the flush after z:3: never advised
    # (Prediction.idle_offloads)
    xyz = m.predict(offload=["x", "y", "z"])
    assert xyz.idle_offloads == ["z"] and xyz.inflight_bytes == 500_000
    out = advise(two_close_names_profile(), Bandwidth.constant(1.0))
    assert [r["verdict"] for r in out["modules"]] == ["free", "free", "nothing"]
    assert out["free"] == ["x", "y"] and out["free_max_inflight_groups"] == 1
    assert out["free_flags"] == "--offload-modules=x,y"
    assert out["free_prediction"]["cost_pct"] <= 2 and out["free_prediction"]["freed_at_peak"] == 2_500_000
    assert search(m, 8_500_000, allow_recompute=False)[0].offload == ["x", "y"]  # not x, y, z (8.5 MB too)
    from offload.tools.advise import render

    assert "max_inflight_groups" not in render(out)
    assert "max_inflight_groups=2" in render({**out, "free_max_inflight_groups": 2})
    # a slower link: 0.8 ms each, 1.6 ms of a 2 ms layer is over the 70% headroom: only one of them
    slow = advise(two_close_names_profile(), Bandwidth.constant(0.5 / 0.8))
    assert slow["free"] == ["x"] and slow["free_max_inflight_groups"] == 1
    assert slow["free_copy_fraction"] <= 0.7


# Figures of the H100 run the derived fixtures come from (.device/2/tools/advice.json there):
# bytes offloaded / recomputed per name alone, and what the old advice called its free set.
H100_OFFLOADED = {"attn_norm": 201326592, "qkv_linear": 234881024, "core_attn": 704643072, "attn_proj": 0,
                  "mlp_norm": 234881024, "fc1": 234881024, "mlp_act": 939524096, "fc2": 939524096}
H100_RECOMPUTED = {"attn_norm": 235110400, "qkv_linear": 704643072, "core_attn": 238551152, "attn_proj": 0,
                   "mlp_norm": 235110400, "fc1": 939524096, "mlp_act": 939524096, "fc2": 0}
H100_OLD_FREE = ["attn_norm", "qkv_linear", "core_attn", "mlp_norm", "fc1"]


def h100_inputs() -> tuple[dict, Bandwidth]:
    return load_fixture("profile_h100_derived.json"), Bandwidth.from_json(load_fixture("bandwidth_h100_derived.json"))


def h100_model() -> Model:
    return Model(*h100_inputs())


def test_h100_derived_fixture_reproduces_that_run():
    m = h100_model()
    for n in m.names:
        assert m.predict(offload=[n]).offloaded_bytes == H100_OFFLOADED[n], n
        assert m.predict(recompute=[n]).recomputed_bytes == H100_RECOMPUTED[n], n
    p = m.predict(offload=H100_OLD_FREE)
    # the run's advice: 4.49 ms of copies per 2.83 ms layer (its bandwidth JSON; the fixture's
    # GB/s are rounded to 0.1). It counted the last group launched (32 MiB) at the peak; the
    # groups held at the first flush now count only if they outweigh the rest of the forward:
    # all 1.5 GiB are freed
    assert p.offloaded_bytes == 1610612736 and p.inflight_bytes == 0
    assert p.freed_at_peak == 1610612736 and p.peak_bytes == 11315364352 - 1610612736
    assert p.d2h_ms_per_layer == pytest.approx(4.4895, rel=2e-3)
    assert m.fwd_window == pytest.approx(2.8334, rel=1e-4)


def test_h100_free_set_is_free_together():
    """The run's advice called five names free, each alone; together their copies were 158% of a
    layer's forward (the advice itself predicted 18%; the measured offload step was 121 ms
    against 94). The free set now fits as a whole."""
    m = h100_model()
    old = m.predict(offload=H100_OLD_FREE)
    assert m.copy_fraction(old) > 1.5
    assert old.cost_pct > 15  # at least the throughput bound: 7 x (4.49 - 2.83) ms of 79 ms
    assert m.predict(offload=H100_OLD_FREE, max_inflight_groups=5).cost_pct > 10  # no in-flight depth helps
    verdicts = {n: classify(m, n, 0.7)["verdict"] for n in m.names}
    assert [n for n, v in verdicts.items() if v == "free"] == H100_OLD_FREE  # each alone still is
    fp = free_set(m)
    assert fp.offload == ["core_attn"] and fp.max_inflight_groups == 1
    assert m.copy_fraction(fp) <= 0.7 and fp.cost_pct <= 2
    # no name can be added: core_attn's 1.85 ms plus any other name's copies is over 70% of 2.83 ms
    for n in m.names:
        if n != "core_attn" and H100_OFFLOADED[n]:
            assert m.copy_fraction(m.predict(offload=["core_attn", n])) > 0.7, n
    adv = advise(*h100_inputs(), budget=11315364352 - int(2.5 * 2**30))
    assert adv["free"] == ["core_attn"] and adv["free_prediction"]["cost_pct"] <= 2
    assert adv["free_alone_together"]["offload"] == H100_OLD_FREE and adv["free_alone_together"]["cost_pct"] > 15
    assert adv["budget"]["meets_budget"] and adv["budget_offload_only"]["meets_budget"]
    from offload.tools.advise import render

    text = render(adv)
    assert "Free set (the names together, one copy stream): `--offload-modules=core_attn`" in text
    assert "are not:" in text


def test_advise_never_prints_a_costly_free_set():
    """Whatever the link, the free set's own predicted cost is within the limit and its copies
    within the headroom (or it is empty)."""
    prof = load_fixture("profile_h100_derived.json")
    for gbps in (5.0, 20.0, 54.0, 200.0):
        for headroom, pct in ((0.7, 2.0), (1.0, 5.0), (0.3, 0.5)):
            bw = Bandwidth.constant(gbps, compute_slowdown=0.05)
            out = advise(prof, bw, headroom=headroom, free_cost_pct=pct)
            m = Model(prof, bw)
            if out["free"]:
                p = m.predict(offload=out["free"], max_inflight_groups=out["free_max_inflight_groups"])
                assert p.cost_pct <= pct and m.copy_fraction(p) <= headroom, (gbps, headroom, pct, out["free"])
            else:
                assert out["free_prediction"]["offloaded_bytes"] == 0


@pytest.mark.parametrize("names", [["core_attn"], ["attn_proj"], ["core_attn", "attn_proj"],
                                   ["fc1", "mlp_act", "fc2"], ["attn_norm", "qkv_linear", "mlp_norm"]])
def test_predicted_bytes_equal_the_engine_on_the_recorded_profile(names):
    """The profile fixture was recorded on CPU; the engine's CPU fallback offloads exactly the
    bytes the advisor predicts, name by name (the same rules, applied independently)."""
    prof = load_fixture("profile_cpu.json")
    predicted = Model(prof, Bandwidth.constant(50.0)).predict(offload=names).offloaded_by_name
    work = build_workload(prof["workload"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        offload.configure(names, min_tensor_bytes=prof["min_tensor_bytes"], device="cpu")
    handle = offload.attach(work.model, {n: work.mapping[n] for n in names})
    work.step()
    stats = offload.end_iteration()
    handle.remove()
    measured = {n: s.bytes_offloaded for n, s in stats.by_name.items() if s.bytes_offloaded}
    assert measured == predicted
    # every name moves bytes, but attn_proj alone: its only saved tensor, core_attn's output,
    # stays, held by core_attn's attention (and core_attn alone leaves that one to attn_proj)
    w = prof["workload"]
    attn_out = (w["layers"] - 1) * w["seq"] * w["batch"] * w["hidden"] * 4  # fp32, offloaded layers
    for name in names:
        held = stats.by_name[name].bytes_held_elsewhere
        assert held == (attn_out if attention_output_stays(name, names) else 0), name
        assert (name in measured) == (names != ["attn_proj"]), name


def test_advise_cli_on_the_recorded_profile(tmp_path, capsys):
    from offload.tools import advise as advise_cli

    out = tmp_path / "advice.json"
    rc = advise_cli.main(["--profile", str(FIX / "profile_gpu.json"), "--bandwidth", str(FIX / "bandwidth.json"),
                          "--budget-below-peak-gib", "1", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert [r["name"] for r in data["modules"]] == load_fixture("profile_gpu.json")["names"]
    assert data["free_flags"] in text and "| core_attn |" in text and "Budget" in text


@pytest.mark.parametrize("tool", ["advise", "advisor_check"])
def test_a_cpu_profile_is_refused(tmp_path, capsys, tool):
    """A CPU profile has host times and no peak: every name would look free and the check would
    pass on nothing. Both tools say so and exit non-zero, writing nothing."""
    import importlib

    out = tmp_path / "out.json"
    argv = ["--profile", str(FIX / "profile_cpu.json"), "--out", str(out)]
    argv += ["--link-gbps", "50"] if tool == "advise" else ["--advice", str(FIX / "check.json")]
    with pytest.raises(SystemExit) as info:
        importlib.import_module(f"offload.tools.{tool}").main(argv)
    assert info.value.code not in (0, None)
    assert "a CPU profile cannot be advised on" in str(info.value.code) and not out.exists()


def test_gpu_profile_and_check_fixtures_agree():
    """The check recorded its predictions from the GPU profile: recomputing them gives the same."""
    prof = load_fixture("profile_gpu.json")
    check = load_fixture("check.json")
    m = Model(prof, Bandwidth.from_json(load_fixture("bandwidth.json")))
    for row in check["rows"]:
        assert row["predicted_offloaded_bytes"] == m.predict(offload=row["modules"]).offloaded_bytes
        # the engine offloaded what the advisor predicted, within 1% (the last-group rule etc.)
        assert row["offloaded_bytes"] == pytest.approx(row["predicted_offloaded_bytes"], rel=0.01)
    from offload.tools.advisor_check import render

    assert "Checks:" in render(check)


def test_check_runs_the_free_set_with_its_groups_in_flight():
    from offload.tools.advisor_check import check, configs_from_advice, render

    adv = {"free": ["x", "y"], "free_max_inflight_groups": 2,
           "budget_offload_only": {"prediction": {"offload": ["x", "y", "z"], "max_inflight_groups": 1}}}
    assert configs_from_advice(adv) == [("x", ["x"], 1, True), ("y", ["y"], 1, True),
                                        ("free set", ["x", "y"], 2, True),
                                        ("budget (offload only)", ["x", "y", "z"], 1, False)]
    assert configs_from_advice({"free": ["x"], "free_max_inflight_groups": 1}) == [("x", ["x"], 1, True)]
    # on CPU, end to end: the engine runs with the in-flight depth asked and offloads the
    # predicted bytes (no peak there, so the peak check is n/a)
    prof = load_fixture("profile_cpu.json")
    result = check(prof, {"free": ["core_attn", "fc1"], "free_max_inflight_groups": 2}, steps=1, warmup=0,
                   peak_tolerance=0.1, free_cost_pct=1e9, extra=[("three", ["qkv_linear", "mlp_act", "fc2"], 3)])
    got = {r["label"]: r for r in result["rows"]}
    assert set(got) == {"core_attn", "fc1", "free set", "three"}
    assert got["free set"]["max_inflight_groups"] == 2 and got["three"]["max_inflight_groups"] == 3
    for r in result["rows"]:
        assert r["offloaded_bytes"] == r["predicted_offloaded_bytes"] > 0
        assert r["peak_ok"] is None and r["called_free"] == (r["label"] != "three")
    text = render(result)
    assert "core_attn,fc1 (in flight 2)" in text and "PASSED" in text


def test_cuda_event_times_are_read_after_the_end_event_completed():
    """Every function of offload.tools that reads ``elapsed_time`` synchronizes first (the end
    event, or the device): elapsed_time raises if an event has not completed yet."""
    import ast

    tools = Path(offload.__file__).parent / "tools"
    readers = 0
    for path in sorted(tools.glob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            calls = [(c.lineno, c.func.attr) for c in ast.walk(fn)
                     if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                     and c.func.attr in ("elapsed_time", "synchronize")]
            reads = [ln for ln, a in calls if a == "elapsed_time"]
            if not reads:
                continue
            readers += 1
            syncs = [ln for ln, a in calls if a == "synchronize"]
            assert syncs and min(syncs) < min(reads), f"{path.name}:{fn.name} reads event times without a synchronize"
    assert readers >= 3  # bandwidth (twice), profile_modules, advisor_check


# ------------------------------------------------------------------ profiler
def test_boundaries_leave_gradients_unchanged_and_see_every_instance():
    from offload.testing import GPT_MAPPING, build_gpt, first_difference, train_step

    model = build_gpt(32, 2, 2)
    x = torch.randn(8, 1, 32)
    g = torch.randn(8, 1, 32)
    _, ref = train_step(model, x, g)
    seen = []
    b = Boundaries(model, GPT_MAPPING, lambda *a: seen.append(a))
    _, got = train_step(model, x, g)
    b.remove()
    assert first_difference(ref, got) is None
    for name in GPT_MAPPING:
        for i in range(2):
            for phase in ("fwd", "bwd"):
                assert {(name, i, phase, "begin"), (name, i, phase, "end")} <= set(seen), (name, i, phase)
    with pytest.raises(ValueError, match="no module matches"):
        Boundaries(model, {"x": "nothing.*"}, lambda *a: None)


def test_profile_cli_records_storages_and_times(tmp_path):
    out = tmp_path / "p.json"
    assert profile_modules.main(["--device", "cpu", "--hidden", "32", "--heads", "2", "--layers", "2",
                                 "--seq", "16", "--dtype", "fp32", "--steps", "1", "--warmup", "0",
                                 "--out", str(out)]) == 0
    prof = json.loads(out.read_text())
    assert prof["names"] == ["attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "fc1", "mlp_act", "fc2"]
    assert all(len(m["fwd_ms"]) == 2 and None not in m["bwd_ms"] for m in prof["modules"].values())
    # q, k and v are one storage (the qkv projection), saved by core_attn
    qkv = [s for s in prof["storages"] if s["savers"] == ["core_attn:0"] and s["bytes"] == 16 * 96 * 4]
    assert len(qkv) == 1 and qkv[0]["created_in"] == "qkv_linear:0"
    # SDPA's output is saved by core_attn and attn_proj both
    assert any(s["savers"] == ["core_attn:1", "attn_proj:1"] for s in prof["storages"])


def test_profile_backward_comes_from_the_same_step_as_its_forward():
    """No input requires grad, so the model's backward has no end marker and is the rest of the
    step. It was the median step of `measure_step` minus the forward of the separately timed
    step: when that step ran slower (a busy host), the backward came out negative and the planner
    predicted tens of ms of exposed reloads for a few KiB (a flaky plan in CI)."""
    import time

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    x = torch.randn(4, 8)
    calls = []

    def step():
        calls.append(None)
        model(x).sum().backward()

    def slow_forward(module, args, out):  # runs before the profiler's own end-of-forward hook
        if len(calls) == 2:  # the timed step (1: measure_step's, 3: record_saved's)
            time.sleep(0.05)

    model.register_forward_hook(slow_forward)
    work = profile_modules.Workload(model, {"lin": "0"}, step, torch.device("cpu"))
    prof = profile_modules.profile(work, {}, steps=1, warmup=0, time_steps=1, min_tensor_bytes=0)
    assert prof["forward_ms"] >= 50
    assert 0 <= prof["backward_ms"] < prof["forward_ms"]


def test_workload_entry_points():
    spec = {"entry": "tests.test_tools:tiny_entry", "kwargs": {"width": "8"}, "device": "cpu"}
    work = build_workload(spec)
    work.step()
    assert work.mapping == {"lin": "0"} and work.model[0].weight.grad is not None
    with pytest.raises(SystemExit, match="pkg.module:function"):
        build_workload({"entry": "nocolon", "device": "cpu"})
    with pytest.raises(SystemExit, match="cannot load"):
        build_workload({"entry": "tests.test_tools:missing", "device": "cpu"})


def tiny_entry(device: str, width: str):
    model = torch.nn.Sequential(torch.nn.Linear(int(width), int(width)), torch.nn.ReLU())
    x = torch.randn(4, int(width), device=device)
    return model, {"lin": "0"}, lambda: model(x).sum().backward()


# ------------------------------------------------------------------ overlap
def synthetic_timeline() -> Timeline:
    """Compute stream 7: kernels [0,100), [100,200), gap, [260,300). D2H stream 20: a copy of
    core_attn L1 [50,150) (fully under kernels) and one of fc1 L1 [150,255), which the third
    kernel, launched at t=210, waited for. An unattributed copy [400,410) on stream 20."""
    tl = Timeline(source="synthetic")
    tl.ops = [GpuOp(0, 100, 7, "kernel", "k0", 1), GpuOp(100, 200, 7, "kernel", "k1", 2),
              GpuOp(260, 300, 7, "kernel", "k2", 3),
              GpuOp(50, 150, 20, "memcpy", "Memcpy DtoH", 10, 100_000_000, "d2h"),
              GpuOp(150, 255, 20, "memcpy", "Memcpy DtoH", 11, 50_000_000, "d2h"),
              GpuOp(400, 410, 20, "memcpy", "Memcpy DtoH", 12, 1_000, "d2h")]
    main, side = ("p", 1), ("p", 2)
    tl.launches = {1: (main, -10), 2: (main, -5), 3: (main, 210), 10: (main, 40), 11: (side, 140), 12: (main, 390)}
    tl.ranges = [HostRange(35, 45, main, "offload/core_attn/L1/mb0"), HostRange(135, 145, side, "offload/fc1/L1/mb0"),
                 HostRange(130, 150, main, "offload/fc1/L1/mb0")]  # right name, wrong thread: not fc1's launch
    return tl


def test_kernel_difference_compares_the_compute_streams_by_kernel_name(tmp_path, capsys):
    """``overlap kernels A B``: the compute stream's kernels of two traces by name, the largest
    difference first; other streams and copies are left out."""
    a, b = synthetic_timeline(), synthetic_timeline()
    a.ops.append(GpuOp(300, 330, 7, "kernel", "spread", 4))
    a.ops.append(GpuOp(0, 50, 9, "kernel", "side", 5))  # another stream's, less kernel time
    b.ops[1] = GpuOp(100, 190, 7, "kernel", "k1", 2)
    assert overlap.compute_kernels(a) == {"k0": (1, pytest.approx(0.1)), "k1": (1, pytest.approx(0.1)),
                                          "k2": (1, pytest.approx(0.04)), "spread": (1, pytest.approx(0.03))}
    text = overlap.kernel_difference(a, b)
    lines = [line for line in text.splitlines() if line.startswith("| +") or line.startswith("| -")]
    assert lines[0].startswith("| +0.03 | 1 | 0.03 | 0 | 0.00 | `spread`")
    assert lines[1].startswith("| +0.01 | 1 | 0.10 | 1 | 0.09 | `k1`")
    assert "A - B +0.04 ms" in text
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 5, "args": {"stream": 7, "correlation": 1}}]}))
    assert overlap.main(["kernels", str(path), str(path)]) == 0
    assert "A - B +0.00 ms" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # a table of no rows, or of all but the last ones, says nothing
        overlap.main(["kernels", str(path), str(path), "--top", "0"])
    assert "--top 0: show at least 1 kernel name" in capsys.readouterr().err


def test_overlap_arithmetic_on_a_known_timeline():
    r = overlap.analyze(synthetic_timeline(), tolerance_us=10)
    g = {(x["direction"], x["name"]): x for x in r["groups"]}
    ca, fc1, other = g[("offload", "core_attn")], g[("offload", "fc1")], g[("other", "(other copies)")]
    assert ca["copy_ms"] == pytest.approx(0.1) and ca["overlap"] == pytest.approx(1.0)
    assert ca["gbps"] == pytest.approx(100_000_000 / 0.1 / 1e6)
    assert fc1["overlap"] == pytest.approx(50 / 105)  # kernels cover [150,200) of [150,255)
    # k2 was launched at 210, the stream was free since 200, the copy ended at 255, k2 began at 260
    assert fc1["compute_wait_ms"] == pytest.approx(0.05) and ca["compute_wait_ms"] == 0
    assert other["copies"] == 1 and r["engine_wait_ms"] == pytest.approx(0.05)
    assert r["compute_stream"] == 7
    roles = {s["stream"]: s["role"] for s in r["streams"]}
    assert roles == {7: "compute", 20: "D2H copies"}
    assert r["engine_overlap"] == pytest.approx((100 + 50) / 205)
    text = overlap.render(r)
    assert "| offload | fc1 | 1 |" in text
    # a wider tolerance does not change it; a narrower one drops the wait (260 - 255 = 5 us)
    assert overlap.analyze(synthetic_timeline(), tolerance_us=4)["engine_wait_ms"] == 0


def test_range_names():
    assert overlap.parse_range_name("offload/core_attn/L3/mb2") == ("offload", "core_attn", 3)
    assert overlap.parse_range_name("reload/fc1/L0/mb0/c1") == ("reload", "fc1", 0)
    with pytest.raises(ValueError):
        overlap.parse_range_name("aten::mm")


def test_nsys_sqlite_gives_the_same_timeline(tmp_path):
    """A small database in the nsys export schema (the tables and columns the reader uses)."""
    db_path = tmp_path / "p.sqlite"
    db = sqlite3.connect(db_path)
    db.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INT, end INT, streamId INT, correlationId INT, shortName INT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INT, end INT, streamId INT, correlationId INT, bytes INT,
                                                 copyKind INT);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INT, end INT, globalTid INT, correlationId INT);
        CREATE TABLE NVTX_EVENTS (start INT, end INT, globalTid INT, text TEXT, textId INT, eventType INT);
    """)
    syn = synthetic_timeline()
    tids = {("p", 1): 100, ("p", 2): 200}
    db.execute("INSERT INTO StringIds VALUES (1, 'gemm'), (2, 'offload/fc1/L1/mb0')")
    for op in syn.ops:
        if op.kind == "kernel":
            db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?,?,?,?,1)",
                       (op.start * 1000, op.end * 1000, op.stream, op.correlation))
        else:
            db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (?,?,?,?,?,2)",
                       (op.start * 1000, op.end * 1000, op.stream, op.correlation, op.bytes))
    for corr, (tid, t) in syn.launches.items():
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?,?,?,?)", (t * 1000, t * 1000 + 1, tids[tid], corr))
    for r in syn.ranges:  # one name through StringIds, the others inline
        text, text_id = (None, 2) if r.thread == ("p", 2) else (r.name, None)
        db.execute("INSERT INTO NVTX_EVENTS VALUES (?,?,?,?,?,59)", (r.start * 1000, r.end * 1000, tids[r.thread],
                                                                     text, text_id))
    db.execute("INSERT INTO NVTX_EVENTS VALUES (0, NULL, 100, 'a mark', NULL, 34)")
    db.commit()
    db.close()
    a = overlap.analyze(load(db_path), tolerance_us=10)
    b = overlap.analyze(synthetic_timeline(), tolerance_us=10)
    strip = lambda r: [(g["direction"], g["name"], g["copies"], round(g["overlapped_ms"], 9),  # noqa: E731
                        round(g["compute_wait_ms"], 9)) for g in r["groups"]]
    assert strip(a) == strip(b)
    with pytest.raises(ValueError, match="not an nsys SQLite export"):
        (tmp_path / "empty.sqlite").write_bytes(b"")
        load_nsys_sqlite(tmp_path / "empty.sqlite")


def test_cpu_trace_fixture_has_the_engine_ranges():
    tl = load(fixture("trace_cpu.json.gz"))
    names = {overlap.parse_range_name(r.name)[:2] for r in tl.ranges if r.name.startswith(("offload/", "reload/"))}
    assert names == {("offload", "core_attn"), ("offload", "fc2"), ("reload", "core_attn"), ("reload", "fc2")}
    with pytest.raises(ValueError, match="no GPU operations"):
        overlap.analyze(tl)


def test_record_on_cpu_restores_nvtx(tmp_path):
    from offload import nvtx

    push = nvtx.push
    out = tmp_path / "t.json"
    assert overlap.main(["record", "--device", "cpu", "--hidden", "32", "--heads", "2", "--layers", "2",
                         "--seq", "8", "--dtype", "fp32", "--modules", "fc1", "--steps", "1", "--warmup", "0",
                         "--out", str(out)]) == 0
    assert nvtx.push is push
    assert [r.name for r in load(out).ranges if r.name.startswith("offload/")] == ["offload/fc1/L0/mb0"]
    assert json.loads((tmp_path / "t.json.stats.json").read_text())["modules"] == ["fc1"]


def test_gpu_trace_fixture(tmp_path):
    path = fixture("trace_gpu.json.gz")
    stats = json.loads(fixture("trace_gpu.json.gz.stats.json").read_text())
    tl = load(path)
    r = overlap.analyze(tl)
    d2h = {g["name"]: g for g in r["groups"] if g["direction"] == "offload"}
    assert set(d2h) == set(stats["modules"])
    for name, g in d2h.items():  # every byte the engine offloaded is a copy in its range
        assert g["bytes"] == stats["by_name"][name]["bytes_offloaded"]
        assert 0 <= g["overlap"] <= 1
    assert overlap.layer_picture(tl, tmp_path / "layer.png").exists()


# ------------------------------------------------------------------ memory
def synthetic_run(label: str, offloaded: bool) -> dict:
    """Host time in us from 1000. Forward [1000,1100): module m allocates 100 bytes at 1010 (kept
    for backward) and 10 at 1020 (freed at 1030); with offloading the 100 are freed at 1080 (in
    (other) forward). Backward [1100,1200): m's backward [1120,1150) allocates 50 (freed at 1190)."""
    events = [[1010, 100, "a"], [1020, 10, "b"], [1030, -10, "b"], [1125, 50, "c"], [1190, -50, "c"],
              [1195, -100, "a"]]
    if offloaded:
        events = [e for e in events if e[2] != "a"] + [[1010, 100, "a"], [1080, -100, "a"], [1110, 100, "a2"],
                                                       [1195, -100, "a2"]]
    exact = {1000: 0, 1100: 100 if not offloaded else 0, 1200: 0}
    markers = [[1000, "step", 0, "step", "begin", 1000], [1000, "", 0, "fwd", "begin", 1000],
               [1005, "m", 0, "fwd", "begin", 1000], [1040, "m", 0, "fwd", "end", 1100],
               [1100, "", 0, "fwd", "end", 1000 + exact[1100]], [1100, "", 0, "bwd", "begin", 1000 + exact[1100]],
               [1120, "m", 0, "bwd", "begin", 1000 + exact[1100] + (100 if offloaded else 0)],
               [1150, "m", 0, "bwd", "end", 1000 + exact[1100] + (150 if offloaded else 50)],
               [1200, "", 0, "bwd", "end", 1000], [1200, "step", 0, "step", "end", 1000]]
    return {"label": label, "modules": ["m"] if offloaded else [], "start_allocated": 1000,
            "peak_allocated": 1150, "events": events, "markers": markers}


def test_memory_regions_and_difference(tmp_path):
    runs = [synthetic_run("none", False), synthetic_run("offload m", True)]
    result = memory.compare(runs)
    s0, s1 = result["summaries"]
    assert s0["alignment_bytes"] == 0 and s1["alignment_bytes"] == 0
    assert s0["at_forward_end"] == 1100 and s1["at_forward_end"] == 1000
    assert s0["peak_rebuilt"] == 1150 and s0["peak_in"] == "m bwd"
    rows = {(r["name"], r["phase"]): r["runs"] for r in result["regions"]}
    assert rows[("m", "fwd")][0] == {"allocated": 110, "freed": 10, "left_at_forward_end": 100}
    assert rows[("m", "fwd")][1] == {"allocated": 110, "freed": 10, "left_at_forward_end": 0}
    assert rows[("(other)", "fwd")][1]["freed"] == 100
    text = memory.render(result)
    assert "| m | fwd | 0.0 | 0.0 |" in text and "Peak:" in text
    assert memory.picture(runs, tmp_path / "m.png").exists()
    with pytest.raises(ValueError, match="two runs"):
        memory.compare(runs[:1])


def test_memory_event_times_in_nanoseconds_are_detected():
    run = synthetic_run("none", False)
    run["events"] = [[t * 1000, d, a] for t, d, a in run["events"]]
    assert memory.Step(run).summary()["at_forward_end"] == 1100


def test_gpu_memory_fixture():
    data = load_fixture("memory_gpu.json")
    result = memory.compare(data["runs"])
    base, off = result["summaries"]
    assert off["peak_allocated"] < base["peak_allocated"]
    for s in result["summaries"]:  # the allocator's clock and the markers' agree
        assert s["alignment_bytes"] <= 0.01 * s["peak_allocated"]
    assert "Regions whose figures differ" in memory.render(result)


# ------------------------------------------------------------------ nsys
def test_nsys_commands(capsys, tmp_path):
    cmds = nsys_run.nsys_commands("nsys", tmp_path, "p", ["python", "train.py"], capture=True)
    assert cmds[0][:2] == ["nsys", "profile"] and "--trace=cuda,nvtx" in cmds[0]
    assert "--capture-range=cudaProfilerApi" in cmds[0] and cmds[0][-2:] == ["python", "train.py"]
    assert cmds[1][:3] == ["nsys", "export", "--type=sqlite"]
    assert nsys_run.main(["--dry-run", "--out", str(tmp_path), "--", "python", "x.py"]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and "offload.tools.overlap report" in printed[2]
    with pytest.raises(SystemExit):
        nsys_run.main(["--dry-run"])


def fake_nsys(tmp_path: Path, body: str) -> str:
    exe = tmp_path / "fake_nsys"
    exe.write_text("#!/bin/sh\n" + body + "\n")
    exe.chmod(0o755)
    return str(exe)


def test_nsys_without_a_report_says_so_and_where_the_capture_is(tmp_path, capsys):
    """As on the lent H100: nsys profile collects (a .qdstrm) but cannot make the report and
    exits with 1. The tool says so, names the capture, and exits with 0."""
    out = tmp_path / "prof"
    nsys = fake_nsys(tmp_path, 'for a in "$@"; do case "$a" in --output=*) o="${a#--output=}";; esac; done\n'
                               'echo "Importer error" >&2; : > "$o.qdstrm"; exit 1')
    rc = nsys_run.main(["--nsys", nsys, "--out", str(out), "--", "python", "x.py"])
    captured = capsys.readouterr()
    assert rc == 0
    assert "could not produce a report" in captured.err and str(out / "profile.qdstrm") in captured.err
    assert "raw capture: " + str(out / "profile.qdstrm") in captured.out
    # nsys that does not run at all (no capture): its status
    nsys = fake_nsys(tmp_path, "exit 3")
    assert nsys_run.main(["--nsys", nsys, "--out", str(tmp_path / "p2"), "--", "python", "x.py"]) == 3
    assert "did not run the command" in capsys.readouterr().err


# ------------------------------------------------------------------ on the GPU
@requires_cuda
def test_advisor_predicts_the_peak_on_the_gpu(tmp_path, capsys):
    """A medium GPT stack (hidden 2048, 4 layers, seq 4096): the advisor's predicted peak is
    within 10% of the measured one (the issue's requirement) for every configuration the check
    runs: each name of the free set alone, the free set with its in-flight depth, and five names
    together with one and with five groups in flight. Step-time limits are checked at full size
    by tools/gpu_session.sh (a small stack is host-bound), so they are off here.

    The prediction is the measured baseline peak less what the profile says is freed at it: the
    offloaded bytes less the groups whose copies may still be in flight (an upper bound on what
    is held: a copy found done is released earlier), so the measured peak may be below the
    prediction by up to those groups; the check's table (printed) gives both freed figures."""
    from offload.tools.advisor_check import check, render

    prof_path = tmp_path / "p.json"
    assert profile_modules.main(["--device", "cuda", "--hidden", "2048", "--heads", "16", "--layers", "4",
                                 "--seq", "4096", "--steps", "3", "--warmup", "2", "--out", str(prof_path)]) == 0
    prof = json.loads(prof_path.read_text())
    adv = advise(prof, Bandwidth.constant(50.0))
    if not adv["free"]:
        adv["free"], adv["free_max_inflight_groups"] = ["core_attn"], 1
    five = ["attn_norm", "qkv_linear", "core_attn", "mlp_norm", "fc1"]
    result = check(prof, adv, steps=3, warmup=2, peak_tolerance=0.10, free_cost_pct=1e9,
                   extra=[("five", five, 1), ("five, 5 in flight", five, 5)])
    with capsys.disabled():
        print("\n" + render(result))
    assert result["rows"]
    bad = [f"{r['label']}: predicted {r['predicted_peak']}, measured {r['peak_allocated']} "
           f"({r['peak_error_pct']:+.1f}%)" for r in result["rows"] if not r["peak_ok"]]
    assert not bad, "; ".join(bad)
    for row in result["rows"]:
        assert row["offloaded_bytes"] == pytest.approx(row["predicted_offloaded_bytes"], rel=0.01), row["label"]


def test_decision_log_summary_cuts_around_where_the_step_first_reached_its_peak():
    """`offload.tools.decision_log.summarize`: the step's highest ``max_mib`` and the entries
    around the first that reached it (the peak came after the entry before it)."""
    from offload.tools.decision_log import summarize

    entries = [{"event": "unpack", "group": f"g{i}", "max_mib": m} for i, m in enumerate([5, 9, 12, 12, 30, 30, 31, 31])]
    out = summarize(entries, before=2)
    assert (out["entries"], out["peak_mib"], out["peak_entry"]) == (8, 31, 6)
    assert [e["group"] for e in out["around_peak"]] == ["g4", "g5", "g6", "g7"]
    assert summarize([])["around_peak"] == [] and summarize([])["peak_mib"] is None


def test_decision_log_wrappers_come_off(configure):
    """`DecisionLog.remove` puts back the engine's own methods; nothing is logged outside `record`."""
    from offload.group import TensorRecord
    from offload.manager import PipelineOffloadManager
    from offload.tools import decision_log
    from offload.tools.decision_log import DecisionLog

    real = (PipelineOffloadManager.reload, TensorRecord.check_version)
    log = DecisionLog().install()
    try:
        assert PipelineOffloadManager.reload is not real[0]
        log._add("reload", "g")
        assert log.entries == []
        with log.record() as entries:
            log._add("reload", "g")
        assert [e["group"] for e in entries] == ["g"]
    finally:
        log.remove()
    assert (PipelineOffloadManager.reload, TensorRecord.check_version) == real
    with decision_log.record() as entries:  # the same, for one step
        assert PipelineOffloadManager.reload is not real[0]
    assert (PipelineOffloadManager.reload, TensorRecord.check_version) == real and entries == []


def test_decision_log_changes_nothing_the_engine_does(configure):
    """A logged step makes the same copies as an unlogged one (one rank of PP=2 VPP=2 replayed,
    8 microbatches): the log reads the engine's handlers without retiring any. A log that went
    through `PipelineOffloadManager.live_handlers`, which retires the idle handlers first,
    retired each chunk's handler before its first layer's `qkv_linear` backward ended, and the
    last layer's `qkv_linear` of the chunk whose backward came next was reloaded on demand: 18
    reloads on demand here instead of 3."""
    import copy

    from conftest import gpt_chunks
    from offload.schedules import schedule_order
    from offload.testing import GPT_MAPPING, first_difference, replay_order
    from offload.tools.decision_log import DecisionLog

    order = schedule_order(2, 2, 8, 0)
    chunks = gpt_chunks(2, 32, 4, 3)
    totals, grads = [], []
    for logged in (False, True):
        configure(["qkv_linear", "core_attn", "attn_proj"])
        model = copy.deepcopy(chunks)
        handles = [offload.attach(chunk, GPT_MAPPING, chunk_id=c) for c, chunk in enumerate(model)]
        offload.set_schedule(order)
        log = DecisionLog().install()
        try:
            with log.record() if logged else contextlib.nullcontext():
                grads.append(replay_order(model, order, (8, 2, 32)))
        finally:
            log.remove()
        t = offload.end_iteration().total()
        totals.append((t.reloads_on_demand, t.reloads_prefetched, t.groups_offloaded, t.groups_kept))
        for handle in handles:
            handle.remove()
    assert first_difference(*grads) is None
    assert totals[0] == totals[1] and totals[0][1] > 0, totals
    assert any(e["event"] == "reload" and e["prefetch"] for e in log.entries)
