"""Pipeline schedules on the CPU fallback: one rank's exact order replayed on one process.

For many (PP, VPP, microbatches, rank) the replays check, with and without the schedule handed
to the engine (`offload.set_schedule`): gradients bitwise equal to no offloading; the last-layer
rule applied at exactly the forwards `kept_last_group` names; every reload prefetched (none on
demand); the handler deque in backward order; no handler left after the iteration.
"""

from __future__ import annotations

import copy

import pytest
import torch

import offload
from conftest import CPU_PIPELINE_GRID as GRID, gpt_chunks
from offload.errors import OffloadError
from offload.group_policy import GroupInfo, by_layer, by_name, min_live, warmup_only
from offload.chunk_lifecycle import ChunkLifecycle
from offload.manager import PipelineOffloadManager
from offload.schedules import SchedulePlan, backward_order, kept_last_group, schedule_events, schedule_order
from offload.testing import GPT_MAPPING, first_difference, replay_order

SHAPE = (8, 2, 32)
NAMES = ["core_attn", "fc1"]


def _chunks(vpp: int, layers: int = 3) -> list[torch.nn.Module]:
    return gpt_chunks(vpp, 32, 4, layers)


def _attach(chunks: list[torch.nn.Module]) -> None:
    for c, chunk in enumerate(chunks):
        offload.attach(chunk, GPT_MAPPING, chunk_id=c)


class _Spy:
    """Records the kept decision of each handler and the deque order at each backward start."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.kept: dict[tuple[int, int], bool] = {}
        self.backward_starts: list[tuple[int, int]] = []
        self.deque_at_start: list[list[tuple[int, int]]] = []
        real = ChunkLifecycle.begin_backward
        spy = self

        def begin_backward(chunks, handler):
            spy.kept[(handler.chunk_id, handler.microbatch)] = bool(handler.pending)
            spy.backward_starts.append((handler.chunk_id, handler.microbatch))
            spy.deque_at_start.append(
                [(h.chunk_id, h.microbatch) for h in chunks.order.handlers if h.phase.name != "BACKWARD"]
            )
            real(chunks, handler)

        monkeypatch.setattr(ChunkLifecycle, "begin_backward", begin_backward)


@pytest.mark.parametrize("with_schedule", [True, False], ids=["order", "inferred"])
@pytest.mark.parametrize("pp,vpp,m,rank", GRID)
def test_replay(configure, monkeypatch, pp, vpp, m, rank, with_schedule):
    order = schedule_order(pp, vpp, m, rank)
    ref_chunks = _chunks(vpp)
    chunks = copy.deepcopy(ref_chunks)
    ref = replay_order(ref_chunks, order, SHAPE, seed=pp * 100 + m + rank)

    manager = configure(NAMES)
    _attach(chunks)
    spy = _Spy(monkeypatch)
    if with_schedule:
        offload.set_schedule(order)
    got = replay_order(chunks, order, SHAPE, seed=pp * 100 + m + rank)
    stats = offload.end_iteration()

    assert first_difference(ref, got) is None
    expected_kept = {
        (chunk, mb): kept
        for (kind, chunk, mb), kept in zip(schedule_events(order), kept_last_group(order))
        if kind == "F"
    }
    assert spy.kept == expected_kept
    # the handlers still waiting for their backward are queued in backward order
    bwd = backward_order(order)
    assert spy.backward_starts == bwd
    for i, queued in enumerate(spy.deque_at_start):
        assert queued == [key for key in bwd[i:] if key in queued]
    # every reload is prefetched, but those of the iteration's first backward when it does not
    # follow its own forward: nothing ran before it that could have (one group per name)
    total = stats.total()
    assert total.reloads_on_demand == (0 if expected_kept[bwd[0]] else len(NAMES))
    assert total.reloads_prefetched > 0
    assert total.groups_kept == 2 * sum(expected_kept.values())
    assert manager.live_handlers == []


@pytest.mark.parametrize("with_schedule", [True, False], ids=["order", "inferred"])
def test_a_forward_whose_own_backward_is_not_next_is_over_when_the_model_returns(configure, monkeypatch,
                                                                                 with_schedule):
    """`offload.chunk_lifecycle`, the forward's end: with the schedule, a chunk forward that
    another chunk's backward follows offloads its last groups when the attached model returns,
    and that backward's start waits for their copies and frees them, so nothing of another
    chunk is in flight once a backward has begun. Without the schedule the engine cannot know
    at the return: the last groups wait for the next chunk, and their copies, issued at that
    backward's start, are in flight through its first groups (each a step's peak on two H200s,
    PP=2 VPP=2, Megatron's dense GPT at 16K: 578 MiB more there). Gradients are exact."""
    order = schedule_order(2, 2, 8, 0)
    ref = replay_order(_chunks(2), order, SHAPE)
    manager = configure(NAMES)
    chunks = _chunks(2)
    _attach(chunks)
    offload.set_schedule(order if with_schedule else None)
    own_backward_next = {(c, m): kept for (kind, c, m), kept in zip(schedule_events(order), kept_last_group(order))
                         if kind == "F"}
    pending_at_return: dict[tuple[int, int], bool] = {}
    others_in_flight: list[int] = []
    real_return, real_begin = PipelineOffloadManager.model_forward_returned, ChunkLifecycle.begin_backward

    def model_forward_returned(self):
        handler = self.chunks.forward
        real_return(self)
        pending_at_return[(handler.chunk_id, handler.microbatch)] = bool(handler.pending)

    def begin_backward(lifecycle, handler):
        real_begin(lifecycle, handler)
        others_in_flight.append(sum(g.handler is not handler for g in lifecycle.copies.inflight))

    monkeypatch.setattr(PipelineOffloadManager, "model_forward_returned", model_forward_returned)
    monkeypatch.setattr(ChunkLifecycle, "begin_backward", begin_backward)
    got = replay_order(chunks, order, SHAPE)
    offload.end_iteration()

    assert first_difference(ref, got) is None
    assert manager.live_handlers == []
    if with_schedule:
        assert pending_at_return == own_backward_next  # pending only where the last-layer rule keeps them
        assert others_in_flight == [0] * len(others_in_flight)
    else:
        assert all(pending_at_return.values())
        assert max(others_in_flight) == len(NAMES)  # the last groups of the forward before


def test_inferred_order_with_a_partial_last_group(configure):
    """Megatron allows a last microbatch group smaller than the others (here 8 microbatches in
    groups of 3): without the schedule the engine cannot know where the last group ends, so a
    few reloads are done on demand; with it, none. Gradients are exact either way."""
    order = schedule_order(2, 2, 8, 0, microbatch_group_size=3)
    ref = replay_order(_chunks(2), order, SHAPE)
    on_demand = {}
    for with_schedule in (False, True):
        configure(NAMES)
        chunks = _chunks(2)
        _attach(chunks)
        offload.set_schedule(order if with_schedule else None)
        got = replay_order(chunks, order, SHAPE)
        on_demand[with_schedule] = offload.end_iteration().total().reloads_on_demand
        assert first_difference(ref, got) is None
    first = len(NAMES)  # the first backward's last groups (see test_replay)
    assert on_demand[True] == first
    assert first < on_demand[False] <= first + 2 * len(NAMES)


def test_schedule_plan_matches_the_order():
    for pp, vpp, m, rank in GRID:
        order = schedule_order(pp, vpp, m, rank)
        plan = SchedulePlan(order)
        events = schedule_events(order)
        fwd = [(c, mb) for kind, c, mb in events if kind == "F"]
        assert [(f.chunk_id, f.microbatch) for f in plan.forwards] == fwd
        assert plan.backwards == backward_order(order)
        assert [f.keeps_last_group for f in plan.forwards] == [
            k for (kind, _, _), k in zip(events, kept_last_group(order)) if kind == "F"
        ]
        first_b = next(i for i, e in enumerate(events) if e[0] == "B")
        assert [f.phase for f in plan.forwards] == [
            "warmup" if i < first_b else "steady" for i, e in enumerate(events) if e[0] == "F"
        ]
        assert plan.max_live == max(f.live for f in plan.forwards)
        chain = [plan.backwards[0]]
        while (nxt := plan.successor(*chain[-1])) is not None:
            chain.append(nxt)
        assert chain == plan.backwards
        assert plan.num_chunks == vpp
    # the first rank of a deep pipeline holds the most microbatches
    assert SchedulePlan(schedule_order(4, 1, 8, 0)).max_live == 4
    assert SchedulePlan(schedule_order(4, 1, 8, 3)).max_live == 1


def test_schedule_plan_rejects_an_incomplete_order():
    with pytest.raises(ValueError, match="without their backwards"):
        SchedulePlan([1, 1, -1])
    with pytest.raises(ValueError, match="before its forward"):
        SchedulePlan([-1, 1])


# ---------------------------------------------------------------- iterations that change
def test_iterations_that_change(configure):
    """Different microbatch counts, evaluation passes (no_grad and a forward whose graph is
    dropped), and microbatches of different sizes (MoE token counts): exact gradients, no
    handler left, and the pinned pool stops growing once every size has been seen."""
    pp, vpp = 2, 2
    ref_chunks = _chunks(vpp)
    chunks = copy.deepcopy(ref_chunks)
    manager = configure(NAMES)
    _attach(chunks)
    cycle = [(2, 8), (4, 12), (6, 8), (2, 16), (4, 16), (6, 12)]
    plan_counts, tokens = zip(*(cycle * 2))
    allocations = []
    for it, (m, seq) in enumerate(zip(plan_counts, tokens)):
        order = schedule_order(pp, vpp, m, it % pp)
        shape = (seq, 2, 32)
        ref = replay_order(ref_chunks, order, shape, seed=it)
        offload.set_schedule(order if it % 2 else None)
        got = replay_order(chunks, order, shape, seed=it)
        offload.end_iteration()
        assert first_difference(ref, got) is None, it
        assert manager.live_handlers == []
        allocations.append(manager.pool.allocations)
        # evaluation between training iterations
        with torch.no_grad():
            for chunk in chunks:
                chunk(torch.randn(shape))
        offload.set_schedule(None)
        for chunk in chunks:
            chunk(torch.randn(shape, requires_grad=True))  # graph dropped without backward
        offload.end_iteration()
        assert manager.live_handlers == []
    # the second cycle of the same shapes and counts allocates no pinned memory
    assert allocations[-1] == allocations[len(cycle) - 1]


# ---------------------------------------------------------------- schedule errors
def test_schedule_mismatch_errors(configure):
    configure(NAMES)
    chunks = _chunks(2)
    _attach(chunks)
    offload.set_schedule(schedule_order(2, 2, 2, 0))  # starts with chunk 0, chunk 0
    chunks[0](torch.randn(SHAPE, requires_grad=True))
    with pytest.raises(OffloadError, match="forward 1 of the schedule is chunk 0, microbatch 1"):
        chunks[1](torch.randn(SHAPE, requires_grad=True))
    with pytest.raises(OffloadError, match="set_schedule\\(\\) called after"):
        offload.set_schedule(None)
    offload.reset()

    offload.set_schedule([1, -1])
    out = chunks[0](torch.randn(SHAPE, requires_grad=True))
    out.sum().backward()
    with pytest.raises(OffloadError, match="has 1"):
        chunks[0](torch.randn(SHAPE, requires_grad=True))
    offload.reset()

    offload.set_schedule([1, 1, -1, -1])
    out = chunks[0](torch.randn(SHAPE, requires_grad=True))
    out.sum().backward()
    with pytest.raises(OffloadError, match="ran 1 chunk forwards, but the schedule .* has 2"):
        offload.end_iteration()
    # the next iteration runs normally
    for _ in range(2):
        out = chunks[0](torch.randn(SHAPE, requires_grad=True))
        out.sum().backward()
    offload.end_iteration()


def test_explicit_microbatch_ids_follow_the_schedule(configure):
    configure(NAMES)
    chunk = _chunks(1)[0]
    offload.set_schedule([1, 1, -1, -1])
    with pytest.raises(OffloadError, match="chunk 0, microbatch 0, but chunk 0, microbatch 1 began"):
        offload.begin_chunk(0, microbatch=1)
    offload.reset()
    outs = []
    for mb in range(2):
        offload.begin_chunk(0, microbatch=mb)
        outs.append(chunk(torch.randn(SHAPE, requires_grad=True)))
    for out in outs:
        out.sum().backward()
    offload.end_iteration()


# ---------------------------------------------------------------- group policies
def _policy_run(configure, policy, pp=4, vpp=1, m=8, rank=0, with_schedule=True):
    order = schedule_order(pp, vpp, m, rank)
    ref_chunks = _chunks(vpp, layers=4)
    chunks = copy.deepcopy(ref_chunks)
    ref = replay_order(ref_chunks, order, SHAPE)
    seen: list[GroupInfo] = []

    def recording(info: GroupInfo) -> bool:
        seen.append(info)
        return policy(info)

    configure(NAMES, policy=recording)
    _attach(chunks)
    if with_schedule:
        offload.set_schedule(order)
    got = replay_order(chunks, order, SHAPE)
    stats = offload.end_iteration()
    assert first_difference(ref, got) is None
    return seen, stats, order


def test_policy_sees_where_each_group_runs(configure):
    seen, stats, order = _policy_run(configure, lambda info: True)
    plan = SchedulePlan(order)
    per_forward = len(NAMES) * 4
    assert len(seen) == per_forward * len(plan)
    for i, step in enumerate(plan.forwards):
        infos = seen[i * per_forward:(i + 1) * per_forward]
        assert {(x.chunk_id, x.microbatch, x.phase, x.live, x.max_live) for x in infos} == {
            (step.chunk_id, step.microbatch, step.phase, step.live, plan.max_live)
        }
        assert sorted((x.name, x.layer) for x in infos) == sorted((n, l) for n in NAMES for l in range(4))
    assert stats.total().groups_declined == 0


def test_policy_without_schedule_infers_phase_and_live(configure):
    order = schedule_order(4, 1, 8, 0)
    plan = SchedulePlan(order)
    seen, _, _ = _policy_run(configure, lambda info: True, with_schedule=False)
    per_forward = len(NAMES) * 4
    for i, step in enumerate(plan.forwards):
        info = seen[i * per_forward]
        assert (info.phase, info.live, info.max_live) == (step.phase, step.live, None)


@pytest.mark.parametrize(
    "policy,offloaded",
    [
        (by_layer({0, 1}), lambda info: info.layer in (0, 1)),
        (by_layer(lambda layer: layer % 2 == 1), lambda info: info.layer % 2 == 1),
        (min_live(3), lambda info: info.live >= 3),
        (warmup_only, lambda info: info.phase == "warmup"),
        (by_name({"fc1": by_layer({0})}, by_layer(range(3))),
         lambda info: info.layer == 0 if info.name == "fc1" else info.layer < 3),
        (by_name({"core_attn": min_live(3)}), lambda info: info.name == "fc1" or info.live >= 3),
    ],
    ids=["layers", "odd-layers", "min_live", "warmup_only", "by_name", "by_name-default-all"],
)
def test_builtin_policies(configure, policy, offloaded):
    seen, stats, _ = _policy_run(configure, policy)
    total = stats.total()
    declined = [x for x in seen if not offloaded(x)]
    assert 0 < len(declined) < len(seen)
    assert total.groups_declined == len(declined)
    assert total.groups == len(seen) - len(declined)


def test_declined_layers_after_a_group_make_it_not_the_last(configure, monkeypatch):
    """``by_layer({0, 1})`` on four layers offloads layers 0 and 1, in the chunk's first forward
    too: the declined layers 2 and 3 come after layer 1, so their backward comes first and
    layer 1 is not the last-layer rule's to keep. The forward's end, where the copies in flight
    are waited for, is the close of layer 3's last invocation, not of layer 1's (Note [11] of
    offload.copy_queue)."""
    torch.manual_seed(0)
    ref_chunk = _chunks(1, layers=4)[0]
    chunk = copy.deepcopy(ref_chunk)
    inputs = [torch.randn(SHAPE, requires_grad=True) for _ in range(3)]
    log: list = []
    admit = by_layer({0, 1})

    def logging_policy(info: GroupInfo) -> bool:
        log.append((info.name, info.layer))
        return admit(info)

    configure(NAMES, policy=logging_policy)
    _attach([chunk])
    copies = PipelineOffloadManager.get().copies
    real_flush = copies.flush
    monkeypatch.setattr(copies, "flush", lambda: (log.append("flush"), real_flush())[1])
    got, ref = [], []
    for x in inputs:
        log.append("forward")
        chunk(x).sum().backward()
        got.append([p.grad.clone() for p in chunk.parameters()])
        log.append("backward done")
        ref_chunk(x).sum().backward()
        ref.append([p.grad.clone() for p in ref_chunk.parameters()])
    stats = offload.end_iteration()
    for a, b in zip(ref, got):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    for name in NAMES:
        s = stats.by_name[name]
        assert (s.groups_offloaded, s.groups_kept, s.groups_declined) == (2 * 3, 0, 2 * 3)
    forwards = "|".join(str(e) for e in log).split("forward|")[1:]
    last_invocation = str((NAMES[-1], 3))
    for forward in forwards[1:]:  # the first forward cannot know its end
        before_backward = forward.split("|backward done")[0].split("|")
        assert before_backward.index("flush") == before_backward.index(last_invocation) + 1


@pytest.mark.parametrize("pp,vpp,m,rank", [(1, 1, 3, 0), (2, 2, 4, 0)], ids=["one-chunk", "pp2-vpp2"])
def test_a_group_whose_next_invocation_is_declined_is_prefetched(configure, pp, vpp, m, rank):
    """``fc1`` offloaded in layer 0 only, ``core_attn`` in layers 0, 1 and 3 of four: the groups
    whose name's next invocation is declined are reloaded by the backward of the next group to
    open, not on demand (Note [11] of offload.copy_queue), and the gradients are bitwise. (The
    last group of the iteration's first backward has nothing before it to prefetch it, with or
    without a policy: no more are reloaded on demand than with every group offloaded.)"""
    _, everything, _ = _policy_run(configure, lambda info: True, pp=pp, vpp=vpp, m=m, rank=rank)
    _, stats, _ = _policy_run(configure, by_name({"fc1": by_layer({0})}, by_layer({0, 1, 3})), pp=pp, vpp=vpp,
                              m=m, rank=rank)
    for name in NAMES:
        s, on_demand = stats.by_name[name], everything.by_name[name].reloads_on_demand
        assert s.groups_offloaded > 0
        assert s.reloads_on_demand <= on_demand, name
        assert s.reloads_prefetched + s.reloads_on_demand == s.groups_offloaded, name


def test_policy_declines_everything_on_the_last_rank(configure):
    _, stats, _ = _policy_run(configure, min_live(2), rank=3)
    assert stats.total().bytes_offloaded == 0
    _, stats, _ = _policy_run(configure, min_live(2), rank=0)
    assert stats.total().bytes_offloaded > 0


def test_bad_policy(configure):
    with pytest.raises(TypeError, match="policy must be a callable"):
        configure(NAMES, policy="all")
    with pytest.raises(ValueError, match="min_live needs an int >= 1"):
        min_live(0)
    with pytest.raises(TypeError, match="by_name's policy for 'fc1' must be a callable or None"):
        by_name({"fc1": "layers:0"})
    with pytest.raises(TypeError, match="by_name's default must be a callable or None"):
        by_name({}, default=0)
