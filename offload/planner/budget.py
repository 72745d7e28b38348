"""The memory budget a plan must meet: the step's peak (``torch.cuda.max_memory_allocated``)
at or below a number of bytes.

Three forms, given as a string, an int or a `Budget`:

* ``"20GiB"`` (also ``KiB``, ``MiB``, ``TiB``, ``B``) or an int of bytes: that peak;
* ``"-4GiB"`` or ``"-30%"``: that much below the peak the step has without a plan;
* ``"fit"`` or ``"fit:10%"``: the device's memory less that headroom (10% when not given), for
  what the caching allocator holds beyond the allocated bytes.

Decimal units (``GB``) are refused rather than guessed. A wrong type raises `OffloadTypeError`, a
malformed or impossible value `OffloadValueError`, both at once (`Budget.parse`); a budget that
needs what is not there (``fit`` without CUDA) raises when it is resolved against the step.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..errors import OffloadTypeError, OffloadValueError

UNITS = {"b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
DEFAULT_FIT_HEADROOM = 0.10
_AMOUNT = re.compile(r"^(-?)\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z%]*)$")
_FORMS = "'20GiB' (a peak), '-4GiB' or '-30%' (below the current peak), 'fit' or 'fit:10%' (the device, less headroom)"


@dataclass(frozen=True)
class Budget:
    """A parsed budget: ``kind`` is ``"peak"`` (``amount`` bytes), ``"below"`` (``amount`` bytes,
    or with ``percent`` a percentage, below the unplanned peak) or ``"fit"`` (``amount`` percent
    of the device's memory kept free)."""

    kind: str
    amount: float
    percent: bool = False

    @classmethod
    def parse(cls, spec: "Budget | str | int") -> "Budget":
        """``spec`` in one of the forms of the module docstring."""
        if isinstance(spec, Budget):
            return spec
        if isinstance(spec, bool) or not isinstance(spec, (str, int)):
            raise OffloadTypeError(f"offload: memory_budget must be a string such as {_FORMS}, or an int "
                                   f"of bytes; got {spec!r} ({type(spec).__name__})")
        if isinstance(spec, int):
            if spec <= 0:
                raise OffloadValueError(f"offload: memory_budget must be > 0 bytes, got {spec}")
            return cls("peak", float(spec))
        text = spec.strip().lower()
        if text == "fit" or text.startswith("fit:"):
            pct = text[4:].strip() if text != "fit" else f"{100 * DEFAULT_FIT_HEADROOM:g}%"
            m = _AMOUNT.match(pct)
            if not m or m.group(1) or m.group(3) != "%" or not float(m.group(2)) < 100:
                raise OffloadValueError(f"offload: memory_budget {spec!r}: 'fit:N%' takes a headroom of 0 to 99%")
            return cls("fit", float(m.group(2)), percent=True)
        m = _AMOUNT.match(text)
        if not m:
            raise OffloadValueError(f"offload: memory_budget {spec!r} is not one of {_FORMS}")
        minus, number, unit = m.group(1), float(m.group(2)), m.group(3)
        if unit == "%":
            if not minus or not 0 < number < 100:
                raise OffloadValueError(f"offload: memory_budget {spec!r}: a percentage is below the current peak, "
                                        "between '-0%' and '-100%' (say '-30%')")
            return cls("below", number, percent=True)
        if unit not in UNITS:
            hint = f" (did you mean '{m.group(2)}{unit[0].upper()}iB'?)" if unit in ("kb", "mb", "gb", "tb") else ""
            raise OffloadValueError(f"offload: memory_budget {spec!r} needs a unit: B, KiB, MiB, GiB or TiB{hint}")
        amount = number * UNITS[unit]
        if amount < 1:
            raise OffloadValueError(f"offload: memory_budget {spec!r} must be more than 0 bytes")
        return cls("below" if minus else "peak", amount)

    def resolve(self, peak_bytes: int | None, device_bytes: int | None) -> int:
        """The budget in bytes of peak, given the step's peak without a plan and the device's
        memory (``None`` where there is none: the CPU)."""
        if self.kind == "peak":
            out = int(self.amount)
        elif self.kind == "below":
            if peak_bytes is None:
                raise OffloadValueError(f"offload: memory_budget {self} is relative to the step's peak, "
                                        "which was not measured")
            out = int(peak_bytes * (1 - self.amount / 100)) if self.percent else int(peak_bytes - self.amount)
        else:
            if device_bytes is None:
                raise OffloadValueError(f"offload: memory_budget {self} fits the CUDA device, and there is none; "
                                        "give the peak in bytes ('20GiB') or below the current peak ('-30%')")
            out = int(device_bytes * (1 - self.amount / 100))
        if out <= 0:
            raise OffloadValueError(f"offload: memory_budget {self} leaves {out} bytes for a peak of "
                                    f"{peak_bytes} bytes: nothing can meet it")
        return out

    def __str__(self) -> str:
        if self.kind == "fit":
            return f"fit:{self.amount:g}%"
        sign = "-" if self.kind == "below" else ""
        if self.percent:
            return f"{sign}{self.amount:g}%"
        return f"{sign}{self.amount / 2**30:.4g}GiB"


def format_bytes(n: int | None) -> str:
    """Bytes in GiB, MiB or KiB, whichever reads best (``n/a`` for ``None``)."""
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n / 2**10:.1f} KiB"
