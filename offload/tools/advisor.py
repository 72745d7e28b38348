"""The advisor's arithmetic: from a module profile and measured bandwidth, what offloading or
recomputing each set of module names frees at the memory peak, and what it costs in step time.

The model, on the profile's saved storages (`offload.tools.profile_modules`):

* **Offloaded bytes** follow the engine's rules (docs/design.md). A storage leaves the GPU if
  the engine may offload it (eligible) and *every* module instance that saved it is offloaded
  (a module that is not offloaded still holds it otherwise); it belongs to the last instance
  that saved it, and the last instance of each name is kept (its backward comes right after
  its forward).
* **At the peak** the groups the engine still holds in flight at the flush (the close of the
  forward's last offloaded group, where the compute stream waits for every copy) count by
  what they outweigh of what comes after that point: the bytes the rest of the forward saves
  and the backward's first buffers (the profile's peak less the memory allocated at the
  forward's end). The host is taken to be ahead of the GPU, so no copy is released before the
  engine waits for it.
* **Recomputed bytes**: recomputing a name drops the storages created inside its instances
  (outputs and internals) that anything saved, for every instance but the last one (whose
  recompute runs at the start of backward). Its inputs stay. A storage both recomputed and
  offloaded counts once, as recomputed. This is recompute that discards the module's output too
  (Megatron's output-discarding recompute), the advisor's ``--recompute-modules``.
* **Checkpointed regions** (``checkpoint=``; what `offload.plan` applies, through non-reentrant
  `torch.utils.checkpoint`): a region is a named module or a container of several (a layer, its
  MLP), given by the profile's ``regions`` facts (`offload.planner.structure`). Every save made
  inside a checkpointed instance is dropped; the instance saves its tensor inputs instead. A
  storage that nothing saves any more is recomputed (freed at the peak unless it belongs to the
  last instance, whose recompute runs at the start of backward; of several regions' last
  instances, recomputed and freed one after another, only the largest); one that a module outside still
  saves stays, so checkpointing a module alone frees only what nothing outside it saves. The
  inputs a checkpointed region keeps can be offloaded too (it is then a group of its own: the
  "memory-free" layer). Recompute costs the forward time of the named modules inside, once
  more, up to the region's last save: non-reentrant checkpointing stops recomputing there (the
  second matmul of an MLP, which saves only its input, is not run again). It lengthens the
  backward that hides the reloads.
* **Selective checkpointing** (``selective=``; `offload.planner.apply.SavedModules`): names
  inside a checkpointed container whose op outputs the checkpoint saves instead of recomputing
  (torch's selective-checkpoint policies, chosen by module). What such an instance creates is
  held from its forward to the region's backward, out of the engine's reach (the policy's cache
  holds it), including the outputs that nothing saves otherwise (the profile's ``unsaved`` rows,
  recorded by `offload.planner.structure.record`): memory the step without checkpointing never
  held. The recompute runs only the names that are not kept.
* **Forward time**: the engine's own schedule, simulated on the profile's forward (each module
  instance's measured forward time, scaled so that a layer takes the measured layer forward),
  with the host ahead of the GPU (a GPU-bound step), in the steady state: a group that is not
  the last of its name is known to be offloaded when it closes (from the chunk's previous
  forward), and its copy is issued at the next group open (Note [7] of `offload.copy_queue`);
  issued early by the host, it starts on the GPU as soon as its group closed, after the copies
  issued before it (one device-to-host stream). At an open, with ``max_inflight_groups=m``,
  the compute stream first waits for the oldest copies until ``m`` are in flight, then the
  open issues its copies; at the close of the forward's last offloaded group (the engine's
  flush) it waits for every copy. Those waits are the forward's exposed time
  (``forward_wait_ms``).
* **Backward time**: the reloads of one layer run one after another behind that layer's
  backward; what exceeds it is exposed (``backward_exposed_ms``).
* **Slowdown**: copies that overlap compute slow it by the probe's ``compute_slowdown``.
  Recomputing costs the module's forward time again. The host's own cost per group is not
  modelled (it matters only when the host, not the GPU, is the bottleneck).

``advise()`` classifies each name alone (free, better recomputed, costly, nothing to move),
chooses the **free set**: the names that, *together*, keep one layer's copies within the
headroom fraction of a layer's forward (and reloads of its backward) and cost at most
``free_cost_pct`` of the step (with ``max_inflight_groups`` 1, or the number of names per
layer where only that makes them free), greedily, largest gain at the peak first; and searches the
assignment (keep / offload / recompute per name) that meets a memory budget with the least
predicted cost.
"""

from __future__ import annotations

import itertools
import statistics
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from .bandwidth import Bandwidth
from .profile_modules import OTHER, split_label

DEFAULT_HEADROOM = 0.7
"""The free set's copies of one layer take at most this fraction of a layer's forward (and its
reloads of a layer's backward): bandwidth varies, compute slows down under copies, the host
adds latency."""

DEFAULT_FREE_COST_PCT = 2.0
"""... and its predicted cost is at most this much of the step time."""

EXHAUSTIVE_MAX_NAMES = 10
"""Above this many names the budget search is greedy instead of exhaustive."""


Label = tuple[str, int]
"""An instance: ``(name or region, index)``."""
Row = tuple[int, bool, list[Label | None]]
"""A saved storage as the offloading rules see it: bytes, eligible, savers (``None``: outside
every named module)."""


@dataclass
class Prediction:
    """What one assignment does, by the model above. Bytes per step, times in ms."""

    offload: list[str]
    recompute: list[str]
    max_inflight_groups: int = 1
    checkpoint: list[str] = field(default_factory=list)
    selective: list[str] = field(default_factory=list)
    offloaded_by_name: dict[str, int] = field(default_factory=dict)
    bytes_per_group: dict[str, int] = field(default_factory=dict)
    forward_wait_by_name: dict[str, float] = field(default_factory=dict)
    # memory, bytes per step
    offloaded_bytes: int = 0
    flush_bytes: int = 0  # in flight or decided, not yet waited for, when the forward's last group closes
    inflight_bytes: int = 0
    recomputed_bytes: int = 0  # net: less what selective checkpointing holds that nothing held before
    freed_at_peak: int = 0
    peak_bytes: int | None = None
    # time, ms
    d2h_ms_per_layer: float = 0.0
    h2d_ms_per_layer: float = 0.0
    forward_wait_ms: float = 0.0
    backward_exposed_ms: float = 0.0
    exposed_ms: float = 0.0
    slowdown_ms: float = 0.0
    recompute_ms: float = 0.0
    cost_ms: float = 0.0
    cost_pct: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def idle_offloads(self) -> list[str]:
        """The offloaded names or regions that move no bytes. Enabling one changes nothing but
        where the engine's flush falls (the close of the forward's last group), so the searches
        never choose one."""
        return [u for u in self.offload if not self.offloaded_by_name.get(u)]


@dataclass
class CheckpointFacts:
    """What checkpointed regions need beyond the profile's storages, from its ``regions`` entry
    (written by `offload.planner.structure.record`): the containers (modules holding several
    named modules), the container instances each name or container instance lies in, the storages
    each instance takes as tensor inputs (what its checkpoint saves), and, for saves made outside
    every named module, the container instances around each of them."""

    members: dict[str, list[str]]
    instances: dict[str, int]
    within: dict[Label, tuple[Label, ...]]
    inputs: dict[Label, list[int]]
    other: dict[int, list[tuple[Label, ...]]]

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "CheckpointFacts":
        containers = data["containers"]
        return cls(
            members={c: list(v["members"]) for c, v in containers.items()},
            instances={c: int(v["instances"]) for c, v in containers.items()},
            within={split_label(k): tuple(split_label(x) for x in v) for k, v in data["within"].items()},
            inputs={split_label(k): [int(x) for x in v] for k, v in data["inputs"].items()},
            other={int(k): [tuple(split_label(x) for x in st) for st in v] for k, v in data["other"].items()},
        )


class Model:
    """The profile's facts in the form the predictions need."""

    def __init__(self, profile: dict[str, Any], bandwidth: Bandwidth) -> None:
        for key in ("names", "modules", "storages", "close_order", "step_ms", "forward_ms", "backward_ms"):
            if key not in profile:
                raise ValueError(f"not a module profile: no {key!r} (make one with offload.tools.profile_modules)")
        self.profile = profile
        self.bw = bandwidth
        self.names: list[str] = list(profile["names"])
        self.instances = {n: len(profile["modules"][n]["fwd_ms"]) for n in self.names}
        self.layers = max(self.instances.values(), default=0)
        if self.layers < 1:
            raise ValueError("the profile has no module instances")
        self.fwd_window = profile["forward_ms"] / self.layers
        self.bwd_window = profile["backward_ms"] / self.layers
        self.close_order: list[tuple[str, int]] = [(n, int(i)) for n, i in profile["close_order"]]
        self.position = {x: k for k, x in enumerate(self.close_order)}
        self.storages = [self._parse(s) for s in profile["storages"]]
        self.segments = self._segments("fwd_ms", profile["forward_ms"])
        self.facts = CheckpointFacts.from_json(profile["regions"]) if profile.get("regions") else None
        self.containers: dict[str, list[str]] = dict(self.facts.members) if self.facts else {}
        self._close_at = dict(self.position)  # a container instance closes with its last named module
        self._open_at = dict(self.position)  # ... and opens with its first (a segment's start)
        for inst, around in (self.facts.within.items() if self.facts else ()):
            for c in around:
                if inst in self.position:
                    self._close_at[c] = max(self._close_at.get(c, -1), self.position[inst])
                    self._open_at[c] = min(self._open_at.get(c, len(self.close_order)), self.position[inst])
        self._saves_any: set[Label] = set()  # instances that save anything, and those that save
        self._saves_own: set[Label] = set()  # something they created (not only their inputs)
        for _, _, savers, created in self.storages:
            for s in savers:
                if s is not None:
                    self._saves_any.add(s)
                    if s == created:
                        self._saves_own.add(s)
        self._checkpointed_rows: dict[tuple[frozenset[str], frozenset[str]], tuple[list[Row], int, float]] = {}
        # what the step's peak holds beyond the forward's end: the backward's first buffers
        end, peak = profile.get("forward_end_allocated"), profile.get("peak_allocated")
        self.backward_buffers = max(0, peak - end) if end is not None and peak is not None else 0

    def _segments(self, key: str, total: float) -> list[float]:
        """Compute time from the close of the previous instance to the close of each instance in
        ``close_order``: the instance's own measured time, all of them scaled so that they add up
        to the whole model's measured ``total`` (the compute between modules, spread over them)."""
        own = [self._module_ms(n, i, key) for n, i in self.close_order]
        s = sum(own)
        if not own:
            return []
        if s <= 0:
            return [total / len(own)] * len(own)
        return [x * total / s for x in own]

    def _module_ms(self, name: str, i: int, key: str = "fwd_ms") -> float:
        """Instance ``i`` of ``name``'s measured time (0 where the profile has none)."""
        v = self.profile["modules"].get(name, {}).get(key, [])
        return float(v[i]) if i < len(v) and v[i] is not None else 0.0

    @staticmethod
    def _parse(s: dict[str, Any]) -> tuple[int, bool, list[tuple[str, int] | None], tuple[str, int] | None]:
        savers = [None if x == OTHER else split_label(x) for x in s["savers"]]
        created = split_label(s["created_in"]) if s.get("created_in") else None
        return int(s["bytes"]), bool(s["eligible"]), savers, created

    def is_last(self, name: str, i: int) -> bool:
        """Whether ``i`` is the last instance of a name or container."""
        return i == self._instances(name) - 1

    def members(self, region: str) -> list[str]:
        """The named modules a region holds: itself for a name, its members for a container."""
        return self.containers.get(region, [region])

    def inside(self, inner: str, outer: str) -> bool:
        """Whether region ``inner`` lies within region ``outer`` (and is not it)."""
        return inner != outer and set(self.members(inner)) <= set(self.members(outer))

    def saved_bytes(self) -> int:
        """Every storage the step saves, once."""
        return sum(nbytes for nbytes, _, savers, _ in self.storages if savers)

    def recompute_ms(self, name: str) -> float:
        """The forward time of every instance of ``name``: what recomputing it costs per step."""
        return sum(v for v in self.profile["modules"][name]["fwd_ms"] if v is not None)

    def _instances(self, unit: str) -> int:
        """How many instances a name or container has."""
        return self.instances[unit] if unit in self.instances else self.facts.instances[unit]

    def forward_schedule(self, by_group: dict[Label, int], units: Iterable[str],
                         inflight: int) -> tuple[dict[str, float], tuple[int, int] | None]:
        """The engine's forward schedule for the groups of ``units`` (module docstring): the
        compute stream's waits for device-to-host copies, in ms per name of the group waited
        for; and the flush (``None`` without groups): the bytes held in flight just before it
        and its position in ``close_order``."""
        waits: dict[str, float] = {}
        opens: dict[int, list[Label]] = {}
        closes: dict[int, list[Label]] = {}
        for unit in units:
            for i in range(self._instances(unit)):
                if (unit, i) in self._close_at:
                    opens.setdefault(self._open_at[(unit, i)], []).append((unit, i))
                    closes.setdefault(self._close_at[(unit, i)], []).append((unit, i))
        t = 0.0  # the compute stream's clock, waits included
        d2h_free = 0.0
        ready: dict[Label, float] = {}
        deferred: list[Label] = []
        pending: deque[tuple[float, Label]] = deque()  # (copy end, group), issue order
        flush: tuple[int, int] | None = None
        last_close = max(closes, default=-1)  # the forward's last group closes there

        def wait_for(end: float, group: Label) -> None:
            nonlocal t
            if end > t:
                waits[group[0]] = waits.get(group[0], 0.0) + end - t
                t = end

        def issue() -> None:
            nonlocal d2h_free
            for g in deferred:
                d2h_free = max(ready[g], d2h_free) + self.bw.copy_ms("d2h", by_group[g])
                pending.append((d2h_free, g))
            deferred.clear()

        for k, seg in enumerate(self.segments):
            if k in opens:  # a group opens: the bound applies, then the deferred copies are issued
                while len(pending) > inflight:
                    wait_for(*pending.popleft())
                issue()
            t += seg
            for unit, i in closes.get(k, ()):
                ready[(unit, i)] = t
                if (unit, i) in by_group and i < self._instances(unit) - 1:
                    deferred.append((unit, i))
            if k == last_close:  # the forward's end: the flush
                flush = (sum(by_group[g] for _, g in pending) + sum(by_group[g] for g in deferred), k)
                issue()
                while pending:
                    wait_for(*pending.popleft())
        return waits, flush

    def _saved_after(self, rows: list[Row], position: int) -> int:
        """The bytes of ``rows`` first saved after the instance at ``position`` in ``close_order``
        closed: memory that the forward adds after that point."""
        out = 0
        for nbytes, _, savers in rows:
            at = [self._close_at.get(s, -1) for s in savers if s is not None]
            if at and min(at) > position:
                out += nbytes
        return out

    def _recomputed_rows(self, rec: set[str]) -> tuple[list[Row], int, float]:
        """The storages under output-discarding recompute of the names ``rec``: those created
        inside them are gone (freed unless created in the last instance)."""
        rows: list[Row] = []
        freed = 0
        for nbytes, eligible, savers, created in self.storages:
            if not savers:  # nothing saves it: nothing to recompute
                continue
            if created is not None and created[0] in rec:
                if not self.is_last(*created):
                    freed += nbytes
                continue
            rows.append((nbytes, eligible, savers))
        return rows, freed, sum(self.recompute_ms(n) for n in rec)

    def _checkpoint_rows(self, regions: frozenset[str],
                         selective: frozenset[str] = frozenset()) -> tuple[list[Row], int, float]:
        """The storages with ``regions`` checkpointed and the names ``selective`` kept inside
        them (module docstring), the net bytes freed at the peak (recomputed, less what the
        checkpoints hold that nothing saved before), and the recompute time. Cached."""
        if (regions, selective) in self._checkpointed_rows:
            return self._checkpointed_rows[(regions, selective)]
        f = self.facts

        def checkpointed(inst: Label) -> Label | None:
            """The checkpointed instance that ``inst`` is or lies in."""
            if inst[0] in regions:
                return inst
            return next((c for c in f.within.get(inst, ()) if c[0] in regions), None)

        takers: dict[int, list[Label]] = {}  # storage -> checkpointed instances that take it as input
        for inst, storages in f.inputs.items():
            if inst[0] in regions:
                for k in storages:
                    takers.setdefault(k, []).append(inst)
        rows: list[Row] = []
        freed = 0
        in_last: dict[Label, int] = {}  # a last instance -> what only it recomputes
        for k, (nbytes, eligible, savers, created) in enumerate(self.storages):
            kept: list[Label | None] = []
            dropped: list[Label] = []
            for s in savers:
                if s is None:  # saved outside named modules: kept if one such save is outside every region
                    stacks = f.other.get(k, [()])
                    inner = [next((c for c in st if c[0] in regions), None) for st in stacks]
                    if None in inner:
                        kept.append(None)
                    dropped += [c for c in inner if c is not None]
                    continue
                c = checkpointed(s)
                if c is None:
                    kept.append(s)
                else:  # the checkpoint saves its inputs where the module inside saved them
                    dropped.append(c)
                    if c in takers.get(k, ()):
                        kept.append(c)
            kept += takers.get(k, [])
            cached = checkpointed(created) if created is not None and created[0] in selective else None
            if cached is not None:  # the policy's cache holds it until the region's backward
                kept.append(cached)
                eligible = False
            kept = list(dict.fromkeys(kept))
            if kept:
                rows.append((nbytes, eligible, kept))
                if not savers:  # held now, by a checkpoint, where nothing held it before
                    freed -= nbytes
            elif dropped:
                last = {c for c in dropped if self.is_last(*c)}
                if not last:
                    freed += nbytes
                elif len(last) == 1:
                    (c,) = last
                    in_last[c] = in_last.get(c, 0) + nbytes
        # the last instances recompute one after another at the start of backward, each freed
        # after its own backward: at the peak only the largest one's is held
        freed += sum(in_last.values()) - max(in_last.values(), default=0)
        ms = 0.0
        inside: dict[Label, list[Label]] = {}  # checkpointed instance -> its named instances, in order
        for inst in self.close_order:
            c = checkpointed(inst)
            if c is not None:
                inside.setdefault(c, []).append(inst)
        for members in inside.values():
            ms += self._recompute_until_last_save(members, selective)
        self._checkpointed_rows[(regions, selective)] = result = (rows, freed, ms)
        return result

    def recomputed_members(self, members: list[Label]) -> list[Label]:
        """The instances among ``members`` (one checkpointed instance's, in order) that its
        recompute runs: non-reentrant checkpointing stops the recompute at the last tensor the
        region saved (early stop), so the modules after the last one that saves do not run, nor
        does that one when it saves only its inputs, which autograd saves before the op runs
        (the second matmul of an MLP)."""
        saving = [k for k, inst in enumerate(members) if inst in self._saves_any]
        if not saving:
            return []
        last = saving[-1]
        return members[:last + 1] if members[last] in self._saves_own else members[:last]

    def _recompute_until_last_save(self, members: list[Label], selective: frozenset[str] = frozenset()) -> float:
        """What recomputing one checkpointed instance costs: the forward time of the instances
        its recompute runs (`recomputed_members`), except those whose outputs it kept."""
        return sum(self._module_ms(n, i) for n, i in self.recomputed_members(members) if n not in selective)

    def _check_assignment(self, offload: list[str], recompute: list[str], checkpoint: list[str],
                          selective: list[str], max_inflight_groups: int) -> None:
        regions = set(self.names) | set(self.containers)
        unknown = sorted((set(offload) - regions) | (set(recompute) - set(self.names)) | (set(checkpoint) - regions)
                        | (set(selective) - regions))
        if unknown:
            raise ValueError(f"unknown module name(s) {unknown}; the profile has {self.names}"
                             + (f" and the regions {sorted(self.containers)}" if self.containers else ""))
        if set(offload) & set(recompute):
            raise ValueError(f"a name cannot be both offloaded and recomputed: {sorted(set(offload) & set(recompute))}")
        if max_inflight_groups < 1:
            raise ValueError(f"max_inflight_groups must be >= 1, got {max_inflight_groups}")
        if set(selective) - set(self.names):
            raise ValueError(f"selective takes module names, not regions: {sorted(set(selective) - set(self.names))}")
        loose = [n for n in selective if not any(self.inside(n, c) and c in self.containers for c in checkpoint)]
        if loose:
            raise ValueError("selective names are kept by a checkpointed container around them; "
                             f"none is around {loose}")
        for c in checkpoint:
            if c in self.containers and set(self.members(c)) <= set(selective):
                raise ValueError(f"checkpointed region {c!r} keeps every name inside it: it recomputes nothing")
        if not checkpoint:
            if set(offload) & set(self.containers):
                raise ValueError(f"a region is offloaded (its inputs) only when checkpointed: "
                                 f"{sorted(set(offload) & set(self.containers))}")
            return
        if self.facts is None:
            raise ValueError("checkpointed regions need the profile's 'regions' facts (offload.plan records them)")
        if recompute:
            raise ValueError("recompute (output discarded) and checkpoint regions cannot be combined")
        for a in checkpoint:
            for b in checkpoint:
                if self.inside(a, b):
                    raise ValueError(f"checkpointed region {a!r} lies inside checkpointed region {b!r}")
        for x in offload:
            outer = [c for c in checkpoint if self.inside(x, c)]
            if outer:
                raise ValueError(f"{x!r} runs inside checkpointed region {outer[0]!r}: it saves nothing to offload")
            if x in self.containers and x not in checkpoint:
                raise ValueError(f"a region is offloaded (its inputs) only when checkpointed: {x!r}")

    def predict(self, offload: Iterable[str] = (), recompute: Iterable[str] = (),
                max_inflight_groups: int = 1, checkpoint: Iterable[str] = (),
                selective: Iterable[str] = ()) -> Prediction:
        """What offloading ``offload`` does with ``recompute`` recomputed (output discarded) or
        ``checkpoint`` checkpointed, keeping the outputs of the names ``selective`` inside them;
        a checkpointed region in ``offload`` offloads its inputs."""
        offload, recompute, checkpoint, selective = list(offload), list(recompute), list(checkpoint), list(selective)
        self._check_assignment(offload, recompute, checkpoint, selective, max_inflight_groups)
        off = set(offload)
        pred = Prediction(offload=offload, recompute=recompute, max_inflight_groups=max_inflight_groups,
                          checkpoint=checkpoint, selective=selective)
        if checkpoint:
            rows, pred.recomputed_bytes, pred.recompute_ms = self._checkpoint_rows(frozenset(checkpoint),
                                                                                  frozenset(selective))
        else:
            rows, pred.recomputed_bytes, pred.recompute_ms = self._recomputed_rows(set(recompute))
        by_group: dict[Label, int] = {}
        for nbytes, eligible, savers in rows:
            if not eligible or not savers or any(s is None or s[0] not in off for s in savers):
                continue
            owner = savers[-1]
            if self.is_last(*owner):
                continue
            by_group[owner] = by_group.get(owner, 0) + nbytes
        pred.offloaded_bytes = sum(by_group.values())
        for (n, _), b in by_group.items():
            pred.offloaded_by_name[n] = pred.offloaded_by_name.get(n, 0) + b
        waits, flush = self.forward_schedule(by_group, off, max_inflight_groups)
        pred.forward_wait_by_name = waits
        pred.forward_wait_ms = sum(waits.values())
        if flush is not None:
            held, at = flush
            pred.flush_bytes = held
            # what the flush frees counts at the peak only by what it holds beyond what comes
            # after it (the rest of the forward, the backward's first buffers)
            pred.inflight_bytes = max(0, held - self._saved_after(rows, at) - self.backward_buffers)
        pred.freed_at_peak = pred.offloaded_bytes - pred.inflight_bytes + pred.recomputed_bytes
        peak = self.profile.get("peak_allocated")
        pred.peak_bytes = None if peak is None else peak - pred.freed_at_peak
        # one layer's copies, each at the bandwidth of its size
        groups_per_name: dict[str, list[int]] = {}
        for (n, _), b in by_group.items():
            groups_per_name.setdefault(n, []).append(b)
        pred.bytes_per_group = {n: int(statistics.median(v)) for n, v in groups_per_name.items()}
        pred.d2h_ms_per_layer = sum(self.bw.copy_ms("d2h", b) for b in pred.bytes_per_group.values())
        pred.h2d_ms_per_layer = sum(self.bw.copy_ms("h2d", b) for b in pred.bytes_per_group.values())
        layers = max((len(v) for v in groups_per_name.values()), default=0)
        # a checkpointed region recomputes in backward: more compute for the reloads to hide behind
        wb = self.bwd_window + (pred.recompute_ms / self.layers if checkpoint else 0.0)
        d, h, wf = pred.d2h_ms_per_layer, pred.h2d_ms_per_layer, self.fwd_window
        pred.backward_exposed_ms = layers * max(0.0, h - wb)
        pred.exposed_ms = pred.forward_wait_ms + pred.backward_exposed_ms
        pred.slowdown_ms = layers * self.bw.compute_slowdown * (min(d, wf) + min(h, wb))
        pred.cost_ms = pred.exposed_ms + pred.slowdown_ms + pred.recompute_ms
        pred.cost_pct = 100 * pred.cost_ms / self.profile["step_ms"]
        return pred

    def copy_fraction(self, pred: Prediction) -> float:
        """One layer's copies (all its offloaded names, one after another on the one copy
        stream) over one layer's compute, the larger of forward and backward."""
        return max(pred.d2h_ms_per_layer / self.fwd_window if self.fwd_window > 0 else float("inf"),
                   pred.h2d_ms_per_layer / self.bwd_window if self.bwd_window > 0 else float("inf"))

    def is_free(self, pred: Prediction, headroom: float, free_cost_pct: float) -> bool:
        """Frees something, its copies fit the headroom, and it costs at most ``free_cost_pct``."""
        return (pred.offloaded_bytes > 0 and self.copy_fraction(pred) <= headroom
                and pred.cost_pct <= free_cost_pct)


def classify(model: Model, name: str, headroom: float,
             free_cost_pct: float = DEFAULT_FREE_COST_PCT) -> dict[str, Any]:
    """One name alone: ``free``, ``recompute`` (better recomputed), ``costly`` or ``nothing``.
    ``free`` is for the name alone: names free alone are not free together (the free set)."""
    off = model.predict(offload=[name])
    rec = model.predict(recompute=[name])
    fraction = model.copy_fraction(off)
    if off.offloaded_bytes == 0:
        verdict = "nothing"
        why = "saves nothing the engine can move (too small, or held by another module)"
    elif model.is_free(off, headroom, free_cost_pct):
        verdict, why = "free", f"alone, one layer's copies take {fraction:.0%} of its compute, cost {off.cost_pct:.1f}%"
    elif rec.recomputed_bytes >= off.freed_at_peak and rec.cost_ms < off.cost_ms:
        verdict, why = "recompute", (f"copies take {fraction:.0%} of a layer's compute; recomputing frees as much "
                                     f"for {rec.cost_ms:.2f} ms")
    else:
        verdict, why = "costly", f"copies take {fraction:.0%} of a layer's compute, cost {off.cost_pct:.1f}%"
    return {"name": name, "verdict": verdict, "why": why, "copy_fraction": fraction,
            "offload": off.as_dict(), "recompute": rec.as_dict()}


def _free_candidate(model: Model, names: list[str], headroom: float, free_cost_pct: float) -> Prediction | None:
    """The best free prediction for offloading ``names``: ``max_inflight_groups`` 1, or the
    number of names per layer that move bytes if only that is free (it holds more at the peak)."""
    best = None
    first = model.predict(offload=names)
    per_layer = len(first.bytes_per_group)
    for m in sorted({1, max(1, per_layer)}):
        p = first if m == 1 else model.predict(offload=names, max_inflight_groups=m)
        if model.is_free(p, headroom, free_cost_pct) and (best is None or p.freed_at_peak > best.freed_at_peak):
            best = p
    return best


def free_set(model: Model, headroom: float = DEFAULT_HEADROOM,
             free_cost_pct: float = DEFAULT_FREE_COST_PCT) -> Prediction:
    """The names to offload together while the set stays free: the *sum* of one layer's copies
    (one copy stream) within ``headroom`` of a layer's compute, and the set's own predicted cost
    within ``free_cost_pct``. Greedy: repeatedly add the name that frees the most more memory at
    the peak (ties: more bytes per copy-millisecond), as long as the set stays free; few large
    groups are preferred to many small ones (each group also costs host time). An empty
    prediction when no name is free."""
    chosen: list[str] = []
    best = model.predict()
    while True:
        options = []
        for n in model.names:
            if n in chosen:
                continue
            p = _free_candidate(model, chosen + [n], headroom, free_cost_pct)
            if p is None:
                continue
            gain = p.freed_at_peak - best.freed_at_peak
            extra = p.d2h_ms_per_layer - best.d2h_ms_per_layer
            if gain > 0 and not p.idle_offloads:
                options.append((gain, gain / max(extra, 1e-9), -len(options), n, p))
        if not options:
            return best
        *_, n, best = max(options)
        chosen.append(n)


def search(model: Model, budget: int, allow_recompute: bool) -> tuple[Prediction, bool]:
    """The assignment with the least predicted cost whose predicted peak is at most ``budget``
    (ties: more memory freed); if none reaches it, the one with the lowest peak. Returns it and
    whether it meets the budget. With the engine's default ``max_inflight_groups=1``."""
    choices = ("keep", "offload", "recompute") if allow_recompute else ("keep", "offload")
    names = model.names

    def evaluate(assign: dict[str, str]) -> Prediction:
        return model.predict([n for n in names if assign[n] == "offload"],
                             [n for n in names if assign[n] == "recompute"])

    def fits(p: Prediction) -> bool:
        return p.peak_bytes is not None and p.peak_bytes <= budget

    def key(p: Prediction) -> tuple:  # an assignment with an idle offload after every other
        idle = bool(p.idle_offloads)
        return (idle, 0, p.cost_ms, -p.freed_at_peak) if fits(p) else (idle, 1, -p.freed_at_peak, p.cost_ms)

    if len(names) <= EXHAUSTIVE_MAX_NAMES:
        best = min((evaluate(dict(zip(names, combo))) for combo in itertools.product(choices, repeat=len(names))),
                   key=key)
    else:  # greedy: repeatedly take the change that frees the most per ms of cost
        assign = {n: "keep" for n in names}
        best = evaluate(assign)
        while not fits(best):
            options = []
            for n in names:
                for c in choices:
                    if c != assign[n]:
                        p = evaluate({**assign, n: c})
                        gain = p.freed_at_peak - best.freed_at_peak
                        if gain > 0:
                            options.append((gain / max(p.cost_ms - best.cost_ms, 1e-3), n, c, p))
            if not options:
                break
            _, n, c, best = max(options, key=lambda o: o[0])
            assign[n] = c
    fits = best.peak_bytes is not None and best.peak_bytes <= budget
    return best, fits


def flags(offload: list[str], recompute: list[str], max_inflight_groups: int = 1) -> str:
    """The command-line settings for an assignment (the Megatron integration's flags)."""
    parts = [f"--offload-modules={','.join(offload)}" if offload else ""]
    if offload and max_inflight_groups != 1:
        parts.append(f"--offload-max-inflight-groups={max_inflight_groups}")
    if recompute:
        parts.append(f"--recompute-modules={','.join(recompute)}")
    return " ".join(p for p in parts if p) or "(nothing to offload or recompute)"


def advise(profile: dict[str, Any], bandwidth: Bandwidth, budget: int | None = None,
           headroom: float = DEFAULT_HEADROOM, allow_recompute: bool = True,
           free_cost_pct: float = DEFAULT_FREE_COST_PCT) -> dict[str, Any]:
    """Per-name verdicts, the free set, and (with ``budget``) the cheapest assignment meeting it,
    with and without recompute."""
    if not 0 < headroom <= 1:
        raise ValueError(f"headroom must be in (0, 1], got {headroom}")
    if free_cost_pct < 0:
        raise ValueError(f"free_cost_pct must be >= 0, got {free_cost_pct}")
    model = Model(profile, bandwidth)
    rows = [classify(model, n, headroom, free_cost_pct) for n in model.names]
    fp = free_set(model, headroom, free_cost_pct)
    free = list(fp.offload)
    out: dict[str, Any] = {
        "tool": "advise", "workload": profile.get("workload"), "device": profile.get("device"),
        "headroom": headroom, "free_cost_pct": free_cost_pct, "layers": model.layers, "step_ms": profile["step_ms"],
        "forward_window_ms": model.fwd_window, "backward_window_ms": model.bwd_window,
        "compute_slowdown": bandwidth.compute_slowdown, "peak_allocated": profile.get("peak_allocated"),
        "modules": rows, "free": free, "free_max_inflight_groups": fp.max_inflight_groups,
        "free_copy_fraction": model.copy_fraction(fp), "free_prediction": fp.as_dict(),
        "free_flags": flags(free, [], fp.max_inflight_groups),
    }
    alone = [r["name"] for r in rows if r["verdict"] == "free"]
    if len(alone) > 1:  # what the names free alone would cost together (why the set is smaller)
        together = model.predict(offload=alone)
        out["free_alone_together"] = {"offload": alone, "copy_fraction": model.copy_fraction(together),
                                      "cost_pct": together.cost_pct, "freed_at_peak": together.freed_at_peak}
    if budget is not None:
        if profile.get("peak_allocated") is None:
            raise ValueError("a memory budget needs a profile with a measured peak (run it on the GPU)")
        for key, recompute in (("budget", allow_recompute), ("budget_offload_only", False)):
            pred, fits = search(model, budget, recompute)
            out[key] = {"budget_bytes": budget, "meets_budget": fits, "prediction": pred.as_dict(),
                        "flags": flags(pred.offload, pred.recompute)}
            if not allow_recompute:
                break
    return out
