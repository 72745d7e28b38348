"""Small output helpers shared by the tools: Markdown tables, byte formatting, JSON files and
the results a tool writes."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterable, Sequence

MIB = 2**20
GIB = 2**30


def md_table(headers: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> str:
    """A Markdown table; ``align`` has one character per column, ``l`` or ``r`` (default: r, first l)."""
    headers = list(headers)
    align = align or "l" + "r" * (len(headers) - 1)
    if len(align) != len(headers):
        raise ValueError(f"align has {len(align)} columns, headers {len(headers)}")
    lines = ["| " + " | ".join(headers) + " |",
             "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"]
    for row in rows:
        cells = [str(c) for c in row]
        if len(cells) != len(headers):
            raise ValueError(f"row {cells} has {len(cells)} cells, the table {len(headers)} columns")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def mib(n: float | None) -> str:
    """Bytes as MiB with one decimal, or ``n/a``."""
    return "n/a" if n is None else f"{n / MIB:.1f}"


def gib(n: float | None) -> str:
    """Bytes as GiB with two decimals, or ``n/a``."""
    return "n/a" if n is None else f"{n / GIB:.2f}"


def write_json(path: str | Path, data: Any) -> Path:
    """Write ``data`` as indented JSON, creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def publish(path: str | Path, data: Any, text: str) -> None:
    """A tool's last step: write ``data`` to the JSON file ``path``, print the report ``text``,
    and say on stderr where the results are."""
    write_json(path, data)
    print(text)
    print(f"results: {path}", file=sys.stderr)


def read_json(path: str | Path, what: str) -> Any:
    """Read a JSON file, with an error that says which input of the tool was wrong."""
    path = Path(path)
    if not path.is_file():
        raise SystemExit(f"{what}: {path} does not exist")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SystemExit(f"{what}: {path} is not JSON ({e})") from None
