"""The planner (offload.plan, configure(modules="auto")): budgets, the checkpoint arithmetic on a
synthetic profile with known answers, the model against the engine and against what a
checkpointed step saves (CPU), the choice on a profile of the tiny GPT stack with GPU-like times
(offload when the link is fast, checkpoint when it is slow, the "memory-free" layer when nothing
else reaches the budget), the check and its re-plan, and bitwise gradients of an applied plan."""

from __future__ import annotations

import copy
import json
import runpy
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

import offload
from offload import Budget, OffloadTypeError, OffloadValueError
from offload.planner import check, search
from offload.planner.apply import Applied, checkpoint_modules, checkpoint_regions, region_modules
from offload.planner.planning import _profile, describe
from offload.planner.structure import find_containers
from offload.testing import GPT_MAPPING, build_gpt, first_difference, train_step
from offload.tools.advisor import Model
from offload.tools.bandwidth import Bandwidth
from offload.tools.profile_modules import record_saved, split_label
from offload.tools.workload import Workload

GIB = 2**30
SHAPE = (64, 2, 32)
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


# ------------------------------------------------------------------ budgets
@pytest.mark.parametrize("spec, kind, amount, percent, text", [
    ("20GiB", "peak", 20 * GIB, False, "20GiB"),
    (" 1.5 gib", "peak", 1.5 * GIB, False, "1.5GiB"),
    ("512MiB", "peak", 512 * 2**20, False, "0.5GiB"),
    (3 * GIB, "peak", 3 * GIB, False, "3GiB"),
    ("-4GiB", "below", 4 * GIB, False, "-4GiB"),
    ("-30%", "below", 30, True, "-30%"),
    ("fit", "fit", 10, True, "fit:10%"),
    ("fit:5%", "fit", 5, True, "fit:5%"),
    ("FIT:0%", "fit", 0, True, "fit:0%"),
])
def test_budget_forms(spec, kind, amount, percent, text):
    b = Budget.parse(spec)
    assert (b.kind, b.amount, b.percent, str(b)) == (kind, amount, percent, text)
    assert Budget.parse(b) is b and Budget.parse(str(b)) == b


def test_budget_resolves_against_the_peak_and_the_device():
    assert Budget.parse("20GiB").resolve(None, None) == 20 * GIB
    assert Budget.parse("-4GiB").resolve(16 * GIB, None) == 12 * GIB
    assert Budget.parse("-25%").resolve(16 * GIB, None) == 12 * GIB
    assert Budget.parse("fit:10%").resolve(16 * GIB, 80 * GIB) == 72 * GIB
    with pytest.raises(OffloadValueError, match="no CUDA|there is none"):
        Budget.parse("fit").resolve(16 * GIB, None)
    with pytest.raises(OffloadValueError, match="nothing can meet it"):
        Budget.parse("-20GiB").resolve(16 * GIB, None)


@pytest.mark.parametrize("spec, error, match", [
    (2.5, OffloadTypeError, "string such as"),
    (True, OffloadTypeError, "string such as"),
    (["20GiB"], OffloadTypeError, "string such as"),
    (0, OffloadValueError, "> 0 bytes"),
    ("20", OffloadValueError, "needs a unit"),
    ("20GB", OffloadValueError, "did you mean '20GiB'"),
    ("30%", OffloadValueError, "below the current peak"),
    ("-100%", OffloadValueError, "below the current peak"),
    ("fit:100%", OffloadValueError, "0 to 99%"),
    ("fit:-5%", OffloadValueError, "0 to 99%"),
    ("lots", OffloadValueError, "is not one of"),
    ("0GiB", OffloadValueError, "more than 0 bytes"),
])
def test_budget_errors(spec, error, match):
    with pytest.raises(error, match=match):
        Budget.parse(spec)


def test_configure_auto_checks_its_arguments_before_anything(configure):
    manager = configure(["core_attn"])
    model = build_gpt(32, 4, 2)
    with pytest.raises(OffloadValueError, match="needs memory_budget"):
        offload.configure("auto", model=model, mapping=GPT_MAPPING, step=lambda: None)
    with pytest.raises(OffloadTypeError, match="memory_budget must be"):
        offload.configure("auto", memory_budget=0.5, model=model, mapping=GPT_MAPPING, step=lambda: None)
    with pytest.raises(OffloadValueError, match="give model=, step="):
        offload.configure("auto", memory_budget="-30%", mapping=GPT_MAPPING)
    with pytest.raises(OffloadValueError, match="leave max_inflight_groups"):
        offload.configure("auto", memory_budget="-30%", model=model, mapping=GPT_MAPPING, step=lambda: None,
                          max_inflight_groups=2)
    with pytest.raises(OffloadValueError, match="are for modules='auto'"):
        offload.configure("core_attn", memory_budget="-30%")
    assert offload.get_manager() is manager  # every refusal left the engine as it was


def test_plan_checks_its_arguments_before_running_the_step():
    model = build_gpt(32, 4, 2)

    def step():
        raise AssertionError("the step must not run")

    with pytest.raises(OffloadTypeError, match="memory_budget must be"):
        offload.plan(model, GPT_MAPPING, step, 2.5)
    with pytest.raises(offload.UnknownModuleError, match="no module matches core_attn"):
        offload.plan(model, {"core_attn": "layers.*.attention"}, step, "-30%")
    with pytest.raises(OffloadValueError, match="one module pattern per name"):
        offload.plan(model, {"fc1": ["layers.0.mlp.linear_fc1", "layers.1.mlp.linear_fc1"]}, step, "-30%")
    with pytest.raises(OffloadTypeError, match="step must be a callable"):
        offload.plan(model, GPT_MAPPING, None, "-30%")


# ------------------------------------------------------------------ the arithmetic, by hand
def layer_profile() -> dict:
    """Three layers, container ``L`` holding ``a`` then ``b``. Per layer i: ``x`` (1 MB) is L's
    input, saved by a; ``t`` (4 MB) is made in a and saved by b; ``o`` (2 MB) is made between a
    and b, outside both but inside L, and saved there (an "(other)" save inside the layer)."""
    storages, inputs, other = [], {}, {}
    for i in range(3):
        k = len(storages)
        storages += [{"bytes": 1_000_000, "eligible": True, "savers": [f"a:{i}"], "created_in": None},
                     {"bytes": 4_000_000, "eligible": True, "savers": [f"b:{i}"], "created_in": f"a:{i}"},
                     {"bytes": 2_000_000, "eligible": True, "savers": ["(other)"], "created_in": None}]
        inputs.update({f"L:{i}": [k], f"a:{i}": [k], f"b:{i}": [k + 1]})
        other[str(k + 2)] = [[f"L:{i}"]]
    return {
        "names": ["a", "b"], "close_order": [[n, i] for i in range(3) for n in "ab"], "step_ms": 30.0,
        "forward_ms": 9.0, "backward_ms": 18.0, "peak_allocated": 100_000_000,
        "modules": {"a": {"fwd_ms": [1.0] * 3, "bwd_ms": [2.0] * 3}, "b": {"fwd_ms": [2.0] * 3, "bwd_ms": [4.0] * 3}},
        "storages": storages,
        "regions": {"containers": {"L": {"modules": ["l.0", "l.1", "l.2"], "members": ["a", "b"], "instances": 3}},
                    "within": {f"{n}:{i}": [f"L:{i}"] for i in range(3) for n in "ab"},
                    "inputs": inputs, "other": other},
    }


def test_checkpoint_arithmetic_on_a_known_profile():
    m = Model(layer_profile(), Bandwidth.constant(1.0))
    # b alone: t stays nowhere else, so it is recomputed (layers 0 and 1: the last one's recompute
    # runs at the start of backward, at the peak); b then saves its input, t itself... which it
    # made not: t is made in a, so b's checkpoint saves t as its input and nothing is freed
    assert m.predict(checkpoint=["b"]).recomputed_bytes == 0
    # a alone: a saves x (its input) either way, and t is b's: nothing freed
    assert m.predict(checkpoint=["a"]).recomputed_bytes == 0
    # the layer: t and o of layers 0 and 1 are recomputed; x is the layer's input, still saved
    layer = m.predict(checkpoint=["L"])
    assert layer.recomputed_bytes == 2 * 6_000_000 and layer.peak_bytes == 88_000_000
    # recompute stops at the layer's last save, b's input t, which autograd saves before b's
    # op runs: a is run again (1 ms a layer), b is not; a or b alone saves only its input
    assert layer.recompute_ms == pytest.approx(3.0) and layer.offloaded_bytes == 0
    assert m.predict(checkpoint=["a"]).recompute_ms == 0 and m.predict(checkpoint=["b"]).recompute_ms == 0
    # ... and its inputs offloaded: x of layers 0 and 1 (the last is kept), L owns them; both
    # are held at the flush (L:2's close, the forward's end) and nothing comes after it
    free = m.predict(checkpoint=["L"], offload=["L"])
    assert free.offloaded_by_name == {"L": 2_000_000} and free.bytes_per_group == {"L": 1_000_000}
    assert free.inflight_bytes == 2_000_000 and free.freed_at_peak == 12_000_000
    buffered = Model({**layer_profile(), "forward_end_allocated": 99_000_000}, Bandwidth.constant(1.0))
    free = buffered.predict(checkpoint=["L"], offload=["L"])  # 1 MB of backward buffers absorb one
    assert free.inflight_bytes == 1_000_000 and free.freed_at_peak == 13_000_000
    # offloading a without checkpoint moves x; with b it moves t too
    assert m.predict(offload=["a"]).offloaded_by_name == {"a": 2_000_000}
    assert m.predict(offload=["a", "b"]).offloaded_by_name == {"a": 2_000_000, "b": 8_000_000}
    for bad, match in [(dict(checkpoint=["L", "a"]), "lies inside"), (dict(checkpoint=["L"], offload=["a"]), "inside"),
                       (dict(offload=["L"]), "only when checkpointed"), (dict(checkpoint=["a"], recompute=["b"]), "combined"),
                       (dict(checkpoint=["z"]), "unknown")]:
        with pytest.raises(ValueError, match=match):
            m.predict(**bad)
    assert search.checkpoint_sets(m, ["L", "a", "b"]) == [(), ("b",), ("a",), ("a", "b"), ("L",)]


def test_last_instances_of_two_regions_are_recomputed_one_after_another():
    """Two containers a layer, P (a, b) then Q (c, d): t (4 MB, made in a, saved by b) and u
    (2 MB, made in c, saved by d) are recomputed. Checkpointing both frees t and u of layers 0
    and 1; of the last layer, whose regions are recomputed (and freed) one after another at the
    start of backward, the smaller, u, is freed at the peak too."""
    storages, inputs = [], {}
    for i in range(3):
        k = len(storages)
        storages += [{"bytes": 1_000_000, "eligible": True, "savers": [f"a:{i}"], "created_in": None},
                     {"bytes": 4_000_000, "eligible": True, "savers": [f"b:{i}"], "created_in": f"a:{i}"},
                     {"bytes": 1_000_000, "eligible": True, "savers": [f"c:{i}"], "created_in": f"b:{i}"},
                     {"bytes": 2_000_000, "eligible": True, "savers": [f"d:{i}"], "created_in": f"c:{i}"}]
        inputs.update({f"P:{i}": [k], f"Q:{i}": [k + 2]})
    prof = {"names": list("abcd"), "close_order": [[n, i] for i in range(3) for n in "abcd"], "step_ms": 30.0,
            "forward_ms": 9.0, "backward_ms": 18.0, "peak_allocated": 100_000_000,
            "modules": {n: {"fwd_ms": [1.0] * 3, "bwd_ms": [2.0] * 3} for n in "abcd"}, "storages": storages,
            "regions": {"containers": {"P": {"members": ["a", "b"], "instances": 3},
                                       "Q": {"members": ["c", "d"], "instances": 3}},
                        "within": {f"{n}:{i}": [f"{'P' if n in 'ab' else 'Q'}:{i}"] for i in range(3) for n in "abcd"},
                        "inputs": inputs, "other": {}}}
    m = Model(prof, Bandwidth.constant(1.0))
    assert m.predict(checkpoint=["P"]).recomputed_bytes == 2 * 4_000_000
    assert m.predict(checkpoint=["Q"]).recomputed_bytes == 2 * 2_000_000
    assert m.predict(checkpoint=["P", "Q"]).recomputed_bytes == 2 * 6_000_000 + 2_000_000


def test_selective_checkpoint_arithmetic_on_a_known_profile():
    """L checkpointed keeping a: t (made in a) stays, held by the policy's cache and out of the
    engine's reach; o (saved outside a and b) is recomputed; a is not run again, nor b (early
    stop), so the recompute costs nothing. Keeping b instead: its output u, which nothing saves,
    is held in every layer, the last one included: memory the step never held before."""
    prof = layer_profile()
    for i in range(3):  # b's output, 3 MB a layer, that nothing saves (what structure.record adds)
        prof["storages"].append({"bytes": 3_000_000, "eligible": True, "savers": [], "created_in": f"b:{i}",
                                 "unsaved": True})
    m = Model(prof, Bandwidth.constant(1.0))
    assert m.predict(checkpoint=["L"]).recomputed_bytes == 2 * 6_000_000  # the unsaved rows change nothing
    assert m.predict(recompute=["b"]).recomputed_bytes == 0 and m.saved_bytes() == 3 * 7_000_000
    keep_a = m.predict(checkpoint=["L"], selective=["a"])
    assert keep_a.recomputed_bytes == 2 * 2_000_000 and keep_a.recompute_ms == 0
    assert m.predict(checkpoint=["L"], selective=["a"], offload=["L"]).offloaded_by_name == {"L": 2_000_000}
    keep_b = m.predict(checkpoint=["L"], selective=["b"])
    assert keep_b.recomputed_bytes == 2 * 6_000_000 - 3 * 3_000_000
    assert keep_b.recompute_ms == pytest.approx(3.0)  # a runs again; b would not have run anyway
    assert search.selective_variants(m, "L") == [(), ("a",)] and search.selective_variants(m, "a") == [()]
    for bad, match in [(dict(selective=["a"]), "checkpointed container around"),
                       (dict(checkpoint=["a"], selective=["a"]), "checkpointed container around"),
                       (dict(checkpoint=["L"], selective=["L"]), "module names"),
                       (dict(checkpoint=["L"], selective=["a", "b"]), "recomputes nothing")]:
        with pytest.raises(ValueError, match=match):
            m.predict(**bad)


# ------------------------------------------------------------------ the tiny GPT stack on CPU
def gpt_step(model: torch.nn.Module):
    x, g = torch.randn(SHAPE, generator=torch.Generator().manual_seed(3)), torch.randn(SHAPE)

    def step() -> None:
        model.zero_grad(set_to_none=False)
        model(x.detach().requires_grad_(True)).backward(g)

    return step


@pytest.fixture(scope="module")
def gpt():
    """The tiny GPT stack, its containers and its profile with region facts (CPU)."""
    model = build_gpt(32, 4, 4)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    step = gpt_step(model)
    containers = find_containers(model, GPT_MAPPING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        offload.configure((), device="cpu", min_tensor_bytes=0)
        prof = _profile(model, GPT_MAPPING, containers, step, torch.device("cpu"), 0, None)
    return model, step, containers, prof


def test_containers_of_the_gpt_stack(gpt):
    model, _, containers, prof = gpt
    assert containers == {"layers": [f"layers.{i}" for i in range(4)],
                          "self_attention": [f"layers.{i}.self_attention" for i in range(4)],
                          "mlp": [f"layers.{i}.mlp" for i in range(4)]}
    assert prof["regions"]["containers"]["mlp"]["members"] == ["fc1", "mlp_act", "fc2"]
    assert prof["regions"]["within"]["core_attn:2"] == ["layers:2", "self_attention:2"]
    assert prof["peak_estimated"] and prof["peak_allocated"] == sum(s["bytes"] for s in prof["storages"] if s["savers"])
    unsaved = {s["created_in"] for s in prof["storages"] if s.get("unsaved")}  # outputs nothing saves
    assert {f"{n}:{i}" for n in ("attn_proj", "fc2") for i in range(4)} <= unsaved


CASES = [((), ("core_attn", "attn_proj")), (("layers",), ("layers",)),
         (("mlp",), ("mlp", "core_attn", "attn_proj", "qkv_linear")),
         (("self_attention", "mlp"), ("self_attention", "mlp", "attn_norm", "mlp_norm")),
         (("mlp_act",), ("mlp_act", "fc1")), (("core_attn", "fc1"), ("core_attn", "fc1", "attn_proj"))]


@pytest.mark.parametrize("checkpointed, offloaded", CASES, ids=[describe(search.Assignment(*c)) for c in CASES])
def test_model_equals_the_engine_and_what_the_checkpointed_step_saves(gpt, configure, checkpointed, offloaded):
    """The bytes the engine offloads under a plan are the model's, name by name, and so are the
    bytes it holds in flight when it flushes at the forward's last group (the CPU fallback's
    copies finish only when waited for: the host is ahead, as the model assumes); and the
    storages a step with those regions checkpointed saves (recorded without offloading) are the
    model's kept storages, byte for byte: the checkpoint transform is exact on this model."""
    model, step, containers, prof = gpt
    m = Model(prof, Bandwidth.constant(10.0))
    applied = Applied(model, GPT_MAPPING, containers, checkpointed, offloaded, 1, {"min_tensor_bytes": 0, "device": "cpu"})
    copies = offload.get_manager().copies
    flushed = []  # per flush: the bytes it waited for

    def flush() -> None:
        groups = [*copies.inflight, *copies.deferred]
        type(copies).flush(copies)
        flushed.append(sum(rec.nbytes for g in groups for rec in g.records if rec.host is not None))

    copies.flush = flush
    try:
        for _ in range(2):
            flushed.clear()
            step()
            stats = offload.end_iteration()
    finally:
        applied.remove()
    predicted = m.predict(offload=offloaded, checkpoint=checkpointed)
    got = {n: s.bytes_offloaded for n, s in stats.by_name.items() if s.bytes_offloaded}
    assert got == predicted.offloaded_by_name
    # the second step knows its forward's last group: one flush there, one (empty) at the backward's start
    assert flushed == [predicted.flush_bytes, 0] and predicted.flush_bytes > 0

    where = region_modules(model, GPT_MAPPING, containers)
    undo = checkpoint_modules(model, [qn for r in checkpointed for qn in where[r]])
    try:
        saved, _ = record_saved(Workload(model, GPT_MAPPING, step, torch.device("cpu")), 0)
    finally:
        undo()
    rows, _, _ = m._checkpoint_rows(frozenset(checkpointed)) if checkpointed else (
        [(s["bytes"],) for s in prof["storages"] if not s.get("unsaved")], 0, 0)
    assert sum(r[0] for r in rows) == sum(s["bytes"] for s in saved)


class LiveStorages(torch.utils._python_dispatch.TorchDispatchMode):
    """Every storage the ops make, weakly: `live_bytes` is what is still alive of them."""

    def __init__(self):
        super().__init__()
        self.made = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                self.made[st._cdata] = (StorageWeakRef(st), st.nbytes())
        return out

    def live_bytes(self):
        return sum(n for ref, n in self.made.values() if not ref.expired())


def held_at_forward_end(model, checkpointed=(), selective=()):
    """Bytes the forward's ops made that are alive when it returns (saved, cached, its output),
    with ``checkpointed`` checkpointed in every layer but the last: the model's peak is at the
    start of the backward, when the last layer has been recomputed already."""
    where = region_modules(model, GPT_MAPPING, find_containers(model, GPT_MAPPING))
    last = f"layers.{len(model.layers) - 1}"
    where = {r: [qn for qn in qns if qn != last and not qn.startswith(last + ".")] for r, qns in where.items()}
    undo = checkpoint_regions(model, where, tuple(checkpointed), tuple(selective))
    x = torch.randn(SHAPE, requires_grad=True)
    try:
        with LiveStorages() as live:
            out = model(x)
        held = live.live_bytes()
        out.sum().backward()
    finally:
        undo()
    return held


SELECTIVE_CASES = [(("mlp",), ("fc1",)), (("mlp",), ("mlp_act",)), (("self_attention",), ("core_attn",)),
                   (("self_attention",), ("qkv_linear", "core_attn")),
                   (("layers",), ("qkv_linear", "core_attn", "attn_proj", "fc1")), (("layers",), ())]


@pytest.mark.parametrize("checkpointed, selective", SELECTIVE_CASES,
                         ids=[describe(search.Assignment(c, selective=k)) for c, k in SELECTIVE_CASES])
def test_model_equals_what_a_selective_checkpoint_holds(gpt, checkpointed, selective):
    """What the forward holds when it returns, by every storage its ops made: checkpointing a
    region, with some modules' outputs kept by the policy (their unsaved outputs too), holds the
    model's net recomputed bytes less than the plain forward, byte for byte (the last layer,
    recomputed at the peak, apart: its cache holds the kept modules' unsaved outputs too)."""
    model, _, _, prof = gpt
    m = Model(prof, Bandwidth.constant(10.0))
    plain = held_at_forward_end(model)
    held = held_at_forward_end(model, checkpointed, selective)
    pred = m.predict(checkpoint=checkpointed, selective=selective)
    last = len(model.layers) - 1
    cached_in_last = sum(s["bytes"] for s in prof["storages"] if s.get("unsaved") and s["created_in"]
                         and split_label(s["created_in"]) in {(n, last) for n in selective})
    assert plain - held == pred.recomputed_bytes + cached_in_last


class OpCount(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self, ops):
        super().__init__()
        self.ops, self.count = ops, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func in self.ops
        return func(*args, **(kwargs or {}))


def test_selective_checkpoint_runs_no_kept_module_again(gpt):
    """The MLP checkpointed keeping fc1: its recompute runs the activation alone, no matmul
    (fc2's is never run again: early stop); checkpointed in full, it runs fc1's again."""
    model = gpt[0]
    where = region_modules(model, GPT_MAPPING, find_containers(model, GPT_MAPPING))

    def backward_matmuls(selective):
        undo = checkpoint_regions(model, where, ("mlp",), selective)
        try:
            out = model(torch.randn(SHAPE, requires_grad=True))
            with OpCount({torch.ops.aten.mm.default, torch.ops.aten.addmm.default}) as count:
                out.sum().backward()
        finally:
            undo()
        return count.count

    full, kept = backward_matmuls(()), backward_matmuls(("fc1",))
    assert full - kept == len(model.layers) > 0
    assert not model.layers[0].mlp.linear_fc1._forward_pre_hooks  # the policy's hooks are gone


FWD_MS = {"attn_norm": .1, "qkv_linear": .6, "core_attn": 1.0, "attn_proj": .2, "mlp_norm": .1, "fc1": .8,
          "mlp_act": .1, "fc2": .8}


def gpu_like(prof: dict) -> dict:
    """The tiny stack's profile with the times of a large one: a layer's forward 3.7 ms, its
    backward twice that, attention and the MLP's matmuls the heavy modules; and, as a GPU
    profile has, the backward's first buffers: the MLP's two input gradients (twice its largest
    saved tensor) beyond the forward's end."""
    prof = copy.deepcopy(prof)
    prof["forward_end_allocated"] = prof["peak_allocated"] - 2 * max(s["bytes"] for s in prof["storages"])
    for name, t in prof["modules"].items():
        t["fwd_ms"] = [FWD_MS[name]] * len(t["fwd_ms"])
        t["bwd_ms"] = [2 * FWD_MS[name]] * len(t["bwd_ms"])
    layers = len(prof["modules"]["fc1"]["fwd_ms"])
    prof.update(forward_ms=3.7 * layers, backward_ms=7.4 * layers, step_ms=11.1 * layers)
    return prof


def test_offloading_beats_recompute_on_a_fast_link(gpt):
    """Copies of a layer well under its compute: the plan offloads and checkpoints nothing, for
    free, down to what offloading alone reaches."""
    prof = gpu_like(gpt[3])
    m = Model(prof, Bandwidth.constant(10.0))
    a, p = search.choose(m, int(0.4 * prof["peak_allocated"]))
    assert not a.checkpoint and {"core_attn", "fc1", "mlp_act", "fc2"} <= set(a.offload)
    assert p.peak_bytes <= 0.4 * prof["peak_allocated"] and p.cost_ms < 0.05
    none, _ = search.choose(m, prof["peak_allocated"])  # no saving asked: nothing done
    assert none == search.Assignment()


def test_recompute_beats_offloading_on_a_slow_link(gpt):
    """Copies far slower than compute: the same budget is met by checkpointing containers, and
    only what is cheap to copy is offloaded."""
    prof = gpu_like(gpt[3])
    m = Model(prof, Bandwidth.constant(0.01))
    a, p = search.choose(m, int(0.4 * prof["peak_allocated"]))
    assert a.checkpoint and set(a.checkpoint) <= set(m.containers)
    offload_only = min((search._best_for(m, (), offloaded, lambda q: search.rank(q, 0)) for offloaded in
                        [("qkv_linear", "core_attn", "attn_proj", "mlp_norm", "fc1", "mlp_act", "fc2")]),
                       key=lambda q: q.cost_ms)
    assert p.cost_ms < offload_only.cost_ms


def test_selective_checkpoint_when_recomputing_the_cheap_module_is_enough(gpt):
    """A small saving on a slow link: the MLP checkpointed keeping fc1, so that its recompute
    runs only the activation (fc2 is not run again either way); without selective
    checkpointing the best plan for the same budget offloads three names and costs more
    (0.57 against 0.40 ms: the wait for fc1's second-to-last copy at the forward's end)."""
    prof = gpu_like(gpt[3])
    m = Model(prof, Bandwidth.constant(0.01))
    assert search.selective_variants(m, "mlp") == [(), ("fc1",), ("fc1", "mlp_act")]
    budget = int(0.9 * prof["peak_allocated"])
    a, p = search.choose(m, budget)
    assert a == search.Assignment(checkpoint=("mlp",), selective=("fc1",)) and p.peak_bytes <= budget
    assert p.recompute_ms == pytest.approx(4 * FWD_MS["mlp_act"])
    full, q = search.choose(m, budget, selective=False)
    assert not full.selective and full.offload == ("attn_norm", "qkv_linear", "fc1")
    assert q.cost_ms > 1.4 * p.cost_ms
    rows = {r["unit"]: r for r in search.explain(m, a, p)}
    assert rows["fc1"]["choice"] == "saved in mlp" and rows["mlp_act"]["choice"] == "in mlp"
    assert describe(a) == "checkpoint mlp (keeping fc1)"


def test_memory_free_layer_when_nothing_else_reaches_the_budget(gpt):
    """With the layers as the only regions (``plan(regions={"layers": ...})``), below what
    checkpointing every layer keeps (the layers' inputs), the plan checkpoints the layers and
    offloads the inputs they keep: the "memory-free" layer."""
    prof = gpu_like(gpt[3])
    regions = prof["regions"]
    regions["containers"] = {"layers": regions["containers"]["layers"]}
    regions["within"] = {k: [c for c in v if c.startswith("layers:")] for k, v in regions["within"].items()}
    m = Model(prof, Bandwidth.constant(0.01))
    full = m.predict(checkpoint=["layers"])
    a, p = search.choose(m, full.peak_bytes - 1)
    assert a.checkpoint == ("layers",) and a.offload == ("layers",)
    assert p.peak_bytes < full.peak_bytes and p.offloaded_by_name["layers"] > 0
    rows = {r["unit"]: r for r in search.explain(m, a, p)}
    assert rows["layers"]["choice"] == "checkpoint+offload" and rows["fc1"]["choice"] == "in layers"
    assert "its inputs" in rows["layers"]["why"]


def test_local_search_finds_the_exhaustive_choice(gpt, monkeypatch):
    prof = gpu_like(gpt[3])
    for gbps in (10.0, 0.05, 0.01):
        m = Model(prof, Bandwidth.constant(gbps))
        for frac in (0.9, 0.6, 0.4, 0.25):
            budget = int(frac * prof["peak_allocated"])
            _, exhaustive = search.choose(m, budget)
            monkeypatch.setattr(search, "EXHAUSTIVE_MAX", 0)
            _, local = search.choose(m, budget)
            monkeypatch.undo()
            assert search.rank(local, budget)[:3] == search.rank(exhaustive, budget)[:3], (gbps, frac)


# ------------------------------------------------------------------ the check and the re-plan
def test_replan_trigger_and_corrections(gpt):
    prof = gpu_like(gpt[3])
    prof["peak_allocated"] = 2 * prof["peak_allocated"]  # with weights: the activations are a share
    link = Bandwidth.constant(0.05)
    m = Model(prof, link)
    budget = prof["peak_allocated"] - int(0.5 * sum(s["bytes"] for s in prof["storages"]))
    a, p = search.choose(m, budget)
    step = check.predicted_step_ms(prof, p)
    exact = check.Measured(step_ms=step * 1.04, peak_bytes=int(p.peak_bytes * 0.97), wait_ms=0.0)
    assert check.deviations(step, p.peak_bytes, exact) == []  # within 5%: no re-plan
    high = check.Measured(step_ms=step, peak_bytes=int(p.peak_bytes * 1.08), wait_ms=0.0)
    assert [d.split()[0] for d in check.deviations(step, p.peak_bytes, high)] == ["peak"]
    slow = check.Measured(step_ms=step * 1.3, peak_bytes=p.peak_bytes, wait_ms=0.0, d2h_gbps=0.025, h2d_gbps=0.025)
    assert [d.split()[0] for d in check.deviations(step, p.peak_bytes, slow)] == ["step"]
    # a peak 8% over the prediction: every plan is assumed off by as much, so the next plan
    # aims lower and is predicted to meet the budget with the offset included
    prof2, link2, offset, notes = check.calibrate(prof, link, p, high)
    assert offset == high.peak_bytes - p.peak_bytes and link2 is link
    a2, p2 = search.choose(Model(prof2, link2), budget - offset)
    assert p2.peak_bytes + offset <= budget < high.peak_bytes
    # copies at half the assumed speed: the link is corrected, and recompute gets what is left
    prof3, link3, _, notes = check.calibrate(prof, link, p, slow)
    assert link3.gbps("d2h", 2**20) == pytest.approx(0.025) and any("link" in n for n in notes)


def test_a_peak_over_the_budget_deviates_however_close_to_the_prediction():
    m = check.Measured(step_ms=100.0, peak_bytes=1010)
    assert check.deviations(100.0, 1000, m) == []  # 1% over the prediction: within 5%
    assert [d.split()[0] for d in check.deviations(100.0, 1000, m, budget_bytes=1005)] == ["peak"]
    assert "over the budget" in check.deviations(100.0, 1000, m, budget_bytes=1005)[0]
    assert check.deviations(100.0, 1000, m, budget_bytes=1010) == []


def test_a_peak_under_the_prediction_raises_no_budget(gpt):
    """The error of one plan's peak below its prediction is that plan's: the budget the model
    plans for is lowered by a peak over the prediction, and never raised."""
    prof = gpu_like(gpt[3])
    link = Bandwidth.constant(0.05)
    a, p = search.choose(Model(prof, link), int(0.7 * prof["peak_allocated"]))
    low = check.Measured(step_ms=check.predicted_step_ms(prof, p), peak_bytes=int(p.peak_bytes * 0.8), wait_ms=0.0)
    assert check.calibrate(prof, link, p, low)[2] == 0


def test_choose_excludes_measured_plans(gpt):
    """The re-plan's runner-up: with the best plan excluded, the next best by the same ranking."""
    prof = gpu_like(gpt[3])
    m = Model(prof, Bandwidth.constant(0.05))
    budget = int(0.6 * prof["peak_allocated"])
    a, p = search.choose(m, budget)
    b, q = search.choose(m, budget, exclude=[a])
    assert b != a and search.rank(p, budget) <= search.rank(q, budget)
    c, _ = search.choose(m, budget, exclude=[a, b])
    assert c not in (a, b)


class ScriptedChecks:
    """The re-plan loop of `offload.planner.planning` with the choices and the measurements
    scripted: ``choices`` are what the model picks, in order (the first: the plan applied); ``measured`` maps an
    assignment to its (step ms, peak bytes). Records what was applied and the budgets planned for."""

    def __init__(self, gpt, monkeypatch, choices, measured, budget_of):
        from offload.planner import planning

        self.prof = gpu_like(gpt[3])
        self.model = Model(self.prof, Bandwidth.constant(0.05))
        self.measured = measured
        self.budget = budget_of(self.prof)
        self.applied, self.planned_for = [], []
        first = choices[0]
        pred = first.predict(self.model)
        self.result = planning.Plan(Budget.parse(self.budget), self.budget, first, pred,
                                    check.predicted_step_ms(self.prof, pred), pred.peak_bytes,
                                    search.explain(self.model, first, pred), self.prof, self.model.bw, False)
        self.current = first
        self.result.measured = self.measure()
        rest = iter(choices[1:])

        def choose(model, budget, exclude=(), selective=True):
            self.planned_for.append(budget)
            a = next(rest, choices[-1])  # past the script: the last choice again (measured: the loop stops)
            return a, a.predict(model)

        monkeypatch.setattr(planning, "choose", choose)
        planning._check_and_replan(self.result, self.apply, self.measure)

    def apply(self, assignment):
        self.applied.append(assignment)
        self.current = assignment

    def measure(self):
        step, peak = self.measured[self.current]
        return check.Measured(step_ms=step, peak_bytes=peak, wait_ms=0.0)


A1 = search.Assignment(checkpoint=("mlp",), offload=("core_attn",))
A2 = search.Assignment(offload=("core_attn", "qkv_linear"))
A3 = search.Assignment(checkpoint=("layers",))


def test_a_plan_that_measures_as_predicted_is_kept_without_planning_again(gpt, monkeypatch):
    prof = gpu_like(gpt[3])
    p = A1.predict(Model(prof, Bandwidth.constant(0.05)))
    run = ScriptedChecks(gpt, monkeypatch, [A1], {A1: (check.predicted_step_ms(prof, p), p.peak_bytes)},
                         lambda prof: 2 * prof["peak_allocated"])
    assert run.applied == [] and run.planned_for == [] and run.result.history == []
    assert run.result.assignment == A1 and not any("Kept" in n for n in run.result.notes)


def test_a_replan_that_measures_over_the_budget_gives_the_first_plan_back(gpt, monkeypatch):
    """The H100 case at seq 32768: the first plan ran faster and lower than predicted, the re-plan
    went over the budget; the first plan is applied again, with its own measurement."""
    prof = gpu_like(gpt[3])
    p1 = A1.predict(Model(prof, Bandwidth.constant(0.05)))
    budget = p1.peak_bytes + 1000
    step1 = 0.8 * check.predicted_step_ms(prof, p1)
    run = ScriptedChecks(gpt, monkeypatch, [A1, A2, A1],
                         {A1: (step1, int(0.9 * p1.peak_bytes)), A2: (0.7 * step1, budget + 1)}, lambda _: budget)
    assert run.planned_for[0] == budget  # the peak under the prediction raised nothing
    assert len(run.planned_for) == 2  # after A2, the corrected model chose A1 again: no more measuring
    assert run.applied == [A2, A1]
    r = run.result
    assert r.assignment == A1 and r.measured.step_ms == step1 and r.predicted_peak_bytes == p1.peak_bytes
    assert [h["assignment"] for h in r.as_dict()["history"]] == [describe(A2)]
    assert any("over the budget" in d for d in r.history[0]["deviations"])
    assert "the fastest measured within the budget" in r.notes[-1]
    assert "Also measured " + describe(A2) in r.table()


def test_a_peak_over_the_budget_plans_again_below_it_by_the_excess(gpt, monkeypatch):
    prof = gpu_like(gpt[3])
    p1 = A1.predict(Model(prof, Bandwidth.constant(0.05)))
    budget = p1.peak_bytes + 1000
    over = 5000
    step1 = check.predicted_step_ms(prof, p1)
    run = ScriptedChecks(gpt, monkeypatch, [A1, A3],
                         {A1: (step1, p1.peak_bytes + over), A3: (1.02 * step1, budget - 1)}, lambda _: budget)
    assert run.planned_for[0] == budget - over
    assert run.applied == [A3] and run.result.assignment == A3 and run.result.history[0]["assignment"] == A1
    p3 = A3.predict(Model(prof, Bandwidth.constant(0.05)))
    assert run.result.predicted_peak_bytes == p3.peak_bytes + over  # the correction is in the prediction


def test_when_no_plan_fits_the_lowest_measured_peak_is_kept_after_three(gpt, monkeypatch):
    prof = gpu_like(gpt[3])
    p1 = A1.predict(Model(prof, Bandwidth.constant(0.05)))
    budget = p1.peak_bytes
    step = check.predicted_step_ms(prof, p1)
    measured = {A1: (step, budget + 300), A2: (step, budget + 100), A3: (step, budget + 200)}
    run = ScriptedChecks(gpt, monkeypatch, [A1, A2, A3, A1], measured, lambda _: budget)
    assert len(run.planned_for) == 2  # three plans measured in all
    assert run.applied == [A2, A3, A2] and run.result.assignment == A2
    assert "no plan measured within the budget" in run.result.notes[-1]


def test_a_replan_that_chooses_a_measured_plan_stops(gpt, monkeypatch):
    prof = gpu_like(gpt[3])
    p1 = A1.predict(Model(prof, Bandwidth.constant(0.05)))
    step1 = 1.5 * check.predicted_step_ms(prof, p1)
    run = ScriptedChecks(gpt, monkeypatch, [A1, A1], {A1: (step1, p1.peak_bytes)}, lambda _: p1.peak_bytes)
    assert run.applied == [] and run.result.assignment == A1 and run.result.history == []
    assert run.result.measured.step_ms == step1


# ------------------------------------------------------------------ applied plans
def test_applied_plan_gradients_are_bitwise(deterministic):
    """A plan that checkpoints and offloads (the memory-free layer among its choices), applied
    to the tiny stack by offload.plan: gradients bitwise equal to the plain model's, over
    several steps; remove() gives the plain model back."""
    torch.manual_seed(0)
    model = build_gpt(32, 4, 4)
    ref = copy.deepcopy(model)
    x, g = torch.randn(SHAPE), torch.randn(SHAPE)
    _, ref_grads = train_step(ref, x, g)
    step = gpt_step(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        plan = offload.plan(model, GPT_MAPPING, step, "-70%", bandwidth=0.01, check_steps=1, verbose=False,
                            profile=None)
        assert plan.assignment.checkpoint and set(plan.assignment.checkpoint) & set(plan.assignment.offload)
        assert offload.planner.active_plan() is plan
        for _ in range(2):
            _, grads = train_step(model, x, g)
            offload.end_iteration()
            assert first_difference(ref_grads, grads) is None
    assert "checkpoint" in plan.table() and "why" in plan.table()
    plan.remove()
    assert offload.planner.active_plan() is None and "forward" not in model.layers[0].__dict__
    assert list(model.state_dict()) == list(ref.state_dict())


def test_selective_plan_offloads_what_the_model_says_and_is_bitwise(gpt, deterministic):
    """The MLP checkpointed keeping fc1, its inputs and core_attn offloaded: the engine moves
    the model's bytes, name by name, and gradients are bitwise those of the plain model."""
    torch.manual_seed(0)
    model = build_gpt(32, 4, 4)
    ref = copy.deepcopy(model)
    x, g = torch.randn(SHAPE), torch.randn(SHAPE)
    _, ref_grads = train_step(ref, x, g)
    prof = gpt[3]
    a = search.Assignment(checkpoint=("mlp",), offload=("core_attn", "mlp"), selective=("fc1",))
    applied = Applied(model, GPT_MAPPING, find_containers(model, GPT_MAPPING), a.checkpoint, a.offload, 1,
                      {"min_tensor_bytes": 0, "device": "cpu"}, a.selective)
    try:
        for _ in range(3):
            _, grads = train_step(model, x, g)
            stats = offload.end_iteration()
            assert first_difference(ref_grads, grads) is None
    finally:
        applied.remove()
    got = {n: s.bytes_offloaded for n, s in stats.by_name.items() if s.bytes_offloaded}
    assert got == a.predict(Model(prof, Bandwidth.constant(10.0))).offloaded_by_name and set(got) == {"core_attn", "mlp"}
    assert "forward" not in model.layers[0].mlp.__dict__ and not model.layers[0].mlp.linear_fc1._forward_hooks


def test_configure_auto_plans_and_applies(capsys):
    model = build_gpt(32, 4, 3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        manager = offload.configure("auto", memory_budget="-40%", model=model, mapping=GPT_MAPPING,
                                    step=gpt_step(model), device="cpu")
    plan = offload.planner.active_plan()
    assert manager is offload.get_manager() and set(manager.config.modules) == set(plan.assignment.offload)
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert "Plan for a memory budget" in capsys.readouterr().out
    plan.remove()


# ------------------------------------------------------------------ the main job and the frontier
def test_demo_refuses_a_bad_budget_before_training(capsys):
    from offload import demo

    with pytest.raises(SystemExit) as info:
        demo.main(["--device", "cpu", "--memory-budget", "20GB"])
    assert info.value.code == 2 and "did you mean '20GiB'" in capsys.readouterr().err
    assert demo.parse_args(["--memory-budget", "-30%"]).memory_budget == "-30%"  # a value, not an option


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_frontier_needs_cuda_or_the_cpu_check(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for argv in ([], ["--device", "cpu"]):  # the CPU check needs --out: its figures are not results
        monkeypatch.setattr(sys, "argv", ["benchmarks/frontier.py", *argv])
        with pytest.raises(SystemExit) as info:
            runpy.run_path(str(ROOT / "benchmarks" / "frontier.py"), run_name="__main__")
        assert info.value.code == 2
    err = capsys.readouterr().err
    assert "CUDA is not available" in err and "--device cpu needs --out" in err
    assert list(tmp_path.iterdir()) == []


def test_frontier_cpu_check_writes_records_with_exactly_the_fields(tmp_path):
    from benchmarks import frontier

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert frontier.main(["--device", "cpu", "--out", str(tmp_path), "--in-process", "--workloads", "seq8192",
                              "--budgets", "2", "--steps", "1", "--warmup", "0"]) == 0
    records = json.loads((tmp_path / "frontier.json").read_text())
    assert all(tuple(r) == frontier.FIELDS for r in records)
    assert [r["strategy"] for r in records] == frontier.FIXED + ["plan", "plan"]
    plans = [r for r in records if r["strategy"] == "plan"]
    assert all(r["predicted_step_ms"] > 0 and r["budget_bytes"] > 0 for r in plans)
    assert "no memory measured (CPU)" in (tmp_path / "frontier.md").read_text()


def test_frontier_targets_say_met_or_not():
    from benchmarks import frontier

    def rec(strategy, step, peak, budget=None, pred=None):
        return {"workload": "seq32768", "strategy": strategy, "budget_bytes": budget, "step_ms": step,
                "peak_bytes": peak, "predicted_step_ms": pred and pred[0], "predicted_peak_bytes": pred and pred[1],
                "device": "gpu", "command": "c"}

    records = [rec("none", 100.0, 20 * GIB), rec("full_recompute", 125.0, 6 * GIB),
               rec("selective:attention", 115.0, 8 * GIB),
               rec("plan", 108.0, 6 * GIB, 6 * GIB, (110.0, 6.2 * GIB)),   # 13.6% faster, predictions ok
               rec("plan", 117.0, 8 * GIB, 8 * GIB, (117.0, 7 * GIB))]     # slower than selective, peak -12.5%
    lines = frontier.targets(records)
    assert "13.6% faster than full recompute (target, seq32768: >= 12%: met)" in lines[0]
    assert "prediction error step +1.9%, peak +3.3% (ok)" in lines[1]
    assert "selective:attention 115.0 ms (+1.7%: NOT ok)" in lines[2] and "peak -12.5% (NOT ok)" in lines[2]


def test_checkpointed_model_is_freed_without_the_garbage_collector():
    """A checkpointed forward refers to its module weakly: dropping the model frees it (and its
    GPU memory) at once, with no reference cycle left for the garbage collector."""
    import gc
    import weakref

    model = build_gpt(32, 4, 2)
    checkpoint_modules(model, ["layers.0", "layers.1"])
    model(torch.randn(8, 2, 32, requires_grad=True)).sum().backward()
    ref = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert ref() is None
    finally:
        gc.enable()


def test_checkpointed_forward_saves_keyword_and_nested_tensor_inputs():
    """A checkpointed module called with keyword (or nested) tensors saves them as the
    checkpoint's saved tensors, which the engine can offload, as the planner's model of a
    region's inputs says (megatron-core calls its layers with keywords only); torch's checkpoint
    given keywords holds them by reference instead (the control). Gradients stay bitwise."""
    from torch.utils.checkpoint import checkpoint

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(8, 8)

        def forward(self, hidden, *, extra=None, pair=()):
            return self.lin(hidden * extra + pair[0]).relu()

    def run(call):
        torch.manual_seed(0)
        block = Block()
        x, e, p = (torch.randn(4, 8, requires_grad=True) for _ in range(3))
        packed = []

        def pack(t):
            packed.append(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = call(block, x, e, p)
        out.sum().backward()
        saved = {id(t) for t in packed}
        return [id(t) in saved for t in (x, e, p)], [x.grad, e.grad, p.grad, block.lin.weight.grad]

    plain = run(lambda b, x, e, p: b(x, extra=e, pair=(p,)))

    def checkpointed(b, x, e, p):
        checkpoint_modules(torch.nn.Sequential(b), ["0"])  # the block's own forward, patched
        return b(x, extra=e, pair=(p,))

    seen, grads = run(checkpointed)
    assert seen == [True, True, True]
    assert all(torch.equal(a, b) for a, b in zip(plain[1], grads))
    control, _ = run(lambda b, x, e, p: checkpoint(b, x, use_reentrant=False, extra=e, pair=(p,)))
    assert control == [True, False, False]


@pytest.mark.parametrize("early", [True, False], ids=["start-of-backward", "control-end-of-backward"])
def test_checkpointed_region_prefetches_the_one_before_it_from_the_start_of_its_backward(
        configure, monkeypatch, early):
    """A checkpointed block whose inputs are offloaded (the "memory-free" layer) reloads the
    block before it when its own backward starts (Note [2] of offload.regions), not when it ends,
    where that block's recompute would wait for the copy; gradients stay bitwise. The control
    signals from the inputs as an ordinary group does."""
    from offload import regions
    from offload.manager import PipelineOffloadManager

    if not early:
        monkeypatch.setattr(regions, "_forward_is_checkpointed", lambda module: False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                                      torch.nn.Linear(32, 16)) for _ in range(4)])
    ref = copy.deepcopy(model)
    checkpoint_modules(model, ["0", "1", "2", "3"])
    configure(["block"])
    offload.attach(model, {"block": ["0", "1", "2", "3"]})
    events: list[tuple[str, int]] = []
    reload = PipelineOffloadManager.reload

    def spy(self, group, *args, **kwargs):
        events.append(("reload", group.layer))
        return reload(self, group, *args, **kwargs)

    monkeypatch.setattr(PipelineOffloadManager, "reload", spy)
    for i, block in enumerate(model):
        block[0].register_forward_pre_hook(
            lambda *_, i=i: events.append(("recompute", i)) if torch._C._current_graph_task_id() != -1 else None)
    x = torch.randn(8, 16, requires_grad=True)
    model(x).square().sum().backward()
    ref(x).square().sum().backward()
    assert first_difference({n: p.grad for n, p in ref.named_parameters()},
                            {n: p.grad for n, p in model.named_parameters()}) is None
    assert offload.end_iteration().by_name["block"].reloads_prefetched == 2
    for i in (1, 2):  # block 0's input is the leaf x (never offloaded); block 3 is kept
        assert (events.index(("reload", i)) < events.index(("recompute", i + 1))) is early, events
