"""Quantized saved tensors (offload/quantized.py) on the CPU fallback, with a stand-in for
Transformer Engine's ``Float8Tensor``: a wrapper subclass whose bytes live in plain inner
tensors and that implements TE's ``prepare_for_saving``/``restore_from_saved`` protocol.
The same path runs with the real TE classes in tests/test_te.py on the GPU machine."""

from __future__ import annotations

import contextlib
import importlib.util

import pytest
import torch
from torch import nn

import offload
from offload.quantized import QuantizedHandle, splittable


class FakeQuantized(torch.Tensor):
    """``dequantize() == data * scale_inv``; ``data`` is int16, like FP8 data it is not the
    nominal dtype. Only ``detach`` is supported as an op, as for TE's wrapper subclasses."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale_inv: torch.Tensor, requires_grad: bool = False):
        self = torch.Tensor._make_wrapper_subclass(
            cls, data.shape, dtype=torch.float32, device=data.device, requires_grad=requires_grad
        )
        self._data = data
        self._scale_inv = scale_inv
        return self

    @classmethod
    def quantize(cls, x: torch.Tensor) -> "FakeQuantized":
        scale_inv = x.detach().abs().amax().clamp(min=1e-6) / 1000
        return cls((x.detach() / scale_inv).round().to(torch.int16), scale_inv.reshape(1))

    def dequantize(self) -> torch.Tensor:
        return self._data.float() * self._scale_inv

    def prepare_for_saving(self):
        tensors = [self._data, None, self._scale_inv]  # None: an unused usage, as in TE
        self._data = self._scale_inv = None
        return tensors, self

    def restore_from_saved(self, tensors):
        self._data, _, self._scale_inv = tensors[:3]
        return tensors[3:]

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return cls(args[0]._data, args[0]._scale_inv)
        raise NotImplementedError(f"FakeQuantized does not support {func}")

    def __repr__(self) -> str:  # the default repr would dispatch ops
        return f"FakeQuantized(shape={tuple(self.shape)})"


class FakeQuantizedLinear(torch.autograd.Function):
    """``y = x @ w.T`` that saves its input quantized, as a ``FakeQuantized`` (the way TE's
    FP8 attention saves ``Float8Tensor`` q, k, v); the weight gradient uses the dequantized
    input. ``seen`` records what backward got back."""

    seen: list = []

    @staticmethod
    def forward(ctx, x, w):
        xq = FakeQuantized.quantize(x)
        ctx.save_for_backward(xq, w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, gy):
        xq, w = ctx.saved_tensors
        FakeQuantizedLinear.seen.append(xq)
        assert type(xq) is FakeQuantized and xq._data is not None
        return gy @ w, gy.t() @ xq.dequantize()


def _run(layers, use_groups, seed=0):
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    h = x
    for w in layers:
        if use_groups:
            with offload.group("fq", h) as h_in:
                h = torch.tanh(FakeQuantizedLinear.apply(h_in, w))
        else:
            h = torch.tanh(FakeQuantizedLinear.apply(h, w))
    h.square().sum().backward()
    grads = [w.grad.clone() for w in layers] + [x.grad.clone()]
    for w in layers:
        w.grad = None
    return grads


def _weights(n=3):
    g = torch.Generator().manual_seed(7)
    return [nn.Parameter(torch.randn(32, 32, generator=g) / 6) for _ in range(n)]


def test_splittable_by_duck_typing():
    q = FakeQuantized.quantize(torch.randn(4, 4))
    assert splittable(q)
    assert not splittable(torch.randn(4))
    assert not splittable(FakeQuantized(q._data, q._scale_inv, requires_grad=True))  # a leaf: an FP8 weight
    assert not splittable(nn.Parameter(torch.randn(4)))


def test_quantized_saved_tensors_offloaded_through_their_data(configure):
    layers = _weights()
    ref = _run(layers, use_groups=False)
    configure(["fq"])
    FakeQuantizedLinear.seen.clear()
    got = _run(layers, use_groups=True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    stats = offload.end_iteration()
    s = stats.by_name["fq"]
    # 3 groups, the last kept; each offloaded group moved the int16 data and the fp32 scale of
    # its quantized input. tanh's saved output is the next group's input, still referenced by
    # the loop when the group's copies start: held elsewhere. When the backward begins (Note
    # [8] of offload.copy_queue) group 0's is only ours and is copied; its copy is not done on
    # the CPU fallback (a few events later) when group 0's backward needs it, so it is used
    # where it is and not reloaded. Group 1's is still the loop's ``h_in`` then: it stays.
    tanh_out = 64 * 32 * 4
    assert s.groups == 3 and s.groups_kept == 1 and s.groups_offloaded == 2
    assert s.tensors_offloaded == 2 * 2 + 1
    assert s.bytes_offloaded == 2 * (64 * 32 * 2 + 4) + tanh_out
    assert s.bytes_reloaded == 2 * (64 * 32 * 2 + 4)
    assert s.bytes_held_elsewhere == tanh_out
    assert len(FakeQuantizedLinear.seen) == 3
    assert offload.get_manager().live_handlers == []


def test_pack_hook_splits_and_restores(configure):
    configure(["fq"])
    q = FakeQuantized.quantize(torch.randn(64, 32))
    data, scale = q._data, q._scale_inv
    w = nn.Parameter(torch.randn(32, 32))
    x = torch.randn(64, 32, requires_grad=True)
    handles = []

    class Save(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(q)
            return x * 2

        @staticmethod
        def backward(ctx, g):
            (back,) = ctx.saved_tensors
            handles.append(back)
            return g * 2

    with offload.group("fq", x) as x_in:
        y = Save.apply(x_in) @ w
    # the original object is untouched by the split (a detached copy was split)
    assert q._data is data and q._scale_inv is scale
    y.sum().backward()
    (back,) = handles
    assert type(back) is FakeQuantized and back is not q
    assert torch.equal(back._data, data) and torch.equal(back._scale_inv, scale)
    offload.end_iteration()


def test_subclass_without_protocol_is_kept(configure):
    class Plain(torch.Tensor):
        pass

    def run(x, subclass, grouped):
        h = x
        for _ in range(2):  # two groups: the first is not the last, so its tensors would go out
            with offload.group("g", h) if grouped else contextlib.nullcontext(h) as h_in:
                t = h_in * 3
                p = t.as_subclass(Plain) if subclass else t
                h = p * p * 1.0  # the product saves p (as it is: Plain or plain), held by nothing else
        h.sum().backward()
        return x.grad

    configure(["g"])
    offloaded = {}
    for subclass in (True, False):  # False: the control, the same ops on plain tensors
        x = torch.randn(16, 16, requires_grad=True)
        ref = run(x.detach().clone().requires_grad_(True), subclass, grouped=False)
        assert torch.equal(run(x, subclass, grouped=True), ref)
        s = offload.end_iteration().by_name["g"]
        assert s.groups == 2 and s.groups_kept == 1
        offloaded[subclass] = s.bytes_offloaded
    assert offloaded == {True: 0, False: 16 * 16 * 4}  # the first group's p, if plain


def test_quantized_handle_checks_the_protocol():
    class Broken(FakeQuantized):
        def restore_from_saved(self, tensors):
            return tensors  # consumes nothing

    obj = Broken(torch.zeros(2, dtype=torch.int16), torch.ones(1))
    h = QuantizedHandle(obj, [torch.zeros(2)], lambda t: t)
    with pytest.raises(RuntimeError, match="restore_from_saved left 1"):
        h.unpack()


def _te_float8_tensor_class():
    try:
        from transformer_engine.pytorch.tensor.float8_tensor import Float8Tensor
        import transformer_engine_torch as tex
    except Exception:  # noqa: BLE001 - not installed (the CPU machine), or not loadable
        return None, None
    return Float8Tensor, tex


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None, reason="Transformer Engine is not installed")
def test_real_te_float8_tensor_on_the_cpu_fallback(configure):
    """TE's own ``Float8Tensor`` (built on the CPU: no kernel runs) through the same path.
    (TE is imported here, not at collection: tests/test_te.py sets TE's variables first.)"""
    Float8Tensor, tex = _te_float8_tensor_class()
    if Float8Tensor is None:
        pytest.skip("Transformer Engine is installed but not importable")

    def fp8(x):
        scale_inv = x.detach().abs().amax().reshape(1) / 100
        data = (x.detach() / scale_inv).round().clamp(-100, 100).to(torch.int8).view(torch.uint8)
        return Float8Tensor(shape=x.shape, dtype=torch.float32, data=data, fp8_scale_inv=scale_inv,
                            fp8_dtype=tex.DType.kFloat8E4M3, requires_grad=False, device=x.device)

    seen = []

    class F8Linear(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            ctx.save_for_backward(fp8(x), w)
            return x @ w.t()

        @staticmethod
        def backward(ctx, gy):
            xq, w = ctx.saved_tensors
            seen.append(type(xq).__name__)
            x = xq._data.view(torch.int8).float() * xq._scale_inv
            return gy @ w, gy.t() @ x

    def run(use_groups):
        x = torch.randn(64, 32, generator=torch.Generator().manual_seed(3), requires_grad=True)
        h = x
        for w in weights:
            if use_groups:
                with offload.group("f8", h) as h_in:
                    h = torch.tanh(F8Linear.apply(h_in, w))
            else:
                h = torch.tanh(F8Linear.apply(h, w))
        h.square().sum().backward()
        out = [w.grad.clone() for w in weights] + [x.grad.clone()]
        for w in weights:
            w.grad = None
        return out

    weights = _weights()
    ref = run(False)
    configure(["f8"])
    got = run(True)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    s = offload.end_iteration().by_name["f8"]
    assert s.groups_offloaded == 2 and s.bytes_offloaded == 2 * (64 * 32 + 4)
    assert seen[-3:] == ["Float8Tensor"] * 3
