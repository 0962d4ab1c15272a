"""CPU energy from Linux powercap (RAPL): the packages and their DRAM, each counted once.

The tree (/sys/class/powercap, or LLMRUN_POWERCAP_ROOT) lists every zone flat:
`intel-rapl:0` (package-0) with its sub-zones `intel-rapl:0:0` (core), `intel-rapl:0:1`
(uncore), `intel-rapl:0:2` (dram); AMD's packages appear the same way under `intel-rapl` or
`amd-rapl`. core and uncore are parts of their package and psys covers the whole platform, so
only packages and dram are summed; `intel-rapl-mmio` repeats a package's counter and is left out.
Each `energy_uj` wraps at `max_energy_range_uj`; since 2020 (CVE-2020-8694) it is root-only.
Every file is read as a hostile one (LLMRUN_POWERCAP_ROOT may name any tree): without waiting
(a FIFO is refused, not waited on), within COUNTER_FILE_BYTES, bytes that are not UTF-8
replaced; one that cannot be read is a zone left out, and the reason is kept for the message.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from llmrun.runners.files import read_capped
from llmrun.runners.lists import whole

from .counter import Unavailable

ROOT_ENV = "LLMRUN_POWERCAP_ROOT"
DEFAULT_ROOT = "/sys/class/powercap"
ZONE = re.compile(r"^(intel-rapl|amd-rapl):([0-9]+)(?::([0-9]+))?$")
ROOT_ONLY = "powercap is root-only here: run as root or grant read access to energy_uj"
COUNTER_FILE_BYTES = 4096  # a sysfs attribute is one page at most


@dataclass
class _Zone:
    path: Path
    label: str  # package-0, package-0/dram
    range_uj: int
    last_uj: int
    total_uj: int = 0


def _read_text(path: Path) -> str:
    """A zone file's text: read without waiting, capped, bytes that are not UTF-8 replaced.
    Raises OSError (PermissionError, a FIFO or device: not a regular file) and ValueError
    (FileTooLargeError)."""
    data = read_capped(path, max_bytes=COUNTER_FILE_BYTES, what="counter file", regular=True)
    return data.decode("utf-8", errors="replace").strip()


def _read_int(path: Path) -> int:
    """A counter file's whole number (ASCII digits, as the kernel writes it)."""
    text = _read_text(path)
    value = whole(text)
    if value is None:
        raise ValueError(f"{text[:20]!r} is not a count")
    return value


def _order(name: str) -> tuple[int, ...]:
    return tuple(int(n) for n in re.findall(r"[0-9]+", name))


class PowercapCounter:
    """The summed package and dram zones of a powercap tree."""

    kind = "cpu"

    def __init__(self, zones: list[_Zone]) -> None:
        self._zones = zones

    @property
    def name(self) -> str:
        return f"RAPL {', '.join(z.label for z in self._zones)}"

    @property
    def labels(self) -> tuple[str, ...]:
        return tuple(z.label for z in self._zones)

    def read_j(self) -> float:
        for zone in self._zones:
            try:
                now = _read_int(zone.path / "energy_uj")
            except PermissionError:
                raise Unavailable(ROOT_ONLY) from None
            except (OSError, ValueError) as e:
                raise Unavailable(f"reading {_why(zone.path / 'energy_uj', e)}") from None
            if now > zone.range_uj:  # the kernel's counter wraps at its range: this is none
                raise Unavailable(
                    f"{zone.path / 'energy_uj'} reads {now} µJ, past its range of"
                    f" {zone.range_uj} µJ: not a RAPL counter"
                )
            delta = now - zone.last_uj
            if delta < 0:  # wrapped: it counted up to the range, then on from zero
                delta += zone.range_uj
            zone.total_uj += delta
            zone.last_uj = now
        return sum(z.total_uj for z in self._zones) / 1e6

    def close(self) -> None:
        pass


def powercap_root(root: str | os.PathLike[str] | None = None) -> Path:
    return Path(root or os.environ.get(ROOT_ENV) or DEFAULT_ROOT)


def open_powercap(root: str | os.PathLike[str] | None = None) -> PowercapCounter:
    """The package and dram zones under `root`; `Unavailable` with the reason where none can
    be read."""
    base = powercap_root(root)
    if base.exists() and not base.is_dir():
        raise Unavailable(f"no RAPL counters: {base} is a file, not the powercap folder")
    if not base.is_dir():
        raise Unavailable(
            f"no RAPL counters: {base} is missing here, as in most VMs and containers"
        )
    found: list[tuple[re.Match[str], Path, str]] = []
    failed: list[str] = []  # why a zone was left out, for the message where none is left
    for entry in sorted(base.iterdir(), key=lambda p: (_order(p.name), p.name)):
        match = ZONE.match(entry.name)
        if match is None:
            continue
        try:
            name = _read_text(entry / "name")
        except (OSError, ValueError) as e:
            failed.append(_why(entry / "name", e))
            continue
        found.append((match, entry, name))
    packages = {m.group(2): name for m, _, name in found if m.group(3) is None}
    zones: list[_Zone] = []
    denied = False
    for match, entry, name in found:
        top = match.group(3) is None
        if top and name.startswith("package"):
            label = name
        elif name == "dram":
            label = f"{packages.get(match.group(2), match.group(2))}/dram" if not top else name
        else:
            continue  # core, uncore: inside their package; psys: the whole platform
        if any(z.label == label for z in zones):  # the same zone under another driver's name
            continue
        try:
            last = _read_int(entry / "energy_uj")
            range_uj = _read_int(entry / "max_energy_range_uj")
        except PermissionError:
            denied = True
            continue
        except (OSError, ValueError) as e:
            failed.append(_why(entry, e))
            continue
        if not 0 <= last <= range_uj or range_uj == 0:  # no counter the kernel writes
            failed.append(f"{entry}: energy_uj {last} is outside its range {range_uj}")
            continue
        zones.append(_Zone(entry, label, range_uj, last))
    if denied:
        raise Unavailable(ROOT_ONLY)
    if not zones:
        reason = f" ({failed[0]})" if failed else ""
        raise Unavailable(f"no readable RAPL package zone under {base}{reason}")
    return PowercapCounter(zones)


def _why(path: Path, e: Exception) -> str:
    """A read's failure in a few words: the file, then the OS's reason or the text that was
    no count."""
    if isinstance(e, OSError):
        return f"{e.filename or path}: {e.strerror or e}"
    return f"{path}: {e}"
