"""Stand-ins for megatron-core's Transformer Engine modules, for the CPU tests.

Transformer Engine does not install on the CPU machine, so these classes mimic what the
integration looks at: the class names and the attribute structure of megatron-core's TE layer
spec (``get_gpt_layer_with_transformer_engine_spec``):

* `TELayerNormColumnParallelLinear`: a column-parallel linear layer with its input norm fused
  in, holding the norm's ``layer_norm_weight``/``layer_norm_bias`` parameters as TE's
  ``LayerNormLinear`` does; ``input_layernorm`` (attention) and ``pre_mlp_layernorm`` (dense
  MLP) are then ``IdentityOp``.
* `TEDotProductAttention`: causal attention in one call, as TE's fused attention is one
  autograd function (it also takes MLA's different q/k and v head sizes).
* `TEColumnParallelGroupedLinear` / `TERowParallelGroupedLinear`: grouped GEMMs with
  ``weight0..weightN`` parameters and the ``(input, m_splits)`` call that megatron-core's real
  ``TEGroupedMLP`` makes, saving the per-expert input splits as TE's autograd function does; with them the real ``TEGroupedMLP`` runs on the CPU, its
  ``moe_act`` recompute (``CheckpointWithoutOutput``) included.
* `TEFusedMLP`: a dense MLP whose forward does not call its fc1/fc2 submodules, as
  Transformer Engine's operation fuser does.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.moe.experts import TEGroupedMLP
from megatron.core.transformer.spec_utils import ModuleSpec

VOCAB, SEQ = 128, 16


class TELayerNormColumnParallelLinear(ColumnParallelLinear):
    """LayerNorm + column-parallel linear in one module (TE's ``LayerNormLinear``)."""

    def __init__(self, input_size: int, output_size: int, **kwargs: Any) -> None:
        super().__init__(input_size, output_size, **kwargs)
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size))
        self.layer_norm_bias = torch.nn.Parameter(torch.zeros(input_size))

    def forward(self, x: torch.Tensor) -> Any:
        return super().forward(F.layer_norm(x, x.shape[-1:], self.layer_norm_weight, self.layer_norm_bias))


class TEDotProductAttention(torch.nn.Module):
    """Causal attention in one call (TE's fused attention), with the constructor arguments
    megatron passes to ``TEDotProductAttention``, MLA's ``k_channels``/``v_channels`` included."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 k_channels: int | None = None, v_channels: int | None = None, **kwargs: Any) -> None:
        super().__init__()
        self.softmax_scale = softmax_scale

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, d] -> [b, n, s, d]
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.softmax_scale)
        return out.permute(2, 0, 1, 3).flatten(2)  # [s, b, n * d_v]


class _TEGroupedLinear(torch.nn.Module):
    """All local experts' linear layers as one grouped GEMM (``forward(x, m_splits)``)."""

    def __init__(self, num_gemms: int, input_size: int, output_size: int, *, config: Any, init_method: Any,
                 bias: bool, skip_bias_add: bool, is_expert: bool, tp_comm_buffer_name: str,
                 pg_collection: Any = None, **kwargs: Any) -> None:
        super().__init__()
        self.num_gemms = num_gemms
        for i in range(num_gemms):
            weight = torch.empty(output_size, input_size)
            init_method(weight)
            self.register_parameter(f"weight{i}", torch.nn.Parameter(weight))

    def forward(self, x: torch.Tensor, m_splits: list[int]) -> tuple[torch.Tensor, None]:
        weights = [getattr(self, f"weight{i}") for i in range(self.num_gemms)]
        return _GroupedGemm.apply(x, m_splits, *weights), None


class _GroupedGemm(torch.autograd.Function):
    """TE's ``_GroupedLinear``: splits the input inside its forward (autograd off) and saves
    the per-expert parts, views that read as leaves requiring grad; writes the output into a
    buffer it allocates and returns a view of it, whose base is that buffer, a leaf."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, m_splits: list[int], *weights: torch.Tensor) -> torch.Tensor:
        parts = torch.split(x, m_splits)
        ctx.m_splits = m_splits
        ctx.save_for_backward(*parts, *weights)
        out = torch.empty(x.shape[0], weights[0].shape[0], dtype=x.dtype, device=x.device)
        torch.cat([p @ w.t() for p, w in zip(parts, weights)], out=out)
        return out.view(-1, out.shape[-1])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        saved = ctx.saved_tensors
        parts, weights = saved[:len(ctx.m_splits)], saved[len(ctx.m_splits):]
        grads = torch.split(grad, ctx.m_splits)
        dx = torch.cat([g @ w for g, w in zip(grads, weights)])
        return (dx, None, *(g.t() @ p for g, p in zip(grads, parts)))


class TEColumnParallelGroupedLinear(_TEGroupedLinear):
    """The experts' fc1."""


class TERowParallelGroupedLinear(_TEGroupedLinear):
    """The experts' fc2."""


class TEFusedMLP(MLP):
    """A dense MLP computed as one fused sequence: its fc1/fc2 modules are never called."""

    def forward(self, hidden_states: torch.Tensor, **kwargs: Any) -> tuple[torch.Tensor, None]:
        fc1 = self.linear_fc1
        x = F.layer_norm(hidden_states, hidden_states.shape[-1:], fc1.layer_norm_weight, fc1.layer_norm_bias)
        x = F.gelu(F.linear(x, fc1.weight, fc1.bias))
        return F.linear(x, self.linear_fc2.weight), self.linear_fc2.bias


def te_like_spec(num_experts: int | None = None, fused_mlp: bool = False) -> ModuleSpec:
    """The local layer spec rebuilt the way the TE spec is: fused attention norm (and fused
    MLP norm in dense layers), TE attention, ``TEGroupedMLP`` experts."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    spec = get_gpt_layer_local_spec(num_experts=num_experts)
    sub = spec.submodules
    sub.input_layernorm = IdentityOp
    sub.self_attention.submodules.linear_qkv = TELayerNormColumnParallelLinear
    sub.self_attention.submodules.core_attention = TEDotProductAttention
    if num_experts:
        sub.mlp.submodules.experts = ModuleSpec(module=TEGroupedMLP, submodules=MLPSubmodules(
            linear_fc1=TEColumnParallelGroupedLinear, linear_fc2=TERowParallelGroupedLinear))
    else:
        sub.pre_mlp_layernorm = IdentityOp
        sub.mlp.submodules.linear_fc1 = TELayerNormColumnParallelLinear
        if fused_mlp:
            sub.mlp.module = TEFusedMLP
    return spec


def build_te_like(moe: bool = False, layers: int = 2, seed: int = 0, fused_mlp: bool = False, **overrides: Any):
    """A tiny GPTModel with the TE-like spec (MoE: 4 grouped experts, top-2, no biases)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    kw: dict[str, Any] = dict(num_layers=layers, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                              hidden_dropout=0.0, attention_dropout=0.0)
    if moe:
        kw.update(num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=48, moe_grouped_gemm=True,
                  moe_token_dispatcher_type="allgather", add_bias_linear=False)
    kw.update(overrides)
    config = TransformerConfig(**kw)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return GPTModel(config, te_like_spec(config.num_moe_experts, fused_mlp), vocab_size=VOCAB,
                        max_sequence_length=SEQ)
