"""NVIDIA GPU energy from NVML's total-energy counter (millijoules since the driver loaded;
Volta and newer), through nvidia-ml-py's `pynvml` module when it is installed (the `nvidia`
extra). Every GPU NVML sees is summed: llama.cpp spreads layers over all visible GPUs, and an
idle one adds only its idle power, which the baseline takes off."""

from __future__ import annotations

import contextlib
import importlib
from types import ModuleType
from typing import Any

from .counter import Unavailable

INSTALL = "nvidia-ml-py is not installed (pip install 'llmrun[nvidia]')"


def _error_text(nvml: Any, e: Exception) -> str:
    """NVML's own words for an error, with what it means here where that is known."""
    value = getattr(e, "value", None)
    if value == getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", object()):
        return "this GPU has no total-energy counter (NVML has one from Volta on)"
    if value == getattr(nvml, "NVML_ERROR_NO_PERMISSION", object()):
        return "NVML refused to read the GPU's energy counter (no permission)"
    return f"NVML: {e}"


class NvmlCounter:
    """The summed total-energy counters of the GPUs NVML sees."""

    kind = "gpu"

    def __init__(self, nvml: Any, handles: list[Any], names: list[str]) -> None:
        self._nvml = nvml
        self._handles = handles
        self._names = names

    @property
    def name(self) -> str:
        gpus = ", ".join(f"GPU {i} ({n})" if n else f"GPU {i}" for i, n in enumerate(self._names))
        return f"NVML {gpus}"

    def read_j(self) -> float:
        try:
            total_mj = sum(
                int(self._nvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in self._handles
            )
        except self._nvml.NVMLError as e:
            raise Unavailable(_error_text(self._nvml, e)) from None
        return total_mj / 1000

    def close(self) -> None:
        _shutdown(self._nvml)


def _shutdown(nvml: Any) -> None:
    with contextlib.suppress(nvml.NVMLError):
        nvml.nvmlShutdown()


def _name(nvml: Any, handle: Any) -> str:
    """The GPU's name, or "" where NVML gives none: nvidia-ml-py decodes the driver's bytes
    strictly, so a name that is not UTF-8 is a UnicodeDecodeError there."""
    try:
        name = nvml.nvmlDeviceGetName(handle)
    except (nvml.NVMLError, UnicodeError):
        return ""
    return name.decode(errors="replace") if isinstance(name, bytes) else str(name)


def install_hint() -> str | None:
    """INSTALL where `pynvml` cannot be imported, else None: what `--energy on` says when it
    finds no counter, though no layer was to run on a GPU."""
    try:
        importlib.import_module("pynvml")
    except ImportError:
        return INSTALL
    return None


def open_nvml(module: ModuleType | None = None) -> NvmlCounter:
    """Every GPU's energy counter; `Unavailable` with the reason where there is none.
    `module` stands for `pynvml` (tests pass a fake)."""
    nvml: Any = module
    if nvml is None:
        try:
            nvml = importlib.import_module("pynvml")
        except ImportError:
            raise Unavailable(INSTALL) from None
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        raise Unavailable(f"NVML cannot start ({e}): no NVIDIA driver here") from None
    try:
        count = int(nvml.nvmlDeviceGetCount())
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        if not handles:
            raise Unavailable("NVML sees no GPU")
        counter = NvmlCounter(nvml, handles, [_name(nvml, h) for h in handles])
        counter.read_j()
    except nvml.NVMLError as e:
        _shutdown(nvml)
        raise Unavailable(_error_text(nvml, e)) from None
    except Unavailable:
        _shutdown(nvml)
        raise
    return counter
