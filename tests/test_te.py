"""`offload` under Transformer Engine layers (issue 9). Skipped without CUDA or without TE.

On a CUDA machine with Transformer Engine installed (docs/te.md; the project's air-gapped GPU
host: ``bash tools/gpu_te.sh install``, docs/contributing/gpu-host.md)::

    eval "$(bash tools/gpu_te.sh env)"; python -m pytest -q tests/test_te.py

Bitwise comparisons need a reproducible reference: deterministic algorithms,
``CUBLAS_WORKSPACE_CONFIG`` (set in conftest before CUDA starts) and
``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` (set here before TE is imported; run this file in a
pytest process of its own so that no earlier module imported TE first); every test first
checks the reference against itself. Each run builds its model afresh from the same seed, so
FP8 scaling state (amax history) starts equal too, and runs several steps, so delayed scaling
uses updated scales.

FP8: TE's modules quantize with *internal* quantizers and save the plain data tensors (uint8
data, transpose, fp32 scale-inverse) through ``prepare_for_saving``: the engine offloads them as
plain tensors. FP8 attention (``DelayedScaling(fp8_dpa=True)``) saves ``Float8Tensor`` objects,
which `offload.quantized` splits into their data tensors; the tests check that both paths ran.

CUDA graphs: TE's ``make_graphed_callables`` through `offload.graphs`, per layer and per (layer,
microbatch) in a pipeline ``_order``, bf16 and FP8, against eager without offloading.
"""

from __future__ import annotations

import os

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
# TE's small fusions (bias+GeLU, bias+dropout+add) go through torch.compile unless this is 0;
# eager keeps the compile time out of the tests and the reference independent of whether
# saved-tensor hooks are active (NVTE_TORCH_COMPILE=1 in the environment turns it back on).
os.environ.setdefault("NVTE_TORCH_COMPILE", "0")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import offload  # noqa: E402
import offload.manager  # noqa: E402
from conftest import seeded_pair  # noqa: E402
from offload.chunk_handler import ChunkOffloadHandler  # noqa: E402
from offload.testing import first_difference  # noqa: E402


def _import_te():
    if not torch.cuda.is_available():
        return None, "needs CUDA"
    try:
        import transformer_engine.pytorch as te_module
    except Exception as exc:  # noqa: BLE001 - a broken install skips with its reason
        return None, f"transformer_engine.pytorch is not importable: {type(exc).__name__}: {exc}"
    return te_module, ""


te, _WHY = _import_te()
pytestmark = [pytest.mark.cuda, pytest.mark.skipif(te is None, reason=_WHY or "needs TE"),
              pytest.mark.usefixtures("deterministic")]

DTYPE = torch.bfloat16
HIDDEN, HEADS, SEQ, BATCH = 256, 4, 128, 2
STEPS = 3
MIN_BYTES = 1024  # below the default 1 MiB: the models here are small


# ----------------------------------------------------------------------------- models
class LinearBlock(nn.Module):
    """``x + fc2(gelu(fc1(x)))`` with two ``te.Linear``."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = te.Linear(HIDDEN, 4 * HIDDEN, params_dtype=DTYPE)
        self.fc2 = te.Linear(4 * HIDDEN, HIDDEN, params_dtype=DTYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(x)))


class AttnBlock(nn.Module):
    """A pre-norm decoder layer from TE's parts: ``LayerNormLinear`` (qkv and fc1),
    ``DotProductAttention`` (causal, sbhd, q/k/v as views of one qkv tensor), ``Linear``."""

    def __init__(self) -> None:
        super().__init__()
        d = HIDDEN // HEADS
        self.qkv = te.LayerNormLinear(HIDDEN, 3 * HIDDEN, params_dtype=DTYPE)
        self.core = te.DotProductAttention(HEADS, d, attention_dropout=0.0, qkv_format="sbhd",
                                           attn_mask_type="causal")
        self.proj = te.Linear(HIDDEN, HIDDEN, params_dtype=DTYPE)
        self.fc1 = te.LayerNormLinear(HIDDEN, 4 * HIDDEN, params_dtype=DTYPE)
        self.fc2 = te.Linear(4 * HIDDEN, HIDDEN, params_dtype=DTYPE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, _ = x.shape
        d = HIDDEN // HEADS
        q, k, v = self.qkv(x).view(s, b, HEADS, 3 * d).split(d, dim=-1)
        x = x + self.proj(self.core(q, k, v))
        return x + self.fc2(F.gelu(self.fc1(x)))


class Stack(nn.Module):
    def __init__(self, make, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(make(i) for i in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _transformer_layer(i: int) -> nn.Module:
    return te.TransformerLayer(HIDDEN, 4 * HIDDEN, HEADS, hidden_dropout=0.0, attention_dropout=0.0,
                               self_attn_mask_type="causal", params_dtype=DTYPE, layer_number=i + 1)


MODELS = {
    "linear": (lambda: Stack(lambda i: LinearBlock(), 4),
               {"fc1": "layers.*.fc1", "fc2": "layers.*.fc2"}),
    "parts": (lambda: Stack(lambda i: AttnBlock(), 4),
              {"qkv": "layers.*.qkv", "core_attn": "layers.*.core", "attn_proj": "layers.*.proj",
               "fc1": "layers.*.fc1", "fc2": "layers.*.fc2"}),
    "transformer_layer": (lambda: Stack(_transformer_layer, 4),
                          {"qkv": "layers.*.self_attention.layernorm_qkv",
                           "core_attn": "layers.*.self_attention.core_attention",
                           "attn_proj": "layers.*.self_attention.proj",
                           "mlp": "layers.*.layernorm_mlp"}),
}


def _recipe(kind: str | None):
    if kind is None:
        return None
    from transformer_engine.common import recipe

    if kind == "delayed":
        ok, reason = te.is_fp8_available(return_reason=True)
        if not ok:
            pytest.skip(f"FP8 not available: {reason}")
        return recipe.DelayedScaling()
    if kind == "delayed_dpa":
        ok, reason = te.is_fp8_available(return_reason=True)
        if not ok:
            pytest.skip(f"FP8 not available: {reason}")
        return recipe.DelayedScaling(fp8_dpa=True)
    if kind == "mxfp8":
        ok, reason = te.is_mxfp8_available(return_reason=True)
        if not ok:
            pytest.skip(f"MXFP8 not available on {torch.cuda.get_device_name()}: {reason}")
        return recipe.MXFP8BlockScaling()
    raise ValueError(kind)


# ----------------------------------------------------------------------------- runs
def _inputs(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return seeded_pair(1000 + step, SEQ, BATCH, HIDDEN, dtype=DTYPE, device="cuda")


def _run(model_name: str, recipe_kind: str | None, names=(), steps: int = STEPS, memory: bool = False):
    """Build the model from seed 0, train ``steps`` steps (offloading ``names``), and return
    per step the output and every gradient; with ``memory``, also the bytes allocated by the
    forward pass of the last step (before its backward) and the iterations' statistics."""
    make, mapping = MODELS[model_name]
    recipe = _recipe(recipe_kind)
    torch.manual_seed(0)
    model = make().cuda()
    handle = None
    if names:
        # the test tensors are small (128 KiB of bf16 activations per token block)
        offload.configure(list(names), min_tensor_bytes=MIN_BYTES, device="cuda")
        handle = offload.attach(model, {n: mapping[n] for n in names})
    results, stats, forward_bytes = [], [], None
    for step in range(steps):
        x, g = _inputs(step)
        x = x.requires_grad_(True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with te.autocast(enabled=recipe is not None, recipe=recipe):
            out = model(x)
        if memory and step == steps - 1:
            torch.cuda.synchronize()
            forward_bytes = torch.cuda.memory_allocated() - before
        out.backward(g)
        got = {"out": out.detach().clone(), "x.grad": x.grad.clone()}
        got.update({n: p.grad.clone() for n, p in model.named_parameters()})
        model.zero_grad(set_to_none=True)
        results.append(got)
        if names:
            stats.append(offload.end_iteration())
    if handle is not None:
        handle.remove()
    offload.reset(release_pool=True)
    return (results, forward_bytes, stats) if memory else results


def _same(a: list[dict], b: list[dict]) -> str | None:
    for step, (x, y) in enumerate(zip(a, b)):
        diff = first_difference(x, y)
        if diff is not None:
            return f"step {step}: {diff}"
    return None


def _reference(model_name: str, recipe_kind: str | None) -> list[dict]:
    try:
        ref = _run(model_name, recipe_kind)
    except (RuntimeError, ValueError) as exc:
        if "backend" in str(exc).lower():  # no attention backend for this recipe and device
            pytest.skip(f"TE cannot run {model_name} with {recipe_kind} here: {exc}")
        raise
    again = _run(model_name, recipe_kind)
    diff = _same(ref, again)
    assert diff is None, f"the reference itself is not reproducible: {diff}"
    return ref


@pytest.fixture
def spy(monkeypatch):
    """Counts quantized tensors split by the pack hook and the dtypes of the records made."""
    seen = {"split": [], "record_dtypes": set()}
    split = offload.manager.pack_quantized

    def counting_split(t, *args):
        seen["split"].append(type(t).__name__)
        return split(t, *args)

    add = ChunkOffloadHandler.record_for

    def recording_add(self, group, t, *args):
        seen["record_dtypes"].add(t.dtype)
        return add(self, group, t, *args)

    monkeypatch.setattr(offload.manager, "pack_quantized", counting_split)
    monkeypatch.setattr(ChunkOffloadHandler, "record_for", recording_add)
    return seen


# ----------------------------------------------------------------------------- tests
@pytest.mark.parametrize("model_name", list(MODELS))
def test_gradients_bitwise_equal_bf16(model_name, spy):
    ref = _reference(model_name, None)
    names = tuple(MODELS[model_name][1])
    got, _, stats = _run(model_name, None, names, memory=True)
    diff = _same(ref, got)
    assert diff is None, diff
    for s in stats:
        total = s.total()
        assert total.bytes_offloaded > 0 and total.bytes_reloaded == total.bytes_offloaded
        assert total.groups_kept == len(names)  # each name's last layer: backward comes next
    print(f"{model_name}: {stats[-1].total()}")


@pytest.mark.parametrize("model_name", list(MODELS))
def test_offloading_removes_memory(model_name):
    names = tuple(MODELS[model_name][1])
    _, plain, _ = _run(model_name, None, (), steps=2, memory=True)
    _, kept, stats = _run(model_name, None, names, steps=2, memory=True)
    offloaded = stats[-1].total().bytes_offloaded
    removed = plain - kept
    print(f"{model_name}: the forward leaves {plain / 2**20:.1f} MiB allocated without offloading, "
          f"{kept / 2**20:.1f} MiB with; removed {removed / 2**20:.1f} MiB of "
          f"{offloaded / 2**20:.1f} MiB offloaded")
    assert offloaded > 0
    # One group may still be in flight when the forward ends (released when the next group
    # opens or backward starts): with 3 of 4 layers offloaded, allow about one group's share.
    assert removed >= 0.6 * offloaded


@pytest.mark.parametrize("model_name", ["linear", "parts", "transformer_layer"])
def test_fp8_delayed_scaling_bitwise_equal(model_name, spy):
    """FP8 GEMMs: the saved FP8 data (uint8) leaves the GPU as plain tensors."""
    ref = _reference(model_name, "delayed")
    names = tuple(MODELS[model_name][1])
    got, _, stats = _run(model_name, "delayed", names, memory=True)
    diff = _same(ref, got)
    assert diff is None, diff
    assert all(s.total().bytes_offloaded > 0 for s in stats)
    assert torch.uint8 in spy["record_dtypes"], spy["record_dtypes"]  # FP8 data went through the engine


@pytest.mark.parametrize("model_name", ["parts", "transformer_layer"])
def test_fp8_attention_float8_tensors_offloaded(model_name, spy):
    """``DelayedScaling(fp8_dpa=True)``: FP8 attention saves ``Float8Tensor`` q, k, v, out; the
    pack hook splits them (`offload.quantized`) and their data is offloaded and reloaded."""
    ref = _reference(model_name, "delayed_dpa")
    names = tuple(MODELS[model_name][1])
    got, _, stats = _run(model_name, "delayed_dpa", names, memory=True)
    diff = _same(ref, got)
    assert diff is None, diff
    if not spy["split"]:
        pytest.skip("TE saved no quantized tensor subclass in FP8 attention here (it ran another "
                    "attention backend); the FP8 GEMM path is tested above")
    assert "Float8Tensor" in spy["split"], spy["split"]
    core = [s.by_name["core_attn"] for s in stats]
    assert all(c.bytes_offloaded > 0 and c.bytes_reloaded == c.bytes_offloaded for c in core)


@pytest.mark.parametrize("model_name", ["linear", "transformer_layer"])
def test_mxfp8_bitwise_equal(model_name, spy):
    """MXFP8 (Blackwell and later; skipped with TE's reason elsewhere)."""
    ref = _reference(model_name, "mxfp8")
    names = tuple(MODELS[model_name][1])
    got = _run(model_name, "mxfp8", names)
    diff = _same(ref, got)
    assert diff is None, diff
    assert torch.uint8 in spy["record_dtypes"] or spy["split"]


# ----------------------------------------------------------------------------- CUDA graphs
# TE's make_graphed_callables over the "parts" layers, one graph per layer: one microbatch
# (order [1, -1]), or two model chunks of two layers and two microbatches in a 1F1B-like
# pipeline order through TE's ``_order`` (per-microbatch graphs, as Megatron builds them).
GRAPH_ORDERS = {"layers": ([1, -1], 1), "vpp_1f1b": ([1, 2, -2, 1, -1, 2, -2, -1], 2)}


def _pipeline_step(layer_fn, model, data, order, chunks, recipe):
    """Run ``order`` (``+c``: forward of model chunk c for its next microbatch, ``-c``: its
    backward) with ``layer_fn(c, m, l)`` as layer l of chunk c for microbatch m. A chunk's input
    is the previous chunk's output detached, so each backward runs one chunk, with the gradient
    the next chunk's backward left on it. Each chunk forward runs in its own ``te.autocast``.
    Returns the last chunk's outputs and every gradient."""
    model.zero_grad(set_to_none=True)
    per = len(model.layers) // chunks
    xs = [x.clone().requires_grad_(True) for x, _ in data]
    inputs, outputs, fwd, bwd = {}, {}, [0] * chunks, [0] * chunks
    for c_id in order:
        c = abs(c_id) - 1
        if c_id > 0:
            m = fwd[c]
            fwd[c] += 1
            h = xs[m] if c == 0 else outputs[(c - 1, m)].detach().requires_grad_(True)
            inputs[(c, m)] = h
            with te.autocast(enabled=recipe is not None, recipe=recipe):
                for layer in range(per):
                    h = layer_fn(c, m, layer)(h)
            outputs[(c, m)] = h
        else:
            m = bwd[c]
            bwd[c] += 1
            grad = data[m][1] if c == chunks - 1 else inputs[(c + 1, m)].grad
            outputs[(c, m)].backward(grad)
    got = {f"out{m}": outputs[(chunks - 1, m)].detach().clone() for m in range(len(data))}
    got.update({f"<input{m}>": x.grad.clone() for m, x in enumerate(xs)})
    got.update({n: p.grad.clone() for n, p in model.named_parameters()})
    return got


@pytest.mark.parametrize("recipe_kind", [None, "delayed"], ids=["bf16", "fp8"])
@pytest.mark.parametrize("layout", list(GRAPH_ORDERS))
def test_graphed_layers_bitwise_equal_eager(layout, recipe_kind):
    """Per-layer graphs from TE's make_graphed_callables through `offload.graphs`, offloading
    every name, against the same model eager without offloading: outputs and every gradient
    bitwise equal over steps with fresh inputs (FP8: delayed scaling updates its scales between
    steps). The graphs hold each (layer, microbatch) once; the groups of a forward graph that a
    backward graph follows stay on the GPU (Note [C1] of offload.capture), all others leave it;
    a replay runs none of the engine's Python."""
    from collections import Counter

    from offload.group import GroupState

    order, microbatches = GRAPH_ORDERS[layout]
    chunks = max(order)
    per = 4 // chunks
    make, mapping = MODELS["parts"]
    recipe = _recipe(recipe_kind)
    data = [[seeded_pair(3000 + 10 * step + m, SEQ, BATCH, HIDDEN, dtype=DTYPE, device="cuda")
             for m in range(microbatches)] for step in range(STEPS)]

    def eager():
        torch.manual_seed(0)
        model = make().cuda()
        return [_pipeline_step(lambda c, m, layer: model.layers[c * per + layer], model, d, order,
                               chunks, recipe) for d in data]

    ref = eager()
    assert _same(ref, eager()) is None, "the reference itself is not reproducible"

    torch.manual_seed(0)
    model = make().cuda()
    names = tuple(mapping)
    manager = offload.configure(list(names), min_tensor_bytes=MIN_BYTES, device="cuda")
    offload.attach(model, mapping)
    sample = tuple((torch.randn(SEQ, BATCH, HIDDEN, device="cuda", dtype=DTYPE, requires_grad=True),)
                   for _ in range(4 * microbatches))
    kwargs = {"enabled": recipe is not None, "recipe": recipe}
    if layout != "layers":
        kwargs["_order"] = order
    try:
        fns = offload.graphs.make_graphed_callables(tuple(model.layers), sample,
                                                    graph_api=te.make_graphed_callables, **kwargs)
        captured = manager.captured_groups
        assert Counter(g.name for g in captured) == {n: 4 * microbatches for n in names}
        # forward graphs followed by a backward capture: the last layer, per microbatch of the
        # last chunk, and chunk 1's second microbatch in the 1F1B order
        kept = {"layers": 1, "vpp_1f1b": 3}[layout]
        assert Counter(g.name for g in captured if g.state is GroupState.KEPT) == {n: kept for n in names}
        for g in captured:
            if g.state is not GroupState.KEPT:
                assert g.state is GroupState.OFFLOADED and sum(r.nbytes for r in g.records if r.host is not None)
        calls = manager.hook_calls
        got = [_pipeline_step(lambda c, m, layer: fns[c * per * microbatches + m * per + layer], model, d,
                              order, chunks, recipe) for d in data]
        assert manager.hook_calls == calls, "a replay runs none of our Python"
    finally:
        offload.reset(release_pool=True)
    diff = _same(ref, got)
    assert diff is None, diff


def test_te_cpu_offload_module_imports():
    """The peer of the benchmark (TE's own offloading) is there: benchmarks/peers.py runs it."""
    from transformer_engine.pytorch.cpu_offload import get_cpu_offload_context

    ctx, sync = get_cpu_offload_context(enabled=True, num_layers=1, model_layers=2)
    assert callable(sync) and hasattr(ctx, "__enter__")
