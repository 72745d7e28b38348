"""Two kinds of picture: a timeline (rows of bars) and line charts.

PNG through matplotlib where it is installed; otherwise the same picture as SVG, written by
hand (no dependency), next to the requested path with the ``.svg`` suffix. Each function
returns the path it wrote.
"""

from __future__ import annotations

from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Sequence

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
           "#bcbd22", "#7f7f7f"]
GRAY = "#9a9a9a"


@dataclass
class Bar:
    start: float
    end: float
    color: str = GRAY
    text: str = ""


def have_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def _target(path: str | Path) -> tuple[Path, bool]:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if have_matplotlib():
        return path, True
    return path.with_suffix(".svg"), False


def timeline(path: str | Path, rows: Sequence[tuple[str, Sequence[Bar]]], title: str,
             xlabel: str = "ms", legend: Sequence[tuple[str, str]] = ()) -> Path:
    """One row of bars per ``(label, bars)``, top to bottom; ``legend`` is ``(text, color)``."""
    if not rows:
        raise ValueError("a timeline needs at least one row")
    out, mpl = _target(path)
    bars = [b for _, bs in rows for b in bs]
    x0 = min((b.start for b in bars), default=0.0)
    x1 = max((b.end for b in bars), default=1.0)
    if mpl:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch

        fig, ax = plt.subplots(figsize=(12, 0.7 * len(rows) + 1.6))
        for k, (label, bs) in enumerate(rows):
            y = len(rows) - 1 - k
            ax.broken_barh([(b.start, b.end - b.start) for b in bs], (y - 0.4, 0.8),
                           facecolors=[b.color for b in bs], edgecolor="none")
            for b in bs:
                if b.text and (b.end - b.start) > 0.06 * (x1 - x0):
                    ax.text((b.start + b.end) / 2, y, b.text, ha="center", va="center", fontsize=7)
        ax.set_yticks(range(len(rows)))
        ax.set_yticklabels([label for label, _ in reversed(rows)])
        ax.set_xlim(x0, x1)
        ax.set_xlabel(xlabel)
        ax.set_title(title)
        if legend:
            ax.legend(handles=[Patch(color=c, label=t) for t, c in legend], loc="upper right", fontsize=7)
        fig.tight_layout()
        fig.savefig(out, dpi=130)
        plt.close(fig)
        return out
    width, left, row_h, top = 1200, 170, 34, 40
    height = top + row_h * len(rows) + 50
    scale = (width - left - 20) / max(x1 - x0, 1e-9)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">',
             f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>']
    for k, (label, bs) in enumerate(rows):
        y = top + k * row_h
        parts.append(f'<text x="{left - 8}" y="{y + row_h / 2 + 4}" text-anchor="end" font-size="11">{escape(label)}</text>')
        for b in bs:
            x, w = left + (b.start - x0) * scale, max((b.end - b.start) * scale, 0.5)
            parts.append(f'<rect x="{x:.1f}" y="{y + 3}" width="{w:.1f}" height="{row_h - 6}" fill="{b.color}">'
                         f'<title>{escape(b.text)}</title></rect>')
            if b.text and w > 60:
                parts.append(f'<text x="{x + w / 2:.1f}" y="{y + row_h / 2 + 4}" text-anchor="middle" '
                             f'font-size="9">{escape(b.text)}</text>')
    axis_y = top + row_h * len(rows) + 16
    parts.append(f'<text x="{left}" y="{axis_y}" font-size="11">{x0:.2f}</text>')
    parts.append(f'<text x="{width - 20}" y="{axis_y}" text-anchor="end" font-size="11">{x1:.2f} {escape(xlabel)}</text>')
    for j, (t, c) in enumerate(legend):
        parts.append(f'<rect x="{left + 140 * j}" y="{axis_y + 10}" width="10" height="10" fill="{c}"/>'
                     f'<text x="{left + 140 * j + 14}" y="{axis_y + 19}" font-size="10">{escape(t)}</text>')
    parts.append("</svg>")
    out.write_text("\n".join(parts) + "\n")
    return out


def lines(path: str | Path, series: Sequence[tuple[str, Sequence[float], Sequence[float]]], title: str,
          xlabel: str, ylabel: str, vlines: Sequence[tuple[float, str]] = ()) -> Path:
    """Step lines, one per ``(label, xs, ys)``; ``vlines`` are ``(x, label)`` markers."""
    if not series or any(len(xs) != len(ys) or not xs for _, xs, ys in series):
        raise ValueError("every series needs as many x as y values, and at least one")
    out, mpl = _target(path)
    if mpl:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 4.5))
        for k, (label, xs, ys) in enumerate(series):
            ax.step(xs, ys, where="post", label=label, color=PALETTE[k % len(PALETTE)])
        for k, (x, label) in enumerate(vlines):
            ax.axvline(x, color=PALETTE[k % len(PALETTE)], linestyle=":", linewidth=1)
            ax.text(x, ax.get_ylim()[1], label, rotation=90, va="top", ha="right", fontsize=7)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out, dpi=130)
        plt.close(fig)
        return out
    width, height, left, bottom, top = 1000, 450, 70, 50, 40
    xs_all = [x for _, xs, _ in series for x in xs]
    ys_all = [y for _, _, ys in series for y in ys]
    x0, x1 = min(xs_all), max(xs_all)
    y0, y1 = min(0.0, min(ys_all)), max(ys_all)
    sx = (width - left - 20) / max(x1 - x0, 1e-9)
    sy = (height - top - bottom) / max(y1 - y0, 1e-9)

    def px(x: float, y: float) -> str:
        return f"{left + (x - x0) * sx:.1f},{height - bottom - (y - y0) * sy:.1f}"

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif">',
             f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>',
             f'<text x="{width / 2}" y="{height - 12}" text-anchor="middle" font-size="11">{escape(xlabel)} '
             f'({x0:.1f} to {x1:.1f})</text>',
             f'<text x="12" y="{top + 10}" font-size="11">{escape(ylabel)}: {y0:.2f} to {y1:.2f}</text>']
    for k, (label, xs, ys) in enumerate(series):
        pts = []
        for i, (x, y) in enumerate(zip(xs, ys)):
            if i:
                pts.append(px(x, ys[i - 1]))
            pts.append(px(x, y))
        color = PALETTE[k % len(PALETTE)]
        parts.append(f'<polyline fill="none" stroke="{color}" stroke-width="1.2" points="{" ".join(pts)}"/>')
        parts.append(f'<text x="{width - 200}" y="{top + 16 * (k + 1)}" fill="{color}" font-size="11">{escape(label)}</text>')
    for k, (x, label) in enumerate(vlines):
        a, b = px(x, y0), px(x, y1)
        parts.append(f'<line x1="{a.split(",")[0]}" y1="{a.split(",")[1]}" x2="{b.split(",")[0]}" '
                     f'y2="{b.split(",")[1]}" stroke="{PALETTE[k % len(PALETTE)]}" stroke-dasharray="3,3"/>')
        parts.append(f'<text x="{b.split(",")[0]}" y="{top - 4}" font-size="9">{escape(label)}</text>')
    parts.append("</svg>")
    out.write_text("\n".join(parts) + "\n")
    return out
