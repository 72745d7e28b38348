"""The engine's last-layer decisions, made from what runs, against the schedule's definition.

Each test replays one pipeline rank's exact order of chunk forwards and backwards (random
inputs and output gradients stand in for the neighbouring ranks) and checks, for every
forward of the order, that the engine kept the chunk's last groups on the device exactly when
`offload.schedules.kept_last_group` says the chunk's backward comes right after its forward;
and that the gradients are bitwise those of the same replay without offloading.
"""

from __future__ import annotations

import copy

import pytest
import torch

import offload
from offload.manager import PipelineOffloadManager
from offload.schedules import kept_last_group, schedule_events, schedule_order
from offload.testing import GPT_MAPPING, build_gpt

CASES = [
    (pp, vpp, m, rank)
    for pp in (1, 2, 4)
    for vpp in ((1,) if pp == 1 else (1, 2))
    for m in (pp, 2 * pp)
    for rank in sorted({0, pp - 1})
]


def _replay(chunks, order, seed, offloading):
    """Run ``order`` on ``chunks``; return the kept decision of each forward and the grads."""
    decisions = {}
    if offloading:
        real = PipelineOffloadManager._begin_backward

        def spy(self, handler):
            decisions[(handler.chunk_id, handler.microbatch)] = bool(handler.pending)
            real(self, handler)

        PipelineOffloadManager._begin_backward = spy
    try:
        gen = torch.Generator().manual_seed(seed)
        outputs = {}
        for kind, chunk, mb in schedule_events(order):
            if kind == "F":
                x = torch.randn(8, 2, 32, generator=gen)
                outputs[(chunk, mb)] = chunks[chunk](x)
            else:
                out = outputs.pop((chunk, mb))
                out.backward(torch.randn(out.shape, generator=gen))
        if offloading:
            offload.end_iteration()
    finally:
        if offloading:
            PipelineOffloadManager._begin_backward = real
    grads = {f"{i}.{n}": p.grad.clone() for i, c in enumerate(chunks) for n, p in c.named_parameters()}
    return decisions, grads


@pytest.mark.parametrize("pp,vpp,m,rank", CASES)
def test_kept_groups_follow_the_schedule(configure, pp, vpp, m, rank):
    order = schedule_order(pp, vpp, m, rank)
    ref_chunks = [build_gpt(32, 4, 2, seed=c) for c in range(vpp)]
    chunks = copy.deepcopy(ref_chunks)
    configure(["core_attn", "fc1"])
    for c, chunk in enumerate(chunks):
        offload.attach(chunk, GPT_MAPPING, chunk_id=c)
    decisions, grads = _replay(chunks, order, seed=0, offloading=True)
    _, ref_grads = _replay(ref_chunks, order, seed=0, offloading=False)
    assert all(torch.equal(grads[k], ref_grads[k]) for k in ref_grads)

    expected = {
        (chunk, mb): kept
        for (kind, chunk, mb), kept in zip(schedule_events(order), kept_last_group(order))
        if kind == "F"
    }
    # a chunk whose pending groups were kept is one whose backward came right after it;
    # chunks whose forward was followed by anything else had their pending groups launched
    assert decisions == expected
    assert offload.get_manager().live_handlers == []
