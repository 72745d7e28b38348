"""The tensor policy, clear errors for bad input, the pinned pool, statistics and NVTX names."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import offload
from offload import OffloadError
from offload.config import OffloadConfig, parse_module_list
from offload.pinned_pool import PinnedHostPool, size_class
from offload.policy import TensorPolicy
from offload.testing import GPT_MAPPING, build_gpt, first_difference, train_step


# ---------------------------------------------------------------- policy
def _policy(min_bytes=0):
    return TensorPolicy(lambda t: t.device.type == "cpu", min_bytes)


def test_policy_rejects_parameters_and_their_views():
    lin = nn.Linear(4, 4)
    p = _policy()
    assert not p.admits(lin.weight)
    assert not p.admits(lin.weight.t())  # a view of a parameter is not an nn.Parameter
    with torch.no_grad():
        view = lin.weight.view(16)  # made without autograd: caught by the storage registry
    p.block_parameters(lin.parameters())
    assert not p.admits(view)


def test_policy_rejects_leaf_inputs_small_and_foreign_tensors():
    p = _policy(min_bytes=64)
    x = torch.randn(100, requires_grad=True)
    assert not p.admits(x)  # a user leaf: someone else holds it
    y = x * 2
    assert p.admits(y)
    assert not p.admits(torch.randn(10) * 2)  # 40 bytes < 64
    assert p.admits(y[:10])  # 40 bytes, but it keeps all 400 of y's storage alive
    other = TensorPolicy(lambda t: False, 0)  # tensors of another device
    assert not other.admits(y)
    assert not p.admits(torch.randn(100).to_sparse())


def test_policy_admits_views_of_activations_made_without_autograd():
    """``torch.split`` inside a custom Function's forward (TE's ``GroupedLinear`` saves its
    per-expert inputs so) gives views that read as leaves requiring grad; their storage is the
    activation's, so they may leave. A view of a user leaf made so stays."""
    p = _policy()
    x = torch.randn(6, 4, requires_grad=True)
    y = x * 2
    with torch.no_grad():
        parts = torch.split(y, [2, 4])
        of_leaf = x.view(24)
    assert parts[0].is_leaf and parts[0].requires_grad  # what autograd reports
    assert all(p.admits(part) for part in parts)
    assert not p.admits(of_leaf)
    plain = torch.randn(24)
    assert p.admits(plain.view(4, 6)) and not p.admits(plain.view(4, 6).requires_grad_())


def test_policy_admits_a_functions_output_that_views_its_own_buffer():
    """A custom Function that writes its output into a buffer it allocates and returns a view
    of it (TE's ``GroupedLinear``): the output's base is that buffer, a leaf that does not
    require grad. The output and views of it (a GLU's halves) are activations and may leave;
    a weight's view and a view made a leaf that requires grad stay."""

    class Matmul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            out = torch.empty(x.shape[0], w.shape[0])
            torch.matmul(x, w.t(), out=out)
            ctx.save_for_backward(x, w)
            return out.view(-1, out.shape[-1])

        @staticmethod
        def backward(ctx, g):
            x, w = ctx.saved_tensors
            return g @ w, g.t() @ x

    p = _policy()
    w = torch.nn.Parameter(torch.randn(6, 4))
    y = Matmul.apply(torch.randn(8, 4, requires_grad=True) * 1, w)
    glu, linear = torch.chunk(y, 2, dim=-1)
    assert glu._base.is_leaf and not glu._base.requires_grad and not glu.is_leaf  # what autograd reports
    assert p.admits(y) and p.admits(glu) and p.admits(linear)
    assert not p.admits(w.t())
    with torch.no_grad():
        leaf_view = y._base.view(48)
    assert p.admits(leaf_view) and not p.admits(leaf_view.requires_grad_())


def test_policy_rejects_subclasses():
    class Sub(torch.Tensor):
        pass

    t = (torch.randn(100) * 2).as_subclass(Sub)
    assert not _policy().admits(t)


def test_never_offload_mark_and_region(configure):
    configure(["g"])
    w = torch.randn(32, requires_grad=True)
    a = torch.randn(32) * 2  # saved by the products below (they need them for w's gradient)
    b = torch.randn(32) * 3
    offload.mark_not_offload(a)
    with offload.group("g", w) as w1:
        y = (a.view(4, 8) * w1.view(4, 8)).sum()  # `a` (through a view) is marked
        with offload.never_offload():
            z = (b * w1).sum()
    with offload.group("g", y + z) as yz:
        out = yz * 1.0
    out.backward()
    s = offload.end_iteration().by_name["g"]
    assert s.bytes_offloaded == 0
    assert torch.equal(w.grad, a + b)


def test_min_tensor_bytes_keeps_small_tensors(configure):
    """Above every saved tensor's size nothing moves; at 0 the same step offloads (the
    control), and either way the gradients are those of the model without offloading."""
    ref_model = build_gpt(32, 4, 2)
    x, g = torch.randn(8, 2, 32), torch.randn(8, 2, 32)
    _, ref = train_step(ref_model, x, g)
    offloaded = {}
    for min_bytes in (1 << 30, 0):
        model = copy.deepcopy(ref_model)
        configure(list(GPT_MAPPING), min_tensor_bytes=min_bytes)
        offload.attach(model, GPT_MAPPING)
        _, got = train_step(model, x, g)
        assert first_difference(ref, got) is None, min_bytes
        offloaded[min_bytes] = offload.end_iteration().total().bytes_offloaded
    assert offloaded[1 << 30] == 0 and offloaded[0] > 0


# ---------------------------------------------------------------- errors
def test_misspelled_name_is_reported_at_attach_and_refused_before_backward_until_fixed(configure):
    """A configured name close to an attached one: a warning at attach; then, once the model's
    first forward is over, `UnknownModuleError` with the valid names when the gradient reaches the
    model's output (before any of its backward and the optimizer step), and again at each
    iteration (its backward and end_iteration) until the config is fixed."""
    configure(["core_atn", "fc1"])
    model = build_gpt(32, 4, 2)
    with pytest.warns(RuntimeWarning, match=r"'core_atn' is not attached \(did you mean 'core_attn'\?\)"):
        offload.attach(model, GPT_MAPPING)
    x = torch.randn(8, 2, 32, requires_grad=True)
    for _ in range(2):  # a user who catches it and goes on hears it again
        out = model(x)
        with pytest.raises(offload.UnknownModuleError,
                           match=r"'core_atn' \(did you mean 'core_attn'\?\).*valid names: .*core_attn"):
            out.sum().backward()
        assert x.grad is None and all(p.grad is None for p in model.parameters())
        with pytest.raises(offload.UnknownModuleError, match="core_atn"):
            offload.end_iteration()
    configure(["core_attn", "fc1"])  # fixed: the same model and hooks train, silently
    model(x).sum().backward()
    assert offload.end_iteration().by_name["fc1"].bytes_offloaded > 0


def test_name_missing_from_model_is_an_error(configure):
    configure(["expert_fc1"])
    model = build_gpt(32, 4, 1)
    offload.attach(model, GPT_MAPPING)
    out = model(torch.randn(8, 2, 32))
    with pytest.raises(offload.UnknownModuleError, match="expert_fc1"):
        out.sum().backward()


def test_attach_and_code_groups_together(configure):
    """Names may come from attach() and from groups in the code at the same time."""
    configure(["core_attn", "mine"])
    model = build_gpt(32, 4, 1)
    offload.attach(model, {"core_attn": GPT_MAPPING["core_attn"]})
    x = torch.randn(8, 2, 32, requires_grad=True)
    with offload.group("mine", x) as x1:
        y = model(x1 * 2.0)
    y.sum().backward()
    assert set(offload.end_iteration().by_name) == {"core_attn", "mine"}


def test_pattern_matching_nothing_is_an_error(configure):
    configure(["core_attn"])
    with pytest.raises(offload.UnknownModuleError, match="matches no submodule.*close module paths"):
        offload.attach(build_gpt(32, 4, 1), {"core_attn": "layers.*.self_attn.core_attention"})


def test_module_matched_by_two_names_is_an_error(configure):
    configure(["a"])
    with pytest.raises(offload.OffloadError, match="matched by both"):
        offload.attach(build_gpt(32, 4, 1), {"a": "layers.0.mlp.*", "b": "layers.0.mlp.linear_fc1"})


def test_misspelled_name_with_context_manager_raises_at_each_end_of_iteration(configure):
    """Groups in code only: the engine sees no forward's end, so end_iteration() raises, at each
    iteration until fixed (`attach(model, {})` would mark the forward's end: see the next test)."""
    configure(["core_atn"])
    x = torch.randn(8, requires_grad=True)
    for _ in range(2):
        with offload.group("core_attn", x) as y:
            z = y.sin()
        z.sum().backward()
        with pytest.raises(offload.UnknownModuleError, match="did you mean 'core_attn'"):
            offload.end_iteration()


def test_attach_without_groups_checks_code_group_names_before_backward(configure):
    """`attach(model, {})` hooks only the model's forward: a misspelled name of a group in the
    model's code is then refused after its first forward, before its backward."""

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 8)

        def forward(self, x):
            with offload.group("mine", x) as x1:
                return self.lin(x1).relu()

    configure(["mien"])
    model = Model()
    offload.attach(model, {})
    out = model(torch.randn(4, 8, requires_grad=True))
    with pytest.raises(offload.UnknownModuleError, match="'mien' \\(did you mean 'mine'\\?\\)"):
        out.sum().backward()


def test_group_inside_group_of_same_name_raises(configure):
    configure(["g"])
    x = torch.randn(8, requires_grad=True)
    with pytest.raises(offload.OffloadError, match="same name"):
        with offload.group("g", x):
            with offload.group("g"):
                pass
    # and the engine is usable afterwards
    with offload.group("g", x) as y:
        z = y.exp()
    z.sum().backward()
    assert torch.equal(x.grad, x.exp().detach())


@pytest.mark.parametrize("cause", ["same_name", "policy"])
def test_error_in_a_module_pre_hook_surfaces_alone(configure, cause):
    """When opening an attached module's group raises (a group of the same name is open
    around it; the group policy raises), that error is the only one: the forward hook that
    torch always calls closes nothing (no "pop from empty list" warned on top), no group is
    left open, and the next step offloads with exact gradients."""
    model = build_gpt(32, 4, 2)
    ref_model = copy.deepcopy(model)
    broken = [cause == "policy"]

    def policy(info):
        if broken[0] and info.name == "fc1" and info.layer == 1:
            raise ValueError("policy failed")
        return True

    manager = configure(list(GPT_MAPPING), policy=policy)
    offload.attach(model, GPT_MAPPING)
    x, g = torch.randn(8, 2, 32), torch.randn(8, 2, 32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cause == "same_name":
            with pytest.raises(OffloadError, match="'fc1' opened inside a group of the same name"):
                with offload.group("fc1"):
                    model(x)
        else:
            with pytest.raises(ValueError, match="policy failed"):
                model(x)
    assert [str(w.message) for w in caught] == []
    assert not manager.in_group
    broken[0] = False
    _, ref = train_step(ref_model, x, g)
    _, got = train_step(model, x, g)
    assert first_difference(ref, got) is None
    stats = offload.end_iteration()
    assert stats.by_name["fc1"].bytes_offloaded > 0
    assert manager.live_handlers == [] and manager.pool.bytes_in_use == 0


@pytest.mark.parametrize("make, bad", [
    (lambda model: offload.group(3), "3 (int)"),
    (lambda model: offload.attach(model, {3: "layers.*.mlp.linear_fc1"}), "3 (int)"),
    (lambda model: offload.attach(model, {"fc1": 3}), "3 (int)"),
    (lambda model: offload.attach(model, {"fc1": ["layers.*.mlp.linear_fc1", None]}), "None (NoneType)"),
    (lambda model: offload.attach(model, {"fc1": b"layers.*.mlp.linear_fc1"}), "b'layers.*.mlp.linear_fc1' (bytes)"),
], ids=["group_name", "mapping_key", "pattern", "pattern_in_list", "bytes_pattern"])
def test_non_string_names_and_patterns_are_refused_early(configure, make, bad):
    """A group name or an attach() pattern that is not a string: an `OffloadTypeError` (a
    TypeError) that names the value, at once (not difflib's "object of type 'int' has no len()"
    later)."""
    configure(["fc1"])
    model = build_gpt(32, 4, 1)
    with pytest.raises(offload.OffloadTypeError) as info:
        make(model)
    message = str(info.value)
    assert message.startswith("offload: ") and "must be a string" in message and f"got {bad}" in message
    assert offload.get_manager().declared_names == set()  # refused before anything was registered


@pytest.mark.parametrize("when", ["inside_group", "after_group"])
def test_in_place_change_of_offloaded_tensor_raises(configure, when):
    configure(["g"])
    w = torch.randn(64, requires_grad=True)
    h = w * 1.0
    with offload.group("g", h) as h1:
        a = h1.exp()  # exp saves its output `a`
        if when == "inside_group":
            a.add_(1)
    with offload.group("g", a) as a1:  # so the first group is offloaded
        b = a1 * 2.0
    if when == "after_group":
        a.add_(1)
    with pytest.raises(offload.SavedTensorModifiedError, match="modified by an inplace operation"):
        b.sum().backward()


def test_in_place_change_of_kept_small_tensor_raises(configure):
    configure(["g"], min_tensor_bytes=1 << 20)  # everything is too small: kept, still checked
    w = torch.randn(8, requires_grad=True)
    with offload.group("g", w * 1.0) as h:
        a = h.exp()
    a.add_(1)
    with pytest.raises(offload.SavedTensorModifiedError, match="is at version 1; expected version 0"):
        a.sum().backward()


def test_pinned_allocation_failure_keeps_tensors_on_device(configure):
    model = build_gpt(32, 4, 3)
    ref_model = copy.deepcopy(model)
    configure(list(GPT_MAPPING), max_pinned_bytes=0)
    offload.attach(model, GPT_MAPPING)
    x, g = torch.randn(8, 2, 32), torch.randn(8, 2, 32)
    _, ref = train_step(ref_model, x, g)
    with pytest.warns(RuntimeWarning, match="cap of 0 bytes.*said once"):
        _, got = train_step(model, x, g)
    assert first_difference(ref, got) is None
    stats = offload.end_iteration()
    assert stats.total().bytes_offloaded == 0 and stats.pinned_failures > 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: no second warning
        train_step(model, x, g)


def test_bad_config_values():
    with pytest.raises(ValueError, match="min_tensor_bytes"):
        OffloadConfig(min_tensor_bytes=-1)
    with pytest.raises(ValueError, match="max_inflight_groups"):
        OffloadConfig(max_inflight_groups=0)
    with pytest.raises(ValueError, match="not a valid module name"):
        OffloadConfig(modules="core attn,1fc")
    with pytest.raises(ValueError, match="copy_chunk_bytes"):
        OffloadConfig(copy_chunk_bytes=-1)
    with pytest.raises(TypeError):
        parse_module_list([3])


def test_parse_module_list_forms():
    assert parse_module_list("core_attn,expert_fc1") == ("core_attn", "expert_fc1")
    assert parse_module_list("core_attn expert_fc1") == ("core_attn", "expert_fc1")
    assert parse_module_list(["core_attn", "expert_fc1,core_attn"]) == ("core_attn", "expert_fc1")
    assert parse_module_list(" , ") == ()


def test_cpu_fallback_says_once_per_process_that_it_saves_nothing(monkeypatch):
    from offload import notices

    monkeypatch.setattr(notices, "_said", set())  # as in a fresh process
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for _ in range(3):
            offload.configure(["core_attn"], device="cpu")
    assert [str(w.message) for w in said if "saves no memory" in str(w.message)] == [
        "offload: no CUDA device; the CPU fallback runs the engine with host copies in place of device "
        "copies and saves no memory (said once per process)."
    ]


def test_begin_chunk_inside_group_raises(configure):
    configure(["g"])
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(offload.OffloadError, match="inside the open group"):
        with offload.group("g", x):
            offload.begin_chunk()


# ---------------------------------------------------------------- pool
def test_size_class_bounds_waste():
    for n in [1, 4095, 4096, 4097, 10**6, 3 * 2**20 + 5, 10**9 + 7]:
        c = size_class(n)
        assert c >= n and c % 4096 == 0
        if n > 4096:
            assert c <= n * (1 + 1 / 32) + 4096


def test_pool_reuses_buffers():
    pool = PinnedHostPool(pin=False)
    a = pool.acquire(10_000)
    pool.release(a, last_read="ev")
    b = pool.acquire(9_999)
    assert b is a and b.last_read == "ev" and pool.allocations == 1
    c = pool.acquire(10_000)
    assert c is not a and pool.allocations == 2
    assert pool.bytes_in_use == 2 * size_class(10_000) and pool.peak_bytes_in_use == pool.bytes_in_use
    pool.close()
    assert pool.bytes_total == 0


def test_pool_stops_growing_when_sizes_change_every_iteration():
    """A mixture of experts' per-expert inputs: 32 buffers an iteration whose sizes follow an
    uneven routing that changes every iteration (same total). Larger free buffers, up to twice
    the size class, serve them: the pool settles near the demand and allocates only for a new
    largest size. Exact size classes alone (control) keep allocating and pin 5x the demand."""
    row, tokens = 2048 * 2, 32 * 1024  # one token of hidden 2048 in bf16

    def run(pool):
        gen = torch.Generator().manual_seed(0)
        allocations = []
        for _ in range(40):
            counts = torch.multinomial(torch.rand(32, generator=gen) + 0.5, tokens, replacement=True,
                                       generator=gen).bincount(minlength=32)
            bufs = [pool.acquire(int(n) * row) for n in counts]
            for buf in bufs:
                pool.release(buf)
            allocations.append(pool.allocations)
        return allocations, pool.bytes_total / (tokens * row)

    allocations, pinned = run(PinnedHostPool(pin=False))
    assert allocations[-1] <= 48 and allocations[-1] - allocations[19] <= 4 and pinned < 2
    exact = PinnedHostPool(pin=False)
    exact._smallest_larger = lambda cls, limit: None
    allocations, pinned = run(exact)
    assert allocations[-1] > 120 and pinned > 4


def test_pool_takes_larger_buffers_up_to_twice_the_size():
    pool = PinnedHostPool(pin=False)
    big = pool.acquire(3 * 2**20)
    pool.release(big)
    assert pool.acquire(2 * 2**20) is big and pool.allocations == 1  # 1.5x: taken
    pool.release(big)
    small = pool.acquire(2**20)  # 3x: a buffer of its own
    assert small is not big and pool.allocations == 2
    pool.release(small)
    assert pool.acquire(2**20) is small  # the exact class first


def test_pool_refuses_to_allocate_during_capture():
    pool = PinnedHostPool(pin=False)
    with pytest.raises(OffloadError, match="pinned host buffer of 100 bytes was needed while a CUDA graph"):
        pool.acquire(100, capturing=True)
    assert pool.allocations == 0
    buf = pool.acquire(100)
    pool.release(buf)
    assert pool.acquire(100, capturing=True) is buf  # a free buffer of the size class is fine


# ---------------------------------------------------------------- stats and nvtx
def test_stats_per_name(configure):
    model = build_gpt(32, 4, 3)
    configure(["core_attn", "fc1"])
    offload.attach(model, GPT_MAPPING)
    x = torch.randn(8, 2, 32)
    model(x).sum().backward()
    stats = offload.end_iteration()
    assert set(stats.by_name) == {"core_attn", "fc1"}
    fc1 = stats.by_name["fc1"]
    # fc1 saves its input, [8, 2, 32] fp32, in each of the two offloaded layers
    assert fc1.bytes_offloaded == 2 * 8 * 2 * 32 * 4 == fc1.bytes_reloaded
    assert stats.pinned_bytes >= stats.total().bytes_offloaded
    assert stats.iteration == 0 and offload.end_iteration().iteration == 1
    d = stats.as_dict()
    assert d["by_name"]["fc1"]["bytes_offloaded"] == fc1.bytes_offloaded and "d2h_gbps" in d["by_name"]["fc1"]


_REFUSE_CUDA_QUERIES = """
import torch
def refuse(*args, **kwargs):
    raise AssertionError("CUDA was queried")
real = torch.cuda.is_available, torch.cuda.device_count
torch.cuda.is_available = torch.cuda.device_count = refuse
"""


_IMPORTS_ONLY_WHAT_IT_NEEDS = """
import sys, offload
assert not [m for m in sys.modules if m.startswith("offload.tools")], "import offload imported offload.tools"
import offload.presets
assert "transformers" not in sys.modules, "import offload.presets imported transformers"
"""


@pytest.mark.parametrize("control", [False, True])
def test_importing_offload_queries_no_cuda_and_imports_no_extras(control):
    """``import offload`` asks nothing of CUDA (a query starts the driver, and a process forked
    afterwards, such as a fork server's workers, cannot use it); the NVTX backend is picked at
    the first range. The control queries CUDA at import and must be caught. In the same fresh
    interpreter: the core imports none of ``offload.tools``, and ``offload.presets`` does not
    import transformers (it reads a model's classes by name)."""
    code = _REFUSE_CUDA_QUERIES + ("torch.cuda.is_available()\n" if control else "") + _IMPORTS_ONLY_WHAT_IT_NEEDS + (
        "import offload.streams, offload.graphs, offload.planner\n"
        "torch.cuda.is_available, torch.cuda.device_count = real\n"
        "offload.nvtx.push('x'); offload.nvtx.pop()\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    if control:
        assert out.returncode != 0 and "CUDA was queried" in out.stderr
    else:
        assert out.returncode == 0, out.stderr


def test_nvtx_ranges_named_after_group_layer_and_microbatch(configure, monkeypatch):
    import offload.nvtx as nv

    names = []
    monkeypatch.setattr(nv, "push", names.append)
    model = build_gpt(32, 4, 2)
    configure(["fc1"])
    offload.attach(model, GPT_MAPPING)
    for _ in range(2):
        model(torch.randn(8, 2, 32)).sum().backward()
    assert names == ["offload/fc1/L0/mb0", "reload/fc1/L0/mb0", "offload/fc1/L0/mb1", "reload/fc1/L0/mb1"]
