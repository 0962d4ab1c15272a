"""Files written so that a full disk, a crash or a signal never leaves half of one.

`atomic_write` writes a temporary file in the same folder, fsyncs it and renames it over the
target (POSIX rename is atomic within a file system): a reader sees the old file or the new one.
A symbolic link is written through, as a shell's `>` does: its target is replaced (with its
mode), the link stays; a device or FIFO is written in place, so a full one raises.
`append_line` appends one whole line with a single write(2) on an O_APPEND descriptor; if the
disk fills part-way, the partial bytes are cut off again, so the file stays whole lines.
`read_capped` reads a file up to the size its reader can use: `/dev/zero` or a 40 GB file
given by mistake ends in one error instead of exhausting memory; a FIFO (`<(command)`,
/dev/stdin) is read within the same cap as its data arrives, and no read keeps a signal
waiting. A small file of the system's (a sysfs counter) may be held to a regular file: a FIFO
or device put in its place is then an OSError at once, never a hang.
`output_file_problem` says, before a run, why a file an option names for the run's results
could not take them, so a bad name costs no run. No open for writing waits: a FIFO with no
reader is an error (ENXIO) at once, never a hang that ignores SIGTERM.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from .errors import BadRequestError, CancelledError

READ_CHUNK = 2**20  # bytes read between two looks at `cancel`
POLL_MS = 100  # a pipe without data is looked at again this often
WRITER_WAIT_S = 1.0  # a FIFO without a writer this long is said to wait for one


def _quiet(path: str, flag: str) -> None:
    pass


# Told once, with the FIFO's path and the option that named it, when a named FIFO has had no
# writer for WRITER_WAIT_S. runners/ writes nothing to a terminal: the CLI sets what it says
# (cli/app.py), and a library caller waits in silence.
on_writer_wait: Callable[[str, str], None] = _quiet


def atomic_write(path: Path, text: str) -> None:
    """Replace `path` with `text` (UTF-8) in one step; on failure the old file is untouched.

    A symbolic link is written through, as a shell's `>` does: the link stays, and its target
    gets the text (atomically, with the target's mode, when it is a regular file or missing;
    a device or FIFO, such as /dev/full, is written in place, and its errors are raised).
    Raises OSError (ENOSPC, EACCES...) with the temporary file removed.
    """
    data = text.encode("utf-8")
    target = Path(os.path.realpath(path)) if os.path.islink(path) else path
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        mode = None
    if mode is not None and not stat.S_ISREG(mode):
        _write_in_place(target, data)
        return
    folder = target.parent if str(target.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=folder)
    try:
        try:
            _write_all(fd, data)
            os.fsync(fd)
            if mode is not None:  # keep the old file's permissions
                os.fchmod(fd, stat.S_IMODE(mode))
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # the rename itself reaches the disk
        dir_fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written <= 0:  # nothing taken and no error: the device is full
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        view = view[written:]


def _write_in_place(path: Path, data: bytes) -> None:
    """A device or FIFO gets the bytes as they are; a failed write (a full device) raises.
    The open does not wait for a FIFO's reader (ENXIO without one); the writes then do."""
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC | os.O_NONBLOCK)
    try:
        os.set_blocking(fd, True)  # a reader is there: let it take the bytes at its pace
        _write_all(fd, data)
        with contextlib.suppress(OSError):  # a terminal or FIFO has nothing to sync (EINVAL)
            os.fsync(fd)
    finally:
        os.close(fd)


def append_line(path: Path, line: str) -> None:
    """Append `line` plus a newline as one write to a regular file; a failed write leaves no
    partial line. Anything else (a FIFO, a device) is an OSError, and the open never waits."""
    data = (line.rstrip("\n") + "\n").encode("utf-8")
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, NOT_REGULAR, str(path))
        start = os.fstat(fd).st_size
        try:
            written = os.write(fd, data)
            if written != len(data):  # a short write: the disk filled in the middle
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        except OSError:
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.fstat(fd).st_mode):
                    os.ftruncate(fd, start)
            raise
    finally:
        os.close(fd)


NOT_REGULAR = "not a regular file (a FIFO, a device or a socket)"
KERNEL_FOLDERS = ("/proc", "/sys")  # regular files by their mode, but the kernel's


class Unwritable(NamedTuple):
    """Why a path cannot take a run's results, in a few words; `no_file` when it names no file
    to write (a folder, a FIFO, a device), so that an example file name helps."""

    text: str
    no_file: bool = False


NO_FILE = Unwritable(NOT_REGULAR, no_file=True)


def output_file_problem(path: Path) -> Unwritable | None:
    """Why `path` cannot take a run's results (None: it can), checked before the run: a
    folder, a missing or unwritable folder, a FIFO, device or socket, a file of the kernel's
    (/proc, /sys: root may open them, and the write fails or changes a setting).
    A file that was not there is not left behind. Any OSError of the checks themselves (a
    name over 255 bytes: ENAMETOOLONG from is_dir) is a reason too, not an error of its own
    that named no option and quoted the whole path."""
    try:
        return _output_file_problem(path)
    except OSError as e:
        return Unwritable(f"cannot write it: {e.strerror or e}")


def _output_file_problem(path: Path) -> Unwritable | None:
    if path.is_dir():
        return Unwritable("a folder", no_file=True)
    folder = path.parent if str(path.parent) else Path(".")
    if not folder.is_dir():
        return Unwritable(f"there is no folder {folder}")
    real = os.path.realpath(path)
    if any(real == top or real.startswith(top + "/") for top in KERNEL_FOLDERS):
        return Unwritable(f"cannot write it: {real} is the kernel's, not a file to write")
    try:
        mode: int | None = os.stat(real).st_mode  # a link's target: the file written
    except FileNotFoundError:
        mode = None
    except OSError as e:
        return Unwritable(f"cannot write it: {e.strerror or e}")
    if mode is not None and not stat.S_ISREG(mode):
        return NO_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
    except OSError as e:
        return Unwritable(f"cannot write it: {e.strerror or e}")
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # made a FIFO since the stat
            return NO_FILE
    finally:
        os.close(fd)
        if mode is None:  # the target made by the trial, never a link to it
            with contextlib.suppress(OSError):
                os.unlink(real)
    return None


class FileTooLargeError(ValueError):
    """A file over the size its reader accepts (or one that never ends)."""

    def __init__(self, what: str, max_bytes: int) -> None:
        limit = f"{max_bytes // 2**20} MiB" if max_bytes >= 2**20 else f"{max_bytes} bytes"
        super().__init__(f"the {what} is larger than {limit}, or does not end")


def read_capped(
    path: Path | str,
    *,
    max_bytes: int,
    what: str = "file",
    regular: bool = False,
    cancel: threading.Event | None = None,
    flag: str | None = None,
) -> bytes:
    """The bytes of a file of at most `max_bytes`, read without ever blocking: opened with
    O_NONBLOCK, a FIFO or pipe (`<(zcat …)`, /dev/stdin) read by a poll that times out as its
    data arrives, in chunks that each end with a look at `cancel` (CancelledError once it is
    set), so a signal ends the wait for a writer that never comes or never finishes; a named
    FIFO with no writer for WRITER_WAIT_S is told, once, to `on_writer_wait` with the option
    `flag` that named it (a pipe with an idle writer, `<(sleep 9)`, is not). `regular`
    (a sysfs counter): anything else (a FIFO, a device) is an OSError naming it, NOT_REGULAR.
    Raises OSError for what cannot be opened or read (a folder: IsADirectoryError) and
    FileTooLargeError past `max_bytes` (/dev/zero never ends)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
    data = bytearray()
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if regular and not stat.S_ISREG(mode):
            raise OSError(errno.EINVAL, NOT_REGULAR, str(path))
        poller = select.poll()  # a regular file is always ready
        poller.register(fd, select.POLLIN)
        since = time.monotonic()
        while len(data) <= max_bytes:
            if cancel is not None and cancel.is_set():
                raise CancelledError(f"reading {path} was interrupted")
            ready = poller.poll(POLL_MS)
            try:
                chunk = os.read(fd, min(READ_CHUNK, max_bytes + 1 - len(data)))
            except BlockingIOError:  # a writer (or a terminal) with nothing yet
                continue
            if chunk:
                data += chunk
            elif ready:  # the end; a pipe's is POLLHUP, once its writers are gone
                break
            elif flag and time.monotonic() - since > WRITER_WAIT_S:
                # a named FIFO that no writer has opened: no POLLHUP, and read() says 0 (an
                # idle writer's says EAGAIN)
                on_writer_wait(str(path), flag)
                flag = None
    finally:
        os.close(fd)
    if len(data) > max_bytes:
        raise FileTooLargeError(what, max_bytes)
    return bytes(data)


def read_option_file(
    path: Path, flag: str, max_bytes: int, what: str, cancel: threading.Event | None = None
) -> bytes:
    """The bytes of a file an option names, within its cap, or one line naming the option and
    what the file is (`-f/--file: cannot read prompt file X: No such file or directory`)."""
    try:
        return read_capped(path, max_bytes=max_bytes, what=what, cancel=cancel, flag=flag)
    except OSError as e:
        raise BadRequestError(f"{flag}: cannot read {what} {path}: {e.strerror or e}") from None
    except FileTooLargeError as e:
        raise BadRequestError(f"{flag} {path}: {e}") from None
