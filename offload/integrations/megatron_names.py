"""The offload names on megatron-core layers: what each name means, where it is in a model chunk
(`find_modules`, on the local and the Transformer Engine layer specs, dense, MoE and MLA), and
the checks that refuse a name where it would offload nothing or break Megatron (`check_compatible`,
`to_megatron_names`) or warn about a setting that slows it (`warn_synchronizing_exchanges`).
`offload.integrations.megatron` attaches the groups these find; the table of names with their
meaning is in that module's docstring and docs/megatron.md."""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

from torch import nn

from offload.config import check_known, parse_module_list
from offload.errors import OffloadError
from offload.notices import say_once
from offload.regions import exact_pattern

from .megatron_graphs import check_cuda_graphs

try:
    import megatron.core as _mcore
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_layer import TransformerLayer
except ImportError as exc:  # pragma: no cover - exercised only without megatron-core
    raise ImportError(
        "offload.integrations.megatron needs megatron-core (pip install 'offload[megatron]')"
    ) from exc

__all__ = ["AUTO", "MEGATRON_OWN_NAMES", "NAMES", "ChunkModules", "check_compatible", "find_modules",
           "fuses_norm", "megatron_version", "module_patterns", "to_megatron_names", "warn_synchronizing_exchanges"]

NAMES: dict[str, str] = {
    "attn_norm": "input_layernorm: its input (the residual stream); fused into linear_qkv (TE): use qkv_linear",
    "qkv_linear": "self_attention.linear_qkv (MLA: the q/kv down and up projections): its input; "
                  "with a fused norm (TE) also the norm's input",
    "core_attn": "self_attention.core_attention: q, k, v and the attention probabilities (fused: the output)",
    "attn_proj": "self_attention.linear_proj: its input (the attention context)",
    "mlp_norm": "pre_mlp_layernorm: its input (the residual stream); fused into linear_fc1 (TE, dense): use fc1",
    "fc1": "mlp.linear_fc1 of a dense MLP: its input; with a fused norm (TE) also the norm's input",
    "mlp_act": "the dense MLP's activation (between fc1 and fc2): the fc1 output",
    "fc2": "mlp.linear_fc2 of a dense MLP: its input (the activation)",
    "router": "mlp.router of a MoE layer: its input and the routing tensors",
    "expert_fc1": "the experts' linear_fc1 (SequentialMLP or TEGroupedMLP): the routed tokens",
    "moe_act": "the experts' activation (between fc1 and fc2): the fc1 output and the probs",
    "expert_fc2": "the experts' linear_fc2: the weighted activation",
}
"""Every name this integration knows, with the module it maps to and what that saves."""

AUTO = "auto"
"""``--offload-modules=auto``: the planner chooses among `NAMES` and the layers' containers."""


MEGATRON_OWN_NAMES: frozenset[str] = frozenset(
    {"attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act"})
"""The names that Megatron's own ``--fine-grained-activation-offloading`` shares with this
integration, with the same meaning (``transformer_config.py``'s ``allowed_modules``, 0.16 and
0.19; 0.19 adds ``fused_group_mlp``, which this integration does not map)."""

# Which of Megatron's selective recompute modules make an offload name offload nothing
# (recompute wins): the region runs under no_grad, or (moe_act with moe_act) what it saves is
# the checkpoint's detached input, a leaf that requires grad, which the engine never offloads.
_RECOMPUTED_BY: dict[str, tuple[str, ...]] = {
    "core_attn": ("core_attn",),
    "attn_norm": ("layernorm",),
    "mlp_norm": ("layernorm",),
    "fc1": ("mlp",),
    "mlp_act": ("mlp",),
    "fc2": ("mlp",),
    "router": ("moe",),
    "expert_fc1": ("moe",),
    "moe_act": ("moe", "moe_act"),
    "expert_fc2": ("moe",),
}

_ACT_NAMES = ("mlp_act", "moe_act")
_MLA_QKV = ("linear_q_proj", "linear_q_down_proj", "linear_q_up_proj",
            "linear_kv_down_proj", "linear_kv_up_proj", "linear_qkv_down_proj")
_MLA_DOWN = ("linear_q_down_proj", "linear_kv_down_proj", "linear_qkv_down_proj")
_MOE_NAMES = ("router", "expert_fc1", "moe_act", "expert_fc2")
_DENSE_MLP_NAMES = ("fc1", "mlp_act", "fc2")


def megatron_version() -> tuple[int, int]:
    """megatron-core's (major, minor) version."""
    major, minor = _mcore.__version__.split(".")[:2]
    return int(major), int(minor)


# ---------------------------------------------------------------------------------- mapping
@dataclass
class ChunkModules:
    """What `find_modules` found in one model chunk.

    ``modules`` maps a name to the qualified names of its modules; ``act_regions`` maps
    ``mlp_act``/``moe_act`` to (mlp, fc1, fc2) qualified-name triples; ``absent`` says, for
    names the chunk lacks although it has transformer layers, why. ``covered`` maps a norm
    name whose norm is fused into the next linear layer (Transformer Engine) to the name of
    that layer, which offloads what the norm saves. ``sequential_experts`` lists the
    SequentialMLP modules (each one ``expert_fc1`` group); ``experts`` every MoE layer's
    experts module whose forward starts after the token dispatcher's host sync (where the
    integration calls `offload.after_host_sync`; a dispatcher that never syncs, `syncs_with_host`,
    leaves its layer out).
    """

    modules: dict[str, list[str]] = field(default_factory=dict)
    act_regions: dict[str, list[tuple[str, str, str]]] = field(default_factory=dict)
    absent: dict[str, str] = field(default_factory=dict)
    covered: dict[str, str] = field(default_factory=dict)
    sequential_experts: list[str] = field(default_factory=list)
    experts: list[str] = field(default_factory=list)
    num_layers: int = 0

    @property
    def names(self) -> set[str]:
        return {n for n, v in self.modules.items() if v} | {n for n, v in self.act_regions.items() if v}


def _real(module: Any) -> bool:
    return isinstance(module, nn.Module) and not isinstance(module, IdentityOp)


def fuses_norm(module: Any) -> bool:
    """Whether ``module`` is a linear layer with its input norm fused in: Transformer Engine's
    ``LayerNormLinear`` (megatron's ``TELayerNormColumnParallelLinear``), recognised by its
    ``layer_norm_weight`` parameter without importing Transformer Engine."""
    return _real(module) and isinstance(getattr(module, "layer_norm_weight", None), nn.Parameter)


def _op_fused(module: Any) -> bool:
    """Whether an MLP or experts module runs Transformer Engine's operation fuser, which calls
    neither ``linear_fc1`` nor ``linear_fc2`` (``TEFusedMLP``; ``TEGroupedMLP`` with
    ``use_transformer_engine_op_fuser``, megatron-core 0.19)."""
    return bool(getattr(module, "_with_fused_impl", False)) or type(module).__name__.startswith("TEFusedMLP")


def syncs_with_host(dispatcher: Any) -> bool:
    """Whether a MoE layer's token dispatcher reads the token counts on the host before the
    experts run. Every Megatron dispatcher does, but the all-to-all one that drops and pads to
    the experts' capacity (``--moe-token-dispatcher-type alltoall --moe-expert-capacity-factor F
    --moe-pad-expert-input-to-capacity``): its counts are the capacity, known on the host."""
    return not (type(dispatcher).__name__ == "MoEAlltoAllTokenDispatcher"
                and getattr(dispatcher, "drop_and_pad", False) is True)


def _describe(module: nn.Module) -> str:
    return type(module).__name__


def find_modules(chunk: nn.Module) -> ChunkModules:
    """Find the modules behind every name of `NAMES` in ``chunk`` (a model chunk, wrapped or not).

    Qualified names are relative to ``chunk`` itself, so that `offload.attach` on ``chunk``
    finds them.
    """
    found = ChunkModules()
    add = lambda name, qn: found.modules.setdefault(name, []).append(qn)  # noqa: E731
    why: dict[str, str] = {}

    def norm(layer: nn.Module, p: str, name: str, attr: str, fused: list[tuple[str, nn.Module]],
             covering: str) -> None:
        """The norm ``attr`` of ``layer`` as ``name``; where it is fused into the linear layers
        ``fused`` (relative names and modules), ``name`` is covered by ``covering``."""
        if _real(getattr(layer, attr, None)):
            add(name, p + attr)
            return
        into = [(qn, m) for qn, m in fused if fuses_norm(m)]
        if into:
            where = ", ".join(f"{qn} ({_describe(m)})" for qn, m in into)
            found.covered[name] = covering
            why[name] = (f"{attr} is an IdentityOp: the norm is fused into {where}, one Transformer "
                         f"Engine function that saves the norm's input and output together; "
                         f"--offload-modules {covering} offloads both (with {covering}, {name} is "
                         "accepted as covered by it)")
        else:
            why[name] = f"{attr} is an IdentityOp and no linear layer after it fuses a norm: there is no norm"

    for qn, layer in chunk.named_modules():
        if not isinstance(layer, TransformerLayer):
            continue
        found.num_layers += 1
        p = f"{qn}." if qn else ""
        attn = getattr(layer, "self_attention", None)
        attn = attn if _real(attn) else None
        after_norm = [(f"self_attention.{sub}", getattr(attn, sub)) for sub in ("linear_qkv", *_MLA_DOWN)
                      if attn is not None and _real(getattr(attn, sub, None))]
        norm(layer, p, "attn_norm", "input_layernorm", after_norm, "qkv_linear")
        if attn is not None:
            a = p + "self_attention."
            if _real(getattr(attn, "linear_qkv", None)):
                add("qkv_linear", a + "linear_qkv")
            for sub in _MLA_QKV:  # multi-latent attention
                if _real(getattr(attn, sub, None)):
                    add("qkv_linear", a + sub)
            if _real(getattr(attn, "core_attention", None)):
                add("core_attn", a + "core_attention")
            if _real(getattr(attn, "linear_proj", None)):
                add("attn_proj", a + "linear_proj")
        mlp = getattr(layer, "mlp", None)
        fc1 = getattr(mlp, "linear_fc1", None) if getattr(mlp, "experts", None) is None else None
        norm(layer, p, "mlp_norm", "pre_mlp_layernorm", [("mlp.linear_fc1", fc1)] if _real(fc1) else [], "fc1")
        if not _real(mlp):
            continue
        m = p + "mlp."
        experts = getattr(mlp, "experts", None)
        if experts is None:  # dense MLP
            if _op_fused(mlp):
                for name in _DENSE_MLP_NAMES + ("mlp_norm",):
                    why[name] = (f"the MLP is a {_describe(mlp)} (--use-te-op-fuser): its norm, fc1, activation "
                                 "and fc2 run as one Transformer Engine operation sequence that does not call "
                                 "linear_fc1 or linear_fc2; drop --use-te-op-fuser to offload them")
                found.covered.pop("mlp_norm", None)
            elif _real(getattr(mlp, "linear_fc1", None)) and _real(getattr(mlp, "linear_fc2", None)):
                add("fc1", m + "linear_fc1")
                add("fc2", m + "linear_fc2")
                found.act_regions.setdefault("mlp_act", []).append(
                    (p + "mlp", m + "linear_fc1", m + "linear_fc2"))
            continue
        if _real(getattr(mlp, "router", None)):
            add("router", m + "router")
        if _real(experts) and syncs_with_host(getattr(mlp, "token_dispatcher", None)):
            found.experts.append(m + "experts")
        local = getattr(experts, "local_experts", None)
        if local is not None:  # SequentialMLP: one MLP per local expert
            add("expert_fc1", m + "experts")
            found.sequential_experts.append(m + "experts")
            for i, expert in enumerate(local):
                e = f"{m}experts.local_experts.{i}."
                add("expert_fc2", e + "linear_fc2")
                found.act_regions.setdefault("moe_act", []).append(
                    (e[:-1], e + "linear_fc1", e + "linear_fc2"))
        elif _op_fused(experts):
            for name in ("expert_fc1", "moe_act", "expert_fc2"):
                why[name] = (f"the experts are a {_describe(experts)} run by Transformer Engine's operation fuser "
                             "(--use-transformer-engine-op-fuser): fc1, activation and fc2 are one fused op that "
                             "does not call linear_fc1 or linear_fc2 (Megatron's own offloading calls it "
                             "fused_group_mlp); drop the op fuser to offload them")
        elif _real(getattr(experts, "linear_fc1", None)) and _real(getattr(experts, "linear_fc2", None)):
            add("expert_fc1", m + "experts.linear_fc1")  # TEGroupedMLP
            add("expert_fc2", m + "experts.linear_fc2")
            found.act_regions.setdefault("moe_act", []).append(
                (m + "experts", m + "experts.linear_fc1", m + "experts.linear_fc2"))
        else:
            for name in ("expert_fc1", "moe_act", "expert_fc2"):
                why[name] = (f"the experts are a {_describe(experts)}, one fused op without "
                             "fc1/fc2 submodules; use SequentialMLP or TEGroupedMLP")
    for name in NAMES:
        if name not in found.names and found.num_layers:
            found.absent[name] = why.get(name, _default_absence(name))
    return found


def _default_absence(name: str) -> str:
    if name in _MOE_NAMES:
        return "no MoE layer (num_moe_experts is not set, or moe_layer_freq puts none here)"
    if name in _DENSE_MLP_NAMES:
        return "no dense MLP (every MLP is a MoE layer; use expert_fc1, moe_act, expert_fc2)"
    return "no such submodule in this model's transformer layers"


def module_patterns(targets: list[str], all_names: list[str]) -> list[str]:
    """Short fnmatch patterns that match exactly ``targets`` among ``all_names``.

    Layer and expert indices become ``*`` where that matches nothing else; otherwise the exact
    names stay. (One pattern per module would cost ``len(targets) × len(all_names)`` matches in
    `offload.attach`, which is slow for models with thousands of experts.)
    """
    wanted = set(targets)
    groups: dict[str, list[str]] = {}
    for qn in targets:
        groups.setdefault(re.sub(r"(?<=\.)\d+(?=\.|$)", "*", exact_pattern(qn)), []).append(qn)
    out: list[str] = []
    for pattern, members in groups.items():
        hits = {qn for qn in all_names if fnmatch.fnmatchcase(qn, pattern)}
        out.extend([pattern] if hits <= wanted else [exact_pattern(qn) for qn in members])
    return out


# ---------------------------------------------------------------------------- compatibility
def check_compatible(config: Any, names: Iterable[str], found: Sequence[ChunkModules] | None = None) -> None:
    """Raise `OffloadError` if ``config`` (a megatron-core ``TransformerConfig``, or Megatron-LM's
    args) switches on something that cannot work with offloading ``names``, or that makes them
    do nothing. ``found`` (`find_modules` of the model chunks) tells which norms are modules of
    their own; without it every norm is taken to be one. Warns once about pipeline exchanges
    that synchronize the device (`warn_synchronizing_exchanges`)."""
    names = list(names)
    if not names:
        return
    if getattr(config, "fine_grained_activation_offloading", False):
        raise OffloadError(
            "offload: Megatron's own fine-grained activation offloading "
            "(--fine-grained-activation-offloading) is on; it reads the same --offload-modules "
            "and hooks the same saved tensors. Switch it off to use this library's offloading."
        )
    if getattr(config, "cpu_offloading", False):
        raise OffloadError(
            "offload: Megatron's layer-level CPU offloading (--cpu-offloading) is on; it hooks "
            "the same saved tensors. Use one of the two."
        )
    check_cuda_graphs(config, names)
    _check_recompute(config, names, found)
    warn_synchronizing_exchanges(config)


def warn_synchronizing_exchanges(config: Any) -> None:
    """Warn once if ``config`` runs the interleaved pipeline schedule with batched exchanges
    followed by a device synchronize (``batch_p2p_comm`` and ``batch_p2p_sync``: megatron-core's
    config defaults, not Megatron-LM's with VPP > 1). Each synchronize waits for the offload
    and reload copies then in flight, and the GPU then waits for the host (docs/pipelines.md,
    *Exchanges that synchronize the device*). 1F1B has no other way in Megatron-LM: not warned."""
    pipeline = getattr(config, "pipeline_model_parallel_size", 1) or 1
    virtual = getattr(config, "virtual_pipeline_model_parallel_size", None) or 1
    synchronizes = getattr(config, "batch_p2p_comm", False) and getattr(config, "batch_p2p_sync", True)
    if pipeline > 1 and virtual > 1 and synchronizes:
        say_once("synchronizing_exchanges", (
            "offload: the interleaved pipeline schedule runs with batch_p2p_comm and batch_p2p_sync, so "
            "megatron-core synchronizes the device after each exchange, which waits for the offload copies "
            "in flight (on two H200s, dsv3_proxy PP=2 VPP=2: +45.6% of the step instead of +10.2%); set "
            "overlap_p2p_comm=True and batch_p2p_comm=False in the config, as Megatron-LM's training does "
            "unless --no-overlap-p2p-communication (docs/pipelines.md)"), stacklevel=3)


def _grouped_act(found: ChunkModules) -> bool:
    """Whether a ``moe_act`` region of ``found`` is a grouped experts module's (``TEGroupedMLP``,
    whose activation ``recompute_modules=["moe_act"]`` checkpoints), not a SequentialMLP expert's."""
    sequential = tuple(f"{qn}." for qn in found.sequential_experts)
    return any(not mlp.startswith(sequential) for mlp, _, _ in found.act_regions.get("moe_act", ()))


def _check_recompute(config: Any, names: list[str], found: Sequence[ChunkModules] | None) -> None:
    """Refuse names that Megatron's selective recompute leaves nothing to offload in: their
    region runs under ``no_grad`` (or, for ``moe_act``, saves only what the engine keeps)."""
    if getattr(config, "recompute_granularity", None) != "selective":
        return
    modules = getattr(config, "recompute_modules", None)
    recomputed = {"core_attn"} if modules is None else set(modules)  # megatron's default
    separate = None if found is None else set().union(*(f.names for f in found))
    clashes, leaf_note = [], False
    for name in names:
        hit = recomputed & set(_RECOMPUTED_BY.get(name, ()))
        if not hit:
            continue
        if name in ("attn_norm", "mlp_norm") and separate is not None and name not in separate:
            continue  # fused into the next linear layer: megatron recomputes only norm modules
        if hit == {"moe_act"} and found is not None and not any(_grouped_act(f) for f in found):
            continue  # SequentialMLP's experts have no activation recompute
        clashes.append(f"{name} (recompute_modules has {', '.join(sorted(hit))})")
        leaf_note |= hit == {"moe_act"}
    if clashes:
        note = ""
        if leaf_note:
            note = (" (moe_act with moe_act: the activation runs in a CheckpointWithoutOutput, which "
                    "saves the fc1 output as a detached leaf that requires grad; the engine keeps such "
                    "tensors on the GPU, so the group would offload nothing)")
        raise OffloadError(
            "offload: these regions are recomputed in backward (--recompute-granularity selective "
            f"--recompute-modules), so they save nothing to offload: {'; '.join(clashes)}{note}. "
            "Recompute wins; drop them from --offload-modules or from --recompute-modules."
        )


def to_megatron_names(names: str | Iterable[str], found: Sequence[ChunkModules] = ()) -> list[str]:
    """``names`` for Megatron's own offloading (``TransformerConfig.offload_modules`` with
    ``fine_grained_activation_offloading=True``), which must mean the same modules there.

    Raises `OffloadError` for a name Megatron's offloading does not have (`MEGATRON_OWN_NAMES`),
    and, given ``found``, for a norm fused into the next linear layer without that layer's name
    (Megatron would drop the norm silently; this integration refuses it).
    """
    names = list(parse_module_list(names))
    if AUTO in names:
        raise OffloadError(
            "offload: --offload-modules=auto is this library's planner; Megatron's own offloading "
            "(--fine-grained-activation-offloading; --system megatron in examples/megatron_gpt.py) takes "
            f"module names ({', '.join(sorted(MEGATRON_OWN_NAMES))}). Use --system offload with auto."
        )
    check_known(names, NAMES, "--offload-modules")
    other = [n for n in names if n not in MEGATRON_OWN_NAMES]
    if other:
        raise OffloadError(
            f"offload: Megatron's own offloading (--fine-grained-activation-offloading) has no "
            f"{', '.join(other)}; the names it shares with this integration are "
            f"{', '.join(sorted(MEGATRON_OWN_NAMES))}"
        )
    for name in names:
        covering = next((f.covered[name] for f in found if name in f.covered and name not in f.names), None)
        if covering is not None and covering not in names:
            reason = next(f.absent[name] for f in found if name in f.absent)
            raise OffloadError(f"offload: --offload-modules {name}: {reason}; Megatron's own offloading "
                               f"would drop {name} silently")
    return names
