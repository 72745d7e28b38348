"""The copy-wait notice: the configured names' copies make the compute stream wait.

Offloading more bytes per layer than the copy engine moves under a layer's compute costs step
time and nothing else shows it: losses stay bitwise, the peak falls. So the engine measures
its first iterations and says so once, with the numbers and what to offload instead.

The rule. ``end_iteration()`` calls are counted. After `WARMUP` (2) of them (pinned
allocations, kernel autotuning, the forward's end not yet known), the next `MEASURED` (3)
iterations are measured: 0-based iterations 2, 3 and 4 when nothing disturbs them. An
iteration in which a group closed under CUDA graph capture, in which `reset()` aborted a
step, or in which no group closed (a step under `offload.suspended`), is not measured; the
next one is measured in its place. Once three are measured and
their events are done (queried at each ``end_iteration()``, never waited for: usually at once
or one iteration later), the notice is said if the compute stream waited for copies
(``offload_wait_ms`` + ``reload_wait_ms`` of every name) more than `THRESHOLD` (2%) of the
step, and nothing is said otherwise. Either way the measurement stops: no event beyond the
engine's own after that. One not decided after `GIVE_UP` (20) ``end_iteration()`` calls (an
iteration captured every time) stops silently.

What is measured, with CUDA events only (`CopyWaitProbe`):

* the step: an event on the current stream at each ``end_iteration()``; a step is the time
  between two of them;
* per name, from the iterations' `GroupStats`: groups offloaded per step (about one per layer
  and microbatch), bytes per group, copy time out and back per group, waits per step;
* per name, the forward compute its copies run under: an event on the group's stream when a
  group closes (only in measured iterations); from one group of the name to the next in the
  same chunk forward (layer L to L+1) is one layer, from which the waits timed on that stream
  in between are subtracted.

The advice (`copy_wait_notice`): the copies out of all names share one copy engine, so a set
of names fits when the shares of their layers' forward compute that their copies out need
(copy ms per group / layer ms) add up to at most 1. If the configured names do not fit, the
subset that fits with the most bytes per step is named; if they do, the waits come from the
forward's end (the part of the waits for copies out timed at the flush, ``flush_wait_ms``, when
it is most of them), from the in-flight bound (the rest of the waits for copies out), or from
the reloads (waits for copies back), and the notice says which. It always points to the planner,
``offload.configure(modules="auto", memory_budget=...)`` and ``offload.plan``.

The CPU fallback cannot time its copies: there no probe runs and nothing is said. On a GPU the
engine times its copies and waits in the measured iterations whatever ``timing`` says
(`offload.stats.StatsRecorder.timing`); ``timing=True`` times every iteration.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

from .notices import say_once
from .stats import GroupStats, IterationStats

WARMUP = 2
"""``end_iteration()`` calls before the measured iterations."""
MEASURED = 3
"""Iterations measured."""
GIVE_UP = 20
"""``end_iteration()`` calls after which a measurement not yet decided stops silently."""
THRESHOLD = 0.02
"""The notice is said when the compute stream waited for copies more than this share of a step."""
BACKWARD_OVER_FORWARD = 2.0
"""A backward's compute, taken as this many times its forward's: copies out that do not fit under
the forward may still fit under the forward and the backward together."""
MAX_SUBSET_NAMES = 12
"""The subset that fits is searched among at most this many names (those moving the most bytes)."""

PLANNER = ('let the planner choose under a memory budget: offload.configure(modules="auto", '
           'memory_budget=...) (offload.plan shows what it would offload)')


@dataclass(frozen=True)
class NameFigures:
    """What the groups of one name cost per step, averaged over the measured iterations.

    ``groups``: groups offloaded per step; ``d2h_ms``/``h2d_ms``: copy time out/back per group;
    ``layer_ms``: the forward compute from one group of the name to the next (one layer), waits
    excluded, positive (the probe makes it at least 1 us), ``None`` if not measured (one group
    per forward); waits and ``reloads_on_demand`` are per step, ``flush_wait_ms`` the part of
    ``offload_wait_ms`` at the forward's end."""

    name: str
    groups: float
    bytes_per_group: float
    d2h_ms: float
    h2d_ms: float
    layer_ms: float | None
    offload_wait_ms: float
    reload_wait_ms: float
    reloads_on_demand: float = 0.0
    flush_wait_ms: float = 0.0

    @property
    def wait_ms(self) -> float:
        return self.offload_wait_ms + self.reload_wait_ms

    @property
    def bytes_per_step(self) -> float:
        return self.groups * self.bytes_per_group

    @property
    def share(self) -> float | None:
        """The share of its layer's forward compute that a group's copy out needs."""
        return None if self.layer_ms is None else self.d2h_ms / self.layer_ms


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes:.0f} B"


def _percent(share: float) -> str:
    return f"{100 * share:.0f}%"


def fitting_subset(names: Sequence[NameFigures]) -> list[NameFigures]:
    """The names, among those whose share is known, whose shares add up to at most 1 and that
    move the most bytes per step (of equal ones, the smaller share; in the given order).
    Only the `MAX_SUBSET_NAMES` names that move the most bytes are considered."""
    known = [n for n in names if n.share is not None and n.groups > 0]
    known = sorted(known, key=lambda n: -n.bytes_per_step)[:MAX_SUBSET_NAMES]
    best: tuple[float, float] = (0.0, 0.0)
    chosen: tuple[NameFigures, ...] = ()
    for size in range(1, len(known) + 1):
        for subset in itertools.combinations(known, size):
            share = sum(n.share for n in subset)
            score = (sum(n.bytes_per_step for n in subset), -share)
            if share <= 1.0 and score > best:
                best, chosen = score, subset
    return [n for n in names if n in chosen]


def _describe(n: NameFigures) -> str:
    if n.layer_ms is None:
        against = "a forward compute per layer that was not measured (one group of the name per forward)"
    else:
        against = f"{n.layer_ms:.2f} ms of forward compute per layer (the copy out needs {_percent(n.share)} of it)"
    return (f"  {n.name}: {round(n.groups, 1):g} group(s) per step of {_size(n.bytes_per_group)} each (one per "
            f"layer and microbatch); copy out {n.d2h_ms:.2f} ms, back {n.h2d_ms:.2f} ms per group, against "
            f"{against}; waits per step: {n.offload_wait_ms:.1f} ms for copies out{_at_the_end(n.flush_wait_ms)}, "
            f"{n.reload_wait_ms:.1f} ms for copies back")


def _at_the_end(flush_ms: float) -> str:
    return f" ({flush_ms:.1f} of them at the forward's end)" if flush_ms >= 0.05 else ""


INTO_BACKWARD = (
    "Where the step's memory peaks in the backward rather than at the forward's end (max_memory_allocated says, "
    "with the option and without), offload.configure(..., copies_into_backward=True) "
    "(--offload-copies-into-backward) waits for the copies still in flight at the forward's end when the "
    "backward starts instead, so that they run on under the forward's tail.")


def _more_in_flight(names: Sequence[NameFigures], total: float, bound_ms: float, max_inflight_groups: int,
                    copies_into_backward: bool) -> str:
    """The sentence that keeps every name where copies out that do not fit under the forward
    (``total`` of it) would fit under the forward and the backward, the waits being the
    in-flight bound's (``bound_ms`` per step); otherwise ''."""
    if not 1.0 < total <= 1.0 + BACKWARD_OVER_FORWARD:
        return ""
    more = f"max_inflight_groups={max_inflight_groups + 1} (--offload-max-inflight-groups)"
    how = (f"{more} lets" if copies_into_backward else
           f"{more} with copies_into_backward=True (--offload-copies-into-backward) let")
    largest = max(n.bytes_per_group for n in names if n.groups > 0)
    return (f" Or keep them all where the memory allows: {bound_ms:.1f} ms per step of the waits are the "
            f"in-flight bound's, and {how} the copies out run on under the backward (each group more in flight "
            f"holds its bytes at the peak, up to {_size(largest)}).")


def _instead(names: Sequence[NameFigures], max_inflight_groups: int, copies_into_backward: bool) -> str:
    offloading = [n for n in names if n.groups > 0]
    known = [n for n in offloading if n.share is not None]
    total = sum(n.share for n in known)
    moved = sum(n.bytes_per_step for n in offloading)
    copy_ms = sum(n.groups * n.d2h_ms for n in offloading)
    rate = f"{_size(moved / copy_ms * 1e3)}/s out" if copy_ms > 0 else "no copy out timed"
    unknown = [n.name for n in offloading if n.share is None]
    left_out = f" ({', '.join(unknown)}: forward compute not measured, left out)" if unknown else ""
    out = sum(n.offload_wait_ms for n in names)  # for copies out, `flush` of it at the forward's end
    flush = sum(n.flush_wait_ms for n in names)
    waits_out = out >= sum(n.reload_wait_ms for n in names)
    if offloading and not unknown and total <= 1.0:
        head = (f"Instead: their copies out need {_percent(total)} of the forward compute they run under, so "
                "they fit at the measured rate")
        if waits_out:
            if 2 * flush > out:
                return (f"{head}; the waits come from the forward's end ({flush:.1f} of the {out:.1f} ms per step "
                        "for copies out): there the compute stream waits for the copies still in flight so that "
                        "the peak does not hold them, and a copy issued at the last layer's group open of its "
                        "name runs only under what is left of that layer (docs/design.md, Known limits); fewer "
                        "bytes in the last layers help there, and so does a name whose group opens early in each "
                        "layer (a norm), at whose open the copies decided before it are issued. "
                        f"Or {PLANNER}.")
            end = (f" ({out - flush:.1f} of the {out:.1f} ms per step for copies out; the rest at the forward's "
                   "end)") if flush >= 0.05 else ""
            return (f"{head}; the waits come from the in-flight bound{end}: max_inflight_groups="
                    f"{max_inflight_groups} lets {max_inflight_groups} group(s) copy at a time, so each copy has to "
                    f"end under the compute of the next {max_inflight_groups} group(s) of any name; raise it (each "
                    f"group more in flight holds its bytes at the peak). Or {PLANNER}.")
        on_demand = sum(n.reloads_on_demand for n in names)
        why = (f"; {round(on_demand, 1):g} reload(s) per step ran on demand, prefetched by nothing (a group "
               "whose inputs need no gradient: docs/design.md, Knowing where backward is)") if on_demand else ""
        return (f"{head}; the waits are for copies back, each of which runs under one layer of backward{why}: "
                f"offload fewer bytes per layer, or {PLANNER}.")
    best = fitting_subset(known)
    need = f"the copies out of all of them need {_percent(total)} of the forward compute they run under"
    bound_made_them = waits_out and 2 * flush <= out
    more = _more_in_flight(names, total, out - flush, max_inflight_groups, copies_into_backward) \
        if bound_made_them and not unknown else ""
    if not best:
        return (f"Instead: at the measured rate ({rate}) no one of them fits under its layer's forward compute"
                f"{left_out}; offload modules that save fewer bytes per layer, or {PLANNER}.{more}")
    subset = ",".join(n.name for n in best)
    return (f"Instead: at the measured rate ({rate}) {need}{left_out}; {', '.join(n.name for n in best)} "
            f"fit ({_percent(sum(n.share for n in best))}, {_size(sum(n.bytes_per_step for n in best))} per step "
            f"instead of {_size(moved)}): offload.configure(modules=\"{subset}\"); or {PLANNER}.{more}")


def copy_wait_notice(names: Sequence[NameFigures], step_ms: float, iterations: Sequence[int] = (),
                     max_inflight_groups: int = 1, copies_into_backward: bool = False) -> str | None:
    """The notice for these figures (``names``: one per group name; ``step_ms``: the measured
    step; ``iterations``: which were measured), or ``None`` when the compute stream waited for
    copies at most `THRESHOLD` of the step. Where most waits for copies out are at the
    forward's end and ``copies_into_backward`` is off, a last line says what it would do; where
    they are the in-flight bound's and the copies out would fit under the forward and the
    backward, the advice names one more group in flight (`_more_in_flight`)."""
    waited = sum(n.wait_ms for n in names)
    if step_ms <= 0 or waited <= THRESHOLD * step_ms:
        return None
    where = f"measured in iterations {', '.join(map(str, iterations))}; " if iterations else ""
    lines = [f"offload: copies made the compute stream wait {waited:.1f} ms per step, "
             f"{100 * waited / step_ms:.1f}% of the {step_ms:.1f} ms step (over {_percent(THRESHOLD)}; "
             f"{where}said once per process):"]
    lines += [_describe(n) for n in sorted(names, key=lambda n: -n.wait_ms)]
    lines.append(_instead(names, max_inflight_groups, copies_into_backward))
    out = sum(n.offload_wait_ms for n in names)
    if not copies_into_backward and 2 * sum(n.flush_wait_ms for n in names) > out:
        lines.append(INTO_BACKWARD)
    return "\n".join(lines)


def _layer_times(marks: Sequence[tuple]) -> Iterator[tuple[str, float]]:
    """(name, forward compute ms) from each group's close to the next of its name in the same
    chunk forward on the same stream, less the waits timed on that stream in between."""
    waited: dict[int, float] = {}  # id(stream) -> ms waited so far
    last: dict[tuple, tuple] = {}  # (handler, name) -> (layer, event, waited then, stream)
    for stream, key, a, b in marks:
        sid = id(stream)
        if key is None:  # a wait: a and b are the events around it
            waited[sid] = waited.get(sid, 0.0) + a.elapsed_time(b)
            continue
        now = waited.get(sid, 0.0)
        prev = last.get(key)
        if prev is not None and prev[0] == a - 1 and prev[3] is stream:
            yield key[1], max(0.0, prev[1].elapsed_time(b) - (now - prev[2]))
        last[key] = (a, b, now, stream)


def _figures(name: str, s: GroupStats, count: int, layers: list[float] | None) -> NameFigures:
    """``name``'s figures from its statistics summed over ``count`` iterations and its layer times."""
    groups, reloads = s.groups_offloaded, s.reloads_prefetched + s.reloads_on_demand
    return NameFigures(
        name=name, groups=groups / count, bytes_per_group=s.bytes_offloaded / groups if groups else 0.0,
        d2h_ms=s.d2h_ms / groups if groups else 0.0, h2d_ms=s.h2d_ms / reloads if reloads else 0.0,
        layer_ms=max(sum(layers) / len(layers), 1e-3) if layers else None,
        offload_wait_ms=s.offload_wait_ms / count, reload_wait_ms=s.reload_wait_ms / count,
        reloads_on_demand=s.reloads_on_demand / count, flush_wait_ms=s.flush_wait_ms / count,
    )


@dataclass
class _Measured:
    iteration: int
    start: Any  # the event of the end_iteration() before
    end: Any
    marks: list[tuple]


class CopyWaitProbe:
    """Measures the iterations the module docstring says and says the notice once.
    `offload.stats.StatsRecorder` drives it: `note_close` and `note_wait` while ``recording``
    (the hot path's only cost otherwise is reading that flag), `end_iteration`, `abort`.
    After the decision, ``figures``, ``step_ms`` and ``notice`` keep what was decided."""

    def __init__(self, streams: Any, max_inflight_groups: int = 1, copies_into_backward: bool = False) -> None:
        self.streams = streams
        self.max_inflight_groups = max_inflight_groups
        self.copies_into_backward = copies_into_backward
        self.recording = False  # the iteration in progress is measured
        self.done = False  # decided, or gave up: it measures nothing more
        self.figures: list[NameFigures] = []
        self.step_ms = 0.0
        self.notice: str | None = None
        self._ends = 0
        self._marks: list[tuple] = []  # (stream, (handler, name), layer, event) or (stream, None, before, after)
        self._spoilt = False
        self._last_end: Any = None
        self._measured: list[_Measured] = []
        self._totals: dict[str, GroupStats] = {}

    def note_close(self, group: Any) -> None:
        """A group of a measured iteration closed: mark the time on its stream (not under
        capture, which spoils the iteration instead)."""
        if group.capture is not None or self.streams.is_capturing():
            self._spoilt = True
            return
        event = self.streams.event(timing=True)
        event.record(group.stream)
        self._marks.append((group.stream, (group.handler, group.name), group.layer, event))

    def note_wait(self, stream: Any, before: Any, after: Any) -> None:
        """``stream`` waited for a copy between the timing events ``before`` and ``after``."""
        self._marks.append((stream, None, before, after))

    def abort(self) -> None:
        """`reset()` aborted the iteration in progress: it is not measured (up to the next
        ``end_iteration()``, which closes it, whatever ran after the reset)."""
        self._marks = []
        self._last_end = None

    def end_iteration(self, stats: IterationStats) -> bool:
        """The iteration of ``stats`` ended; whether the probe is done (decided or gave up)."""
        if self.done:
            return True
        self._ends += 1
        end = None
        if len(self._measured) < MEASURED and self._ends >= WARMUP and not self.streams.is_capturing():
            end = self.streams.event(timing=True)
            end.record(self.streams.current())
        closed = any(mark[1] is not None for mark in self._marks)  # a step without groups tells nothing
        if self.recording and closed and not self._spoilt and self._last_end is not None and end is not None:
            self._measured.append(_Measured(stats.iteration, self._last_end, end, self._marks))
            for name, s in stats.by_name.items():
                self._totals[name] = GroupStats.sum([self._totals.get(name, GroupStats()), s])
        self._marks, self._spoilt, self._last_end = [], False, end
        self.recording = end is not None and len(self._measured) < MEASURED
        if len(self._measured) == MEASURED and self._events_done():
            self._decide()
        self.done = self.done or self._ends >= GIVE_UP
        return self.done

    def _events_done(self) -> bool:
        for m in self._measured:
            if not (m.start.query() and m.end.query()):
                return False
            if not all(mark[3].query() for mark in m.marks):
                return False
        return True

    def _decide(self) -> None:
        count = len(self._measured)
        self.step_ms = sum(m.start.elapsed_time(m.end) for m in self._measured) / count
        layers: dict[str, list[float]] = {}
        for m in self._measured:
            for name, ms in _layer_times(m.marks):
                layers.setdefault(name, []).append(ms)
        for name, s in self._totals.items():
            if s.groups_offloaded or s.offload_wait_ms or s.reload_wait_ms:
                self.figures.append(_figures(name, s, count, layers.get(name)))
        iterations = [m.iteration for m in self._measured]
        self._measured, self._totals, self.done = [], {}, True
        self.notice = copy_wait_notice(self.figures, self.step_ms, iterations, self.max_inflight_groups,
                                       self.copies_into_backward)
        if self.notice is not None:
            say_once("copy_wait", self.notice, stacklevel=6)  # the caller of offload.end_iteration()
