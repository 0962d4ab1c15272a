"""Seeded fuzzing of GGUF headers: every damaged model must end in exit 0 or 1, one short error.

One parent process imports llmrun and llama_cpp once, then forks a child per case. The parent
must never have run llama.cpp (OpenMP's worker threads do not survive a fork: a child would
hang), so run it as its own process, as `tests/test_trust.py` does. The cases mutate one
copy of the real model in place and put the original bytes back afterwards, so a case costs a
model load, not a 96 MB copy. Two kinds of cases:

- field: a scalar metadata value (block_count, head counts, lengths, token ids, file type, ...)
  rewritten to a boundary value (0, 1, -1, the type's maximum, a random value);
- flip: a few random bytes of the header (metadata and tensor infos) changed.

`python -m tests.fuzz_gguf --cases 2000` (make fuzz) runs a longer campaign.
"""

from __future__ import annotations

import argparse
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


def scan(path: Path) -> tuple[list[Field], int]:
    """The scalar metadata fields with their file offsets, and where the header ends."""
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
    for _ in range(n_tensors):
        string()
        (n_dims,) = struct.unpack_from("<I", data, pos)
        pos += 4 + 8 * n_dims + 4 + 8
    return fields, pos


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


def make_cases(
    fields: list[Field], header_end: int, n: int, seed: int
) -> list[tuple[str, list[tuple[int, bytes]]]]:
    """(description, [(offset, new bytes), ...]) for n cases: about half fields, half flips."""
    rng = random.Random(seed)
    cases = []
    interesting = [f for f in fields if not f.key.endswith("[]")]
    for i in range(n):
        if i % 2 == 0 and interesting:
            f = rng.choice(interesting)
            new = rng.choice(boundary_values(f.fmt, rng))
            cases.append((f"field {f.key}={new.hex()}", [(f.offset, new)]))
        else:
            edits = []
            for _ in range(rng.randint(1, 4)):
                offset = rng.randrange(4, header_end)
                edits.append((offset, bytes([rng.randrange(256)])))
            cases.append(("flip " + ",".join(f"{o}:{b.hex()}" for o, b in edits), edits))
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


def campaign(model: Path, n: int, seed: int, workdir: Path) -> list[Outcome]:
    copy = workdir / "model.gguf"
    shutil.copyfile(model, copy)
    fields, header_end = scan(copy)
    # Load everything the child needs once, here (fork shares it); no computation in the parent.
    import llmrun.cli.app  # main() imports it; it must be imported before any fork
    import llmrun.cli.main
    import llmrun.cli.run  # noqa: F401  # the app imports a command's module when it runs
    from llmrun.runners.library import llama_lib

    llama_lib()
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
        "--no-dashboard",
        "--stats",
        "json",
        "Hello",
    ]
    outcomes = []
    for desc, edits in make_cases(fields, header_end, n, seed):
        code, out, err = run_case(copy, edits, argv, workdir)
        outcomes.append(Outcome(desc, code, out, err))
    return outcomes


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
        outcomes = campaign(Path(default_model_path()), args.cases, args.seed, Path(tmp))
    bad = [(o, why) for o in outcomes if (why := judge(o))]
    codes: dict[int, int] = {}
    for o in outcomes:
        codes[o.status] = codes.get(o.status, 0) + 1
    for o, why in bad:
        print(f"FAIL {o.case}: {why}")
    print(f"{len(outcomes)} cases, exit codes {dict(sorted(codes.items()))}, {len(bad)} failed")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
