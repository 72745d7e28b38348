"""A tiny Llama under FSDP2 (``fully_shard``, world size 1) with offloading: gloo on the CPU,
and NCCL on a GPU where there is one (the same tests, ``device`` "cuda").

FSDP2 all-gathers each layer's parameters into fresh storages before its forward (and again
before its backward) and registers them on the modules as ``nn.Parameter``s
(``FSDPParam._unsharded_param``); none of them, nor a view of one, may be offloaded.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
fsdp = pytest.importorskip("torch.distributed.fsdp")
if not dist.is_available() or not hasattr(fsdp, "fully_shard"):
    pytest.skip("needs torch.distributed with FSDP2 (fully_shard)", allow_module_level=True)

import offload  # noqa: E402
from offload import presets  # noqa: E402
from offload.chunk_handler import ChunkOffloadHandler  # noqa: E402
from offload.testing import first_difference, free_port  # noqa: E402
from test_presets import token_ids, tiny_model  # noqa: E402

NAMES = ["qkv_linear", "core_attn", "attn_proj", "fc1", "mlp_act", "fc2"]


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.fixture(scope="module")
def process_group():
    """A one-rank process group: gloo for CPU tensors, and NCCL for CUDA tensors where CUDA is."""
    started = not dist.is_initialized()
    if started:
        port = free_port()
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    if started:
        dist.destroy_process_group()


@pytest.fixture(params=DEVICES)
def mesh(request, process_group):
    """The device mesh of the one rank, on the CPU or on the GPU."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(request.param, (1,))


def shard(model: torch.nn.Module, mesh, mixed_precision: bool = False) -> torch.nn.Module:
    """FSDP2 as usual for a transformers model: each decoder layer, then the root; with
    ``mixed_precision``, parameters all-gathered in bf16 and gradients reduced in fp32."""
    kw = {}
    if mixed_precision:
        kw["mp_policy"] = fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fsdp.fully_shard(layer, mesh=mesh, **kw)
    fsdp.fully_shard(model, mesh=mesh, **kw)
    return model


def fsdp2_step(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=False)
    model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    return {n: p.grad.full_tensor().clone() for n, p in model.named_parameters() if p.grad is not None}


def unsharded_params_admitted(model: torch.nn.Module, monkeypatch) -> list[str]:
    """Spy on the engine: the labels of groups that took a saved tensor whose storage is an
    unsharded FSDP2 parameter's (the parameter itself or any view of it) as an offload record."""
    params = [fp for m in model.modules() if isinstance(m, fsdp.FSDPModule)
              for fp in m._get_fsdp_state()._fsdp_param_group.fsdp_params]
    admitted: list[str] = []
    record_for = ChunkOffloadHandler.record_for

    def spy(self, group, t, ptr, *args):
        for fp in params:
            up = getattr(fp, "_unsharded_param", None)
            if up is not None and up.untyped_storage().nbytes() and up.untyped_storage().data_ptr() == ptr:
                admitted.append(f"{group.label}: {tuple(t.shape)} of {fp._module_info.param_name}")
        return record_for(self, group, t, ptr, *args)

    monkeypatch.setattr(ChunkOffloadHandler, "record_for", spy)
    return admitted


def run_fsdp2(configure, mesh, monkeypatch, frozen: bool, mixed_precision: bool = False) -> list[str]:
    """Train the sharded tiny Llama with and without offloading; gradients must be bitwise
    equal and something offloaded. Returns what `unsharded_params_admitted` saw."""
    device = mesh.device_type
    model = tiny_model("llama", layers=3).to(device)
    if frozen:  # LoRA-style: the projections' weights are frozen, their views saved for dgrad
        for name, p in model.named_parameters():
            if name.endswith("proj.weight"):
                p.requires_grad_(False)
    ref = shard(copy.deepcopy(model), mesh, mixed_precision)
    configure(NAMES, device=device)
    # attach before fully_shard: attach after it fails (test_attach_after_fully_shard)
    offload.attach(model, presets.mapping_for(model, NAMES))
    shard(model, mesh, mixed_precision)
    admitted = unsharded_params_admitted(model, monkeypatch)
    for it in range(2):
        ids = token_ids(it).to(device)
        assert first_difference(fsdp2_step(ref, ids), fsdp2_step(model, ids)) is None
        stats = offload.end_iteration()
        assert sum(s.bytes_offloaded for s in stats.by_name.values()) > 0
        assert stats.by_name["core_attn"].groups == 3
    return admitted


def test_fsdp2_gradients_bitwise_equal_and_no_unsharded_parameter_offloaded(configure, mesh, monkeypatch,
                                                                           deterministic):
    """Trainable parameters: the policy refuses the unsharded parameters and their views (a
    leaf that requires grad, or a view of one), whatever their storage."""
    assert run_fsdp2(configure, mesh, monkeypatch, frozen=False) == []


def test_fsdp2_frozen_unsharded_parameter_views_are_refused(configure, mesh, monkeypatch, deterministic):
    """Frozen parameters: a view of FSDP2's unsharded parameter (``weight.t()``), in a fresh
    storage that attach() never saw, is refused because its base is a parameter."""
    assert run_fsdp2(configure, mesh, monkeypatch, frozen=True) == []


def test_fsdp2_mixed_precision_gradients_bitwise_equal(configure, mesh, monkeypatch, deterministic):
    """FSDP2's mixed precision (bf16 parameters in forward and backward, fp32 reduction): the
    activations are bf16, the all-gathered bf16 parameters are refused like fp32 ones."""
    dtypes = []
    record_for = ChunkOffloadHandler.record_for

    def spy(self, group, t, *args):
        dtypes.append(t.dtype)
        return record_for(self, group, t, *args)

    monkeypatch.setattr(ChunkOffloadHandler, "record_for", spy)
    assert run_fsdp2(configure, mesh, monkeypatch, frozen=False, mixed_precision=True) == []
    assert torch.bfloat16 in dtypes


def test_attach_after_fully_shard(configure, mesh):
    """attach() after fully_shard: the DTensor parameters' local shards are blocked."""
    model = shard(tiny_model("llama").to(mesh.device_type), mesh)
    configure(NAMES, device=mesh.device_type)
    handle = offload.attach(model, presets.mapping_for(model, NAMES))
    policy = offload.get_manager().policy
    for param in model.parameters():
        assert policy.blocked(param.to_local().untyped_storage().data_ptr())
    handle.remove()  # an attached model that never runs a forward would hold back the names check
