"""Reference models and comparison helpers shared by the tests, the benchmarks and the main job.

`GPTLayerStack` is a GPT-style decoder stack whose submodules are named like Megatron-core's
(``input_layernorm``, ``self_attention.linear_qkv``, ``self_attention.core_attention``, ...), so
`GPT_MAPPING` gives the usual offload names (``attn_norm``, ``qkv_linear``, ``core_attn``,
``attn_proj``, ``mlp_norm``, ``fc1``, ``mlp_act``, ``fc2``). It has no dropout: a step is a pure
function of its inputs, which is what bitwise comparisons need.
"""

from __future__ import annotations

import collections
import gc
import socket
import time
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

GPT_MAPPING: dict[str, str] = {
    "attn_norm": "layers.*.input_layernorm",
    "qkv_linear": "layers.*.self_attention.linear_qkv",
    "core_attn": "layers.*.self_attention.core_attention",
    "attn_proj": "layers.*.self_attention.linear_proj",
    "mlp_norm": "layers.*.pre_mlp_layernorm",
    "fc1": "layers.*.mlp.linear_fc1",
    "mlp_act": "layers.*.mlp.activation",
    "fc2": "layers.*.mlp.linear_fc2",
}


class CoreAttention(nn.Module):
    """Causal scaled-dot-product attention on a fused ``[s, b, 3h]`` qkv tensor."""

    def __init__(self, heads: int) -> None:
        super().__init__()
        self.heads = heads

    def forward(self, qkv: torch.Tensor) -> torch.Tensor:
        s, b, three_h = qkv.shape
        h = three_h // 3
        d = h // self.heads
        # [s, b, heads, 3, d] -> three [b, heads, s, d] views of one storage
        qkv = qkv.view(s, b, self.heads, 3, d)
        q, k, v = (qkv[:, :, :, i].permute(1, 2, 0, 3) for i in range(3))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.permute(2, 0, 1, 3).reshape(s, b, h)


class SelfAttention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.linear_qkv = nn.Linear(hidden, 3 * hidden)
        self.core_attention = CoreAttention(heads)
        self.linear_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_proj(self.core_attention(self.linear_qkv(x)))


class GeLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)


class MLP(nn.Module):
    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(hidden, ffn)
        self.activation = GeLU()
        self.linear_fc2 = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.activation(self.linear_fc1(x)))


class TransformerLayer(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attention = SelfAttention(hidden, heads)
        self.pre_mlp_layernorm = nn.LayerNorm(hidden)
        self.mlp = MLP(hidden, ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class GPTLayerStack(nn.Module):
    """``layers`` decoder layers on ``[seq, batch, hidden]`` activations, plus a final norm."""

    def __init__(self, hidden: int, heads: int, layers: int, ffn: int | None = None) -> None:
        super().__init__()
        self.layers = nn.ModuleList(TransformerLayer(hidden, heads, ffn or 4 * hidden) for _ in range(layers))
        self.final_layernorm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.final_layernorm(x)


class Recomputed(nn.Module):
    """Runs ``inner`` under non-reentrant `torch.utils.checkpoint`: what it saves is dropped
    after forward and recomputed in backward; only its inputs are saved."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.inner, *args, use_reentrant=False)


def recompute(model: nn.Module, pattern: str) -> list[str]:
    """Wrap every submodule of ``model`` whose qualified name matches ``pattern`` (fnmatch)
    in `Recomputed`, in place; the wrapper takes the module's name, so mappings that name it
    still match. Submodules of a wrapped module are not wrapped again.
    ``recompute(m, "layers.*.input_layernorm")`` recomputes the norms, ``recompute(m,
    "layers.*")`` whole layers (full recompute). Returns the wrapped names."""
    import fnmatch

    wrapped = []
    for qn, module in list(model.named_modules()):
        inside = any(qn.startswith(w + ".") for w in wrapped)
        if qn and not inside and fnmatch.fnmatchcase(qn, pattern):
            parent_name, _, attr = qn.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, attr, Recomputed(module))
            wrapped.append(qn)
    if not wrapped:
        raise ValueError(f"recompute: {pattern!r} matches no submodule of {type(model).__name__}")
    return wrapped


LIGHT_MODULES = ("layers.*.input_layernorm", "layers.*.pre_mlp_layernorm", "layers.*.mlp.activation")
"""The cheap modules of a `GPTLayerStack` layer, recomputed in a "memory-free" layer while
the others are offloaded."""


class Clock:
    """Timestamps: CUDA events on the current stream, or ``perf_counter`` on CPU."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def mark(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def ms(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return (end - start) * 1e3
        end.synchronize()
        return start.elapsed_time(end)


def build_gpt(
    hidden: int, heads: int, layers: int, ffn: int | None = None,
    dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", seed: int = 0,
) -> GPTLayerStack:
    """A `GPTLayerStack` with weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return GPTLayerStack(hidden, heads, layers, ffn).to(device=device, dtype=dtype)


def train_step(model: nn.Module, x: torch.Tensor, grad_out: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward; returns the output and a copy of every gradient (input too).

    Gradients are zeroed in place, not freed: like the persistent gradient buffers of real
    trainers (DDP buckets, Megatron's grad buffer), so that a step's memory peak reflects
    activations and not gradients allocated afresh during backward.
    """
    model.zero_grad(set_to_none=False)
    x = x.detach().requires_grad_(True)
    out = model(x)
    out.backward(grad_out)
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}
    grads["<input>"] = x.grad.detach().clone()
    return out.detach(), grads


def replay_order(
    chunks: list[nn.Module],
    order: list[int],
    shape: tuple[int, ...],
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    on_event: Callable[[str, int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """Run one pipeline rank's ``order`` (see `offload.schedules`) on its model ``chunks``.

    Random inputs (``shape``) stand in for the activations the previous rank sends, random
    output gradients for the gradients the next rank sends back, both drawn from ``seed`` in
    the order's sequence, so the same call gives the same numbers with or without
    offloading. ``on_event(kind, chunk, microbatch)`` runs after each forward ("F") and
    backward ("B"). Returns every chunk's parameter gradients (``"<chunk>.<name>"``, summed
    over microbatches, as a pipeline rank accumulates them) and each input gradient
    (``"<input c<chunk> mb<mb>>"``).
    """
    from .schedules import schedule_events

    gen = torch.Generator(device=device).manual_seed(seed)
    for chunk in chunks:
        chunk.zero_grad(set_to_none=False)
    pending: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
    grads: dict[str, torch.Tensor] = {}
    for kind, chunk, mb in schedule_events(order):
        if kind == "F":
            x = torch.randn(shape, generator=gen, device=device, dtype=dtype).requires_grad_(True)
            pending[(chunk, mb)] = (x, chunks[chunk](x))
        else:
            x, out = pending.pop((chunk, mb))
            out.backward(torch.randn(out.shape, generator=gen, device=device, dtype=dtype))
            grads[f"<input c{chunk} mb{mb}>"] = x.grad
            del x, out
        if on_event is not None:
            on_event(kind, chunk, mb)
    for c, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            if p.grad is not None:
                grads[f"{c}.{name}"] = p.grad.detach().clone()
    return grads


def first_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> str | None:
    """``None`` if every tensor is bitwise equal, else a description of the first that is not."""
    if a.keys() != b.keys():
        return f"different keys: {sorted(set(a) ^ set(b))}"
    for name in a:
        x, y = a[name], b[name]
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{name}: {x.shape}/{x.dtype} vs {y.shape}/{y.dtype}"
        if not torch.equal(x.view(torch.uint8) if x.dtype == torch.bool else x, y):
            diff = (x.float() - y.float()).abs().max().item()
            return f"{name}: max abs difference {diff:g}"
    return None


def free_port() -> int:
    """A TCP port on 127.0.0.1 free now: the rendezvous of a test's process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def graph_pool_segments() -> list[dict]:
    """The CUDA caching allocator's segments that belong to private pools (the memory CUDA
    graphs hold), as ``torch.cuda.memory._snapshot()`` describes them."""
    segments = torch.cuda.memory._snapshot()["segments"]
    return [seg for seg in segments if tuple(seg.get("segment_pool_id", (0, 0))) != (0, 0)]


def graph_pool_bytes() -> int:
    """Bytes of the private pools' segments, i.e. the memory CUDA graphs hold. A graph's
    activations live there, freed inside the capture and reused by later captures of the
    pool, so ``max_memory_allocated`` does not show them."""
    return sum(seg["total_size"] for seg in graph_pool_segments())


def saved_bytes_by_name(model: nn.Module, mapping: dict[str, str], run: Callable[[], None]) -> dict[str, int]:
    """Activation bytes that autograd saves inside each mapped module during ``run()``, without
    offloading: what offloading those modules can move at most. Parameters and views of them
    (``weight.t()``, saved by ``addmm``) are not counted: they are never offloaded."""
    import fnmatch

    totals: dict[str, int] = {name: 0 for name in mapping}
    current: list[str] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t._base
        parameter = (t.requires_grad and t.is_leaf) or (base is not None and base.requires_grad and base.is_leaf)
        if current and not parameter:
            totals[current[-1]] += t.numel() * t.element_size()
        return t

    def enter(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: tuple) -> None:
            current.append(name)

        return hook

    def leave(module: nn.Module, args: tuple, output: object) -> None:
        current.pop()  # returns None: a forward hook's return value would replace the output

    hooks = []
    for qn, module in model.named_modules():
        for name, pattern in mapping.items():
            if qn and fnmatch.fnmatchcase(qn, pattern):
                hooks.append(module.register_forward_pre_hook(enter(name)))
                hooks.append(module.register_forward_hook(leave, always_call=True))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for h in hooks:
            h.remove()
    return totals


def slow_copy_streams(monkeypatch: Any, spin_cycles: int = 2_000_000) -> None:
    """Queue a spinning kernel (``spin_cycles``, 2M is about a millisecond) on the side stream
    before every offload and every reload, so copies run late: any missing event edge then
    reads or frees memory too early. ``monkeypatch`` is pytest's fixture (undone after the test);
    inside a CUDA graph capture the spin is captured too."""
    from .streams import CudaStreams

    copy = CudaStreams.copy

    def slow_copy(self: Any, stream: Any, *args: Any) -> None:
        with torch.cuda.stream(stream):  # after the stream's waits, before its copies
            torch.cuda._sleep(spin_cycles)
        copy(self, stream, *args)

    monkeypatch.setattr(CudaStreams, "copy", slow_copy)


def cyclic_garbage(run: Callable[[], None]) -> dict[str, int]:
    """This library's objects that ``run()`` left in reference cycles, by type name: objects only
    Python's cyclic collector can free, which pile up (with the CUDA events and any memory they
    hold) while it is off, as under ``gc.disable()`` or Megatron's ``--manual-gc``, and which
    otherwise live into the collector's oldest generation, whose full collections they make
    more frequent."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        run()
    finally:
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            gc.collect()
            found = collections.Counter(type(obj).__name__ for obj in gc.garbage
                                        if type(obj).__module__.split(".")[0] == "offload")
        finally:
            gc.garbage.clear()
            gc.set_debug(0)
            if was_enabled:
                gc.enable()
    return dict(found)
