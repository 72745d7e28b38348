"""Captured-mode logic on the CPU fallback, with a stand-in for "the stream is capturing".

The real captures run in tests/test_cuda_graphs.py on the GPU; here the engine is told that a
capture is in progress (``is_capturing`` returns True) so that the decisions it takes then
(copies carried to the next graph, reloads at a backward graph's start, plans, joins,
graph-owned buffers, errors) are checked on every machine.
"""

from __future__ import annotations

import copy

import pytest
import torch

import offload
from conftest import seeded_pair
from offload import OffloadError
from offload.group import GroupState, TensorRecord
from offload.testing import GPT_MAPPING, build_gpt, first_difference

NAMES = ["core_attn", "fc1", "mlp_act"]


class Graph:
    """Stands for a `torch.cuda.CUDAGraph` being captured into."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"Graph({self.name})"


def _capturing(manager, token):
    manager.streams.is_capturing = lambda: token is not None


def _step(layer, x, g, key=None):
    """Forward in region ``key`` (if any), then backward; returns output and all gradients."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    if key is None:
        out = layer(x)
    else:
        with offload.graphs.region(key):
            out = layer(x)
    out.backward(g)
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    grads["<input>"] = x.grad.clone()
    return out.detach(), grads


@pytest.fixture
def setup(configure):
    model = build_gpt(32, 4, 2)
    ref = copy.deepcopy(model)
    manager = configure(NAMES)
    offload.attach(model, GPT_MAPPING)
    return model.layers[0], ref.layers[0], manager


@pytest.fixture
def stack(configure):
    """Three layers, each its own graphed callable (``offload.graphs`` regions with edges),
    and an untouched copy of them."""
    model = build_gpt(32, 4, 3)
    ref = copy.deepcopy(model)
    manager = configure(NAMES)
    offload.attach(model, GPT_MAPPING)
    regions = [offload.graphs._as_region(layer, ("L", i)) for i, layer in enumerate(model.layers)]
    return model, ref, regions, manager


def _stack_step(model, fns, x, g, capture=None):
    """Forward through ``fns`` then backward; with ``capture`` (a manager), each forward and
    the backward is "captured" into a graph of its own, in the order torch's
    make_graphed_callables captures them. Returns output and gradients."""
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_(True)
    h = x
    for i, fn in enumerate(fns):
        if capture is not None:
            _capturing(capture, Graph(f"fwd{i}"))
        h = fn(h)
    if capture is not None:
        _capturing(capture, Graph("bwd"))
    h.backward(g)
    if capture is not None:
        _capturing(capture, None)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    grads["<input>"] = x.grad.clone()
    return h.detach(), grads


def test_captured_regions_carry_their_last_groups_to_the_next_graph(stack):
    """Note [C1]: a region's capture hands its last groups to the next capture. The next
    forward region copies them at its start and frees them at its end; the backward that
    follows the last region keeps that region's on the GPU. Buffers come from the warm-up's
    and stay the graphs' until `release_graphs`; gradients are exact."""
    model, ref, regions, manager = stack
    x, g = seeded_pair(0, 8, 2, 32)
    _stack_step(model, regions, x, g)  # eager warm-up: the plans
    offload.end_iteration()
    allocations = manager.pool.allocations
    model.zero_grad(set_to_none=True)
    xc = x.detach().requires_grad_(True)
    _capturing(manager, Graph("fwd0"))
    h = regions[0](xc)
    (first,) = [hd for hd in manager.captures._graph_handlers]
    assert [grp.state for grp in first.groups] == [GroupState.PENDING] * len(NAMES), "carried, not copied"
    assert not manager.copies.inflight
    _capturing(manager, Graph("fwd1"))
    h = regions[1](h)
    assert all(grp.state is GroupState.OFFLOADED for grp in first.groups), "copied and freed by the next graph"
    _capturing(manager, Graph("fwd2"))
    h = regions[2](h)
    *_, second, third = manager.captures._graph_handlers
    assert all(grp.state is GroupState.OFFLOADED for grp in second.groups)
    assert all(grp.state is GroupState.PENDING for grp in third.groups)
    _capturing(manager, Graph("bwd"))
    h.backward(g)
    _capturing(manager, None)
    assert all(grp.state is GroupState.KEPT for grp in third.groups), "its own backward came next"
    assert manager.pool.allocations == allocations, "a capture takes its buffers from the warm-up's"
    ref_out, ref_grads = _stack_step(ref, list(ref.layers), x, g)
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    got["<input>"] = xc.grad
    assert torch.equal(h.detach(), ref_out)
    assert first_difference(ref_grads, got) is None

    stats = offload.end_iteration()
    assert stats.by_name["core_attn"].groups_kept == 1
    assert stats.by_name["core_attn"].reloads_prefetched == 2, "each region's backward reloads at its start"
    assert stats.by_name["core_attn"].reloads_on_demand == 0
    buffers = {id(rec.host) for grp in manager.captured_groups for rec in grp.records if rec.host is not None}
    assert buffers, "the graphs keep their pinned buffers after their backward"
    summary = manager.captures.captured_summary()
    assert set(summary) == set(NAMES)
    for name, entry in summary.items():  # three regions; the third region's groups stayed (KEPT)
        copied = [g for g in manager.captured_groups if g.name == name and g.state is GroupState.OFFLOADED]
        assert (entry["groups"], entry["groups_copied"]) == (3, 2) and len(copied) == 2, (name, entry)
        assert entry["bytes_copied"] == stats.by_name[name].bytes_offloaded > 0, name  # the capturing step's
    _stack_step(model, regions, *seeded_pair(1, 8, 2, 32))  # an eager step after the capture cannot take them
    offload.end_iteration()
    assert buffers == {id(rec.host) for grp in manager.captured_groups for rec in grp.records if rec.host is not None}
    assert manager.pool.allocations > allocations
    manager.captures.release_graphs()
    assert manager.captured_groups == []
    assert manager.pool.bytes_in_use == 0


def test_carried_groups_are_kept_when_eager_code_follows(stack):
    """A region captured alone, then eager code: what it carried stays on the GPU, in the
    graph's pool (no copy of a graph's memory is issued outside the graph)."""
    model, _, regions, manager = stack
    x, g = seeded_pair(0, 8, 2, 32)
    _stack_step(model, regions, x, g)
    offload.end_iteration()
    _capturing(manager, Graph("fwd0"))
    out = regions[0](x.detach().requires_grad_(True))
    _capturing(manager, None)
    (handler,) = manager.captures._graph_handlers
    offload.end_iteration()
    assert all(grp.state is GroupState.KEPT for grp in handler.groups)
    assert not manager.copies.inflight and not manager.copies.deferred
    del out
    offload.reset(release_pool=True)


def _warm_up_reported(stack):
    """The stack's eager warm-up (its plans), then its regions' replays reported as
    `offload.graphs.make_graphed_callables` reports them; returns the input and the keys."""
    model, _, regions, manager = stack
    x, _ = seeded_pair(0, 8, 2, 32)
    _stack_step(model, regions, x, torch.ones_like(x))
    offload.end_iteration()
    keys = [("L", i) for i in range(len(regions))]
    manager.captures.prepare_replays(keys)
    return x, keys


def test_carried_groups_go_to_the_replays_of_the_graph_that_saved_them(stack):
    """Note [C3]: where the graphs' replays are reported (`prepare_replays`), the next forward
    capture hands a region's carried groups to that region's `ReplayCopies` instead of copying
    them itself (nothing is queued on the D2H stream while it is captured), and its end still
    frees them, after a wait on the copies' event; the last region's stay kept."""
    model, _, regions, manager = stack
    x, keys = _warm_up_reported(stack)
    queued = manager.streams.d2h.issued
    waited = []
    h = x.detach().requires_grad_(True)
    for i, region in enumerate(regions):
        _capturing(manager, Graph(f"fwd{i}"))
        if i == 2:
            wait = manager.copies.wait
            manager.copies.wait = lambda stream, event, *rest: (waited.append(event), wait(stream, event, *rest))
        h = region(h)
    first, second, third = manager.captures._graph_handlers
    assert manager.streams.d2h.issued == queued, "no copy issued inside the captures"
    for handler, key in ((first, keys[0]), (second, keys[1])):
        assert all(grp.state is GroupState.OFFLOADED for grp in handler.groups)
        assert manager.captures.replays[key].groups == handler.groups
    assert manager.captures.replays[keys[1]].done in waited, "the next graph waits for the copies at its end"
    assert all(grp.state is GroupState.PENDING for grp in third.groups)
    _capturing(manager, None)
    offload.end_iteration()  # eager code follows the last graph
    assert all(grp.state is GroupState.KEPT for grp in third.groups)
    assert manager.captures.replays[keys[2]].groups == []
    del h
    offload.reset(release_pool=True)
    assert manager.captures.replays == {}, "released with the graphs"


def test_reloads_go_to_the_backward_replays_of_the_graph_before(stack):
    """Note [C4]: a backward capture that begins right after the backward capture of a region
    whose replays are reported allocates its reload buffers but hands their copies to that
    region's `ReplayCopies` for backward (nothing is queued on the H2D stream in the capture),
    last closed group first; the first backward capture reloads in its own graph (Note [C2])."""
    model, _, regions, manager = stack
    x, keys = _warm_up_reported(stack)
    h = x.detach().requires_grad_(True)
    for i, region in enumerate(regions):
        _capturing(manager, Graph(f"fwd{i}"))
        h = region(h)
    first, second, third = manager.captures._graph_handlers
    _capturing(manager, Graph("bwd"))  # the regions' backward captures, last region first
    queued = manager.streams.h2d.issued
    h.backward(torch.ones_like(h))
    _capturing(manager, None)
    backward = manager.captures.backward_replays
    assert backward[keys[2]].groups == list(reversed(second.groups)), "region 1's reloads, fc2 first"
    assert backward[keys[1]].groups == list(reversed(first.groups))
    assert backward[keys[0]].groups == []
    assert all(rec.dev is None for grp in first.groups + second.groups for rec in grp.records), \
        "the buffers were allocated, used and given back inside the capture"
    assert manager.streams.h2d.issued == queued, "no reload issued inside the captures"
    stats = offload.end_iteration()
    assert stats.by_name["core_attn"].reloads_prefetched == 2
    offload.reset(release_pool=True)
    assert manager.captures.backward_replays == {}


def test_a_backward_graph_whose_groups_copied_nothing_waits_on_no_replay(stack, monkeypatch):
    """Note [C4]: groups captured while something else held everything they saved are
    OFFLOADED with nothing on the host, so a backward capture after the one of the region
    before reloads nothing, and its graph waits on no replay: registered as waiting, its
    replay would be refused as out of order although every graph replays in capture order (the
    GPU failure of Megatron's attention-only graphs of an MoE layer with ``attn_norm``)."""
    model, ref, regions, manager = stack
    x, keys = _warm_up_reported(stack)
    monkeypatch.setattr(TensorRecord, "copy_frees_memory", lambda rec, aliases: False)
    h = x.detach().requires_grad_(True)
    for i, region in enumerate(regions):
        _capturing(manager, Graph(f"fwd{i}"))
        h = region(h)
    _capturing(manager, Graph("bwd"))
    h.backward(torch.ones_like(h))
    _capturing(manager, None)
    first, second, _ = manager.captures._graph_handlers
    assert all(grp.state is GroupState.OFFLOADED for grp in first.groups + second.groups)
    assert all(rec.host is None for grp in first.groups + second.groups for rec in grp.records)
    assert all(replay.groups == [] for replay in manager.captures.backward_replays.values())
    assert manager.captures.reloaded_by == {}, "no backward graph waits on a replay that issues nothing"
    stats = offload.end_iteration()
    assert stats.by_name["core_attn"].bytes_offloaded == 0 and stats.by_name["core_attn"].bytes_held_elsewhere > 0
    offload.reset(release_pool=True)


def test_a_backward_graph_that_reloads_nothing_waits_on_no_replay(stack):
    """Note [C4] in a pipeline order (TE's ``_order``): chain A's forward (regions 0, 1), chain
    B's forward (region 2), A's backward, then B's. Region 2's groups are kept (a backward
    capture followed its forward, Note [C1]), so its backward capture, though it follows
    region 0's, reloads nothing and waits on no replay: were it registered as waiting on
    region 0's backward replay, which then has nothing to copy and never counts an issue,
    its replay would be refused as out of order (the GPU failure of
    tests/test_te.py::test_graphed_layers_bitwise_equal_eager[vpp_1f1b-*])."""
    model, ref, regions, manager = stack
    x, keys = _warm_up_reported(stack)
    xa, xb = x.detach().requires_grad_(True), x.detach().clone().requires_grad_(True)
    _capturing(manager, Graph("fwd0"))
    a = regions[0](xa)
    _capturing(manager, Graph("fwd1"))
    a = regions[1](a)
    _capturing(manager, Graph("fwd2"))
    b = regions[2](xb)
    _capturing(manager, Graph("bwdA"))
    a.backward(torch.ones_like(a))
    _capturing(manager, Graph("bwdB"))
    b.backward(torch.ones_like(b))
    _capturing(manager, None)
    first, second, third = manager.captures._graph_handlers
    assert all(grp.state is GroupState.KEPT for grp in third.groups)
    reloaded_by = manager.captures.reloaded_by
    assert reloaded_by[keys[0]] is manager.captures.backward_replays[keys[1]]
    assert reloaded_by[keys[0]].groups == list(reversed(first.groups))
    assert keys[2] not in reloaded_by, "region 2's backward graph waits on no reload"
    assert manager.captures.backward_replays[keys[0]].groups == []
    offload.end_iteration()
    offload.reset(release_pool=True)


def test_replay_copies_copy_after_the_replay_and_record_their_event(configure):
    """`ReplayCopies.issue`: the D2H stream waits for what ran before, copies each span into
    its pinned buffer (late, on the CPU fallback: only once waited for) and records ``done``."""
    manager = configure(["core_attn"])
    streams = manager.streams
    replay = offload.capture.ReplayCopies(streams, to_host=True)
    source = torch.arange(64, dtype=torch.float32)

    class Record:  # the fields ReplayCopies reads from a TensorRecord
        host = manager.pool.acquire(64 * 4, False)
        ptr, start, end, itemsize, nbytes = source.data_ptr(), 16, 48, 4, 32 * 4

        @staticmethod
        def rows():
            return None

    class Group:
        label = "core_attn/L0/mb1"

    replay.add(Group, [Record])
    replay.issue(streams, chunk_bytes=0)
    copied = Record.host.tensor[:Record.nbytes].view(torch.float32)
    assert not replay.done.query() and not torch.equal(copied, source[16:48]), "the copy runs late"
    streams.current().wait_event(replay.done)
    assert torch.equal(copied, source[16:48])
    replay.clear()
    queued = streams.d2h.issued
    replay.issue(streams, chunk_bytes=0)
    assert streams.d2h.issued == queued, "nothing to copy: nothing issued"
    manager.pool.release(Record.host)


def test_replays_are_reported_only_when_the_graph_replayed(setup, monkeypatch):
    """The callables `make_graphed_callables` returns report a call as a replay unless it ran
    the region eagerly (the API's fallback, e.g. in another training mode); a module keeps the
    API's forward behind the report, a function the API's attributes (TE's ``reset``)."""
    layer, _, manager = setup
    reported = []
    monkeypatch.setattr(manager.captures, "after_replay", reported.append)
    region = offload.graphs._as_region(layer, "R")
    x = torch.randn(8, 2, 32)

    def graphed(h):  # stands for a replay: no region is entered
        return h * 2

    graphed.reset = "TE's attribute"
    fn = offload.graphs._reporting_replays(graphed, "R")
    assert torch.equal(fn(x), x * 2) and reported == ["R"] and fn.reset == "TE's attribute"
    fallback = offload.graphs._reporting_replays(lambda h: region(h), "R")
    fallback(x.requires_grad_(True))
    assert reported == ["R"], "an eager run of the region is not a replay"
    module = torch.nn.Linear(32, 32)
    module.forward = graphed
    assert offload.graphs._reporting_replays(module, "M") is module
    module(x)
    assert reported == ["R", "M"]
    manager.end_iteration(check_names=False)  # one layer: its groups were the last of their names


def test_te_order_read_as_forward_passes():
    """TE's ``_order`` for two model chunks of two layers and two microbatches: the callable
    of each forward pass in ``sample_args`` order (chunk, then microbatch, then layer)."""
    passes = offload.graphs._forward_passes
    assert passes([1, 2, -2, 1, -1, 2, -2, -1], 4, 8) == ([0, 1, 0, 1, 2, 3, 2, 3], 2)
    assert passes([1, 2, -2, 1, -1, 2, -2, -1], 3, 6, [1, 2]) == ([0, 0, 1, 2, 1, 2], 2)
    assert passes([1, -1, 1, -1, 1, -1], 2, 6) == ([0, 1, 0, 1, 0, 1], 3)
    assert passes([1, 1, -1, -0.5, -1, -0.5], 1, 2) == ([0, 0], 2), "wgrad entries are not passes"
    with pytest.raises(OffloadError, match="need 8 sample_args tuples"):
        passes([1, 2, -2, 1, -1, 2, -2, -1], 4, 6)
    with pytest.raises(OffloadError, match=r"chunks of \[1, 1\] layers"):
        passes([1, 2, -2, -1], 3, 3, [1, 1])
    with pytest.raises(OffloadError, match="not a forward and a backward"):
        passes([1, 2, -2], 2, 2)


def test_region_module_takes_its_keys_in_turn(setup):
    """Under TE's ``_order`` one callable runs once per microbatch: each run is a region of its
    own (its own plan, hence its own graph's buffers), taken in turn."""
    layer, _, manager = setup
    region = offload.graphs._as_region(layer, "L", passes=2)
    for seed in range(3):
        _step(region, *seeded_pair(seed, 8, 2, 32))
        offload.end_iteration()
    assert sorted(manager.captures.plans) == [("L", 0), ("L", 1)]
    assert manager.captures.plans[("L", 0)] == manager.captures.plans[("L", 1)]


class _Scaled(torch.nn.Module):
    """A layer that takes a keyword argument, as Megatron's layers take ``attention_mask``."""

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, *, scale: torch.Tensor) -> torch.Tensor:
        return self.layer(x) * scale


def test_region_passes_keyword_arguments_and_their_gradients(setup):
    """A graphed callable's keyword arguments (TE's ``sample_kwargs``) reach the callable, and
    a keyword tensor that needs a gradient gets the same one as without the region."""
    layer, ref, manager = setup
    region = offload.graphs._as_region(_Scaled(layer), "K")
    plain = _Scaled(ref)
    for seed in range(2):
        x, g = seeded_pair(seed, 8, 2, 32)
        results = []
        for fn in (region, plain):
            fn_x = x.detach().requires_grad_(True)
            scale = torch.full((32,), 0.5 + seed, requires_grad=True)
            fn(fn_x, scale=scale).backward(g)
            results.append((fn_x.grad, scale.grad))
        offload.end_iteration()
        assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert list(manager.captures.plans) == ["K"] and manager.captures.plans["K"]


def test_a_suspended_engine_opens_no_group_and_its_regions_plan_nothing(setup):
    """While a graph API runs its own warm-up after ours (``manager.suspended``), the regions
    run their callables as they are: no group opens, no plan is recorded or overwritten, the
    gradients are the plain ones."""
    layer, ref, manager = setup
    region = offload.graphs._as_region(layer, "S")
    x, g = seeded_pair(0, 8, 2, 32)
    manager.suspended += 1
    try:
        out, grads = _step(region, x, g)
    finally:
        manager.suspended -= 1
    stats = manager.end_iteration(check_names=False)
    assert "S" not in manager.captures.plans and not stats.by_name
    ref_out, ref_grads = _step(ref, x, g)
    grads = {n.removeprefix("module."): t for n, t in grads.items()}
    assert torch.equal(out, ref_out) and grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
    _step(region, x, g)  # and resumed, the region plans again
    offload.end_iteration()
    assert manager.captures.plans["S"]


def test_sample_kwargs_must_be_one_dict_per_sample(setup):
    layer, _, _ = setup
    x = torch.randn(8, 2, 32)
    with pytest.raises(OffloadError, match=r"sample_kwargs must be one dict per sample_args tuple \(2\)"):
        offload.graphs.make_graphed_callables([layer, layer], [(x,), (x,)], sample_kwargs=[{}])
    with pytest.raises(OffloadError, match="sample_kwargs must be one dict per sample_args tuple"):
        offload.graphs.make_graphed_callables([layer], [(x,)], sample_kwargs=[None])


def test_changed_shape_under_capture_raises(setup):
    layer, _, manager = setup
    _step(layer, *seeded_pair(0, 8, 2, 32), key="L0")
    offload.end_iteration()
    _capturing(manager, Graph("fwd"))
    x, _ = seeded_pair(0, 16, 2, 32)
    with pytest.raises(OffloadError, match="changed after the plan was frozen"):
        with offload.graphs.region("L0"):
            layer(x.requires_grad_(True))
    _capturing(manager, None)
    offload.reset()


def test_changed_group_structure_under_capture_raises(setup):
    layer, _, manager = setup
    x, g = seeded_pair(0, 8, 2, 32)
    _step(layer, x, g, key="L0")
    offload.end_iteration()
    _capturing(manager, Graph("fwd"))
    with pytest.raises(OffloadError, match="1 group.s. under capture, but 3"):
        with offload.graphs.region("L0"):
            layer.self_attention(x.clone().requires_grad_(True))
    _capturing(manager, None)
    offload.reset()


def test_capture_of_a_region_that_never_ran_eagerly_raises(setup):
    layer, _, manager = setup
    _capturing(manager, Graph("fwd"))
    with pytest.raises(OffloadError, match="never ran eagerly"):
        with offload.graphs.region("new"):
            pass
    _capturing(manager, None)


def test_capture_ended_without_join_is_reported(setup):
    layer, _, manager = setup
    x, g = seeded_pair(0, 8, 2, 32)
    _step(layer, x, g, key="L0")
    offload.end_iteration()
    _capturing(manager, Graph("fwd"))
    layer(x.clone().requires_grad_(True))  # no region, no join: copies stay forked
    _capturing(manager, None)
    with pytest.raises(OffloadError, match="not joined into it"):
        _step(layer, x, g)
    offload.reset()


def test_capture_starts_clean_from_an_eager_forward(setup):
    """An eager forward whose last groups are still undecided when a capture begins keeps
    them on the GPU (their copy cannot start inside the capture); its gradients stay exact."""
    layer, ref_layer, manager = setup
    x, g = seeded_pair(0, 8, 2, 32)
    _step(layer, x, g, key="L0")
    offload.end_iteration()
    xe = x.detach().requires_grad_(True)
    eager_out = layer(xe)
    eager_handler = manager.chunks.forward
    _capturing(manager, Graph("fwd"))
    with offload.graphs.region("L0"):
        layer(x.detach().requires_grad_(True))
    _capturing(manager, None)
    assert all(grp.state is not GroupState.PENDING for grp in eager_handler.groups)
    assert eager_handler.groups[-1].state is GroupState.KEPT
    layer.zero_grad(set_to_none=True)
    eager_out.backward(g)
    _, ref = _step(ref_layer, x, g)
    got = {n: p.grad for n, p in layer.named_parameters()}
    got["<input>"] = xe.grad
    assert first_difference(ref, got) is None
    offload.reset(release_pool=True)


def test_no_prefetch_across_graphs_without_edges(setup):
    """Two layers captured into two forward graphs by bare regions (no graphed-callable edges):
    the backward of the second does not prefetch the first's tensors (a reload issued in one
    graph would have to be joined there), and the first's groups were copied by the second."""
    layer, _, manager = setup
    other = build_gpt(32, 4, 2).layers[1]
    offload.attach(torch.nn.ModuleList([other]), {"core_attn": "0.self_attention.core_attention"})
    x, g = seeded_pair(0, 8, 2, 32)
    with offload.graphs.region("A"):  # warm-up in the capture order: both forwards, then backward
        h = layer(x.clone().requires_grad_(True))
    with offload.graphs.region("B"):
        out = other(h)
    out.backward(g)
    offload.end_iteration()
    fa, fb, bwd = Graph("fa"), Graph("fb"), Graph("bwd")
    xa = x.clone().requires_grad_(True)
    _capturing(manager, fa)
    with offload.graphs.region("A"):
        h = layer(xa)
    _capturing(manager, fb)
    with offload.graphs.region("B"):
        out = other(h)
    _capturing(manager, bwd)
    out.backward(g)
    offload.graphs.join()
    _capturing(manager, None)
    stats = offload.end_iteration()
    assert stats.by_name["core_attn"].groups_kept == 1  # B's, whose backward came next
    assert stats.by_name["core_attn"].reloads_prefetched == 0
    assert stats.by_name["core_attn"].reloads_on_demand == 1  # A's


def test_capture_takes_a_larger_free_buffer_rather_than_allocate():
    from offload.pinned_pool import PinnedHostPool

    pool = PinnedHostPool(pin=False)
    big = pool.acquire(1 << 20)
    pool.release(big)
    assert pool.acquire(1000, capturing=True) is big
    assert pool.allocations == 1


def test_hook_calls_are_counted(setup):
    layer, _, manager = setup
    before = manager.hook_calls
    _step(layer, *seeded_pair(0, 8, 2, 32))
    assert manager.hook_calls > before


def test_region_closed_out_of_order_raises(setup):
    _, _, manager = setup
    manager.captures.enter_region("a")
    with pytest.raises(OffloadError, match="out of order"):
        manager.captures.exit_region("b")
    offload.reset()


def test_torch_compile_stays_exact(configure):
    """Under torch.compile the attached modules' hooks do nothing (docs/compile.md): no group
    opens in compiled code and gradients are exact. tests/test_compile.py covers the backends."""
    model = build_gpt(32, 4, 2)
    ref = copy.deepcopy(model)
    configure(["fc1"])
    offload.attach(model, GPT_MAPPING)
    compiled = torch.compile(model, backend="eager")
    x, g = seeded_pair(0, 8, 2, 32)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    compiled(xa).backward(g)
    ref(xb).backward(g)
    stats = offload.end_iteration()
    assert "fc1" not in stats.by_name  # traced hooks open no group
    assert torch.equal(xa.grad, xb.grad)
    for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        assert torch.equal(p.grad, q.grad), n


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
@pytest.mark.parametrize("script", ["graph_pool_trace.py", "copy_fit.py"])
def test_graph_benchmarks_say_they_need_cuda(script, monkeypatch):
    """The CUDA-only graph benchmarks exit non-zero with a message, not a traceback, without CUDA:
    run as ``__main__`` in this process, they raise `SystemExit` with a string, which Python
    prints to stderr as it exits with status 1."""
    import runpy
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / script
    monkeypatch.setattr(sys, "argv", [str(path)])
    monkeypatch.setattr(sys, "path", [str(path.parent), *sys.path])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(path), run_name="__main__")
    assert isinstance(exit_.value.code, str) and "needs a CUDA device" in exit_.value.code


def test_the_hook_after_a_backward_replay_runs_once_per_replay():
    """`_after_backward` hooks the first input that needs a gradient and removes the hook when
    it runs: a leaf the caller keeps across steps gets one run per backward, not one per
    replay so far."""
    x = torch.ones(3, requires_grad=True)
    fired = []
    for step in range(3):
        offload.graphs._after_backward((x,), {}, "region", lambda _grad, step=step: fired.append(step))
        (x * 2).sum().backward()
    assert fired == [0, 1, 2]
    with pytest.raises(OffloadError, match="no input that needs a gradient"):
        offload.graphs._after_backward((torch.ones(3),), {"y": torch.ones(1)}, "region", fired.append)


def test_no_collection_during_capture_collects_first_and_keeps_the_collector_off():
    """What the capture wrappers run their captures in: garbage from before is collected (a dead
    CUDA graph must not be destroyed inside a capture), the cyclic collector stays off inside,
    and its state is restored after, on an error too."""
    import gc
    import weakref

    from offload.streams import no_collection_during_capture

    class Node:
        pass

    def dead_cycle():
        node = Node()
        node.self = node
        return weakref.ref(node)

    assert gc.isenabled()
    dead = dead_cycle()
    assert dead() is not None
    with no_collection_during_capture():
        assert dead() is None
        assert not gc.isenabled()
    assert gc.isenabled()
    dead = dead_cycle()
    with no_collection_during_capture(collect_first=False):
        assert dead() is not None
    gc.collect()
    with pytest.raises(ValueError):
        with no_collection_during_capture():
            raise ValueError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with no_collection_during_capture():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
