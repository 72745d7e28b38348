"""The name table on the Transformer Engine layer spec, Megatron's CUDA-graph flags and its
selective recompute (CPU, gloo, world size 1).

Transformer Engine is not installable here: `te_like` rebuilds the TE spec's structure with
stand-ins (a norm fused into ``linear_qkv``/``linear_fc1``, TE's attention, the real
``TEGroupedMLP`` over grouped-GEMM stand-ins). Training runs through Megatron's own
``forward_backward_func`` and is compared bitwise with the same model without offloading.
"""

from __future__ import annotations

import re
import enum
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core")

from offload.errors import OffloadError, UnknownModuleError  # noqa: E402
from test_megatron import assert_bitwise, build, fb_no_pipelining, mg, no_fp8, train  # noqa: E402,F401

pytestmark = pytest.mark.usefixtures("megatron_cpu")


@pytest.fixture
def te():
    """`te_like`, skipped where megatron-core builds MLPs from partials (0.19) instead of specs."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import ModuleSpec

    if not isinstance(get_gpt_layer_local_spec().submodules.mlp, ModuleSpec):
        pytest.skip("te_like rewrites 0.16-style ModuleSpecs")
    import te_like

    return te_like


def offload_and_compare(mg, make, names: str, steps: int = 2):
    """Train ``make()`` without and with ``names`` offloaded; bitwise equal; the handle."""
    ref = train(make(), fb_no_pipelining(), steps=steps)
    model = make()
    handle = mg.apply(model, names, min_tensor_bytes=0, device="cpu")
    assert_bitwise(ref, train(model, handle.wrap(fb_no_pipelining()), steps=steps))
    handle.remove()
    return handle


# ------------------------------------------------------------------------ TE name table
def test_te_dense_spec_maps_norms_to_the_fused_linear_layers(mg, te):
    found = mg.find_modules(te.build_te_like(layers=2))
    layer = "decoder.layers.{}."
    assert found.modules["qkv_linear"] == [layer.format(i) + "self_attention.linear_qkv" for i in range(2)]
    assert found.modules["core_attn"] == [layer.format(i) + "self_attention.core_attention" for i in range(2)]
    assert found.modules["fc1"] == [layer.format(i) + "mlp.linear_fc1" for i in range(2)]
    assert "attn_norm" not in found.names and "mlp_norm" not in found.names
    assert found.covered == {"attn_norm": "qkv_linear", "mlp_norm": "fc1"}
    assert "fused into self_attention.linear_qkv (TELayerNormColumnParallelLinear)" in found.absent["attn_norm"]


def test_te_moe_spec_maps_grouped_experts_and_the_separate_mlp_norm(mg, te):
    found = mg.find_modules(te.build_te_like(moe=True, layers=2))
    assert found.modules["expert_fc1"] == [f"decoder.layers.{i}.mlp.experts.linear_fc1" for i in range(2)]
    assert found.modules["expert_fc2"] == [f"decoder.layers.{i}.mlp.experts.linear_fc2" for i in range(2)]
    experts = "decoder.layers.1.mlp.experts"
    assert found.act_regions["moe_act"][1] == (experts, f"{experts}.linear_fc1", f"{experts}.linear_fc2")
    assert found.modules["mlp_norm"] == [f"decoder.layers.{i}.pre_mlp_layernorm" for i in range(2)]
    assert found.covered == {"attn_norm": "qkv_linear"}


@pytest.mark.parametrize("name, covering", [("attn_norm", "qkv_linear"), ("mlp_norm", "fc1")])
def test_a_fused_norm_alone_is_an_error_that_names_its_linear_layer(mg, te, name, covering):
    model = te.build_te_like()
    with pytest.raises(UnknownModuleError, match=rf"'{name}': .* is an IdentityOp: the norm is fused into .*"
                                                 rf"--offload-modules {covering} offloads both"):
        mg.apply(model, f"core_attn,{name}", device="cpu")
    assert all(not m._forward_pre_hooks for m in model.modules())


def test_te_dense_with_fused_norms_covered_is_bitwise_and_offloads_the_fused_layers(mg, te):
    names = "attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm,fc1,mlp_act,fc2"
    handle = offload_and_compare(mg, lambda: te.build_te_like(layers=3), names)
    by_name = handle.last_stats.by_name
    assert "attn_norm" not in by_name and "mlp_norm" not in by_name  # no group of their own
    for name in ("qkv_linear", "core_attn", "fc1", "mlp_act", "fc2"):
        assert by_name[name].bytes_offloaded > 0, name
    # the fused layer saves the norm's input and output: more than the linear layer alone
    local = offload_and_compare(mg, lambda: build(layers=3), "qkv_linear")
    saved = lambda s: s.bytes_offloaded + s.bytes_held_elsewhere  # noqa: E731
    assert saved(by_name["qkv_linear"]) > saved(local.last_stats.by_name["qkv_linear"])


def test_te_moe_grouped_experts_are_bitwise(mg, te):
    names = "qkv_linear,core_attn,mlp_norm,router,expert_fc1,moe_act,expert_fc2"
    handle = offload_and_compare(mg, lambda: te.build_te_like(moe=True, layers=3), names)
    for name in names.split(","):
        assert handle.last_stats.by_name[name].groups == 3 * 2, name
    for name in ("qkv_linear", "core_attn", "mlp_norm", "expert_fc1", "moe_act", "expert_fc2"):
        assert handle.last_stats.by_name[name].bytes_offloaded > 0, name


def test_op_fused_mlps_are_errors_that_name_the_flag(mg, te):
    with pytest.raises(UnknownModuleError, match=r"'fc1': the MLP is a TEFusedMLP \(--use-te-op-fuser\)"):
        mg.apply(te.build_te_like(fused_mlp=True), "fc1", device="cpu")
    with pytest.raises(UnknownModuleError, match=r"'mlp_norm': the MLP is a TEFusedMLP"):
        mg.apply(te.build_te_like(fused_mlp=True), "mlp_norm,fc1", device="cpu")
    model = te.build_te_like(moe=True)
    for layer in model.decoder.layers:
        layer.mlp.experts._with_fused_impl = True  # megatron-core 0.19's op fuser for TEGroupedMLP
    with pytest.raises(UnknownModuleError, match=r"'moe_act': .*--use-transformer-engine-op-fuser.*fused_group_mlp"):
        mg.apply(model, "moe_act", device="cpu")


@pytest.fixture
def mla(te, monkeypatch):
    """``mla(**config)`` makes a tiny multi-latent-attention GPT (local spec, TE-like attention
    for its different q/k and v head sizes)."""
    import megatron.core.transformer.multi_latent_attention as mla_module
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    monkeypatch.setattr(mla_module, "HAVE_TE", False)  # 0.16 checks isinstance(linear_proj, TELinear=None)

    def make(**overrides):
        config = MLATransformerConfig(
            num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True, hidden_dropout=0.0,
            attention_dropout=0.0, multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8,
            qk_pos_emb_head_dim=8, v_head_dim=8, rope_type="rope", **overrides)
        spec = get_gpt_layer_local_spec(multi_latent_attention=True)
        spec.submodules.self_attention.submodules.core_attention = te.TEDotProductAttention
        torch.manual_seed(0)
        return GPTModel(config, spec, vocab_size=te.VOCAB, max_sequence_length=te.SEQ, position_embedding_type="rope")

    return make


def test_mla_projections_are_qkv_linear(mg, mla):
    """The four projections are qkv_linear's groups, the separate input norm is attn_norm."""
    found = mg.find_modules(mla())
    assert found.modules["qkv_linear"][:4] == [f"decoder.layers.0.self_attention.{p}" for p in (
        "linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj")]
    assert found.modules["attn_norm"] == ["decoder.layers.0.input_layernorm", "decoder.layers.1.input_layernorm"]
    handle = offload_and_compare(mg, mla, "attn_norm,qkv_linear,core_attn")
    assert handle.last_stats.by_name["qkv_linear"].groups == 4 * 2 * 2  # 4 projections, 2 layers, 2 microbatches
    assert handle.last_stats.by_name["core_attn"].bytes_offloaded > 0


def test_mla_up_projection_recompute_leaves_qkv_linear_its_down_projections(mg, mla, no_fp8):
    """``mla_up_proj`` recomputes the up projections (CheckpointWithoutOutput, under no_grad):
    only the two down projections of each layer open qkv_linear groups. core_attn next to it
    saves q, k, v that the checkpoint discards and refills: training stays exact."""
    handle = offload_and_compare(mg, lambda: mla(**_selective("mla_up_proj")), "qkv_linear,core_attn")
    s = handle.last_stats.by_name
    assert s["qkv_linear"].groups == 2 * 2 * 2 and s["qkv_linear"].bytes_offloaded > 0


# -------------------------------------------------------------------------- CUDA graphs
class _Module(enum.Enum):  # megatron-core 0.19's CudaGraphModule, as a config holds it
    attn = 1
    mlp = 2
    moe = 3
    moe_router = 4


def _v19(impl: str, modules: list, **kw) -> SimpleNamespace:
    return SimpleNamespace(cuda_graph_impl=impl, cuda_graph_modules=modules, cuda_graph_scope=None, **kw)


def _v16(impl: str, scope, **kw) -> SimpleNamespace:
    return SimpleNamespace(cuda_graph_impl=impl, cuda_graph_scope=scope, **kw)


@pytest.mark.parametrize("config, names, label, expected", [
    (_v16("local", []), "core_attn", "local:layer",
     [r"\(--cuda-graph-impl local: one graph per transformer layer, the whole layer\)",
      "Inside the graphs: core_attn."]),
    (_v19("local", [_Module.attn]), "core_attn,expert_fc1", "local:attn",
     [r"--cuda-graph-impl local --cuda-graph-modules attn: Megatron's own runners, which take each transformer "
      r"layer whole when attn is named\)", "Inside the graphs: core_attn, expert_fc1."]),
    (_v19("full_iteration", []), "fc1", "full_iteration",
     [r"\(--cuda-graph-impl full_iteration: one graph for the whole forward and backward", "Inside the graphs: fc1."]),
    (_v16("local", "full_iteration"), "fc1", "full_iteration",
     ["--cuda-graph-scope full_iteration: one graph for the whole forward and backward"]),
    (_v19("none", "full", enable_cuda_graph=True), "fc1", "local:layer",
     [r"--enable-cuda-graph \(= --cuda-graph-impl local\)"]),
], ids=["016-local-layer", "019-local-attn", "019-full-iteration", "016-local-full-iteration", "enable-cuda-graph"])
def test_megatrons_own_graph_runners_are_refused_naming_the_flags_and_where_each_name_runs(mg, config, names, label,
                                                                                           expected):
    assert mg.cuda_graph_mode(config).label == label
    with pytest.raises(OffloadError) as info:
        mg.check_compatible(config, names.split(","))
    for pattern in expected:
        assert re.search(pattern, str(info.value)), (pattern, str(info.value))
    assert "Use --cuda-graph-impl transformer_engine" in str(info.value)


@pytest.mark.parametrize("config, names, label, inside", [
    (_v16("transformer_engine", "attn"), "core_attn,expert_fc1", "transformer_engine:attn", ["core_attn"]),
    (_v19("transformer_engine", [_Module.attn, _Module.moe_router]), "mlp_norm,router,expert_fc1,moe_act",
     "transformer_engine:attn+moe_router", ["mlp_norm", "router"]),
    (_v19("transformer_engine", ["mlp"]), "qkv_linear,fc1", "transformer_engine:mlp", ["fc1"]),
    (_v19("transformer_engine", []), "qkv_linear,fc1", "transformer_engine:layer", ["qkv_linear", "fc1"]),
    (_v16("none", [], external_cuda_graph=True), "fc1", "transformer_engine:layer", ["fc1"]),
], ids=["016-te-attn", "019-te-attn-router", "019-te-mlp", "019-te-layer", "external-cuda-graph"])
def test_transformer_engine_graphs_pass_the_check(mg, config, names, label, inside):
    mode = mg.check_cuda_graphs(config, names.split(","))
    assert mode.label == label and mode.through_offload
    assert mode.captured(names.split(",")) == inside
    mg.check_compatible(config, names.split(","))


def test_the_graph_regions_name_only_known_names_and_cover_them_all(mg):
    """megatron_graphs' table of which names each capture region holds spells the names out (it
    cannot import megatron_names' lists: megatron_names imports it): every name there is one
    `NAMES` has, and each of `NAMES` is in some region, so an unknown region ("all") and a
    renamed name cannot drift apart."""
    from offload.integrations import megatron_graphs, megatron_names

    regions = megatron_graphs._GRAPH_REGIONS
    assert {n for names in regions.values() for n in names} == set(mg.NAMES)
    assert regions["mlp"] == ("mlp_norm",) + megatron_names._DENSE_MLP_NAMES
    assert regions["moe"] == ("mlp_norm",) + megatron_names._MOE_NAMES


@pytest.mark.parametrize("field, flag", [("overlap_moe_expert_parallel_comm", "--overlap-moe-expert-parallel-comm"),
                                         ("delay_wgrad_compute", "--delay-wgrad-compute")])
def test_transformer_engine_graphs_with_split_weight_gradients_are_refused(mg, field, flag):
    config = _v19("transformer_engine", [_Module.attn], **{field: True})
    assert mg.check_cuda_graphs(config, []) is None  # nothing offloaded: nothing to refuse
    with pytest.raises(OffloadError, match=rf"\(--cuda-graph-impl transformer_engine --cuda-graph-modules attn\) "
                                           rf"with {flag} split each layer's backward graph"):
        mg.check_compatible(config, ["core_attn"])


def test_cuda_graphs_off_pass_and_a_real_config_is_read(mg):
    assert mg.cuda_graph_mode(_v19("none", "full")) is None
    mg.check_compatible(_v19("none", []), ["core_attn"])
    model = build()
    model.config.cuda_graph_impl = "local"
    model.config.cuda_graph_scope = ["attn"]  # 0.16's field (0.19: cuda_graph_modules)
    with pytest.raises(OffloadError, match=r"--cuda-graph-impl local --cuda-graph-(scope|modules) attn"):
        mg.apply(model, "fc1", device="cpu")
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


def _te_graph_model():
    model = build()
    model.config.cuda_graph_impl = "transformer_engine"
    model.config.cuda_graph_scope = ["attn"]
    return model


def test_transformer_engine_graphs_route_megatrons_capture_through_offload(mg, monkeypatch):
    """With TE's graphs on, `apply` makes the function Megatron's ``TECudaGraphHelper`` captures
    with call ``offload.graphs.make_graphed_callables`` with TE's as ``graph_api`` and every
    keyword argument passed on; `remove` puts TE's back; without names nothing is rebound."""
    from megatron.core.transformer import cuda_graphs

    import offload.graphs

    def te_api(callables, sample_args, **kwargs):  # stands for TE's make_graphed_callables
        raise AssertionError("called directly")

    calls = []
    monkeypatch.setattr(cuda_graphs, "make_graphed_callables", te_api, raising=False)
    monkeypatch.setattr(offload.graphs, "make_graphed_callables",
                        lambda fns, args, **kw: calls.append((fns, args, kw)) or "graphed")
    assert mg.apply(_te_graph_model(), "", device="cpu").names == ()
    assert cuda_graphs.make_graphed_callables is te_api
    handle = mg.apply(_te_graph_model(), "fc1", device="cpu")
    routed = cuda_graphs.make_graphed_callables
    assert routed is not te_api
    assert mg.apply(_te_graph_model(), "fc1", device="cpu").remove() is None  # routed once: the second undoes nothing
    assert cuda_graphs.make_graphed_callables is routed
    kwargs = dict(_order=[1, -1], sample_kwargs=[{}], num_warmup_iters=7, fp8_enabled=False)
    assert routed(("layer",), [("x",)], **kwargs) == "graphed"
    assert calls == [(("layer",), [("x",)], dict(graph_api=te_api, **kwargs))]
    handle.remove()
    assert cuda_graphs.make_graphed_callables is te_api


def test_transformer_engine_graphs_without_te_are_an_error_at_apply(mg, monkeypatch):
    from megatron.core.transformer import cuda_graphs

    monkeypatch.delattr(cuda_graphs, "make_graphed_callables", raising=False)
    model = _te_graph_model()
    with pytest.raises(OffloadError, match="needs Transformer Engine's make_graphed_callables"):
        mg.apply(model, "fc1", device="cpu")
    assert all(not m._forward_pre_hooks and not m._forward_hooks for m in model.modules())


# ---------------------------------------------------------------------- selective recompute
def _selective(*modules: str) -> dict:
    return dict(recompute_granularity="selective", recompute_modules=list(modules))


REFUSED = [  # (model, names, recompute_modules)
    ("dense", "core_attn", ["core_attn"]),
    ("dense", "attn_norm", ["layernorm"]),
    ("dense", "fc1", ["mlp"]),
    ("moe", "expert_fc1", ["moe"]),
    ("te_moe", "moe_act", ["moe_act"]),
]


def _maker(kind: str, te_mod, **cfg):
    if kind == "te_moe":
        return lambda: te_mod.build_te_like(moe=True, layers=2, **cfg)
    return lambda: build(moe=kind == "moe", layers=2, **cfg)


@pytest.mark.parametrize("kind, name, recompute", REFUSED, ids=[f"{n}-{r[0]}" for _, n, r in REFUSED])
def test_recomputed_regions_are_refused(mg, te, no_fp8, kind, name, recompute):
    with pytest.raises(OffloadError, match=rf"{name} \(recompute_modules has {recompute[0]}\)"):
        mg.apply(_maker(kind, te, **_selective(*recompute))(), name, device="cpu")


# megatron-core 0.16's "mlp" recompute recurses without end in CheckpointFunction.backward on
# the CPU harness, with or without offloading: left out here (its refusal is tested above).
INERT = [case for case in REFUSED if case[2] != ["mlp"]]


@pytest.mark.parametrize("kind, name, recompute", INERT, ids=[f"{n}-{r[0]}" for _, n, r in INERT])
def test_refused_pairs_would_offload_nothing(mg, te, no_fp8, monkeypatch, kind, name, recompute):
    """Why they are refused: with the check bypassed, training stays exact and the name's
    groups move no byte (the region runs under no_grad, or saves only what the engine keeps)."""
    from offload.integrations import megatron_names

    monkeypatch.setattr(megatron_names, "_check_recompute", lambda *a: None)
    handle = offload_and_compare(mg, _maker(kind, te, **_selective(*recompute)), name)
    stats = handle.last_stats.by_name.get(name)
    assert stats is None or stats.bytes_offloaded == 0


def test_moe_act_refusal_explains_the_detached_leaf(mg, te, no_fp8):
    with pytest.raises(OffloadError, match="saves the fc1 output as a detached leaf that requires grad"):
        mg.apply(te.build_te_like(moe=True, **_selective("moe_act")), "moe_act", device="cpu")


def test_fused_norms_are_not_recomputed_so_layernorm_recompute_composes(mg, te, no_fp8):
    """Megatron recomputes only norm modules; the TE spec's attention and dense-MLP norms are
    fused into linear_qkv/linear_fc1, whose groups offload as usual."""
    handle = offload_and_compare(mg, lambda: te.build_te_like(layers=2, **_selective("layernorm")),
                                 "attn_norm,qkv_linear,mlp_norm,fc1")
    assert handle.last_stats.by_name["qkv_linear"].bytes_offloaded > 0
    assert handle.last_stats.by_name["fc1"].bytes_offloaded > 0


def test_moe_act_recompute_next_to_offloaded_experts(mg, te, no_fp8):
    """TEGroupedMLP with its activation recomputed: fc1's input is offloaded; fc2's input is the
    checkpoint's discarded output, held by the checkpoint: left alone, not copied."""
    handle = offload_and_compare(mg, lambda: te.build_te_like(moe=True, layers=3, **_selective("moe_act")),
                                 "expert_fc1,expert_fc2")
    s = handle.last_stats.by_name
    assert s["expert_fc1"].bytes_offloaded > 0
    assert s["expert_fc2"].bytes_offloaded == 0 and s["expert_fc2"].bytes_held_elsewhere > 0


def test_moe_act_recompute_does_not_apply_to_sequential_experts(mg):
    """``moe_act`` recompute needs moe_grouped_gemm in the config, but SequentialMLP's experts
    have no activation checkpoint: there moe_act offloads as usual."""
    handle = offload_and_compare(mg, lambda: build(moe=True, layers=2, moe_grouped_gemm=True, **_selective("moe_act")),
                                 "moe_act")
    assert handle.last_stats.by_name["moe_act"].bytes_offloaded > 0


# ------------------------------------------------------------ Megatron's own offloading
def test_names_for_megatrons_own_offloading(mg, te):
    assert mg.to_megatron_names("expert_fc1,moe_act,mlp_norm") == ["expert_fc1", "moe_act", "mlp_norm"]
    with pytest.raises(OffloadError, match=r"has no fc1, expert_fc2; the names it shares"):
        mg.to_megatron_names("fc1,core_attn,expert_fc2")
    found = [mg.find_modules(te.build_te_like())]
    with pytest.raises(OffloadError, match="would drop attn_norm silently"):
        mg.to_megatron_names("attn_norm,core_attn", found)
    assert mg.to_megatron_names("attn_norm,qkv_linear", found) == ["attn_norm", "qkv_linear"]


def test_moe_act_offloads_the_grouped_fc1_output_a_glu_splits(mg, te):
    """TE's ``GroupedLinear`` returns its output as a view of a buffer it allocated (a leaf
    that does not require grad); a GLU saves the halves of it. They are the fc1 output, an
    activation: ``moe_act`` moves them with the rest (the H200 peak trace of dsv3_proxy showed
    7 of 8 layers' fc1 outputs left on the GPU when the policy refused them, docs/megatron.md)."""
    import torch.nn.functional as F

    make = lambda: te.build_te_like(moe=True, layers=3, gated_linear_unit=True, activation_func=F.silu)  # noqa: E731
    handle = offload_and_compare(mg, make, "expert_fc1,moe_act")
    s = handle.last_stats.by_name
    per_column = s["expert_fc1"].bytes_offloaded // 32  # expert_fc1 saves the routed tokens: h = 32 columns
    assert per_column > 0
    # the fc1 output (2·f columns, f = 48) and what the activation saves (silu's output and the
    # product the probabilities scale, f each): 4·f at least; without the fc1 output, 3·f
    assert s["moe_act"].bytes_offloaded >= 4 * 48 * per_column
