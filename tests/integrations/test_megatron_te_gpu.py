"""The name table on megatron-core's real Transformer Engine layer spec (GPU, TE installed).

Skipped without CUDA or without an importable Transformer Engine. Run it in a pytest process of
its own (NCCL world size 1, and ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`` must be set before TE is
imported), on the project's GPU host after ``tools/gpu_te.sh``::

    eval "$(bash tools/gpu_te.sh env)"; python -m pytest -q tests/integrations/test_megatron_te_gpu.py

It checks what the CPU tests assume of TE's modules (`te_like`): the norms fused into
``linear_qkv``/``linear_fc1`` (``layer_norm_weight``), ``TEGroupedMLP``'s ``linear_fc1``/
``linear_fc2``, MLA's separate ``input_layernorm``; and that training through Megatron's schedule
is bitwise equal with and without offloading, in bf16 and under FP8 delayed and current scaling.
"""

from __future__ import annotations

import os

os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
os.environ.setdefault("NVTE_TORCH_COMPILE", "0")

import functools  # noqa: E402
import warnings  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from offload.testing import free_port  # noqa: E402

pytest.importorskip("megatron.core")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)
te = pytest.importorskip("transformer_engine.pytorch")

pytestmark = pytest.mark.cuda
SEQ, MBS, VOCAB = 256, 2, 1024
GRAPH_WARMUP = 1  # eager steps before Megatron's TE graphs are captured


@pytest.fixture(scope="module")
def mg():
    """The integration, with NCCL (world size 1) and Megatron's groups started."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.cuda.set_device(0)
    started = not torch.distributed.is_initialized()
    if started:
        port = free_port()
        torch.distributed.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)
    torch.use_deterministic_algorithms(True, warn_only=True)
    from offload.integrations import megatron

    yield megatron
    torch.use_deterministic_algorithms(False)
    parallel_state.destroy_model_parallel()
    if started:
        torch.distributed.destroy_process_group()


def build(moe: bool = False, mla: bool = False, fp8: str | None = None, graphs: list[str] | None = None,
          capacity: bool = False):
    """A 2-layer GPTModel with the TE spec in bf16 (``Float16Module``); with ``graphs`` (the
    ``cuda_graph_modules``, ``[]`` for whole layers), set up for Megatron's TE CUDA graphs; with
    ``capacity``, the MoE's all-to-all dispatcher drops and pads to capacity (no host sync)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    kw = dict(num_layers=2, hidden_size=256, num_attention_heads=4, ffn_hidden_size=512, hidden_dropout=0.0,
              attention_dropout=0.0, bf16=True, params_dtype=torch.bfloat16, normalization="RMSNorm",
              gated_linear_unit=True, activation_func=torch.nn.functional.silu, add_bias_linear=False)
    if moe:
        kw.update(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=128, moe_grouped_gemm=True,
                  moe_token_dispatcher_type="allgather")
    if capacity:
        kw.update(moe_token_dispatcher_type="alltoall", moe_expert_capacity_factor=1.0,
                  moe_pad_expert_input_to_capacity=True)
    if mla:
        kw.update(multi_latent_attention=True, q_lora_rank=128, kv_lora_rank=64, qk_head_dim=64,
                  qk_pos_emb_head_dim=32, v_head_dim=64, rope_type="rope")
    if fp8:
        kw.update(fp8="hybrid", fp8_recipe={"delayed": "delayed", "current": "tensorwise"}[fp8])
    if graphs is not None:
        kw.update(cuda_graph_impl="transformer_engine", cuda_graph_modules=list(graphs),
                  cuda_graph_warmup_steps=GRAPH_WARMUP)
    config = (MLATransformerConfig if mla else TransformerConfig)(**kw)
    torch.manual_seed(0)
    if graphs is None:
        model_parallel_cuda_manual_seed(1234)
    else:  # as Megatron's training seeds for TE's graphs: graph-safe RNG states
        model_parallel_cuda_manual_seed(1234, te_rng_tracker=True, use_cudagraphable_rng=True, force_reset_rng=True)
    spec = get_gpt_layer_with_transformer_engine_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=moe,
                                                      multi_latent_attention=mla)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                         position_embedding_type="rope" if mla else "learned_absolute")
    return Float16Module(config, model.cuda())


def train(model, fb, steps: int = 3, microbatches: int = 2, before_step=None) -> tuple[list[str], dict]:
    """``steps`` steps through Megatron's schedule; (losses as float.hex, last gradients).
    ``before_step(i)`` runs before step ``i``."""
    g = torch.Generator().manual_seed(1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pos = torch.arange(SEQ).expand(MBS, SEQ).cuda()
    losses = []

    def step_func(data, m):
        tokens = next(data)
        out = m(tokens[:, :-1], pos, None, labels=tokens[:, 1:])
        return out, lambda o: (o.float().mean(), {"loss": o.float().mean().detach()})

    for step in range(steps):
        if before_step is not None:
            before_step(step)
        data = iter([torch.randint(0, VOCAB, (MBS, SEQ + 1), generator=g).cuda() for _ in range(microbatches)])
        opt.zero_grad(set_to_none=False)
        out = fb(forward_step_func=step_func, data_iterator=data, model=[model], num_microbatches=microbatches,
                 seq_length=SEQ, micro_batch_size=MBS)
        losses += [float(d["loss"]).hex() for d in out]
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
    return losses, grads


def bitwise(mg, make, names: str):
    """Reference twice (reproducible?), then with ``names`` offloaded; returns the stats."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ref, again = train(make(), get_forward_backward_func()), train(make(), get_forward_backward_func())
    assert ref[0] == again[0], "the reference does not reproduce itself"
    model = make()
    handle = mg.apply(model, names, min_tensor_bytes=0)
    got = train(model, handle.wrap(get_forward_backward_func()))
    handle.remove()
    assert got[0] == ref[0]
    for n, grad in ref[1].items():
        assert torch.equal(grad, got[1][n]), n
    return handle.last_stats


def test_the_te_spec_has_the_structure_the_name_table_assumes(mg):
    dense = mg.find_modules(build())
    assert dense.covered == {"attn_norm": "qkv_linear", "mlp_norm": "fc1"}
    assert dense.modules["qkv_linear"] == [f"module.decoder.layers.{i}.self_attention.linear_qkv" for i in range(2)]
    moe = mg.find_modules(build(moe=True))
    assert moe.modules["expert_fc1"] == [f"module.decoder.layers.{i}.mlp.experts.linear_fc1" for i in range(2)]
    assert moe.modules["mlp_norm"] == [f"module.decoder.layers.{i}.pre_mlp_layernorm" for i in range(2)]
    assert moe.covered == {"attn_norm": "qkv_linear"} and "moe_act" in moe.names
    mla = mg.find_modules(build(mla=True))
    assert "attn_norm" in mla.names and len(mla.modules["qkv_linear"]) == 4 * 2


@pytest.mark.parametrize("moe, names", [
    (False, "attn_norm,qkv_linear,core_attn,attn_proj,mlp_norm,fc1,mlp_act,fc2"),
    (True, "qkv_linear,core_attn,mlp_norm,router,expert_fc1,moe_act,expert_fc2"),
], ids=["dense", "moe"])
def test_te_spec_bitwise_bf16(mg, moe, names):
    stats = bitwise(mg, lambda: build(moe=moe), names)
    for name in ("qkv_linear", "core_attn", "expert_fc1" if moe else "fc1"):
        assert stats.by_name[name].bytes_offloaded > 0, name


def test_a_dispatcher_without_host_syncs_offloads_bitwise_and_never_reports_a_sync(mg, monkeypatch):
    """The all-to-all dispatcher dropping and padding to capacity (``grouped-gemm-capacity`` in
    the example) on TEGroupedMLP: no `offload.after_host_sync`, copies issued at group opens,
    bitwise as without offloading."""
    from offload.manager import PipelineOffloadManager

    assert mg.find_modules(build(moe=True, capacity=True)).experts == []
    syncs: list[int] = []
    monkeypatch.setattr(PipelineOffloadManager, "after_host_sync", lambda self: syncs.append(1))
    stats = bitwise(mg, lambda: build(moe=True, capacity=True), "mlp_norm,expert_fc1,moe_act")
    assert syncs == []
    assert stats.by_name["moe_act"].bytes_offloaded > 0 and stats.by_name["expert_fc1"].bytes_offloaded > 0


def test_moe_act_gets_the_glus_activated_half_back_packed_and_bitwise(mg, monkeypatch):
    """Note [10] of offload.copy_queue: on CUDA the integration opens ``moe_act`` with
    ``packed_views``: TEGroupedMLP's GLU saves its activated half alone, a view with gaps, which
    comes back packed, never spread, and training is bitwise as without offloading."""
    from offload import manager as manager_module
    from offload.copy_queue import CopyQueue

    rows, spread = [], []
    gapped = manager_module.gapped_rows

    def counted(size, stride):
        found = gapped(size, stride)
        if found is not None:
            rows.append(found)
        return found

    monkeypatch.setattr(manager_module, "gapped_rows", counted)
    monkeypatch.setattr(CopyQueue, "spread", lambda self, rec: spread.append(rec))
    stats = bitwise(mg, lambda: build(moe=True, capacity=True), "moe_act")
    assert rows and spread == []
    assert stats.by_name["moe_act"].bytes_reloaded == stats.by_name["moe_act"].bytes_offloaded > 0


def test_mla_te_spec_bitwise(mg):
    stats = bitwise(mg, lambda: build(moe=True, mla=True), "attn_norm,qkv_linear,core_attn,expert_fc1,moe_act")
    assert stats.by_name["attn_norm"].bytes_offloaded + stats.by_name["attn_norm"].bytes_held_elsewhere > 0


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_te_spec_bitwise_fp8(mg, recipe):
    if not te.is_fp8_available():
        pytest.skip("no FP8 on this GPU")
    stats = bitwise(mg, lambda: build(moe=True, fp8=recipe), "qkv_linear,core_attn,mlp_norm,expert_fc1,moe_act")
    assert stats.by_name["expert_fc1"].bytes_offloaded > 0


# ------------------------------------------------------------ Megatron's TE CUDA graphs
@pytest.fixture
def te_graphs(mg):
    """What Megatron's training sets up for ``TECudaGraphHelper`` (its microbatch calculator);
    afterwards, the plain RNG tracker again for the other tests."""
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                           init_num_microbatches_calculator)
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    init_num_microbatches_calculator(0, None, MBS * 2, MBS, 1)
    yield
    destroy_num_microbatches_calculator()
    model_parallel_cuda_manual_seed(1234, force_reset_rng=True)


@functools.cache
def example_module():
    """examples/megatron_gpt.py as a module (its helper for Megatron's TE capture)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "examples" / "megatron_gpt.py"
    spec = importlib.util.spec_from_file_location("megatron_gpt_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def graphed_train(mg, moe: bool, graphs: list[str], names: str, steps: int = 4):
    """Train with Megatron's TE graphs, captured by ``TECudaGraphHelper`` after `GRAPH_WARMUP`
    eager steps as Megatron-LM's loop does, with ``names`` offloaded through the integration
    (``""``: none); returns `train`'s result, what the graphs hold per name
    (``captures.captured_summary()``) and the last step's statistics."""
    import offload
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.cuda_graphs import TECudaGraphHelper

    model = build(moe=moe, graphs=graphs)
    model.zero_grad_buffer = lambda: model.zero_grad(set_to_none=False)  # what the capture's reset calls
    handle = mg.apply(model, names, min_tensor_bytes=0)
    helper = TECudaGraphHelper(model=[model], config=model.config, seq_length=SEQ, micro_batch_size=MBS,
                               optimizers=[])

    def before_step(step: int) -> None:
        if step == GRAPH_WARMUP:
            example_module().drop_autograd_history_kept_by_modules([model])  # the MoE dispatcher's
            helper.create_cudagraphs()

    try:
        result = train(model, handle.wrap(get_forward_backward_func()), steps=steps, before_step=before_step)
        captured = offload.get_manager().captures.captured_summary()
        stats = handle.last_stats
    finally:
        if helper.graphs_created():
            helper.delete_cuda_graphs()
        handle.remove()
        offload.reset(release_pool=True)
    return result, captured, stats


@pytest.mark.parametrize("moe, graphs, names, inside, eager", [
    (False, [], "qkv_linear,core_attn,attn_proj,fc1", {"core_attn", "fc1", "qkv_linear"}, set()),
    (False, ["attn"], "qkv_linear,core_attn,fc1,mlp_act", {"core_attn", "qkv_linear"}, {"fc1", "mlp_act"}),
    (True, ["attn"], "qkv_linear,core_attn,expert_fc1,moe_act", {"core_attn", "qkv_linear"},
     {"expert_fc1", "moe_act"}),
], ids=["dense-layer", "dense-attn", "moe-attn"])
def test_megatron_te_graphs_offload_bitwise(mg, te_graphs, moe, graphs, names, inside, eager):
    """``--cuda-graph-impl transformer_engine`` (whole layers; attention only, with the MLP or
    the MoE layer eager, as Megatron captures MoE models): the names inside the graphs are
    captured, the others offload eagerly, and losses and gradients equal those of the same
    graphs without offloading, bitwise."""
    from megatron.core.transformer import cuda_graphs

    te_api = cuda_graphs.make_graphed_callables
    ref = graphed_train(mg, moe, graphs, "")[0]
    again = graphed_train(mg, moe, graphs, "")[0]
    assert ref[0] == again[0], "the graphed reference does not reproduce itself"
    got, captured, stats = graphed_train(mg, moe, graphs, names)
    assert cuda_graphs.make_graphed_callables is te_api, "remove() leaves Megatron's TE function in place"
    assert inside <= set(captured) and not set(captured) & eager, captured
    assert captured["core_attn"]["bytes_copied"] > 0, captured  # what each replay moves
    for name in eager:  # offloaded eagerly, between the graphs' replays
        assert stats.by_name[name].bytes_offloaded > 0, name
    assert got[0] == ref[0]
    for n, grad in ref[1].items():
        assert torch.equal(grad, got[1][n]), n
