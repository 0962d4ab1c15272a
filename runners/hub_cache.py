"""The Hugging Face Hub cache on disk, read without huggingface_hub.

`llmrun models` and an offline `-hf` look only at what is already downloaded. Importing
huggingface_hub for that costs about 0.3 s of start-up (its errors module pulls in httpx), so
this module reads the cache's documented layout itself, as `huggingface_hub.scan_cache_dir`
does (https://huggingface.co/docs/huggingface_hub/guides/manage-cache):

    <cache>/models--<owner>--<name>/
        blobs/<hash>                 the files' contents
        refs/<branch>                the commit a branch points at
        snapshots/<commit>/<path>    links into blobs/

The cache is found as huggingface_hub finds it: HF_HUB_CACHE, else the legacy
HUGGINGFACE_HUB_CACHE, else HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else
~/.cache/huggingface/hub. A link whose blob is missing (an interrupted download) is left out.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

_PREFIX = "models--"


def cache_dir() -> str:
    """Where huggingface_hub keeps its downloads, by the same environment variables."""
    home = os.getenv(
        "HF_HOME", os.path.join(os.getenv("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    )
    hub = os.getenv("HF_HUB_CACHE", os.getenv("HUGGINGFACE_HUB_CACHE", os.path.join(home, "hub")))
    return os.path.expandvars(os.path.expanduser(hub))


@dataclass(frozen=True)
class Snapshot:
    """One downloaded revision of a model repository."""

    repo_id: str
    commit: str
    path: str  # the snapshot folder
    refs: frozenset[str]  # the branches (or pr/N) that point at it
    last_modified: float  # the newest of its files' contents
    files: tuple[str, ...]  # paths relative to `path`, sorted, each with its contents present


def snapshots(root: str | None = None) -> Iterator[Snapshot]:
    """Every model snapshot in the cache, by repository (case-insensitive) and then newest
    first; nothing when there is no cache."""
    root = cache_dir() if root is None else root
    try:
        names = sorted(os.listdir(root), key=str.lower)
    except OSError:
        return
    for name in names:
        if name.startswith(_PREFIX) and os.path.isdir(os.path.join(root, name)):
            repo_id = name[len(_PREFIX) :].replace("--", "/")
            found = list(_repo_snapshots(repo_id, os.path.join(root, name)))
            yield from sorted(found, key=lambda s: s.last_modified, reverse=True)


def _repo_snapshots(repo_id: str, folder: str) -> Iterator[Snapshot]:
    refs = _refs(os.path.join(folder, "refs"))
    base = os.path.join(folder, "snapshots")
    try:
        commits = os.listdir(base)
    except OSError:
        return
    for commit in commits:
        path = os.path.join(base, commit)
        if not os.path.isdir(path):
            continue
        files, newest = _files(path)
        yield Snapshot(
            repo_id,
            commit,
            path,
            frozenset(ref for ref, target in refs.items() if target == commit),
            newest if files else _mtime(path),
            tuple(sorted(files)),
        )


def _refs(folder: str) -> dict[str, str]:
    """refs/<name> (and refs/pr/<n>) → the commit each names."""
    out: dict[str, str] = {}
    for dirpath, _, filenames in os.walk(folder):
        for filename in filenames:
            path = os.path.join(dirpath, filename)
            try:
                if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the open
                    continue
                with open(path, encoding="utf-8", errors="replace") as f:
                    commit = f.read(256).strip()
            except OSError:
                continue
            out[os.path.relpath(path, folder).replace(os.sep, "/")] = commit
    return out


def _files(snapshot: str) -> tuple[list[str], float]:
    """The snapshot's files whose contents are there, and the newest contents' mtime."""
    files: list[str] = []
    newest = 0.0
    for dirpath, _, filenames in os.walk(snapshot):
        for filename in filenames:
            path = os.path.join(dirpath, filename)
            try:
                st = os.stat(path)  # follows the link to its blob
            except OSError:
                continue
            files.append(os.path.relpath(path, snapshot).replace(os.sep, "/"))
            newest = max(newest, st.st_mtime)
    return files, newest


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def damaged_ref(repo_id: str, root: str | None = None) -> str | None:
    """Why the cached `refs/main` of a repository cannot be what huggingface_hub reads to find
    its snapshot (it reads the file whole and joins it into a path), or None when it is a
    commit hash or absent. A 2 GB file of garbage there hung the download's path handling."""
    root = cache_dir() if root is None else root
    path = os.path.join(root, _PREFIX + repo_id.replace("/", "--"), "refs", "main")
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the open
            return f"{path} is not a regular file"
        with open(path, "rb") as f:
            data = f.read(COMMIT_HEX + 2)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"{path} cannot be read ({e.strerror or e})"
    text = data.decode("ascii", "replace")
    if len(data) != COMMIT_HEX or not all(c in "0123456789abcdef" for c in text):
        return f"{path} is not a commit hash (remove it or the repository folder, and pull again)"
    return None


COMMIT_HEX = 40  # a git commit's hash in hex, as huggingface_hub writes refs/<branch>


def _snapshot(repo_id: str, root: str | None) -> Snapshot | None:
    """A repository's cached snapshot: the one `main` points at, else the newest."""
    found = [s for s in snapshots(root) if s.repo_id.lower() == repo_id.lower()]
    if not found:
        return None
    return max(found, key=lambda s: ("main" in s.refs, s.last_modified))


def repo_files(repo_id: str, root: str | None = None) -> list[str] | None:
    """The files of a repository's cached snapshot (`_snapshot`); None when nothing of it is
    cached."""
    best = _snapshot(repo_id, root)
    return None if best is None else list(best.files)


def cached_entry(repo_id: str, name: str, root: str | None = None) -> str | None:
    """The path of `name` in the repository's cached snapshot, whatever is there (a FIFO, a
    link to nowhere: what `llmrun models` lists, where huggingface_hub, which finds a
    snapshot through refs/main only, finds nothing); None when nothing is."""
    best = _snapshot(repo_id, root)
    if best is None:
        return None
    path = os.path.join(best.path, *name.split("/"))
    return path if os.path.lexists(path) else None
