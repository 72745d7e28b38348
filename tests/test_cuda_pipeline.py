"""Pipeline schedules and recompute on a real GPU. Skipped without CUDA.

One-rank replays: each runs rank r's exact order of (PP, VPP, M) on one GPU, random inputs
and output gradients standing in for the neighbouring ranks, with the schedule handed to the
engine. Checked per case: gradients bitwise equal to the same replay without offloading, the
peak memory lower by the expected amount, and no handler left after the iteration. Results
are also written to ``$OFFLOAD_RESULTS_DIR/pipeline_replay.json`` when that is set.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch

import offload
from conftest import CUDA_ONLY, PIPELINE_GRID as GRID, gpt_chunks, reproducible, seeded_pair, slow_side_streams
from offload.schedules import SchedulePlan, schedule_order
from offload.testing import (
    GPT_MAPPING, LIGHT_MODULES, build_gpt, first_difference, recompute, replay_order, train_step,
)

pytestmark = [*CUDA_ONLY, pytest.mark.usefixtures("deterministic")]

HIDDEN, HEADS, LAYERS, SEQ = 256, 4, 2, 2048
SHAPE = (SEQ, 1, HIDDEN)
NAMES = ["core_attn", "fc1"]

RESULTS: list[dict] = []


@pytest.fixture(scope="module", autouse=True)
def _write_results():
    yield
    out = os.environ.get("OFFLOAD_RESULTS_DIR")
    if out and RESULTS:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "pipeline_replay.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "cases": RESULTS}, f, indent=1)


def _chunks(vpp):
    return gpt_chunks(vpp, HIDDEN, HEADS, LAYERS, dtype=torch.bfloat16, device="cuda")


def _peak(run):
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = run()
    torch.cuda.synchronize()
    return out, torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("pp,vpp,m,rank", GRID)
def test_replay_on_gpu(configure, monkeypatch, pp, vpp, m, rank):
    order = schedule_order(pp, vpp, m, rank)
    plan = SchedulePlan(order)
    ref_chunks = _chunks(vpp)
    chunks = copy.deepcopy(ref_chunks)
    seed = 1000 * pp + 10 * m + rank
    run_ref = lambda: replay_order(ref_chunks, order, SHAPE, seed, torch.bfloat16, "cuda")  # noqa: E731
    ref, peak_ref = reproducible(lambda: _peak(run_ref), grads=lambda result: result[0])

    manager = configure(NAMES, device="cuda", min_tensor_bytes=0)
    if (pp, vpp, rank) in {(4, 2, 0), (8, 4, 0), (2, 4, 1)}:
        slow_side_streams(monkeypatch)
    for c, chunk in enumerate(chunks):
        offload.attach(chunk, GPT_MAPPING, chunk_id=c)
    offload.set_schedule(order)
    replay_order(chunks, order, SHAPE, seed + 1, torch.bfloat16, "cuda")  # warm-up: pinned pool
    pinned_after_warmup = offload.end_iteration().pinned_allocations
    got, peak = _peak(lambda: replay_order(chunks, order, SHAPE, seed, torch.bfloat16, "cuda"))
    stats = offload.end_iteration()
    assert first_difference(ref, got) is None
    assert manager.live_handlers == []

    total = stats.total()
    per_group = total.bytes_offloaded / total.groups_offloaded
    per_chunk = per_group * len(NAMES) * LAYERS  # a chunk forward whose groups all go out
    expected = (plan.max_live - 1) * per_chunk
    saved = peak_ref - peak
    RESULTS.append({
        "pp": pp, "vpp": vpp, "microbatches": m, "rank": rank, "max_live": plan.max_live,
        "peak_mib": peak / 2**20, "peak_ref_mib": peak_ref / 2**20, "saved_mib": saved / 2**20,
        "expected_mib": expected / 2**20, "reloads_on_demand": total.reloads_on_demand,
        "new_pinned_allocations": stats.pinned_allocations - pinned_after_warmup,
        "d2h_ms": total.d2h_ms, "h2d_ms": total.h2d_ms,
        "offload_wait_ms": total.offload_wait_ms, "reload_wait_ms": total.reload_wait_ms,
    })
    # the rank holds max_live chunk forwards at its peak; all but about one chunk's worth of
    # their offloaded groups are on the host then (the chunk in flight or being reloaded).
    # Measured on an H100: saved / expected between 1.04 and 2.1 over the grid.
    assert saved >= 0.95 * expected
    assert saved > 0
    assert stats.pinned_allocations == pinned_after_warmup


def test_offload_plus_recompute_at_or_below_full_recompute(configure):
    """A "memory-free" layer (norms and activation recomputed, every other module offloaded)
    keeps nothing between forward and backward; its peak is at or below full recompute of
    the same layers, and its gradients are bitwise those of plain training."""
    hidden, heads, layers, seq = 1024, 8, 8, 4096
    plain = build_gpt(hidden, heads, layers, dtype=torch.bfloat16, device="cuda", seed=3)
    full = copy.deepcopy(plain)
    recompute(full, "layers.*")
    free = copy.deepcopy(plain)
    for pattern in LIGHT_MODULES:
        recompute(free, pattern)
    x, dy = seeded_pair(0, seq, 1, hidden, dtype=torch.bfloat16, device="cuda")
    strip = lambda grads: {k.replace(".inner", ""): v for k, v in grads.items()}  # noqa: E731

    (_, ref), peak_plain = _peak(lambda: train_step(plain, x, dy))
    (_, full_grads), peak_full = _peak(lambda: train_step(full, x, dy))
    assert first_difference(ref, strip(full_grads)) is None

    configure(list(GPT_MAPPING), device="cuda", min_tensor_bytes=0)
    offload.attach(free, GPT_MAPPING)
    train_step(free, x, dy)
    offload.end_iteration()
    (_, free_grads), peak_free = _peak(lambda: train_step(free, x, dy))
    offload.end_iteration()
    assert first_difference(ref, strip(free_grads)) is None
    RESULTS.append({
        "case": "memory-free layer vs full recompute", "layers": layers, "hidden": hidden, "seq": seq,
        "peak_plain_mib": peak_plain / 2**20, "peak_full_recompute_mib": peak_full / 2**20,
        "peak_offload_recompute_mib": peak_free / 2**20,
    })
    assert peak_free <= peak_full
