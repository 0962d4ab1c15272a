"""The GPU check: llmrun against llama.cpp's own tools on a GPU machine that has no network.

The GPU machine reaches no package registry, takes at most 64 MiB of files and can download no
model. So the check runs in two halves:

- Here, with network: `--prepare` makes a bundle (.gpu/, ignored by git): the llama.cpp source
  that the installed llama-cpp-python vendors, trimmed of what a build of the libraries,
  llama-bench and llama-batched-bench does not need; the bindings' Python files; wheels of the
  Python packages llmrun needs (for CPython 3.12, the GPU image's); the project itself; the
  embedded model's tokenizer and chat template without its tensors. Its last line is the folder.
- There: without --prepare it builds llama.cpp with CUDA for the GPU's compute capability
  (flash-attention kernels on; --fa off builds without them), puts the libraries under the
  bindings, writes synthetic models of the 135M, 1B and 8B Llama shapes (synth_gguf.py), runs
  llama-bench and `llmrun bench` side by side (B A B) for pp512/tg128, llama-batched-bench and
  llmrun's serving lab at 1, 8 and 32 sequences, the batched engine's two KV layouts (unified
  and one stream per sequence, benchmarks/kv_layout.py: 8B shape, B=8 and 32, 64 in / 32 out,
  about a minute) each next to llama-batched-bench in the same layout, and prints every ratio
  of issue 20 with its target, and which KV layout the engine runs faster there. Everything it
  prints also goes to $OUT/gpu-log.txt when OUT names a folder.

    .venv/bin/python benchmarks/gpu.py --prepare     # here; prints the bundle's folder last
    python3 benchmarks/gpu.py                        # there, from the repository root
    python3 benchmarks/gpu.py --dry-run --cuda-arch 90   # the commands it would run

Exit status: 0 when every step ran, 1 when one failed, there is no GPU, or no bundle.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parent.parent
BUNDLE = ROOT / ".gpu"
BUNDLE_LIMIT_BYTES = 48 << 20  # the machine takes 64 MiB, the working tree included
PACKAGE = "llama-cpp-python"
TOKENIZER = "tokenizer.gguf"
LLAMA_CPP_TGZ, BINDINGS_TGZ, PROJECT_TGZ, WHEELS = (
    "llama.cpp.tgz",
    "llama_cpp.tgz",
    "project.tgz",
    "wheels",
)

# ---- the bundle (here) ---------------------------------------------------------------------

# What a build of libllama, libggml (CPU and CUDA), llama-bench and llama-batched-bench does
# not read: models and docs (110 MB of the 176), tests, examples, the web UI, the Python
# conversion scripts, and the other accelerators' ggml backends. CMake only enters a backend's
# folder when that backend is asked for.
TRIMMED = (
    "models",
    "docs",
    "benches",
    "tests",
    "examples",
    "pocs",
    "media",
    "gguf-py",
    "conversion",
    "ci",
    "skills",
    "requirements",
    "tools/ui",
    "ggml/src/ggml-et",
    "ggml/src/ggml-metal",
    "ggml/src/ggml-hexagon",
    "ggml/src/ggml-sycl",
    "ggml/src/ggml-vulkan",
    "ggml/src/ggml-opencl",
    "ggml/src/ggml-cann",
    "ggml/src/ggml-openvino",
    "ggml/src/ggml-webgpu",
    "ggml/src/ggml-virtgpu",
    "ggml/src/ggml-zdnn",
)
TRIMMED_FILES = (
    "convert_hf_to_gguf.py",
    "convert_hf_to_gguf_update.py",
    "convert_llama_ggml_to_gguf.py",
    "convert_lora_to_gguf.py",
)

# The GPU machine's Python (KINDS.md: CPython 3.12 on x86-64) and the wheels pip may take for it
WHEEL_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)
WHEEL_PYTHON = "3.12"
# What the image has and llmrun must not replace: numpy (its own build of it) and llama-cpp-python
# (built there from the bundle's source). huggingface-hub is imported only to download a model,
# which nothing does there.
NOT_CARRIED = frozenset(("llama-cpp-python", "numpy", "huggingface-hub"))
MARKER_ENV = {
    "python_version": WHEEL_PYTHON,
    "python_full_version": WHEEL_PYTHON + ".3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "os_name": "posix",
    "platform_machine": "x86_64",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}


def keep_llama_cpp(rel: str) -> bool:
    """Whether a path of vendor/llama.cpp goes into the bundle."""
    if rel in TRIMMED_FILES:
        return False
    return not any(rel == d or rel.startswith(d + "/") for d in TRIMMED)


def keep_binding(rel: str) -> bool:
    """The bindings' Python files: the llama_cpp package without built libraries."""
    return rel.startswith("llama_cpp/") and not rel.startswith("llama_cpp/lib/")


def split_sdist(sdist: Path, bundle: Path) -> tuple[Path, Path]:
    """The sdist's vendored llama.cpp (trimmed) and its llama_cpp package, each as a tgz."""
    llama, bindings = bundle / LLAMA_CPP_TGZ, bundle / BINDINGS_TGZ
    with (
        tarfile.open(sdist) as src,
        tarfile.open(llama, "w:gz", compresslevel=9) as out_l,
        tarfile.open(bindings, "w:gz", compresslevel=9) as out_b,
    ):
        for member in src:
            _, _, rel = member.name.partition("/")  # below llama_cpp_python-X.Y.Z/
            vendored = rel.removeprefix("vendor/")
            if rel.startswith("vendor/llama.cpp/") and keep_llama_cpp(
                vendored.removeprefix("llama.cpp/")
            ):
                target, name = out_l, vendored
            elif keep_binding(rel):
                target, name = out_b, rel
            else:
                continue
            data = src.extractfile(member) if member.isfile() else None
            target.addfile(replace_name(member, name), data)
    if not _has(llama, "llama.cpp/CMakeLists.txt") or not _has(bindings, "llama_cpp/llama.py"):
        raise ValueError(f"{sdist} is not a llama-cpp-python source distribution")
    return llama, bindings


def replace_name(member: tarfile.TarInfo, name: str) -> tarfile.TarInfo:
    """The member under another name (a long name's pax header would otherwise win)."""
    renamed = copy.copy(member)
    renamed.name = name
    renamed.pax_headers = {k: v for k, v in member.pax_headers.items() if k != "path"}
    return renamed


def _has(archive: Path, name: str) -> bool:
    with tarfile.open(archive) as tar:
        try:
            tar.getmember(name)
        except KeyError:
            return False
    return True


def wheel_pins(
    roots: Iterable[str],
    requires: Callable[[str], list[str] | None],
    version: Callable[[str], str | None],
) -> list[str]:
    """`name==version` for every package the roots need at run time on the GPU machine (their
    requirements' closure for CPython 3.12 on Linux, extras left out), at the versions installed
    here, less NOT_CARRIED."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    pins: dict[str, str] = {}
    todo = [canonicalize_name(r) for r in roots]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name in NOT_CARRIED:
            continue
        seen.add(name)
        installed = version(name)
        if installed is None:
            raise ValueError(f"{name} is needed on the GPU machine but is not installed here")
        pins[name] = installed
        for text in requires(name) or []:
            req = Requirement(text)
            if req.marker is None or req.marker.evaluate(MARKER_ENV):
                todo.append(canonicalize_name(req.name))
    return [f"{n}=={v}" for n, v in sorted(pins.items())]


def installed_pins() -> list[str]:
    """wheel_pins for llmrun and the bindings, from this environment's metadata."""

    def version(name: str) -> str | None:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return None

    def requires(name: str) -> list[str] | None:
        return importlib.metadata.requires(name)

    roots = [r for r in requires("llmrun") or [] if "extra ==" not in r]
    roots += [r for r in requires(PACKAGE) or [] if "extra ==" not in r]
    from packaging.requirements import Requirement

    return wheel_pins([Requirement(r).name for r in roots], requires, version)


def pip(*args: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", *args, "--quiet", "--disable-pip-version-check"], check=False
    )
    if done.returncode != 0:
        raise OSError(f"pip {args[0]} failed ({done.returncode})")


def download_sdist(version: str, folder: Path) -> Path:
    """llama-cpp-python's source distribution (pip's cache serves it once fetched)."""
    pip("download", "--no-deps", "--no-binary", ":all:", f"{PACKAGE}=={version}", "-d", str(folder))
    return next(folder.glob("*.tar.gz"))


def download_wheels(pins: Sequence[str], folder: Path) -> None:
    platforms = [a for p in WHEEL_PLATFORMS for a in ("--platform", p)]
    pip(
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        WHEEL_PYTHON,
        "--implementation",
        "cp",
        *platforms,
        "-d",
        str(folder),
        *pins,
    )


def project_files(root: Path) -> list[str]:
    """The project as git sees it: tracked files and new ones it does not ignore."""
    done = subprocess.run(
        ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
        check=True,
    )
    names = [n for n in done.stdout.decode().split("\0") if n]
    return sorted(n for n in dict.fromkeys(names) if (root / n).is_file())


def pack_project(root: Path, target: Path) -> Path:
    with tarfile.open(target, "w:gz", compresslevel=9) as tar:
        for name in project_files(root):
            tar.add(root / name, arcname=f"project/{name}", recursive=False)
    return target


@dataclass(frozen=True)
class Sources:
    """Where prepare gets what it packs: the network and this environment, or test fakes."""

    version: str
    tokenizer_model: Path  # a real GGUF model whose tokenizer and chat template are kept
    sdist: Callable[[str, Path], Path] = download_sdist
    pins: Callable[[], list[str]] = installed_pins
    wheels: Callable[[Sequence[str], Path], None] = download_wheels
    project: Path = ROOT


def prepare(bundle: Path, sources: Sources, *, log: TextIO = sys.stdout) -> int:
    """Make the bundle; returns its size in bytes (refused past BUNDLE_LIMIT_BYTES)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import synth_gguf

    if bundle.exists():
        shutil.rmtree(bundle)
    (bundle / WHEELS).mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        sdist = sources.sdist(sources.version, Path(tmp))
        split_sdist(sdist, bundle)
        log.write(f"{sdist.name}: {sdist.stat().st_size / 2**20:,.1f} MiB, trimmed\n")
    pins = sources.pins()
    sources.wheels(pins, bundle / WHEELS)
    pack_project(sources.project, bundle / PROJECT_TGZ)
    synth_gguf.strip(sources.tokenizer_model, bundle / TOKENIZER)
    manifest = {
        "llama_cpp_python": sources.version,
        "wheels": pins,
        "tokenizer_from": sources.tokenizer_model.name,
        "made": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    (bundle / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = 0
    for path in sorted(p for p in bundle.rglob("*") if p.is_file()):
        total += path.stat().st_size
        if path.parent == bundle:
            log.write(f"  {path.name:<16} {path.stat().st_size / 2**20:8.2f} MiB\n")
    n_wheels = len(list((bundle / WHEELS).glob("*.whl")))
    log.write(f"  {WHEELS + '/':<16} {n_wheels} wheels\n")
    log.write(f"bundle: {total / 2**20:,.1f} MiB in all\n")
    if total > BUNDLE_LIMIT_BYTES:
        raise ValueError(
            f"the bundle is {total / 2**20:,.1f} MiB, over its {BUNDLE_LIMIT_BYTES >> 20} MiB limit"
        )
    return total


def ignore_bundle(root: Path, bundle: Path) -> None:
    """Keep the bundle out of git's view (.gitignore names /.gpu/; other folders are added to
    the clone's own exclude file)."""
    try:
        rel = bundle.resolve().relative_to(root.resolve())
    except ValueError:
        return
    pattern = f"/{rel.as_posix()}/"
    gitignore = root / ".gitignore"
    if gitignore.exists() and pattern in gitignore.read_text().splitlines():
        return
    exclude = root / ".git" / "info" / "exclude"
    if (root / ".git").is_dir():
        exclude.parent.mkdir(parents=True, exist_ok=True)
        lines = exclude.read_text().splitlines() if exclude.exists() else []
        if pattern not in lines:
            exclude.write_text("\n".join([*lines, pattern]) + "\n")


# ---- the machine (there) -------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    name: str
    compute_cap: str  # "9.0"
    memory_mib: int

    @property
    def cuda_arch(self) -> str:
        """CMAKE_CUDA_ARCHITECTURES for this GPU alone: machine code for it, no PTX."""
        return self.compute_cap.replace(".", "") + "-real"


def parse_gpus(text: str) -> list[Gpu]:
    """nvidia-smi --query-gpu=name,compute_cap,memory.total --format=csv,noheader,nounits"""
    gpus = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.rsplit(",", 2)]
        if len(parts) == 3 and parts[1].replace(".", "").isdigit() and parts[2].isdigit():
            gpus.append(Gpu(parts[0], parts[1], int(parts[2])))
    return gpus


def find_gpus() -> tuple[list[Gpu], str]:
    """The NVIDIA GPUs here, or none and why."""
    if shutil.which("nvidia-smi") is None:
        return [], "nvidia-smi is not installed"
    try:
        done = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,compute_cap,memory.total",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return [], f"nvidia-smi failed: {e}"
    gpus = parse_gpus(done.stdout)
    return gpus, "" if gpus else (done.stderr.strip() or "nvidia-smi lists no GPU")


@dataclass(frozen=True)
class Layout:
    """The bundle, and the folders the check builds and writes in."""

    bundle: Path
    work: Path

    @property
    def src(self) -> Path:
        return self.work / "llama.cpp"

    @property
    def build(self) -> Path:
        return self.src / "build"

    @property
    def site(self) -> Path:  # the wheels, the bindings and llmrun: PYTHONPATH
        return self.work / "site"

    @property
    def project(self) -> Path:
        return self.work / "project"

    @property
    def models(self) -> Path:
        return self.work / "models"

    def tool(self, name: str) -> str:
        return str(self.build / "bin" / name)

    def model(self, shape: str) -> str:
        return str(self.models / f"{shape}.gguf")


@dataclass(frozen=True)
class Options:
    flash_attn: bool = True
    shapes: tuple[str, ...] = ("135m", "1b", "8b")
    reps: int = 5
    serve_shape: str = "8b"
    concurrency: tuple[int, ...] = (1, 8, 32)
    num_prompts: int = 64
    input_len: int = 256
    output_len: int = 64
    cpu_shape: str | None = "1b"  # the host's CPU, -ngl 0: None skips it
    # weight repacking on that CPU row, the same for both tools: off on a host with AMX, where
    # llama.cpp's repacked AMX kernels (in llama-cpp-python 0.3.36) die by SIGILL at the first
    # batch of more than one token, as llmrun's probe finds (host_has_amx)
    cpu_repack: bool = True
    # the KV layouts' step (on serve_shape): kept small, the whole check fits in ~9 minutes
    kv_levels: tuple[int, ...] = (8, 32)
    kv_input_len: int = 64
    kv_output_len: int = 32
    kv_rounds: int = 3
    jobs: int = 16
    python: str = sys.executable


@dataclass(frozen=True)
class Step:
    """One thing the check does: a command (argv) or one of ACTIONS (action), with what its
    output is read as (`reads`) and under which key its results are filed."""

    label: str
    argv: tuple[str, ...] = ()
    action: str = ""
    timeout_s: int = 300
    reads: str = ""  # "", "llama-bench", "llmrun-bench", "batched-bench", "llmrun-serve",
    # "kv-layout"
    key: str = ""  # e.g. "8b" or "cpu-1b"
    cwd: str = ""


def llmrun_argv(opts: Options) -> tuple[str, ...]:
    return (opts.python, "-c", "import sys; from llmrun.cli.main import main; sys.exit(main())")


def plan(arch: str, layout: Layout, opts: Options, wheels: Sequence[str]) -> list[Step]:
    """Every step of the check, in order: a pure function of the machine and the options."""
    fa = "1" if opts.flash_attn else "0"
    llmrun = llmrun_argv(opts)
    steps = [
        Step("unpack the bundle", action="unpack"),
        Step(
            "install the wheels",
            (
                opts.python,
                "-m",
                "pip",
                "install",
                "-q",
                "--no-index",
                "--no-deps",
                "--no-compile",
                "--no-cache-dir",
                "--upgrade",
                "--target",
                str(layout.site),
                *wheels,
            ),
            timeout_s=180,
        ),
        Step("link the bindings and llmrun", action="link"),
        Step(
            "configure llama.cpp",
            (
                "cmake",
                "-S",
                str(layout.src),
                "-B",
                str(layout.build),
                "-G",
                "Ninja",
                "-DCMAKE_BUILD_TYPE=Release",
                "-DGGML_CUDA=ON",
                f"-DCMAKE_CUDA_ARCHITECTURES={arch}",
                f"-DGGML_CUDA_FA={'ON' if opts.flash_attn else 'OFF'}",
                "-DGGML_CUDA_COMPRESSION_MODE=none",
                "-DGGML_NATIVE=ON",
                "-DBUILD_SHARED_LIBS=ON",
                "-DLLAMA_CURL=OFF",
                "-DLLAMA_OPENSSL=OFF",
                "-DLLAMA_BUILD_TESTS=OFF",
                "-DLLAMA_BUILD_EXAMPLES=OFF",
                "-DLLAMA_BUILD_SERVER=OFF",
                "-DLLAMA_BUILD_APP=OFF",
            ),
            timeout_s=300,
        ),
        Step(
            "build llama.cpp",
            (
                "cmake",
                "--build",
                str(layout.build),
                "-j",
                str(opts.jobs),
                "--target",
                "llama-bench",
                "llama-batched-bench",
            ),
            timeout_s=480,
        ),
        Step("put the libraries under the bindings", action="libs"),
    ]
    shapes = list(
        dict.fromkeys(
            [*opts.shapes, opts.serve_shape, *([opts.cpu_shape] if opts.cpu_shape else [])]
        )
    )
    synth = str(layout.project / "benchmarks" / "synth_gguf.py")
    tokenizer = str(layout.bundle / TOKENIZER)
    for shape in shapes:
        steps.append(
            Step(
                f"write the {shape} model",
                (opts.python, synth, "make", tokenizer, shape, layout.model(shape)),
                timeout_s=120,
            )
        )
    for shape in opts.shapes:
        common = (
            "-m",
            layout.model(shape),
            "-p",
            "512",
            "-n",
            "128",
            "-r",
            str(opts.reps),
            "-ngl",
            "99",
            "-fa",
            fa,
            "-o",
            "jsonl",
        )
        lb = Step(
            f"{shape}: llama-bench",
            (layout.tool("llama-bench"), *common),
            reads="llama-bench",
            key=shape,
        )
        lr = Step(
            f"{shape}: llmrun bench",
            (*llmrun, "bench", *common, "--no-history", "--no-tuned"),
            reads="llmrun-bench",
            key=shape,
        )
        steps += [lb, lr, replace(lb, label=lb.label + " again")]  # B A B
    if opts.cpu_shape:
        cpu = (
            "-m",
            layout.model(opts.cpu_shape),
            "-p",
            "512",
            "-n",
            "64",
            "-r",
            "3",
            "-ngl",
            "0",
            "-fa",
            fa,
            "-t",
            str(opts.jobs),
            "--repack",
            "1" if opts.cpu_repack else "0",
            "-o",
            "jsonl",
        )
        key = f"cpu-{opts.cpu_shape}"
        lb = Step(
            f"{opts.cpu_shape} on the CPU: llama-bench",
            (layout.tool("llama-bench"), *cpu),
            reads="llama-bench",
            key=key,
        )
        lr = Step(
            f"{opts.cpu_shape} on the CPU: llmrun bench",
            (*llmrun, "bench", *cpu, "--no-history", "--no-tuned"),
            reads="llmrun-bench",
            key=key,
        )
        steps += [lb, lr, replace(lb, label=lb.label + " again")]
    levels = ",".join(str(c) for c in opts.concurrency)
    n_ctx = max(opts.concurrency) * (opts.input_len + opts.output_len) + 256
    model = layout.model(opts.serve_shape)
    steps.append(
        Step(
            f"{opts.serve_shape}: llama-batched-bench",
            (
                layout.tool("llama-batched-bench"),
                "-m",
                model,
                "-c",
                str(n_ctx),
                "-npp",
                str(opts.input_len),
                "-ntg",
                str(opts.output_len),
                "-npl",
                levels,
                "-ngl",
                "99",
                "-fa",
                "on" if opts.flash_attn else "off",
                "--output-format",
                "jsonl",
            ),
            timeout_s=180,
            reads="batched-bench",
            key=opts.serve_shape,
        )
    )
    steps.append(kv_layout_step(layout, opts))
    steps.append(
        Step(
            f"{opts.serve_shape}: llmrun's serving lab",
            (
                *llmrun,
                "bench",
                "serve",
                "-m",
                model,
                "--concurrency",
                levels,
                "--request-rate",
                "inf",
                "--num-prompts",
                str(opts.num_prompts),
                "--input-len",
                str(opts.input_len),
                "--output-len",
                str(opts.output_len),
                "--policy",
                "prefill-first",
                "-o",
                "json",
                "--no-history",
            ),
            timeout_s=300,
            reads="llmrun-serve",
            key=opts.serve_shape,
        )
    )
    return steps


def kv_layout_step(layout: Layout, opts: Options) -> Step:
    """The batched engine with its KV unified and with one stream per sequence, each next to
    llama-batched-bench in the same layout (benchmarks/kv_layout.py, JSON lines)."""
    return Step(
        f"{opts.serve_shape}: KV layouts, the batched engine and llama-batched-bench",
        (
            opts.python,
            str(layout.project / "benchmarks" / "kv_layout.py"),
            "--model",
            layout.model(opts.serve_shape),
            "--npp",
            str(opts.kv_input_len),
            "--ntg",
            str(opts.kv_output_len),
            "--npl",
            ",".join(str(b) for b in opts.kv_levels),
            "--rounds",
            str(opts.kv_rounds),
            "--ngl",
            "99",
            "--jsonl",
        ),
        timeout_s=240,
        reads="kv-layout",
        key=opts.serve_shape,
    )


def step_env(layout: Layout) -> dict[str, str]:
    return {
        **os.environ,
        "LLAMA_BATCHED_BENCH": layout.tool("llama-batched-bench"),  # kv_layout.py's reference
        "PYTHONPATH": str(layout.site),
        "LLMRUN_HOME": str(layout.work / "home"),
        "HF_HUB_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
        "NO_COLOR": "1",
        "GGML_NO_BACKTRACE": "1",
    }


def _unpack(layout: Layout) -> None:
    layout.work.mkdir(parents=True, exist_ok=True)
    for name, into in (
        (LLAMA_CPP_TGZ, layout.work),
        (BINDINGS_TGZ, layout.site),
        (PROJECT_TGZ, layout.work),
    ):
        into.mkdir(parents=True, exist_ok=True)
        with tarfile.open(layout.bundle / name) as tar:
            tar.extractall(into, filter="data")
    layout.models.mkdir(exist_ok=True)


def _link(layout: Layout) -> None:
    package = layout.site / "llmrun"
    package.mkdir(parents=True, exist_ok=True)
    for part in ("cli", "runners"):
        link = package / part
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(layout.project / part)


def _libs(layout: Layout) -> None:
    """libllama.so and every libggml*.so next to the bindings, where llama_cpp loads them
    (LLAMA_CPP_LIB_PATH would move libllama alone)."""
    lib = layout.site / "llama_cpp" / "lib"
    lib.mkdir(parents=True, exist_ok=True)
    found = [
        p
        for p in layout.build.rglob("lib*.so*")
        if p.name.startswith(("libllama", "libggml", "libmtmd"))
    ]
    if not any(p.name.startswith("libggml-cuda") for p in found):
        raise OSError(f"the build made no libggml-cuda under {layout.build}")
    for path in found:
        shutil.copy2(path, lib / path.name, follow_symlinks=False)


ACTIONS: dict[str, Callable[[Layout], None]] = {"unpack": _unpack, "link": _link, "libs": _libs}


# ---- reading the tools' output and the ratios ----------------------------------------------


def json_lines(text: str) -> list[dict[str, Any]]:
    """The JSON objects among a tool's output lines (jsonl, or a JSON array)."""
    stripped = text.strip()
    if stripped.startswith("["):
        try:
            return [r for r in json.loads(stripped) if isinstance(r, dict)]
        except json.JSONDecodeError:
            pass
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return rows


def _test(row: dict[str, Any]) -> str:
    n_prompt, n_gen = int(row.get("n_prompt") or 0), int(row.get("n_gen") or 0)
    return f"pp{n_prompt}" if n_prompt and not n_gen else f"tg{n_gen}" if n_gen else "?"


@dataclass
class Results:
    """What the steps measured, filed by shape (or cpu-SHAPE) and test."""

    llama_bench: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    llmrun: dict[tuple[str, str], list[float]] = field(default_factory=dict)
    counter: dict[tuple[str, str], list[float]] = field(
        default_factory=dict
    )  # llama.cpp's, in llmrun
    bandwidth: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    batched: dict[int, dict[str, float]] = field(default_factory=dict)  # B -> total tok/s, step ms
    serving: dict[int, dict[str, float]] = field(default_factory=dict)  # concurrency -> same, ITL
    # (B, kv_unified) -> the engine's and llama-batched-bench's total tok/s and step ms
    kv_layout: dict[tuple[int, bool], dict[str, Any]] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)

    def read(self, step: Step, output: str) -> None:
        rows = json_lines(output)
        if step.reads in ("llama-bench", "llmrun-bench"):
            for r in rows:
                key = (step.key, _test(r))
                mine = self.llama_bench if step.reads == "llama-bench" else self.llmrun
                mine.setdefault(key, []).append(float(r["avg_ts"]))
                if step.reads == "llmrun-bench":
                    if r.get("engine_avg_ts"):
                        self.counter.setdefault(key, []).append(float(r["engine_avg_ts"]))
                    self.bandwidth[key] = {
                        k: r.get(k)
                        for k in (
                            "bw_util",
                            "decode_bw_gbs",
                            "weights_bw_gbs",
                            "mem_bw_source",
                            "device",
                            "n_gpu_layers_offloaded",
                        )
                    }
        elif step.reads == "batched-bench":
            for r in rows:
                steps_ms = 1000 * float(r["t_tg"]) / max(int(r["tg"]), 1)
                self.batched[int(r["pl"])] = {"total_tps": float(r["speed"]), "step_ms": steps_ms}
        elif step.reads == "kv-layout":
            for r in rows:
                self.kv_layout[(int(r["B"]), bool(r["kv_unified"]))] = r
        elif step.reads == "llmrun-serve":
            for r in rows:
                self.serving[int(r["concurrency"])] = {
                    "total_tps": float(r.get("total_token_throughput") or 0),
                    "step_ms": float(r.get("median_itl_ms") or 0),
                }


# Issue 20's targets: llmrun's tg128 against llama-bench's on the same build, per shape
TG_TARGETS = {"135m": 0.95, "1b": 0.98, "8b": 0.98}
SERVING_TARGET = 0.9  # total throughput against llama-batched-bench at 8 and 32 sequences
ITL_TARGET = 1.05  # at one sequence, the serving lab's ITL against plain decode


def _span(values: Sequence[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:,.1f}" if abs(high - low) < 0.05 else f"{low:,.1f}-{high:,.1f}"


def _verdict(ratio: float, target: float, *, at_most: bool = False) -> str:
    ok = ratio <= target if at_most else ratio >= target
    return f"target {'≤' if at_most else '≥'} {target:.2f}: {'met' if ok else 'MISSED'}"


def ratio_lines(res: Results, opts: Options) -> list[str]:
    """Every ratio issue 20 names, one line each, from what the steps measured."""
    fa = "on" if opts.flash_attn else "off"
    lines = []
    for key in sorted(res.llmrun, key=lambda k: (k[0].startswith("cpu"), k)):
        shape, test = key
        ours, theirs = res.llmrun[key], res.llama_bench.get(key)
        if not theirs:
            continue
        ratio = statistics.fmean(ours) / statistics.fmean(theirs)
        where = f"{shape} shape" if not shape.startswith("cpu-") else f"{shape[4:]} shape, CPU"
        line = (
            f"{where}, FA {fa}, {test}: llmrun {_span(ours)} / llama-bench {_span(theirs)}"
            f" tok/s = x{ratio:.3f}"
        )
        counter = res.counter.get(key)
        if counter:
            share = statistics.fmean(counter) / statistics.fmean(theirs)
            line += f"; llama.cpp's counter in llmrun {_span(counter)} (x{share:.3f})"
        if test.startswith("tg") and shape in TG_TARGETS:
            line += f"; {_verdict(ratio, TG_TARGETS[shape])}"
        lines.append(line)
        bw = res.bandwidth.get(key)
        if test.startswith("tg") and bw and not shape.startswith("cpu-"):
            lines.append(
                f"  llmrun ran on {bw.get('device')}, {bw.get('n_gpu_layers_offloaded')}"
                " layers offloaded"
            )
        if test.startswith("tg") and bw and bw.get("bw_util") is not None:
            lines.append(
                f"  bandwidth share {bw['bw_util']:.0%}: {bw.get('decode_bw_gbs')} GB/s"
                f" of {bw.get('weights_bw_gbs')} GB/s ({bw.get('mem_bw_source')})"
                + (" — over 100 %: wrong memory" if bw["bw_util"] > 1 else "")
            )
    plain = res.llama_bench.get((opts.serve_shape, "tg128"))
    for level in sorted(set(res.serving) | set(res.batched)):
        lab, bb = res.serving.get(level), res.batched.get(level)
        if not lab or not bb:
            lines.append(f"{opts.serve_shape} serving at {level}: not measured by both tools")
            continue
        ratio = lab["total_tps"] / bb["total_tps"]
        line = (
            f"{opts.serve_shape} serving, {level} at a time, {opts.input_len} in /"
            f" {opts.output_len} out: llmrun {lab['total_tps']:,.0f} / llama-batched-bench"
            f" {bb['total_tps']:,.0f} total tok/s = x{ratio:.3f}; ITL p50"
            f" {lab['step_ms']:.2f} ms against a decode step of {bb['step_ms']:.2f} ms"
        )
        if level >= 8:
            line += f"; {_verdict(ratio, SERVING_TARGET)}"
        lines.append(line)
        if level == 1 and plain:
            itl = lab["step_ms"] / (1000 / statistics.fmean(plain))
            lines.append(
                f"  at 1: ITL / plain decode (llama-bench tg128) = x{itl:.3f};"
                f" {_verdict(itl, ITL_TARGET, at_most=True)}"
            )
    return lines + kv_layout_lines(res, opts)


def kv_layout_lines(res: Results, opts: Options) -> list[str]:
    """Which KV layout the batched engine runs faster at each B, and llama-batched-bench's."""
    lines = []
    for b in sorted({b for b, _ in res.kv_layout}):
        one, split = res.kv_layout.get((b, True)), res.kv_layout.get((b, False))
        if not one or not split or not one.get("total_tps") or not split.get("total_tps"):
            lines.append(f"{opts.serve_shape} KV layouts at {b}: not measured in both")
            continue
        ratio = one["total_tps"] / split["total_tps"]
        faster = "unified" if ratio > 1 else "one stream per sequence"
        line = (
            f"{opts.serve_shape} KV layouts, {b} at a time, {one.get('npp')} in /"
            f" {one.get('ntg')} out: llmrun unified {one['total_tps']:,.0f} / one stream per"
            f" sequence {split['total_tps']:,.0f} total tok/s = x{ratio:.3f}: {faster} is faster"
        )
        if one.get("ref_total_tps") and split.get("ref_total_tps"):
            theirs, mine = one["ref_total_tps"], split["ref_total_tps"]
            line += (
                f"; llama-batched-bench -kvu {theirs:,.0f} / default {mine:,.0f} ="
                f" x{theirs / mine:.3f}; llmrun / llama-batched-bench in the same layout:"
                f" unified x{one['total_tps'] / theirs:.3f}, per sequence"
                f" x{split['total_tps'] / mine:.3f}"
            )
        lines.append(line)
    return lines


def offload_failures(res: Results) -> list[str]:
    """llmrun's GPU runs that did not run on the GPU (all layers offloaded is its default)."""
    failures = []
    for (shape, test), bw in sorted(res.bandwidth.items()):
        on_cpu = bw.get("device") in (None, "CPU") or not bw.get("n_gpu_layers_offloaded")
        if on_cpu and not shape.startswith("cpu-"):
            failures.append(f"{shape} {test}: llmrun ran on the CPU, -ngl 99 offloaded nothing")
    return failures


# ---- running it ----------------------------------------------------------------------------


class Log:
    """Prints to stdout and, when OUT names a folder, to $OUT/gpu-log.txt."""

    def __init__(self, out: str | None) -> None:
        self._t0 = time.perf_counter()
        self._file: TextIO | None = None
        if out:
            Path(out).mkdir(parents=True, exist_ok=True)
            self._file = open(Path(out) / "gpu-log.txt", "a", encoding="utf-8")  # noqa: SIM115

    def __call__(self, text: str) -> None:
        for stream in (sys.stdout, self._file):
            if stream is not None:
                stream.write(text if text.endswith("\n") else text + "\n")
                stream.flush()

    def mark(self, label: str) -> None:
        self(f"=== [{time.perf_counter() - self._t0:5.0f} s] {label}")


def run(steps: Sequence[Step], layout: Layout, log: Log) -> Results:
    res = Results()
    env = step_env(layout)
    for step in steps:
        log.mark(step.label)
        if step.action:
            try:
                ACTIONS[step.action](layout)
            except (OSError, tarfile.TarError) as e:
                res.failed.append(f"{step.label}: {e}")
                log(f"FAILED: {e}")
                break
            continue
        log("$ " + " ".join(step.argv))
        try:
            done = subprocess.run(
                step.argv,
                capture_output=True,
                text=True,
                env=env,
                timeout=step.timeout_s,
                check=False,
            )
            output, code = done.stdout, done.returncode
            detail = done.stderr
        except subprocess.TimeoutExpired as e:
            output, code = _text(e.stdout), 124
            detail = _text(e.stderr) + f"\ntimed out after {step.timeout_s} s"
        except OSError as e:
            output, code, detail = "", 127, str(e)
        if step.reads:
            log(output.strip()[-4000:])
        if code != 0:
            log(detail.strip()[-3000:])
            res.failed.append(f"{step.label}: exit {code}")
            if not step.reads:  # the build and set-up: nothing after them can run
                break
            continue
        res.read(step, output + "\n" + (detail if step.reads == "batched-bench" else ""))
    return res


def _text(value: str | bytes | None) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value or ""


def host_has_amx(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this host's CPU has AMX tiles (an Intel Xeon since Sapphire Rapids): llama-bench's
    CPU row then runs with repacking off, for both tools (Options.cpu_repack)."""
    try:
        text = Path(cpuinfo).read_text(errors="replace")
    except OSError:
        return False
    return any(
        "amx_tile" in line.split(":", 1)[1].split()
        for line in text.splitlines()
        if line.startswith("flags")
    )


def check(args: argparse.Namespace) -> int:
    layout = Layout(Path(args.bundle).resolve(), Path(args.work).resolve())
    opts = Options(
        flash_attn=args.fa == "on",
        reps=args.reps,
        jobs=args.jobs or os.cpu_count() or 4,
        shapes=tuple(args.shapes.split(",")),
        cpu_repack=not host_has_amx(),
    )
    arch = args.cuda_arch and args.cuda_arch + ("" if "-" in args.cuda_arch else "-real")
    log = Log(os.environ.get("OUT") if not args.dry_run else None)
    if not arch:
        gpus, why = find_gpus()
        if not gpus:
            print(
                f"gpu.py: no NVIDIA GPU here ({why}): this check runs on the GPU machine;"
                " `--prepare` makes its bundle here",
                file=sys.stderr,
            )
            return 1
        arch = gpus[0].cuda_arch
        names = [f"{g.name} (compute {g.compute_cap}, {g.memory_mib:,} MiB)" for g in gpus]
        log("GPU: " + ", ".join(names))
    wheels = sorted(str(p) for p in (layout.bundle / WHEELS).glob("*.whl"))
    steps = plan(arch, layout, opts, wheels)
    if args.dry_run:
        for step in steps:
            print(f"{step.label}: " + (" ".join(step.argv) if step.argv else f"({step.action})"))
        return 0
    if not (layout.bundle / LLAMA_CPP_TGZ).exists():
        print(
            f"gpu.py: no bundle at {layout.bundle}: make it with `--prepare` where pip"
            " works, and bring it along",
            file=sys.stderr,
        )
        return 1
    res = run(steps, layout, log)
    res.failed += offload_failures(res)
    log.mark("ratios")
    for line in ratio_lines(res, opts):
        log(line)
    for failure in res.failed:
        log(f"FAILED: {failure}")
    out = os.environ.get("OUT")
    if out:
        Path(out, "gpu-results.json").write_text(
            json.dumps(
                {
                    "llama_bench": {"/".join(k): v for k, v in res.llama_bench.items()},
                    "llmrun": {"/".join(k): v for k, v in res.llmrun.items()},
                    "counter": {"/".join(k): v for k, v in res.counter.items()},
                    "bandwidth": {"/".join(k): v for k, v in res.bandwidth.items()},
                    "batched": res.batched,
                    "serving": res.serving,
                    "kv_layout": [
                        {**row, "B": b, "kv_unified": u} for (b, u), row in res.kv_layout.items()
                    ],
                    "failed": res.failed,
                },
                indent=1,
            )
        )
    return 1 if res.failed else 0


def embedded_model() -> Path:
    from llmrun.runners.models import default_model_path

    return Path(default_model_path())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prepare", action="store_true", help="make the bundle here (needs pip)")
    ap.add_argument("--bundle", default=str(BUNDLE), help="the bundle's folder (default .gpu)")
    ap.add_argument("--sdist", help="--prepare: this llama-cpp-python sdist instead of pip's")
    ap.add_argument(
        "--work",
        default=str(Path(tempfile.gettempdir()) / "llmrun-gpu"),
        help="where the check builds and writes models",
    )
    ap.add_argument(
        "--fa",
        choices=("on", "off"),
        default="on",
        help="build with flash attention's CUDA kernels and run with -fa 1 (on)",
    )
    ap.add_argument("--shapes", default="135m,1b,8b")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=0, help="build jobs (default: every CPU)")
    ap.add_argument("--cuda-arch", help="e.g. 90: skip asking nvidia-smi")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    args = ap.parse_args(argv)
    if not args.prepare:
        return check(args)
    bundle = Path(args.bundle).resolve()
    try:
        given = Path(args.sdist) if args.sdist else None
        sources = Sources(
            version=importlib.metadata.version(PACKAGE),
            tokenizer_model=embedded_model(),
            sdist=(lambda _v, _d: given) if given else download_sdist,
            wheels=download_wheels,  # looked up now: tests replace it
        )
        ignore_bundle(ROOT, bundle)
        prepare(bundle, sources)
    except (OSError, ValueError, tarfile.TarError, subprocess.CalledProcessError) as e:
        print(f"gpu.py: {e}", file=sys.stderr)
        return 1
    print(bundle)
    return 0


if __name__ == "__main__":
    import script  # benchmarks/script.py: Ctrl-C is exit 130

    script.run(main)
