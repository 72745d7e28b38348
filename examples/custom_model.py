"""Offloading in a model of your own: region API, attach, never-offload, statistics.

    python examples/custom_model.py            # GPU if there is one, else the CPU fallback

A small attention + MLP block written without any framework. The attention core is marked
with ``offload.group`` inside its forward (passing its inputs, so backward can prefetch the
layer below); the MLP's first linear layer is attached by path, without touching its code;
the output head is kept on the device with ``offload.never_offload``. The script checks that
the gradients are bitwise those of the same model without offloading.
"""

from __future__ import annotations

import copy
import os
import warnings

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import offload  # noqa: E402


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        with offload.group("core_attn", q, k, v) as (q, k, v):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            out = out.transpose(1, 2).reshape(b, s, d)
        return self.proj(out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(x)
        return x + self.down(F.gelu(self.up(x)))


class Model(nn.Module):
    def __init__(self, dim: int = 128, heads: int = 4, layers: int = 4, vocab: int = 512) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        with offload.never_offload():  # logits are large and needed right away
            return self.head(x)


def step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=False)
    logits = model(x)
    F.cross_entropy(logits.flatten(0, 1).float(), target.flatten()).backward()
    return [p.grad.clone() for p in model.parameters()]


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = Model().to(device)
    reference = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the CPU fallback's notice
        offload.configure("core_attn,mlp_up", min_tensor_bytes=0 if device == "cpu" else 1 << 16)
    offload.attach(model, {"mlp_up": "blocks.*.up"})  # core_attn is marked in the code above
    for it in range(3):
        x = torch.randn(2, 256, 128, device=device)
        target = torch.randint(0, 512, (2, 256), device=device)
        expected = step(reference, x, target)
        got = step(model, x, target)
        stats = offload.end_iteration()
        same = all(torch.equal(a, b) for a, b in zip(expected, got))
        moved = {name: s.bytes_offloaded for name, s in stats.by_name.items()}
        print(f"step {it}: gradients bitwise equal: {same}; bytes offloaded per name: {moved}")
        if not same:
            raise SystemExit(1)


if __name__ == "__main__":
    main()
