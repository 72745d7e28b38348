"""`offload.plan`: say how much memory the step may take, get the fastest mix of offloading and
recompute for it, applied, checked and explained.

    plan = offload.plan(model, mapping, step, memory_budget="-4GiB")   # or "20GiB", "fit:10%"
    ... train; offload.end_iteration() after each step, as always ...
    plan.remove()

What it does (docs/planner.md):

1. profiles the step without a plan (`offload.tools.profile_modules`: step time and peak, every
   named module's forward and backward time, every saved storage), or reads a saved profile,
   and records where checkpointed regions could go (`structure`);
2. measures the link (`offload.tools.bandwidth`), or reads a probe's JSON;
3. chooses per named module keep, offload or checkpoint, and per container (a layer, its MLP)
   checkpoint or not, which modules inside it keep their outputs (selective checkpointing), and
   whether the inputs a checkpointed region keeps are offloaded (`search`, on
   `offload.tools.advisor.Model`'s predictions);
4. applies it (`apply`): regions run under non-reentrant `torch.utils.checkpoint` (with a
   selective-checkpoint policy by module where they keep modules), groups are offloaded through
   `offload.configure` and `offload.attach`;
5. measures a few steps and, on a GPU, plans again with the measurement's corrections
   (`check`) while the step or the peak differs from the prediction by more than 5% or the peak
   is over the budget (three plans measured at most), and keeps the fastest measured plan within
   the budget;
6. says what it chose and why, in a short table (`Plan.table`).

On the CPU the engine saves no memory and times are host times: the plan is made on the bytes
the step saves (standing in for the peak) and a nominal link, applied and run, not checked.
"""

from __future__ import annotations

from typing import Any

from .budget import Budget

__all__ = ["Assignment", "Budget", "Measured", "Plan", "active_plan", "describe", "plan"]


def __getattr__(name: str) -> Any:
    """The planner's steps are imported on first use: they bring the workflow tools
    (`offload.tools`), which ``import offload`` does not load."""
    if name in __all__:
        from . import planning

        return getattr(planning, name)
    raise AttributeError(f"module 'offload.planner' has no attribute {name!r}")
