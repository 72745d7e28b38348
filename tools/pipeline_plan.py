"""What the engine does across one pipeline rank's schedule: a table and a picture.

    python tools/pipeline_plan.py --pp 4 --vpp 2 --microbatches 8 --rank 0

For each step of the rank's order (Megatron's interleaved 1F1B, `offload.schedules`): the
event, the schedule phase, how many chunk forwards are live after it, and what the engine
does: at a forward, whether the chunk's last groups are kept on the GPU (its own backward
comes next) or everything is offloaded; at a backward, which chunk's last groups it
prefetches when it ends, or "on demand" for a backward nothing could prefetch (the
iteration's first, when it does not follow its own forward). `tests/test_pipeline.py`
checks that the engine does exactly this over a grid of schedules. The picture draws one row
per (chunk, microbatch): ``F`` forward, ``B`` backward, ``o`` its activations offloaded to
the host, ``k`` its last groups kept on the GPU.
"""

from __future__ import annotations

import argparse

from offload.schedules import SchedulePlan, schedule_events, schedule_order


def plan_rows(order: list[int]) -> list[dict]:
    """One row per event of ``order``: what the engine decides there."""
    plan = SchedulePlan(order)
    rows = []
    live = 0
    forwards = iter(plan.forwards)
    kept_by_key = {(f.chunk_id, f.microbatch): f.keeps_last_group for f in plan.forwards}
    first_backward = True
    for step, (kind, chunk, mb) in enumerate(schedule_events(order)):
        if kind == "F":
            f = next(forwards)
            live = f.live
            action = "keep last groups" if f.keeps_last_group else "offload all"
            phase = f.phase
        else:
            live -= 1
            nxt = plan.successor(chunk, mb)
            reload = "on demand" if first_backward and not kept_by_key[(chunk, mb)] else "prefetched"
            then = f"prefetch c{nxt[0]} mb{nxt[1]}" if nxt else "-"
            action = f"own reloads {reload}; then {then}"
            phase = "steady" if any(e > 0 for e in order[step + 1:]) else "cool-down"
            first_backward = False
        rows.append({"step": step, "event": f"{kind} c{chunk} mb{mb}", "phase": phase, "live": live, "action": action})
    return rows


def picture(order: list[int]) -> str:
    """Rows per (chunk, microbatch), one column per step of the order."""
    events = schedule_events(order)
    plan = SchedulePlan(order)
    kept = {(f.chunk_id, f.microbatch): f.keeps_last_group for f in plan.forwards}
    keys = sorted({(c, m) for _, c, m in events})
    start = {(c, m): i for i, (k, c, m) in enumerate(events) if k == "F"}
    end = {(c, m): i for i, (k, c, m) in enumerate(events) if k == "B"}
    lines = []
    for key in keys:
        cells = []
        for i in range(len(events)):
            if i == start[key]:
                cells.append("F")
            elif i == end[key]:
                cells.append("B")
            elif start[key] < i < end[key]:
                cells.append("k" if kept[key] else "o")
            else:
                cells.append(" ")
        lines.append(f"c{key[0]} mb{key[1]:<3d}|{''.join(cells)}|")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, required=True, help="pipeline-parallel size")
    p.add_argument("--vpp", type=int, default=1, help="model chunks per rank (virtual pipeline)")
    p.add_argument("--microbatches", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--group-size", type=int, default=None, help="microbatch group size (default: pp)")
    args = p.parse_args()
    order = schedule_order(args.pp, args.vpp, args.microbatches, args.rank, args.group_size)
    plan = SchedulePlan(order)
    print(f"order (pp={args.pp}, vpp={args.vpp}, microbatches={args.microbatches}, rank={args.rank}): {order}")
    print(f"peak live chunk forwards: {plan.max_live}\n")
    print("| step | event | phase | live | engine |")
    print("|---:|---|---|---:|---|")
    for r in plan_rows(order):
        print(f"| {r['step']} | {r['event']} | {r['phase']} | {r['live']} | {r['action']} |")
    print("\n```\n" + picture(order) + "\n```")


if __name__ == "__main__":
    main()
