"""The choice: per named module keep, offload or checkpoint, and per container checkpoint or not,
with the inputs a checkpointed region keeps offloaded or not, for the least predicted step time
under a memory budget. Every figure is `offload.tools.advisor.Model.predict`'s.

The choices form a small tree: a container's checkpoint replaces the choices of the names inside
it, which are then recomputed or, by selective checkpointing, kept (their outputs saved). The
search takes, as candidates for checkpointing, the containers and names whose checkpoint alone
frees at least `MIN_CHECKPOINT_GAIN` of the step's saved bytes (a module whose output the next
module saves frees almost nothing alone), forms every set of candidates that do not lie in each
other, gives each container of a set its `selective_variants` (everything recomputed, or the
names that are dearest to recompute for what they hold kept), and for each chooses which of the
remaining units to offload: the names outside the set and the set's regions (their inputs). The
engine's ``max_inflight_groups`` is 1, or the number of offloaded groups per layer when that is
faster. With at most `EXHAUSTIVE_MAX`
predictions in all, every choice is predicted; above it, a local search per set (from nothing
offloaded and from everything offloaded, toggling one unit at a time while that improves).

The best: the least predicted step time among the choices whose predicted peak meets the budget
(ties: fewer things moved, then more memory freed); when none meets it, the lowest peak.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterable

from ..tools.advisor import Model, Prediction
from .budget import format_bytes

MIN_CHECKPOINT_GAIN = 0.01
EXHAUSTIVE_MAX = 4096
MAX_CANDIDATES = 12


@dataclass(frozen=True)
class Assignment:
    """What a plan does: ``checkpoint`` (names or containers) runs under `torch.utils.checkpoint`,
    keeping the outputs of the names ``selective`` inside them (selective checkpointing);
    ``offload`` (names, or checkpointed regions, whose inputs then leave) is offloaded with
    ``max_inflight_groups``."""

    checkpoint: tuple[str, ...] = ()
    offload: tuple[str, ...] = ()
    max_inflight_groups: int = 1
    selective: tuple[str, ...] = ()

    def predict(self, model: Model) -> Prediction:
        return model.predict(offload=self.offload, checkpoint=self.checkpoint, selective=self.selective,
                             max_inflight_groups=self.max_inflight_groups)

    def choice(self, unit: str) -> str:
        """``keep``, ``offload``, ``checkpoint`` or ``checkpoint+offload`` for one unit."""
        if unit in self.checkpoint:
            return "checkpoint+offload" if unit in self.offload else "checkpoint"
        return "offload" if unit in self.offload else "keep"


MAX_SELECTIVE_VARIANTS = 4
"""Selective variants tried per checkpointed container, besides recomputing everything."""


def selective_variants(model: Model, region: str) -> list[tuple[str, ...]]:
    """The names a checkpoint of ``region`` may keep: nothing (all recomputed), then the first
    one, two, ... of the names its recompute runs (`Model.recomputed_members`, first instance),
    dearest first: forward time per byte it creates (what keeping it holds). Keeping a name the
    recompute never runs would hold memory for nothing; keeping all it runs still recomputes
    what runs outside every name (a save between two modules)."""
    if region not in model.containers:
        return [()]
    members = [inst for inst in model.close_order if inst[1] == 0 and model.inside(inst[0], region)]
    run = [n for n, _ in model.recomputed_members(members)]
    created: dict[str, int] = {}
    for nbytes, _, _, made in model.storages:
        if made is not None and made[1] == 0:
            created[made[0]] = created.get(made[0], 0) + nbytes
    dearest = sorted(run, key=lambda n: -model.recompute_ms(n) / max(created.get(n, 0), 1))
    sizes = [k for k in range(1, min(len(run), MAX_SELECTIVE_VARIANTS) + 1) if k < len(members)]
    return [()] + [tuple(n for n in run if n in dearest[:k]) for k in sizes]


def checkpoint_candidates(model: Model) -> list[str]:
    """The names and containers worth checkpointing (module docstring), most freed first."""
    if model.facts is None:
        return []
    floor = MIN_CHECKPOINT_GAIN * model.saved_bytes()
    gains = [(model.predict(checkpoint=[r]).recomputed_bytes, r) for r in [*model.containers, *model.names]]
    kept = [r for g, r in sorted(gains, key=lambda x: -x[0]) if g > 0 and g >= floor]
    return kept[:MAX_CANDIDATES]


def checkpoint_sets(model: Model, candidates: list[str]) -> list[tuple[str, ...]]:
    """Every set of candidates none of which lies inside another (the empty set first)."""
    out: list[tuple[str, ...]] = []

    def extend(k: int, chosen: tuple[str, ...]) -> None:
        if k == len(candidates):
            out.append(chosen)
            return
        extend(k + 1, chosen)
        c = candidates[k]
        if not any(model.inside(c, x) or model.inside(x, c) for x in chosen):
            extend(k + 1, chosen + (c,))

    extend(0, ())
    return out


def selective_sets(model: Model, checkpoint: tuple[str, ...], selective: bool) -> list[tuple[str, ...]]:
    """The names kept inside ``checkpoint``'s containers, every combination of their
    `selective_variants` (only nothing kept when ``selective`` is false)."""
    if not selective:
        return [()]
    return [tuple(n for part in combo for n in part)
            for combo in itertools.product(*(selective_variants(model, c) for c in checkpoint))]


def units(model: Model, checkpoint: tuple[str, ...]) -> list[str]:
    """What can be offloaded with ``checkpoint`` checkpointed: the names outside it, and it."""
    outside = [n for n in model.names if not any(n == c or model.inside(n, c) for c in checkpoint)]
    return outside + list(checkpoint)


def rank(pred: Prediction, budget: int) -> tuple:
    """Sort key of a prediction against the budget (module docstring): smaller is better; an
    assignment that offloads a unit moving no bytes after every other (`Prediction.idle_offloads`)."""
    moved = len(pred.offload) + len(pred.checkpoint) + len(pred.selective)
    idle = bool(pred.idle_offloads)
    if pred.peak_bytes is not None and pred.peak_bytes <= budget:
        return (idle, 0, round(pred.cost_ms, 2), moved, -pred.freed_at_peak)
    return (idle, 1, -pred.freed_at_peak, round(pred.cost_ms, 2), moved)


def _best_for(model: Model, checkpoint: tuple[str, ...], offload: Iterable[str], key: Callable,
              selective: tuple[str, ...] = ()) -> Prediction:
    """The better of ``max_inflight_groups`` 1 and one group in flight per offloaded group of a layer."""
    offload = tuple(offload)
    one = Assignment(checkpoint, offload, 1, selective).predict(model)
    per_layer = len(one.bytes_per_group)
    if per_layer <= 1:
        return one
    more = Assignment(checkpoint, offload, per_layer, selective).predict(model)
    return min(one, more, key=key)


def _local_search(model: Model, checkpoint: tuple[str, ...], selective: tuple[str, ...], options: list[str],
                  key: Callable) -> Prediction:
    best = None
    for start in (set(), set(options)):
        current = start
        here = _best_for(model, checkpoint, [u for u in options if u in current], key, selective)
        while True:
            moves = [(_best_for(model, checkpoint, [u for u in options if u in current ^ {x}], key, selective), x)
                     for x in options]
            p, x = min(moves, key=lambda m: key(m[0]))
            if key(p) >= key(here):
                break
            here, current = p, current ^ {x}
        if best is None or key(here) < key(best):
            best = here
    return best


def _assignment(pred: Prediction) -> Assignment:
    return Assignment(tuple(pred.checkpoint), tuple(pred.offload), pred.max_inflight_groups, tuple(pred.selective))


def choose(model: Model, budget: int, exclude: Collection[Assignment] = (),
           selective: bool = True) -> tuple[Assignment, Prediction]:
    """The best assignment for ``budget`` bytes of peak (module docstring) and its prediction;
    assignments in ``exclude`` (plans measured already) rank after every other. With
    ``selective`` false, checkpointed regions recompute everything inside them."""
    if model.profile.get("peak_allocated") is None:
        raise ValueError("a memory budget needs a profile with a peak (measured, or estimated on CPU)")

    def key(p: Prediction) -> tuple:
        return (bool(exclude) and _assignment(p) in exclude, *rank(p, budget))

    sets = [(chain, kept) for chain in checkpoint_sets(model, checkpoint_candidates(model))
            for kept in selective_sets(model, chain, selective)]
    total = sum(2 ** len(units(model, chain)) for chain, _ in sets)
    best: Prediction | None = None
    for chain, kept in sets:
        options = units(model, chain)
        if total <= EXHAUSTIVE_MAX:
            preds = (_best_for(model, chain, [u for u, on in zip(options, mask) if on], key, kept)
                     for mask in itertools.product((False, True), repeat=len(options)))
            here = min(preds, key=key)
        else:
            here = _local_search(model, chain, kept, options, key)
        if best is None or key(here) < key(best):
            best = here
    assert best is not None
    return _assignment(best), best


def explain(model: Model, assignment: Assignment, pred: Prediction) -> list[dict[str, Any]]:
    """One row per unit of the plan (every name, and the containers it checkpoints): its choice,
    and why, from the same plan with that unit kept (or, for a kept name, offloaded)."""
    rows = []
    for unit in [*model.names, *model.containers]:
        outer = next((c for c in assignment.checkpoint if model.inside(unit, c)), None)
        if unit in model.containers and unit not in assignment.checkpoint and outer is None:
            continue
        row: dict[str, Any] = {"unit": unit, "members": model.members(unit), "choice": assignment.choice(unit),
                               "bytes_per_layer": 0, "copy_ms_per_layer": 0.0, "frees_bytes": 0, "cost_ms": 0.0}
        if outer is not None:
            if unit in assignment.selective:
                row.update(choice=f"saved in {outer}", why=f"its outputs kept by {outer}'s checkpoint (selective), "
                                                           "not recomputed")
            else:
                row.update(choice=f"in {outer}", why=f"recomputed with {outer}")
            rows.append(row)
            continue
        if row["choice"] == "keep":
            if unit in model.containers:
                continue
            other = Assignment(assignment.checkpoint, assignment.offload + (unit,),
                               assignment.max_inflight_groups, assignment.selective).predict(model)
        else:
            other = Assignment(tuple(c for c in assignment.checkpoint if c != unit),
                               tuple(o for o in assignment.offload if o != unit),
                               assignment.max_inflight_groups,
                               tuple(n for n in assignment.selective if not model.inside(n, unit))).predict(model)
        gain = abs(pred.freed_at_peak - other.freed_at_peak)
        cost = abs(pred.cost_ms - other.cost_ms)
        if row["choice"] == "keep":
            row["why"] = ("offloading it frees nothing (held by a module that stays, or too small)" if gain == 0 else
                          f"not needed for the budget (offloading it: {format_bytes(gain)} for +{cost:.2f} ms)")
        else:
            copied = pred.bytes_per_group.get(unit, 0)
            row.update(bytes_per_layer=copied, copy_ms_per_layer=model.bw.copy_ms("d2h", copied),
                       frees_bytes=gain, cost_ms=cost)
            row["why"] = _why(model, row)
        rows.append(row)
    return rows


def _why(model: Model, row: dict[str, Any]) -> str:
    """Why a unit that does something is worth its cost, in a few words."""
    ms, window = row["copy_ms_per_layer"], model.fwd_window
    copies = (f"{ms:.2f} ms of copies a layer, {'under' if ms <= window else 'over'} its {window:.2f} ms forward"
              if row["bytes_per_layer"] else "")
    if row["choice"] == "offload":
        return copies or "moves what it shares with another offloaded name (both must go for it to leave)"
    return "recomputed in backward" + (f"; its inputs offloaded: {copies}" if copies else "")
