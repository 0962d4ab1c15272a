"""llama-bench's list syntax for whole numbers: `1,2,4`, ranges `8-512*4` and `0-24+8`, as
bench's sweeps and `bench serve --concurrency` read it."""

from __future__ import annotations

import re

from llmrun.runners.errors import OptionError

MAX_SWEEP_VALUES = 1000
MAX_DIGITS = 100  # far past any figure an option takes (2**64 has 20 digits)


def whole(text: str) -> int | None:
    """`text` as a whole number in ASCII digits, else None. `str.isdigit()` alone also passes `²`
    and `٣`: `int()` refuses the first with a ValueError and reads the second as 3. Past
    MAX_DIGITS it is none either: Python's int() refuses more than 4,300 digits with a
    ValueError, and no count, port or size llmrun reads has more than a few dozen."""
    if len(text) > MAX_DIGITS or not (text.isascii() and text.isdigit()):
        return None
    return int(text)


def integer(text: str) -> int | None:
    """A whole number with an optional sign, in ASCII digits, else None: `int()` alone also
    reads `٣` (Arabic-Indic), fullwidth digits and `1_0`, which no option, JSON number or
    llama.cpp tool spells so."""
    text = text.strip()
    digits = text[1:] if text[:1] in ("-", "+") else text
    return int(text) if whole(digits) is not None else None


def real(text: str) -> float | None:
    """A number as `float()` reads it (`0.5`, `5e-1`, `inf`, `nan`), in ASCII and without `_`,
    else None; whether inf or nan may pass is the caller's range check."""
    if not text.isascii() or "_" in text or len(text) > MAX_DIGITS + 10:
        return None
    try:
        return float(text)
    except ValueError:
        return None


def share(text: str) -> float | None:
    """A non-negative decimal such as `3` or `0.5` in ASCII digits (-ts's shares), else None."""
    return float(text) if whole(text.replace(".", "", 1)) is not None else None


MAX_VALUE = 1 << 24  # a list's largest value unless its option says less (a server's levels)


def parse_values(text: str, *, name: str, minimum: int = 0, maximum: int = MAX_VALUE) -> list[int]:
    """llama-bench's list syntax: `1,2,4`, ranges `8-512*4` (times) and `0-24+8` (plus).

    Every value must lie in minimum..maximum (sizes are never negative; -ngl allows -1)."""
    values: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if len(part) > 3 * MAX_DIGITS:  # int() refuses more than 4,300 digits
            raise OptionError(
                f"{name}: '{part[:40]}...' is not a number, list or range like 8-512*4"
            )
        m = re.fullmatch(r"(-?[0-9]+)(?:-([0-9]+)(?:([*+])([0-9]+))?)?", part)
        if not m:
            raise OptionError(f"{name}: '{part}' is not a number, list or range like 8-512*4")
        first = int(m.group(1))
        if m.group(2) is None:
            values.append(first)
            continue
        last, op, step = int(m.group(2)), m.group(3) or "+", int(m.group(4) or 1)
        if (op == "*" and (step < 2 or first < 1)) or (op == "+" and step < 1) or last < first:
            raise OptionError(f"{name}: the range '{part}' never ends or is empty")
        value = first
        while value <= last and len(values) <= MAX_SWEEP_VALUES:
            values.append(value)
            value = value * step if op == "*" else value + step
        if len(values) > MAX_SWEEP_VALUES:
            raise OptionError(f"{name}: '{part}' gives more than {MAX_SWEEP_VALUES} values")
    for value in values:
        if not minimum <= value <= maximum:
            raise OptionError(f"{name}: {value} is out of range {minimum}..{maximum}")
    return list(dict.fromkeys(values))
