"""`llmrun doctor`: what this installation is and what it will choose, in a form to paste into a
bug report."""

from __future__ import annotations

import sys
from dataclasses import dataclass

import typer

from llmrun.runners.errors import LlmrunError

from . import options as o
from .errors import handled
from .report import mib
from .terminal import fold, terminal_line, terminal_width
from .version import version_line


@dataclass(frozen=True)
class Finding:
    label: str
    value: str


def findings(model: str | None, *, probe: bool) -> list[Finding]:
    """Every line of the report, in order. Loads llama.cpp's library, not a model; the repacking
    verdict may run the probe (a child process, once per build, CPU and quantization)."""
    from llmrun.runners import devices as dv
    from llmrun.runners import system as sy
    from llmrun.runners.library import llama_c_library

    out = [Finding("version", version_line())]
    lib = llama_c_library()  # libllama alone: the llama_cpp package (numpy...) stays unloaded
    q = dv.query()
    found = q.devices()
    offload = bool(lib.llama_supports_gpu_offload())
    info = lib.llama_print_system_info()
    features = sy._features(info.decode(errors="replace") if isinstance(info, bytes) else str(info))
    out += [
        Finding(
            "build",
            f"llama.cpp {dv.build_commit(q.commit())} · ggml {q.version() or '?'}"
            f" · {sys.executable}",
        ),
        Finding(
            "backend",
            dv.backends(found)
            + (" · GPU offload supported" if offload else " · no GPU offload in this build"),
        ),
    ]
    for d in found:
        memory = (
            f" · {mib(d.free_bytes or 0)} free of {mib(d.total_bytes)}" if d.total_bytes else ""
        )
        out.append(Finding("device", f"{d.name} ({d.kind}) {d.description}{memory}"))
    gpus = dv.describe_gpus(found, offload, dv.host_gpus())
    if gpus:
        out.append(Finding("gpus", gpus))
    ram, free = sy.ram_bytes(), sy.available_memory_bytes()
    p_cores = sy.performance_cores()
    out += [
        Finding(
            "cpu",
            f"{sy.cpu_model()} · {sy.physical_cores()} physical cores"
            + (f" ({p_cores} performance)" if p_cores else "")
            + f" · {sy.logical_cpus()} logical CPUs",
        ),
        Finding("features", features or "-"),
        Finding("memory", f"{mib(ram)} RAM · {mib(free)} available" if ram and free else "-"),
    ]
    background = sy.background_now(0.5)
    choice = sy.choose_threads(sy.default_threads(), background, sy.logical_cpus())
    others = f"other processes use {background or 0.0:.1f} of {sy.logical_cpus()} CPUs"
    if background is None:
        busy = "unknown (no /proc/stat)"
    else:
        busy = f"{'busy' if sy.busy_machine(background, choice.default) else 'quiet'}: {others}"
    out += [
        Finding("load", busy),
        Finding("threads", f"run and chat now: {choice.why}; bench: {choice.default}, as asked"),
    ]
    out.append(Finding("repack", _repack(model, probe=probe)))
    out.append(Finding("tuned", _tuned()))
    return out


def _tuned() -> str:
    """Where tune's settings are kept, and whether run and chat can read them: a damaged file
    stops both at their start, and doctor said nothing of it."""
    from llmrun.runners.bench.tuned import check_tuned_file, tuned_file
    from llmrun.runners.limits import SettingError

    try:
        check_tuned_file()
    except SettingError as e:
        return f"unusable, so run and chat stop at their start: {e}"
    path = tuned_file()
    return f"saved in {path}" if path.exists() else f"none saved yet ({path})"


def _repack(model: str | None, *, probe: bool) -> str:
    """Whether run and chat would repack this model's weights, and why."""
    from llmrun.runners.gguf import read_gguf
    from llmrun.runners.models import resolve_model

    try:
        path = resolve_model(model).path
        quant = read_gguf(path).quantization
    except LlmrunError as e:
        return f"decided per model at load (no model to ask about: {e})"
    from llmrun.runners.probe import probe_key, repack_verdict

    name = path.rsplit("/", 1)[-1]
    if not probe:
        from llmrun.runners.probe import _read_cache

        cached = _read_cache().get(probe_key(quant))
        if not isinstance(cached, dict):
            return f"{name} ({quant}): not probed yet on this build and CPU (llmrun doctor --probe)"
        safe, why = bool(cached.get("safe")), str(cached.get("why", "probed"))
    else:
        verdict = repack_verdict(path, quant)
        safe, why = verdict.safe, verdict.why
    return f"{name} ({quant}): {'on' if safe else 'off'}: {why}"


def doctor(
    model: o.Model = None,
    probe: bool = typer.Option(
        False, "--probe", help="Run the repacking probe for the model if it has not run yet."
    ),
) -> None:
    """Print the build, backend, devices, CPU features, the thread and repacking choices with
    their reasons, and whether the machine is busy: paste it into a bug report."""
    with handled():
        width = terminal_width(sys.stdout)  # folded at spaces on a terminal, whole in a pipe
        for f in findings(model, probe=probe):
            # a value may quote a file (the probe's cached reason) or a path: text, not controls
            line = f"{f.label:<9} {terminal_line(f.value)}"
            print(fold(line, width, indent=10), flush=True)
