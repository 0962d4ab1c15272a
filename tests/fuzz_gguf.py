"""Seeded fuzzing of GGUF headers: every damaged model must end in exit 0 or 1, one short error.

One parent process imports llmrun and llama_cpp once, then forks a child per case. The parent
must never have run llama.cpp (OpenMP's worker threads do not survive a fork: a child would
hang), so run it as its own process, as `tests/test_trust.py` does. The cases mutate one
copy of the real model in place and put the original bytes back afterwards, so a case costs a
model load, not a 96 MB copy. Two kinds of cases:

- field: a scalar metadata value (block_count, head counts, lengths, token ids, file type, ...)
  rewritten to a boundary value (0, 1, -1, the type's maximum, a random value);
- flip: a few random bytes of the header changed, in turn in the metadata and in the tensor
  infos (a flip anywhere in the header would land in the tensor infos 1 time in 100).

A campaign begins with the cases that cover every kind once (COVERING): each scalar field, each
boundary value of each type, flips in both parts of the header; the cases after them are
random. The test suite runs those 48 cases (tests/test_trust.py); `python -m tests.fuzz_gguf
--cases 2000` (make fuzz) runs a longer campaign. The summary names any kind left uncovered.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import shutil
import signal
import struct
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from llmrun.runners.gguf import SCALAR_FORMATS

CASE_TIMEOUT_S = 60.0
HUNG = 999  # the status of a case whose child had to be killed


@dataclass(frozen=True)
class Field:
    key: str
    fmt: str
    offset: int


@dataclass(frozen=True)
class Outcome:
    case: str
    status: int  # exit code, or -signal
    stdout: bytes
    stderr: bytes


@dataclass(frozen=True)
class Header:
    fields: list[Field]  # the scalar metadata values, with their offsets
    metadata_end: int  # where the tensor infos begin
    end: int  # where the header ends


def scan(path: Path) -> Header:
    """The scalar metadata fields with their file offsets, and where the header's parts end."""
    data = path.read_bytes()[: 16 << 20]
    pos = 4
    _version, n_tensors, n_kv = struct.unpack_from("<IQQ", data, pos)
    pos += 20
    fields: list[Field] = []

    def string() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8 + n
        return data[pos - n : pos].decode("utf-8", "replace")

    def value(vtype: int, key: str) -> None:
        nonlocal pos
        if vtype in SCALAR_FORMATS:
            fields.append(Field(key, SCALAR_FORMATS[vtype], pos))
            pos += struct.calcsize(SCALAR_FORMATS[vtype])
        elif vtype == 8:
            string()
        elif vtype == 9:
            itype, n = struct.unpack_from("<IQ", data, pos)
            pos += 12
            if itype in SCALAR_FORMATS:
                pos += n * struct.calcsize(SCALAR_FORMATS[itype])
            else:
                for _ in range(n):
                    value(itype, key + "[]")

    for _ in range(n_kv):
        key = string()
        (vtype,) = struct.unpack_from("<I", data, pos)
        pos += 4
        value(vtype, key)
    metadata_end = pos
    for _ in range(n_tensors):
        string()
        (n_dims,) = struct.unpack_from("<I", data, pos)
        pos += 4 + 8 * n_dims + 4 + 8
    return Header(fields, metadata_end, pos)


def boundary_values(fmt: str, rng: random.Random) -> list[bytes]:
    if fmt in ("<f", "<d"):
        values: list[float] = [0.0, -1.0, 1e30, float("nan"), float("inf"), rng.uniform(-1e6, 1e6)]
        return [struct.pack(fmt, v) for v in values]
    if fmt == "<?":
        return [b"\x00", b"\x01", b"\x02", b"\xff"]
    size = struct.calcsize(fmt)
    top = (1 << (8 * size)) - 1
    raw = [0, 1, 2, 513, top, top // 2, top // 2 + 1, rng.randrange(top + 1)]
    return [v.to_bytes(size, "little") for v in raw]


# A case: (description, [(offset, new bytes), ...], its kind). The kinds: ("field", key),
# ("value", format, index into boundary_values) and ("flip", part of the header).
Case = tuple[str, list[tuple[int, bytes]], tuple[tuple[str, ...], ...]]
PARTS = ("metadata", "tensor-infos")
COVERING = 48  # the cases that cover every kind of the embedded model's header (24 fields)


def field_case(f: Field, index: int, rng: random.Random) -> Case:
    new = boundary_values(f.fmt, rng)[index]
    return (
        f"field {f.key}={new.hex()}",
        [(f.offset, new)],
        (("field", f.key), ("value", f.fmt, str(index))),
    )


def flip_case(header: Header, part: int, rng: random.Random) -> Case:
    low, high = ((4, header.metadata_end), (header.metadata_end, header.end))[part]
    edits = []
    for _ in range(rng.randint(1, 4)):
        edits.append((rng.randrange(low, high), bytes([rng.randrange(256)])))
    desc = f"flip {PARTS[part]} " + ",".join(f"{o}:{b.hex()}" for o, b in edits)
    return desc, edits, (("flip", PARTS[part]),)


def every_kind(header: Header) -> set[tuple[str, ...]]:
    fields = [f for f in header.fields if not f.key.endswith("[]")]
    rng = random.Random(0)
    return (
        {("field", f.key) for f in fields}
        | {
            ("value", f.fmt, str(i))
            for f in fields
            for i in range(len(boundary_values(f.fmt, rng)))
        }
        | {("flip", part) for part in PARTS}
    )


def make_cases(header: Header, n: int, seed: int) -> list[Case]:
    """n cases, half fields, half flips. The field cases begin with every field once, then
    fields of the types whose boundary values are not all written yet, each with the next
    boundary value of its type; after them a random field and value each."""
    rng = random.Random(seed)
    interesting = [f for f in header.fields if not f.key.endswith("[]")]
    order = rng.sample(interesting, len(interesting))
    sizes = {f.fmt: len(boundary_values(f.fmt, rng)) for f in interesting}
    written = dict.fromkeys(sizes, 0)
    for f in order:
        written[f.fmt] += 1
    for fmt, size in sizes.items():  # more fields of this type, until every value is written
        same = [f for f in order if f.fmt == fmt]
        order += [same[k % len(same)] for k in range(max(0, size - written[fmt]))]
    counters = dict.fromkeys(sizes, 0)
    cases: list[Case] = []
    for i in range(n):
        if i % 2 == 0 and interesting:
            if i // 2 < len(order):
                f = order[i // 2]
                index, counters[f.fmt] = counters[f.fmt] % sizes[f.fmt], counters[f.fmt] + 1
            else:
                f = rng.choice(interesting)
                index = rng.randrange(sizes[f.fmt])
            cases.append(field_case(f, index, rng))
        else:
            cases.append(flip_case(header, (i // 2) % 2, rng))
    return cases


def run_case(
    path: Path, edits: list[tuple[int, bytes]], argv: list[str], workdir: Path
) -> tuple[int, bytes, bytes]:
    """Apply the edits, run llmrun in a forked child, restore the bytes."""
    with open(path, "r+b") as f:
        originals = []
        for offset, new in edits:
            f.seek(offset)
            originals.append((offset, f.read(len(new))))
            f.seek(offset)
            f.write(new)
    out_path, err_path = workdir / "out", workdir / "err"
    try:
        pid = os.fork()
        if pid == 0:  # the child: run the CLI as a user would, with its output in files
            try:
                out_fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                err_fd = os.open(err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                null = os.open(os.devnull, os.O_RDONLY)
                os.dup2(null, 0)
                os.dup2(out_fd, 1)
                os.dup2(err_fd, 2)
                sys.argv = ["llmrun", *argv]
                from llmrun.cli.main import main

                try:
                    main()
                    code = 0
                except SystemExit as e:
                    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
                sys.stdout.flush()
                sys.stderr.flush()
            except BaseException:
                import traceback

                traceback.print_exc()  # judged a failure, with the reason in stderr
                code = 99
            os._exit(code)
        deadline = time.monotonic() + CASE_TIMEOUT_S
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:  # a hang is a failure too
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                code = HUNG
                break
            time.sleep(0.005)
    finally:
        with open(path, "r+b") as f:
            for offset, old in reversed(originals):
                f.seek(offset)
                f.write(old)
    return code, out_path.read_bytes(), err_path.read_bytes()


def warm_up_parsing(workdir: Path) -> None:
    """Parse a `run` command line once here, so that the forked children share what parsing
    imports and builds (typer's validators: about 0.2 s a child on 2 slow cores). The model is
    missing, so the command stops at its check, before llama.cpp computes anything."""
    from llmrun.cli.main import main

    sys.argv = ["llmrun", "run", "-m", str(workdir / "missing.gguf"), "-n", "2", "Hello"]
    with (
        open(os.devnull, "w") as null,
        contextlib.redirect_stderr(null),
        contextlib.suppress(SystemExit),
    ):
        main()


def campaign(model: Path, n: int, seed: int, workdir: Path) -> tuple[list[Outcome], list[str]]:
    """The outcomes, and the kinds of case that the n cases left uncovered."""
    copy = workdir / "model.gguf"
    shutil.copyfile(model, copy)
    header = scan(copy)
    # Load everything the child needs once, here (fork shares it); no computation in the parent.
    import llmrun.cli.app  # main() imports it; it must be imported before any fork
    import llmrun.cli.main
    import llmrun.cli.run  # noqa: F401  # the app imports a command's module when it runs
    from llmrun.runners.library import llama_lib

    llama_lib()
    warm_up_parsing(workdir)
    argv = [
        "run",
        "-m",
        str(copy),
        "--raw",
        "-n",
        "2",
        "--temp",
        "0",
        "-c",
        "256",
        "-t",
        "1",  # two threads cost twice the CPU for two tokens, and far more on a busy machine
        "--no-dashboard",
        "--stats",
        "json",
        "Hello",
    ]
    outcomes = []
    left = every_kind(header)
    for desc, edits, kinds in make_cases(header, n, seed):
        code, out, err = run_case(copy, edits, argv, workdir)
        outcomes.append(Outcome(desc, code, out, err))
        left -= set(kinds)
    return outcomes, sorted(" ".join(kind) for kind in left)


def judge(o: Outcome) -> str | None:
    """None when the outcome is acceptable, else what is wrong with it."""
    err_lines = o.stderr.decode("utf-8", "replace").strip().splitlines()
    if o.status not in (0, 1):
        return f"exit {o.status}"
    if o.status == 1 and (len(err_lines) > 3 or not err_lines[-1:][0].startswith("llmrun: error:")):
        return f"stderr not one clear line: {err_lines[:4]}"
    if o.status == 1 and b"internal error" in o.stderr:
        return f"internal error: {err_lines[-1]}"
    if o.status == 0 and len(err_lines) != 1:  # --stats json: exactly the stats object
        return f"stderr on success: {err_lines[:3]}"
    if len(o.stdout) > 200:  # at most two tokens of text
        return f"stdout holds more than text: {o.stdout[:80]!r}"
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    from llmrun.runners.models import default_model_path

    with tempfile.TemporaryDirectory() as tmp:
        outcomes, uncovered = campaign(Path(default_model_path()), args.cases, args.seed, Path(tmp))
    bad = [(o, why) for o in outcomes if (why := judge(o))]
    codes: dict[int, int] = {}
    for o in outcomes:
        codes[o.status] = codes.get(o.status, 0) + 1
    for o, why in bad:
        print(f"FAIL {o.case}: {why}")
    print("covered every kind of case" if not uncovered else f"not covered: {', '.join(uncovered)}")
    print(f"{len(outcomes)} cases, exit codes {dict(sorted(codes.items()))}, {len(bad)} failed")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
