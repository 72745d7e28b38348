"""`offload` under torch.compile (docs/compile.md): code that torch.compile traces opens no
group, so what compiled code saves stays where it is and the compiled graph is the one the
model gets without offloading (bitwise the same gradients); what runs eagerly around compiled
modules offloads as usual. Every test runs with the eager, aot_eager and inductor backends."""

from __future__ import annotations

import copy
import shutil
import warnings

import pytest
import torch

import offload
from conftest import reproducible, seeded_pair
from offload.testing import GPT_MAPPING, build_gpt, first_difference, train_step

COMPILED_MLP = ["fc1", "mlp_act", "fc2"]  # the names inside each layer's `mlp`

BACKENDS = [
    "eager",
    "aot_eager",
    pytest.param("inductor", marks=pytest.mark.skipif(
        not (shutil.which("g++") or shutil.which("clang++")), reason="inductor on CPU needs a C++ compiler")),
]

pytestmark = pytest.mark.compile


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compile_mlps(model: torch.nn.Module, backend: str) -> torch.nn.Module:
    for layer in model.layers:
        layer.mlp.compile(backend=backend)
    return model


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_model_offloads_nothing_and_matches_it_without_offload(configure, backend):
    """The whole model compiled, every name configured: no group opens in compiled code, nothing
    is offloaded (the first iteration says so), and the gradients are bitwise those of the same
    compiled model without offloading. Before: Dynamo traced the engine's own code and failed."""
    model = build_gpt(32, 4, 2)
    plain = torch.compile(copy.deepcopy(model), backend=backend)
    x, g = seeded_pair(0, 8, 2, 32)
    configure(list(GPT_MAPPING))
    offload.attach(model, GPT_MAPPING)
    compiled = torch.compile(model, backend=backend)
    runs = []
    for iteration in range(2):
        runs.append(train_step(compiled, x, g)[1])
        with warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            stats = offload.end_iteration()
        assert stats.total().groups == 0 and stats.total().bytes_offloaded == 0
        notes = [str(w.message) for w in said if "nothing was offloaded" in str(w.message)]
        assert len(notes) == (iteration == 0)
        if notes:
            assert "torch.compile" in notes[0]
    _, ref = reproducible(lambda: train_step(plain, x, g))  # after: the offloaded model compiles first
    for got in runs:
        assert first_difference(ref, got) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_eager_code_around_compiled_modules_offloads(configure, backend):
    """The MLPs compiled, attention eager: the attention names offload, the MLP names open no
    group, and the gradients are bitwise those of the same model without offloading."""
    model = build_gpt(32, 4, 2)
    plain = _compile_mlps(copy.deepcopy(model), backend)
    x, g = seeded_pair(1, 8, 2, 32)
    configure(list(GPT_MAPPING))
    offload.attach(model, GPT_MAPPING)
    _compile_mlps(model, backend)
    runs = []
    for _ in range(2):
        runs.append(train_step(model, x, g)[1])
        stats = offload.end_iteration().by_name
        assert stats["core_attn"].bytes_offloaded > 0 and stats["qkv_linear"].bytes_offloaded > 0
        assert not set(COMPILED_MLP) & set(stats)  # their groups would open in compiled code
    _, ref = reproducible(lambda: train_step(plain, x, g))
    for got in runs:
        assert first_difference(ref, got) is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_compiled_function_inside_an_eager_group(configure, backend):
    """A compiled function called inside a group that opened eagerly: what the compiled graph
    hands autograd to save goes through the group like any saved tensor (how much depends on the
    backend); the gradients are exact."""
    configure(["outer"])
    body = torch.compile(lambda h: torch.sigmoid(torch.tanh(h) * h) * h, backend=backend)
    w = torch.randn(256, requires_grad=True)

    def step(grouped: bool) -> torch.Tensor:
        w.grad = None
        h = w * 2
        if grouped:
            with offload.group("outer", h) as h1:
                y = body(h1)
            with offload.group("outer", y) as y1:
                z = (y1 * 3).sum()
        else:
            z = (body(h) * 3).sum()
        z.backward()
        return w.grad.clone()

    ref = step(grouped=False)
    for _ in range(2):
        assert torch.equal(step(grouped=True), ref)
        assert offload.end_iteration().by_name["outer"].groups == 2
