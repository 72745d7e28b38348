"""Engine behaviour on the CPU fallback: gradients, the last-layer rule, prefetch, lifetimes."""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import numpy
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import offload
from conftest import attention_output_stays, engine_flows, seeded_pair
from offload.testing import GPT_MAPPING, build_gpt, cyclic_garbage, first_difference, recompute, train_step
from offload.errors import OffloadTypeError, OffloadValueError


@pytest.mark.parametrize("modules", [["core_attn"], ["attn_proj"], ["qkv_linear", "core_attn", "attn_proj"],
                                     list(GPT_MAPPING)])
def test_gpt_stack_gradients_bitwise_equal(configure, modules):
    model = build_gpt(64, 4, 3)
    ref_model = copy.deepcopy(model)
    configure(modules)
    offload.attach(model, GPT_MAPPING)
    for it in range(4):
        x, g = seeded_pair(it, 16, 2, 64)
        ref_out, ref = train_step(ref_model, x, g)
        out, got = train_step(model, x, g)
        assert torch.equal(out, ref_out)
        assert first_difference(ref, got) is None
        stats = offload.end_iteration()
        for name in modules:
            s = stats.by_name[name]
            assert s.groups == 3 and s.groups_kept == 1
            if attention_output_stays(name, modules):  # per offloaded layer: [16, 2, 64] fp32
                assert s.bytes_held_elsewhere == 2 * 16 * 2 * 64 * 4, name
            else:
                assert s.bytes_held_elsewhere == 0, name
            if modules == ["attn_proj"]:  # its only saved tensor stays: nothing to copy
                assert s.groups_offloaded == 0 and s.bytes_offloaded == s.bytes_reloaded == 0
            else:
                assert s.groups_offloaded == 2 and s.bytes_offloaded == s.bytes_reloaded > 0, name
    assert offload.get_manager().live_handlers == []


def test_mlp_context_manager_gradients_equal(configure):
    torch.manual_seed(0)
    lins = nn.ModuleList(nn.Linear(32, 32) for _ in range(4))
    ref = copy.deepcopy(lins)

    def run(layers, use_groups):
        x = torch.randn(8, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
        h = x
        for i, lin in enumerate(layers):
            if use_groups:
                with offload.group("fc", h) as h_in:
                    h = F.relu(lin(h_in))
            else:
                h = F.relu(lin(h))
        h.square().sum().backward()
        return [p.grad.clone() for p in layers.parameters()] + [x.grad.clone()]

    configure(["fc"])
    a, b = run(ref, False), run(lins, True)
    assert all(torch.equal(u, v) for u, v in zip(a, b))
    stats = offload.end_iteration().by_name["fc"]
    # The first group saves only its input (a leaf: not offloaded) and relu's output, which the
    # second group saves too and so owns; the last group is kept with the storage it shares.
    assert (stats.groups, stats.groups_offloaded, stats.groups_kept) == (4, 2, 1)
    # every offloaded group was prefetched by the backward of the group after it
    assert stats.reloads_prefetched == 2 and stats.reloads_on_demand == 0


def test_group_without_inputs_reloads_on_demand(configure):
    configure(["blk"])
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16)
    h = x
    for _ in range(3):
        with offload.group("blk"):
            h = torch.tanh(h @ w)
    h.sum().backward()
    grad = w.grad.clone()
    w.grad = None
    h = x
    for _ in range(3):
        h = torch.tanh(h @ w)
    h.sum().backward()
    assert torch.equal(grad, w.grad)
    s = offload.end_iteration().by_name["blk"]
    # group 0 saves `x` (the test holds it: not copied) and its tanh output, which group 1
    # saves too and so owns; group 2 is kept
    assert s.bytes_held_elsewhere == x.numel() * 4
    assert s.groups_offloaded == 1 and s.reloads_on_demand == 1 and s.reloads_prefetched == 0


def test_attention_block_views_share_one_record(configure):
    """q, k, v are views of one qkv storage: offloaded once, rebuilt as views."""
    model = build_gpt(32, 4, 2)
    ref_model = copy.deepcopy(model)
    configure(["core_attn"])
    offload.attach(model, {"core_attn": GPT_MAPPING["core_attn"]})
    x, g = seeded_pair(0, 8, 2, 32)
    _, ref = train_step(ref_model, x, g)
    _, got = train_step(model, x, g)
    assert first_difference(ref, got) is None
    s = offload.end_iteration().by_name["core_attn"]
    # per layer: one record for the qkv storage that q, k and v view, plus SDPA's own outputs
    assert s.groups_offloaded == 1
    assert s.bytes_offloaded >= 8 * 2 * 96 * 4
    assert offload.get_manager().live_handlers == []


def test_tensor_saved_twice_is_copied_once(configure):
    configure(["sq"])
    x = torch.randn(64, requires_grad=True)

    def square(y):
        with offload.group("sq", y) as y_in:
            return y_in * y_in  # mul saves y_in twice

    z = square(x * 2)  # nothing but the graph holds x * 2 afterwards
    with offload.group("sq", z) as z_in:  # a second group so that the first one is offloaded
        out = z_in.sin()
    out.sum().backward()
    s = offload.end_iteration().by_name["sq"]
    assert s.groups_offloaded == 1
    assert s.tensors_offloaded == 1 and s.bytes_offloaded == 64 * 4
    y = (x * 2).detach()
    assert torch.equal(x.grad, torch.cos(y * y) * 2 * y * 2)


def test_small_view_of_big_storage_copies_only_its_span(configure):
    configure(["v"])
    a = torch.randn(10, requires_grad=True)

    def region(a):
        with offload.group("v", a) as a_in:
            piece = torch.arange(1000.0)[100:110]
            return (a_in * piece).sum()  # saves `piece`, a 10-element view of a 1000-element storage

    out = region(a)
    with offload.group("v", out) as o:
        out2 = o * 1.0
    out2.backward()
    s = offload.end_iteration().by_name["v"]
    assert s.bytes_offloaded == 10 * 4  # the span of `piece`, not all of its storage
    assert torch.equal(a.grad, torch.arange(100.0, 110.0))


def _grouped_gemm_step(sizes, weights, offloading, used=None):
    """One grouped-GEMM-like forward and backward: the input split per expert, each piece (of
    those in ``used``, all by default) saved by its own ``mm``; with ``offloading``, in a group
    that a second group makes offloaded. Returns the input's and the weights' gradients."""
    for w in weights:
        w.grad = None
    x = torch.randn(sum(sizes), 16, generator=torch.Generator().manual_seed(5), requires_grad=True)
    used = range(len(sizes)) if used is None else used

    def experts(h):
        pieces = h.split(sizes)
        return torch.cat([pieces[i] @ weights[i] for i in used])

    def forward():  # returns before backward: nothing but autograd holds the input then
        if not offloading:
            return experts(x * 1.0).sum()
        with offload.group("experts", x * 1.0) as h_in:
            y = experts(h_in)
        with offload.group("experts", y) as y_in:
            return y_in.sum()

    forward().backward()
    return [x.grad, *(w.grad for w in weights)]


@pytest.mark.parametrize("saved", ["every piece", "all but the second"])
def test_pieces_of_one_tensor_saved_in_order_are_one_record(configure, saved):
    """A grouped GEMM saves its input split per expert: pieces that follow each other in one
    storage become one record (one copy each way); pieces with a gap between them stay apart."""
    sizes = [3, 5, 0, 8, 4]
    weights = [torch.randn(16, 16, requires_grad=True) for _ in sizes]
    used = None if saved == "every piece" else (0, 2, 3, 4)
    ref = _grouped_gemm_step(sizes, weights, offloading=False, used=used)
    configure(["experts"])
    got = _grouped_gemm_step(sizes, weights, offloading=True, used=used)
    assert [g is None for g in got] == [g is None for g in ref]
    assert all(torch.equal(a, b) for a, b in zip(ref, got) if a is not None)
    s = offload.end_iteration().by_name["experts"]
    assert s.groups_offloaded == 1
    if saved == "every piece":  # 3 + 5 + 0 + 8 + 4 rows: the whole storage, in one record
        assert s.tensors_offloaded == 1 and s.bytes_offloaded == 20 * 16 * 4
    else:  # rows 0-2, then (after the gap of rows 3-7) rows 8-15 and 16-19, which are adjacent
        assert s.tensors_offloaded == 2 and s.bytes_offloaded == (3 + 8 + 4) * 16 * 4


def test_one_small_piece_does_not_keep_the_whole_input_on_the_device(configure):
    """One expert's piece under ``min_tensor_bytes``, kept on the device, kept its whole storage
    there: every other piece's copy read as freeing nothing (``bytes_held_elsewhere``) and the
    group moved no byte. The size test now judges the storage the piece keeps alive."""
    sizes = [64, 64, 2, 64, 64]  # rows of 16 floats: expert 2's 128 bytes are under 1 KiB
    weights = [torch.randn(16, 16, requires_grad=True) for _ in sizes]
    ref = _grouped_gemm_step(sizes, weights, offloading=False)
    configure(["experts"], min_tensor_bytes=1024)
    got = _grouped_gemm_step(sizes, weights, offloading=True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    s = offload.end_iteration().by_name["experts"]
    assert s.bytes_held_elsewhere == 0
    assert s.tensors_offloaded == 1 and s.bytes_offloaded == sum(sizes) * 16 * 4


def test_most_of_the_storage_after_small_pieces_extends_their_record(configure):
    """A piece of at least half its storage records the whole storage (docs/design.md, Views);
    after small pieces of the same group it extends their record instead of making a second,
    overlapping one that would copy their rows twice."""
    sizes = [3, 5, 40, 2]
    weights = [torch.randn(16, 16, requires_grad=True) for _ in sizes]
    ref = _grouped_gemm_step(sizes, weights, offloading=False)
    configure(["experts"])
    got = _grouped_gemm_step(sizes, weights, offloading=True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    s = offload.end_iteration().by_name["experts"]
    assert s.tensors_offloaded == 1 and s.bytes_offloaded == sum(sizes) * 16 * 4


class _SeenStrides(torch.autograd.Function):
    """``x * 2`` that saves ``x`` and notes the strides its backward unpacks."""

    seen: list = []

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        _SeenStrides.seen.append(x.stride())
        return grad * 2 + x * 0


def _glu_step(offloading: bool, saved: str, chunk_bytes_rows: int = 0, packed_views: bool = False):
    """A GLU over ``fc1 = x @ w`` (64 rows of 2·24 columns): ``saved`` says which views of
    ``fc1`` the backward keeps: ``"gate"`` (the activated half alone, the linear half through an
    addition, as Megatron's experts), ``"both"`` (both halves), ``"interleaved"`` (three
    interleaved views, q, k, v-like, by `_SeenStrides`); ``packed_views`` is the first group's.
    Returns the gradients."""
    torch.manual_seed(3)
    x = torch.randn(64, 16, requires_grad=True)
    w = torch.randn(16, 48, requires_grad=True)
    _SeenStrides.seen = []

    def body(h):
        fc1 = h @ w
        if saved == "interleaved":
            parts = fc1.view(64, 16, 3).unbind(-1)
            return sum(_SeenStrides.apply(p) for p in parts)
        gate, lin = fc1.chunk(2, dim=-1)
        if saved == "gate":
            return _SeenStrides.apply(gate) * (lin + 0.0)
        return _SeenStrides.apply(gate) * lin

    def forward():
        if not offloading:
            return body(x * 1.0).sum()
        with offload.group("glu", x * 1.0, packed_views=packed_views) as h_in:
            y = body(h_in)
        with offload.group("glu", y) as y_in:  # a second group: the first one is offloaded
            return y_in.sum()

    forward().backward()
    return [x.grad, w.grad]


@pytest.mark.parametrize("chunk_bytes", [0, 3 * 24 * 4])
def test_a_lone_view_with_gaps_moves_only_its_rows(configure, chunk_bytes):
    """Note [10] of offload.copy_queue: the activated half of a GLU's input, saved without the
    other half, is copied and reloaded as its rows (half of the storage), in pieces of whole
    rows, and comes back with its strides; the gradients are bitwise those without offloading
    (the CPU's SiLU gives other bits for the same values packed)."""
    ref = _glu_step(False, "gate")
    assert _SeenStrides.seen == [(48, 1)]
    configure(["glu"], copy_chunk_bytes=chunk_bytes)
    got = _glu_step(True, "gate")
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert _SeenStrides.seen == [(48, 1)]  # reloaded with its gaps: the strides it was saved with
    s = offload.end_iteration().by_name["glu"]
    # the matmul's input, the gate's rows, and what the product saves: the gate times 2 and
    # `lin + 0.0`; 64 rows of 24 floats each
    assert s.bytes_offloaded == 64 * 16 * 4 + 3 * 64 * 24 * 4 and s.bytes_reloaded == s.bytes_offloaded
    assert s.tensors_offloaded == 4


@pytest.mark.parametrize("saved, strides", [("gate", [(24, 1)]), ("both", [(48, 1)])])
def test_a_group_with_packed_views_gets_its_rows_packed(configure, monkeypatch, saved, strides):
    """Note [10] of offload.copy_queue: a group opened with ``packed_views`` gets a view with
    gaps back as its rows packed (contiguous strides), with no spread; ``_SeenStrides``'s
    backward gives the same bits for it. Both halves saved: one record of the whole storage,
    nothing packed, the view's own strides."""
    ref = _glu_step(False, saved)
    manager = configure(["glu"])
    spread = []
    monkeypatch.setattr(manager.copies, "spread", spread.append)
    got = _glu_step(True, saved, packed_views=True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert _SeenStrides.seen == strides and spread == []
    s = offload.end_iteration().by_name["glu"]
    assert s.bytes_reloaded == s.bytes_offloaded > 0


def test_packed_views_must_be_a_bool():
    with pytest.raises(OffloadTypeError, match="packed_views must be a bool"):
        offload.group("glu", packed_views="yes")


def test_a_lone_view_with_gaps_waits_for_its_backward_packed(configure):
    """Note [10] of offload.copy_queue: between its prefetch and its backward, the reload of the
    gate's rows holds their bytes alone, not their span's; its unpack spreads them into a buffer
    of the span, and the view comes back with its strides and bitwise the same gradients."""
    held: list = []
    engine: list = []  # the manager, once configured

    class Probe(torch.autograd.Function):
        """Its backward runs in the GLU group's backward, before the gate's is unpacked."""

        @staticmethod
        def forward(ctx, y):
            return y * 1.0

        @staticmethod
        def backward(ctx, grad):
            held.extend((r.numel, r.end - r.start, r.dev.numel()) for m in engine for h in m.live_handlers
                        for group in h.groups for r in group.records if r.pitch and r.dev is not None)
            return grad

    def step(offloading: bool):
        torch.manual_seed(3)
        x = torch.randn(64, 16, requires_grad=True)
        w = torch.randn(16, 48, requires_grad=True)
        _SeenStrides.seen = []

        def body(h):
            gate, lin = (h @ w).chunk(2, dim=-1)
            return Probe.apply(_SeenStrides.apply(gate) * (lin + 0.0))

        if not offloading:
            (body(x * 1.0) * 2).sum().backward()
            return [x.grad, w.grad]
        with offload.group("glu", x * 1.0) as h:
            y = body(h)
        with offload.group("glu", y) as y_in:  # a second group: the first one is offloaded
            loss = (y_in * 2).sum()
        loss.backward()
        return [x.grad, w.grad]

    ref = step(False)
    assert held == []
    manager = configure(["glu"], min_tensor_bytes=0)
    engine.append(manager)
    got = step(True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert _SeenStrides.seen == [(48, 1)]
    assert held == [(64 * 24, 63 * 48 + 24, 64 * 24)]  # 64 rows of 24: packed, where the span is 3048
    s = offload.end_iteration().by_name["glu"]
    assert s.reloads_prefetched == 1 and s.reloads_on_demand == 0
    assert all(r.dev is None for h in manager.live_handlers for g in h.groups for r in g.records)


@pytest.mark.parametrize("saved", ["both", "interleaved"])
def test_views_saved_together_keep_their_storage_and_strides(configure, saved):
    """A second view of the storage in the same group makes its record the whole storage: one
    copy each way, and the views come back with their strides and aliasing."""
    ref = _glu_step(False, saved)
    ref_seen = list(_SeenStrides.seen)
    configure(["glu"])
    got = _glu_step(True, saved)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert _SeenStrides.seen == ref_seen != []
    s = offload.end_iteration().by_name["glu"]
    input_and_fc1 = 64 * 16 * 4 + 64 * 48 * 4  # the matmul's input, and one record of fc1
    if saved == "both":  # and the gate times 2, which the product saves
        assert s.bytes_offloaded == input_and_fc1 + 64 * 24 * 4
    else:
        assert s.bytes_offloaded == input_and_fc1


def test_gapped_rows_reads_the_rows_of_a_view():
    from offload.group import gapped_rows

    x = torch.empty(16, 8)
    y = torch.empty(4, 3, 5, 6)
    cases = [(x[:, :4], (16, 4, 8)), (x[:, 4:], (16, 4, 8)), (x[::2], (8, 8, 16)),
             (y[..., :2], (60, 2, 6)), (y[:, 0], (4, 30, 90)),
             (x[:, :5], None),  # less than half of each row is a gap: the span
             (x, None), (x.t(), None), (y[..., ::2], None), (torch.empty(8).expand(4, 8), None)]
    for view, expected in cases:
        assert gapped_rows(view.size(), view.stride()) == expected, (view.size(), view.stride())


def test_tensor_held_elsewhere_is_not_copied(configure):
    """A tensor that something else holds stays on the GPU: copying it would free nothing."""
    configure(["g"])
    w = torch.randn(256, requires_grad=True)
    keep = []

    def region(h, hold):
        with offload.group("g", h) as h1:
            out = h1.exp()  # exp saves its output
        if hold:
            keep.append(out)
        return out * 1.0

    h = w * 1.0
    for hold in (True, False, False):
        h = region(h, hold)
    h.sum().backward()
    s = offload.end_iteration().by_name["g"]
    assert s.bytes_held_elsewhere == 256 * 4 and s.bytes_offloaded == 256 * 4 and s.groups_kept == 1
    assert torch.equal(w.grad, (w.exp().exp().exp() * w.exp().exp() * w.exp()).detach())


def test_module_output_saved_by_a_module_not_offloaded(configure):
    """core_attn's output is saved again by attn_proj: offloading core_attn alone leaves it on
    the GPU (held by attn_proj); offloading both copies it once."""
    model = build_gpt(32, 4, 3)
    x, g = seeded_pair(0, 16, 2, 32)
    held = {}
    for modules in (["core_attn"], ["core_attn", "attn_proj"]):
        configure(modules)
        h = offload.attach(model, GPT_MAPPING)
        train_step(model, x, g)
        stats = offload.end_iteration()
        held[len(modules)] = sum(s.bytes_held_elsewhere for s in stats.by_name.values())
        h.remove()
    assert held[1] > 0 and held[2] == 0


def test_address_reused_after_free_is_not_deduplicated(configure):
    """A storage freed after its copy and a new one at the same address (what a caching
    allocator hands out) must not share a record: backward gets the new tensor's values, not
    the old copy's. Both storages are built on one block of memory, so the second one is at
    the first one's address for certain (the CPU allocator reuses a freed address only
    sometimes)."""
    configure(["g"])
    n = 256
    memory = numpy.empty(n, dtype=numpy.float32)
    w = torch.randn(n, requires_grad=True)
    t = torch.from_numpy(memory).fill_(1.0)
    address, first = t.data_ptr(), StorageWeakRef(t.untyped_storage())
    with offload.group("g", w) as w_in:
        a = w_in * t  # saves t (only: w_in's gradient needs t, t needs none)
    del t  # the engine holds t's storage alone now: it is copied out and then freed
    with offload.group("g", a) as a_in:
        b = a_in * 1.0  # saves nothing; closing it decides the first group's offload
    with offload.group("g", b) as b_in:
        b = b_in * 1.0  # saves nothing; opening it started the first group's copy
    offload.get_manager().streams.synchronize()  # the copy has run (the CPU fallback's copies run late)
    with offload.group("g", b) as b_in:
        # opening a group frees the memory of the copies that are done: t's storage is gone
        assert first.expired()
        u = torch.from_numpy(memory).fill_(2.0)  # a new storage, at the freed address
        assert u.data_ptr() == address
        c = b_in * u  # saves u
    del u
    with offload.group("g", c) as c_in:  # so that u's group is not the last one (kept)
        d = c_in * 1.0
    d.sum().backward()
    s = offload.end_iteration().by_name["g"]
    # both storages were copied out, each in its own record, and came back
    assert s.groups_offloaded == 2 and s.tensors_offloaded == 2
    assert s.bytes_offloaded == s.bytes_reloaded == 2 * n * 4
    assert torch.equal(w.grad, torch.full((n,), 1.0 * 2.0))  # t * u; a shared record gives 1 * 1


def test_pipeline_like_order_offloads_last_group(configure):
    """F0 F1 B0 B1: no chunk's backward follows its own forward, so nothing is kept."""
    model = build_gpt(32, 4, 2)
    ref_model = copy.deepcopy(model)
    configure(["core_attn", "fc1"])
    offload.attach(model, GPT_MAPPING)
    xs = [seeded_pair(i, 8, 2, 32) for i in range(2)]
    ref_outs = [ref_model(x.requires_grad_()) for x, _ in xs]
    for out, (_, g) in zip(ref_outs, xs):
        out.backward(g)
    ref = {n: p.grad.clone() for n, p in ref_model.named_parameters()}
    outs = [model(x) for x, _ in xs]
    for out, (_, g) in zip(outs, xs):
        out.backward(g)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert first_difference(ref, got) is None
    stats = offload.end_iteration()
    assert stats.handlers == 2
    for name in ("core_attn", "fc1"):
        assert stats.by_name[name].groups_kept == 0
        assert stats.by_name[name].groups_offloaded == 4


def test_gradient_accumulation_keeps_last_group_of_each_microbatch(configure):
    model = build_gpt(32, 4, 3)
    configure(["fc1"])
    offload.attach(model, GPT_MAPPING)
    for mb in range(3):
        x, g = seeded_pair(mb, 8, 2, 32)
        model(x).backward(g)
    stats = offload.end_iteration()
    assert stats.handlers == 3
    assert stats.by_name["fc1"].groups_kept == 3 and stats.by_name["fc1"].groups_offloaded == 6


def test_retain_graph_second_backward(configure):
    model = build_gpt(32, 4, 2)
    ref_model = copy.deepcopy(model)
    configure(list(GPT_MAPPING))
    offload.attach(model, GPT_MAPPING)
    x, g = seeded_pair(0, 8, 2, 32)
    for m in (ref_model, model):
        out = m(x)
        out.backward(g, retain_graph=True)
        out.backward(g)
    ref = {n: p.grad for n, p in ref_model.named_parameters()}
    got = {n: p.grad for n, p in model.named_parameters()}
    assert first_difference(ref, got) is None
    offload.end_iteration()
    assert offload.get_manager().live_handlers == []


def test_backward_twice_without_retain_graph_raises(configure):
    model = build_gpt(32, 4, 2)
    configure(list(GPT_MAPPING))
    offload.attach(model, GPT_MAPPING)
    x, g = seeded_pair(0, 8, 2, 32)
    out = model(x)
    out.backward(g)
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.backward(g)


def test_forward_only_and_no_grad_passes_disturb_nothing(configure):
    model = build_gpt(32, 4, 3)
    ref_model = copy.deepcopy(model)
    configure(list(GPT_MAPPING))
    offload.attach(model, GPT_MAPPING)
    x, g = seeded_pair(0, 8, 2, 32)
    _, ref = train_step(ref_model, x, g)
    # evaluation under no_grad between forward and backward: no group opens
    model.zero_grad(set_to_none=True)
    xi = x.detach().requires_grad_()
    out = model(xi)
    with torch.no_grad():
        model(x)
    out.backward(g)
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    got["<input>"] = xi.grad
    assert first_difference(ref, got) is None
    stats = offload.end_iteration()
    assert stats.by_name["fc1"].groups_kept == 1
    # a forward with grad enabled whose graph is dropped leaves nothing behind
    model(x).sum()
    offload.end_iteration()
    manager = offload.get_manager()
    assert manager.live_handlers == [] and manager.pool.bytes_in_use == 0
    _, again = train_step(model, x, g)
    assert first_difference(ref, again) is None


def test_exception_inside_forward_leaves_engine_usable(configure):
    model = build_gpt(32, 4, 2)
    ref_model = copy.deepcopy(model)
    configure(list(GPT_MAPPING))
    offload.attach(model, GPT_MAPPING)
    x, g = seeded_pair(0, 8, 2, 32)

    def boom(mod, args):
        raise ValueError("boom")

    h = model.layers[1].mlp.linear_fc1.register_forward_pre_hook(boom)
    with pytest.raises(ValueError, match="boom"):
        model(x)
    h.remove()
    manager = offload.get_manager()
    assert not manager.in_group
    _, ref = train_step(ref_model, x, g)
    _, got = train_step(model, x, g)
    assert first_difference(ref, got) is None
    offload.end_iteration()
    assert manager.live_handlers == [] and manager.pool.bytes_in_use == 0


def test_steady_state_allocates_no_pinned_memory(configure):
    model = build_gpt(32, 4, 3)
    configure(list(GPT_MAPPING))
    offload.attach(model, GPT_MAPPING)
    allocations = []
    for it in range(6):
        x, g = seeded_pair(it, 8, 2, 32)
        train_step(model, x, g)
        allocations.append(offload.end_iteration().pinned_allocations)
    assert allocations[0] > 0 and len(set(allocations[1:])) == 1 and allocations[1] == allocations[0]
    assert offload.get_manager().pool.bytes_in_use == 0


def test_nested_groups_of_different_names(configure):
    configure(["outer", "inner"])
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16)
    with offload.group("outer", w) as w1:
        a = torch.tanh(x @ w1)
        with offload.group("inner", a) as a1:
            b = torch.sigmoid(a1 @ w1)
        c = torch.sin(b)
    with offload.group("outer", c) as c1:
        with offload.group("inner", c1) as c2:
            d = c2.exp()
    d.sum().backward()
    grad = w.grad.clone()
    w.grad = None
    ((torch.sin(torch.sigmoid(torch.tanh(x @ w) @ w))).exp()).sum().backward()
    assert torch.equal(grad, w.grad)
    stats = offload.end_iteration().by_name
    assert stats["outer"].groups == 2 and stats["inner"].groups == 2


def test_disabled_name_runs_untouched(configure):
    configure(["core_attn"])
    offload.get_manager().declare_names(["core_attn"])
    x = torch.randn(4, requires_grad=True)
    with offload.group("fc1", x) as y:
        assert y is x  # not enabled: inputs pass through, no marker
        z = (y * 2).sin()
    z.sum().backward()
    assert offload.end_iteration().by_name == {}


def test_suspended_steps_open_no_group_and_offloading_resumes_after(configure):
    """`offload.suspended` (an A/B step-time baseline in one process): inside it no group opens
    and nothing moves; after it, and after an exception inside it, the names offload again."""
    model = build_gpt(64, 4, 3)
    ref_model = copy.deepcopy(model)
    configure(["core_attn"])
    offload.attach(model, GPT_MAPPING)
    for it, suspend in enumerate([True, False, True, False]):
        x, g = seeded_pair(it, 16, 2, 64)
        _, ref = train_step(ref_model, x, g)
        with offload.suspended() if suspend else contextlib.nullcontext():
            _, got = train_step(model, x, g)
        assert first_difference(ref, got) is None
        stats = offload.end_iteration().by_name.get("core_attn")
        if suspend:
            assert stats is None or (stats.groups, stats.bytes_offloaded) == (0, 0)
        else:
            assert (stats.groups, stats.groups_offloaded) == (3, 2) and stats.bytes_offloaded > 0
    with pytest.raises(RuntimeError, match="inside"):
        with offload.suspended(), offload.suspended():
            raise RuntimeError("inside")
    assert offload.get_manager().suspended == 0


def test_begin_chunk_numbers_microbatches(configure):
    configure(["a"])
    labels = []
    import offload.nvtx as nv

    real = nv.push
    nv.push = lambda m: labels.append(m)
    try:
        w = torch.randn(8, requires_grad=True)
        for mb in range(2):
            offload.begin_chunk(chunk_id=1)
            h = w * 1  # not a view of a leaf: offloaded (a range is named only for real copies)
            for _ in range(2):
                with offload.group("a", h) as hin:
                    h = hin.sin() * 1
            h.sum().backward()
    finally:
        nv.push = real
    assert [m for m in labels if m.startswith("offload/")] == [
        "offload/a/L0/c1/mb0", "offload/a/L0/c1/mb1",
    ]


def _record_engine_order(manager: Any, monkeypatch: Any) -> list[str]:
    """A list that records, in order, each copy's NVTX label (``offload/a/L0/...``), each group
    open (``open a``) and each host sync the model reports (``sync``)."""
    import offload.nvtx as nv

    order: list[str] = []
    monkeypatch.setattr(nv, "push", lambda label: order.append(label))
    real_open, real_sync = manager.open_group, manager.after_host_sync
    monkeypatch.setattr(manager, "open_group",
                        lambda name, *args: order.append("open " + name) or real_open(name, *args))
    monkeypatch.setattr(manager, "after_host_sync", lambda: order.append("sync") or real_sync())
    return order


def _layer(name: str, fn: Any, h: torch.Tensor) -> torch.Tensor:
    """``fn`` in group ``name``; nothing but the group's handle holds its input once it returns."""
    with offload.group(name, h) as hin:
        return fn(hin) * 1


def _ab_step(w: torch.Tensor, sync_layers: tuple[int, ...] = ()) -> torch.Tensor:
    """One step of 4 layers, each a group ``a`` (sin) then a group ``b`` (cos), with a host sync
    reported between them in ``sync_layers``; returns ``w``'s gradient (and clears it)."""
    h = w * 1
    for k in range(4):
        h = _layer("a", torch.sin, h)
        if k in sync_layers:
            offload.after_host_sync()
        h = _layer("b", torch.cos, h)
    h.sum().backward()
    grad, w.grad = w.grad, None
    return grad


def _ab_reference(w: torch.Tensor) -> torch.Tensor:
    """`_ab_step`'s gradient without offloading."""
    v = w.detach().clone().requires_grad_(True)
    h = v * 1
    for _ in range(4):
        h = (h.sin() * 1).cos() * 1
    h.sum().backward()
    return v.grad


def _before_each_copy(order: list[str], *items: str) -> dict[str, int]:
    """Each copy out (``aL0`` for ``offload/a/L0/...``) -> how many of ``items`` came before it."""
    return {m.split("/")[1] + m.split("/")[2]: sum(order[:i].count(x) for x in items)
            for i, m in enumerate(order) if m.startswith("offload/")}


def _issue_points(order: list[str]) -> dict[str, str]:
    """Each copy out (``aL0``) -> the engine entry point it was issued from (the last of them
    before it in ``order``)."""
    points = {}
    last = None
    for item in order:
        if item.startswith("offload/"):
            points[item.split("/")[1] + item.split("/")[2]] = last
        elif not item.startswith("reload/"):
            last = item
    return points


def test_a_chunk_known_from_its_previous_forward_issues_each_copy_one_layer_earlier(configure, monkeypatch):
    """Note [7] of offload.copy_queue: in a chunk's first forward a group is known not to be the
    last of its name when the next group of its name closes; from its second forward on (the
    previous one says which layer was the last) when it closes itself. Its copies are issued at
    the next group's open either way: a layer earlier from the second forward on, so that at
    the forward's end only the second-to-last layer's copies are in flight. Gradients stay exact."""
    order = _record_engine_order(configure(["a", "b"]), monkeypatch)
    torch.manual_seed(0)
    w = torch.randn(64, requires_grad=True)
    for it in range(3):
        order.clear()
        assert torch.equal(_ab_step(w), _ab_reference(w))
        total = offload.end_iteration().total()
        assert (total.groups_offloaded, total.groups_kept, total.bytes_held_elsewhere) == (6, 2, 0)
        opens_before = _before_each_copy(order, "open a", "open b")
        if it == 0:  # a/L0 is decided when a/L1 closes, issued at b/L1's open (the 4th open)
            assert opens_before == {"aL0": 4, "bL0": 5, "aL1": 6, "bL1": 7, "aL2": 8, "bL2": 8}
        else:  # a/L0 is decided when it closes, issued at b/L0's open (the 2nd)
            assert opens_before == {"aL0": 2, "bL0": 3, "aL1": 4, "bL1": 5, "aL2": 6, "bL2": 7}


@pytest.mark.parametrize("sync_layers", [(0, 1, 2, 3), (0,)], ids=["sync_every_layer", "sync_in_layer_0_only"])
def test_copies_are_issued_after_the_models_host_syncs(configure, monkeypatch, sync_layers):
    """Note [9] of offload.copy_queue: once the model said it synced with the host in a chunk
    forward (`offload.after_host_sync`, as an MoE layer's dispatcher does between the norm and
    the experts), the decided copies are issued there, and a group open issues only deferred
    groups of its own name: with a sync every layer, every copy is issued at a sync; in layers
    without one, a group's copies are issued at the next open of its name, a layer on. Outside
    a forward it does nothing. Gradients stay exact."""
    manager = configure(["a", "b"])
    offload.after_host_sync()  # no forward: nothing to do, no error
    order = _record_engine_order(manager, monkeypatch)
    torch.manual_seed(0)
    w = torch.randn(64, requires_grad=True)
    for it in range(3):
        order.clear()
        assert torch.equal(_ab_step(w, sync_layers), _ab_reference(w))
        total = offload.end_iteration().total()
        assert (total.groups_offloaded, total.groups_kept, total.bytes_held_elsewhere) == (6, 2, 0)
        if it == 0:
            continue
        if len(sync_layers) == 4:  # each group is issued at the first sync after its close
            assert _issue_points(order) == dict.fromkeys(["aL0", "bL0", "aL1", "bL1", "aL2", "bL2"], "sync")
            assert _before_each_copy(order, "sync") == {"aL0": 1, "bL0": 2, "aL1": 2, "bL1": 3, "aL2": 3, "bL2": 4}
        else:  # a/L0 at the only sync; then X/Lk at the open of X/L(k+1), the (k+2)-th of its name
            assert _issue_points(order) == {"aL0": "sync", "bL0": "open b", "aL1": "open a", "bL1": "open b",
                                            "aL2": "open a", "bL2": "open b"}
            opens_of_name = {k: n for item in ("open a", "open b")
                             for k, n in _before_each_copy(order, item).items() if k[0] == item[-1]}
            assert opens_of_name == {"aL0": 1, "bL0": 2, "aL1": 3, "bL1": 3, "aL2": 4, "bL2": 4}


class _SyncingLayer(nn.Module):
    """attention (group ``a``), a router that reads its counts on the host, experts (group ``b``)."""

    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(16, 16)
        self.experts = nn.Linear(16, 16)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = torch.sin(self.attn(h * 1)) * 1  # what attn saves is ours alone once it returns
        (h > 0).sum().tolist()  # the router's host sync
        return torch.cos(self.experts(h)) * 1


def test_attach_host_syncs_reports_each_sync_and_copies_follow_it(configure, monkeypatch):
    """``attach(..., host_syncs=patterns)``: each matched module's forward pre-hook reports a
    host sync (Note [9] of offload.copy_queue), once per layer, and after a first step no copy
    out is issued between a layer's attention and its sync. A pattern that matches nothing
    raises at once with nothing attached; `remove` takes the hooks away. Gradients exact."""
    torch.manual_seed(0)
    model = nn.Sequential(*[_SyncingLayer() for _ in range(4)])
    ref = copy.deepcopy(model)
    manager = configure(["a", "b"])
    mapping = {"a": "*.attn", "b": "*.experts"}
    with pytest.raises(offload.UnknownModuleError, match="'\\*.router' in host_syncs matches no submodule"):
        offload.attach(model, mapping, host_syncs=["*.experts", "*.router"])
    assert all(not m._forward_pre_hooks for m in model.modules())
    handle = offload.attach(model, mapping, host_syncs="*.experts")
    order = _record_engine_order(manager, monkeypatch)
    x = torch.randn(8, 16)
    for _ in range(2):
        order.clear()
        model(x).sum().backward()
        offload.end_iteration()
    assert order.count("sync") == 4
    copies = [m for m in order if m.startswith("offload/")]
    assert sorted(copies) == sorted(f"offload/{n}/L{k}/mb0" for n in "ab" for k in range(3))  # the last layer kept
    issued_after = {m: next(x for x in reversed(order[:order.index(m)]) if x in ("sync", "open a")) for m in copies}
    assert set(issued_after.values()) == {"sync"}, issued_after
    ref(x).sum().backward()
    assert all(torch.equal(p.grad, q.grad / 2) for p, q in zip(ref.parameters(), model.parameters()))
    handle.remove()
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_a_forward_shorter_than_the_previous_one_offloads_its_last_group_and_stays_exact(configure):
    """Note [7]: the previous forward is a guess. When this one has fewer groups of a name, its
    last group was decided at its close as not the last and is offloaded, though the chunk's own
    backward comes next; the guess is right again from the next forward on."""
    configure(["a"])
    torch.manual_seed(0)
    w = torch.randn(64, requires_grad=True)

    def layer(h: torch.Tensor) -> torch.Tensor:  # nothing but the group's handle holds its input after it
        with offload.group("a", h) as hin:
            return hin.sin() * 1

    def step(layers: int) -> tuple[torch.Tensor, Any]:
        h = w * 1
        for _ in range(layers):
            h = layer(h)
        h.sum().backward()
        grad, w.grad = w.grad, None
        return grad, offload.end_iteration().by_name["a"]

    def reference(layers: int) -> torch.Tensor:
        v = w.detach().clone().requires_grad_(True)
        h = v * 1
        for _ in range(layers):
            h = h.sin() * 1
        h.sum().backward()
        return v.grad

    for layers, kept in [(4, 1), (3, 0), (3, 1), (4, 1)]:
        grad, stats = step(layers)
        assert torch.equal(grad, reference(layers))
        assert (stats.groups, stats.groups_kept, stats.groups_offloaded) == (layers, kept, layers - kept), layers


def test_copy_in_pieces_covers_every_element():
    from offload.streams import copy_in_pieces

    src = torch.arange(1003, dtype=torch.float32)
    for chunk_bytes in (0, 4, 40, 4000, 4012, 1 << 20):
        dst = torch.zeros_like(src)
        copy_in_pieces(dst, src, chunk_bytes)
        assert torch.equal(dst, src), chunk_bytes


def test_host_copy_is_a_copy_of_the_span():
    """The CPU fallback's copy (a byte copy where that is the same) writes what `copy_in_pieces`
    of the span writes: offsets, strided sources, pieces, conjugate and negative views; a span
    past a shrunk storage raises as the view would."""
    from offload.streams import Rows, _host_copy, _span, copy_in_pieces

    base = torch.arange(40, dtype=torch.float32)
    cases = [(base, 0, 40, 0), (base, 5, 30, 0), (base.view(4, 10)[:, 2:], 2, 36, 0), (base, 3, 20, 16),
             (torch._neg_view(base), 4, 10, 0), (torch.randn(6, dtype=torch.complex64).conj(), 1, 4, 0)]
    for src, start, numel, chunk_bytes in cases:
        expected = torch.empty(numel, dtype=src.dtype)
        copy_in_pieces(expected, _span(src, start, numel), chunk_bytes)
        got = torch.full((numel,), float("nan"), dtype=src.dtype)
        _host_copy(got, src, start, None, chunk_bytes)
        assert torch.equal(got, expected), (start, numel, chunk_bytes)
    for chunk_bytes in (0, 8, 12, 1000):  # rows of 3 elements, 10 apart, from element 2 on, packed
        got = torch.full((14,), float("nan"))
        _host_copy(got[:12], base, 2, Rows(4, 3, 10), chunk_bytes)
        assert torch.equal(got[:12], base.view(4, 10)[:, 2:5].reshape(-1)), chunk_bytes
        assert got[12:].isnan().all(), chunk_bytes  # nothing written past the rows
    shrunk = torch.arange(8, dtype=torch.float32)
    shrunk.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match="out of bounds"):
        _host_copy(torch.empty(8), shrunk, 0, None, 0)


@pytest.mark.parametrize("chunk_bytes", [0, 64, 1000])
def test_copies_in_pieces_keep_gradients_bitwise(configure, chunk_bytes):
    model = build_gpt(64, 4, 3)
    ref_model = copy.deepcopy(model)
    configure(list(GPT_MAPPING), copy_chunk_bytes=chunk_bytes)
    offload.attach(model, GPT_MAPPING)
    for it in range(2):
        x, g = seeded_pair(it, 16, 2, 64)
        ref_out, ref = train_step(ref_model, x, g)
        out, got = train_step(model, x, g)
        assert torch.equal(out, ref_out)
        assert first_difference(ref, got) is None
        assert offload.end_iteration().total().bytes_offloaded > 0


@pytest.mark.parametrize("modules", [["core_attn"], list(GPT_MAPPING)])
def test_the_forwards_last_group_frees_the_copies_in_flight(configure, modules):
    """When a chunk's forward's last group closes (learned from the chunk's previous forward),
    nothing offloaded is still in flight: the forward ends, and backward starts, with the
    memory of every offloaded group freed. Only there: at the last group of an earlier name
    the copies go on under the in-flight bound, as in every other layer (waiting there would
    expose the copy of that name's second-to-last group). The first forward cannot know
    which group is last."""
    model = build_gpt(32, 4, 4)
    ref_model = copy.deepcopy(model)
    manager = configure(modules)  # the CPU fallback's copies run only when waited for
    offload.attach(model, GPT_MAPPING)
    close_group = manager.close_group
    copies_after_close = {}  # group label -> labels deferred or in flight right after it closed

    def watched_close(group, name):
        close_group(group, name)
        if group is not None:
            copies_after_close[group.label] = [g.label for g in (*manager.copies.deferred, *manager.copies.inflight)]

    manager.close_group = watched_close
    in_flight_at_forward_end = []
    for it in range(3):
        copies_after_close.clear()
        x, g = seeded_pair(it, 8, 2, 32)
        model.zero_grad(set_to_none=False)
        xx = x.detach().requires_grad_(True)
        out = model(xx)
        in_flight_at_forward_end.append([group.label for group in manager.copies.inflight])
        out.backward(g)
        _, ref = train_step(ref_model, x, g)
        got = {n: p.grad for n, p in model.named_parameters()}
        got["<input>"] = xx.grad
        assert first_difference(ref, got) is None
        stats = offload.end_iteration()
        assert stats.total().groups_kept == len(modules)
        if it > 0 and len(modules) > 1:  # attn_norm's last group is not the forward's last
            assert copies_after_close["attn_norm/L3/mb0"], "the last group of a name waited for the copies"
            assert copies_after_close["fc2/L3/mb0"] == []
    assert in_flight_at_forward_end[0]  # the first forward: the group before the last one
    assert in_flight_at_forward_end[1:] == [[], []]
    assert manager.live_handlers == []


@pytest.mark.parametrize("modules", [["core_attn"], list(GPT_MAPPING)])
def test_copies_into_backward_leave_the_forwards_copies_running_until_the_backward_starts(configure, modules):
    """``copies_into_backward``: the forward's last group waits for nothing, so the
    second-to-last layer's copies (and, within the in-flight bound, the layer's before) are
    still in flight when the forward returns; the backward's
    start waits for them and frees their memory before any reload. Gradients stay exact, with
    copies that complete late (the CPU fallback), and every handler retires."""
    model = build_gpt(32, 4, 4)
    ref_model = copy.deepcopy(model)
    manager = configure(modules, copies_into_backward=True)
    offload.attach(model, GPT_MAPPING)
    begin_backward = manager.chunks.begin_backward
    in_flight_after_backward_began = []

    def watched(handler):
        begin_backward(handler)
        in_flight_after_backward_began.append(list(manager.copies.inflight))

    manager.chunks.begin_backward = watched
    in_flight_at_forward_end = []
    for it in range(3):
        x, g = seeded_pair(it, 8, 2, 32)
        model.zero_grad(set_to_none=False)
        xx = x.detach().requires_grad_(True)
        out = model(xx)
        in_flight_at_forward_end.append(sorted(group.label for group in manager.copies.inflight))
        out.backward(g)
        _, ref = train_step(ref_model, x, g)
        got = {n: p.grad for n, p in model.named_parameters()}
        got["<input>"] = xx.grad
        assert first_difference(ref, got) is None
        assert offload.end_iteration().total().groups_kept == len(modules)
    if modules == ["core_attn"]:  # with every name, layer 3's groups give the fallback's copies time to end
        assert in_flight_at_forward_end[1] == in_flight_at_forward_end[2] == ["core_attn/L1/mb0", "core_attn/L2/mb0"]
    assert in_flight_after_backward_began == [[], [], []]
    assert manager.live_handlers == []


def test_copies_into_backward_must_be_a_bool_and_is_not_for_the_planner():
    with pytest.raises(OffloadTypeError, match="copies_into_backward must be True or False, got 1"):
        offload.OffloadConfig(modules="core_attn", copies_into_backward=1)
    with pytest.raises(OffloadValueError, match="leave copies_into_backward unset"):
        offload.configure("auto", copies_into_backward=True, memory_budget="1GiB")


def test_a_host_stream_wait_takes_the_event_as_it_is_when_issued():
    """As on a GPU (``cudaStreamWaitEvent``), recording an event again after a wait was issued
    does not move that wait: the CPU fallback queues the event's position, not the event."""
    from offload.streams import HostStreams

    streams = HostStreams()
    ran = []
    streams.d2h.enqueue(lambda: ran.append("first"))
    event = streams.event()
    event.record(streams.d2h)
    streams.h2d.wait_event(event)
    streams.h2d.enqueue(lambda: ran.append("after the wait"))
    streams.d2h.enqueue(lambda: ran.append("second"))
    event.record(streams.d2h)  # again, later: the wait above still means "after first"
    streams.h2d.run_until(streams.h2d.issued)
    assert ran == ["first", "after the wait"]


def test_a_reload_orders_its_stream_with_one_reused_event(configure, monkeypatch):
    """Note [2] of offload.copy_queue: the H2D stream waits for the compute stream through one
    event the queue records again for each reload, not ``wait_stream`` (an event made per
    reload on the hot path); gradients stay exact."""
    from offload.streams import _HostStream

    calls = []
    monkeypatch.setattr(_HostStream, "wait_stream", lambda self, other: calls.append(self.name))
    model = build_gpt(64, 4, 3)
    ref_model = copy.deepcopy(model)
    configure(["core_attn", "fc1"])
    offload.attach(model, GPT_MAPPING)
    for it in range(2):
        x, g = seeded_pair(it, 16, 2, 64)
        ref_out, ref = train_step(ref_model, x, g)
        out, got = train_step(model, x, g)
        assert torch.equal(out, ref_out) and first_difference(ref, got) is None
        stats = offload.end_iteration()
        assert sum(s.groups_offloaded for s in stats.by_name.values()) == 4  # 2 layers of 3, 2 names
    assert calls == []


@pytest.mark.filterwarnings("ignore:offload. nothing was offloaded")
@pytest.mark.parametrize("flow", ["accumulation", "pipeline_order", "dropped_forward", "retain_graph",
                                  "reset_while_alive", "recompute"])
def test_retired_handlers_leave_no_reference_cycles(configure, flow):
    """A retired handler, its groups, records and events are freed by reference counting alone:
    with Python's cyclic collector off (``gc.disable()``, Megatron's ``--manual-gc``) nothing of
    the engine piles up, and with it on nothing lives into an old generation to be found there."""
    model = build_gpt(32, 4, 3)
    mapping = dict(GPT_MAPPING)
    flows = engine_flows(model, *seeded_pair(0, 8, 2, 32))
    if flow == "recompute":
        recompute(model, "layers.*.mlp")
        mapping.update(fc1="layers.*.mlp.inner.linear_fc1", mlp_act="layers.*.mlp.inner.activation",
                       fc2="layers.*.mlp.inner.linear_fc2")
        flows[flow] = flows["accumulation"]
    configure(list(mapping))
    offload.attach(model, mapping)
    flows[flow]()  # warm-up: the pool's buffers, the engine's lasting objects
    assert cyclic_garbage(lambda: [flows[flow]() for _ in range(3)]) == {}
    assert offload.get_manager().live_handlers == []


def _chunk_holding_its_input(w: torch.Tensor, scale: float, keep: list | None = None,
                             freed: list | None = None, layers: int = 3, freed_at: int = 1) -> torch.Tensor:
    """A chunk forward of ``layers`` groups that holds its first group's input until it
    returns, as Megatron's ``GPTModel.forward`` holds the embedding's output (``keep``: held
    past the return too); returns the microbatch's loss. ``freed`` gets, when the backward
    reaches group ``freed_at``, whether that input's storage was gone by then."""
    x = w * scale
    if keep is not None:
        keep.append(x)
    gone = StorageWeakRef(x.untyped_storage())
    h = x
    for i in range(layers):
        with offload.group("g", h) as h1:
            h = (h1 * h1).tanh()  # mul saves its input: group 0 saves x
        if i == freed_at and freed is not None:
            h.register_hook(lambda grad: freed.append(gone.expired()))
    return h.sum()


def _forwards_then_backwards(configure, names: list[str], keep: list | None = None,
                             freed: list | None = None) -> tuple[torch.Tensor, object]:
    """Two microbatches' forwards before either backward, as a pipeline runs them; the
    gradient and the statistics of ``g``."""
    configure(names)
    torch.manual_seed(0)
    w = torch.randn(256, requires_grad=True)
    losses = []
    for mb in range(2):
        offload.begin_chunk(0, mb)
        losses.append(_chunk_holding_its_input(w, 1.0 + mb, keep, freed))
    for loss in losses:
        loss.backward()
    return w.grad, offload.end_iteration().by_name.get("g")


def test_a_tensor_held_until_the_forward_returns_is_copied_at_its_end(configure):
    """Note [8] of offload.copy_queue: group 0's input is held by the chunk's forward when the
    group's copies are issued (a layer later), so it stays; when the forward is over and another
    forward follows, it is only ours, and it is copied then: nothing is left held elsewhere, it
    is reloaded for its backward, and the gradient is the one without offloading. Its storage
    is gone before the backward of each microbatch reaches group 1 (after the backward's start,
    where the engine frees what it copied out)."""
    freed: list = []
    grad, s = _forwards_then_backwards(configure, ["g"], freed=freed)
    ref, _ = _forwards_then_backwards(configure, [])
    assert torch.equal(grad, ref)
    assert freed == [True, True]
    # per microbatch: x and the three tanh outputs (each owned by the group whose mul saves it next)
    assert s.bytes_held_elsewhere == 0 and s.bytes_offloaded == 2 * 4 * 256 * 4, s
    assert s.groups_offloaded == 2 * 3 and s.reloads_prefetched + s.reloads_on_demand == 2 * 3, s


def test_the_second_look_adds_to_copies_still_in_flight(configure):
    """When the forward is over, group 0's own copies (its matmuls' other inputs) may still be
    in flight (the engine's first forward of a chunk does not wait for them at its end): the
    held input's copy joins them, and the group is freed once all are done."""
    configure(["g"], min_tensor_bytes=1024)
    torch.manual_seed(0)
    w = torch.randn(64, 32, requires_grad=True)
    freed: list = []
    losses = []
    for mb in range(2):
        offload.begin_chunk(0, mb)
        x = w * (1.0 + mb)
        gone = StorageWeakRef(x.untyped_storage())
        h = x
        for i in range(3):
            with offload.group("g", h) as h1:
                h = (h1 @ h1.t()).tanh() @ h1  # group 0 saves x and a tanh output of its own
            if i == 1:
                h.register_hook(lambda grad, gone=gone: freed.append(gone.expired()))
        del x, h1
        losses.append(h.pow(2).sum())
    for loss in losses:
        loss.backward()
    grad = w.grad.clone()
    s = offload.end_iteration().by_name["g"]
    w.grad = None
    for mb in range(2):
        h = w * (1.0 + mb)
        for _ in range(3):
            h = (h @ h.t()).tanh() @ h
        h.pow(2).sum().backward()
    assert torch.equal(grad, w.grad)
    assert freed == [True, True] and s.bytes_held_elsewhere == 0, (freed, s)


def test_a_tensor_still_held_after_the_forward_stays(configure):
    """Held past the forward's end (by the caller), the input stays on the GPU: the second look
    copies nothing that would free nothing."""
    keep: list = []
    grad, s = _forwards_then_backwards(configure, ["g"], keep)
    ref, _ = _forwards_then_backwards(configure, [], [])
    assert torch.equal(grad, ref)
    assert s.bytes_held_elsewhere == 2 * 256 * 4 and s.bytes_offloaded == 2 * 3 * 256 * 4, s


LAYERS = 6  # a backward long enough for the CPU fallback's copy to be done (`HostStreams.COPY_TICKS`)


def _forward_then_its_backward(configure, names: list[str], keep: list | None = None,
                               freed: list | None = None) -> tuple[torch.Tensor, object]:
    """Two microbatches, each forward of ``LAYERS`` groups followed by its own backward (no
    pipeline); the gradient and the statistics of ``g``."""
    configure(names)
    torch.manual_seed(0)
    w = torch.randn(256, requires_grad=True)
    for mb in range(2):
        offload.begin_chunk(0, mb)
        _chunk_holding_its_input(w, 1.0 + mb, keep, freed, LAYERS, freed_at=0).backward()
    return w.grad, offload.end_iteration().by_name.get("g")


def test_a_forward_followed_by_its_own_backward_copies_its_held_input_when_the_backward_begins(configure):
    """Note [8]: the input the forward held until it returned is only ours when the backward
    begins, and its first layer's backward is the backward's end: it is copied then (the last
    layer's group is kept, by the last-layer rule), its storage is gone before the backward
    reaches group 0 (on the CPU fallback a copy is done a few events after it was issued), it
    is reloaded for group 0, and the gradient is the one without offloading."""
    freed: list = []
    grad, s = _forward_then_its_backward(configure, ["g"], freed=freed)
    ref, _ = _forward_then_its_backward(configure, [])
    assert torch.equal(grad, ref)
    assert freed == [True, True]
    assert s.bytes_held_elsewhere == 0 and s.groups_kept == 2, s
    # per microbatch: x, and the input of each group after the first but the kept last one (the
    # tanh output before it, which its mul saves and so owns)
    assert s.groups_offloaded == 2 * (LAYERS - 1) and s.bytes_offloaded == 2 * (LAYERS - 1) * 256 * 4, s
    assert s.bytes_reloaded == s.bytes_offloaded, s


class _SquareTanh(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return (h * h).tanh()  # mul saves its input


class _HoldsItsInput(nn.Module):
    """A model whose forward holds its first layer's input in a local until it returns, as
    Megatron's ``GPTModel.forward`` holds the embedding's output. ``freed`` gets, when the
    backward has done the last layer, whether that input's storage was gone by then."""

    def __init__(self, freed: list) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_SquareTanh() for _ in range(LAYERS))
        self.freed = freed

    def forward(self, w: torch.Tensor, scale: float) -> torch.Tensor:
        x = w * scale
        gone = StorageWeakRef(x.untyped_storage())
        h = x
        for i, layer in enumerate(self.layers):
            h = layer(h)
            if i == LAYERS - 2:
                h.register_hook(lambda grad: self.freed.append(gone.expired()))
        return h.sum()


def _attached_forward_then_its_backward(configure, names: list[str], freed: list) -> tuple[torch.Tensor, object]:
    configure(names)
    torch.manual_seed(0)
    w = torch.randn(256, requires_grad=True)
    model = _HoldsItsInput(freed)
    offload.attach(model, {"g": "layers.*"})
    for mb in range(2):
        model(w, 1.0 + mb).backward()
    return w.grad, offload.end_iteration().by_name.get("g")


def test_the_held_input_is_copied_when_the_attached_model_returns(configure):
    """Note [8]: with `offload.attach`, the input the model's forward held until it returned
    is copied right then, under the loss head, and the compute stream waits for that copy when
    the backward begins (at the kept last layer): its storage is gone before the backward
    reaches the layer before the last, where a look at the backward's start would still be
    copying it. It is reloaded for the first layer, and the gradient is the one without
    offloading."""
    freed: list = []
    grad, s = _attached_forward_then_its_backward(configure, ["g"], freed)
    ref, _ = _attached_forward_then_its_backward(configure, [], [])
    assert torch.equal(grad, ref)
    assert freed == [True, True]
    assert s.bytes_held_elsewhere == 0 and s.groups_kept == 2, s
    assert s.bytes_offloaded == 2 * (LAYERS - 1) * 256 * 4 and s.bytes_reloaded == s.bytes_offloaded, s


def test_a_forward_followed_by_its_own_backward_leaves_an_input_still_held(configure):
    """Held past the backward's start (by the caller), the input stays on the GPU: the last
    look copies nothing that would free nothing."""
    keep: list = []
    grad, s = _forward_then_its_backward(configure, ["g"], keep)
    ref, _ = _forward_then_its_backward(configure, [], [])
    assert torch.equal(grad, ref)
    assert s.bytes_held_elsewhere == 2 * 256 * 4 and s.groups_kept == 2, s
    assert s.bytes_offloaded == 2 * (LAYERS - 2) * 256 * 4, s
