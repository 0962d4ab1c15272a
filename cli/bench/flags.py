"""llama-bench's options that llmrun's engine cannot honour, or that act on the whole process.

A llama-bench command line must never fail with a misleading parse error, nor silently measure
something else: each such option is accepted at llama-bench's default, applied where it means
something for this process, and otherwise refused in one line that says why.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from llmrun.runners.bench.sweep import BOOL_ALIASES
from llmrun.runners.errors import NO_MODEL, BadRequestError, OptionError
from llmrun.runners.library import llama_lib

# llama-bench's default for each placement on a device, all passed on to llama.cpp: given at
# this value (or a list of only it), it changes nothing (-ncmoe and -ot are not here: they
# place tensors on the CPU too, which every build has)
_GPU = {
    "-sm/--split-mode": {"layer"},
    "-mg/--main-gpu": {"0"},
    "-ts/--tensor-split": {"0", "0.00"},
    "-dev/--device": {"auto"},
}
NUMA = {"distribute": 1, "isolate": 2, "numactl": 3}
PRIORITY_NICE = {-1: 5, 0: 0, 1: -5, 2: -10, 3: -20}  # llama.cpp's set_process_priority


def _non_default(text: str | None, defaults: set[str]) -> list[str]:
    if text is None:
        return []
    words = [w.strip().lower() for w in text.split(",")]
    return [w for w in words if w and BOOL_ALIASES.get(w, w) not in defaults]


def refuse_unusable(given: Mapping[str, str | None]) -> None:
    """One line for the first placement (a flag of _GPU, its list as given) that asks for a
    device where this build has none."""
    for flag, text in given.items():
        odd = _non_default(text, _GPU[flag])
        if odd and not llama_lib().llama_supports_gpu_offload():
            raise BadRequestError(
                f"{flag} {odd[0]}: this llama.cpp build has no GPU backend, so there is nothing"
                " to place on a device; rebuild with one (README, 'Hardware': make GPU=cuda)"
            )


def attach_rpc(servers: str) -> None:
    """llama-bench's -rpc: the servers' devices registered before any check or model, as
    llama-bench registers them while it reads its options (so -ts, -sm and -dev see them)."""
    from llmrun.runners import rpc

    try:
        rpc.attach(rpc.parse_endpoints(servers))
    except rpc.RpcNotBuiltError as e:
        raise BadRequestError(f"-rpc/--rpc {servers}: {e}") from None


def hub_models(
    models: list[str] | None,
    repos: list[str] | None,
    hf_file: str | None,
    token: str | None,
    offline: bool,
) -> list[str] | None:
    """llama-bench's -hf REPO[:QUANT] and -hff FILE as llmrun's Hub references (-m takes
    them too); -hft and --offline through the Hub library's own variables."""
    if token:
        os.environ["HF_TOKEN"] = token
    if offline:
        os.environ["HF_HUB_OFFLINE"] = "1"
    if hf_file and not repos:
        raise BadRequestError("-hff/--hf-file names a file in -hf/--hf-repo: give the repository")
    refs = [f"{r.split(':')[0]}/{hf_file}" if hf_file else r for r in repos or []]
    # as llama-bench (getline: `a.gguf,` is one item; `a,,b` holds an empty one)
    split = [p.strip() for m in models or [] for p in m.removesuffix(",").split(",")]
    if not all(split):  # `-m ''` or `-m a,,b` measured the embedded model
        raise OptionError(NO_MODEL)
    return [*split, *refs] or None


def apply_process_settings(*, numa: str | None, prio: int) -> None:
    """--numa and --prio act on the process, as in llama-bench."""
    if numa is not None:
        strategy = NUMA.get(numa.strip().lower())
        if strategy is None:
            raise OptionError(f"--numa: '{numa}' is not one of {', '.join(NUMA)}")
        llama_lib().llama_numa_init(strategy)
    if prio:
        try:
            os.setpriority(os.PRIO_PROCESS, 0, PRIORITY_NICE[prio])
        except PermissionError:
            raise BadRequestError(
                f"--prio {prio}: raising the priority needs privileges (CAP_SYS_NICE) this"
                " process lacks; run without --prio or with -1 (lower)"
            ) from None
