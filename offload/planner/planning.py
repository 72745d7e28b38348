"""The planner's steps in order: profile, measure the link, choose, apply, check, plan again
while the check says so (at most `MAX_MEASURED_PLANS` measured) and keep the best measured; and
the `Plan` it returns (package docstring)."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch import nn

from ..config import DEFAULT_MIN_TENSOR_BYTES
from ..errors import OffloadTypeError, OffloadValueError, UnknownModuleError
from ..tools.advisor import Model, Prediction
from ..tools.bandwidth import Bandwidth, measure_copy
from ..tools.boundaries import match_modules
from ..tools.report import md_table
from .apply import Applied
from .budget import Budget, format_bytes as size
from .check import Measured, calibrate, deviations, measure, predicted_step_ms
from .search import Assignment, choose, explain
from .structure import find_containers, record, resolve_containers

__all__ = ["Assignment", "Budget", "Measured", "Plan", "active_plan", "describe", "plan"]

CPU_LINK_GBPS = 10.0
"""The link assumed on the CPU, where there is none to measure (the plan there is a dry run)."""
LINK_PROBE_MIB = (4, 16, 64, 256)
"""Copy sizes of the quick link probe (pinned, both directions, 5 copies each)."""
PROFILE_STEPS = {"cuda": dict(steps=5, warmup=3, time_steps=3), "cpu": dict(steps=1, warmup=1, time_steps=1)}
"""The profile's measured steps, warm-up steps and steps timed per module (CPU: a dry run)."""
CHECK_WARMUP = {"cuda": 2, "cpu": 1}
"""Steps with the plan before its measured ones: pinned buffers, the forward's end learned."""

_active: "Plan | None" = None


def active_plan() -> "Plan | None":
    """The plan applied last (by `plan` or ``configure(modules="auto")``) and not removed."""
    return _active


@dataclass
class Plan:
    """A chosen plan: what it does (``assignment``), its prediction, why (``rows``), and, once
    applied and run, what was measured; ``history`` holds the other plans measured (not kept)."""

    budget: Budget
    budget_bytes: int
    assignment: Assignment
    prediction: Prediction
    predicted_step_ms: float
    predicted_peak_bytes: int
    rows: list[dict[str, Any]]
    profile: dict[str, Any]
    bandwidth: Bandwidth
    peak_estimated: bool
    measured: Measured | None = None
    notes: list[str] = field(default_factory=list)
    history: list[dict[str, Any]] = field(default_factory=list)
    applied: Any = field(default=None, repr=False)
    """What `remove` undoes (an object with ``remove()``): the planner's `Applied`, or an
    integration's handle that applied the plan itself."""

    @property
    def base_step_ms(self) -> float:
        return self.profile["step_ms"]

    @property
    def base_peak_bytes(self) -> int:
        return self.profile["peak_allocated"]

    def remove(self) -> None:
        """Undo the plan: no checkpointed regions, an engine that offloads nothing."""
        global _active
        if self.applied is not None:
            self.applied.remove()
            self.applied = None
        if _active is self:
            _active = None

    def table(self) -> str:
        """What it chose and why, with the prediction and (once run) the measurement."""
        base, peak = self.base_step_ms, self.base_peak_bytes
        what = "bytes the step saves (no memory measured on CPU)" if self.peak_estimated else "peak"
        lines = [
            f"Plan for a memory budget of {size(self.budget_bytes)} ({self.budget}; without a plan the {what} is "
            f"{size(peak)} and the step {base:.2f} ms): {describe(self.assignment)}",
            "",
            md_table(["unit", "choice", "copied per layer", "copy ms/layer", "frees", "cost ms", "why"],
                     [[r["unit"], r["choice"], size(r["bytes_per_layer"]) if r["bytes_per_layer"] else "-",
                       f"{r['copy_ms_per_layer']:.2f}" if r["bytes_per_layer"] else "-",
                       size(r["frees_bytes"]) if r["frees_bytes"] else "-",
                       f"{r['cost_ms']:.2f}" if r["frees_bytes"] else "-", r["why"]] for r in self.rows], "llrrrrl"),
            "",
            f"Predicted: peak {size(self.predicted_peak_bytes)} ({_pct(self.predicted_peak_bytes, peak)}), step "
            f"{self.predicted_step_ms:.2f} ms ({_pct(self.predicted_step_ms, base)}); "
            + ("meets the budget." if self.predicted_peak_bytes <= self.budget_bytes
               else "the budget cannot be met: this is the lowest peak the plans reach."),
        ]
        for h in self.history:
            m = h["measured"]
            line = f"Also measured {describe(h['assignment'])}: step {m['step_ms']:.2f} ms" + (
                f", peak {size(m['peak_bytes'])}" if m["peak_bytes"] is not None else "")
            if h["deviations"]:
                line += " (" + "; ".join(h["deviations"]) + ")"
            if h["corrections"]:
                line += "; planned again with " + "; ".join(h["corrections"])
            lines.append(line + ".")
        m = self.measured
        if m is not None and m.peak_bytes is None:
            lines.append(f"Ran with the plan: {m.step_ms:.2f} ms per step (host time: CPU times are not checked).")
        elif m is not None:
            lines.append(f"Measured with the plan: step {m.step_ms:.2f} ms ({_pct(m.step_ms, self.predicted_step_ms)} "
                         f"against the prediction), peak {size(m.peak_bytes)} "
                         f"({_pct(m.peak_bytes, self.predicted_peak_bytes)}).")
        lines += self.notes
        return "\n".join(lines)

    def as_dict(self) -> dict[str, Any]:
        """The plan as JSON-ready data (without the profile)."""
        return {
            "budget": str(self.budget), "budget_bytes": self.budget_bytes,
            "checkpoint": list(self.assignment.checkpoint), "selective": list(self.assignment.selective),
            "offload": list(self.assignment.offload), "max_inflight_groups": self.assignment.max_inflight_groups,
            "predicted_step_ms": self.predicted_step_ms, "predicted_peak_bytes": self.predicted_peak_bytes,
            "base_step_ms": self.base_step_ms, "base_peak_bytes": self.base_peak_bytes,
            "peak_estimated": self.peak_estimated, "rows": self.rows,
            "measured": None if self.measured is None else self.measured.as_dict(),
            "history": [{**h, "assignment": describe(h["assignment"])} for h in self.history],
            "notes": self.notes,
        }


def describe(a: Assignment) -> str:
    """An assignment in a few words."""
    parts = []
    if a.checkpoint:
        parts.append("checkpoint " + ",".join(a.checkpoint) + (f" (keeping {','.join(a.selective)})"
                                                               if a.selective else ""))
    if a.offload:
        parts.append("offload " + ",".join(a.offload) + (f" ({a.max_inflight_groups} groups in flight)"
                                                          if a.max_inflight_groups > 1 else ""))
    return "; ".join(parts) or "nothing to offload or recompute"


def plan(model: nn.Module, mapping: Mapping[str, str] | str | list[str], step: Callable[[], None],
         memory_budget: Budget | str | int, *, regions: str | Mapping[str, str | list[str]] | None = "auto",
         profile: dict[str, Any] | str | Path | None = None, bandwidth: Bandwidth | dict | str | Path | float | None = None,
         device: torch.device | str | None = None, min_tensor_bytes: int | None = None,
         engine: Mapping[str, Any] | None = None, apply: bool = True, check_steps: int = 3,
         replan: bool = True, selective: bool = True, verbose: bool = True) -> Plan:
    """Choose, apply and check the fastest plan for ``memory_budget`` (module docstring).

    ``mapping`` names the modules as for `offload.attach` (one pattern per name; names alone for a
    transformers model with a preset). ``step()`` runs one forward and backward of ``model`` (no
    optimizer step: the planner runs it to profile and check). ``model`` must not be attached.
    ``regions``: ``"auto"`` (containers found in the model), ``None`` (named modules only) or
    name -> pattern(s). ``profile`` and ``bandwidth`` take saved results instead of measuring
    (``bandwidth`` also a flat GB/s). ``engine``: more `offload.configure` arguments
    (``max_pinned_bytes``, ``copy_chunk_bytes``, ``timing``). With ``apply=False`` nothing is
    applied or measured. ``selective=False`` leaves selective checkpointing out (a checkpointed
    region recomputes everything inside it: for modules whose ops torch's dispatcher does not
    see). Prints the table unless ``verbose=False``.
    """
    global _active
    budget = Budget.parse(memory_budget)
    if not isinstance(model, nn.Module):
        raise OffloadTypeError(f"offload: plan() takes a torch.nn.Module, got {type(model).__name__}")
    if not callable(step):
        raise OffloadTypeError(f"offload: plan()'s step must be a callable that runs a forward and backward, got {step!r}")
    if isinstance(check_steps, bool) or not isinstance(check_steps, int) or check_steps < 0:
        raise OffloadValueError(f"offload: plan()'s check_steps must be an int >= 0, got {check_steps!r}")
    mapping = _mapping(model, mapping)
    device = _device(model, device)
    cuda = device.type == "cuda"
    mtb = (DEFAULT_MIN_TENSOR_BYTES if cuda else 0) if min_tensor_bytes is None else min_tensor_bytes
    engine = {**dict(engine or {}), "min_tensor_bytes": mtb, "device": device}
    if regions == "auto":
        containers = find_containers(model, mapping)
    else:
        containers = resolve_containers(model, dict(regions)) if regions else {}
    import offload as api

    api.configure((), device=device, min_tensor_bytes=mtb)  # nothing offloaded while profiling
    prof = _profile(model, mapping, containers, step, device, mtb, profile)
    link = _bandwidth(bandwidth, device)
    device_bytes = torch.cuda.get_device_properties(device).total_memory if cuda else None
    budget_bytes = budget.resolve(prof["peak_allocated"], device_bytes)
    model_ = Model(prof, link)
    assignment, pred = choose(model_, budget_bytes, selective=selective)
    result = Plan(budget, budget_bytes, assignment, pred, predicted_step_ms(prof, pred), pred.peak_bytes,
                  explain(model_, assignment, pred), prof, link, peak_estimated=bool(prof.get("peak_estimated")))
    if result.peak_estimated:
        link_text = f"a nominal {CPU_LINK_GBPS:g} GB/s link" if bandwidth is None else "the link given"
        result.notes.append("On the CPU no memory is measured and the engine saves none: the plan was made on the "
                            f"bytes the step saves and {link_text}, applied and run, not checked.")
    if bandwidth is None and cuda:
        result.notes.append("Link measured by a quick probe (compute slowdown under copies not measured: 0 assumed).")
    if apply:
        _apply(result, model, mapping, containers, engine)
        _active = result
        if check_steps:
            def measure_plan() -> Measured:
                return measure(step, check_steps, CHECK_WARMUP[device.type], cuda)

            def apply_plan(assignment: Assignment) -> None:
                result.applied.remove()
                result.assignment = assignment
                _apply(result, model, mapping, containers, engine)

            result.measured = measure_plan()
            if cuda and replan:
                _check_and_replan(result, apply_plan, measure_plan, selective)
    if verbose:
        print(result.table())
    return result


def _apply(result: Plan, model: nn.Module, mapping: dict[str, str], containers: dict[str, list[str]],
           engine: dict[str, Any]) -> None:
    a = result.assignment
    result.applied = Applied(model, mapping, containers, a.checkpoint, a.offload, a.max_inflight_groups, engine,
                             a.selective)


MAX_MEASURED_PLANS = 3
"""Plans measured at most by one `plan` call: the first and up to two re-plans."""


_CHOICE = ("assignment", "prediction", "predicted_step_ms", "predicted_peak_bytes", "rows", "profile", "bandwidth",
           "measured")
"""The fields of a `Plan` that one measured choice sets."""


@dataclass
class _Tried:
    """A plan that was applied and measured: its `Plan` fields (`_CHOICE`), and why it was left."""

    choice: dict[str, Any]
    deviations: list[str] = field(default_factory=list)
    corrections: list[str] = field(default_factory=list)

    @property
    def measured(self) -> Measured:
        return self.choice["measured"]

    def fits(self, budget_bytes: int) -> bool:
        return self.measured.peak_bytes is None or self.measured.peak_bytes <= budget_bytes


def _check_and_replan(result: Plan, apply_plan: Callable[[Assignment], None],
                      measure_plan: Callable[[], Measured], selective: bool = True) -> None:
    """Plan again while the measurement deviates (`check.deviations`), with the corrections of
    `check.calibrate`: the best plan of the corrected model not measured yet (the runner-up when
    the corrected model still prefers a measured one), up to `MAX_MEASURED_PLANS` measured; then
    keep the fastest measured plan within the budget (none within it: the lowest measured peak).

    The measurement decides, not the model: a re-plan made on corrected inputs can still measure
    slower, or over the budget, than the plan it was to replace (H100, seq 32768: a first plan at
    528.9 ms was replaced by one predicted faster that measured 611.2 ms). ``apply_plan``
    replaces the applied plan by an assignment; ``measure_plan`` measures the applied one."""
    budget = result.budget_bytes
    tried = [_Tried({k: getattr(result, k) for k in _CHOICE})]
    prof, link, offset = result.profile, result.bandwidth, 0
    while len(tried) < MAX_MEASURED_PLANS:
        last = tried[-1].choice
        tried[-1].deviations = deviations(last["predicted_step_ms"], last["predicted_peak_bytes"], last["measured"],
                                          budget)
        if not tried[-1].deviations:
            break
        prof, link, over, tried[-1].corrections = calibrate(prof, link, last["prediction"], last["measured"])
        offset = max(offset, over)
        model_ = Model(prof, link)
        measured_already = [t.choice["assignment"] for t in tried]
        assignment, pred = choose(model_, budget - offset, exclude=measured_already, selective=selective)
        if assignment in measured_already:  # nothing else to try
            break
        apply_plan(assignment)
        tried.append(_Tried(dict(assignment=assignment, prediction=pred, predicted_step_ms=predicted_step_ms(prof, pred),
                                 predicted_peak_bytes=pred.peak_bytes + offset, rows=explain(model_, assignment, pred),
                                 profile=prof, bandwidth=link, measured=measure_plan())))
    fits = [t for t in tried if t.fits(budget)]
    best = min(fits, key=lambda t: t.measured.step_ms) if fits else min(tried, key=lambda t: t.measured.peak_bytes)
    if best is not tried[-1]:
        apply_plan(best.choice["assignment"])
    for k in _CHOICE:
        setattr(result, k, best.choice[k])
    result.history = [{"assignment": t.choice["assignment"], "predicted_step_ms": t.choice["predicted_step_ms"],
                       "predicted_peak_bytes": t.choice["predicted_peak_bytes"], "measured": t.measured.as_dict(),
                       "deviations": t.deviations, "corrections": t.corrections} for t in tried if t is not best]
    if len(tried) > 1:
        why = ("the fastest measured within the budget" if fits else
               "no plan measured within the budget; this one had the lowest peak")
        result.notes.append(f"Kept {describe(result.assignment)} of {len(tried)} plans measured: {why}.")


def _mapping(model: nn.Module, mapping: Mapping[str, Any] | str | list[str]) -> dict[str, str]:
    """One pattern per name (names alone: a transformers model's preset, as `offload.attach`)."""
    if isinstance(mapping, (str, list, tuple)):
        from ..presets import mapping_for

        mapping = mapping_for(model, mapping)
    if not isinstance(mapping, Mapping) or not mapping:
        raise OffloadTypeError(f"offload: plan()'s mapping must be a non-empty dict of name -> module pattern, got {mapping!r}")
    out = {}
    for name, pattern in mapping.items():
        if not isinstance(pattern, str):
            pattern = list(pattern)
            if len(pattern) != 1:
                raise OffloadValueError(f"offload: plan() takes one module pattern per name; {name!r} has {pattern}")
            pattern = pattern[0]
        out[name] = pattern
    try:
        match_modules(model, out)
    except ValueError as exc:
        raise UnknownModuleError(f"offload: plan(): {exc} in {type(model).__name__}") from None
    return out


def _device(model: nn.Module, device: torch.device | str | None) -> torch.device:
    if device is not None:
        from ..config import check_device

        return check_device(device)
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _profile(model: nn.Module, mapping: dict[str, str], containers: dict[str, list[str]], step: Callable[[], None],
             device: torch.device, mtb: int, given: dict[str, Any] | str | Path | None) -> dict[str, Any]:
    """The step's profile with its region facts; on CPU the saved bytes stand in for the peak."""
    from ..tools import profile_modules
    from ..tools.workload import Workload

    if given is None:
        work = Workload(model, mapping, step, device, type(model).__name__)
        spec = {"entry": "offload.plan", "device": str(device)}
        prof = profile_modules.profile(work, spec, min_tensor_bytes=mtb, **PROFILE_STEPS[device.type])
    elif isinstance(given, dict):
        prof = copy.deepcopy(given)
    else:
        prof = json.loads(Path(given).read_text())
    if set(prof.get("names", ())) != set(mapping):
        raise OffloadValueError(f"offload: the profile's names {prof.get('names')} are not those of the mapping {list(mapping)}")
    if "regions" not in prof:
        prof["regions"] = record(model, mapping, containers, step, prof, device)
    if prof.get("peak_allocated") is None:
        prof["peak_allocated"] = sum(s["bytes"] for s in prof["storages"] if not s.get("unsaved"))
        prof["peak_estimated"] = True
    return prof


def _bandwidth(given: Bandwidth | dict | str | Path | float | None, device: torch.device) -> Bandwidth:
    if isinstance(given, Bandwidth):
        return given
    if isinstance(given, (int, float)) and not isinstance(given, bool):
        return Bandwidth.constant(float(given))
    if isinstance(given, dict):
        return Bandwidth.from_json(given)
    if isinstance(given, (str, Path)):
        return Bandwidth.load(given)
    if given is not None:
        raise OffloadTypeError(f"offload: plan()'s bandwidth must be a Bandwidth, a probe's JSON (dict or path) "
                               f"or GB/s, got {given!r}")
    if device.type != "cuda":
        return Bandwidth.constant(CPU_LINK_GBPS)
    records = [measure_copy(int(mib * 2**20), d, True, 5, device) for mib in LINK_PROBE_MIB for d in ("d2h", "h2d")]
    return Bandwidth.from_json({"records": records})


def _pct(x: float, base: float) -> str:
    return f"{100 * (x / base - 1):+.1f}%" if base else "n/a"

