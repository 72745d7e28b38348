"""The ``--offload-*`` flags of the Megatron integration: `add_arguments` (Megatron's
``extra_args_provider``), their parsed form (`Options`, `parse_policy`) and the checks of
``--offload-modules=auto`` with its memory budget (`check_auto_options`)."""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from typing import Any, Iterable

from offload import group_policy
from offload.config import DEFAULT_MIN_TENSOR_BYTES, check_known, parse_module_list
from offload.errors import OffloadError, OffloadValueError
from offload.planner.budget import Budget

from .megatron_names import AUTO, NAMES

__all__ = ["Options", "add_arguments", "check_auto_options", "parse_policy"]


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the offload flags to ``parser``; returns it (Megatron's ``extra_args_provider``).

    ``--offload-modules`` takes ``core_attn,expert_fc1`` as well as Megatron's space-separated
    ``core_attn expert_fc1``. When the parser already has ``--offload-modules`` (Megatron-LM
    defines it for its own offloading, which ``--fine-grained-activation-offloading`` switches
    on), that flag is reused: without Megatron's switch, the names go to this library.
    """
    group = parser.add_argument_group("offload", "fine-grained activation offloading (offload)")
    try:
        group.add_argument(
            "--offload-modules", nargs="*", default=[], metavar="NAME",
            help=f"offload the saved tensors of these modules to pinned host memory; "
                 f"comma- or space-separated; names: {', '.join(NAMES)}; or {AUTO} (the planner "
                 "chooses under --offload-memory-budget)",
        )
    except argparse.ArgumentError:
        pass  # Megatron-LM's own --offload-modules (dest offload_modules): reuse it
    group.add_argument(
        "--offload-memory-budget", default=None, metavar="BUDGET",
        help=f"with --offload-modules={AUTO}: the peak of forward_backward_func to plan for: 20GiB, -4GiB or "
             "-30%% (below the peak without a plan), fit or fit:10%% (the GPU less headroom)",
    )
    group.add_argument(
        "--offload-memory-budget-gib", type=float, default=None, metavar="GIB",
        help=f"with --offload-modules={AUTO}: the same as --offload-memory-budget=<GIB>GiB (a peak in GiB)",
    )
    group.add_argument(
        "--offload-min-tensor-bytes", type=int, default=DEFAULT_MIN_TENSOR_BYTES, metavar="BYTES",
        help="saved tensors smaller than this stay on the GPU (default: %(default)s)",
    )
    group.add_argument(
        "--offload-max-inflight-groups", type=int, default=1, metavar="N",
        help="at most N groups' device-to-host copies in flight (default: %(default)s)",
    )
    group.add_argument(
        "--offload-copies-into-backward", action="store_true",
        help="wait for the copies still in flight at a forward's end when its backward starts, not when its "
             "last group closes: they also run under the forward's tail; free where the step's memory peaks "
             "in the backward, up to their bytes where it peaks at the forward's end",
    )
    group.add_argument(
        "--offload-policy", default="all", metavar="POLICY",
        help="which groups of the names to offload: all (default), warmup_only, "
             "min_live:N (only while N microbatches are live), layers:0-3,6 (these layers); "
             "per name, clauses separated by ';': 'expert_fc1=layers:0;layers:0-2' (NAMES=POLICY "
             "for those names, a clause without names for the others)",
    )
    return parser


def parse_policy(spec: str | None, modules: Iterable[str] | None = None) -> group_policy.GroupPolicy | None:
    """Turn ``all``, ``warmup_only``, ``min_live:N`` or ``layers:0-3,6`` into a group policy
    (``None`` for ``all``); per name, clauses separated by ``;``, each ``NAMES=POLICY`` for
    those comma-separated names, and at most one without names for the others
    (``expert_fc1=layers:0;layers:0-2``: `offload.group_policy.by_name`). With ``modules``
    (the ``--offload-modules`` names) a clause's names must be among them. Raises ValueError
    with the accepted forms (`UnknownModuleError` for a name)."""
    text = "all" if spec is None else spec.strip()
    clauses = [c.strip() for c in text.split(";")]
    if len(clauses) == 1 and "=" not in clauses[0]:
        return _parse_one_policy(clauses[0], text)
    per_name: dict[str, group_policy.GroupPolicy | None] = {}
    default: list[group_policy.GroupPolicy | None] = []
    for clause in clauses:
        names_text, eq, form = clause.rpartition("=")
        if not eq:
            if default:
                raise ValueError(f"offload: two clauses without names in --offload-policy {spec!r}; "
                                 "give one, for the names no other clause names")
            default.append(_parse_one_policy(form, text))
            continue
        names = [n.strip() for n in names_text.split(",")]
        if not all(names):
            raise ValueError(f"offload: a clause {clause!r} of --offload-policy {spec!r} names no module; "
                             "write NAMES=POLICY, e.g. expert_fc1=layers:0")
        if modules is not None:
            check_known(names, modules, "--offload-policy (the --offload-modules names)")
        for name in names:
            if name in per_name:
                raise ValueError(f"offload: {name!r} is in two clauses of --offload-policy {spec!r}")
            per_name[name] = _parse_one_policy(form, text)
    return group_policy.by_name(per_name, default[0] if default else None)


def _parse_one_policy(spec: str, whole: str) -> group_policy.GroupPolicy | None:
    """One clause's policy (``None`` for ``all``); ``whole`` is the flag's value, for errors."""
    forms = "all, warmup_only, min_live:N, layers:A-B,C; per name NAMES=POLICY clauses separated by ';'"
    if spec in ("", "all"):
        return None
    kind, _, arg = spec.partition(":")
    if kind == "warmup_only" and not arg:
        return group_policy.warmup_only
    if kind == "min_live" and arg.strip().isdigit() and int(arg) >= 1:
        return group_policy.min_live(int(arg))
    if kind == "layers" and arg:
        layers: set[int] = set()
        for part in arg.split(","):
            m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
            if not m:
                raise ValueError(f"offload: bad layer range {part!r} in --offload-policy {whole!r}")
            lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
            if hi < lo:
                raise ValueError(f"offload: empty layer range {part!r} in --offload-policy {whole!r}")
            layers.update(range(lo, hi + 1))
        return group_policy.by_layer(layers)
    raise ValueError(f"offload: unknown --offload-policy {whole!r}; accepted: {forms}")


_ENGINE_ONLY_FLAGS = (("--offload-max-inflight-groups", "max_inflight_groups"), ("--offload-policy", "policy"),
                      ("--offload-copies-into-backward", "copies_into_backward"))


@dataclass(frozen=True)
class Options:
    """The offload settings that `add_arguments` adds, as `apply` takes them.

    ``modules`` is ``("auto",)`` for the planner, with ``memory_budget`` set."""

    modules: tuple[str, ...]
    min_tensor_bytes: int = DEFAULT_MIN_TENSOR_BYTES
    max_inflight_groups: int = 1
    policy: str = "all"
    memory_budget: Budget | None = None
    copies_into_backward: bool = False

    @property
    def auto(self) -> bool:
        return self.modules == (AUTO,)

    def engine_flags_set(self) -> list[str]:
        """The flags of this library's engine settings given other than their defaults
        (`--offload-max-inflight-groups`, `--offload-policy`, `--offload-copies-into-backward`):
        Megatron's own offloading has none of them."""
        default = Options(self.modules)
        return [flag for flag, attr in _ENGINE_ONLY_FLAGS if getattr(self, attr) != getattr(default, attr)]

    def engine_settings(self) -> dict[str, Any]:
        """The engine's settings among these, as `offload.configure` and `apply` take them (the
        policy parsed)."""
        return dict(min_tensor_bytes=self.min_tensor_bytes, max_inflight_groups=self.max_inflight_groups,
                    policy=parse_policy(self.policy, self.modules or None),
                    copies_into_backward=self.copies_into_backward)

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "Options":
        """Read the flags; checks the names, the budget (`check_auto_options`) and Megatron's own
        offloading switch. Raises `OffloadError` (or its subclasses) naming the flag."""
        if getattr(args, "fine_grained_activation_offloading", False) and getattr(args, "offload_modules", None):
            raise OffloadError(
                "offload: --fine-grained-activation-offloading switches on Megatron's own "
                "offloading of --offload-modules; drop it to use this library's offloading"
            )
        modules = parse_module_list(getattr(args, "offload_modules", None) or ())
        text = getattr(args, "offload_memory_budget", None)
        gib = getattr(args, "offload_memory_budget_gib", None)
        if text is not None and gib is not None:
            raise OffloadValueError(
                f"offload: --offload-memory-budget={text} and --offload-memory-budget-gib={gib:g} both give the "
                "budget; give one (--offload-memory-budget-gib X is --offload-memory-budget=XGiB)")
        budget = None
        if text is not None:
            budget = _parse_budget(text, "--offload-memory-budget")
        elif gib is not None:
            if not (math.isfinite(gib) and gib > 0):
                raise OffloadValueError(f"offload: --offload-memory-budget-gib={gib:g} must be a number of GiB > 0")
            budget = _parse_budget(int(gib * 2**30), "--offload-memory-budget-gib")
        opts = cls(
            modules=modules,
            min_tensor_bytes=getattr(args, "offload_min_tensor_bytes", DEFAULT_MIN_TENSOR_BYTES),
            max_inflight_groups=getattr(args, "offload_max_inflight_groups", 1),
            policy=getattr(args, "offload_policy", "all") or "all",
            memory_budget=budget,
            copies_into_backward=bool(getattr(args, "offload_copies_into_backward", False)),
        )
        check_auto_options(opts.modules, opts.memory_budget, opts.max_inflight_groups, opts.policy,
                           opts.copies_into_backward)
        if not opts.auto:  # a bad --offload-policy fails here, before any model is built
            parse_policy(opts.policy, opts.modules or None)  # no names: nothing is offloaded, the policy unused
        return opts


def _parse_budget(spec: str | int, flag: str) -> Budget:
    """`Budget.parse` with the flag named in its error (same exception type)."""
    try:
        return Budget.parse(spec)
    except OffloadError as exc:
        raise type(exc)(f"offload: {flag}: {str(exc).removeprefix('offload: ')}") from None


def check_auto_options(modules: Iterable[str], memory_budget: Budget | str | int | None,
                       max_inflight_groups: int = 1, policy: Any = None,
                       copies_into_backward: bool = False) -> Budget | None:
    """Check ``--offload-modules`` against the budget flags; returns the parsed budget.

    ``auto`` needs a budget and no other name, and leaves the in-flight bound, the policy and
    where a forward's copies are waited for to the plan; a budget needs ``auto``; other names
    must be in `NAMES`. Raises `OffloadValueError` (`UnknownModuleError` for a name) that names
    the flags.
    """
    modules = tuple(modules)
    if AUTO not in modules:
        check_known(modules, NAMES, "--offload-modules")
        if memory_budget is not None:
            raise OffloadValueError(
                f"offload: a memory budget (--offload-memory-budget, --offload-memory-budget-gib) is for "
                f"--offload-modules={AUTO} (the planner); with "
                f"--offload-modules={','.join(modules) or '(none)'} nothing is planned. Drop the budget, or use "
                f"--offload-modules={AUTO}")
        return None
    if modules != (AUTO,):
        raise OffloadValueError(
            f"offload: --offload-modules={AUTO} lets the planner choose the names; it takes no others "
            f"(got {','.join(modules)}). Use --offload-modules={AUTO} alone, or the names alone")
    if memory_budget is None:
        raise OffloadValueError(
            f"offload: --offload-modules={AUTO} needs a memory budget: --offload-memory-budget=20GiB, -4GiB, -30% "
            "or fit:10%, or --offload-memory-budget-gib=20")
    budget = _parse_budget(memory_budget, "--offload-memory-budget")
    if max_inflight_groups != 1 or (policy not in (None, "", "all")):
        raise OffloadValueError(
            f"offload: with --offload-modules={AUTO} the plan chooses --offload-max-inflight-groups and offloads "
            "every group of the names it picks; leave --offload-max-inflight-groups and --offload-policy unset")
    if copies_into_backward:
        raise OffloadValueError(
            f"offload: with --offload-modules={AUTO} the plan frees a forward's copies when its last group "
            "closes, as its memory model assumes; leave --offload-copies-into-backward unset")
    return budget
