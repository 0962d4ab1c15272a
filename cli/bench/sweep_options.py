"""`llmrun bench`'s options: one table of the sweep lists with their defaults (llama-bench's
`cmd_params_defaults`), and records of the options that take one value.

Each list option takes a comma list or a range (`8-512*4`) and may be repeated, as in
llama-bench. A list's name is the `Sweep` field it fills, or the test shape it makes; a
default of None leaves the choice to the engine (or llama-bench's defaults), as its help says.
"""

from __future__ import annotations

import functools
import inspect
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from llmrun.cli import options as co
from llmrun.cli.errors import usage_error
from llmrun.cli.options import RPC_FLAGS, RPC_HELP, AutoOnOff, Energy, check_rpc
from llmrun.cli.records import OptionRecord
from llmrun.runners.bench import localscore as ls
from llmrun.runners.bench import run
from llmrun.runners.config import LOAD_MODES
from llmrun.runners.limits import CACHE_TYPES

from . import flags as lb
from . import output as out

PANEL = "Tests (llama-bench's)"
SWEEP = "Sweep: each takes a comma list or a range such as 8-512*4"
LB = "llama-bench's other options"
_tests_option = functools.partial(typer.Option, rich_help_panel=PANEL)
_lb_option = functools.partial(typer.Option, rich_help_panel=LB)


@dataclass(frozen=True)
class ListOption:
    """One list option: the `Sweep` field it fills (or the test shape it makes), its flags,
    help, and the value a run uses when it is not given (said in the help)."""

    name: str
    flags: tuple[str, ...]
    help: str
    default: str | None = None
    panel: str = SWEEP
    metavar: str = "LIST"

    @property
    def shape(self) -> bool:
        """A test shape (-p, -n, -pg, -d), not a setting swept."""
        return self.panel == PANEL

    def parameter(self) -> inspect.Parameter:
        shown = self.help if self.default is None else f"{self.help} (default: {self.default})"
        option = typer.Option(
            *self.flags, help=shown, rich_help_panel=self.panel, metavar=self.metavar
        )
        return inspect.Parameter(
            self.name,
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=Annotated[list[str] | None, option],
        )


_lb = functools.partial(ListOption, panel=LB)  # one of llama-bench's other list options


LISTS = (
    ListOption(
        "n_prompt", ("-p", "--n-prompt"), "Prompt sizes of pp tests (0: none).", "512", PANEL
    ),
    ListOption(
        "n_gen", ("-n", "--n-gen"), "Generation lengths of tg tests (0: none).", "128", PANEL
    ),
    ListOption(
        "pg",
        ("-pg", "--pg"),
        "A pp+tg test PROMPT,GEN such as 512,128 (repeatable).",
        panel=PANEL,
        metavar="PP,TG",
    ),
    ListOption(
        "depth",
        ("-d", "--n-depth"),
        "Run each test after N tokens already in the KV cache.",
        "0",
        PANEL,
    ),
    ListOption(
        "threads",
        ("-t", "--threads"),
        "CPU threads. (default: physical cores, or performance cores of a hybrid CPU, as"
        " llama-bench)",
    ),
    ListOption(
        "batch",
        ("-b", "--batch", "--batch-size"),
        "Prefill chunk sizes (n_batch). (default: 2048, as llama-bench; --tuned: 512)",
    ),
    ListOption(
        "ubatch",
        ("-ub", "--ubatch", "--ubatch-size"),
        "Micro-batch sizes (n_ubatch). (default: 512)",
    ),
    ListOption(
        "gpu_layers",
        ("-ngl", "--gpu-layers", "--n-gpu-layers"),
        "GPU layers; -1, or more than the model has (99), is all. (default: -1, as llama-bench)",
    ),
    ListOption(
        "flash_attn",
        ("-fa", "--flash-attn"),
        "on, off, auto (or 1, 0, -1). (default: auto, as llama-bench)",
    ),
    ListOption(
        "cache_type_k",
        ("-ctk", "--cache-type-k"),
        f"KV cache K types: {', '.join(CACHE_TYPES)}.",
        "f16",
    ),
    ListOption(
        "cache_type_v",
        ("-ctv", "--cache-type-v"),
        "KV cache V types (quantized V needs flash attention).",
        "f16",
    ),
    ListOption(
        "repack",
        ("--repack",),
        "Weight repacking for faster CPU kernels, 0 or 1. (default: 1 where a probe found it"
        " safe on this CPU)",
    ),
    ListOption(
        "mmap",
        ("-mmp", "--mmap"),
        "Memory-map the model file, 0 or 1 (older llama-bench's -mmp; same as -lm none/mmap).",
    ),
    ListOption(
        "direct_io",
        ("-dio", "--direct-io"),
        "Read the model with direct I/O, 0 or 1 (older llama-bench's -dio; same as -lm dio).",
    ),
    ListOption(
        "load_mode",
        ("-lm", "--load-mode"),
        f"How weights load: {', '.join(LOAD_MODES)}. (default: auto)",
    ),
    ListOption(
        "no_kv_offload",
        ("-nkvo", "--no-kv-offload"),
        "Keep the KV cache in host memory, 0 or 1 (GPU builds).",
    ),
    ListOption(
        "ctx",
        ("-c", "--ctx"),
        "Context sizes: each runs every test, so the KV cache's memory shows against the"
        " context. (default: what the tests need)",
    ),
    ListOption(
        "draft",
        ("--draft",),
        "Prompt-lookup speculative decoding in the generation tests: at most N drafted tokens a"
        " step, a list such as 0,8 (0: off) to measure with and without in one run.",
    ),
    _lb(
        "split_mode",
        ("-sm", "--split-mode"),
        "Split across GPUs: none, layer, row, tensor. (default: layer)",
    ),
    _lb("main_gpu", ("-mg", "--main-gpu"), "The GPU for -sm none. (default: 0)"),
    _lb("tensor_split", ("-ts", "--tensor-split"), "Share of the model per GPU, such as 3/1."),
    _lb("devices", ("-dev", "--device"), "Devices to use, such as CUDA0/CUDA1. (default: auto)"),
    _lb(
        "n_cpu_moe",
        ("-ncmoe", "--n-cpu-moe"),
        "Keep the MoE experts of the first N layers on the CPU.",
    ),
    _lb(
        "tensor_overrides",
        ("-ot", "--override-tensor"),
        "Tensor name pattern=buffer type (llama.cpp's -ot).",
    ),
    _lb(
        "cpu_mask",
        ("-C", "--cpu-mask"),
        "The compute threads' CPUs, a hex mask such as 0x3 for CPUs 0-1. (default: 0x0, no mask)",
    ),
    _lb(
        "cpu_strict", ("--cpu-strict",), "1: one CPU of the mask per thread, in turn. (default: 0)"
    ),
    _lb(
        "poll",
        ("--poll",),
        "How long idle compute threads spin before they sleep, 0..100. (default: 50)",
    ),
    _lb(
        "embeddings",
        ("-embd", "--embeddings"),
        "1: the context also outputs every token's embedding, as an embedding model's does."
        " (default: 0)",
    ),
    _lb(
        "no_op_offload",
        ("-nopo", "--no-op-offload"),
        "1: operations on weights in host memory are not offloaded to a GPU. (default: 0)",
    ),
    _lb(
        "no_host",
        ("--no-host",),
        "1: load the weights without a host buffer, so extra buffer types may take them."
        " (default: 0)",
    ),
    _lb(
        "lazy_mode",
        ("-lzm", "--lazy-mode"),
        "Read the tensors a model marks on demand: on, auto (those over 4 GiB) or off."
        " (default: auto)",
    ),
    _lb(
        "fit_target",
        ("-fitt", "--fit-target"),
        "MiB to leave free per device when fitting: recorded as given, not applied (llmrun fits"
        " -ngl -1 to free memory itself).",
    ),
    _lb(
        "fit_ctx",
        ("-fitc", "--fit-ctx"),
        "The least context fitting may choose: recorded as given, not applied.",
    ),
)


# llama-bench's -rpc: a list of servers, for every test at once (run's --rpc, declared there)
RPC = ListOption("rpc", RPC_FLAGS, RPC_HELP, panel=LB, metavar="HOST:PORT,...")


def _misspelt_name(real: str) -> str:
    return f"misspelt_{real[2:].replace('-', '_')}"


def _misspelt(name: str, real: str, flag: bool) -> inspect.Parameter:
    """A single-dash spelling of one of bench's long options, such as -cpu-mask: llama-bench
    refuses it, and Click would read it as -c with `pu-mask`; it is refused by name."""
    option = typer.Option(name, hidden=True)
    annotation = Annotated[bool, option] if flag else Annotated[list[str] | None, option]
    return inspect.Parameter(
        _misspelt_name(real),
        inspect.Parameter.KEYWORD_ONLY,
        default=False if flag else None,
        annotation=annotation,
    )


class SweepLists(OptionRecord):
    """The list options as given (each repetition of an option joined by commas), and
    llama-bench's -rpc."""

    def __init__(self, rpc: list[str] | None = None, **given: list[str] | None) -> None:
        self.given = given
        self.rpc = ",".join(rpc) if rpc else None

    def __repr__(self) -> str:
        return f"SweepLists({self.given!r})"

    @classmethod
    def parameters(cls) -> list[inspect.Parameter]:
        return [
            *(option.parameter() for option in LISTS),
            RPC.parameter(),
            *(_misspelt(f"-{real[2:]}", real, flag) for real, flag in misspellable().items()),
        ]

    @classmethod
    def build(cls, given: dict[str, Any]) -> SweepLists:
        for real in misspellable():
            if given.pop(_misspelt_name(real)):
                usage_error(f"-{real[2:]}: no such option; llama-bench's spelling is {real}")
        try:
            rpc = check_rpc(given.pop(RPC.name))
        except typer.BadParameter as e:
            usage_error(f"-rpc/--rpc: {e}")
        return cls([rpc] if rpc else None, **{o.name: given.pop(o.name) for o in LISTS})

    def text(self, name: str) -> str | None:
        """A list as one comma list, or its default when not given."""
        values = self.given[name]
        return ",".join(values) if values else DEFAULTS[name]

    def sweep(self, *, scenarios: bool, scenario_scale: float, **fields: Any) -> run.Sweep:
        """The run's record: the test shapes, every swept setting, and `fields` (the options
        that take one value)."""
        shapes = run.parse_shapes(
            str(self.text("n_prompt")),
            str(self.text("n_gen")),
            self.given["pg"] or [],
            str(self.text("depth")),
            scenarios,
            scenario_scale,
        )
        swept: dict[str, Any] = {o.name: self.text(o.name) for o in LISTS if not o.shape}
        rpc = tuple(self.rpc.split(",")) if self.rpc else ()
        return run.Sweep(shapes=shapes, scenarios=scenarios, rpc=rpc, **swept, **fields)

    def refuse_unusable(self) -> None:
        """The placement options this engine cannot apply, refused before any model loads."""
        if self.rpc is not None:
            lb.attach_rpc(self.rpc)
        lb.refuse_unusable(
            {
                "-sm/--split-mode": self.text("split_mode"),
                "-mg/--main-gpu": self.text("main_gpu"),
                "-ts/--tensor-split": self.text("tensor_split"),
                "-dev/--device": self.text("devices"),
            }
        )


DEFAULTS = {o.name: o.default for o in LISTS}


@dataclass(frozen=True, kw_only=True)
class Measured(OptionRecord):
    """What is measured besides the swept settings."""

    reps: Annotated[
        int,
        _tests_option(
            "-r",
            "--repetitions",
            min=0,
            help="Timed repetitions per test, after one warm-up (0: the warm-up"
            " only, rows of 0 t/s as llama-bench's, kept out of the history).",
        ),
    ] = 5
    until_ci: Annotated[
        str | None,
        _tests_option(
            "--until-ci",
            metavar="PCT[,SECONDS]",
            help="Repeat each test past -r until its mean rate's 95 % interval is within"
            " ±PCT % (e.g. 2%), or until it has taken SECONDS (default 300).",
        ),
    ] = None
    scenarios: Annotated[
        bool,
        _tests_option(
            "--scenarios", help="LocalScore's prompt/output matrix, scaled, with its overall score."
        ),
    ] = False
    scenario_scale: Annotated[
        float,
        _tests_option(
            "--scenario-scale",
            min=0.001,
            max=1.0,
            help="Token counts of --scenarios relative to LocalScore's (1 = as LocalScore).",
        ),
    ] = ls.DEFAULT_SCENARIO_SCALE
    cold: Annotated[
        bool,
        typer.Option(
            "--cold",
            help="Drop the model file from the page cache before each"
            " load (posix_fadvise, no root needed), so load time is measured"
            " from disk; every row records how much of the file was cached.",
        ),
    ] = False
    ppl: Annotated[
        Path | None,
        typer.Option(
            "--ppl",
            metavar="FILE",
            help="Also measure each model's perplexity on this text"
            " (llama-perplexity's method; windows of -c tokens, default"
            " 512), e.g. examples/declaration_of_independence.txt.",
        ),
    ] = None
    kld: Annotated[
        bool,
        typer.Option(
            "--kld",
            help="With --ppl and several -m: also score each later model's next-token"
            " distributions against the first's by KL divergence, top-token agreement and"
            " Δp (llama-perplexity --kl-divergence's figures; the first model's log-probs"
            " go through a temporary file, 2 bytes per vocabulary entry and scored token).",
        ),
    ] = False
    tuned: Annotated[
        bool,
        typer.Option(
            "--tuned/--no-tuned",
            help="Measure llmrun's own settings in place of"
            " llama-bench's defaults: those `llmrun tune` saved for the model,"
            " else llmrun's (-b 512, the prefill chunk that shows in TTFT).",
        ),
    ] = False
    energy: Energy = AutoOnOff.auto


@dataclass(frozen=True, kw_only=True)
class Controls(OptionRecord):
    """How the run goes and what it shows besides the results: llama-bench's other options."""

    numa: Annotated[
        str | None,
        _lb_option(
            "--numa",
            metavar="distribute|isolate|numactl",
            help="NUMA placement, as llama.cpp's. (default: disabled)",
        ),
    ] = None
    prio: Annotated[
        int,
        _lb_option(
            "--prio",
            min=-1,
            max=3,
            help="Process and compute-thread priority: -1 low, 0 normal, 1"
            " medium, 2 high, 3 realtime (raising it may need privileges).",
        ),
    ] = 0
    delay: Annotated[
        float,
        _lb_option(
            "--delay",
            min=0.0,
            max=3600.0,
            help="Seconds to wait between tests (lets a hot machine cool).",
        ),
    ] = 0.0
    no_warmup: Annotated[
        bool,
        _lb_option("--no-warmup", help="Skip the untimed warm-up run before each test."),
    ] = False
    progress_lines: Annotated[
        bool,
        _lb_option(
            "--progress", help="One line per test on stderr (a terminal shows a bar anyway)."
        ),
    ] = False
    verbose: Annotated[
        bool,
        _lb_option("-v", "--verbose", help="Show llama.cpp's own log on stderr."),
    ] = False
    output_err: Annotated[
        out.OutputFormat | None,
        _lb_option("-oe", "--output-err", help="Also print the results on stderr in this format."),
    ] = None


@dataclass(frozen=True, kw_only=True)
class Hub(OptionRecord):
    """llama-bench's Hugging Face options: models named by repository."""

    hf_repo: Annotated[
        list[str] | None,
        _lb_option(
            "-hf",
            "-hfr",
            "--hf-repo",
            help="A Hub model, owner/repo[:QUANT] (the same as -m).",
            metavar="REPO",
        ),
    ] = None
    hf_file: Annotated[
        str | None,
        _lb_option("-hff", "--hf-file", help="The file in --hf-repo (owner/repo/FILE.gguf)."),
    ] = None
    hf_token: Annotated[
        str | None,
        _lb_option("-hft", "--hf-token", help="Hub token (default: HF_TOKEN; never printed)."),
    ] = None
    offline: Annotated[
        bool,
        _lb_option("--offline", help="Use the Hub cache only (HF_HUB_OFFLINE)."),
    ] = False

    def models(self, models: list[str] | None) -> list[str | None]:
        """Every model to measure, in order; the embedded one when none is named."""
        chosen = lb.hub_models(models, self.hf_repo, self.hf_file, self.hf_token, self.offline)
        return list(chosen) if chosen else [None]


@dataclass(frozen=True, kw_only=True)
class Delivery(OptionRecord):
    """Where the results go: stdout's format, a chart file, the history, a comparison."""

    output: Annotated[
        out.OutputFormat | None,
        typer.Option(
            "-o",
            "--output",
            help="Print the results on stdout as md, csv,"
            " json, jsonl or sql (llama-bench's table)."
            " (default: a table on a terminal, else md)",
        ),
    ] = None
    plot: Annotated[
        str | None,
        typer.Option("--plot", metavar="FILE.png", help="Also draw the charts into a PNG file."),
    ] = None
    compare: Annotated[
        bool,
        typer.Option(
            "--compare", help="Show the change against the last run of the same model and settings."
        ),
    ] = False
    no_history: Annotated[
        bool, typer.Option("--no-history", help="Do not store this run in the history.")
    ] = False


def _print_version(given: bool) -> None:
    """llama-bench's --version: the versions (llama.cpp's build with them), then exit."""
    if given:
        from llmrun.cli.version import version_line

        print(version_line())
        raise typer.Exit(0)


Models = Annotated[
    list[str] | None,
    _tests_option(
        "-m",
        "--model",
        envvar="LLMRUN_MODEL",
        help="A .gguf path or Hub reference; repeat for several models, compared side by side."
        " (default: the embedded SmolLM2-135M)",
    ),
]
Version = Annotated[
    bool,
    _lb_option(
        "--version", is_eager=True, callback=_print_version, help="Print the version and exit."
    ),
]
ListDevices = Annotated[
    bool,
    _lb_option("--list-devices", help="List the devices this llama.cpp can use, and exit."),
]


def _names(annotation: Any) -> list[str]:
    """An option's spellings, from its `Annotated[T, typer.Option(...)]` (typer takes a
    string default there as the first spelling)."""
    info = annotation.__metadata__[0]
    first = [info.default] if isinstance(info.default, str) else []
    return [n for decl in (*first, *info.param_decls) for n in decl.split("/")]


@functools.cache
def misspellable() -> dict[str, bool]:
    """Each long option of bench whose one-dash spelling is no option of its own (--cpu-mask's
    -cpu-mask; not --pg, as -pg is llama-bench's), and whether it is a flag (its misspelling
    then takes no value)."""
    records = (Measured, Controls, Hub, Delivery)
    annotations = [p.annotation for r in records for p in r.parameters()]
    annotations += [o.parameter().annotation for o in (*LISTS, RPC)]
    annotations += [Models, Version, ListDevices, co.PromptSeed]
    taken = {n for a in annotations for n in _names(a)}
    return {
        n: typing.get_args(a)[0] is bool
        for a in annotations
        for n in _names(a)
        if n.startswith("--") and f"-{n[2:]}" not in taken
    }
