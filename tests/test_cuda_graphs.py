"""Offloading captured in CUDA graphs, on a real GPU (skipped without CUDA).

    OFFLOAD_RESULTS_DIR=$OUT python -m pytest -q -m cuda tests/test_cuda_graphs.py

Eager and graphed, each with offloading on and off, over fresh inputs: outputs and every
gradient bitwise equal. Graphs through ``torch.cuda.make_graphed_callables`` (all forwards,
then all backwards), through ``offload.graphs.graph`` in 1F1B order, and through Transformer
Engine's ``make_graphed_callables`` where TE is installed; partial capture (graphed attention,
eager MLP) and a capture broken around an eager operation; what the pinned buffers hold after
a replay; hook calls during replays; the graph pool's growth with depth; 1000 replays; slowed
copy streams; a dead graph that the collector would free inside a capture; and the errors for
what cannot work.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import weakref
from collections import Counter

import pytest
import torch
from torch import nn

import offload
from conftest import CUDA_ONLY, reproducible, slow_side_streams, with_gate_only_glu
from offload import OffloadError
from offload.capture import ReplayCopies
from offload.copy_queue import CopyQueue
from offload.group import GroupState
from offload.testing import GPT_MAPPING, build_gpt, cyclic_garbage, first_difference, graph_pool_bytes

pytestmark = [*CUDA_ONLY, pytest.mark.usefixtures("deterministic")]

NAMES = ["core_attn", "fc1", "mlp_act", "fc2"]
SEQ, BATCH, HIDDEN, HEADS = 256, 2, 256, 4


@pytest.fixture(autouse=True)
def _synchronize():
    yield
    torch.cuda.synchronize()


def _inputs(seed, microbatches=2, seq=SEQ):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [(torch.randn(seq, BATCH, HIDDEN, device="cuda", generator=g),
             torch.randn(seq, BATCH, HIDDEN, device="cuda", generator=g)) for _ in range(microbatches)]


def _model(layers=2, seed=0):
    return build_gpt(HIDDEN, HEADS, layers, device="cuda", seed=seed)


def _grads(model, inputs):
    out = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    for i, x in enumerate(inputs):
        out[f"<input{i}>"] = x.grad.detach().clone()
    return out


def _eager_step(model, data, order):
    """Forwards and backwards of the stack over microbatches in ``order`` (``+m`` forward of
    microbatch m, ``-m`` its backward; 1-based); returns outputs and gradients."""
    model.zero_grad(set_to_none=True)
    xs = [x.clone().requires_grad_(True) for x, _ in data]
    outs = {}
    for step in order:
        m = abs(step) - 1
        if step > 0:
            h = xs[m]
            for layer in model.layers:
                h = layer(h)
            outs[m] = h
        else:
            outs[m].backward(data[m][1])
    return [outs[m].detach() for m in range(len(data))], _grads(model, xs)


class Graphed:
    """Per (layer, microbatch) graphed callables from make_graphed_callables (torch or TE)."""

    def __init__(self, model, microbatches, graph_api=None, seq=SEQ):
        layers = list(model.layers)
        callables = tuple(layer for _ in range(microbatches) for layer in layers)
        sample = tuple((torch.randn(seq, BATCH, HIDDEN, device="cuda", requires_grad=True),)
                       for _ in callables)
        self.model = model
        self.layers = len(layers)
        self.fns = offload.graphs.make_graphed_callables(callables, sample, graph_api=graph_api)

    def step(self, data, order):
        self.model.zero_grad(set_to_none=True)
        xs = [x.clone().requires_grad_(True) for x, _ in data]
        outs = {}
        for step in order:
            m = abs(step) - 1
            if step > 0:
                h = xs[m]
                for i in range(self.layers):
                    h = self.fns[m * self.layers + i](h)
                outs[m] = h
            else:
                outs[m].backward(data[m][1])
        return [outs[m].detach() for m in range(len(data))], _grads(self.model, xs)


class OrderedGraphs:
    """The stack of each microbatch as one forward graph and one backward graph, captured with
    `offload.graphs.graph` in the order they will replay (1F1B here), sharing one pool."""

    def __init__(self, model, microbatches, order):
        self.model = model
        self.named = [(n, p) for n, p in model.named_parameters() if n.startswith("layers.")]
        self.params = tuple(p for _, p in self.named)
        self.static_x = [torch.randn(SEQ, BATCH, HIDDEN, device="cuda", requires_grad=True)
                         for _ in range(microbatches)]
        self.static_g = [torch.randn(SEQ, BATCH, HIDDEN, device="cuda") for _ in range(microbatches)]
        self.fwd = [torch.cuda.CUDAGraph() for _ in range(microbatches)]
        self.bwd = [torch.cuda.CUDAGraph() for _ in range(microbatches)]
        self.out: list = [None] * microbatches
        self.grads: list = [None] * microbatches
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # eager warm-up, in the capture order: the plans and buffers
            outs = {}
            for step in order:
                m = abs(step) - 1
                if step > 0:
                    with offload.graphs.region(("stack", m)):
                        outs[m] = self._forward(self.static_x[m])
                else:
                    torch.autograd.grad(outs[m], (self.static_x[m], *self.params), self.static_g[m])
            del outs
        torch.cuda.current_stream().wait_stream(side)
        offload.end_iteration()
        pool = torch.cuda.graph_pool_handle()
        for step in order:
            m = abs(step) - 1
            if step > 0:
                with offload.graphs.graph(self.fwd[m], key=("stack", m), pool=pool):
                    self.out[m] = self._forward(self.static_x[m])
            else:
                with torch.cuda.graph(self.bwd[m], pool=pool):
                    self.grads[m] = torch.autograd.grad(self.out[m], (self.static_x[m], *self.params),
                                                        self.static_g[m])
                    offload.graphs.join()
        self.order = order

    def _forward(self, h):
        for layer in self.model.layers:
            h = layer(h)
        return h

    def step(self, data, order):
        assert order == self.order
        total = None
        for step in order:
            m = abs(step) - 1
            if step > 0:
                self.static_x[m].detach().copy_(data[m][0])
                self.fwd[m].replay()
            else:
                self.static_g[m].copy_(data[m][1])
                self.bwd[m].replay()
                grads = [g.clone() for g in self.grads[m]]
                total = grads if total is None else [a + b for a, b in zip(total, grads)]
        got = dict(zip([n for n, _ in self.named], total[1:]))
        got.update({f"<input{m}>": self.grads[m][0].clone() for m in range(len(data))})
        return [self.out[m].detach().clone() for m in range(len(data))], got


def _reference(ref, data, order):
    """``ref``: a copy of the model taken before `offload.attach` (so it offloads nothing)."""
    return reproducible(lambda: _eager_step(ref, data, order))


def _chain(exc):
    """Every message in an exception's context chain (a failed capture raises on its way out)."""
    text = []
    while exc is not None:
        text.append(str(exc))
        exc = exc.__context__ or exc.__cause__
    return " | ".join(text)


def _assert_equal(got, ref):
    for o, r in zip(got[0], ref[0]):
        assert torch.equal(o, r)
    assert first_difference(ref[1], got[1]) is None


def _assert_captured(manager, per_name, kept=None):
    """The graphs hold ``per_name`` groups of each name in `NAMES`; ``kept`` of them (by name;
    default one of each) stay on the GPU: those the forward graph captured last before a
    backward had not copied yet (Note [C1] of offload.capture: its last group of each name,
    and the one before it for a name whose copy waits for a next group that never opened in
    that graph). Every other one copies bytes out to pinned buffers (what each forward replay
    writes and its backward reads)."""
    captured = manager.captured_groups
    assert Counter(g.name for g in captured) == {name: per_name for name in NAMES}
    held = [g for g in captured if g.state is GroupState.KEPT]
    assert Counter(g.name for g in held) == (kept or {name: 1 for name in NAMES})
    for g in captured:
        if g.state is not GroupState.KEPT:
            assert g.state is GroupState.OFFLOADED, g
            assert sum(rec.nbytes for rec in g.records if rec.host is not None) > 0, g.label


def _assert_copied_after_replays(manager):
    """Graphs of `make_graphed_callables` copy the groups carried out of them after their
    forward replays (Note [C3] of offload.capture), and the first reloads of a backward graph
    after the backward replay before it (Note [C4]): captured groups that were copied out."""
    captured = {id(g) for g in manager.captured_groups}
    for replays in (manager.captures.replays, manager.captures.backward_replays):
        groups = [g for replay in replays.values() for g in replay.groups]
        assert groups
        assert all(g.state is GroupState.OFFLOADED and id(g) in captured for g in groups)


# Graphs of two layers each: fc2 closes a layer last, so the graph's end finds the fc2 before
# the last one still waiting for its copy (Note [7] of offload.copy_queue) and carries it too.
KEPT_TWO_LAYER_GRAPH = {"core_attn": 1, "fc1": 1, "mlp_act": 1, "fc2": 2}


def _count_captured_launches(monkeypatch):
    """Count the offload and reload launches made while the stream is being captured."""
    launched = Counter()
    for kind in ("offload", "reload"):
        def counting(self, *args, _launch=getattr(CopyQueue, kind), _kind=kind, **kwargs):
            if torch.cuda.is_current_stream_capturing():
                launched[_kind] += 1
            return _launch(self, *args, **kwargs)

        monkeypatch.setattr(CopyQueue, kind, counting)
    return launched


ALL_FWD_THEN_BWD = [1, 2, -2, -1]
ONE_F_ONE_B = [1, 2, -1, -2]


@pytest.mark.parametrize("offloading", [False, True], ids=["plain", "offload"])
def test_make_graphed_callables_bitwise(configure, offloading):
    """Per (layer, microbatch) graphs from torch's make_graphed_callables, all forwards then all
    backwards: eager and graphed, with offloading on and off, equal bitwise on fresh inputs."""
    model = _model()
    ref_model = copy.deepcopy(model)
    manager = configure(NAMES if offloading else [], device="cuda", min_tensor_bytes=1 << 16)
    offload.attach(model, GPT_MAPPING)
    refs = [_reference(ref_model, _inputs(seed), ALL_FWD_THEN_BWD) for seed in range(3)]
    for seed in range(3):
        _assert_equal(_eager_step(model, _inputs(seed), ALL_FWD_THEN_BWD), refs[seed])
        offload.end_iteration()
    graphed = Graphed(model, 2)
    if offloading:
        _assert_captured(manager, 2 * 2)
        _assert_copied_after_replays(manager)
    calls = manager.hook_calls
    for seed in range(3):
        _assert_equal(graphed.step(_inputs(seed), ALL_FWD_THEN_BWD), refs[seed])
    assert manager.hook_calls == calls, "a replay runs none of our Python"


@pytest.mark.parametrize("names", [["mlp_act"], NAMES], ids=["last-in-graph", "inside-graph"])
def test_a_lone_view_with_gaps_under_graphs_bitwise(configure, monkeypatch, names):
    """A GLU that saves half of its input, a view with gaps (Note [10] of offload.copy_queue),
    under per-layer graphs with slowed copies: its rows copied inside the capture, or after each
    replay when its group is the graph's last (Note [C3] of offload.capture); bitwise equal."""
    slow_side_streams(monkeypatch)
    model = with_gate_only_glu(_model())
    ref_model = copy.deepcopy(model)
    manager = configure(names, device="cuda", min_tensor_bytes=1 << 16)
    offload.attach(model, GPT_MAPPING)
    refs = [_reference(ref_model, _inputs(seed), ALL_FWD_THEN_BWD) for seed in range(3)]
    graphed = Graphed(model, 2)
    rows = [rec for g in manager.captured_groups if g.name == "mlp_act" for rec in g.records if rec.pitch]
    assert rows, "no record of rows was captured"
    if names == ["mlp_act"]:
        _assert_copied_after_replays(manager)
    for seed in range(3):
        _assert_equal(graphed.step(_inputs(seed), ALL_FWD_THEN_BWD), refs[seed])


def test_ordered_graphs_1f1b_bitwise_and_buffers_hold_the_replay(configure):
    """Whole-stack graphs per microbatch captured in 1F1B order with offload.graphs.graph:
    bitwise equal to eager; after each forward replay the pinned buffers hold that replay's
    activations (here: the GeLU input, i.e. fc1's output, of every layer)."""
    model = _model()
    ref_model = copy.deepcopy(model)
    manager = configure(NAMES, device="cuda", min_tensor_bytes=1 << 16)
    offload.attach(model, GPT_MAPPING)
    graphs = OrderedGraphs(model, 2, ONE_F_ONE_B)
    _assert_captured(manager, 2 * len(model.layers), KEPT_TWO_LAYER_GRAPH)  # microbatch 2's last groups
    captured = [g for g in manager.captured_groups if g.name == "mlp_act"]
    calls = manager.hook_calls
    for seed in range(3):
        data = _inputs(seed)
        ref = _reference(ref_model, data, ONE_F_ONE_B)
        _assert_equal(graphs.step(data, ONE_F_ONE_B), ref)
        for m in range(2):  # what microbatch m's forward graph wrote into its pinned buffers
            h = data[m][0]
            for i, layer in enumerate(ref_model.layers):
                expected = layer.mlp.linear_fc1(layer.pre_mlp_layernorm(h + layer.self_attention(layer.input_layernorm(h))))
                group = captured[m * len(model.layers) + i]
                h = layer(h)
                if group.state is GroupState.KEPT:
                    continue
                (rec,) = group.records
                assert torch.equal(rec.host.view(rec.dtype, rec.numel).cuda(), expected.detach().flatten())
    assert manager.hook_calls == calls


def test_te_make_graphed_callables_bitwise(configure):
    try:
        te = pytest.importorskip("transformer_engine.pytorch", reason="Transformer Engine is not installed")
    except OSError as exc:  # seen on the H100 machine once torch has loaded the image's cuDNN
        pytest.skip(f"Transformer Engine cannot load after torch's cuDNN in this process ({exc}); "
                    "run this test in a pytest process of its own: -k te_make")
    # TE's cuDNN wheel and the image's cuDNN disagree on a symbol that torch's cuDNN attention
    # backend needs (seen on the H100 machine): our model's attention uses the other backends.
    torch.backends.cuda.enable_cudnn_sdp(False)
    model = _model()
    ref_model = copy.deepcopy(model)
    manager = configure(NAMES, device="cuda", min_tensor_bytes=1 << 16)
    offload.attach(model, GPT_MAPPING)
    ref = _reference(ref_model, _inputs(0), ALL_FWD_THEN_BWD)
    try:
        graphed = Graphed(model, 2, graph_api=te.make_graphed_callables)
        _assert_captured(manager, 2 * len(model.layers))  # each (layer, microbatch) callable, once
        calls = manager.hook_calls
        for seed in range(3):
            _assert_equal(graphed.step(_inputs(seed), ALL_FWD_THEN_BWD),
                          ref if seed == 0 else _reference(ref_model, _inputs(seed), ALL_FWD_THEN_BWD))
        assert manager.hook_calls == calls, "a replay runs none of our Python"
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


def test_slowed_copy_streams_inside_the_capture(configure, monkeypatch):
    """The spinning kernels that delay every copy are captured with the copies, in both kinds
    of graphs: the replays stay bitwise equal to eager."""
    slow_side_streams(monkeypatch)
    launched = _count_captured_launches(monkeypatch)
    model = _model()
    ref_model = copy.deepcopy(model)
    manager = configure(NAMES, device="cuda", min_tensor_bytes=1 << 16)
    offload.attach(model, GPT_MAPPING)
    graphs = OrderedGraphs(model, 2, ONE_F_ONE_B)
    _assert_captured(manager, 2 * len(model.layers), KEPT_TWO_LAYER_GRAPH)
    graphed = Graphed(model, 2)
    _assert_captured(manager, 2 * 2 * len(model.layers),  # the ordered graphs' groups, then these
                     {name: KEPT_TWO_LAYER_GRAPH[name] + 1 for name in NAMES})
    # every captured group's copy out was decided under capture (the ordered graphs copy
    # inside the next graph, the graphed callables after their replays: both slowed), and the
    # copies back were launched (slowed) under capture
    copied = [g for g in manager.captured_groups if g.state is GroupState.OFFLOADED]
    assert launched["offload"] == len(copied) and launched["reload"] > 0
    _assert_copied_after_replays(manager)
    for seed in range(5):
        data = _inputs(seed)
        ref = _reference(ref_model, data, ONE_F_ONE_B)
        _assert_equal(graphs.step(data, ONE_F_ONE_B), ref)
        ref = _reference(ref_model, data, ALL_FWD_THEN_BWD)
        _assert_equal(graphed.step(data, ALL_FWD_THEN_BWD), ref)


class AttentionBlock(nn.Module):
    """A layer's attention half (its own submodules only, as a graphed callable must use all
    the parameters it holds)."""

    def __init__(self, layer):
        super().__init__()
        self.input_layernorm = layer.input_layernorm
        self.self_attention = layer.self_attention

    def forward(self, x):
        return x + self.self_attention(self.input_layernorm(x))


class MLPBlock(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.pre_mlp_layernorm = layer.pre_mlp_layernorm
        self.mlp = layer.mlp

    def forward(self, x):
        return x + self.mlp(self.pre_mlp_layernorm(x))


def _eager_dispatch(x, weight, grouped=True):
    """An eager step between graphs, like MoE dispatch: a host sync and a data-dependent
    choice, then a matmul whose saved tensors are offloaded eagerly (group ``expert_fc1``)."""
    keep = int((x[0, 0] > -1e9).sum().item())  # host sync: cannot be captured
    if not grouped:
        return x + torch.tanh(x[:, :keep] @ weight)
    with offload.group("expert_fc1"):
        return x + torch.tanh(x[:, :keep] @ weight)


@pytest.mark.parametrize("pattern", ["partial", "partial-slowed", "breakable"])
def test_partial_and_breakable_capture(configure, monkeypatch, pattern):
    """``partial``: each layer's attention block is graphed, its MLP runs eagerly; the copies
    carried out of an attention graph are issued after its replay, under the eager MLP
    (Note [C3]); ``partial-slowed`` with the copy streams slowed. ``breakable``: attention block
    graphed, an eager dispatch step, then the MLP block graphed (a capture broken around an
    eager operation). Offloading works in every part."""
    if pattern == "partial-slowed":
        slow_side_streams(monkeypatch)
        pattern = "partial"
    model = _model()
    ref_model = copy.deepcopy(model)
    weight = torch.randn(HIDDEN, HIDDEN, device="cuda", requires_grad=True)
    names = NAMES + (["expert_fc1"] if pattern == "breakable" else [])
    manager = configure(names, device="cuda", min_tensor_bytes=1 << 16)
    offload.attach(model, GPT_MAPPING)

    def run(net, fns, data):
        net.zero_grad(set_to_none=True)
        weight.grad = None
        xs = [x.clone().requires_grad_(True) for x, _ in data]
        outs = []
        for m, x in enumerate(xs):
            h = x
            for i in range(len(net.layers)):
                h = fns["attn"][m][i](h)
                if pattern == "breakable":
                    h = _eager_dispatch(h, weight, grouped=net is model)
                h = fns["mlp"][m][i](h)
            outs.append(h)
        for m in reversed(range(len(xs))):
            outs[m].backward(data[m][1])
        grads = _grads(net, xs)
        if pattern == "breakable":
            grads["<weight>"] = weight.grad.clone()
        return [o.detach() for o in outs], grads

    eager = {"attn": [[AttentionBlock(l) for l in ref_model.layers]] * 2,
             "mlp": [[MLPBlock(l) for l in ref_model.layers]] * 2}
    refs = [run(ref_model, eager, _inputs(seed)) for seed in range(2)]
    assert first_difference(refs[0][1], run(ref_model, eager, _inputs(0))[1]) is None

    def sample():
        return tuple((torch.randn(SEQ, BATCH, HIDDEN, device="cuda", requires_grad=True),)
                     for _ in range(2 * len(model.layers)))

    graphed = offload.graphs.make_graphed_callables(
        tuple(AttentionBlock(l) for _ in range(2) for l in model.layers), sample())
    if pattern == "breakable":
        graphed_mlp = offload.graphs.make_graphed_callables(
            tuple(MLPBlock(l) for _ in range(2) for l in model.layers), sample())
    else:
        graphed_mlp = [MLPBlock(l) for _ in range(2) for l in model.layers]
    _assert_copied_after_replays(manager)
    n = len(model.layers)
    fns = {"attn": [graphed[m * n:(m + 1) * n] for m in range(2)],
           "mlp": [graphed_mlp[m * n:(m + 1) * n] for m in range(2)]}
    for seed in range(2):
        _assert_equal(run(model, fns, _inputs(seed)), refs[seed])
        stats = offload.end_iteration()
        eager_names = {"fc1", "mlp_act", "fc2"} if pattern == "partial" else {"expert_fc1"}
        for name in eager_names:
            assert stats.by_name[name].bytes_offloaded > 0, name  # offloaded eagerly, between graphs
    assert {g.name for g in manager.captured_groups} >= {"core_attn"}


def test_an_eager_fallback_is_not_a_replay(configure, monkeypatch):
    """A graphed module called in another training mode than captured runs eagerly (the API's
    fallback): no copies are issued after it, as no graph replayed (Note [C3]); replays after it
    still copy, and stay bitwise equal to eager."""
    model = _model()
    ref_model = copy.deepcopy(model)
    manager = configure(NAMES, device="cuda", min_tensor_bytes=1 << 16)
    offload.attach(model, GPT_MAPPING)
    graphed = Graphed(model, 1)
    issued = []
    issue = ReplayCopies.issue
    monkeypatch.setattr(ReplayCopies, "issue", lambda self, *a: (issued.append(list(self.groups)), issue(self, *a)))
    data = _inputs(0, microbatches=1)
    _assert_equal(graphed.step(data, [1, -1]), _reference(ref_model, data, [1, -1]))
    assert [groups for groups in issued if groups], "the first layer's graph copies after its replay"
    issued.clear()
    for fn in graphed.fns:
        fn.eval()
    with torch.no_grad():
        h = data[0][0]
        for fn in graphed.fns:
            h = fn(h)
    assert issued == []
    for fn in graphed.fns:
        fn.train()
    data = _inputs(1, microbatches=1)
    _assert_equal(graphed.step(data, [1, -1]), _reference(ref_model, data, [1, -1]))
    assert [groups for groups in issued if groups]


def test_reloads_after_a_backward_replay_are_checked(configure):
    """Layer 1's backward replay issues layer 0's reloads (Note [C4]): called with no input
    that needs a gradient, that backward would never run, so the call is refused (without
    grad mode, no backward at all, it runs); and layer 0's backward graph refuses to replay
    when the gradient did not pass layer 1's input since its forward."""
    model = _model()
    configure(NAMES, device="cuda", min_tensor_bytes=1 << 16)
    offload.attach(model, GPT_MAPPING)
    graphed = Graphed(model, 1)
    x = _inputs(0, microbatches=1)[0][0]
    with pytest.raises(OffloadError, match="no input that needs a gradient"):
        graphed.fns[1](x)
    with torch.no_grad():
        graphed.fns[1](graphed.fns[0](x))
    # layer 1 called on an input that is not layer 0's output: layer 0's backward graph would
    # replay without layer 1's gradient having reached that input: refused before it reads
    h0 = graphed.fns[0](x.clone().requires_grad_(True))
    graphed.fns[1](x.clone().requires_grad_(True))
    with pytest.raises(OffloadError, match="its reloads were not issued"):
        h0.backward(torch.ones_like(h0))


class _DropsAGraphWhileCaptured(nn.Module):
    """A layer that, the first time it runs under capture, leaves a captured CUDA graph and its
    output to a reference cycle alone, then allocates enough for the collector to run: a dead
    graph (as ``torch.cuda.make_graphed_callables`` and the engine's own cycles leave them)
    collected in a later capture."""

    def __init__(self, layer, graph, output):
        super().__init__()
        self.layer = layer
        self.graph = (graph, output)

    def forward(self, x):
        if self.graph is not None and torch.cuda.is_current_stream_capturing():
            cycle = [*self.graph]
            cycle.append(cycle)
            self.graph = cycle = None
            pressure = [[] for _ in range(4 * gc.get_threshold()[0])]  # the collector would run here
            del pressure
        return self.layer(x)


def test_a_dead_graph_is_not_collected_inside_a_capture(configure):
    """A CUDA graph destroyed during another capture invalidates that capture, and PyTorch no
    longer collects garbage before it captures: `make_graphed_callables` collects first and
    keeps the collector off until its captures end. Without that this capture fails."""
    configure(NAMES, device="cuda", min_tensor_bytes=1 << 16)
    model = _model(layers=1)
    ref = copy.deepcopy(model)
    offload.attach(model, GPT_MAPPING)
    dead = torch.cuda.CUDAGraph()
    x = torch.zeros(4, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        dead.capture_begin()
        y = x + 1  # in the graph's own pool, as a graph's static outputs are
        dead.capture_end()
    torch.cuda.synchronize()
    layer = _DropsAGraphWhileCaptured(model.layers[0], dead, y)
    died_capturing = []
    watch = weakref.ref(dead, lambda _: died_capturing.append(torch.cuda.is_current_stream_capturing()))
    del dead, y
    sample = (torch.randn(SEQ, BATCH, HIDDEN, device="cuda", requires_grad=True),)
    (fn,) = offload.graphs.make_graphed_callables((layer,), (sample,))
    assert gc.isenabled()
    gc.collect()  # the graph in the cycle dies here, after the captures
    assert layer.graph is None and watch() is None
    assert died_capturing == [False]  # collected after the captures, not inside one
    data = _inputs(0, microbatches=1)
    xs = [data[0][0].clone().requires_grad_(True)]
    out = fn(xs[0])
    out.backward(data[0][1])
    offload.end_iteration()
    _assert_equal(([out.detach()], _grads(model, xs)), _eager_step(ref, data, [1, -1]))


def test_a_copy_program_is_captured_once_and_repeats_its_copies(monkeypatch):
    """`CudaStreams.copy_program`: the copies after each replay are one small graph, captured at
    the first call and launched at each: every call copies what the source holds then (in
    pieces) and records the event. Inside another capture, and under the stream sanitizer,
    the copies are issued through the runtime instead (recorded by that capture)."""
    from offload.streams import CudaStreams

    captures = []
    begin = torch.cuda.CUDAGraph.capture_begin
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin",
                        lambda self, *a, **k: (captures.append(1), begin(self, *a, **k))[1])
    streams = CudaStreams(torch.device("cuda"))
    source = torch.empty(3 * 2**20 + 5, dtype=torch.uint8, device="cuda")
    host = torch.empty(source.numel(), dtype=torch.uint8, pin_memory=True)
    done = streams.event(external=True)
    done.record(streams.current())
    program = streams.copy_program(streams.d2h, [(host, source, 0, None)], 2**20, done)
    ready = streams.event()

    def call():
        ready.record(streams.current())
        streams.d2h.wait_event(ready)
        program()

    def fill(seed):
        source.random_(generator=torch.Generator(device="cuda").manual_seed(seed))

    for seed in range(3):
        fill(seed)
        call()
        done.synchronize()
        assert torch.equal(host, source.cpu()), f"call {seed}"
    assert len(captures) == 1, "captured at the first call only"

    outer = torch.cuda.CUDAGraph()
    with torch.cuda.graph(outer):
        call()
        streams.current().wait_stream(streams.d2h)
    assert len(captures) == 2, "inside another capture: recorded there, no graph of its own"
    fill(3)
    outer.replay()
    torch.cuda.synchronize()
    assert torch.equal(host, source.cpu()), "the outer graph copies"

    monkeypatch.setattr(offload.streams, "_sanitizer_watches", lambda: True)
    fill(4)
    call()
    done.synchronize()
    assert torch.equal(host, source.cpu()), "under the sanitizer"
    assert len(captures) == 2, "under the sanitizer: no capture"

    caller = streams.current_id()
    with streams.use(streams.d2h):
        with pytest.raises(RuntimeError, match="entered again"):
            with streams.use(streams.d2h):
                pass
    assert streams.current_id() == caller, "a stream switch restores the caller's stream"


POOL_SEQ = 2048


def _pool_size(layers, offloading):
    """The graph pool of ``layers`` per-layer graphs (one microbatch), captured after warm-up."""
    gc.collect()  # graphs of earlier measurements die here (their callables hold cycles)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = graph_pool_bytes()  # graphs of earlier tests may still be alive
    model = _model(layers)
    offload.configure(NAMES if offloading else [], device="cuda", min_tensor_bytes=1 << 16)
    offload.attach(model, GPT_MAPPING)
    graphed = Graphed(model, 1, seq=POOL_SEQ)
    torch.cuda.synchronize()
    size = graph_pool_bytes() - base
    del graphed, model
    offload.reset(release_pool=True)
    return size


def test_graph_pool_grows_less_with_depth_when_offloading():
    results = {offloading: [_pool_size(layers, offloading) for layers in (4, 8)] for offloading in (False, True)}
    slope_plain = results[False][1] - results[False][0]
    slope_offload = results[True][1] - results[True][0]
    record = {"layers": [4, 8], "plain_pool_bytes": results[False], "offload_pool_bytes": results[True],
              "growth_plain": slope_plain, "growth_offload": slope_offload,
              "model": f"seq {POOL_SEQ} batch {BATCH} hidden {HIDDEN} heads {HEADS} fp32, per-layer graphs, "
                       f"offload {NAMES}",
              "measure": "sum of CUDA graph private-pool segments (torch.cuda.memory._snapshot)"}
    print(json.dumps(record))
    out = os.environ.get("OFFLOAD_RESULTS_DIR")
    if out:
        with open(os.path.join(out, "graph_pool_growth.json"), "w") as f:
            json.dump(record, f, indent=1)
    assert results[True][0] < results[False][0] and results[True][1] < results[False][1]
    assert 0 < slope_offload < slope_plain


def test_thousand_replays_leak_nothing(configure):
    model = _model()
    manager = configure(NAMES, device="cuda", min_tensor_bytes=1 << 16)
    offload.attach(model, GPT_MAPPING)
    graphed = Graphed(model, 2)
    data = _inputs(0)
    for _ in range(10):
        graphed.step(data, ALL_FWD_THEN_BWD)
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    start = (torch.cuda.memory_reserved(), manager.pool.bytes_total, manager.pool.num_buffers,
             manager.pool.allocations, manager.hook_calls, len(manager.captured_groups))
    for _ in range(1000):
        graphed.step(data, ALL_FWD_THEN_BWD)
    torch.cuda.synchronize()
    end = (torch.cuda.memory_reserved(), manager.pool.bytes_total, manager.pool.num_buffers,
           manager.pool.allocations, manager.hook_calls, len(manager.captured_groups))
    assert end == start
    assert torch.cuda.memory_allocated() <= allocated


def test_released_graphs_leave_no_reference_cycles(configure):
    """Graphs captured with offloading (`offload.graphs.graph`, 1F1B), replayed, then released
    (``reset(release_pool=True)``) with the cyclic collector off: no object of the engine is left
    in a reference cycle (the captured handlers' groups and records, their events), and no pinned
    buffer is left. (torch's ``make_graphed_callables`` wraps each graphed module in a cycle of its
    own, which holds what its autograd contexts hold, our region edges' too, until a collection.)"""
    model = _model()
    manager = configure(NAMES, device="cuda", min_tensor_bytes=1 << 16)
    offload.attach(model, GPT_MAPPING)

    def capture_replay_release():
        graphs = OrderedGraphs(model, 2, ONE_F_ONE_B)
        for seed in range(2):
            graphs.step(_inputs(seed), ONE_F_ONE_B)
        torch.cuda.synchronize()
        offload.reset(release_pool=True)

    assert cyclic_garbage(capture_replay_release) == {}
    assert manager.captured_groups == [] and manager.pool.bytes_total == 0


def test_errors_changed_shape_and_unjoined(configure):
    model = _model(1)
    configure(NAMES, device="cuda", min_tensor_bytes=1 << 16)
    offload.attach(model, GPT_MAPPING)
    layer = model.layers[0]
    x = torch.randn(SEQ, BATCH, HIDDEN, device="cuda", requires_grad=True)
    with offload.graphs.region("L"):
        layer(x).sum().backward()
    offload.end_iteration()
    torch.cuda.synchronize()
    longer = torch.randn(2 * SEQ, BATCH, HIDDEN, device="cuda", requires_grad=True)
    with pytest.raises(Exception) as info:
        with offload.graphs.graph(torch.cuda.CUDAGraph(), key="L"):
            layer(longer)
    assert "changed after the plan was frozen" in _chain(info.value)
    offload.reset()
    # A raw capture without a join: CUDA refuses to end it, and the engine says why.
    with offload.graphs.region("L"):
        layer(x).sum().backward()
    offload.end_iteration()
    torch.cuda.synchronize()
    try:  # CUDA may refuse to end the capture ("unjoined"); either way the engine knows
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            out = layer(x)  # noqa: F841
    except RuntimeError:
        pass
    with pytest.raises(OffloadError, match="not joined"):
        layer(x)
    offload.reset(release_pool=True)


def test_error_pinned_allocation_during_capture(configure):
    model = _model(1)
    configure(NAMES, device="cuda", min_tensor_bytes=1 << 16)
    offload.attach(model, GPT_MAPPING)
    x = torch.randn(SEQ, BATCH, HIDDEN, device="cuda", requires_grad=True)
    torch.cuda.synchronize()
    manager = offload.get_manager()
    assert manager.pool.num_buffers == 0
    with pytest.raises(Exception) as info:
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            out = model.layers[0](x)  # noqa: F841 - keeps the saved tensors alive
            offload.graphs.join()
            raise AssertionError(f"no pinned allocation was attempted: {dict(manager.stats.by_name)}")
    assert "pinned host buffer" in _chain(info.value)
    offload.reset(release_pool=True)


def test_a_graphs_static_input_is_not_copied_and_the_summary_says_so(configure):
    """attn_norm saves each layer's input (its mean and rstd are under ``min_tensor_bytes``);
    inside a graph that input is the graph's static input, a leaf that requires grad, which
    the policy never copies (autograd keeps the leaf itself), as under Megatron's attention
    graphs: attn_norm's captured groups copy nothing and count no bytes held elsewhere, fc1's
    copy. `captured_summary` is where this shows (a replay runs no hook)."""
    model = _model(3)
    manager = configure(["attn_norm", "fc1"], device="cuda", min_tensor_bytes=1 << 16)
    offload.attach(model, GPT_MAPPING)
    sample = tuple((torch.randn(SEQ, BATCH, HIDDEN, device="cuda", requires_grad=True),) for _ in model.layers)
    offload.graphs.make_graphed_callables(tuple(model.layers), sample)
    summary = manager.captures.captured_summary()
    assert summary["attn_norm"] == {"groups": 3, "groups_copied": 0, "bytes_copied": 0}, summary
    assert manager.captures.capture_stats.by_name["attn_norm"].bytes_held_elsewhere == 0
    assert summary["fc1"]["groups_copied"] == 2 and summary["fc1"]["bytes_copied"] > 0, summary  # the last is kept
    offload.reset(release_pool=True)


@pytest.mark.parametrize("per_graph", [1, 2])
def test_several_layers_per_graph_with_slowed_copies_bitwise(configure, monkeypatch, per_graph):
    """Graphed callables of ``per_graph`` layers each (4 layers, one microbatch), the copy
    streams slowed: copies carried from one graph into the next (Note [C1]) and reloads issued
    at the start of each backward graph (Note [C2]) stay exact over fresh inputs."""
    slow_side_streams(monkeypatch)
    model = _model(4)
    ref_model = copy.deepcopy(model)
    manager = configure(NAMES, device="cuda", min_tensor_bytes=1 << 16)
    offload.attach(model, GPT_MAPPING)
    layers = list(model.layers)
    blocks = tuple(nn.Sequential(*layers[i:i + per_graph]) for i in range(0, len(layers), per_graph))
    sample = tuple((torch.randn(SEQ, BATCH, HIDDEN, device="cuda", requires_grad=True),) for _ in blocks)
    fns = offload.graphs.make_graphed_callables(blocks, sample)
    _assert_captured(manager, len(layers), KEPT_TWO_LAYER_GRAPH if per_graph == 2 else None)
    prefetched = sum(s.reloads_prefetched for s in manager.captures.capture_stats.by_name.values())
    assert prefetched > 0, "the backward graphs reload before they need the data"
    for seed in range(3):
        data = _inputs(seed, microbatches=1)
        ref = _reference(ref_model, data, [1, -1])
        model.zero_grad(set_to_none=True)
        x = data[0][0].clone().requires_grad_(True)
        h = x
        for fn in fns:
            h = fn(h)
        h.backward(data[0][1])
        _assert_equal(([h.detach()], _grads(model, [x])), ref)
