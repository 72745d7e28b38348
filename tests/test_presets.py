"""`offload.presets` on tiny random transformers models: names → modules, gradients, errors.

Every preset's model is built from a tiny config (nothing is downloaded) and trained with and
without offloading; the gradients must be bitwise equal and each name's groups must have run
and copied bytes. Skipped when transformers is not installed.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

import offload  # noqa: E402
from conftest import reproducible  # noqa: E402
from offload import presets  # noqa: E402
from offload.errors import OffloadError, UnknownModuleError  # noqa: E402
from offload.testing import first_difference  # noqa: E402

NORMS = ("attn_norm", "mlp_norm")
"""The norm names: their input, the residual stream, has three consumers (the residual add, and
pow and mul inside RMSNorm in fp32), where a backward marker that adds an autograd node would
change the order in which autograd sums its gradient (`test_groups_add_no_autograd_node`)."""

MOE = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # layers 0 and 2 dense, 1 and 3 MoE: both kinds of MLP, each in two layers
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[0, 2]),
}

# (model_type, attention implementation, experts implementation); Gemma 2 has no sdpa
# path. The experts' batched_mm is left out: it is not bitwise reproducible on the CPU itself.
CASES = [
    (model_type, attn, None)
    for model_type in ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text")
    for attn in ("sdpa", "eager")
    if (model_type, attn) != ("gemma2", "sdpa")
] + [
    (model_type, attn, experts)
    for model_type in MOE
    for attn in ("sdpa", "eager")
    for experts in ("grouped_mm", "eager")
]


def tiny_model(model_type: str, attn: str = "sdpa", experts: str | None = None, layers: int = 2,
               seed: int = 0) -> nn.Module:
    """A randomly initialised causal LM of ``model_type`` with tiny sizes, in train mode."""
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
        **MOE.get(model_type, {}),
    )
    kw = {"attn_implementation": attn}
    if experts is not None:
        kw["experts_implementation"] = experts
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, **kw).train()


def token_ids(seed: int, batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 128, (batch, seq), generator=torch.Generator().manual_seed(seed))


def step(model: nn.Module, ids: torch.Tensor, **inputs: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward and backward (no KV cache: it would hold k and v); the loss and the gradients."""
    model.zero_grad(set_to_none=False)
    loss = model(input_ids=ids, labels=ids, use_cache=False, **inputs).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def check_against_reference(model: nn.Module, ref: nn.Module, names, handle, iterations: int = 2,
                            **inputs: torch.Tensor) -> None:
    """Train ``model`` (attached) and ``ref`` (not) on the same batches: bitwise equal
    gradients, and every name's groups ran (one per matched module) and copied bytes."""
    for it in range(iterations):
        ids = token_ids(it)
        ref_loss, ref_grads = reproducible(lambda: step(ref, ids, **inputs)) if it == 0 else step(ref, ids, **inputs)
        loss, grads = step(model, ids, **inputs)
        assert torch.equal(loss, ref_loss)
        assert first_difference(ref_grads, grads) is None
        stats = offload.end_iteration()
        for name in names:
            s = stats.by_name[name]
            assert s.groups == len(handle.matched[name]), name
            assert s.groups_kept >= 1 and s.groups_offloaded >= 1, name
            assert s.bytes_offloaded > 0 and s.bytes_reloaded > 0, name
            if "layer" not in names:  # nested groups: a record may go out with one and come back with another
                assert s.bytes_offloaded == s.bytes_reloaded, name
        # Not equal in general: a record copied when the backward begins (Note [8] of
        # offload.copy_queue: the embedding output the model's forward held) whose backward
        # comes before its copy is done is used where it is, not reloaded
        assert 0 < stats.total().bytes_reloaded <= stats.total().bytes_offloaded
    assert offload.get_manager().live_handlers == []


@pytest.mark.parametrize("model_type,attn,experts", CASES)
def test_every_preset_gradients_bitwise_equal(configure, model_type, attn, experts):
    model = tiny_model(model_type, attn, experts, layers=4 if model_type == "qwen3_moe" else 2)
    ref = copy.deepcopy(model)
    names = [n for n in presets.available(model) if n != "layer"]  # it holds the others: test_layer_*
    expected = {"core_attn", "qkv_linear", "attn_proj"} | ({"router", "experts"} if model_type in MOE else set())
    assert expected <= set(names)
    configure(names)
    handle = offload.attach(model, presets.mapping_for(model, names))
    check_against_reference(model, ref, names, handle)


@pytest.mark.parametrize("name", ["qkv_linear", "core_attn", "fc1", "mlp_act", "fc2"])
def test_each_name_alone(configure, name):
    model = tiny_model("llama", layers=3)
    ref = copy.deepcopy(model)
    configure([name])
    handle = offload.attach(model, presets.mapping_for(model, name))
    check_against_reference(model, ref, [name], handle)


@pytest.mark.parametrize("names", ["core_attn,mlp_act", ["core_attn", "mlp_act"]], ids=["str", "list"])
def test_attach_takes_the_names_of_a_preset(configure, names):
    """``offload.attach(model, "core_attn,mlp_act")``: the patterns come from the preset."""
    model = tiny_model("qwen3", layers=2)
    ref = copy.deepcopy(model)
    configure(["core_attn", "mlp_act"])
    handle = offload.attach(model, names)
    assert set(handle.matched) == {"core_attn", "mlp_act"} and all(len(m) == 2 for m in handle.matched.values())
    check_against_reference(model, ref, ["core_attn", "mlp_act"], handle)


@pytest.mark.filterwarnings("ignore:offload. nothing was offloaded:RuntimeWarning")
def test_attn_proj_alone_finds_its_input_held_by_sdpa(configure):
    """On the CPU, o_proj's input is the storage SDPA saved as its output: offloading o_proj
    alone would free nothing, so it stays (the same as `GPTLayerStack`'s attn_proj)."""
    model = tiny_model("llama", layers=3)
    ref = copy.deepcopy(model)
    configure(["attn_proj"])
    offload.attach(model, presets.mapping_for(model, "attn_proj"))
    _, ref_grads = step(ref, token_ids(0))
    _, grads = step(model, token_ids(0))
    assert first_difference(ref_grads, grads) is None
    s = offload.end_iteration().by_name["attn_proj"]
    assert s.groups == 3 and s.bytes_offloaded == 0 and s.bytes_held_elsewhere == 2 * 2 * 16 * 64 * 4


def test_norm_groups_offload_exactly(configure):
    """The norms' groups, whose input has three consumers, offload and keep every gradient
    bitwise equal to the model without offloading, iteration after iteration."""
    model = tiny_model("llama", layers=3)
    ref = copy.deepcopy(model)
    configure(list(NORMS))
    offload.attach(model, presets.mapping_for(model, NORMS))
    for it in range(2):
        _, ref_grads = step(ref, token_ids(it))
        _, grads = step(model, token_ids(it))
        assert first_difference(ref_grads, grads) is None
        stats = offload.end_iteration()
        for name in NORMS:
            assert stats.by_name[name].bytes_offloaded > 0, name


def _autograd_nodes(output: torch.Tensor) -> list[str]:
    """The names of the autograd nodes behind ``output``, in a fixed traversal order."""
    seen, order, stack = set(), [], [output.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        order.append(node.name())
        stack.extend(next_node for next_node, _ in node.next_functions)
    return sorted(order)


@pytest.mark.filterwarnings("ignore:offload. nothing was offloaded:RuntimeWarning")
@pytest.mark.parametrize("name", NORMS)
def test_groups_add_no_autograd_node(configure, name):
    """A group's backward signal is a hook, not a node (offload/regions.py, Note [1]): the
    autograd graph is the plain model's, so autograd sums the residual stream's gradient in the
    same order, and with nothing offloaded the gradients are bitwise the plain model's."""
    model = tiny_model("llama")
    ref = copy.deepcopy(model)
    configure([name], min_tensor_bytes=1 << 40)  # nothing is offloaded: only the groups act
    offload.attach(model, presets.mapping_for(model, name))
    ids = token_ids(0)
    assert _autograd_nodes(model(ids, labels=ids).loss) == _autograd_nodes(ref(ids, labels=ids).loss)
    offload.reset()
    _, ref_grads = step(ref, token_ids(0))
    _, grads = step(model, token_ids(0))
    stats = offload.end_iteration()
    assert stats.by_name[name].groups == 2
    assert first_difference(ref_grads, grads) is None


def test_qkv_projections_are_three_sibling_groups(configure):
    """q, k and v run one after the other: three ``qkv_linear`` groups per layer, none inside
    another, and their one shared input is copied once per layer (by v_proj, the last to save it)."""
    model = tiny_model("llama", layers=3)
    configure(["qkv_linear"])
    offload.attach(model, presets.mapping_for(model, "qkv_linear"))
    step(model, token_ids(0))
    s = offload.end_iteration().by_name["qkv_linear"]
    assert s.groups == 9 and s.groups_kept == 1
    assert s.bytes_offloaded == 2 * (2 * 16 * 64 * 4)  # layers 0 and 1: the normed hidden state each


def test_a_qkv_group_around_the_projections_cannot_also_match_them(configure):
    """The other way to cover q, k and v, a group around them (the attention module), must not
    also name the projections: a group would open inside one of the same name."""
    model = tiny_model("llama")
    configure(["qkv_linear"])
    with pytest.raises(OffloadError, match="inside"):  # at attach, or at the forward that nests
        offload.attach(model, {"qkv_linear": ["model.layers.*.self_attn", "model.layers.*.self_attn.q_proj"]})
        step(model, token_ids(0))
    offload.reset()


def test_core_attention_routing(configure):
    """`CoreAttention` modules are installed once; a model of the same architecture without them
    runs exactly as before, and the attention function goes through them (switching the
    attention implementation at run time too)."""
    model = tiny_model("qwen3")
    plain = copy.deepcopy(model)
    first = presets.install_core_attention(model)
    assert first == [f"model.layers.{i}.self_attn.core_attention" for i in range(2)]
    assert presets.install_core_attention(model) == first
    assert sum(isinstance(m, presets.CoreAttention) for m in model.modules()) == 2
    assert not any(isinstance(m, presets.CoreAttention) for m in plain.modules())
    ids = token_ids(0)
    calls = []
    for qn in first:
        model.get_submodule(qn).register_forward_hook(lambda *a: calls.append(1))
    for attn in ("sdpa", "eager"):
        model.set_attn_implementation(attn)
        plain.set_attn_implementation(attn)
        assert first_difference(step(plain, ids)[1], step(model, ids)[1]) is None
    assert len(calls) == 4
    assert not any(isinstance(m, presets.CoreAttention) for m in plain.modules())


def test_core_attention_guard_raises_if_attention_bypasses_it(configure, monkeypatch):
    from transformers.models.llama import modeling_llama

    model = tiny_model("llama")
    presets.install_core_attention(model)
    unrouted = type(modeling_llama.ALL_ATTENTION_FUNCTIONS).__mro__[1]()
    monkeypatch.setattr(modeling_llama, "ALL_ATTENTION_FUNCTIONS", unrouted)
    with pytest.raises(OffloadError, match="did not call its attention function through core_attention"):
        step(model, token_ids(0))


# ------------------------------------------------------- the layer name, gradient checkpointing
CHECKPOINT_WRAPS_HOOKS = "__call__" in vars(transformers.modeling_layers.GradientCheckpointingLayer)
"""transformers before 5.23 checkpoints a layer's ``__call__``, its hooks inside the checkpoint."""
needs_forward_checkpointing = pytest.mark.skipif(
    CHECKPOINT_WRAPS_HOOKS, reason=f"transformers {transformers.__version__} checkpoints the layer's hooks (< 5.23)")


def checkpointed(model: nn.Module, reentrant: bool = False) -> nn.Module:
    """``model`` with every decoder layer checkpointed (``activation_checkpointing_enable``,
    ``gradient_checkpointing_enable`` before transformers 5.23)."""
    kwargs = {"use_reentrant": reentrant}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model


@pytest.mark.parametrize("names", [["layer"], ["layer", "core_attn", "fc2"]], ids=["alone", "around-others"])
def test_layer_offloads_what_no_inner_group_takes(configure, names):
    """Without checkpointing, ``layer`` is a group around the whole decoder layer: it takes what
    the layer saves outside the other names' groups, which nest inside it."""
    model = tiny_model("llama", layers=3)
    ref = copy.deepcopy(model)
    configure(names)
    handle = offload.attach(model, presets.mapping_for(model, names))
    assert handle.matched["layer"] == ["model.layers.0", "model.layers.1", "model.layers.2"]
    check_against_reference(model, ref, names, handle)


@pytest.mark.filterwarnings("ignore:offload. nothing was offloaded:RuntimeWarning")
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_groups_inside_checkpointed_layers_are_inert(configure, reentrant):
    """Under ``gradient_checkpointing_enable()`` the names inside a layer offload nothing: the
    forward's saved tensors are dropped and recomputed in backward, where they are needed at
    once. Non-reentrant checkpointing (transformers' default) counts them as recomputed;
    reentrant checkpointing runs the forward without grad, so no group opens at all."""
    names = ["core_attn", "fc1"]
    model = checkpointed(tiny_model("llama", layers=3), reentrant)
    ref = checkpointed(copy.deepcopy(model), reentrant)
    configure(names)
    offload.attach(model, presets.mapping_for(model, names))
    for it in range(2):
        ids = token_ids(it)
        ref_loss, ref_grads = step(ref, ids)
        loss, grads = step(model, ids)
        assert torch.equal(loss, ref_loss) and first_difference(ref_grads, grads) is None
        stats = offload.end_iteration()
        assert stats.total().bytes_offloaded == 0 and stats.total().groups == 0
        recomputed = {n: s.groups_recomputed for n, s in stats.by_name.items()}
        assert recomputed == ({} if reentrant else {"core_attn": 3, "fc1": 6})


@needs_forward_checkpointing
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_layer_offloads_the_inputs_checkpointing_keeps(configure, reentrant):
    """Under gradient checkpointing a layer keeps only its inputs (the hidden states), saved by
    the checkpoint while ``layer``'s group is open: they are offloaded, gradients bitwise those of
    checkpointing alone. Layer 0's input is the embedding output, which the model's forward
    holds until it returns (held elsewhere then), copied when the model's forward returns (Note
    [8] of offload.copy_queue); the last layer's is kept (its backward comes first)."""
    names = ["layer", "core_attn"]
    model = checkpointed(tiny_model("llama", layers=4), reentrant)
    ref = checkpointed(copy.deepcopy(model), reentrant)
    configure(names)
    offload.attach(model, presets.mapping_for(model, names))
    hidden_states = token_ids(0).numel() * model.config.hidden_size * 4  # [2, 16, 64] fp32
    for it in range(2):
        ids = token_ids(it)
        ref_loss, ref_grads = step(ref, ids)
        loss, grads = step(model, ids)
        assert torch.equal(loss, ref_loss) and first_difference(ref_grads, grads) is None
        s = offload.end_iteration().by_name
        assert (s["layer"].groups, s["layer"].groups_kept, s["layer"].tensors_offloaded) == (4, 1, 3)
        assert s["layer"].bytes_offloaded == 3 * hidden_states and s["layer"].bytes_held_elsewhere == 0
        # layer 0's input is copied when the model returns, and the backward's start waits for
        # that copy: reloaded for layer 0's backward as the others are
        assert s["layer"].bytes_reloaded == 3 * hidden_states
        if reentrant:  # the layer's forward runs without grad: core_attn's group never opens
            assert "core_attn" not in s
        else:
            assert (s["core_attn"].groups_recomputed, s["core_attn"].bytes_offloaded) == (4, 0)


def reload_order(model: nn.Module, monkeypatch) -> list[tuple[str, int]]:
    """Train one step of the checkpointed, ``layer``-attached model; the order in which backward
    reloads ``layer`` groups and recomputes the layers: ("reload", layer), ("recompute", layer)."""
    from offload.manager import PipelineOffloadManager

    events: list[tuple[str, int]] = []
    reload = PipelineOffloadManager.reload

    def spy(self, group, *args, **kwargs):
        if group.name == "layer":
            events.append(("reload", group.layer))
        return reload(self, group, *args, **kwargs)

    monkeypatch.setattr(PipelineOffloadManager, "reload", spy)
    for i, layer in enumerate(model.model.layers):  # self_attn's hooks run inside the checkpoint
        layer.self_attn.register_forward_pre_hook(
            lambda *_, i=i: events.append(("recompute", i)) if torch._C._current_graph_task_id() != -1 else None)
    step(model, token_ids(0))
    offload.end_iteration()
    return events


@needs_forward_checkpointing
@pytest.mark.parametrize("early", [True, False], ids=["start-of-backward", "control-end-of-backward"])
def test_checkpointed_layer_prefetches_the_layer_before_it_from_the_start_of_its_backward(
        configure, monkeypatch, early):
    """Note [2] of offload.regions: layer i's backward starts by recomputing from its inputs, so
    layer i-1's reload is issued when layer i's backward starts (its outputs' gradient hooks),
    not when it ends, which would leave the copy nothing to hide behind. The control signals
    from the inputs and reloads layer i-1 only after layer i is recomputed."""
    from offload import regions

    if not early:
        monkeypatch.setattr(regions, "_forward_is_checkpointed", lambda module: False)
    model = checkpointed(tiny_model("llama", layers=4))
    configure(["layer"])
    offload.attach(model, presets.mapping_for(model, "layer"))
    events = reload_order(model, monkeypatch)
    for i in (1, 2):  # layer 3 is kept; layer 0's input is held elsewhere (not reloaded)
        reloaded, recomputed_next = events.index(("reload", i)), events.index(("recompute", i + 1))
        assert (reloaded < recomputed_next) is early, events


def test_layer_under_checkpointing_that_wraps_hooks_is_refused(monkeypatch):
    """transformers < 5.23 checkpoints a layer's hooks too: ``layer`` would open its group after
    the checkpoint saved the inputs, so mapping_for refuses it while checkpointing is on."""
    model = tiny_model("llama")
    assert presets.mapping_for(model, "layer")  # control: without checkpointing
    checkpointed(model)
    monkeypatch.setattr(presets, "checkpoint_wraps_hooks", lambda layer: True)
    with pytest.raises(OffloadError, match=r"'layer' under gradient checkpointing needs transformers >= 5.23"):
        presets.mapping_for(model, "core_attn,layer")
    assert presets.mapping_for(model, "core_attn")  # the other names are inert there, not wrong


def test_checkpoint_wraps_hooks_reads_the_layer_class():
    assert presets.checkpoint_wraps_hooks(tiny_model("llama").model.layers[0]) == CHECKPOINT_WRAPS_HOOKS
    assert not presets.checkpoint_wraps_hooks(nn.Linear(2, 2))


def test_mapping_for_names_as_string_or_list():
    model = tiny_model("llama")
    a = presets.mapping_for(model, "core_attn,fc1")
    assert a == presets.mapping_for(model, ["core_attn", "fc1"]) == presets.mapping_for(model, "core_attn fc1")
    assert a == {
        "core_attn": ["model.layers.*.self_attn.core_attention"],
        "fc1": ["model.layers.*.mlp.gate_proj", "model.layers.*.mlp.up_proj"],
    }
    with pytest.raises(TypeError, match="string"):
        presets.mapping_for(model, ["core_attn", 3])


def test_dense_and_moe_layers_of_qwen3_moe():
    model = tiny_model("qwen3_moe", layers=4)
    have = presets.available(model)
    assert have["fc1"] == ["model.layers.*.mlp.gate_proj", "model.layers.*.mlp.up_proj"]
    assert have["router"] == ["model.layers.*.mlp.gate"] and have["experts"] == ["model.layers.*.mlp.experts"]
    handle = offload.attach(model, presets.mapping_for(model, "fc1,router,experts"))
    assert handle.matched["fc1"] == [f"model.layers.{i}.mlp.{p}_proj" for i in (0, 2) for p in ("gate", "up")]
    assert handle.matched["experts"] == ["model.layers.1.mlp.experts", "model.layers.3.mlp.experts"]
    handle.remove()


def test_a_wrapped_model_gets_its_prefix():
    class Wrapper(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

    model = Wrapper(tiny_model("mistral"))
    assert presets.mapping_for(model, "fc2") == {"fc2": ["inner.model.layers.*.mlp.down_proj"]}


def test_unsupported_architecture_lists_the_supported_ones():
    config = transformers.AutoConfig.for_model("gpt2", n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    model = transformers.AutoModelForCausalLM.from_config(config)
    with pytest.raises(OffloadError, match=r"model_type 'gpt2'.*supported model types: gemma, gemma2, .*llama"):
        presets.mapping_for(model, "core_attn")
    with pytest.raises(OffloadError, match="no transformers config"):
        presets.mapping_for(nn.Linear(2, 2), "core_attn")


@pytest.mark.parametrize("model_type,name,why", [
    ("llama", "router", "a dense model: no MoE layer"),
    ("llama", "expert_fc1", "a dense model: no MoE layer"),
    ("mixtral", "fc1", "every MLP is a MoE layer"),
    ("qwen3_moe", "expert_fc1", "fuses the experts into one module"),
    ("qwen3_moe", "moe_act", "would copy nothing"),
    ("llama", "core_atn", "not an offload name \\(did you mean 'core_attn'\\?\\)"),
])
def test_a_name_the_model_lacks_lists_the_names_it_has(model_type, name, why):
    model = tiny_model(model_type)
    with pytest.raises(UnknownModuleError, match=why) as err:
        presets.mapping_for(model, ["core_attn", name])
    assert "Names it has: attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm" in str(err.value)
    assert not any(isinstance(m, presets.CoreAttention) for m in model.modules())  # nothing installed


def test_gemma3_multimodal_maps_only_its_language_model(configure):
    text = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=28, patch_size=14)
    config = transformers.AutoConfig.for_model("gemma3", text_config=text, vision_config=vision,
                                               mm_tokens_per_image=4)
    torch.manual_seed(0)
    model = transformers.AutoModelForImageTextToText.from_config(config).train()
    ref = copy.deepcopy(model)
    names = ["core_attn", "qkv_linear", "fc2"]
    configure(names)
    handle = offload.attach(model, presets.mapping_for(model, names))
    assert all(qn.startswith("model.language_model.layers.") for qns in handle.matched.values() for qn in qns)
    assert not any(isinstance(m, presets.CoreAttention) for m in model.model.vision_tower.modules())
    text_only = torch.zeros(2, 16, dtype=torch.long)  # token_type_ids: no image token (5.0 requires them)
    check_against_reference(model, ref, names, handle, token_type_ids=text_only)


def test_an_attention_implementation_registered_later_is_routed_too():
    """Stands in for flash_attention_2 and kernels, which need CUDA: an implementation that
    transformers' registry gets after `install_core_attention` goes through the core attention."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model = tiny_model("llama")
    installed = presets.install_core_attention(model)
    calls = []
    for qn in installed:
        model.get_submodule(qn).register_forward_hook(lambda *a: calls.append(1))
    AttentionInterface.register("offload_test_sdpa", sdpa_attention_forward)
    try:
        model.set_attn_implementation("offload_test_sdpa")
        step(model, token_ids(0))
    finally:
        del AttentionInterface._global_mapping["offload_test_sdpa"]
    assert len(calls) == 2
