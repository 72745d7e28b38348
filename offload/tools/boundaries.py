"""Where each named module's forward and backward begin and end, as callbacks.

The profiler times the regions between these boundaries and the memory tool attributes
allocations to them. Forward boundaries are forward pre- and post-hooks. Backward boundaries
are tensor hooks, which change nothing in the graph: the gradient of the module's output
arrives (its backward begins), and the gradients of all its inputs that require grad exist
(its backward is over). A module without inputs that require grad has no backward end.

Instances are numbered per name in forward order (instance ``i`` of ``fc1`` is usually
layer ``i``); ``reset()`` starts the numbering again for a new step.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable

import torch
from torch import nn

Callback = Callable[[str, int, str, str], None]
"""``callback(name, instance, phase, edge)`` with phase ``fwd``/``bwd`` and edge ``begin``/``end``."""
TensorCallback = Callable[[str, int, str, list], None]
"""``on_tensors(name, instance, "inputs" or "outputs", tensors)``, at the forward boundaries."""


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def match_modules(model: nn.Module, mapping: dict[str, str]) -> list[tuple[str, str, nn.Module]]:
    """``(name, qualified module name, module)`` for every module a pattern of ``mapping`` matches;
    raises ``ValueError`` naming the patterns that match nothing."""
    found: list[tuple[str, str, nn.Module]] = []
    unmatched = set(mapping)
    for qn, module in model.named_modules():
        for name, pattern in mapping.items():
            if qn and fnmatch.fnmatchcase(qn, pattern):
                found.append((name, qn, module))
                unmatched.discard(name)
    if unmatched:
        raise ValueError(f"no module matches {', '.join(f'{n}={mapping[n]!r}' for n in sorted(unmatched))}")
    return found


class Boundaries:
    """Installs the hooks on the modules of ``mapping`` and calls ``callback`` at each boundary;
    also at the model's own forward (name ``""``, instance 0), which marks the phases."""

    def __init__(self, model: nn.Module, mapping: dict[str, str], callback: Callback,
                 on_tensors: TensorCallback | None = None) -> None:
        self.callback = callback
        self.on_tensors = on_tensors
        self.counts: dict[str, int] = {}
        self.close_order: list[tuple[str, int]] = []
        self._handles: list[Any] = []
        self._stack: list[tuple[str, int]] = []
        for name, _, module in match_modules(model, mapping):
            self._install(module, name)
        self._install(model, "")

    def reset(self) -> None:
        """A new step: number instances from 0 again."""
        self.counts.clear()
        self.close_order.clear()
        self._stack.clear()

    def remove(self) -> None:
        """Take every hook away."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _install(self, module: nn.Module, name: str) -> None:
        def pre(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            i = self.counts.get(name, 0)
            self.counts[name] = i + 1
            self._stack.append((name, i))
            tensors = _tensors((args, kwargs))
            if self.on_tensors is not None:
                self.on_tensors(name, i, "inputs", tensors)
            inputs = [t for t in tensors if t.requires_grad]
            if inputs and torch.is_grad_enabled():
                pending = [len(inputs)]

                def input_grad(_: torch.Tensor) -> None:
                    pending[0] -= 1
                    if pending[0] == 0:
                        self.callback(name, i, "bwd", "end")

                for t in inputs:
                    t.register_hook(input_grad)
            self.callback(name, i, "fwd", "begin")

        def post(mod: nn.Module, args: tuple, output: Any) -> None:
            name_, i = self._stack.pop()
            self.callback(name_, i, "fwd", "end")
            self.close_order.append((name_, i))
            tensors = _tensors(output)
            if self.on_tensors is not None:
                self.on_tensors(name_, i, "outputs", tensors)
            outputs = [t for t in tensors if t.requires_grad]
            if outputs and torch.is_grad_enabled():
                fired = [False]

                def output_grad(_: torch.Tensor) -> None:
                    if not fired[0]:
                        fired[0] = True
                        self.callback(name_, i, "bwd", "begin")

                for t in outputs:
                    t.register_hook(output_grad)

        self._handles.append(module.register_forward_pre_hook(pre, with_kwargs=True))
        self._handles.append(module.register_forward_hook(post))
