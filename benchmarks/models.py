"""Models for the peer benchmark (`benchmarks/peers.py`): the GPT layer stack of
`offload.testing` and a mixture-of-experts (MoE) layer stack, built directly on the device.

`MoELayerStack` has the GPT stack's attention (same module names) and, instead of the MLP, a
token-choice MoE block: a linear router, top-k of a softmax, one dropless dispatch per layer
(tokens sorted by expert; one host sync for the per-expert counts, as Megatron's
``SequentialMLP`` does), and experts that are separate ``linear_fc1`` / ``activation`` /
``linear_fc2`` modules. Each expert gets its tokens with ``index_select`` (a tensor of its
own, so offloading one expert frees its bytes) and adds its weighted output back with
``index_add_``. `MOE_MAPPING` gives the offload names (``expert_fc1``, ``moe_act``,
``expert_fc2``, ``router`` and the attention names of `offload.testing.GPT_MAPPING`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from offload.testing import GPT_MAPPING, MLP, GPTLayerStack, LIGHT_MODULES, SelfAttention

MOE_MAPPING: dict[str, str] = {
    "attn_norm": "layers.*.input_layernorm",
    "qkv_linear": "layers.*.self_attention.linear_qkv",
    "core_attn": "layers.*.self_attention.core_attention",
    "attn_proj": "layers.*.self_attention.linear_proj",
    "mlp_norm": "layers.*.pre_mlp_layernorm",
    "router": "layers.*.mlp.router",
    "expert_fc1": "layers.*.mlp.experts.*.linear_fc1",
    "moe_act": "layers.*.mlp.experts.*.activation",
    "expert_fc2": "layers.*.mlp.experts.*.linear_fc2",
}

MOE_LIGHT_MODULES = ("layers.*.input_layernorm", "layers.*.pre_mlp_layernorm", "layers.*.mlp.experts.*.activation")
"""The cheap modules of a `MoELayerStack` layer (norms and the experts' activation), as
`offload.testing.LIGHT_MODULES` are for the GPT stack."""


class MoE(nn.Module):
    """Top-k token-choice routing over ``experts`` separate experts, without token dropping."""

    def __init__(self, hidden: int, ffn: int, experts: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k must be in [1, experts], got {top_k} of {experts}")
        self.top_k = top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(MLP(hidden, ffn) for _ in range(experts))  # linear_fc2(gelu(linear_fc1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs = torch.softmax(self.router(flat), dim=-1, dtype=torch.float32)
        weight, expert = probs.topk(self.top_k, dim=-1)  # [tokens, k]
        weight = (weight / weight.sum(dim=-1, keepdim=True)).to(x.dtype)
        expert = expert.reshape(-1)
        order = expert.argsort(stable=True)  # routed slots grouped by expert
        counts = torch.bincount(expert, minlength=len(self.experts)).tolist()  # one host sync
        token = order // self.top_k
        slot_weight = weight.reshape(-1).index_select(0, order)
        out = torch.zeros_like(flat)
        for e, (idx, w) in enumerate(zip(token.split(counts), slot_weight.split(counts))):
            if idx.numel() == 0:
                continue
            y = self.experts[e](flat.index_select(0, idx))
            out.index_add_(0, idx, y * w.unsqueeze(-1))
        return out.view(shape)


class MoELayer(nn.Module):
    def __init__(self, hidden: int, heads: int, ffn: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(hidden)
        self.self_attention = SelfAttention(hidden, heads)
        self.pre_mlp_layernorm = nn.LayerNorm(hidden)
        self.mlp = MoE(hidden, ffn, experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attention(self.input_layernorm(x))
        return x + self.mlp(self.pre_mlp_layernorm(x))


class MoELayerStack(nn.Module):
    """``layers`` MoE decoder layers on ``[seq, batch, hidden]`` activations, plus a final norm."""

    def __init__(self, hidden: int, heads: int, layers: int, ffn: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MoELayer(hidden, heads, ffn, experts, top_k) for _ in range(layers))
        self.final_layernorm = nn.LayerNorm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.final_layernorm(x)


@dataclass(frozen=True)
class ModelSpec:
    """One model at one size. ``experts == 0`` is the dense GPT stack (``ffn`` 0: 4 x hidden)."""

    name: str
    hidden: int
    heads: int
    layers: int
    seq: int
    batch: int = 1
    ffn: int = 0
    experts: int = 0
    top_k: int = 2

    @property
    def family(self) -> str:
        return "moe" if self.experts else "gpt"

    @property
    def mapping(self) -> dict[str, str]:
        return MOE_MAPPING if self.experts else GPT_MAPPING

    @property
    def light_modules(self) -> tuple[str, ...]:
        return MOE_LIGHT_MODULES if self.experts else LIGHT_MODULES

    def as_dict(self) -> dict:
        d = asdict(self)
        d["family"] = self.family
        d["ffn"] = self.ffn or 4 * self.hidden
        return d

    def describe(self) -> str:
        text = f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads, seq {self.seq}, batch {self.batch}"
        if self.experts:
            text += f", {self.experts} experts top-{self.top_k}, expert FFN {self.ffn or 4 * self.hidden}"
        else:
            text += f", FFN {self.ffn or 4 * self.hidden}"
        return text


def build(spec: ModelSpec, dtype: torch.dtype, device: str | torch.device, seed: int = 0) -> nn.Module:
    """The model of ``spec``, initialized from ``seed`` directly on ``device`` (no host copy of
    the weights: a large stack builds in well under a second on a GPU)."""
    torch.manual_seed(seed)
    with torch.device(device):
        if spec.experts:
            model: nn.Module = MoELayerStack(spec.hidden, spec.heads, spec.layers, spec.ffn or 4 * spec.hidden,
                                             spec.experts, spec.top_k)
        else:
            model = GPTLayerStack(spec.hidden, spec.heads, spec.layers, spec.ffn or None)
    return model.to(dtype=dtype)
