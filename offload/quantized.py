"""Quantized saved tensors (Transformer Engine's ``Float8Tensor``, ``MXFP8Tensor``, ...).

A quantized tensor is a ``torch.Tensor`` subclass whose bytes live in plain inner tensors
(FP8 data, its transpose, scale inverses); the subclass object itself has no storage of its
own. The tensor policy keeps every subclass on the GPU (`offload.policy`), so without this
module a saved quantized tensor would never leave it.

How Transformer Engine saves them (TE 2.20):

* its modules (``Linear``, ``LayerNormLinear``, ``LayerNormMLP``, ``GroupedLinear``) quantize
  with *internal* quantizers, whose results are ``...TensorStorage`` objects (not tensors), and
  split them with ``prepare_for_saving`` before ``ctx.save_for_backward``: the pack hook sees
  the plain data tensors and offloads them like any other tensor, with no help from here;
* some paths save the subclass itself: FP8 attention (``DotProductAttention`` under
  ``DelayedScaling(fp8_dpa=True)``) saves its FP8 q, k, v and output as ``Float8Tensor``, and a
  ``Linear`` fed an FP8 tensor saves that tensor. TE's ``prepare_for_saving`` passes tensors
  through unchanged, so the hook gets the subclass.

For the second case the pack hook does what TE's own ``cpu_offload`` does: take a detached
copy (a new object sharing the inner tensors), split the copy with its
``prepare_for_saving()`` into plain tensors plus the emptied object, pack each plain tensor
through the normal path (so the usual policy, deduplication, lifetimes and in-place checks
apply to the bytes), and at unpack put the tensors back with ``restore_from_saved()``.

This module never imports ``transformer_engine``: a quantized tensor is recognised by its
two methods (duck typing), so any subclass with the same protocol is handled.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["QuantizedHandle", "pack_quantized", "splittable"]


def splittable(t: torch.Tensor) -> bool:
    """Whether ``t`` is a tensor subclass that splits into plain tensors for saving.

    Parameters (``nn.Parameter``, or any leaf that requires grad: FP8 weights made by
    ``quantized_model_init``) are not split: their inner tensors are held by the module, so
    copying them would free nothing.
    """
    cls = type(t)
    if cls is torch.Tensor:
        return False
    if not callable(getattr(cls, "prepare_for_saving", None)) or not callable(
        getattr(cls, "restore_from_saved", None)
    ):
        return False
    if isinstance(t, torch.nn.Parameter) or (t.requires_grad and t.is_leaf):
        return False
    return True


class QuantizedHandle:
    """What autograd holds in place of a quantized tensor: the emptied object and the
    handles of its plain tensors (each an offloaded `SavedHandle` or a kept tensor)."""

    __slots__ = ("obj", "parts", "_unpack_part")

    def __init__(self, obj: Any, parts: list[Any], unpack_part: Callable[[Any], torch.Tensor]) -> None:
        self.obj = obj
        self.parts = parts
        self._unpack_part = unpack_part

    def unpack(self) -> Any:
        tensors = [None if h is None else self._unpack_part(h) for h in self.parts]
        rest = self.obj.restore_from_saved(tensors)
        if rest:
            raise RuntimeError(
                f"offload: {type(self.obj).__name__}.restore_from_saved left {len(rest)} of the "
                f"{len(tensors)} tensors that prepare_for_saving returned"
            )
        return self.obj


def pack_quantized(
    t: torch.Tensor,
    pack_part: Callable[[torch.Tensor], Any],
    unpack_part: Callable[[Any], torch.Tensor],
) -> QuantizedHandle | None:
    """Split ``t`` (see `splittable`) and pack its plain tensors with ``pack_part``; ``None``
    if its class does not implement the split (the caller then keeps ``t`` whole)."""
    copy = t.detach()  # a new object on the same inner tensors: splitting it leaves `t` intact
    if copy is t:
        return None
    try:
        tensors, obj = copy.prepare_for_saving()
    except NotImplementedError:
        return None
    parts = [None if p is None else pack_part(p) for p in tensors]
    return QuantizedHandle(obj, parts, unpack_part)
