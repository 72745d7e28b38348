"""Which saved tensors may leave the GPU.

A saved tensor is offloaded only if all of these hold:

* it is a plain dense tensor (``type(t) is torch.Tensor``, strided layout): parameters
  (``nn.Parameter``), fake/functional tensors and tensor subclasses stay (a quantized
  subclass such as TE's ``Float8Tensor`` is split into its plain tensors before this test:
  `offload.quantized`);
* it lives on the engine's device;
* the storage it keeps alive holds at least ``min_tensor_bytes``: a small view of a large
  storage (one expert's few rows of a grouped GEMM's input) is judged by the storage, since
  keeping the view on the GPU keeps all of the storage there, and with it every other record
  of that storage (their copies would free nothing);
* it is not a leaf that requires grad (a parameter, a user input, or the detached inputs a
  recompute saves, as megatron's ``CheckpointWithoutOutput`` does): autograd's saved
  variable keeps such a leaf itself, hooks or not, so offloading would copy bytes and free
  nothing; nor a view of one (``weight.t()``
  saved by ``addmm`` is a view of the weight, not an ``nn.Parameter``);
* its storage is not marked never-offload and is not the storage of a registered
  parameter (this catches parameter views made without autograd, e.g. under ``no_grad``).

Storages are compared by address. An address is only meaningful while the storage lives,
so every mark keeps a weak reference and is dropped once its tensor is gone.
"""

from __future__ import annotations

import weakref
from typing import Callable, Iterable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


class TensorPolicy:
    """The eligibility test run by the pack hook on every saved tensor."""

    def __init__(self, owns: Callable[[torch.Tensor], bool], min_tensor_bytes: int) -> None:
        self._owns = owns
        self.min_tensor_bytes = min_tensor_bytes
        self._blocked: dict[int, weakref.ref] = {}
        self.never_offload_depth = 0  # `offload.never_offload` regions open: nothing is eligible
        self.below_min = [0, 0]  # tensors, and their storages' bytes, refused for size, ever (`offload.notices`)

    def block_storage_of(self, tensor: torch.Tensor) -> None:
        """Never offload ``tensor``'s storage (any view of it) while the tensor lives. A wrapper
        subclass (FSDP2's ``DTensor`` parameters, quantized tensors) has no storage of its own:
        the storages of its inner tensors are blocked instead."""
        if is_traceable_wrapper_subclass(tensor):
            names, _ = tensor.__tensor_flatten__()
            for name in names:
                inner = getattr(tensor, name)
                if isinstance(inner, torch.Tensor):
                    self.block_storage_of(inner)
            return
        ptr = tensor.untyped_storage().data_ptr()
        if ptr:
            self._blocked[ptr] = weakref.ref(tensor)

    def block_parameters(self, params: Iterable[torch.Tensor]) -> None:
        for p in params:
            self.block_storage_of(p)

    def refresh(self) -> None:
        """Drop marks whose tensor is gone or whose storage moved (``model.to(...)``)."""
        for ptr, ref in list(self._blocked.items()):
            t = ref()
            if t is None or t.untyped_storage().data_ptr() != ptr:
                del self._blocked[ptr]
                if t is not None:
                    self.block_storage_of(t)

    def admits(self, t: torch.Tensor) -> bool:
        """The whole test for one tensor (the pack hook runs its two parts with values it
        has already computed)."""
        if type(t) is not torch.Tensor or t.layout is not torch.strided:
            return False
        storage = t.untyped_storage()
        return self.eligible(t, storage.nbytes()) and not self.blocked(storage.data_ptr())

    def eligible(self, t: torch.Tensor, storage_bytes: int) -> bool:
        """Every test but the storage mark's, for a plain dense tensor (the callers checked its
        type and layout): ``t``, whose storage holds ``storage_bytes``, is on our device, large
        enough, and neither a leaf that requires grad nor a view of one or of a parameter (a
        frozen one, or FSDP2's unsharded parameters, fresh storages every step).
        A view made without autograd of an activation (``torch.split`` inside a custom
        Function's forward, as Transformer Engine's ``GroupedLinear`` saves its per-expert
        inputs) reads as a leaf that requires grad, but its storage is the activation's. A
        custom Function's output that is a view of a buffer its forward allocated (TE's
        ``GroupedLinear`` returns its output so) has that buffer, a leaf that does not require
        grad, as its base: the output and views of it (the two halves of a GLU's input) are
        activations too; only a view that is itself a leaf requiring grad, whose base is a
        leaf, is refused (``buffer.view(...).requires_grad_()``)."""
        if storage_bytes < self.min_tensor_bytes:
            below = self.below_min
            below[0] += 1
            below[1] += storage_bytes
            return False
        if not self._owns(t):
            return False
        base = t._base
        if base is None:
            return not (t.requires_grad and t.is_leaf)
        return not (base.is_leaf and (base.requires_grad or t.requires_grad and t.is_leaf)
                    or isinstance(base, torch.nn.Parameter))

    def blocked(self, ptr: int) -> bool:
        """Whether the storage at address ``ptr`` is marked never-offload (or a parameter's)."""
        if not self._blocked:
            return False
        ref = self._blocked.get(ptr)
        return ref is not None and ref() is not None
