"""The engine on a real GPU: streams, events, freed memory. Skipped without CUDA.

Run on the GPU machine with ``python -m pytest -q -m cuda tests``.
Bitwise comparisons need a reproducible reference: deterministic algorithms and
``CUBLAS_WORKSPACE_CONFIG`` (set in conftest before CUDA starts); each test first checks the
reference against itself.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import warnings

import pytest
import torch

import offload
from conftest import (CUDA_ONLY, SPIN_CYCLES, assert_step_bitwise, engine_flows, reproducible, seeded_pair,
                      GateOnlyGLU, slow_side_streams, with_gate_only_glu)
from offload import notices
from offload.testing import GPT_MAPPING, build_gpt, cyclic_garbage, first_difference, slow_copy_streams, train_step

pytestmark = [*CUDA_ONLY, pytest.mark.usefixtures("deterministic")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("variant", ["plain", "slow_copies", "host_ahead", "torch_copies", "into_backward"])
def test_stack_gradients_bitwise_equal(configure, monkeypatch, dtype, variant):
    """``torch_copies``: the copies through ``Tensor.copy_``, the path taken where CUDA's runtime
    is not a shared library that the engine can call (`offload.streams._runtime_memcpy`).
    ``into_backward``: copies slowed and ``copies_into_backward``, so the second-to-last layer's
    copies are still running when the backward starts and waits for them."""
    hidden, heads, layers, seq, batch = 256, 4, 4, 256, 2
    model = build_gpt(hidden, heads, layers, dtype=dtype, device="cuda")
    ref_model = copy.deepcopy(model)
    x, g = seeded_pair(0, seq, batch, hidden, dtype=dtype, device="cuda")
    reproducible(lambda: train_step(ref_model, x, g))

    inflight = 2 if variant == "plain" else 1  # the default, 1, forces the most waits
    manager = configure(list(GPT_MAPPING), min_tensor_bytes=1024, max_inflight_groups=inflight, device="cuda",
                        copies_into_backward=variant == "into_backward")
    offload.attach(model, GPT_MAPPING)
    if variant == "torch_copies":
        manager.streams._memcpy = None
    if variant in ("slow_copies", "into_backward"):
        slow_side_streams(monkeypatch)
    for it in range(20):
        x, g = seeded_pair(it + 1, seq, batch, hidden, dtype=dtype, device="cuda")
        ref_out, ref = train_step(ref_model, x, g)
        if variant == "host_ahead":
            torch.cuda._sleep(50 * SPIN_CYCLES)  # the GPU lags: every decision is made ahead of it
        out, got = train_step(model, x, g)
        assert torch.equal(out, ref_out), f"iteration {it}: outputs differ"
        diff = first_difference(ref, got)
        assert diff is None, f"iteration {it}: {diff}"
        stats = offload.end_iteration()
        assert stats.total().bytes_offloaded > 0
        assert stats.total().groups_kept == len(GPT_MAPPING)


def test_a_policy_that_declines_layers_is_bitwise_and_prefetches(configure, monkeypatch):
    """``fc1`` offloaded in layer 0 only, the other names in layers 0, 1 and 3 of four
    (`offload.group_policy.by_name`), copies slowed: gradients bitwise over fresh inputs, a
    group followed by declined invocations of its name offloaded, not kept, and every
    offloaded group reloaded ahead of its backward, also where its name's next invocation was
    declined (Note [11] of offload.copy_queue)."""
    from offload.group_policy import by_layer, by_name

    hidden, heads, layers, seq, batch = 256, 4, 4, 256, 2
    model = build_gpt(hidden, heads, layers, dtype=torch.bfloat16, device="cuda")
    ref_model = copy.deepcopy(model)
    x, g = seeded_pair(0, seq, batch, hidden, dtype=torch.bfloat16, device="cuda")
    reproducible(lambda: train_step(ref_model, x, g))
    configure(list(GPT_MAPPING), min_tensor_bytes=1024, device="cuda",
              policy=by_name({"fc1": by_layer({0})}, by_layer({0, 1, 3})))
    offload.attach(model, GPT_MAPPING)
    slow_side_streams(monkeypatch)
    for it in range(10):
        x, g = seeded_pair(it + 1, seq, batch, hidden, dtype=torch.bfloat16, device="cuda")
        assert_step_bitwise(ref_model, model, x, g, it)
        stats = offload.end_iteration()
        fc1 = stats.by_name["fc1"]
        assert (fc1.groups_offloaded, fc1.groups_kept, fc1.groups_declined) == (1, 0, 3)
        for name, s in stats.by_name.items():
            assert s.reloads_on_demand == 0, f"iteration {it}: {name} reloaded on demand"
            assert s.reloads_prefetched == s.groups_offloaded, f"iteration {it}: {name}"


def test_selective_plan_gradients_bitwise_equal(monkeypatch):
    """A plan with selective checkpoints (`offload.planner.apply.SavedModules`): the MLP keeping
    fc1, the attention keeping core_attn, their inputs and attn_norm offloaded, copies slowed:
    gradients bitwise equal to the plain model's over fresh inputs, and the engine moved bytes."""
    from offload.planner.apply import Applied
    from offload.planner.structure import find_containers

    hidden, heads, layers, seq, batch = 256, 4, 4, 256, 2
    model = build_gpt(hidden, heads, layers, dtype=torch.bfloat16, device="cuda")
    ref_model = copy.deepcopy(model)
    x, g = seeded_pair(0, seq, batch, hidden, dtype=torch.bfloat16, device="cuda")
    reproducible(lambda: train_step(ref_model, x, g))
    slow_side_streams(monkeypatch)
    applied = Applied(model, GPT_MAPPING, find_containers(model, GPT_MAPPING), ("mlp", "self_attention"),
                      ("attn_norm", "mlp", "self_attention"), 1, {"min_tensor_bytes": 1024, "device": "cuda"},
                      ("fc1", "core_attn"))
    try:
        for it in range(10):
            x, g = seeded_pair(it + 1, seq, batch, hidden, dtype=torch.bfloat16, device="cuda")
            assert_step_bitwise(ref_model, model, x, g, it)
            stats = offload.end_iteration()
            assert {n for n, s in stats.by_name.items() if s.bytes_offloaded} == {"attn_norm", "mlp", "self_attention"}
    finally:
        applied.remove()


def test_pipeline_order_with_slow_copies(configure, monkeypatch):
    """Two chunks' forwards before their backwards (nothing kept), with late copies."""
    hidden, heads, layers, seq, batch = 256, 4, 3, 256, 2
    model = build_gpt(hidden, heads, layers, device="cuda")
    ref_model = copy.deepcopy(model)
    configure(list(GPT_MAPPING), min_tensor_bytes=1024, device="cuda")
    offload.attach(model, GPT_MAPPING)
    slow_side_streams(monkeypatch)
    for it in range(5):
        data = [seeded_pair(10 * it + mb, seq, batch, hidden, dtype=torch.float32, device="cuda") for mb in range(3)]
        for m in (ref_model, model):
            m.zero_grad(set_to_none=True)
            outs = [m(x) for x, _ in data]
            for out, (_, g) in zip(outs, data):
                out.backward(g)
        ref = {n: p.grad for n, p in ref_model.named_parameters()}
        got = {n: p.grad for n, p in model.named_parameters()}
        assert first_difference(ref, got) is None, f"iteration {it}"
        stats = offload.end_iteration()
        assert stats.total().groups_kept == 0 and stats.handlers == 3


@pytest.mark.parametrize("pipelined", [True, False], ids=["forwards-then-backwards", "own-backward-next"])
def test_an_input_held_by_the_forward_leaves_at_its_end(configure, monkeypatch, pipelined):
    """Note [8] of offload.copy_queue on the GPU, copies slowed: each microbatch's first input,
    which the chunk's forward holds until it returns (as Megatron's ``GPTModel.forward`` holds
    the embedding's output), is copied once another forward follows, and its memory is gone
    before its backward reaches the second group; or, each forward followed by its own backward,
    when that backward begins, unwaited (its copy may still run when group 0 needs it: used in
    place). Nothing is left held elsewhere; gradients bitwise, iteration after iteration."""
    from torch.multiprocessing.reductions import StorageWeakRef
    layers = 3 if pipelined else 6

    def chunk(w, scale, freed):
        x = w * scale
        gone = StorageWeakRef(x.untyped_storage())
        h = x
        for i in range(layers):
            with offload.group("g", h) as h1:
                h = (h1 @ h1.t()).tanh() @ h1  # the matmuls save their inputs: group 0 saves x
            if i == 1 and freed is not None:
                h.register_hook(lambda grad: freed.append(gone.expired()))
        return h.float().pow(2).sum()

    def step(w, offloading, freed=None):
        w.grad = None
        with contextlib.nullcontext() if offloading else offload.suspended():
            losses = []
            for mb in range(2):
                offload.begin_chunk(0, mb)
                losses.append(chunk(w, 1.0 + mb, freed))
                if not pipelined:
                    losses.pop().backward()
            for loss in losses:
                loss.backward()
        return w.grad.clone()

    configure(["g"], min_tensor_bytes=1024, device="cuda")
    slow_side_streams(monkeypatch)
    for it in range(5):
        torch.manual_seed(it)
        w = torch.randn(512, 256, device="cuda", requires_grad=True)
        ref = reproducible(lambda: step(w, False), grads=lambda g: {"w": g})
        freed: list = []
        got = step(w, True, freed if pipelined else None)
        assert torch.equal(got, ref), f"iteration {it}"
        s = offload.end_iteration().by_name["g"]
        assert s.bytes_held_elsewhere == 0, f"iteration {it}: {freed}, {s}"
        if pipelined:
            assert freed == [True, True], f"iteration {it}: {freed}"
        else:
            assert s.groups_kept == 2 and 0 < s.bytes_reloaded <= s.bytes_offloaded, f"iteration {it}: {s}"


def test_an_input_held_until_the_attached_model_returns_leaves_before_the_backward(configure, monkeypatch):
    """Note [8] of offload.copy_queue on the GPU, copies slowed: with `offload.attach` and each
    forward followed by its own backward, the first layer's input, which the model's forward
    holds until it returns, is copied at the return, and its memory is gone (the compute stream
    waited for the copy when the backward began, at the kept last layer) before the backward
    passes the last layer: off the GPU for the backward's first modules, where a deterministic
    step often peaks. Nothing is left held elsewhere; gradients bitwise, iteration after
    iteration."""
    from torch import nn
    from torch.multiprocessing.reductions import StorageWeakRef
    layers = 6

    class Layer(nn.Module):
        def forward(self, h: torch.Tensor) -> torch.Tensor:
            return (h @ h.t()).tanh() @ h  # the matmuls save their inputs: layer 0 saves x

    class HoldsItsInput(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(Layer() for _ in range(layers))
            self.freed: list | None = None

        def forward(self, w: torch.Tensor, scale: float) -> torch.Tensor:
            x = w * scale
            gone, freed = StorageWeakRef(x.untyped_storage()), self.freed
            h = x
            for i, layer in enumerate(self.layers):
                h = layer(h)
                if i == layers - 2 and freed is not None:
                    h.register_hook(lambda grad: freed.append(gone.expired()))
            return h.float().pow(2).sum()

    configure(["g"], min_tensor_bytes=1024, device="cuda")
    model = HoldsItsInput()
    offload.attach(model, {"g": "layers.*"})
    slow_side_streams(monkeypatch)

    def step(w, offloading, freed=None):
        w.grad, model.freed = None, freed
        with contextlib.nullcontext() if offloading else offload.suspended():
            for mb in range(2):
                model(w, 1.0 + mb).backward()
        return w.grad.clone()

    for it in range(5):
        torch.manual_seed(it)
        w = torch.randn(512, 256, device="cuda", requires_grad=True)
        ref = reproducible(lambda: step(w, False), grads=lambda g: {"w": g})
        offload.end_iteration()
        freed: list = []
        got = step(w, True, freed)
        assert torch.equal(got, ref), f"iteration {it}"
        s = offload.end_iteration().by_name["g"]
        assert freed == [True, True], f"iteration {it}: {freed}"
        assert s.bytes_held_elsewhere == 0 and s.groups_kept == 2, f"iteration {it}: {s}"
        # per microbatch, each layer but the kept last: its input and its tanh's output
        assert s.bytes_reloaded == s.bytes_offloaded == 2 * (layers - 1) * (512 * 256 + 512 * 512) * 4, s


@pytest.mark.parametrize(
    "modules, share", [(list(GPT_MAPPING), 0.90), (["core_attn"], 0.95)], ids=["all", "core_attn"]
)
def test_peak_memory_falls_by_the_offloaded_bytes(configure, modules, share):
    """The peak falls by at least ``share`` of the bytes offloaded, on an 8-layer stack whose
    backward follows its forward (the last layer is kept, so it is not counted as offloaded).

    One name (``core_attn``): 95%. The group before the last one used to be in flight at the
    forward's end, the peak: 86% removed. The engine now frees it when the forward's last
    group closes (learned from the previous step); 100% on the H100.
    Every name: 90%. With all eight names offloaded the peak moves into backward, where each
    name's next group is already reloaded (prefetched) while the current layer's backward runs
    with its own transients: `python tools/memory_timeline.py --hidden 1024 --layers 8 --seq 4096
    --modules all` on the H100 showed
    the peak 176 MiB above the forward's end against 112 MiB without offloading, and 90.1%
    (801 of 889 MiB) removed. That prefetch window is the price of hiding the reloads."""
    hidden, heads, layers, seq, batch = 1024, 8, 8, 4096, 1
    model = build_gpt(hidden, heads, layers, dtype=torch.bfloat16, device="cuda")
    x, g = seeded_pair(0, seq, batch, hidden, dtype=torch.bfloat16, device="cuda")

    def peak_of_steps(n):
        for _ in range(2):
            train_step(model, x, g)  # warm-up: cuBLAS workspace, pinned pool
            offload.end_iteration()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        stats = None
        for _ in range(n):
            train_step(model, x, g)
            stats = offload.end_iteration()
        return torch.cuda.max_memory_allocated(), stats

    train_step(model, x, g)  # gradients exist from here on, in both measurements
    configure([], device="cuda")
    peak_none, _ = peak_of_steps(2)
    configure(modules, device="cuda")
    handle = offload.attach(model, GPT_MAPPING)
    peak_off, stats = peak_of_steps(2)
    handle.remove()
    offloaded = stats.total().bytes_offloaded
    removed = peak_none - peak_off
    print(f"peak without {peak_none / 2**20:.1f} MiB, with {peak_off / 2**20:.1f} MiB, "
          f"removed {removed / 2**20:.1f} MiB of {offloaded / 2**20:.1f} MiB offloaded "
          f"({100 * removed / offloaded:.1f}%)")
    assert offloaded > 0
    assert removed >= share * offloaded


def test_no_growth_over_200_iterations(configure):
    hidden, heads, layers, seq, batch = 256, 4, 3, 256, 2
    model = build_gpt(hidden, heads, layers, device="cuda")
    configure(list(GPT_MAPPING), min_tensor_bytes=1024, device="cuda")
    offload.attach(model, GPT_MAPPING)
    manager = offload.get_manager()
    allocated, pinned, allocations = [], [], []
    for it in range(200):
        x, g = seeded_pair(it, seq, batch, hidden, dtype=torch.float32, device="cuda")
        train_step(model, x, g)
        stats = offload.end_iteration()
        gc.collect()
        allocated.append(torch.cuda.memory_allocated())
        pinned.append(stats.pinned_bytes)
        allocations.append(stats.pinned_allocations)
    assert allocations[1] == allocations[-1], f"pinned allocations after iteration 2: {allocations[1]} -> {allocations[-1]}"
    assert pinned[1] == pinned[-1]
    assert allocated[5] == allocated[-1], f"GPU memory grew: {allocated[5]} -> {allocated[-1]}"
    assert manager.live_handlers == [] and manager.pool.bytes_in_use == 0
    assert all(buf.tensor.is_pinned() for buf in manager.pool._all)


@pytest.mark.filterwarnings("ignore:offload. nothing was offloaded")
@pytest.mark.parametrize("flow", ["accumulation", "pipeline_order", "dropped_forward", "retain_graph",
                                  "reset_while_alive"])
def test_no_reference_cycles_with_the_cyclic_collector_off(configure, monkeypatch, flow):
    """With ``gc.disable()`` (Megatron's ``--manual-gc``), copies slowed: no object of the engine
    is left in a reference cycle (each holds CUDA events until a collection), and the GPU memory
    and pinned buffers are back where they were after the warm-up."""
    model = build_gpt(256, 4, 3, dtype=torch.bfloat16, device="cuda")
    slow_side_streams(monkeypatch)
    manager = configure(list(GPT_MAPPING), min_tensor_bytes=1024, device="cuda")
    offload.attach(model, GPT_MAPPING)
    flows = engine_flows(model, *seeded_pair(0, 256, 2, 256, dtype=torch.bfloat16, device="cuda"))
    flows[flow]()
    torch.cuda.synchronize()
    allocated = torch.cuda.memory_allocated()
    assert cyclic_garbage(lambda: [flows[flow]() for _ in range(3)]) == {}
    torch.cuda.synchronize()
    assert manager.live_handlers == [] and manager.pool.bytes_in_use == 0
    assert torch.cuda.memory_allocated() == allocated


def _routing_sizes(gen: torch.Generator, tokens: int, experts: int) -> list[int]:
    """Rows per expert, skewed as an untrained router's: several experts get a few rows or none,
    and now and then one gets most of them."""
    share = torch.rand(experts, generator=gen) ** 4
    sizes = (share / share.sum() * tokens).floor().long().tolist()
    sizes[-1] += tokens - sum(sizes)
    return sizes


def test_grouped_gemm_pieces_drawn_by_routing(configure, monkeypatch):
    """A grouped GEMM saves its input as one piece per expert, with sizes that follow the routing,
    drawn anew each iteration: pieces under ``min_tensor_bytes`` (which, kept, held the whole input
    on the GPU, so its group moved nothing), pieces of most of the input after small ones. Copies
    slowed, 20 iterations: gradients bitwise; each group's input is one record of the whole
    storage, nothing is held elsewhere, and the pinned pool stops growing after the first
    iteration although the pieces' sizes never repeat."""
    hidden, experts, layers, tokens = 256, 8, 4, 2048  # fp32 rows of 1 KiB; 64 KiB is 64 rows
    gen = torch.Generator().manual_seed(0)
    weights = [[torch.randn(hidden, hidden, device="cuda", generator=torch.Generator(device="cuda").manual_seed(
        10 * layer + e)).div_(16).requires_grad_() for e in range(experts)] for layer in range(layers)]
    params = [w for ws in weights for w in ws]

    def step(x, routing, offloading):
        for w in params:
            w.grad = None

        def forward():  # returns before backward: nothing but autograd holds the layers' inputs
            h = x * 1.0
            for layer in range(layers):
                if offloading:
                    with offload.group("experts", h) as h_in:
                        h = torch.cat([p @ w for p, w in zip(h_in.split(routing[layer]), weights[layer])])
                else:
                    h = torch.cat([p @ w for p, w in zip(h.split(routing[layer]), weights[layer])])
            return h.square().sum()

        loss = forward()
        loss.backward()
        return loss.detach(), {f"w{i}": w.grad.clone() for i, w in enumerate(params)}

    configure(["experts"], min_tensor_bytes=64 << 10, max_inflight_groups=1, device="cuda")
    slow_side_streams(monkeypatch)
    allocations, pieces = [], set()
    for it in range(20):
        x, _ = seeded_pair(it, tokens, hidden, device="cuda")
        routing = [_routing_sizes(gen, tokens, experts) for _ in range(layers)]
        pieces.update(n for sizes in routing[:-1] for n in sizes)  # the last layer's group is kept
        ref_loss, ref = reproducible(lambda: step(x, routing, False))
        loss, got = step(x, routing, True)
        assert torch.equal(loss, ref_loss), f"iteration {it}: losses differ"
        diff = first_difference(ref, got)
        assert diff is None, f"iteration {it}: {diff}"
        stats = offload.end_iteration()
        s = stats.by_name["experts"]
        assert s.bytes_held_elsewhere == 0, f"iteration {it}: {s}"
        assert s.groups_offloaded == layers - 1 and s.tensors_offloaded == layers - 1
        assert s.bytes_offloaded == (layers - 1) * tokens * hidden * 4
        allocations.append(stats.pinned_allocations)
    assert allocations[0] == allocations[-1], f"pinned allocations after the first iteration: {allocations}"
    assert min(pieces) < 64 and max(pieces) >= tokens // 2  # both cases were drawn


@pytest.mark.parametrize("copies", ["runtime", "torch_copies"])
def test_a_lone_view_with_gaps_leaves_as_its_rows(configure, monkeypatch, copies):
    """Note [10] of offload.copy_queue: the activated half of a GLU's input, saved alone, moves
    as its rows (``cudaMemcpy2DAsync``, or ``Tensor.copy_``) in pieces, both ways.
    bf16, copies slowed, 10 iterations of fresh inputs: gradients bitwise; per offloaded layer
    three tensors of tokens x ffn/2 (the gate's rows, its SiLU and ``linear + 0.0``), where the
    span of the gate was two."""
    hidden, heads, layers, seq, batch = 256, 4, 4, 256, 2
    model = with_gate_only_glu(build_gpt(hidden, heads, layers, dtype=torch.bfloat16, device="cuda"))
    ref_model = copy.deepcopy(model)
    x, g = seeded_pair(0, seq, batch, hidden, dtype=torch.bfloat16, device="cuda")
    reproducible(lambda: train_step(ref_model, x, g))
    manager = configure(["mlp_act"], min_tensor_bytes=1024, copy_chunk_bytes=64 << 10, device="cuda")
    offload.attach(model, GPT_MAPPING)
    if copies == "torch_copies":
        manager.streams._memcpy = None
    slow_side_streams(monkeypatch)
    half = seq * batch * 2 * hidden  # elements of tokens x ffn/2 (ffn = 4 * hidden)
    for it in range(10):
        x, g = seeded_pair(it + 1, seq, batch, hidden, dtype=torch.bfloat16, device="cuda")
        assert_step_bitwise(ref_model, model, x, g, it)
        s = offload.end_iteration().by_name["mlp_act"]
        assert s.bytes_held_elsewhere == 0
        assert s.bytes_offloaded == s.bytes_reloaded == (layers - 1) * 3 * half * 2, s


class _PackedGateOnlyGLU(GateOnlyGLU):
    """`GateOnlyGLU` in a group ``glu`` opened with ``packed_views``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with offload.group("glu", x, packed_views=True) as x:
            return super().forward(x)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_group_with_packed_views_is_bitwise_with_its_rows_packed(configure, monkeypatch, dtype):
    """Note [10] of offload.copy_queue: the GLU's activated half comes back packed to a group
    opened with ``packed_views`` (what the Megatron integration's ``moe_act`` does on CUDA):
    no spread, and torch's SiLU backward gives the same bits for it as for the view. Copies
    slowed, 10 iterations of fresh inputs: gradients bitwise."""
    hidden, heads, layers, seq, batch = 256, 4, 4, 256, 2
    model = with_gate_only_glu(build_gpt(hidden, heads, layers, dtype=dtype, device="cuda"))
    ref_model = copy.deepcopy(model)  # without the groups: the reference offloads nothing
    for layer in model.layers:
        layer.mlp.activation = _PackedGateOnlyGLU()
    x, g = seeded_pair(0, seq, batch, hidden, dtype=dtype, device="cuda")
    reproducible(lambda: train_step(ref_model, x, g))
    manager = configure(["glu"], min_tensor_bytes=1024, device="cuda")
    offload.attach(model, GPT_MAPPING)
    spread: list = []
    monkeypatch.setattr(manager.copies, "spread", spread.append)
    slow_side_streams(monkeypatch)
    half = seq * batch * 2 * hidden  # elements of tokens x ffn/2 (ffn = 4 * hidden)
    for it in range(10):
        x, g = seeded_pair(it + 1, seq, batch, hidden, dtype=dtype, device="cuda")
        assert_step_bitwise(ref_model, model, x, g, it)
        s = offload.end_iteration().by_name["glu"]
        assert s.bytes_offloaded == s.bytes_reloaded == (layers - 1) * 3 * half * dtype.itemsize, s
    assert spread == []


def _odd_layers_on(model: torch.nn.Module, stream: torch.cuda.Stream) -> torch.nn.Module:
    """``model`` (a `build_gpt` stack) with its odd layers' forwards on ``stream``: their
    backwards run there too, while the reloads of their groups are issued from the backward of
    the layer after them, on the default stream."""
    for layer in model.layers[1::2]:
        def forward(x, *args, _forward=layer.forward, **kwargs):
            main = torch.cuda.current_stream()
            stream.wait_stream(main)
            with torch.cuda.stream(stream):
                x.record_stream(stream)
                y = _forward(x, *args, **kwargs)
            main.wait_stream(stream)
            y.record_stream(main)
            return y
        layer.forward = forward
    return model


def test_a_view_with_gaps_spread_on_another_stream_than_its_reload(configure, monkeypatch):
    """Note [10] of offload.copy_queue: a record of rows unpacked on another stream than the one
    its reload buffer was allocated on is spread there (the allocating stream then waits for the
    spread before the packed buffer is dropped). Copies slowed, 6 iterations of fresh inputs:
    gradients bitwise, and some spreads crossed streams."""
    hidden, heads, layers, seq, batch = 256, 4, 4, 256, 2
    side = torch.cuda.Stream()
    model = with_gate_only_glu(build_gpt(hidden, heads, layers, dtype=torch.bfloat16, device="cuda"))
    # copied before wrapping: a deep copy shares the wrapper closures, which call the original layers
    ref_model = _odd_layers_on(copy.deepcopy(model), side)
    model = _odd_layers_on(model, side)
    x, g = seeded_pair(0, seq, batch, hidden, dtype=torch.bfloat16, device="cuda")
    reproducible(lambda: train_step(ref_model, x, g))
    manager = configure(["mlp_act"], min_tensor_bytes=1024, device="cuda")
    offload.attach(model, GPT_MAPPING)
    crossed: list[bool] = []
    spread = manager.copies.spread

    def watched(rec):
        crossed.append(rec.reload_group.alloc_stream is not manager.streams.current())
        spread(rec)

    monkeypatch.setattr(manager.copies, "spread", watched)
    slow_side_streams(monkeypatch)
    for it in range(6):
        x, g = seeded_pair(it + 1, seq, batch, hidden, dtype=torch.bfloat16, device="cuda")
        assert_step_bitwise(ref_model, model, x, g, it)
        s = offload.end_iteration().by_name["mlp_act"]
        assert s.bytes_reloaded > 0
    assert crossed and any(crossed), crossed


def test_timing_statistics_are_plausible(configure):
    hidden, heads, layers, seq, batch = 1024, 8, 4, 2048, 1
    model = build_gpt(hidden, heads, layers, dtype=torch.bfloat16, device="cuda")
    configure(["fc1", "mlp_act", "fc2"], timing=True, device="cuda")
    offload.attach(model, GPT_MAPPING)
    x, g = seeded_pair(0, seq, batch, hidden, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        train_step(model, x, g)
        stats = offload.end_iteration()
    total = stats.total()
    assert total.d2h_ms > 0 and total.h2d_ms > 0
    d2h = total.bytes_offloaded / total.d2h_ms / 1e6
    h2d = total.bytes_reloaded / total.h2d_ms / 1e6
    print(f"achieved D2H {d2h:.1f} GB/s, H2D {h2d:.1f} GB/s")
    assert 1 < d2h < 1000 and 1 < h2d < 1000


@pytest.mark.parametrize("timing", [False, True], ids=["default", "timing"])
def test_which_iterations_are_timed(configure, timing):
    """By default the engine times its copies and waits only in the iterations the copy-wait
    notice measures (2 to 4), whose statistics carry the times; then it makes no timing event
    any more. ``timing=True`` times every iteration."""
    model = build_gpt(256, 4, 4, dtype=torch.bfloat16, device="cuda")
    manager = configure(["fc1"], timing=timing, min_tensor_bytes=0, device="cuda")
    offload.attach(model, GPT_MAPPING)
    x, g = seeded_pair(0, 512, 1, 256, dtype=torch.bfloat16, device="cuda")
    timed, copied = [], []
    for _ in range(8):
        train_step(model, x, g)
        stats = offload.end_iteration()
        torch.cuda.synchronize()
        timed.append(stats.timed)
        copied.append(stats.total().d2h_ms > 0 and stats.total().h2d_ms > 0)
    expected = [True] * 8 if timing else [False, False, True, True, True, False, False, False]
    assert timed == expected and copied == expected
    assert manager.stats.probe is None  # decided (nothing to say for these small copies)
    assert manager.stats.timing is timing


@pytest.mark.parametrize("slowed", [True, False], ids=["slowed_copies", "small_copies"])
def test_copy_wait_notice(configure, monkeypatch, slowed):
    """Copies slowed by a spin of about 10 ms each (`offload.testing.slow_copy_streams`): after
    iterations 2-4 the engine says once that the compute stream waited for them, naming each
    name with its measured figures. The control, the same small copies at full speed: nothing
    said, and the probe decided that (it is gone, its events with it)."""
    monkeypatch.setattr(notices, "_said", set())  # as in a fresh process
    hidden, heads, layers, seq, batch = 256, 4, 4, 128, 2  # copies under about 2 MB per group
    names = ["qkv_linear", "core_attn", "fc1"]
    model = build_gpt(hidden, heads, layers, device="cuda")
    manager = configure(names, min_tensor_bytes=1024, device="cuda")
    offload.attach(model, GPT_MAPPING)
    if slowed:
        slow_copy_streams(monkeypatch, 10 * SPIN_CYCLES)
    probe = manager.stats.probe
    x, g = seeded_pair(0, seq, batch, hidden, dtype=torch.float32, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(8):
            train_step(model, x, g)
            offload.end_iteration()
    said = [str(w.message) for w in caught if "copies made the compute stream wait" in str(w.message)]
    assert manager.stats.probe is None and probe.done
    figures = {f.name: f for f in probe.figures}
    print(probe.notice or f"no notice: waits {sum(f.wait_ms for f in figures.values()):.3f} ms of a "
          f"{probe.step_ms:.3f} ms step")
    assert sorted(figures) == sorted(names)
    assert all(f.groups == 3 and f.layer_ms is not None and f.layer_ms > 0 for f in figures.values())
    if not slowed:
        assert said == [] and probe.notice is None
        return
    assert said == [probe.notice]
    assert "measured in iterations 2, 3, 4;" in probe.notice
    assert all(f"\n  {name}: 3 group(s) per step of " in probe.notice for name in names)
    assert all(f.d2h_ms > 5.0 for f in figures.values())  # the spin runs in each copy
    # the forward's end waits for the second-to-last layer's slowed copies: a part of the waits out
    assert all(0.0 <= f.flush_wait_ms <= f.offload_wait_ms + 1e-6 for f in figures.values())
    assert sum(f.flush_wait_ms for f in figures.values()) > 0


def test_copies_call_the_cuda_runtime_directly():
    """The suite runs the engine's fast copy path: torch's CUDA runtime is found and called."""
    from offload.streams import CudaStreams

    assert CudaStreams(torch.device("cuda", 0))._memcpy is not None


@pytest.mark.parametrize("max_pitch", [None, 1], ids=["2d", "row-by-row"])
def test_copies_of_rows_match_torch(monkeypatch, max_pitch):
    """`CopyJob`s of rows (Note [10] of offload.copy_queue) through the runtime, in pieces of
    whole rows and in one: to the host packed, writing nothing past them; ``row-by-row``: the
    path for rows more than cudaMemcpy2DAsync's largest pitch apart."""
    from offload import streams as streams_module
    from offload.streams import CudaStreams, Rows

    if max_pitch is not None:
        monkeypatch.setattr(streams_module, "_MAX_PITCH_BYTES", max_pitch)
    streams = CudaStreams(torch.device("cuda", 0))
    src = torch.randn(37, 40, device="cuda", dtype=torch.bfloat16)
    expected = src[:, 3:19].contiguous().view(-1).cpu()
    for chunk_bytes in (0, 5 * 16 * 2, 1 << 20):
        host = torch.full((37 * 16 + 8,), float("nan"), dtype=torch.bfloat16).pin_memory()
        streams.copy(streams.d2h, [(host[:37 * 16], src, 3, Rows(37, 16, 40))], chunk_bytes)
        streams.d2h.synchronize()
        assert torch.equal(host[:37 * 16], expected), chunk_bytes
        assert host[37 * 16:].isnan().all(), chunk_bytes


def test_stream_helpers_match_torch():
    """`CudaStreams.current` and `use` bypass torch.cuda.current_stream/stream (slow on the
    hot path): they must give the same stream, restore the one before, and leave the device."""
    from offload.streams import CudaStreams

    streams = CudaStreams(torch.device("cuda", 0))
    assert streams.current() == torch.cuda.current_stream(0)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert streams.current() == side
        with streams.use(streams.d2h):
            assert torch.cuda.current_stream() == streams.d2h
            assert streams.current() == streams.d2h
        assert torch.cuda.current_stream() == side
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    with pytest.raises(RuntimeError, match="boom"):
        with streams.use(streams.h2d):
            raise RuntimeError("boom")
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    if torch.cuda.device_count() > 1:
        with torch.cuda.device(1):
            with streams.use(streams.d2h):
                assert torch.cuda.current_stream(0) == streams.d2h
            assert torch.cuda.current_device() == 1
            assert torch.cuda.current_stream(0) == torch.cuda.default_stream(0)
