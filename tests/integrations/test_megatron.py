"""The megatron-core integration on a tiny GPT and a tiny MoE GPT (CPU, gloo, world size 1).

What is checked: each name attaches to the megatron-core modules it stands for; bad names and
conflicting Megatron options give clear errors; a training step through Megatron's own
``forward_backward_func`` gives bitwise the same losses and gradients with and without
``--offload-modules`` while the engine really moved bytes; the schedule order handed to the
engine is the one Megatron runs.
"""

from __future__ import annotations

import argparse
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")

import offload  # noqa: E402
from offload.errors import OffloadError, UnknownModuleError  # noqa: E402

pytestmark = pytest.mark.usefixtures("megatron_cpu")

VOCAB, SEQ, MBS = 128, 16, 2
DENSE_NAMES = {"attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "fc1", "mlp_act", "fc2"}
MOE_NAMES = {"attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "router",
             "expert_fc1", "moe_act", "expert_fc2"}


@pytest.fixture
def mg():
    """The integration module (imported after the CPU patches)."""
    from offload.integrations import megatron

    yield megatron
    megatron._remove_schedule_hook()


def build(moe: bool = False, layers: int = 2, seed: int = 0, **overrides):
    """A tiny GPTModel with megatron-core's local layer spec (no Transformer Engine).

    The MoE variant is the configuration pinned in ``examples/megatron_gpt.py``: SequentialMLP
    experts without linear biases (with biases, the expert MLP adds its bias in place to a view
    and autograd refuses it, in 0.16.1 and 0.19.2 alike)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw = dict(num_layers=layers, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
              hidden_dropout=0.0, attention_dropout=0.0)
    if moe:
        kw.update(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48,
                  moe_token_dispatcher_type="allgather", add_bias_linear=False)
    kw.update(overrides)
    config = TransformerConfig(**kw)
    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ)


def batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool).tril().logical_not()
    pos = torch.arange(SEQ).expand(MBS, SEQ)
    for _ in range(n):
        tokens = torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g)
        yield tokens[:, :-1], pos, mask, tokens[:, 1:]


def forward_step(data_iterator, model):
    tokens, pos, mask, labels = next(data_iterator)
    losses = model(tokens, pos, mask, labels=labels)

    def loss_func(output):
        loss = output.float().mean()
        return loss, {"loss": loss.detach()}

    return losses, loss_func


def train(model, fb_func, steps: int = 2, microbatches: int = 2):
    """``steps`` iterations of Megatron's ``fb_func`` with SGD; returns (losses, gradients of the
    last step)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(steps * microbatches)
    losses = []
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)
        out = fb_func(forward_step_func=forward_step, data_iterator=data, model=[model],
                      num_microbatches=microbatches, seq_length=SEQ, micro_batch_size=MBS)
        losses.extend(d["loss"].item() for d in out)
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
    return losses, grads


def fb_no_pipelining():
    from megatron.core.pipeline_parallel import get_forward_backward_func

    return get_forward_backward_func()


def assert_bitwise(a, b):
    (la, ga), (lb, gb) = a, b
    assert la == lb, f"losses differ: {la} vs {lb}"
    assert ga.keys() == gb.keys()
    for n in ga:
        assert torch.equal(ga[n], gb[n]), f"gradient of {n} differs"


# ----------------------------------------------------------------------------- mapping
def test_dense_mapping_finds_every_dense_name(mg):
    found = mg.find_modules(build(layers=2))
    assert found.names == DENSE_NAMES
    assert found.modules["core_attn"] == [f"decoder.layers.{i}.self_attention.core_attention" for i in range(2)]
    assert found.modules["attn_norm"] == [f"decoder.layers.{i}.input_layernorm" for i in range(2)]
    assert found.modules["qkv_linear"] == [f"decoder.layers.{i}.self_attention.linear_qkv" for i in range(2)]
    assert found.modules["fc2"] == [f"decoder.layers.{i}.mlp.linear_fc2" for i in range(2)]
    assert found.act_regions["mlp_act"][1] == (
        "decoder.layers.1.mlp", "decoder.layers.1.mlp.linear_fc1", "decoder.layers.1.mlp.linear_fc2")
    assert "no MoE layer" in found.absent["expert_fc1"]


def test_moe_mapping_finds_sequential_experts_and_router(mg):
    found = mg.find_modules(build(moe=True, layers=2))
    assert found.names == MOE_NAMES
    assert found.modules["expert_fc1"] == [f"decoder.layers.{i}.mlp.experts" for i in range(2)]
    assert len(found.modules["expert_fc2"]) == 2 * 4
    assert found.modules["expert_fc2"][5] == "decoder.layers.1.mlp.experts.local_experts.1.linear_fc2"
    assert found.modules["router"] == [f"decoder.layers.{i}.mlp.router" for i in range(2)]
    assert len(found.act_regions["moe_act"]) == 8
    assert "no dense MLP" in found.absent["fc1"]


def test_apply_attaches_short_patterns_through_wrappers(mg):
    from megatron.core.transformer.module import Float16Module

    model = build(moe=True, layers=3, bf16=True)
    wrapped = Float16Module(model.config, model)
    handle = mg.apply(wrapped, "core_attn,expert_fc2", device="cpu")
    assert handle.mapping == [{
        "core_attn": ["module.decoder.layers.*.self_attention.core_attention"],
        "expert_fc2": ["module.decoder.layers.*.mlp.experts.local_experts.*.linear_fc2"],
    }]
    # the engine hooks exactly the modules the patterns stand for
    assert handle._attached[0].matched["expert_fc2"] == sorted(
        f"module.{qn}" for qn in mg.find_modules(model).modules["expert_fc2"])
    handle.remove()


def test_patterns_fall_back_to_exact_names_where_a_wildcard_overreaches(mg):
    names = ["a.layers.0.fc", "a.layers.1.fc", "a.layers.2.fc"]
    assert mg.module_patterns(names[:2], names) == ["a.layers.0.fc", "a.layers.1.fc"]
    assert mg.module_patterns(names, names) == ["a.layers.*.fc"]
    assert mg.module_patterns(["x[1]"], ["x[1]", "x1"]) == ["x[[]1]"]


def test_moe_act_and_mlp_act_are_groups_between_fc1_and_fc2(mg):
    """The activation regions open when fc1 returns and close before fc2's own group opens."""
    for moe, names in ((False, "fc1,mlp_act,fc2"), (True, "expert_fc1,moe_act,expert_fc2")):
        model = build(moe=moe)
        handle = mg.apply(model, names, min_tensor_bytes=0, device="cpu")
        train(model, handle.wrap(fb_no_pipelining()), steps=1, microbatches=2)
        by_name = handle.last_stats.by_name
        for name in names.split(","):
            assert by_name[name].groups > 0, name
            assert by_name[name].bytes_offloaded > 0, name
        handle.remove()


# ------------------------------------------------------------------------------ errors
def test_unknown_name_suggests_the_closest(mg):
    with pytest.raises(UnknownModuleError, match=r"'core_atn' \(did you mean 'core_attn'\?\)"):
        mg.apply(build(), "core_atn", device="cpu")


def test_moe_name_in_a_dense_model_says_why(mg):
    with pytest.raises(UnknownModuleError, match=r"'expert_fc1': no MoE layer"):
        mg.apply(build(), "core_attn,expert_fc1", device="cpu")
    with pytest.raises(UnknownModuleError, match=r"'fc1': no dense MLP"):
        mg.apply(build(moe=True), "fc1", device="cpu")


def test_no_hooks_stay_behind_after_a_failed_apply(mg):
    model = build()
    with pytest.raises(UnknownModuleError):
        mg.apply(model, "core_attn,expert_fc1", device="cpu")
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("setting, match", [
    (dict(fine_grained_activation_offloading=True), "Megatron's own fine-grained"),
    (dict(cpu_offloading=True), "layer-level CPU offloading"),
    (dict(cuda_graph_impl="local"), "CUDA graphs are on"),
    (dict(recompute_granularity="selective", recompute_modules=["core_attn"]), r"core_attn \(recompute_modules has core_attn\)"),
    (dict(recompute_granularity="selective", recompute_modules=["layernorm"]), r"attn_norm \(recompute_modules has layernorm\)"),
])
def test_conflicting_megatron_options_are_refused(mg, setting, match):
    model = build()
    for key, value in setting.items():
        setattr(model.config, key, value)
    with pytest.raises(OffloadError, match=match):
        mg.apply(model, "core_attn,attn_norm", device="cpu")


def test_flag_accepts_commas_and_spaces_and_reuses_megatrons_own_flag(mg):
    parser = mg.add_arguments(argparse.ArgumentParser())
    a = parser.parse_args(["--offload-modules=core_attn,expert_fc1"])
    b = parser.parse_args(["--offload-modules", "core_attn", "expert_fc1", "--offload-policy", "min_live:2"])
    assert mg.Options.from_args(a).modules == mg.Options.from_args(b).modules == ("core_attn", "expert_fc1")
    assert mg.Options.from_args(b).policy == "min_live:2"

    lm = argparse.ArgumentParser()  # a parser that already has Megatron-LM's flags
    lm.add_argument("--fine-grained-activation-offloading", action="store_true")
    lm.add_argument("--offload-modules", nargs="*", type=str, default=[])
    mg.add_arguments(lm)
    args = lm.parse_args(["--offload-modules", "core_attn", "--offload-min-tensor-bytes", "4096"])
    assert mg.Options.from_args(args) == mg.Options(("core_attn",), 4096, 1, "all")
    both = lm.parse_args(["--offload-modules", "core_attn", "--fine-grained-activation-offloading"])
    with pytest.raises(OffloadError, match="Megatron's own offloading"):
        mg.Options.from_args(both)
    with pytest.raises(UnknownModuleError, match="did you mean 'expert_fc1'"):
        mg.Options.from_args(lm.parse_args(["--offload-modules", "exprt_fc1"]))


def test_policy_strings(mg):
    from offload.group_policy import GroupInfo

    info = lambda layer, live: GroupInfo("fc1", layer, 0, 0, "steady", live, None, 0)  # noqa: E731
    assert mg.parse_policy("all") is None
    assert mg.parse_policy("layers:0-1,3")(info(3, 1)) and not mg.parse_policy("layers:0-1,3")(info(2, 1))
    assert mg.parse_policy("min_live:2")(info(0, 2)) and not mg.parse_policy("min_live:2")(info(0, 1))
    for bad in ("sometimes", "min_live:0", "layers:3-1", "layers:x"):
        with pytest.raises(ValueError, match="offload-policy"):
            mg.parse_policy(bad)
    # per name: NAMES=POLICY clauses, one clause without names for the others
    named = lambda name, layer: GroupInfo(name, layer, 0, 0, "steady", 1, None, 0)  # noqa: E731
    p = mg.parse_policy(" expert_fc1=layers:0 ; layers:0-2 ", ["attn_norm", "expert_fc1"])
    assert [p(named("expert_fc1", i)) for i in range(4)] == [True, False, False, False]
    assert [p(named("attn_norm", i)) for i in range(4)] == [True, True, True, False]
    p = mg.parse_policy("expert_fc1,moe_act=layers:1")
    assert not p(named("moe_act", 0)) and p(named("moe_act", 1)) and p(named("attn_norm", 7))
    for bad, match in (("fc1=layers:0;fc1=layers:1", "'fc1' is in two clauses"),
                       ("layers:0;layers:1", "two clauses without names"),
                       ("=layers:0", "names no module"), ("fc1=sometimes", "unknown --offload-policy")):
        with pytest.raises(ValueError, match=match):
            mg.parse_policy(bad)
    with pytest.raises(UnknownModuleError, match="'exprt_fc1' \\(did you mean 'expert_fc1'\\?\\) in --offload-policy"):
        mg.parse_policy("exprt_fc1=layers:0", ["expert_fc1", "moe_act"])
    # a bad policy fails when the flags are read, before a model is built
    with pytest.raises(UnknownModuleError, match="in --offload-policy"):
        mg.Options.from_args(mg.add_arguments(argparse.ArgumentParser()).parse_args(
            ["--offload-modules=core_attn", "--offload-policy=fc1=layers:0"]))
    with pytest.raises(ValueError, match="unknown --offload-policy"):
        mg.Options.from_args(mg.add_arguments(argparse.ArgumentParser()).parse_args(
            ["--offload-modules=core_attn", "--offload-policy=sometimes"]))
    # without names (a baseline run with the same flags) the policy's forms are checked, not its names
    assert mg.Options.from_args(mg.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--offload-policy=fc1=layers:0"])).modules == ()


# ------------------------------------------------------------------- bitwise equality
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_losses_and_gradients_bitwise_equal_with_and_without_the_flag(mg, moe):
    names = "core_attn,expert_fc1,moe_act,router" if moe else "core_attn,qkv_linear,fc1,mlp_act"
    ref = train(build(moe=moe, layers=3), fb_no_pipelining(), steps=3)

    model = build(moe=moe, layers=3)
    handle = mg.apply(model, names, min_tensor_bytes=0, device="cpu")
    got = train(model, handle.wrap(fb_no_pipelining()), steps=3)
    assert_bitwise(ref, got)
    stats = handle.last_stats
    assert stats.iteration == 2  # one engine iteration per forward_backward_func call
    for name in names.split(","):
        assert stats.by_name[name].bytes_offloaded > 0, name
        assert stats.by_name[name].bytes_reloaded == stats.by_name[name].bytes_offloaded, name


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_every_name_at_once_is_bitwise_equal(mg, moe):
    names = sorted(MOE_NAMES if moe else DENSE_NAMES)
    ref = train(build(moe=moe, layers=3), fb_no_pipelining())
    model = build(moe=moe, layers=3)
    handle = mg.apply(model, names, min_tensor_bytes=0, device="cpu")
    assert_bitwise(ref, train(model, handle.wrap(fb_no_pipelining())))
    assert handle.last_stats.total().bytes_offloaded > 0
    assert all(handle.last_stats.by_name[n].groups > 0 for n in names)


def test_without_names_nothing_is_attached_or_wrapped(mg):
    model = build()
    handle = mg.apply(model, "", device="cpu")
    fb = fb_no_pipelining()
    assert handle.wrap(fb) is fb and not handle.enabled
    assert all(not m._forward_pre_hooks for m in model.modules())


@pytest.fixture
def no_fp8(monkeypatch):
    """``CheckpointWithoutOutput()`` takes its FP8 path even with FP8 off (``fp8 is not None``
    with ``fp8=False``), which needs Transformer Engine's FP8 state: stand-ins that say "no FP8"."""
    import contextlib

    from megatron.core.tensor_parallel import random as mrandom

    class NoFP8:
        is_fp8_enabled = staticmethod(lambda: False)

    monkeypatch.setattr(mrandom, "FP8GlobalStateManager", NoFP8, raising=False)
    for name in ("activation_recompute_forward", "fp8_autocast"):
        monkeypatch.setattr(mrandom, name, lambda **kw: contextlib.nullcontext(), raising=False)


def test_selective_layernorm_recompute_composes_with_offloading(mg, no_fp8):
    """Megatron recomputes the norms (CheckpointWithoutOutput) and discards their outputs; the
    linear layers after them save those outputs, which the checkpoint holds: the engine leaves
    them alone (held elsewhere), and the gradients stay bitwise equal."""
    cfg = dict(recompute_granularity="selective", recompute_modules=["layernorm"])
    ref = train(build(layers=3, **cfg), fb_no_pipelining())
    model = build(layers=3, **cfg)
    handle = mg.apply(model, "qkv_linear,core_attn,fc1", min_tensor_bytes=0, device="cpu")
    assert_bitwise(ref, train(model, handle.wrap(fb_no_pipelining())))
    by_name = handle.last_stats.by_name
    assert by_name["core_attn"].bytes_offloaded > 0
    assert by_name["qkv_linear"].bytes_held_elsewhere > 0


def test_the_embedding_output_leaves_with_the_first_layers_copies(mg):
    """`GPTModel.forward` hands the embedding's output, the first layer's input, to its decoder
    wrapped, as Megatron does in inference (`_hand_the_embedding_output_to_the_decoder`): the
    first layer's ``attn_norm`` group, which saves it, copies it with its other copies, before
    the loss is computed, where it waited for the model's return (Note [8] of
    offload.copy_queue); training stays bitwise, and `remove` gives the model its method back."""
    ref = train(build(layers=3), fb_no_pipelining())
    model = build(layers=3)
    handle = mg.apply(model, "attn_norm", min_tensor_bytes=0, device="cpu")
    manager = offload.get_manager()
    copied_before_the_loss: list[bool] = []

    def before_output_layer(module, args):
        first = next(g for g in manager.chunks.forward.groups if g.name == "attn_norm" and g.layer == 0)
        copied_before_the_loss.append(all(rec.host is not None for rec in first.records))

    hook = model.output_layer.register_forward_pre_hook(before_output_layer)
    assert_bitwise(ref, train(model, handle.wrap(fb_no_pipelining())))
    hook.remove()
    assert copied_before_the_loss == [True] * 4  # 2 steps of 2 microbatches
    s = handle.last_stats.by_name["attn_norm"]
    assert s.bytes_held_elsewhere == 0 and s.groups_offloaded == 2 * 2  # the last layer is kept (F B F B)
    assert "_preprocess" in vars(model)
    handle.remove()
    assert "_preprocess" not in vars(model)


def test_full_recompute_makes_groups_inert_and_stays_exact(mg):
    cfg = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    ref = train(build(layers=2, **cfg), fb_no_pipelining())
    model = build(layers=2, **cfg)
    handle = mg.apply(model, "core_attn,fc1", min_tensor_bytes=0, device="cpu")
    assert_bitwise(ref, train(model, handle.wrap(fb_no_pipelining())))
    assert handle.last_stats.total().bytes_offloaded == 0


# ---------------------------------------------------------------------------- schedule
def test_wrapper_resets_the_engine_when_the_step_fails(mg):
    model = build()
    handle = mg.apply(model, "core_attn", min_tensor_bytes=0, device="cpu")

    def broken_step(data_iterator, model):
        output, loss_func = forward_step(data_iterator, model)
        raise RuntimeError("data error")

    fb = handle.wrap(fb_no_pipelining())
    with pytest.raises(RuntimeError, match="data error"):
        fb(forward_step_func=broken_step, data_iterator=batches(2), model=[model],
           num_microbatches=2, seq_length=SEQ, micro_batch_size=MBS)
    assert offload.get_manager().live_handlers == []
    train(model, fb, steps=1)  # and the next step runs normally
    assert handle.last_stats.by_name["core_attn"].bytes_offloaded > 0


class _Group:
    def __init__(self, size, rank):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


class _P2P:
    def __init__(self, size, rank, virtual):
        self.pp_group = _Group(size, rank)
        self.virtual_pipeline_model_parallel_size = virtual


@pytest.mark.parametrize("pp, chunks, virtual, microbatches, group", [
    (2, 1, None, 4, None), (2, 1, 1, 4, None), (2, 2, 2, 4, None), (2, 2, 2, 6, 3),
    (4, 2, 2, 8, None), (4, 3, 3, 8, None), (2, 2, 2, 2, None),
])
def test_interleaved_order_is_the_one_megatron_runs(mg, pp, chunks, virtual, microbatches, group):
    """Against Megatron's own get_pp_rank_microbatches + get_schedule_table +
    convert_schedule_table_to_order, which its CUDA-graph code uses for the same purpose."""
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.transformer.cuda_graphs import convert_schedule_table_to_order

    models = [build(layers=1) for _ in range(chunks)]
    models[0].config.microbatch_group_size_per_vp_stage = group or pp
    for rank in range(pp):
        p2p = _P2P(pp, rank, virtual)
        _, _, warmup, _ = schedules.get_pp_rank_microbatches(
            microbatches, chunks, group or pp, p2p_communicator=p2p)
        table = schedules.get_schedule_table(microbatches, chunks, group or pp)
        expected = convert_schedule_table_to_order(warmup, chunks, table)
        got = mg.megatron_order(schedules.forward_backward_pipelining_with_interleaving,
                                dict(model=models, num_microbatches=microbatches, p2p_communicator=p2p))
        assert got == expected, (rank, got, expected)


def test_plain_and_unpipelined_orders(mg):
    from megatron.core.pipeline_parallel import schedules

    from offload.schedules import schedule_order

    model = build(layers=1)
    for rank in range(4):
        got = mg.megatron_order(schedules.forward_backward_pipelining_without_interleaving,
                                dict(model=[model], num_microbatches=6, p2p_communicator=_P2P(4, rank, None)))
        assert got == schedule_order(4, 1, 6, rank)
    assert mg.megatron_order(schedules.forward_backward_no_pipelining,
                             dict(model=[model], num_microbatches=3)) == [1, -1, 1, -1, 1, -1]
    assert mg.megatron_order(schedules.forward_backward_no_pipelining,
                             dict(model=[model], num_microbatches=3, forward_only=True)) is None


# ----------------------------------------------------------------- Megatron-LM's pretrain
def test_model_provider_wrapper_attaches_and_hooks_the_schedule(mg):
    """What Megatron-LM's pretrain does with a wrapped provider: build, then fetch the schedule
    with get_forward_backward_func() (from its own import) and run it."""
    import megatron.core.pipeline_parallel as pp_pkg

    args = argparse.Namespace(offload_modules=["core_attn,fc1"], offload_min_tensor_bytes=0,
                              offload_max_inflight_groups=1, offload_policy="all",
                              virtual_pipeline_model_parallel_size=None)
    ref = train(build(layers=2), fb_no_pipelining())

    provider = mg.wrap_model_provider(lambda pre_process=True, post_process=True, vp_stage=None: build(layers=2), args)
    model = provider(pre_process=True, post_process=True)
    fb = pp_pkg.get_forward_backward_func()  # rebound: hands out the wrapped schedule
    assert getattr(fb, "__offload_wrapped__", False)
    got = train(model, fb)
    assert_bitwise(ref, got)
    assert offload.get_manager().config.min_tensor_bytes == 0
    # the engine offloads from where the model lives (here the CPU, also on a GPU machine)
    assert offload.get_manager().streams.device == next(model.parameters()).device
    assert mg.MegatronOffload(()).last_stats.by_name["core_attn"].bytes_offloaded > 0
    mg._remove_schedule_hook()
    assert not getattr(pp_pkg.get_forward_backward_func(), "__offload_wrapped__", False)


# ------------------------------------------------------- the example, pipelined (2 processes)
TINY = ["--layers", "4", "--hidden", "32", "--heads", "4", "--ffn", "64", "--seq", "16",
        "--micro-batch-size", "2", "--vocab", "128", "--steps", "3", "--warmup-steps", "1",
        "--device", "cpu", "--offload-min-tensor-bytes", "0"]


def _run_example(tmp_path, name: str, world: int, argv: list[str]) -> dict:
    from megatron_cpu import run_example

    return run_example(tmp_path, name, world, [*TINY, *argv])[0]


@pytest.mark.parametrize("argv, names", [
    (["--model", "gpt", "--pp", "2", "--vpp", "1"], "core_attn,fc1,mlp_act"),
    (["--model", "gpt", "--pp", "2", "--vpp", "2", "--layers", "8"], "attn_norm,core_attn,qkv_linear,fc2"),
    (["--model", "moe", "--experts", "4", "--topk", "2", "--moe-ffn", "48", "--pp", "2", "--vpp", "1",
      "--interleaved"], "core_attn,expert_fc1,moe_act"),
], ids=["pp2-vpp1", "pp2-vpp2", "moe-pp2-interleaved-vpp1"])
def test_example_pipelined_on_two_processes_is_bitwise_equal(tmp_path, argv, names):
    """Megatron's own 1F1B and interleaved schedules over gloo (with VPP=2, sends and receives
    overlapped with compute, as Megatron-LM trains): the engine is handed the order Megatron
    runs (it checks every chunk forward against it), and training is bitwise equal.
    ``attn_norm`` (two layers a chunk): ``GPTModel.forward`` holds the embedding's output, the
    first layer's input, until it returns, so its first group finds it held elsewhere when its
    copies are issued; another chunk's forward or backward follows, and the second look (Note
    [8] of offload.copy_queue) copies it then: rank 0 leaves nothing held elsewhere (before it,
    the embedding's output of every microbatch)."""
    ref = _run_example(tmp_path, "ref", 2, argv)
    got = _run_example(tmp_path, "offload", 2, [*argv, f"--offload-modules={names}"])
    assert ref["ok"] and got["ok"]
    assert got["offload_modules"] == names.split(",")
    assert got["overlap_p2p_comm"] is (argv[argv.index("--vpp") + 1] != "1")  # Megatron-LM's default
    assert ref["loss_hex"] == got["loss_hex"] and len(ref["loss_hex"]) == 3
    assert ref["param_sha256"] == got["param_sha256"]
    for rank in got["per_rank"]:
        for name in names.split(","):
            assert rank["offload"]["by_name"][name]["bytes_offloaded"] > 0, (rank["rank"], name)
        if "attn_norm" in names and rank["pp_rank"] == 0:  # rank 1: the received input, which the schedule holds
            assert rank["offload"]["by_name"]["attn_norm"]["bytes_held_elsewhere"] == 0, rank["offload"]


@pytest.mark.parametrize("pipeline, virtual, batch, sync, warned", [
    (2, 2, True, True, True),     # megatron-core's config defaults with the interleaved schedule
    (2, 2, False, True, False),   # overlapped, as Megatron-LM trains with VPP > 1
    (2, 2, True, False, False),   # batched without the synchronize
    (2, None, True, True, False),  # 1F1B: Megatron-LM has no other way
    (1, None, True, True, False),
], ids=["interleaved-batched-sync", "interleaved-overlapped", "interleaved-batched-nosync", "1f1b", "no-pipeline"])
def test_interleaved_exchanges_that_synchronize_the_device_are_warned_once(mg, monkeypatch, pipeline, virtual,
                                                                           batch, sync, warned):
    """Each device synchronize after a batched exchange waits for the copies in flight (+45.6%
    against +10.2% on two H200s): `apply` says so once, where Megatron-LM would overlap."""
    import warnings

    from offload import notices

    monkeypatch.setattr(notices, "_said", set())  # as in a fresh process
    model = build()
    model.config.pipeline_model_parallel_size = pipeline
    model.config.virtual_pipeline_model_parallel_size = virtual
    model.config.batch_p2p_comm, model.config.batch_p2p_sync = batch, sync
    model.config.overlap_p2p_comm = not batch
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            mg.apply(model, "core_attn", device="cpu").remove()
        said = [str(w.message) for w in caught if "synchronizes the device after each exchange" in str(w.message)]
        assert len(said) == int(warned)
        if said:
            assert "set overlap_p2p_comm=True and batch_p2p_comm=False" in said[0]
        warned = False  # once per process


def test_example_alternate_baseline_suspends_every_other_measured_step(tmp_path):
    """``--alternate-baseline``: measured steps alternate between offloading and none, ending with
    one that offloads; both kinds of step train exactly as without the flag, and each is timed."""
    argv = ["--model", "gpt", "--pp", "2", "--vpp", "1", "--steps", "5"]
    ref = _run_example(tmp_path, "ref", 2, argv)
    got = _run_example(tmp_path, "alt", 2, [*argv, "--offload-modules=core_attn", "--alternate-baseline"])
    assert ref["ok"] and got["ok"]
    assert ref["loss_hex"] == got["loss_hex"] and len(ref["loss_hex"]) == 5
    assert ref["param_sha256"] == got["param_sha256"]
    for rank in got["per_rank"]:  # warm-up step 0, then steps 1 and 3 without offloading, 2 and 4 with
        assert len(rank["step_time_ms"]) == 3 and len(rank["alternate_baseline"]["step_time_ms"]) == 2
        assert rank["offload"]["by_name"]["core_attn"]["bytes_offloaded"] > 0  # the last step offloaded
        # the allocator's peaks exist on CUDA only; on the CPU both kinds of step say so
        assert rank["peak_reserved_bytes"] is None and rank["alternate_baseline"]["peak_reserved_bytes"] is None


def test_example_profile_trace_records_the_last_step_untimed(tmp_path):
    """``--profile-trace``: the last step runs under torch.profiler with the engine's ranges
    (named as in nsys), left out of the step times; training is as without it."""
    import gzip
    import json

    argv = ["--model", "gpt", "--steps", "4", "--offload-modules=core_attn"]
    ref = _run_example(tmp_path, "ref", 1, argv)
    got = _run_example(tmp_path, "traced", 1, [*argv, "--profile-trace", str(tmp_path / "trace")])
    assert ref["ok"] and got["ok"]
    assert ref["loss_hex"] == got["loss_hex"] and ref["param_sha256"] == got["param_sha256"]
    assert len(ref["per_rank"][0]["step_time_ms"]) == 4 and len(got["per_rank"][0]["step_time_ms"]) == 3
    with gzip.open(tmp_path / "trace" / "trace_rank0.json.gz", "rt") as f:
        names = {e.get("name", "") for e in json.load(f)["traceEvents"]}
    assert any(n.startswith("offload/core_attn/") for n in names)
    assert any(n.startswith("reload/core_attn/") for n in names)


def test_example_decision_log_logs_the_last_step_untimed(tmp_path):
    """``--decision-log`` (`offload.tools.decision_log`): the last step's reloads, group
    backwards and first unpacks, in the order the engine made them, with what it held then;
    left out of the step times, training as without it. Each group is unpacked once in the
    log, reloaded before its first unpack, and its backward ends after it; with the last-layer
    rule (one chunk, forward then its own backward) the last layer's group is kept, its source
    still the engine's at its unpack, and nothing reloads it."""
    import json

    argv = ["--model", "gpt", "--steps", "4", "--offload-modules=core_attn"]
    ref = _run_example(tmp_path, "ref", 1, argv)
    got = _run_example(tmp_path, "logged", 1, [*argv, "--decision-log", str(tmp_path / "log")])
    assert ref["ok"] and got["ok"]
    assert ref["loss_hex"] == got["loss_hex"] and ref["param_sha256"] == got["param_sha256"]
    assert len(got["per_rank"][0]["step_time_ms"]) == 3
    log = json.loads((tmp_path / "log" / "decisions_rank0.json").read_text())
    entries = log["log"]
    assert log["entries"] == len(entries) and log["peak_mib"] == 0  # no allocator on the CPU
    unpacked = [e["group"] for e in entries if e["event"] == "unpack"]
    layers = 4  # TINY
    assert len(unpacked) == len(set(unpacked)) == layers * 2  # two microbatches
    for label in unpacked:
        events = [(i, e["event"]) for i, e in enumerate(entries) if e["group"] == label]
        kinds = [kind for _, kind in events]
        assert kinds.count("unpack") == 1 and kinds.count("backward_done") == 1, (label, kinds)
        first_unpack = kinds.index("unpack")
        assert kinds.index("backward_done") > first_unpack
        if f"/L{layers - 1}/" in label:  # kept by the last-layer rule
            assert "reload" not in kinds
            unpack = entries[events[first_unpack][0]]
            assert any(key.startswith(label) and key.endswith(":KEPT") for key in unpack["sources"]), unpack
        else:
            assert "reload" in kinds  # prefetched before its unpack, or on demand right after it


def test_sequential_expert_fc1_is_one_group_per_layer_and_copies_all_routed_tokens(mg):
    """Each expert's fc1 saves a slice of the routed tokens; the layer's expert_fc1 group copies
    every slice once the experts are done, and nothing of the activations or fc2s."""
    model = build(moe=True, layers=3)
    handle = mg.apply(model, "expert_fc1", min_tensor_bytes=0, device="cpu")
    ref = train(build(moe=True, layers=3), fb_no_pipelining(), steps=1)
    assert_bitwise(ref, train(model, handle.wrap(fb_no_pipelining()), steps=1))
    s = handle.last_stats.by_name["expert_fc1"]
    routed = SEQ * MBS * 2 * 32 * 4  # tokens x topk x hidden x fp32, per layer and microbatch
    assert s.groups == 3 * 2 and s.groups_offloaded == 2 * 2  # the last layer is kept (F B F B)
    assert s.bytes_offloaded == 2 * 2 * routed
    assert s.bytes_held_elsewhere == 0


def test_copies_are_issued_after_each_moe_layers_dispatcher_sync(mg, monkeypatch):
    """Note [9] of offload.copy_queue: the dispatcher syncs with the host before the experts run;
    a pre-hook on each layer's experts says so (`offload.after_host_sync`), once per MoE layer
    and microbatch, and from then on no copy out is issued between a layer's attention and its
    sync (where the sync's own copy would wait behind it): each is issued at a sync or inside
    the experts after it (SequentialMLP: one moe_act group per expert, the next expert's open
    issues the previous one's). Bitwise as without offloading."""
    import offload.nvtx as nv

    model = build(moe=True, layers=3)
    handle = mg.apply(model, "core_attn,moe_act", min_tensor_bytes=0, device="cpu")
    manager = offload.get_manager()
    order: list[str] = []
    monkeypatch.setattr(nv, "push", lambda label: order.append(label))
    real_sync, real_open = manager.after_host_sync, manager.open_group
    monkeypatch.setattr(manager, "after_host_sync", lambda: order.append("sync") or real_sync())
    monkeypatch.setattr(manager, "open_group",
                        lambda name, *args: order.append("open " + name) or real_open(name, *args))
    fb = handle.wrap(fb_no_pipelining())

    def step(**kwargs):
        order.append("step")
        return fb(**kwargs)

    ref = train(build(moe=True, layers=3), fb_no_pipelining(), steps=2)
    assert_bitwise(ref, train(model, step, steps=2))
    last_step = order[len(order) - order[::-1].index("step"):]
    assert last_step.count("sync") == 3 * 2
    copies = [m for m in last_step if m.startswith("offload/")]
    s = handle.last_stats
    assert s.by_name["core_attn"].groups_offloaded == 2 * 2  # layers 0 and 1, both microbatches
    assert s.by_name["moe_act"].groups_offloaded == 2 * (3 * 4 - 1)  # 4 experts a layer, the last kept
    assert len(copies) == 2 * 2 + 2 * (3 * 4 - 1)
    issued_after = {m: next(x for x in reversed(last_step[:last_step.index(m)]) if x in ("sync", "open core_attn"))
                    for m in copies}
    assert set(issued_after.values()) == {"sync"}, issued_after
    handle.remove()
    assert all(not m._forward_pre_hooks for n, m in model.named_modules() if n.endswith("experts"))


def test_a_dispatcher_that_never_syncs_leaves_copies_at_group_opens(mg, monkeypatch):
    """The all-to-all dispatcher that drops and pads to capacity knows its token counts on the
    host (`megatron_names.syncs_with_host` is false): no experts pre-hook, no
    `offload.after_host_sync`, the decided copies issued at group opens (Note [7] of
    offload.copy_queue), bitwise as without offloading. The allgather dispatcher of the same
    model keeps its sync."""
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    from offload.integrations.megatron_names import syncs_with_host

    # the dispatcher makes a CUDA stream for its readbacks when its class has none yet
    monkeypatch.setattr(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", object())
    capacity = dict(moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=1.0,
                    moe_pad_expert_input_to_capacity=True)
    model = build(moe=True, layers=3, **capacity)
    assert not syncs_with_host(model.decoder.layers[0].mlp.token_dispatcher)
    assert syncs_with_host(build(moe=True, layers=1).decoder.layers[0].mlp.token_dispatcher)
    assert syncs_with_host(build(moe=True, layers=1, moe_token_dispatcher_type="alltoall")
                           .decoder.layers[0].mlp.token_dispatcher)
    assert mg.find_modules(model).experts == []
    handle = mg.apply(model, "moe_act", min_tensor_bytes=0, device="cpu")
    manager = offload.get_manager()
    syncs: list[int] = []
    monkeypatch.setattr(manager, "after_host_sync", lambda: syncs.append(1))
    ref = train(build(moe=True, layers=3, **capacity), fb_no_pipelining(), steps=2)
    assert_bitwise(ref, train(model, handle.wrap(fb_no_pipelining()), steps=2))
    assert syncs == []
    s = handle.last_stats.by_name["moe_act"]
    assert s.groups_offloaded == 2 * (3 * 4 - 1) and s.bytes_offloaded > 0
    assert all(not m._forward_pre_hooks for n, m in model.named_modules() if n.endswith("experts"))


def test_copies_into_backward_flag_reaches_the_engine(mg):
    """``--offload-copies-into-backward`` sets the engine's `OffloadConfig.copies_into_backward`;
    training stays bitwise and the same groups are offloaded and kept."""
    ref = train(build(layers=3), fb_no_pipelining(), steps=2)
    flags = ["--offload-modules=core_attn", "--offload-min-tensor-bytes=0"]
    parser = mg.add_arguments(argparse.ArgumentParser())
    assert not mg.Options.from_args(parser.parse_args(flags)).copies_into_backward
    model = build(layers=3)
    handle = mg.apply_from_args(model, parser.parse_args(flags + ["--offload-copies-into-backward"]), device="cpu")
    assert offload.get_manager().config.copies_into_backward
    assert_bitwise(ref, train(model, handle.wrap(fb_no_pipelining()), steps=2))
    s = handle.last_stats.by_name["core_attn"]
    assert (s.groups_offloaded, s.groups_kept) == (2 * 2, 2)


def test_policy_flag_reaches_the_engine(mg):
    """``--offload-policy layers:0-1``: layer 2's groups are declined, layers 0 and 1 offloaded
    (layer 2's backward comes before layer 1's: Note [11] of offload.copy_queue)."""
    ref = train(build(layers=3), fb_no_pipelining(), steps=1)
    model = build(layers=3)
    args = mg.add_arguments(argparse.ArgumentParser()).parse_args(
        ["--offload-modules=core_attn", "--offload-min-tensor-bytes=0", "--offload-policy=layers:0-1"])
    handle = mg.apply_from_args(model, args, device="cpu")
    assert_bitwise(ref, train(model, handle.wrap(fb_no_pipelining()), steps=1))
    s = handle.last_stats.by_name["core_attn"]
    assert (s.groups_offloaded, s.groups_kept, s.groups_declined) == (4, 0, 2)

