"""A plan against its measurement: a few steps with the plan applied, the deviation from the
prediction, and the corrected inputs for planning once more.

`measure` times steps as `offload.tools.profile_modules` does (GPU synchronized before each, CUDA
events, median) and takes the peak over them, with the engine's statistics (achieved copy GB/s,
the time the compute stream waited for copies).

`deviations` says what differs from the prediction by more than `TOLERANCE` (5%), and a peak over
the budget at any distance from the prediction. Planning again (`calibrate`) corrects three
inputs and keeps the rest:

* the peak: what the profile does not see (allocator rounding, a workspace, where the peak moves
  to) may be there in every plan, so the budget the model plans for is lowered by what the
  peak was over the prediction. A peak under the prediction raises nothing: that error belongs
  to the plan measured, and another plan may be off the other way (a first plan at 10.07 GiB,
  1.8 GiB under its prediction, had the budget raised by as much, and the next plan measured
  12.70 GiB on a budget of 11.97: H100, seq 32768);
* the link: where copies ran, the bandwidth becomes what they achieved;
* recompute: the measured step less the base step and the copy waits is what recompute cost;
  every module's forward time is scaled by its ratio to the predicted recompute time, within
  `RECOMPUTE_RATIO` (the forward's shape stays, as the advisor normalizes it to the measured
  forward).
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from ..tools.advisor import Prediction
from ..tools.bandwidth import Bandwidth

TOLERANCE = 0.05
RECOMPUTE_RATIO = (0.5, 3.0)
"""The correction of recompute times is kept within these factors: one measurement is noisy."""


@dataclass
class Measured:
    """What the steps with a plan measured; ``None`` where the CPU has nothing to say."""

    step_ms: float
    peak_bytes: int | None
    wait_ms: float | None = None
    d2h_gbps: float | None = None
    h2d_gbps: float | None = None
    offloaded_bytes: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def measure(step: Callable[[], None], steps: int, warmup: int, cuda: bool) -> Measured:
    """``warmup`` steps, then ``steps`` measured ones, each followed by ``end_iteration()``; the
    engine times every one of them (``timing=True``) for the waits and copy rates."""
    import offload

    recorder = offload.get_manager().stats
    always_timed, recorder.always_timed = recorder.always_timed, cuda
    try:
        return _measure(step, steps, warmup, cuda)
    finally:
        recorder.always_timed = always_timed


def _measure(step: Callable[[], None], steps: int, warmup: int, cuda: bool) -> Measured:
    import offload

    for _ in range(warmup):
        step()
        offload.end_iteration()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times, totals = [], []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            totals.append(offload.end_iteration().total())
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
            totals.append(offload.end_iteration().total())
    last = totals[-1]
    moved = last.bytes_offloaded > 0 and cuda
    return Measured(
        step_ms=statistics.median(times),
        peak_bytes=torch.cuda.max_memory_allocated() if cuda else None,
        wait_ms=statistics.median(t.offload_wait_ms + t.reload_wait_ms for t in totals) if cuda else None,
        d2h_gbps=last.d2h_gbps if moved else None,
        h2d_gbps=last.h2d_gbps if moved else None,
        offloaded_bytes=last.bytes_offloaded,
    )


def predicted_step_ms(profile: dict[str, Any], pred: Prediction) -> float:
    """The step time a plan is predicted to take: the profile's step plus the plan's cost."""
    return profile["step_ms"] + pred.cost_ms


def deviations(predicted_step: float, predicted_peak: int | None, measured: Measured,
               budget_bytes: int | None = None, tolerance: float = TOLERANCE) -> list[str]:
    """What the measurement says differs from the prediction by more than ``tolerance``, and a
    peak over ``budget_bytes``."""
    out = []
    if measured.peak_bytes is not None and budget_bytes is not None and measured.peak_bytes > budget_bytes:
        out.append(f"peak {measured.peak_bytes / 2**30:.2f} GiB over the budget of {budget_bytes / 2**30:.2f} GiB")
    step_err = measured.step_ms / predicted_step - 1
    if abs(step_err) > tolerance:
        out.append(f"step {measured.step_ms:.2f} ms against {predicted_step:.2f} ms predicted ({100 * step_err:+.1f}%)")
    if measured.peak_bytes is not None and predicted_peak:
        peak_err = measured.peak_bytes / predicted_peak - 1
        if abs(peak_err) > tolerance:
            out.append(f"peak {measured.peak_bytes / 2**30:.2f} GiB against {predicted_peak / 2**30:.2f} GiB "
                       f"predicted ({100 * peak_err:+.1f}%)")
    return out


def calibrate(profile: dict[str, Any], bandwidth: Bandwidth, pred: Prediction,
              measured: Measured) -> tuple[dict[str, Any], Bandwidth, int, list[str]]:
    """The profile and bandwidth corrected by the measurement, the bytes by which the measured
    peak was over ``pred``'s (0 when under), and what was corrected, in words (module docstring)."""
    notes = []
    peak_offset = 0
    if measured.peak_bytes is not None and pred.peak_bytes is not None:
        peak_offset = max(0, measured.peak_bytes - pred.peak_bytes)
        if peak_offset:
            notes.append(f"peaks {peak_offset / 2**20:+.0f} MiB against the model")
    bw = bandwidth
    if measured.d2h_gbps and measured.h2d_gbps and pred.bytes_per_group:
        size = int(statistics.median(pred.bytes_per_group.values()))
        scale = {"d2h": measured.d2h_gbps / bandwidth.gbps("d2h", size),
                 "h2d": measured.h2d_gbps / bandwidth.gbps("h2d", size)}
        bw = Bandwidth({d: [(s, g * scale.get(d, 1.0)) for s, g in pts] for d, pts in bandwidth.points.items()},
                       bandwidth.compute_slowdown)
        notes.append(f"link {measured.d2h_gbps:.1f}/{measured.h2d_gbps:.1f} GB/s out/back as copied")
    fixed = profile
    if pred.recompute_ms > 0:
        spent = measured.step_ms - profile["step_ms"] - (measured.wait_ms or 0.0)
        ratio = min(max(spent / pred.recompute_ms, RECOMPUTE_RATIO[0]), RECOMPUTE_RATIO[1])
        fixed = copy.deepcopy(profile)
        for times in fixed["modules"].values():
            times["fwd_ms"] = [None if v is None else v * ratio for v in times["fwd_ms"]]
        notes.append(f"recompute x{ratio:.2f} of the profile's forward times")
    return fixed, bw, peak_offset, notes
