"""``--offload-modules=auto``: the planner in the megatron-core integration (CPU, gloo, world size 1).

What is checked: the flags and the Megatron settings the plan cannot handle are refused when
parsed or applied, each with the flag named; the plan is made on the first training call of the
wrapped ``forward_backward_func`` from the integration's names and the layers' containers,
applied (checkpointed regions, offloaded names and region inputs), and training stays bitwise
that of the model without a plan (plain chunks, Megatron's DDP with overlapped grad reduction,
dropout inside Megatron's RNG tracker); the example runs with the flags and matches its reference.
"""

from __future__ import annotations

import argparse
import contextlib
import warnings
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")

from offload.errors import OffloadError, OffloadValueError, UnknownModuleError  # noqa: E402
from test_megatron import MBS, SEQ, assert_bitwise, batches, build, fb_no_pipelining, forward_step, train  # noqa: E402

pytestmark = pytest.mark.usefixtures("megatron_cpu")

ROOT = Path(__file__).resolve().parents[2]
CONTAINERS = {"layers", "self_attention", "mlp"}
SLOW = dict(memory_budget="-70%", min_tensor_bytes=0, device="cpu", bandwidth=1e-5)
"""A link so slow that recompute wins, and a budget no plan reaches: the lowest peak, which
checkpoints regions and offloads what they keep (the "memory-free" layer) where that frees more."""


@pytest.fixture
def mg():
    from offload.integrations import megatron

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the engine's CPU fallback
        yield megatron


def parse(mg, argv: list[str]) -> argparse.Namespace:
    return mg.add_arguments(argparse.ArgumentParser()).parse_args(argv)


# ------------------------------------------------------------------------------ the flags
@pytest.mark.parametrize("argv, error, match", [
    (["--offload-modules=auto"], OffloadValueError, r"--offload-modules=auto needs a memory budget"),
    (["--offload-modules=auto,core_attn", "--offload-memory-budget=-30%"], OffloadValueError,
     r"it takes no others \(got auto,core_attn\)"),
    (["--offload-modules", "core_attn", "auto", "--offload-memory-budget=-30%"], OffloadValueError, "takes no others"),
    (["--offload-modules=core_attn", "--offload-memory-budget=-30%"], OffloadValueError,
     r"a memory budget \(--offload-memory-budget, --offload-memory-budget-gib\) is for --offload-modules=auto"),
    (["--offload-memory-budget-gib=4"], OffloadValueError, r"with --offload-modules=\(none\) nothing is planned"),
    (["--offload-modules=auto", "--offload-memory-budget=20GB"], OffloadValueError,
     r"--offload-memory-budget: memory_budget '20GB' .*did you mean '20GiB'"),
    (["--offload-modules=auto", "--offload-memory-budget=30%"], OffloadValueError,
     r"--offload-memory-budget: .*below the current peak"),
    (["--offload-modules=auto", "--offload-memory-budget=-30%", "--offload-memory-budget-gib=20"], OffloadValueError,
     r"both give the budget; give one"),
    (["--offload-modules=auto", "--offload-memory-budget-gib=0"], OffloadValueError,
     r"--offload-memory-budget-gib=0 must be"),
    (["--offload-modules=auto", "--offload-memory-budget-gib=nan"], OffloadValueError,
     r"--offload-memory-budget-gib=nan"),
    (["--offload-modules=auto", "--offload-memory-budget=-30%", "--offload-policy=min_live:2"], OffloadValueError,
     r"the plan chooses --offload-max-inflight-groups"),
    (["--offload-modules=auto", "--offload-memory-budget=-30%", "--offload-max-inflight-groups=2"], OffloadValueError,
     r"leave --offload-max-inflight-groups and --offload-policy unset"),
    (["--offload-modules=auto,core_atn", "--offload-memory-budget=-30%"], OffloadValueError, "takes no others"),
    (["--offload-modules=auto", "--offload-memory-budget=-30%", "--offload-copies-into-backward"], OffloadValueError,
     r"leave --offload-copies-into-backward unset"),
])
def test_auto_flags_are_checked_when_read(mg, argv, error, match):
    with pytest.raises(error, match=match):
        mg.Options.from_args(parse(mg, argv))


def test_auto_flags_accepted_forms(mg):
    from offload import Budget

    for argv, budget in ((["--offload-modules=auto", "--offload-memory-budget=-30%"], "-30%"),
                         (["--offload-modules", "auto", "--offload-memory-budget", "fit:5%"], "fit:5%"),
                         (["--offload-modules=auto", "--offload-memory-budget-gib=2.5"], "2.5GiB")):
        opts = mg.Options.from_args(parse(mg, argv))
        assert opts.auto and opts.modules == ("auto",) and opts.memory_budget == Budget.parse(budget)
    names = mg.Options.from_args(parse(mg, ["--offload-modules=core_attn"]))
    assert not names.auto and names.memory_budget is None


@pytest.mark.parametrize("setting, match", [
    (dict(pipeline_model_parallel_size=2), r"cannot plan a pipeline yet \(--pipeline-model-parallel-size 2"),
    (dict(virtual_pipeline_model_parallel_size=2),
     r"cannot plan a pipeline yet \(--virtual-pipeline-model-parallel-size 2"),
    (dict(cuda_graph_impl="local"),
     r"--offload-modules=auto: Megatron's CUDA graphs are on \(--cuda-graph-impl local\)"),
    (dict(cuda_graph_impl="transformer_engine", cuda_graph_scope=["attn"]), r"CUDA graphs are on .*attn"),
    (dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
     r"chooses what to recompute itself .*--recompute-granularity selective"),
    (dict(recompute_granularity="full"), r"--recompute-granularity full"),
    (dict(fp8="hybrid"), r"--offload-modules=auto with FP8"),
    (dict(fine_grained_activation_offloading=True), r"--fine-grained-activation-offloading; --system megatron"),
    (dict(cpu_offloading=True), r"--offload-modules=auto: Megatron's layer-level CPU offloading"),
    (dict(overlap_moe_expert_parallel_comm=True), r"--overlap-moe-expert-parallel-comm runs two microbatches"),
    (dict(moe_router_enable_expert_bias=True), r"--moe-router-enable-expert-bias: the router counts tokens"),
])
def test_auto_refuses_what_it_cannot_plan(mg, setting, match):
    model = build()
    for key, value in setting.items():
        setattr(model.config, key, value)
    with pytest.raises(OffloadError, match=match):
        mg.apply(model, "auto", memory_budget="-30%", device="cpu")
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def test_auto_is_accepted_where_it_can_plan_and_attaches_nothing_before_the_first_call(mg):
    model = build()
    handle = mg.apply(model, "auto", memory_budget="-30%", device="cpu")
    assert handle.enabled and handle.plan is None and handle.names == ()
    assert set(handle.auto.mapping) == {"attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "fc1", "fc2"}
    assert handle.auto.mapping["core_attn"] == "decoder.layers.*.self_attention.core_attention"
    assert set(handle.auto.left_out) == {"mlp_act"}
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())
    fb = fb_no_pipelining()
    assert handle.wrap(fb) is not fb and getattr(handle.wrap(fb), "__offload_wrapped__", False)


def test_auto_refuses_two_chunks_megatrons_own_names_and_megatron_lm_pretrain(mg):
    with pytest.raises(OffloadError, match=r"cannot plan a pipeline yet \(--virtual-pipeline-model-parallel-size 2"):
        mg.apply([build(layers=1), build(layers=1)], "auto", memory_budget="-30%", device="cpu")
    with pytest.raises(OffloadError, match=r"--offload-modules=auto is this library's planner; Megatron's own"):
        mg.to_megatron_names("auto")
    args = argparse.Namespace(offload_modules=["auto"], offload_memory_budget="-30%", offload_min_tensor_bytes=0,
                              offload_max_inflight_groups=1, offload_policy="all")
    provider = mg.wrap_model_provider(lambda pre_process=True, post_process=True, vp_stage=None: build(layers=1), args)
    with pytest.raises(OffloadError, match="not wired into Megatron-LM's pretrain yet"):
        provider(pre_process=True, post_process=True)


def test_first_call_must_start_from_zeroed_gradients(mg):
    model = build(layers=2)
    handle = mg.apply(model, "auto", memory_budget="-30%", device="cpu", verbose=False)
    fb = handle.wrap(fb_no_pipelining())
    next(model.parameters()).grad = torch.ones_like(next(model.parameters()))
    with pytest.raises(OffloadError, match="starts with gradients that are not zero .*Zero them before the call"):
        fb(forward_step_func=forward_step, data_iterator=batches(2), model=[model], num_microbatches=2,
           seq_length=SEQ, micro_batch_size=MBS)
    assert handle.plan is None


# --------------------------------------------------------------------------- the plan
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_plan_on_the_first_call_is_applied_and_training_stays_bitwise(mg, moe, capsys):
    """The lowest-peak plan (regions checkpointed, inputs offloaded): the losses and gradients of 3 steps are
    bitwise those without a plan (whose data the planning steps must not consume), a buffer
    that counts the model's forwards (as a MoE router counts tokens) counts only the training
    steps', and the table is printed once."""

    def counting(model):
        model.register_buffer("forwards", torch.zeros((), dtype=torch.long))
        model.register_forward_pre_hook(lambda m, args: m.forwards.add_(1) and None)
        return model

    ref_model = counting(build(moe=moe, layers=3))
    ref = train(ref_model, fb_no_pipelining(), steps=3)
    model = counting(build(moe=moe, layers=3))
    handle = mg.apply(model, "auto", **SLOW)
    got = train(model, handle.wrap(fb_no_pipelining()), steps=3)
    assert_bitwise(ref, got)
    assert ref_model.forwards.item() == model.forwards.item() == 3 * 2
    plan = handle.plan
    a = plan.assignment
    # the lowest peak a CPU profile predicts (no backward buffers known: the inputs held at the
    # forward's end count there): the dense stack checkpoints its attention and MLP and offloads
    # their inputs and the norms between them; the MoE stack checkpoints its layers
    if moe:
        assert a.checkpoint == ("layers",) and a.offload == () and handle.names == ()
    else:
        assert set(a.checkpoint) == {"mlp", "self_attention"}
        assert set(a.offload) == {"mlp", "self_attention", "attn_norm", "mlp_norm"}
        assert handle.regions == {r: [f"decoder.layers.{i}.{r}" for i in range(3)] for r in ("mlp", "self_attention")}
        assert set(handle.names) == {"attn_norm", "mlp_norm"}
        assert "forward" in model.decoder.layers[0].mlp.__dict__  # checkpointed
    for unit in a.offload:
        stats = handle.last_stats.by_name[unit]
        assert stats.bytes_offloaded > 0 and stats.bytes_reloaded == stats.bytes_offloaded, unit
    checkpointed = [model.get_submodule(qn) for r in a.checkpoint
                    for qn in ([f"decoder.layers.{i}" for i in range(3)] if r == "layers"
                               else [f"decoder.layers.{i}.{r}" for i in range(3)])]
    assert all("forward" in m.__dict__ for m in checkpointed)
    assert plan.measured is not None  # the check's steps ran with the plan
    out = capsys.readouterr().out
    assert out.count("Plan for a memory budget") == 1 and "Megatron: planned on one microbatch" in out
    assert ("Not planned: expert_fc1" if moe else "Not planned: mlp_act") in out
    plan.remove()  # the model as it was (but for the counting hook)
    assert all("forward" not in m.__dict__ for m in checkpointed)
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.decoder.modules())


def test_plan_that_offloads_names_attaches_them_as_the_flag_would(mg):
    """A fast link: the plan offloads names of the integration's table, which are attached as
    ``--offload-modules`` attaches them and move bytes; bitwise over 2 steps."""
    ref = train(build(layers=3), fb_no_pipelining())
    model = build(layers=3)
    handle = mg.apply(model, "auto", memory_budget="-30%", min_tensor_bytes=0, device="cpu", bandwidth=1e4,
                      verbose=False)
    assert_bitwise(ref, train(model, handle.wrap(fb_no_pipelining())))
    a = handle.plan.assignment
    assert handle.names and set(handle.names) <= set(mg.NAMES) and set(a.offload) <= set(mg.NAMES) | CONTAINERS
    assert set(a.checkpoint) <= set(mg.NAMES) | CONTAINERS
    assert set(handle.mapping[0]) == set(a.offload)
    assert all(p.startswith("decoder.layers.") for patterns in handle.mapping[0].values() for p in patterns)
    assert handle.last_stats.total().bytes_offloaded > 0
    assert handle.plan.predicted_peak_bytes <= handle.plan.budget_bytes


def test_plan_with_megatrons_ddp_leaves_no_gradients_behind(mg):
    """Megatron's DDP accumulates into ``main_grad`` and, with overlapped reduction, tracks its
    buckets per step: the planning steps zero them through ``zero_grad_buffer()``, so the
    first real step's ``main_grad`` (and all later ones) are bitwise those without a plan."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    def ddp_model():
        model = build(layers=2)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(overlap_grad_reduce=True), model)
        model.config.no_sync_func = ddp.no_sync
        model.config.finalize_model_grads_func = finalize_model_grads
        return ddp

    def run(model, fb):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        data, losses, grads = batches(4), [], []
        for _ in range(2):
            model.zero_grad_buffer()
            out = fb(forward_step_func=forward_step, data_iterator=data, model=[model], num_microbatches=2,
                     seq_length=SEQ, micro_batch_size=MBS)
            losses += [d["loss"].item() for d in out]
            grads.append({n: p.main_grad.clone() for n, p in model.named_parameters()})
            for p in model.parameters():
                p.grad = p.main_grad
            opt.step()
        return losses, grads

    ref = run(ddp_model(), fb_no_pipelining())
    model = ddp_model()
    handle = mg.apply(model, "auto", **{**SLOW, "memory_budget": "-50%"}, verbose=False)
    got = run(model, handle.wrap(fb_no_pipelining()))
    assert handle.plan.assignment.checkpoint
    assert ref[0] == got[0]
    for a, b in zip(ref[1], got[1]):
        assert all(torch.equal(a[n], b[n]) for n in a)


@contextlib.contextmanager
def _fork_on_cpu(self, name="model-parallel-rng"):
    """Megatron's ``CudaRNGStatesTracker.fork`` on the CPU generator (the CPU patches make it a
    no-op): the region draws from the tracker's own stream, which it advances."""
    outer = torch.get_rng_state()
    torch.set_rng_state(self.states_[name])
    try:
        yield
    finally:
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(outer)


def test_recompute_sees_megatrons_rng_tracker_as_the_forward_did(mg, monkeypatch):
    """Attention dropout draws inside ``get_cuda_rng_tracker().fork()``, whose stream the forward
    advances; the plan's recompute restores the tracker (as Megatron's own checkpoint does), so
    the masks and the gradients are bitwise those without a plan. Without that restore they are
    not (the control), and the planning steps leave the tracker where they found it."""
    from megatron.core.tensor_parallel import random as mrandom

    monkeypatch.setattr(mrandom.CudaRNGStatesTracker, "fork", _fork_on_cpu)
    tracker = mrandom.get_cuda_rng_tracker()

    def run(plan: bool, context_fn=None):
        tracker.reset()
        tracker.set_states({"model-parallel-rng": torch.Generator().manual_seed(7).get_state()})
        torch.manual_seed(3)
        model = build(layers=2, attention_dropout=0.3, hidden_dropout=0.2)
        fb = fb_no_pipelining()
        if plan:
            if context_fn is not None:
                from offload.integrations import megatron_plan

                monkeypatch.setattr(megatron_plan, "tracker_context", context_fn)
            handle = mg.apply(model, "auto", **SLOW, verbose=False)
            fb = handle.wrap(fb)
        out = train(model, fb)
        if plan:
            assert {"layers", "self_attention", "core_attn"} & set(handle.plan.assignment.checkpoint)
        return out

    try:
        ref = run(False)
        assert_bitwise(ref, run(True))
        with pytest.raises(AssertionError, match="differ"):
            assert_bitwise(ref, run(True, context_fn=lambda: (contextlib.nullcontext(), contextlib.nullcontext())))
    finally:
        tracker.reset()


def test_forward_only_calls_do_not_plan_and_other_schedules_are_refused(mg):
    model = build(layers=2)
    handle = mg.apply(model, "auto", memory_budget="-30%", min_tensor_bytes=0, device="cpu", verbose=False)
    fb = handle.wrap(fb_no_pipelining())
    fb(forward_step_func=forward_step, data_iterator=batches(1), model=[model], num_microbatches=1,
       seq_length=SEQ, micro_batch_size=MBS, forward_only=True)
    assert handle.plan is None
    train(model, fb, steps=1)
    assert handle.plan is not None

    other = mg.apply(build(layers=2), "auto", memory_budget="-30%", device="cpu", verbose=False)
    with pytest.raises(OffloadError, match="plans through megatron-core's forward_backward_no_pipelining"):
        other.wrap(lambda **kw: None)(model=[model], num_microbatches=1, data_iterator=None)


def test_ranks_apply_rank_zeros_plan(mg, monkeypatch):
    """With several ranks every rank applies rank 0's assignment (tensor-parallel ranks must
    recompute the same regions), re-predicted on its own profile."""
    from offload.planner.search import Assignment

    model = build(layers=2)
    handle = mg.apply(model, "auto", memory_budget="-30%", min_tensor_bytes=0, device="cpu", bandwidth=1e4,
                      verbose=False)
    train(model, handle.wrap(fb_no_pipelining()), steps=1)
    plan = handle.plan
    rank0 = Assignment(checkpoint=("layers",), offload=("layers",))
    assert plan.assignment != rank0

    def broadcast(box, src):
        assert src == 0
        box[0] = rank0

    monkeypatch.setattr(torch.distributed, "get_world_size", lambda *a, **k: 2)
    monkeypatch.setattr(torch.distributed, "broadcast_object_list", broadcast)
    before = plan.predicted_peak_bytes
    from offload.integrations.megatron_plan import agree

    agree(plan)
    assert plan.assignment == rank0 and plan.predicted_peak_bytes != before
    assert any(r["unit"] == "layers" and r["choice"] == "checkpoint+offload" for r in plan.rows)
    assert "Rank 0's plan, applied on every rank" in plan.table()


def test_no_name_to_plan_is_an_error(mg):
    empty = torch.nn.Linear(2, 2)
    empty.config = build(layers=1).config
    with pytest.raises(UnknownModuleError, match="finds no module name to plan .*no transformer layer"):
        mg.apply(empty, "auto", memory_budget="-30%", device="cpu")


# ---------------------------------------------------------------------------- the example
@pytest.fixture
def example():
    import importlib.util

    spec = importlib.util.spec_from_file_location("megatron_gpt_auto", ROOT / "examples/megatron_gpt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv, match", [
    (["--offload-modules=auto"], "needs a memory budget"),
    (["--offload-modules=auto", "--offload-memory-budget=-30%", "--pp", "2"], "cannot plan a pipeline yet"),
    (["--offload-modules=auto", "--offload-memory-budget=-30%", "--system", "megatron"],
     "--offload-modules=auto is this library's planner; Megatron's own offloading"),
    (["--offload-modules=auto", "--offload-memory-budget=-30%", "--recompute-modules", "core_attn"],
     "chooses what to recompute itself"),
    (["--offload-modules=core_attn", "--offload-memory-budget-gib=3"], "--offload-memory-budget-gib) is for"),
])
def test_example_refuses_bad_auto_flags_before_it_starts(example, capsys, argv, match):
    with pytest.raises(SystemExit) as info:
        example.parse_args(["--device", "cpu", *argv])
    assert info.value.code == 2 and match in capsys.readouterr().err
    assert example.parse_args(["--device", "cpu", "--offload-modules=auto", "--offload-memory-budget=-30%"])


def test_example_with_auto_is_bitwise_equal_to_its_reference(tmp_path):
    """``examples/megatron_gpt.py --offload-modules=auto --offload-memory-budget=-30%`` on the
    CPU (tests/integrations/megatron_cpu.py's ``run_example``): the plan is printed and recorded, the losses and
    the trained parameters are bitwise those of the run without offloading."""
    tiny = ["--model", "gpt", "--layers", "2", "--hidden", "32", "--heads", "4", "--ffn", "64", "--seq", "16",
            "--vocab", "128", "--steps", "3", "--warmup-steps", "1", "--device", "cpu",
            "--offload-min-tensor-bytes", "0"]

    from megatron_cpu import run_example

    ref, _ = run_example(tmp_path, "ref", 1, tiny)
    got, stdout = run_example(tmp_path, "auto", 1, [*tiny, "--offload-modules=auto", "--offload-memory-budget=-30%"])
    assert got["ok"] and got["offload_modules"] == ["auto"] and got["offload_memory_budget"] == "-30%"
    assert ref["loss_hex"] == got["loss_hex"] and len(got["loss_hex"]) == 3
    assert ref["param_sha256"] == got["param_sha256"]
    plan = got["offload_plan"]
    assert plan["checkpoint"] or plan["offload"]
    assert stdout.count("Plan for a memory budget") == 1
