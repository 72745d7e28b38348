"""Offload names for Hugging Face ``transformers`` models: which modules each name means.

``mapping_for(model, "core_attn,fc1")`` detects the architecture (``model.config.model_type``)
and returns the mapping that `offload.attach` takes, with patterns over the model's own module
paths (``model.layers.*.self_attn.q_proj``; a wrapper's prefix, such as PEFT's
``base_model.model.``, is part of them). transformers is never imported here: the model and
its classes are all this module looks at.

Patterns are relative to a decoder layer; ``mapping_for`` finds the layers by their class and
puts their path in front. Where transformers has several modules for one name (separate q, k
and v projections; the gate and up projections of a SwiGLU MLP), the name matches each of
them: they run one after the other, never one inside another, so each is a group of its own
and a group never opens inside one of the same name. The input they all save is one tensor,
copied once, by the last of them (docs/hf.md).

``core_attn`` is the attention function (sdpa, eager, flash_attention_2, ...), which
transformers calls from the attention module's forward; it is no module. `mapping_for` gives
it one: a `CoreAttention` submodule ``core_attention`` in each attention module, through which
that call goes (`install_core_attention`).
"""

from __future__ import annotations

import difflib
import fnmatch
import functools
import re
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Iterable

from torch import nn

from .config import parse_module_list
from .errors import OffloadError, UnknownModuleError
from .regions import exact_pattern

__all__ = [
    "ARCHITECTURES",
    "CORE_ATTENTION",
    "NAMES",
    "Architecture",
    "CoreAttention",
    "architecture_of",
    "available",
    "checkpoint_wraps_hooks",
    "install_core_attention",
    "mapping_for",
]

NAMES: dict[str, str] = {
    "attn_norm": "the norm before attention: its input (the residual stream)",
    "qkv_linear": "the q, k and v projections (three groups per layer): their input, the normed hidden state",
    "core_attn": "the attention function (sdpa, eager, flash): q, k, v, its output; eager: the probabilities",
    "attn_proj": "the attention output projection: its input (the attention context)",
    "mlp_norm": "the norm before the MLP: its input (the residual stream)",
    "fc1": "the MLP's gate and up projections (two groups per layer): their input",
    "mlp_act": "the MLP's activation module (act_fn): the gate projection's output",
    "fc2": "the MLP's down projection: its input (the activation times the up projection)",
    "router": "the MoE router: its input and the routing probabilities",
    "experts": "the fused experts module (all experts' fc1, activation, fc2): the routed tokens and all in between",
    "layer": ("the decoder layer: under gradient checkpointing, the inputs the checkpoint keeps (the hidden "
              "states); without it, whatever it saves that no other offloaded name takes"),
}
"""Every name that some preset maps, with what it saves for backward."""

CORE_ATTENTION = "core_attention"
"""The name of the `CoreAttention` submodule installed in each attention module."""


@dataclass(frozen=True)
class Architecture:
    """One architecture's names: patterns relative to its decoder layer.

    ``layer_classes`` are the decoder layer's class names (subclasses, such as FSDP2's, match
    too); ``attention`` is the attention module's path in a layer; ``absent`` says why a name
    of `NAMES` has no module here.
    """

    layer_classes: tuple[str, ...]
    names: dict[str, tuple[str, ...]]
    attention: str = "self_attn"
    absent: dict[str, str] = field(default_factory=dict)


_ATTENTION = {
    "attn_norm": ("input_layernorm",),
    "qkv_linear": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "core_attn": (f"self_attn.{CORE_ATTENTION}",),
    "attn_proj": ("self_attn.o_proj",),
}
_DENSE_MLP = {
    "fc1": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp_act": ("mlp.act_fn",),
    "fc2": ("mlp.down_proj",),
}
_MOE = {
    "router": ("mlp.gate",),
    "experts": ("mlp.experts",),
}
_NO_MOE = dict.fromkeys(("router", "experts", "expert_fc1", "moe_act", "expert_fc2"), "a dense model: no MoE layer")
_FUSED = ("transformers fuses the experts into one module with 3-D weights (no fc1/fc2 "
          "submodules); offload 'experts'")
_FUSED_MOE = {
    "expert_fc1": _FUSED,
    "expert_fc2": _FUSED,
    "moe_act": ("the experts' act_fn runs on half of the fused fc1 output, whose other half the "
                "GLU product saves outside it: a group around act_fn alone would copy nothing; "
                "offload 'experts'"),
}


def _dense(layer: str, mlp_norm: str = "post_attention_layernorm") -> Architecture:
    return Architecture((layer,), {**_ATTENTION, "mlp_norm": (mlp_norm,), **_DENSE_MLP}, absent=dict(_NO_MOE))


def _moe(layer: str, dense_layers: bool) -> Architecture:
    names = {**_ATTENTION, "mlp_norm": ("post_attention_layernorm",), **_MOE}
    absent = dict(_FUSED_MOE)
    if dense_layers:  # only in the layers that the config makes dense (mlp_only_layers, ...)
        names.update(_DENSE_MLP)
    else:
        absent.update(dict.fromkeys(_DENSE_MLP, "every MLP is a MoE layer; offload 'experts' or 'router'"))
    return Architecture((layer,), names, absent=absent)


ARCHITECTURES: dict[str, Architecture] = {
    "llama": _dense("LlamaDecoderLayer"),
    "mistral": _dense("MistralDecoderLayer"),
    "qwen2": _dense("Qwen2DecoderLayer"),
    "qwen3": _dense("Qwen3DecoderLayer"),
    "gemma": _dense("GemmaDecoderLayer"),
    # Gemma 2 and 3 norm the attention output (post_attention_layernorm) and the MLP output
    # too; the norm before the MLP is pre_feedforward_layernorm.
    "gemma2": _dense("Gemma2DecoderLayer", mlp_norm="pre_feedforward_layernorm"),
    "gemma3_text": _dense("Gemma3DecoderLayer", mlp_norm="pre_feedforward_layernorm"),
    "gemma3": _dense("Gemma3DecoderLayer", mlp_norm="pre_feedforward_layernorm"),
    "mixtral": _moe("MixtralDecoderLayer", dense_layers=False),
    "qwen3_moe": _moe("Qwen3MoeDecoderLayer", dense_layers=True),
}
"""The supported architectures, by ``config.model_type``."""


# ------------------------------------------------------------------------------ detection
def _config_of(model: nn.Module) -> Any:
    """The first ``config`` with a ``model_type`` on ``model`` or a submodule (a wrapper such
    as DDP or PEFT holds the transformers model inside)."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if isinstance(getattr(config, "model_type", None), str):
            return config
    return None


def architecture_of(model: nn.Module) -> tuple[str, Architecture]:
    """The ``model_type`` of ``model`` and its `Architecture`; `OffloadError` if unsupported."""
    config = _config_of(model)
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        what = f"model_type {model_type!r}" if model_type else "no transformers config (config.model_type)"
        raise OffloadError(
            f"offload: no preset for {type(model).__name__} ({what}); supported model types: "
            f"{', '.join(sorted(ARCHITECTURES))}. Pass attach() a mapping of your own instead."
        )
    return model_type, ARCHITECTURES[model_type]


def _is_layer(module: nn.Module, arch: Architecture) -> bool:
    return any(cls.__name__ in arch.layer_classes for cls in type(module).__mro__)


def _layers(model: nn.Module, arch: Architecture) -> dict[str, nn.Module]:
    """The decoder layers of ``model`` by qualified name."""
    return {qn: m for qn, m in model.named_modules() if qn and _is_layer(m, arch)}


def _layer_prefixes(layer_names: Iterable[str]) -> list[str]:
    """``model.layers.0``, ``model.layers.1`` → ``model.layers.*`` (layer indices become ``*``)."""
    out: list[str] = []
    for qn in layer_names:
        prefix = re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", exact_pattern(qn))
        if prefix not in out:
            out.append(prefix)
    return out


def _resolve(model: nn.Module) -> tuple[str, Architecture, dict[str, nn.Module], dict[str, list[str]], dict[str, str]]:
    """(model_type, architecture, layers, patterns of every name the model has, why the others are absent)."""
    model_type, arch = architecture_of(model)
    layers = _layers(model, arch)
    if not layers:
        raise OffloadError(
            f"offload: {type(model).__name__} ({model_type}) has no {' or '.join(arch.layer_classes)}; "
            "is it the transformers model (or a wrapper around it)?"
        )
    prefixes = _layer_prefixes(layers)
    qualnames = [qn for qn, _ in model.named_modules() if qn]
    have: dict[str, list[str]] = {}
    absent = {n: arch.absent.get(n, "no such module in this architecture")
              for n in [*NAMES, *arch.absent] if n not in arch.names}
    for name, suffixes in arch.names.items():
        patterns = [f"{p}.{s}" for p in prefixes for s in suffixes]
        if name == "core_attn":  # its module is installed on demand: look for the attention module
            found = all(_attention_of(layer, arch) is not None for layer in layers.values())
        else:
            patterns = [p for p in patterns if any(fnmatch.fnmatchcase(qn, p) for qn in qualnames)]
            found = bool(patterns)
        if found:
            have[name] = patterns
        else:
            absent[name] = arch.absent.get(name, f"no {' or '.join(suffixes)} in this model's layers")
    have["layer"] = [exact_pattern(qn) for qn in layers]  # each layer by its own path: a '*' would match inside it
    return model_type, arch, layers, have, absent


def available(model: nn.Module) -> dict[str, list[str]]:
    """Every name ``model`` has, with its module patterns (``core_attn``'s module exists once
    `mapping_for` or `install_core_attention` installed it)."""
    return _resolve(model)[3]


def mapping_for(model: nn.Module, names: str | Iterable[str]) -> dict[str, list[str]]:
    """The ``attach`` mapping for ``names`` (``"core_attn,fc1"``, ``"core_attn fc1"`` or a list)
    in ``model``, a transformers model of a supported architecture (`ARCHITECTURES`).

    With ``core_attn``, installs the `CoreAttention` modules first (`install_core_attention`).
    Raises `OffloadError` for an unsupported architecture (listing the supported ones) and
    `UnknownModuleError` for a name the model lacks (saying why, and listing the names it has).
    """
    names = parse_module_list(names)
    model_type, arch, layers, have, absent = _resolve(model)
    missing = [n for n in names if n not in have]
    if missing:
        lines = []
        for n in missing:
            if n in absent:
                lines.append(f"{n!r}: {absent[n]}")
            else:
                close = difflib.get_close_matches(n, list(have), n=1)
                lines.append(f"{n!r}: not an offload name" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise UnknownModuleError(
            f"offload: {type(model).__name__} ({model_type}) has no module for {'; '.join(lines)}. "
            f"Names it has: {', '.join(have)}"
        )
    if "layer" in names:
        _check_layer_outside_checkpoint(model, layers)
    if "core_attn" in names:
        install_core_attention(model)
    return {n: list(have[n]) for n in names}


def checkpoint_wraps_hooks(layer: nn.Module | type) -> bool:
    """Whether transformers' gradient checkpointing runs this layer's (or layer class's) hooks
    inside the checkpoint: before transformers 5.23, ``GradientCheckpointingLayer`` checkpoints
    ``__call__`` (hooks included), from 5.23 on only ``forward``."""
    mro = (layer if isinstance(layer, type) else type(layer)).__mro__
    return any(cls.__name__ == "GradientCheckpointingLayer" and "__call__" in vars(cls) for cls in mro)


def _check_layer_outside_checkpoint(model: nn.Module, layers: dict[str, nn.Module]) -> None:
    """``layer`` offloads the inputs a checkpointed layer keeps only if its group is open when
    the checkpoint saves them, which is before the layer's hooks run where `checkpoint_wraps_hooks`."""
    for qn, layer in layers.items():
        if getattr(layer, "gradient_checkpointing", False) and checkpoint_wraps_hooks(layer):
            version = getattr(sys.modules.get("transformers"), "__version__", "older")
            raise OffloadError(
                f"offload: 'layer' under gradient checkpointing needs transformers >= 5.23 (this is "
                f"{version}): before it, checkpointing wraps {qn}'s hooks, so the inputs it "
                "keeps are saved before the group opens and nothing would be offloaded. Upgrade "
                "transformers, or offload 'layer' without gradient checkpointing"
            )


# -------------------------------------------------------------------------- core attention
class CoreAttention(nn.Module):
    """The attention function that transformers calls from an attention module's forward,
    as a module: ``attach`` can make it a group, whose inputs are q, k and v.

    Installed as ``<attention>.core_attention``; it has no parameters, so state dicts, FSDP and
    PEFT do not see it. Its forward calls ``fn(attention_module, *args, **kwargs)`` unchanged.
    """

    def __init__(self) -> None:
        super().__init__()
        self.running = False  # inside fn: a nested dispatch (sdpa falling back to eager) goes straight through
        self.ran = False  # since the attention module's forward began

    def forward(self, fn: Callable[..., Any], attention: nn.Module, *args: Any, **kwargs: Any) -> Any:
        self.running = self.ran = True
        try:
            return fn(attention, *args, **kwargs)
        finally:
            self.running = False


_ROUTED = "__offload_core_attention__"


@functools.lru_cache(maxsize=None)
def _routed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (an attention function) that goes through the calling module's `CoreAttention`
    when it has one, and runs unchanged otherwise."""
    if getattr(fn, _ROUTED, False):
        return fn

    @functools.wraps(fn)
    def call(module: Any, *args: Any, **kwargs: Any) -> Any:
        core = module._modules.get(CORE_ATTENTION) if isinstance(module, nn.Module) else None
        if isinstance(core, CoreAttention) and not core.running:
            return core(fn, module, *args, **kwargs)
        return fn(module, *args, **kwargs)

    setattr(call, _ROUTED, True)
    return call


@functools.lru_cache(maxsize=None)
def _routed_interface_class(base: type) -> type:
    """A subclass of transformers' ``AttentionInterface`` (``base``) whose functions are `_routed`."""

    def __getitem__(self: Any, key: str) -> Any:
        return _routed(base.__getitem__(self, key))

    def get_interface(self: Any, attn_implementation: str, default: Callable[..., Any]) -> Any:
        return _routed(base.get_interface(self, attn_implementation, default))

    methods = {"__getitem__": __getitem__, _ROUTED: True}
    if hasattr(base, "get_interface"):  # newer transformers; older ones index the mapping in forward
        methods["get_interface"] = get_interface
    return type(f"Routed{base.__name__}", (base,), methods)


def _route_modeling_module(module: ModuleType) -> None:
    """Route the attention functions that ``module`` (a ``modeling_*.py``) looks up at call
    time: its ``ALL_ATTENTION_FUNCTIONS`` and its ``eager_attention_forward``. Models without a
    `CoreAttention` run exactly as before."""
    interface = module.ALL_ATTENTION_FUNCTIONS
    if not getattr(type(interface), _ROUTED, False):
        routed = object.__new__(_routed_interface_class(type(interface)))
        routed.__dict__.update(interface.__dict__)  # the same local mapping object: later registrations show
        module.ALL_ATTENTION_FUNCTIONS = routed
    eager = getattr(module, "eager_attention_forward", None)
    if callable(eager):
        module.eager_attention_forward = _routed(eager)


def _attention_of(layer: nn.Module, arch: Architecture) -> nn.Module | None:
    try:
        return layer.get_submodule(arch.attention)
    except AttributeError:
        return None


def _check_ran(attention: nn.Module, args: tuple, output: Any) -> None:
    if not attention._modules[CORE_ATTENTION].ran:
        raise OffloadError(
            f"offload: {type(attention).__name__}.forward did not call its attention function through "
            f"{CORE_ATTENTION}; this transformers version dispatches attention differently, so core_attn "
            "would offload nothing. Drop core_attn, or report the transformers version."
        )


def _reset_ran(attention: nn.Module, args: tuple) -> None:
    attention._modules[CORE_ATTENTION].ran = False


def install_core_attention(model: nn.Module) -> list[str]:
    """Give every attention module of ``model`` a `CoreAttention` submodule ``core_attention``
    and route its attention function through it; returns their qualified names.

    Idempotent. The routing replaces ``ALL_ATTENTION_FUNCTIONS`` and ``eager_attention_forward``
    in the architecture's ``modeling_*.py`` with wrappers that call the original function
    directly for any module without a `CoreAttention`, so other models are unaffected. The
    attention module checks after each forward that the call went through its core attention.
    """
    model_type, arch = architecture_of(model)
    installed = []
    for qn, layer in _layers(model, arch).items():
        attention = _attention_of(layer, arch)
        if attention is None:
            raise OffloadError(f"offload: decoder layer {qn!r} has no attention module {arch.attention!r}")
        existing = attention._modules.get(CORE_ATTENTION)
        if existing is None:
            if hasattr(attention, CORE_ATTENTION):
                raise OffloadError(
                    f"offload: {type(attention).__name__} already has an attribute {CORE_ATTENTION!r}"
                )
            modeling = [sys.modules.get(cls.__module__) for cls in type(attention).__mro__]
            modeling = [m for m in modeling if hasattr(m, "ALL_ATTENTION_FUNCTIONS")]
            if not modeling:
                raise OffloadError(
                    f"offload: core_attn is not supported for {type(attention).__name__} ({model_type}): its "
                    "module does not look up its attention function in transformers' ALL_ATTENTION_FUNCTIONS"
                )
            _route_modeling_module(modeling[0])
            attention.add_module(CORE_ATTENTION, CoreAttention())
            attention.register_forward_pre_hook(_reset_ran)
            attention.register_forward_hook(_check_ran)
        elif not isinstance(existing, CoreAttention):
            raise OffloadError(f"offload: {type(attention).__name__}.{CORE_ATTENTION} is not a CoreAttention")
        installed.append(f"{qn}.{arch.attention}.{CORE_ATTENTION}")
    return installed
