"""Shared fixtures and helpers: every test gets a fresh engine, and leaves none behind.

Fixtures: ``configure`` (a fresh engine, CPU fallback by default), ``deterministic``
(deterministic algorithms for the test's duration; the GPU files use it), ``megatron_cpu``
(megatron-core patched for the CPU, gloo with world size 1; tests/integrations).

Helpers, imported by the test modules with ``from conftest import ...``: `CUDA_ONLY` and
`requires_cuda` (skip without CUDA), `seeded_pair` (an input and an output gradient drawn from a
seed), `PIPELINE_GRID`, `CPU_PIPELINE_GRID` and `pipeline_ranks` (the (PP, VPP, M, rank)
replays), `gpt_chunks` (one model per pipeline chunk), `slow_side_streams` (copies run late),
`reproducible` (a reference run, checked against a second run), `attention_output_stays` (which
names of a `GPTLayerStack` keep core_attn's output on the device), `engine_flows` (the ways a
chunk handler ends). That import works because this is the
suite's only conftest.py: pytest imports every conftest.py outside a package as the module
``conftest``, so a second one (say in tests/integrations/) would take its place in
``sys.modules`` partway through a whole-suite run. Put fixtures for a subfolder here too.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable

import pytest
import torch

# Deterministic cuBLAS must be chosen before CUDA starts (bitwise comparisons on the GPU).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import offload  # noqa: E402
from offload.manager import PipelineOffloadManager  # noqa: E402
from offload.testing import build_gpt, first_difference, slow_copy_streams, train_step  # noqa: E402

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

CUDA_ONLY = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
"""``pytestmark = CUDA_ONLY`` for a module of GPU tests (``-m cuda`` selects them)."""

SPIN_CYCLES = 2_000_000
"""A spinning kernel of about a millisecond (`slow_side_streams`)."""


@pytest.fixture(autouse=True)
def _fresh_engine():
    yield
    manager, PipelineOffloadManager._instance = PipelineOffloadManager._instance, None
    if manager is not None:
        manager.reset(release_pool=True)  # raises for what the test left broken: then it fails alone


@pytest.fixture
def configure():
    """``configure(modules, **kw)``: a fresh engine on the CPU fallback unless ``device`` says
    otherwise (also on a GPU machine, where the CPU tests' tensors are CPU tensors); the
    CPU-fallback warning is silenced."""

    def make(modules, **kw):
        kw.setdefault("min_tensor_bytes", 0)
        kw.setdefault("device", "cpu")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)
            return offload.configure(modules, **kw)

    return make


@pytest.fixture
def deterministic():
    """Deterministic algorithms during the test (bitwise comparisons on the GPU)."""
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture(scope="module")
def megatron_cpu():
    """Patch megatron-core for the CPU and start gloo with world size 1 (for a test module;
    the patches are in tests/integrations/megatron_cpu.py, shared with the ranks of its run_example)."""
    from megatron.core import parallel_state
    from megatron_cpu import apply_cpu_patches  # tests/integrations, on sys.path there

    from offload.testing import free_port

    mp = apply_cpu_patches()
    started = not torch.distributed.is_initialized()
    if started:
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )
    parallel_state.initialize_model_parallel(1, 1)
    yield
    parallel_state.destroy_model_parallel()
    if started:
        torch.distributed.destroy_process_group()
    mp.undo()


def requires_cuda(fn):
    """`CUDA_ONLY` for one test."""
    for mark in reversed(CUDA_ONLY):
        fn = mark(fn)
    return fn


def seeded_pair(seed: int, *shape: int, dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """An input and an output gradient of ``shape``, drawn in that order from ``seed``."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(*shape, device=device, dtype=dtype, generator=g)
    return x, torch.randn(*shape, device=device, dtype=dtype, generator=g)


def pipeline_ranks(pp: int) -> list[int]:
    """The ranks replayed for a pipeline of ``pp``: the first, a middle and the last."""
    return sorted({0, pp // 2, pp - 1})


PIPELINE_GRID = [
    (pp, vpp, m, rank)
    for pp in (1, 2, 4, 8)
    for vpp in ((1,) if pp == 1 else (1, 2, 4))
    for m in (pp, 2 * pp, 4 * pp)
    for rank in pipeline_ranks(pp)
]
"""(PP, VPP, microbatches, rank) of the one-rank pipeline replays on the GPU."""

CPU_PIPELINE_GRID = [(pp, vpp, m, rank) for pp, vpp, m, rank in PIPELINE_GRID if (pp, m) != (8, 32)]
"""The CPU suite's replays: `PIPELINE_GRID` less its 32 microbatches on 8 stages, the longest
steady states (a third of the CPU replays' time), which the GPU suite still replays."""


def gpt_chunks(vpp: int, hidden: int, heads: int, layers: int, **kw: Any) -> list[torch.nn.Module]:
    """One `GPTLayerStack` per model chunk of a pipeline rank, chunk ``c`` from seed ``c``."""
    return [build_gpt(hidden, heads, layers, seed=c, **kw) for c in range(vpp)]


def slow_side_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every offload and reload starts after a spinning kernel of `SPIN_CYCLES` on its side
    stream (`offload.testing.slow_copy_streams`): a missing event edge then shows."""
    slow_copy_streams(monkeypatch, SPIN_CYCLES)


def attention_output_stays(name: str, names: list[str]) -> bool:
    """Whether group ``name`` of a `GPTLayerStack` leaves core_attn's output on the device when
    the groups ``names`` are offloaded. That output is one storage saved twice: by core_attn's
    attention (SDPA saves its output; on the CPU the projection's input is a view of it) and by
    attn_proj (a linear saves its input). With both offloaded, attn_proj, whose backward needs it
    first, owns it and copies it; with only one, the other module's autograd still holds it, so
    copying it would free nothing: it stays, as ``bytes_held_elsewhere`` of that one (and
    attn_proj saves nothing else, so it offloads nothing)."""
    pair = {"core_attn", "attn_proj"}
    return name in pair and not pair <= set(names)


class GateOnlyGLU(torch.nn.Module):
    """SiLU of the first half of its input times the second half plus 0.0, as Megatron's experts
    compute a GLU (``x_linear + glu_linear_offset``): only the first half, a view with gaps, is
    saved of the input (Note [10] of offload.copy_queue)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, linear = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * (linear + 0.0)


def with_gate_only_glu(model: torch.nn.Module, seed: int = 1) -> torch.nn.Module:
    """``model`` (an `offload.testing.build_gpt` stack) with `GateOnlyGLU` activations and fc2
    layers of half the width to match, drawn from ``seed``."""
    torch.manual_seed(seed)
    for layer in model.layers:
        fc2 = layer.mlp.linear_fc2
        layer.mlp.activation = GateOnlyGLU()
        layer.mlp.linear_fc2 = torch.nn.Linear(fc2.in_features // 2, fc2.out_features).to(
            device=fc2.weight.device, dtype=fc2.weight.dtype)
    return model


def assert_step_bitwise(ref_model: torch.nn.Module, model: torch.nn.Module, x: torch.Tensor,
                        g: torch.Tensor, it: int) -> None:
    """One `train_step` of each model: outputs and every gradient bitwise equal (iteration ``it``)."""
    ref_out, ref = train_step(ref_model, x, g)
    out, got = train_step(model, x, g)
    assert torch.equal(out, ref_out), f"iteration {it}: outputs differ"
    diff = first_difference(ref, got)
    assert diff is None, f"iteration {it}: {diff}"


def reproducible(run: Callable[[], Any], grads: Callable[[Any], dict] = lambda result: result[1]) -> Any:
    """``run()`` twice: the gradients of both (``grads(result)``; by default the second item,
    as `train_step` returns them) must be bitwise equal, or the reference cannot judge
    offloading. Returns the first run's result."""
    first = run()
    diff = first_difference(grads(first), grads(run()))
    assert diff is None, f"the reference itself is not reproducible: {diff}"
    return first


def engine_flows(model: torch.nn.Module, x: torch.Tensor, g: torch.Tensor) -> dict[str, Callable[[], None]]:
    """The ways a chunk handler ends (for `offload.testing.cyclic_garbage`), each an iteration
    of ``model`` (attached) on ``x`` with output gradient ``g``: gradient accumulation (each
    backward follows its own forward), a pipeline-like order (all forwards, then all backwards),
    a forward whose graph is dropped, a second backward (``retain_graph``), and a reset while
    the saved tensors are alive (an aborted step), freed after it."""

    def accumulation() -> None:
        for _ in range(3):
            model(x).backward(g)
        offload.end_iteration()

    def pipeline_order() -> None:
        outs = [model(x) for _ in range(3)]
        for out in outs:
            out.backward(g)
        offload.end_iteration()

    def dropped_forward() -> None:
        model(x).sum()
        offload.end_iteration()

    def retain_graph() -> None:
        out = model(x)
        out.backward(g, retain_graph=True)
        out.backward(g)
        offload.end_iteration()

    def reset_while_alive() -> None:
        out = model(x)
        offload.reset()
        del out
        offload.end_iteration()

    return {f.__name__: f for f in (accumulation, pipeline_order, dropped_forward, retain_graph, reset_while_alive)}
