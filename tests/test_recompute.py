"""Offloading composed with activation recompute (CPU fallback).

* A group *around* a checkpointed region offloads what the checkpoint saves (its inputs);
  the recompute in backward reads them back through the engine.
* A group *inside* a checkpointed region does nothing: the checkpoint's own saved-tensor
  hooks are innermost there, the region's tensors are recomputed, not saved.
* Reentrant checkpointing: its forward runs under ``no_grad`` (groups inside see nothing,
  correctly, since nothing is saved); its inputs are saved outside and offloaded.
* megatron-core's ``CheckpointWithoutOutput``: its output is held by the checkpoint object,
  so a group that saves it copies nothing; its inputs are offloaded.
* A "memory-free" layer: light modules recomputed, heavy ones offloaded, so nothing the
  layer saves stays on the device between its forward and backward.
All with gradients bitwise equal to no offloading.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import offload
from offload import GroupStats
from offload.testing import (
    GPT_MAPPING, LIGHT_MODULES, build_gpt, first_difference, recompute, train_step,
)

SHAPE = (16, 2, 32)


def _grads_equal(run_ref, run_got):
    ref = run_ref()
    got = run_got()
    assert all(torch.equal(a, b) for a, b in zip(ref, got))


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_group_around_checkpoint_offloads_its_inputs(configure, reentrant):
    configure(["g"])
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(8, 16, requires_grad=True)

    def body(h):
        return torch.tanh(h @ w) @ w

    def run(offloading):
        w.grad = x.grad = None
        h = x * 1
        for _ in range(3):
            if offloading:
                with offload.group("g", h) as h_in:
                    h = checkpoint(body, h_in, use_reentrant=reentrant)
            else:
                h = checkpoint(body, h, use_reentrant=reentrant)
        h.sum().backward()
        return w.grad.clone(), x.grad.clone()

    _grads_equal(lambda: run(False), lambda: run(True))
    stats = offload.end_iteration().by_name["g"]
    assert stats.groups == 3
    assert stats.groups_offloaded == 2  # the last one is kept (its backward comes next)
    assert stats.bytes_offloaded == 2 * 8 * 16 * 4  # each checkpoint's input, nothing inside
    assert stats.bytes_reloaded == stats.bytes_offloaded


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_group_inside_checkpoint_leaves_it_to_recompute(configure, reentrant):
    configure(["g"])
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16, requires_grad=True)

    def f(h):
        with offload.group("g", h) as h1:
            return torch.tanh(h1 @ w)

    def run(use_ckpt):
        w.grad = x.grad = None
        h = x * 1
        for _ in range(3):
            h = checkpoint(f, h, use_reentrant=reentrant) if use_ckpt else f(h)
        h.sum().backward()
        return w.grad.clone(), x.grad.clone()

    offload.reset()
    ref = run(False)
    offload.end_iteration()
    got = run(True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    stats = offload.end_iteration().by_name.get("g", GroupStats())
    assert stats.groups == 0 and stats.bytes_offloaded == 0
    # non-reentrant: the checkpoint's hooks are active; reentrant: its forward runs without grad
    assert stats.groups_recomputed == (0 if reentrant else 3)


@pytest.fixture
def checkpoint_without_output(monkeypatch):
    """megatron-core's CheckpointWithoutOutput; without CUDA, its RNG bookkeeping is limited to
    the CPU generator (megatron reads CUDA RNG states unconditionally)."""
    random = pytest.importorskip("megatron.core.tensor_parallel.random")
    if not torch.cuda.is_available():
        monkeypatch.setattr(random, "_get_all_rng_states", lambda: (torch.get_rng_state(), None, None))
        monkeypatch.setattr(random, "_set_all_rng_states", lambda cpu, cuda, tracker: torch.set_rng_state(cpu))
    return random.CheckpointWithoutOutput


def test_megatron_checkpoint_without_output(configure, checkpoint_without_output):
    """The norm is recomputed by CheckpointWithoutOutput and its output discarded after the
    linear layer used it; the linear layer is an offload group. The discarded output is held
    by the checkpoint object, so the group does not copy it. The checkpoint saves its input
    as a detached leaf, which autograd keeps itself: the group around it copies nothing."""
    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(32)
    linear = torch.nn.Linear(32, 64)
    x0 = torch.randn(SHAPE, requires_grad=True)

    def layer(x, offloading):
        ckpt = checkpoint_without_output(fp8=None)  # megatron: None means no FP8
        if offloading:
            with offload.group("attn_norm", x) as x:
                h = ckpt.checkpoint(norm, x)
            with offload.group("qkv_linear", h) as h:
                y = torch.nn.functional.gelu(linear(h))
        else:
            h = ckpt.checkpoint(norm, x)
            y = torch.nn.functional.gelu(linear(h))
        ckpt.discard_output_and_register_recompute(y)
        return y[..., :32] + x

    def run(offloading):
        for p in (*norm.parameters(), *linear.parameters()):
            p.grad = None
        x0.grad = None
        h = x0 * 1
        for _ in range(3):
            h = layer(h, offloading)
        h.sum().backward()
        return [p.grad.clone() for p in (*norm.parameters(), *linear.parameters())] + [x0.grad.clone()]

    configure(["attn_norm", "qkv_linear"])
    offload.attach(torch.nn.ModuleList([norm, linear]), {})
    # several iterations: a discarded storage's address is soon reused by another tensor,
    # which must not be mistaken for the discarded one (it was, once, in 1 run of 3)
    for _ in range(5):
        _grads_equal(lambda: run(False), lambda: run(True))
        stats = offload.end_iteration().by_name
    assert stats["attn_norm"].groups == 3 and stats["attn_norm"].bytes_offloaded == 0
    assert stats["qkv_linear"].bytes_held_elsewhere > 0  # the discarded norm output
    assert stats["qkv_linear"].bytes_offloaded == 2 * 16 * 2 * 64 * 4  # gelu input, not the kept last


def test_memory_free_layer(configure):
    """Norms and the activation recomputed, every other module offloaded: nothing the layers
    save stays on the device outside the groups, and gradients are exact."""
    torch.manual_seed(1)
    ref = build_gpt(32, 4, 4)
    model = copy.deepcopy(ref)
    for pattern in LIGHT_MODULES:
        recompute(model, pattern)
    layers = torch.nn.Sequential(*model.layers)
    ref_layers = torch.nn.Sequential(*ref.layers)
    x, g = torch.randn(SHAPE), torch.randn(SHAPE)
    _, ref_grads = train_step(ref_layers, x, g)

    configure(list(GPT_MAPPING))
    offload.attach(layers, {k: v.replace("layers.", "") for k, v in GPT_MAPPING.items()})
    outside: list[torch.Tensor] = []

    def count(t):
        outside.append(t)
        return t

    for _ in range(2):
        outside.clear()
        with torch.autograd.graph.saved_tensors_hooks(count, lambda t: t):
            _, grads = train_step(layers, x, g)
        stats = offload.end_iteration()
        assert first_difference(ref_grads, {k.replace(".inner", ""): v for k, v in grads.items()}) is None
    parameters = {p.untyped_storage().data_ptr() for p in layers.parameters()}
    assert [t for t in outside if t.untyped_storage().data_ptr() not in parameters] == []
    by_name = stats.by_name
    for name in ("attn_norm", "mlp_norm", "mlp_act"):  # recomputed: only their inputs are saved
        assert by_name[name].bytes_offloaded > 0
    # every group offloads or is kept by the last-layer rule, but the first attn_norm: it saves
    # the stack's input, a leaf that requires grad (the caller holds it)
    total = stats.total()
    assert total.groups == 4 * len(GPT_MAPPING)
    assert total.groups_kept == len(GPT_MAPPING)
    assert total.groups_offloaded == total.groups - total.groups_kept - 1
