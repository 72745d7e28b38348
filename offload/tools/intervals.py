"""Interval arithmetic on ``(start, end)`` pairs: unions, lengths, intersections."""

from __future__ import annotations

import bisect
from typing import Iterable


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the same points (empty ones dropped)."""
    out: list[list[float]] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length of the union."""
    return sum(e - s for s, e in union(intervals))


class Cover:
    """A union of intervals that answers "how much of [s, e) does it cover" quickly."""

    def __init__(self, intervals: Iterable[tuple[float, float]]) -> None:
        self.parts = union(intervals)
        self.starts = [s for s, _ in self.parts]
        self.prefix = [0.0]
        for s, e in self.parts:
            self.prefix.append(self.prefix[-1] + e - s)

    def covered(self, s: float, e: float) -> float:
        """Length of [s, e) inside the union."""
        if e <= s or not self.parts:
            return 0.0
        i = max(bisect.bisect_right(self.starts, s) - 1, 0)
        total = 0.0
        while i < len(self.parts) and self.parts[i][0] < e:
            ps, pe = self.parts[i]
            total += max(0.0, min(pe, e) - max(ps, s))
            i += 1
        return total
