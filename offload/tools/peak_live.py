"""What is allocated at a step's memory peak, and which code allocated it.

Two systems can lower a step's peak by different amounts for the same offloaded names; this
tool says where the difference lies. `record` keeps CUDA's allocator history (every allocation
and free, with its Python stack) over one step; `summarize` replays it to the peak that
``max_memory_allocated`` reports and groups the blocks live there by the innermost frame of their
allocation outside ``torch`` (``megatron/core/transformer/moe/experts.py:800 forward``), with the
allocation that reached the peak and its stack; each site lists its blocks' sizes too (the
largest `SIZES_KEPT`), so that bytes two runs hold at one site can be told apart block by
block (two reload buffers of 128 MiB, or one of 256). `compare` lines two summaries up site by
site:

    python -m offload.tools.peak_live A.json B.json     # which sites hold more at B's peak

A block allocated before the recording began counts under ``(before the recording)`` until it is
freed; an allocation made with no Python frame outside ``torch`` (autograd's own kernels in a
backward) under ``(no python frame)``. Blocks count from their allocation until their free was
requested, as ``memory_allocated`` counts them.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any, Iterator

from .report import GIB, MIB, md_table, read_json

BEFORE = "(before the recording)"
NO_FRAME = "(no python frame)"
SIZES_KEPT = 16


def _frame(frame: dict[str, Any], short: bool = True) -> str:
    """``path:line function``, the path from the package root (``megatron/...``), or with
    ``short`` its last three parts where it is not under site-packages."""
    filename = frame.get("filename", "")
    path = filename.split("site-packages/")[-1]
    if short and path == filename:
        path = "/".join(filename.split("/")[-3:])
    return f"{path}:{frame.get('line')} {frame.get('name')}"


def frame_site(frames: list[dict[str, Any]]) -> str:
    """The innermost frame outside ``torch`` (`_frame`), or `NO_FRAME`."""
    for frame in frames:
        filename = frame.get("filename", "")
        if "/torch/" not in filename and not filename.startswith("<"):
            return _frame(frame)
    return NO_FRAME


@contextlib.contextmanager
def record(max_entries: int = 2_000_000) -> Iterator[dict[str, Any]]:
    """Record the CUDA allocator's history inside the block; on exit the yielded dict holds
    ``snapshot`` (``torch.cuda.memory._snapshot()``) and ``start_bytes`` (``memory_allocated``
    when the recording began)."""
    import torch

    out: dict[str, Any] = {}
    torch.cuda.synchronize()
    out["start_bytes"] = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=max_entries)
    try:
        yield out
        torch.cuda.synchronize()
        out["snapshot"] = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)


def _replay(events: list[dict[str, Any]], start_bytes: int,
            stop: int) -> tuple[dict[int, tuple[int, int]], int, int, int]:
    """Replay ``events[:stop]``: the blocks allocated in the recording still live (address ->
    (size, index of their allocation event)), the bytes of earlier blocks still live, and the
    peak reached with the index of the event that reached it (-1: none above ``start_bytes``)."""
    live: dict[int, tuple[int, int]] = {}
    before = current = peak = start_bytes
    peak_index = -1
    for index in range(stop):
        event = events[index]
        action = event.get("action")
        if action == "alloc":
            live[event["addr"]] = (event["size"], index)
            current += event["size"]
            if current > peak:
                peak, peak_index = current, index
        elif action == "free_requested":
            current -= event["size"]
            if live.pop(event["addr"], None) is None:
                before -= event["size"]
                if before < 0:
                    raise ValueError(f"event {index} frees a block the replay never saw, beyond the "
                                     f"{start_bytes} bytes allocated when the recording began: the history "
                                     "was cut (record fewer steps or raise max_entries)")
    return live, before, peak, peak_index


def _site_entry(site: str, total: int, sizes: list[int]) -> dict[str, Any]:
    """One site of a summary: its bytes and blocks at the peak, the largest blocks' sizes."""
    return {"site": site, "bytes": total, "blocks": len(sizes), "sizes": sorted(sizes, reverse=True)[:SIZES_KEPT]}


def summarize(snapshot: dict[str, Any], start_bytes: int, device: int = 0, top: int = 40) -> dict[str, Any]:
    """The peak of the recorded history on ``device`` and the live blocks there by allocation
    site (the ``top`` largest sites; the rest summed as ``(other sites)``), each with its bytes,
    its count of blocks and the sizes of its `SIZES_KEPT` largest blocks.

    Raises ``ValueError`` when the history cannot be replayed from ``start_bytes``: more freed of
    the blocks allocated before it than there were (the allocator keeps at most ``max_entries``
    events and drops the oldest, or ``start_bytes`` was read elsewhere)."""
    traces = snapshot.get("device_traces") or []
    events = traces[device] if device < len(traces) else []
    _, _, peak, peak_index = _replay(events, start_bytes, len(events))  # where the peak is
    peak_live, peak_before, _, _ = _replay(events, start_bytes, peak_index + 1)  # what is live there
    sizes_at: dict[str, list[int]] = {}
    for size, index in peak_live.values():
        sizes_at.setdefault(frame_site(events[index].get("frames") or []), []).append(size)
    rows = [(site, sum(sizes), sizes) for site, sizes in sizes_at.items()]
    if peak_before:
        rows.append((BEFORE, peak_before, []))
    rows.sort(key=lambda row: -row[1])
    rest = rows[top:]
    sites = [_site_entry(site, total, sizes) for site, total, sizes in rows[:top]]
    if rest:
        sites.append(_site_entry("(other sites)", sum(row[1] for row in rest),
                                 [size for row in rest for size in row[2]]))
    at_peak = events[peak_index] if peak_index >= 0 else None
    first_us = events[0].get("time_us", 0) if events else 0
    last_us = events[-1].get("time_us", 0) if events else 0
    return {
        "start_bytes": start_bytes,
        "peak_bytes": peak,
        "events": len(events),
        "peak_event": peak_index,
        "peak_at_fraction": (None if at_peak is None or last_us == first_us
                             else round((at_peak.get("time_us", 0) - first_us) / (last_us - first_us), 4)),
        "peak_allocation": None if at_peak is None else {
            "size": at_peak["size"],
            "stack": [_frame(f, short=False) for f in (at_peak.get("frames") or [])[:25]],
        },
        "sites": sites,
    }


def compare(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str, int, int]]:
    """``(site, bytes at a's peak, bytes at b's peak)`` for every site, largest difference first
    (``(other sites)`` last)."""
    sa = {s["site"]: s["bytes"] for s in a["sites"]}
    sb = {s["site"]: s["bytes"] for s in b["sites"]}
    rows = [(site, sa.get(site, 0), sb.get(site, 0)) for site in set(sa) | set(sb) if site != "(other sites)"]
    rows.sort(key=lambda r: -abs(r[2] - r[1]))
    rows.append(("(other sites)", sa.get("(other sites)", 0), sb.get("(other sites)", 0)))
    return rows


def render_compare(a: dict[str, Any], b: dict[str, Any], names: tuple[str, str], rows: int = 25) -> str:
    """A Markdown report: both peaks, then the sites whose bytes at the peak differ most."""
    table = [(f"`{site}`", f"{x / MIB:.1f}", f"{y / MIB:.1f}", f"{(y - x) / MIB:+.1f}")
             for site, x, y in compare(a, b)[:rows]]
    head = (f"peak: {names[0]} {a['peak_bytes'] / GIB:.2f} GiB, {names[1]} {b['peak_bytes'] / GIB:.2f} GiB "
            f"({(b['peak_bytes'] - a['peak_bytes']) / GIB:+.2f})")
    return head + "\n\n" + md_table(["site", f"{names[0]} MiB", f"{names[1]} MiB", "difference"], table, "lrrr")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("a", help="a summary JSON (examples/megatron_gpt.py --peak-trace writes them)")
    p.add_argument("b", help="the summary to compare it with")
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args(argv)
    data = [read_json(path, name) for path, name in ((args.a, "a"), (args.b, "b"))]
    try:
        text = render_compare(data[0], data[1], (args.a, args.b), args.rows)
    except (KeyError, TypeError) as e:
        p.error(f"not a summary of offload.tools.peak_live: {e!r}")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
