"""The copy-wait notice (offload/copy_wait.py): the rule on given figures, the probe on fake
events, and the engine end to end on the CPU fallback with a simulated GPU timeline."""

from __future__ import annotations

import warnings
from dataclasses import replace
from types import SimpleNamespace
from typing import Sequence

import pytest
import torch

import offload
from offload import notices
from offload.copy_wait import (GIVE_UP, INTO_BACKWARD, MAX_SUBSET_NAMES, CopyWaitProbe, NameFigures, copy_wait_notice,
                               fitting_subset)
from offload.config import OffloadConfig
from offload.pinned_pool import PinnedHostPool
from offload.stats import GroupStats, IterationStats, StatsRecorder
from offload.streams import HostStreams, _HostEvent, _HostStream
from offload.testing import GPT_MAPPING, build_gpt, train_step

# The Megatron example (hidden 3072, seq 4096, 6 layers, 2 microbatches: 10 groups of each
# name per step, the last layer kept), offloading qkv_linear, core_attn and attn_proj.
MEGATRON = [
    NameFigures("qkv_linear", 10, 50.3e6, d2h_ms=1.0, h2d_ms=1.0, layer_ms=7.7, offload_wait_ms=20.0,
                reload_wait_ms=15.0),
    NameFigures("core_attn", 10, 2.389e9, d2h_ms=47.8, h2d_ms=47.0, layer_ms=7.7, offload_wait_ms=420.0,
                reload_wait_ms=440.0),
    NameFigures("attn_proj", 10, 50.3e6, d2h_ms=1.0, h2d_ms=1.0, layer_ms=7.7, offload_wait_ms=5.0,
                reload_wait_ms=5.0),
]
PLANNER = ('let the planner choose under a memory budget: offload.configure(modules="auto", memory_budget=...) '
           '(offload.plan shows what it would offload).')


def test_megatron_figures_name_the_names_and_the_subset_that_fits():
    note = copy_wait_notice(MEGATRON, 1182.0, [2, 3, 4])
    assert note is not None
    assert note.split("\n") == [
        "offload: copies made the compute stream wait 905.0 ms per step, 76.6% of the 1182.0 ms step (over 2%; "
        "measured in iterations 2, 3, 4; said once per process):",
        "  core_attn: 10 group(s) per step of 2.4 GB each (one per layer and microbatch); copy out 47.80 ms, back "
        "47.00 ms per group, against 7.70 ms of forward compute per layer (the copy out needs 621% of it); waits "
        "per step: 420.0 ms for copies out, 440.0 ms for copies back",
        "  qkv_linear: 10 group(s) per step of 50.3 MB each (one per layer and microbatch); copy out 1.00 ms, back "
        "1.00 ms per group, against 7.70 ms of forward compute per layer (the copy out needs 13% of it); waits per "
        "step: 20.0 ms for copies out, 15.0 ms for copies back",
        "  attn_proj: 10 group(s) per step of 50.3 MB each (one per layer and microbatch); copy out 1.00 ms, back "
        "1.00 ms per group, against 7.70 ms of forward compute per layer (the copy out needs 13% of it); waits per "
        "step: 5.0 ms for copies out, 5.0 ms for copies back",
        "Instead: at the measured rate (50.0 GB/s out) the copies out of all of them need 647% of the forward "
        "compute they run under; qkv_linear, attn_proj fit (26%, 1.0 GB per step instead of 24.9 GB): "
        'offload.configure(modules="qkv_linear,attn_proj"); or ' + PLANNER,
    ]


@pytest.mark.parametrize("waited, says", [(4.9, False), (5.0, False), (5.01, True)], ids=["under", "at", "over"])
def test_says_nothing_at_or_under_two_percent_of_the_step(waited, says):
    names = [NameFigures("core_attn", 5, 1e8, d2h_ms=2.0, h2d_ms=2.0, layer_ms=1.0, offload_wait_ms=waited,
                         reload_wait_ms=0.0)]
    assert (copy_wait_notice(names, 250.0) is not None) == says
    assert copy_wait_notice([], 250.0) is None and copy_wait_notice(names, 0.0) is None


def test_copies_that_fit_point_to_the_in_flight_bound():
    names = [NameFigures("fc1", 6, 4e7, d2h_ms=0.8, h2d_ms=0.8, layer_ms=4.0, offload_wait_ms=6.0,
                         reload_wait_ms=1.0, flush_wait_ms=1.5),
             NameFigures("mlp_act", 6, 8e7, d2h_ms=1.6, h2d_ms=1.6, layer_ms=4.0, offload_wait_ms=3.0,
                         reload_wait_ms=0.0)]
    lines = copy_wait_notice(names, 100.0, max_inflight_groups=2).split("\n")
    assert lines[1].endswith("waits per step: 6.0 ms for copies out (1.5 of them at the forward's end), 1.0 ms "
                             "for copies back")
    assert lines[2].endswith("waits per step: 3.0 ms for copies out, 0.0 ms for copies back")
    assert lines[-1] == (
        "Instead: their copies out need 60% of the forward compute they run under, so they fit at the measured "
        "rate; the waits come from the in-flight bound (7.5 of the 9.0 ms per step for copies out; the rest at "
        "the forward's end): max_inflight_groups=2 lets 2 group(s) copy at a time, so each copy has to end under "
        "the compute of the next 2 group(s) of any name; raise it (each group more in flight holds its bytes at "
        "the peak). Or " + PLANNER)


def test_copies_that_fit_waited_for_at_the_forwards_end_say_so():
    """Most of the waits for copies out timed at the flush: the forward's end, not the bound."""
    names = [NameFigures("moe_act", 28, 4.6e8, d2h_ms=8.6, h2d_ms=8.6, layer_ms=12.8, offload_wait_ms=33.8,
                         reload_wait_ms=2.8, flush_wait_ms=30.0)]
    lines = copy_wait_notice(names, 952.4).split("\n")
    assert lines[-1] == INTO_BACKWARD
    assert copy_wait_notice(names, 952.4, copies_into_backward=True).split("\n") == lines[:-1]
    assert lines[-2] == (
        "Instead: their copies out need 67% of the forward compute they run under, so they fit at the measured "
        "rate; the waits come from the forward's end (30.0 of the 33.8 ms per step for copies out): there the "
        "compute stream waits for the copies still in flight so that the peak does not hold them, and a copy "
        "issued at the last layer's group open of its name runs only under what is left of that layer "
        "(docs/design.md, Known limits); fewer bytes in the last layers help there, and so does a name whose group "
        "opens early in each layer (a norm), at whose open the copies decided before it are issued. Or " + PLANNER)


def test_copies_that_fit_with_waits_for_reloads_name_the_reloads_on_demand():
    names = [NameFigures("core_attn", 6, 4e7, d2h_ms=0.8, h2d_ms=0.8, layer_ms=4.0, offload_wait_ms=0.5,
                         reload_wait_ms=9.0, reloads_on_demand=2.0)]
    last = copy_wait_notice(names, 100.0).split("\n")[-1]
    assert last.startswith("Instead: their copies out need 20% of the forward compute they run under, so they fit "
                           "at the measured rate; the waits are for copies back, each of which runs under one layer "
                           "of backward; 2 reload(s) per step ran on demand, prefetched by nothing")
    assert last.endswith("offload fewer bytes per layer, or " + PLANNER)


def test_no_name_that_fits_and_a_name_without_layer_time():
    names = [NameFigures("core_attn", 4, 1e9, d2h_ms=20.0, h2d_ms=20.0, layer_ms=5.0, offload_wait_ms=60.0,
                         reload_wait_ms=0.0),
             NameFigures("head", 1, 1e9, d2h_ms=20.0, h2d_ms=20.0, layer_ms=None, offload_wait_ms=10.0,
                         reload_wait_ms=0.0)]
    lines = copy_wait_notice(names, 200.0).split("\n")
    assert "against a forward compute per layer that was not measured (one group of the name per forward)" in lines[2]
    assert lines[-1] == (
        "Instead: at the measured rate (50.0 GB/s out) no one of them fits under its layer's forward compute (head: "
        "forward compute not measured, left out); offload modules that save fewer bytes per layer, or " + PLANNER)


# DeepSeek-V3's widths at sequence 16384, all four names, with --offload-copies-into-backward
# (H200, 2026-11-29; docs/megatron.md, At equal device memory): the copies out need 163% of the
# forward compute, and the waits for them are the in-flight bound's, none at the forward's end.
DSV3_16K = [
    NameFigures("expert_fc1", 6, 1.9e9, d2h_ms=38.66, h2d_ms=35.90, layer_ms=56.91, offload_wait_ms=129.8,
                reload_wait_ms=0.0),
    NameFigures("mlp_norm", 6, 234.9e6, d2h_ms=4.83, h2d_ms=4.51, layer_ms=56.91, offload_wait_ms=0.3,
                reload_wait_ms=0.0),
    NameFigures("moe_act", 6, 2.1e9, d2h_ms=44.63, h2d_ms=44.34, layer_ms=56.89, offload_wait_ms=0.0,
                reload_wait_ms=0.0),
    NameFigures("attn_norm", 6, 234.9e6, d2h_ms=4.80, h2d_ms=4.98, layer_ms=56.98, offload_wait_ms=0.0,
                reload_wait_ms=0.0),
]


@pytest.mark.parametrize("into_backward, how", [
    (True, "max_inflight_groups=2 (--offload-max-inflight-groups) lets"),
    (False, "max_inflight_groups=2 (--offload-max-inflight-groups) with copies_into_backward=True "
            "(--offload-copies-into-backward) let"),
], ids=["into-backward", "without-it"])
def test_copies_that_fit_under_forward_and_backward_point_to_one_more_group_in_flight(into_backward, how):
    """Measured: one more group in flight with the option took that step from +5.8% to +2.2%."""
    lines = copy_wait_notice(DSV3_16K, 1767.9, copies_into_backward=into_backward).split("\n")
    assert lines[-1].startswith("Instead: at the measured rate (48.1 GB/s out) the copies out of all of them need 163% ")
    assert lines[-1].endswith(
        f"Or keep them all where the memory allows: 130.1 ms per step of the waits are the in-flight bound's, and "
        f"{how} the copies out run on under the backward (each group more in flight holds its bytes at the peak, up "
        "to 2.1 GB).")


@pytest.mark.parametrize("change", ["too-slow", "flush", "reloads", "bound-of-3"])
def test_no_more_in_flight_where_it_cannot_help(change):
    """Copies out over forward and backward together, waits at the forward's end or for copies
    back: one more group in flight would hold memory for nothing. A bound of 3 says 4."""
    names = list(DSV3_16K)
    kw = {}
    if change == "too-slow":
        names = [replace(n, d2h_ms=n.d2h_ms * 2) for n in names]
    elif change == "flush":
        names[0] = replace(names[0], flush_wait_ms=100.0)
    elif change == "reloads":
        names[0] = replace(names[0], reload_wait_ms=200.0)
    else:
        kw = {"max_inflight_groups": 3}
    last = copy_wait_notice(names, 1767.9, copies_into_backward=True, **kw).split("\n")[-1]
    if change == "bound-of-3":
        assert "max_inflight_groups=4 (--offload-max-inflight-groups) lets the copies out run on" in last
    else:
        assert last.startswith("Instead: ") and "Or keep them all" not in last


def test_fitting_subset_moves_the_most_bytes_among_the_names_moving_the_most():
    def name(n: str, nbytes: float, share: float) -> NameFigures:
        return NameFigures(n, 1, nbytes, d2h_ms=share, h2d_ms=0.0, layer_ms=1.0, offload_wait_ms=0.0,
                           reload_wait_ms=0.0)

    a, b, c = name("a", 6e6, 0.6), name("b", 5e6, 0.5), name("c", 4.5e6, 0.45)
    assert fitting_subset([a, b, c]) == [b, c]  # 9.5 MB in 95%: more than a alone, or a with nothing
    tied = name("d", 5e6, 0.6)
    assert fitting_subset([tied, b]) == [b]  # the same bytes in a smaller share
    many = [name(f"n{i}", 1e6 * (i + 1), 0.01) for i in range(MAX_SUBSET_NAMES + 1)]
    assert fitting_subset(many) == many[1:]  # the name moving the fewest bytes is not considered


# ---------------------------------------------------------------------------- the probe, on fake events
class FakeEvent:
    """A timing event at a time the test sets; `query` says whether the GPU reached it."""

    def __init__(self, clock: "FakeStreams") -> None:
        self.clock = clock
        self.t = None

    def record(self, stream: object) -> None:
        self.t = self.clock.now

    def query(self) -> bool:
        return self.clock.done

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.clock.done, "read before it was done"
        return end.t - self.t

    def synchronize(self) -> None:
        raise AssertionError("the probe never waits for the GPU")


class FakeStreams:
    is_cuda = True

    def __init__(self) -> None:
        self.now = 0.0
        self.done = True
        self.capturing = False
        self.events = 0

    def event(self, timing: bool = False) -> FakeEvent:
        assert timing
        self.events += 1
        return FakeEvent(self)

    def current(self) -> str:
        return "compute"

    def is_capturing(self) -> bool:
        return self.capturing


def run_probe(probe: CopyWaitProbe, streams: FakeStreams, iterations: int, layer_ms: float = 4.0,
              wait_ms: float = 2.0, capture_in: Sequence[int] = (), abort_in: Sequence[int] = (),
              suspended_in: Sequence[int] = (), done_after: int = 0) -> list[bool]:
    """Drive ``probe`` for ``iterations``: each closes two groups of ``fc1`` one layer apart
    (with a wait of ``wait_ms`` between them) and ends with 20 ms of compute; groups close
    under capture in the iterations ``capture_in``, `reset()` aborts those in ``abort_in``
    (after the first group), and no group opens in those in ``suspended_in`` (`offload.suspended`: only
    compute); the GPU reaches the events only from iteration ``done_after`` on.
    Returns what each end_iteration() said (done or not)."""
    handler, said = object(), []
    for it in range(iterations):
        streams.done = it >= done_after
        capture = object() if it in capture_in else None
        if it in suspended_in:
            streams.now += 28.0
            said.append(probe.end_iteration(IterationStats(iteration=it, by_name={})))
            continue
        for layer in range(2):
            if probe.recording:
                probe.note_close(SimpleNamespace(capture=capture, stream="compute", handler=handler, name="fc1",
                                                 layer=layer))
            if layer == 0 and it in abort_in:
                probe.abort()
            if layer == 0:
                before, after = streams.event(True), streams.event(True)
                before.record("compute")
                streams.now += wait_ms
                after.record("compute")
                if probe.recording:
                    probe.note_wait("compute", before, after)
                streams.now += layer_ms
        streams.now += 20.0
        stats = IterationStats(iteration=it, by_name={"fc1": GroupStats(
            groups=2, groups_offloaded=1, bytes_offloaded=10**8, d2h_ms=3.0, h2d_ms=3.0, reloads_prefetched=1,
            offload_wait_ms=wait_ms)})
        said.append(probe.end_iteration(stats))
    return said


@pytest.fixture
def fresh_notices(monkeypatch):
    monkeypatch.setattr(notices, "_said", set())  # as in a fresh process


def measured(**kw: object) -> tuple[CopyWaitProbe, list[bool], list[str]]:
    """A probe on `FakeStreams` driven by `run_probe` (``kw``): it, what each end_iteration()
    said, and the warnings."""
    streams = FakeStreams()
    probe = CopyWaitProbe(streams)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        done = run_probe(probe, streams, **kw)
    return probe, done, [str(w.message) for w in said]


def test_probe_measures_iterations_2_to_4_and_decides_once_their_events_are_done(fresh_notices):
    probe, done, said = measured(iterations=7, done_after=6)
    assert done == [False] * 6 + [True]  # never a wait for the GPU: decided when its events are done
    [figures] = probe.figures
    assert figures.layer_ms == 4.0 and figures.d2h_ms == 3.0 and figures.groups == 1.0  # the wait taken out
    assert probe.step_ms == 26.0
    assert said == [probe.notice] and "measured in iterations 2, 3, 4;" in probe.notice
    assert "fc1: 1 group(s) per step of 100.0 MB each" in probe.notice and "7.7% of the 26.0 ms step" in probe.notice


def test_probe_skips_iterations_captured_and_those_after_a_reset(fresh_notices):
    probe, done, _ = measured(iterations=9, capture_in=(2,), abort_in=(4,))
    assert done == [False] * 6 + [True] * 3  # 2 captured, 4 aborted
    assert "measured in iterations 3, 5, 6;" in probe.notice


def test_probe_skips_iterations_in_which_no_group_closed(fresh_notices):
    """Steps run under `offload.suspended` (``examples/megatron_gpt.py --alternate-baseline``
    alternates them with offloading steps) have nothing to measure: averaged in, they would
    hide the waits of the others."""
    probe, done, _ = measured(iterations=9, suspended_in=(2, 4, 6))
    assert done == [False] * 7 + [True] * 2
    assert "measured in iterations 3, 5, 7;" in probe.notice and "of the 26.0 ms step" in probe.notice


def test_probe_does_not_record_while_the_stream_captures():
    streams = FakeStreams()
    probe = CopyWaitProbe(streams)
    run_probe(probe, streams, 2)
    streams.capturing = True
    made = streams.events
    probe.note_close(SimpleNamespace(capture=None, stream="compute", handler=object(), name="fc1", layer=0))
    assert not probe.end_iteration(IterationStats(iteration=2))  # no event at the end either
    assert streams.events == made and not probe.recording


def test_probe_counts_no_wait_and_says_nothing_under_two_percent(fresh_notices):
    probe, done, said = measured(iterations=6, wait_ms=0.1)
    assert done == [False] * 4 + [True, True] and probe.notice is None and said == []
    assert probe.figures[0].layer_ms == 4.0


def test_probe_gives_up_when_no_iteration_can_be_measured():
    probe, done, _ = measured(iterations=GIVE_UP, capture_in=range(GIVE_UP))
    assert done == [False] * (GIVE_UP - 1) + [True] and probe.figures == [] and probe.notice is None


def test_a_probe_runs_where_copies_can_be_timed_and_names_configured(configure):
    assert configure(["fc1"]).stats.probe is None  # the CPU fallback times nothing
    cuda = FakeStreams()
    for timing in (False, True):  # timing=False still times the probe's iterations
        stats = StatsRecorder.for_engine(cuda, OffloadConfig(modules="fc1", max_inflight_groups=3, timing=timing))
        probe = stats.probe
        assert isinstance(probe, CopyWaitProbe) and probe.max_inflight_groups == 3 and probe.streams is cuda
        assert stats.always_timed is timing
    assert StatsRecorder.for_engine(cuda, OffloadConfig(modules=())).probe is None


def test_copies_are_timed_in_the_probes_iterations_or_always_with_timing(configure):
    """Without ``timing``, the engine times its copies and waits only while the copy-wait probe
    records (iterations 2 to 4), then no more; with it, every iteration."""
    cuda = FakeStreams()
    for timing, expected in ((False, [False, False, True, True, True, False, False]), (True, [True] * 7)):
        stats = StatsRecorder.for_engine(cuda, OffloadConfig(modules="fc1", timing=timing))
        seen, handler = [], object()
        for _ in range(7):
            seen.append(stats.timing)
            if stats.probe is not None and stats.probe.recording:  # a group closed (else: not measured)
                stats.probe.note_close(SimpleNamespace(capture=None, stream="compute", handler=handler, name="fc1",
                                                       layer=0))
            stats.collect(len(seen) - 1, PinnedHostPool(pin=False))
            cuda.now += 10.0
        assert seen == expected, timing


# ---------------------------------------------------------------------------- end to end, simulated GPU time
class SimulatedGpu:
    """The CPU fallback's streams on a GPU's timeline: each stream has a clock (ms); a copy adds
    its bytes over ``bytes_per_ms`` to its stream's clock, a wait moves the waiting stream's
    clock up to the event's, an event takes its stream's clock when recorded, and the test adds
    compute (`compute`). Every event can be timed, and the engine times its copies."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, bytes_per_ms: float) -> None:
        clock = self.clock = {"compute": 0.0, "d2h": 0.0, "h2d": 0.0}

        class TimedEvent(_HostEvent):
            __slots__ = ("t",)

            def record(self, stream: _HostStream) -> None:
                _HostEvent.record(self, stream)
                self.t = clock[stream.name]

            def elapsed_time(self, end: "TimedEvent") -> float:
                return end.t - self.t

        make_event, copy = HostStreams.event, HostStreams.copy
        wait_event, wait_stream = _HostStream.wait_event, _HostStream.wait_stream

        def event(streams: HostStreams, timing: bool = False) -> TimedEvent:
            make_event(streams, timing)  # the fallback's checks and its clock of copies
            return TimedEvent(streams)

        def timed_copy(streams: HostStreams, stream: _HostStream, jobs: list, chunk_bytes: int) -> None:
            clock[stream.name] += sum(job[0].nbytes for job in jobs) / bytes_per_ms
            copy(streams, stream, jobs, chunk_bytes)

        def timed_wait_event(stream: _HostStream, event: TimedEvent) -> None:
            if event.stream is not None:
                clock[stream.name] = max(clock[stream.name], event.t)
            wait_event(stream, event)

        def timed_wait_stream(stream: _HostStream, other: _HostStream) -> None:
            clock[stream.name] = max(clock[stream.name], clock[other.name])
            wait_stream(stream, other)

        monkeypatch.setattr(HostStreams, "event", event)
        monkeypatch.setattr(HostStreams, "copy", timed_copy)
        monkeypatch.setattr(_HostStream, "wait_event", timed_wait_event)
        monkeypatch.setattr(_HostStream, "wait_stream", timed_wait_stream)

    def compute(self, ms: float) -> None:
        self.clock["compute"] += ms

    def time_layers(self, model: torch.nn.Module, forward_ms: float) -> None:
        """Each layer of ``model`` computes ``forward_ms`` in forward and twice that in backward."""
        def backward(module: torch.nn.Module, args: tuple, out: torch.Tensor) -> None:
            if out.requires_grad:
                out.register_hook(lambda grad: self.compute(2 * forward_ms))

        for layer in model.layers:
            layer.register_forward_pre_hook(lambda module, args: self.compute(forward_ms))
            layer.register_forward_hook(backward)


class CountedStreams:
    """``streams``, counting the events made through it (the probe's own)."""

    def __init__(self, streams: HostStreams) -> None:
        self.streams = streams
        self.events = 0

    def event(self, timing: bool = False) -> _HostEvent:
        self.events += 1
        return self.streams.event(timing)

    def __getattr__(self, name: str) -> object:
        return getattr(self.streams, name)


def engine_on_simulated_gpu(configure, monkeypatch, bytes_per_ms: float, names: list[str]):
    """An engine on the CPU fallback timed by a `SimulatedGpu`, a 4-layer model whose layers
    compute 10 ms each in forward, and the engine's copy-wait probe (its events counted)."""
    monkeypatch.setattr(notices, "_said", set())
    gpu = SimulatedGpu(monkeypatch, bytes_per_ms)
    manager = configure(names)
    manager.stats.always_timed = True  # the fallback times nothing; the simulated clocks can
    probe = manager.stats.probe = CopyWaitProbe(CountedStreams(manager.streams), manager.config.max_inflight_groups)
    model = build_gpt(32, 4, 4)
    offload.attach(model, GPT_MAPPING)
    gpu.time_layers(model, 10.0)
    return gpu, manager, probe, model


def test_engine_says_once_with_the_simulated_figures(configure, monkeypatch):
    """Copies at 600 bytes/ms: qkv_linear's and fc1's 2 kB groups take 3.41 ms each,
    mlp_act's 8 kB 13.65 ms, against 10 ms of forward compute per layer."""
    gpu, manager, probe, model = engine_on_simulated_gpu(configure, monkeypatch, 600.0,
                                                         ["qkv_linear", "fc1", "mlp_act"])
    x, g = torch.randn(8, 2, 32), torch.randn(8, 2, 32)
    ends, events, notes, closed = [], [], [], []
    for it in range(8):
        before = probe.streams.events
        train_step(model, x, g)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            stats = offload.end_iteration()
        ends.append(gpu.clock["compute"])
        events.append(probe.streams.events - before)
        closed.append(stats.total().groups)
        notes.append([str(w.message) for w in said if "copies made the compute stream wait" in str(w.message)])
        assert (manager.stats.probe is None) == (it >= 4), it  # decided at iteration 4's end
    assert [len(n) for n in notes] == [0, 0, 0, 0, 1, 0, 0, 0]
    note = notes[4][0]
    step = (ends[4] - ends[1]) / 3
    assert probe.step_ms == pytest.approx(step)
    by_name = {f.name: f for f in probe.figures}
    assert sorted(by_name) == ["fc1", "mlp_act", "qkv_linear"]
    for name, f in by_name.items():
        assert f.groups == 3 and f.layer_ms == pytest.approx(10.0), name  # 4 layers, the last kept
        assert f.d2h_ms == pytest.approx(f.bytes_per_group / 600.0), name
    assert by_name["mlp_act"].bytes_per_group == 4 * by_name["fc1"].bytes_per_group
    waited = sum(f.wait_ms for f in probe.figures)
    assert waited > 0.02 * step
    assert note.startswith(f"offload: copies made the compute stream wait {waited:.1f} ms per step, "
                           f"{100 * waited / step:.1f}% of the {step:.1f} ms step (over 2%; measured in "
                           "iterations 2, 3, 4;")
    assert "  mlp_act: 3 group(s) per step of 8.2 kB each" in note
    assert "against 10.00 ms of forward compute per layer (the copy out needs 137% of it)" in note
    assert 'qkv_linear, fc1 fit (68%, 12.3 kB per step instead of 36.9 kB): ' \
           'offload.configure(modules="qkv_linear,fc1")' in note
    # The probe's events: the first step's start, then one per group closed and the step's end.
    assert events == [0, 1, closed[2] + 1, closed[3] + 1, closed[4] + 1, 0, 0, 0] and closed[2] == 12


def test_engine_times_the_waits_at_the_forwards_end_apart(configure, monkeypatch):
    """mlp_act alone at 600 bytes/ms: its 13.65 ms copies against 10 ms layers. From the second
    iteration on (the forward's last group known) the compute stream waits only at the forward's
    end, for the second-to-last layer's copy: all of ``offload_wait_ms`` is ``flush_wait_ms``,
    and the notice says so."""
    gpu, manager, probe, model = engine_on_simulated_gpu(configure, monkeypatch, 600.0, ["mlp_act"])
    x, g = torch.randn(8, 2, 32), torch.randn(8, 2, 32)
    waits, said_all = [], []
    for _ in range(6):
        train_step(model, x, g)
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            s = offload.end_iteration().by_name["mlp_act"]
        waits.append((s.offload_wait_ms, s.flush_wait_ms))
        said_all += [str(w.message) for w in said if "copies made the compute stream wait" in str(w.message)]
    assert all(out > 0 and flush == pytest.approx(out) for out, flush in waits[1:]), waits
    assert len(said_all) == 1
    out = waits[2][0]
    assert f"waits per step: {out:.1f} ms for copies out ({out:.1f} of them at the forward's end)" in said_all[0]


def test_engine_says_nothing_when_copies_hide_under_compute(configure, monkeypatch):
    gpu, manager, probe, model = engine_on_simulated_gpu(configure, monkeypatch, 1e6,
                                                         ["qkv_linear", "fc1", "mlp_act"])
    x, g = torch.randn(8, 2, 32), torch.randn(8, 2, 32)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(6):
            train_step(model, x, g)
            offload.end_iteration()
    assert [w for w in said if "copies made the compute stream wait" in str(w.message)] == []
    assert manager.stats.probe is None and probe.notice is None
    assert sum(f.wait_ms for f in probe.figures) < 0.02 * probe.step_ms
    assert [f.layer_ms for f in probe.figures] == pytest.approx([10.0] * 3)


def test_engine_reset_moves_the_measured_iterations(configure, monkeypatch):
    gpu, manager, probe, model = engine_on_simulated_gpu(configure, monkeypatch, 600.0,
                                                         ["qkv_linear", "fc1", "mlp_act"])
    x, g = torch.randn(8, 2, 32), torch.randn(8, 2, 32)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for it in range(7):
            if it == 2:  # an aborted step: its forward, then reset() (iteration 2 ends with the next step)
                model(x.requires_grad_(False))
                offload.reset()
            train_step(model, x, g)
            offload.end_iteration()
    assert "measured in iterations 3, 4, 5;" in probe.notice
