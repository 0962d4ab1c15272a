"""Model resolution, and the Hub path against a populated local cache in offline mode."""

from __future__ import annotations

import os
import struct
import subprocess
import time
from pathlib import Path

import pytest

from llmrun.runners.errors import AmbiguousModelError, HubError
from llmrun.runners.models import HUB_RETRIES, choose_gguf, hub_words, is_hub_ref, quant_matches

from .conftest import which_llmrun
from .fake_hub import FakeHub, fake_hub, url

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def test_quant_tags_match_whole_names() -> None:
    assert quant_matches("SmolLM2-135M-Instruct.Q4_1.gguf", "q4_1")
    assert quant_matches("model-Q4_K_M.gguf", "Q4_K_M")
    assert not quant_matches("model-Q4_K_M.gguf", "Q4_K")
    assert not quant_matches("model-IQ4_XS.gguf", "Q4_XS")


def test_reference_kinds(tmp_path: Path) -> None:
    assert is_hub_ref("owner/repo")
    assert is_hub_ref("owner/repo:Q4_K_M")
    assert is_hub_ref("owner/repo/sub/file.gguf")
    assert not is_hub_ref("models/file.gguf")  # a missing local file, not a repo
    assert not is_hub_ref("./owner/repo")
    (tmp_path / "owner").mkdir()
    assert not is_hub_ref(str(tmp_path / "owner"))


def test_choose_gguf() -> None:
    files = [
        "README.md",
        "m-Q4_K_M.gguf",
        "m-Q8_0.gguf",
        "big-Q8_0-00001-of-00002.gguf",
        "big-Q8_0-00002-of-00002.gguf",
    ]
    assert choose_gguf("o/r", files, None) == ["m-Q4_K_M.gguf"]  # preferred when unnamed
    with pytest.raises(AmbiguousModelError) as e:
        choose_gguf("o/r", files, "Q8_0")
    assert e.value.candidates == ["o/r/big-Q8_0.gguf", "o/r/m-Q8_0.gguf"]
    assert choose_gguf("o/r", files[3:], "Q8_0") == files[3:]
    with pytest.raises(HubError, match=r"no Q2_K file; it has: .*m-Q4_K_M\.gguf"):
        choose_gguf("o/r", files, "Q2_K")


def add_repo(hub: Path, repo: str, files: dict[str, Path]) -> None:
    """Lay out a repo the way huggingface-hub caches it: blobs, a snapshot, refs/main."""
    folder = hub / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / COMMIT
    (folder / "blobs").mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(COMMIT)
    for i, (name, source) in enumerate(files.items()):
        blob = folder / "blobs" / f"{i:064x}"
        blob.symlink_to(source)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(blob)


@pytest.fixture
def hub_env(llmrun_env: dict[str, str], tmp_path: Path, model_path: str) -> dict[str, str]:
    hub = Path(llmrun_env["HF_HOME"]) / "hub"
    readme = tmp_path / "README.md"
    readme.write_text("# tiny\n")
    model = Path(model_path)
    add_repo(
        hub,
        "acme/tiny-GGUF",
        {"tiny-Q4_1.gguf": model, "tiny-Q8_0.gguf": model, "README.md": readme},
    )
    add_repo(hub, "acme/two-GGUF", {"a-Q4_K_M.gguf": model, "b/b-Q4_K_M.gguf": model})
    return llmrun_env


def llmrun(
    env: dict[str, str], *args: str, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [which_llmrun(), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
    )


def test_pull_of_a_damaged_cached_copy_is_no_success(
    llmrun_env: dict[str, str], tmp_path: Path, model_path: str
) -> None:
    """An empty or cut-short file in the cache was printed as pulled (exit 0), while `models`
    and `-m` called it no GGUF file."""
    cut, empty = tmp_path / "cut.gguf", tmp_path / "empty.gguf"
    cut.write_bytes(Path(model_path).read_bytes()[:100])
    empty.write_bytes(b"")
    hub = Path(llmrun_env["HF_HOME"]) / "hub"
    add_repo(hub, "acme/bad-GGUF", {"cut-Q4_1.gguf": cut, "empty-Q8_0.gguf": empty})
    for ref, why in (("acme/bad-GGUF:Q4_1", "truncated GGUF"), ("acme/bad-GGUF:Q8_0", "too short")):
        result = llmrun(llmrun_env, "pull", ref)
        assert result.returncode == 1 and result.stdout == "", result.stderr
        assert result.stderr.count("\n") == 1 and why in result.stderr
        assert "the Hugging Face cache's copy is damaged; delete it, then pull again" in (
            result.stderr
        )
    # a file a new download would not change is named as -m names it, without that advice
    newer = tmp_path / "newer.gguf"
    newer.write_bytes(b"GGUF" + struct.pack("<I", 99) + bytes(64))
    add_repo(hub, "acme/new-GGUF", {"newer-Q4_1.gguf": newer})
    result = llmrun(llmrun_env, "pull", "acme/new-GGUF:Q4_1")
    assert result.returncode == 1 and result.stderr.count("\n") == 1, result.stderr
    assert "version" in result.stderr and "pull again" not in result.stderr, result.stderr


def test_pull_resolves_quant_from_cache(hub_env: dict[str, str]) -> None:
    result = llmrun(hub_env, "pull", "acme/tiny-GGUF:Q8_0")
    assert result.returncode == 0, result.stderr
    path = Path(result.stdout.strip())
    assert path.name == "tiny-Q8_0.gguf" and COMMIT in str(path)
    result = llmrun(hub_env, "pull", "acme/tiny-GGUF/tiny-Q4_1.gguf")
    assert result.returncode == 0 and result.stdout.strip().endswith("tiny-Q4_1.gguf")


def test_hub_errors_are_one_line(hub_env: dict[str, str]) -> None:
    cases = {
        (
            "pull",
            "acme/tiny-GGUF:Q2_K",
        ): "acme/tiny-GGUF has no Q2_K file; it has: tiny-Q4_1.gguf, tiny-Q8_0.gguf",
        (
            "pull",
            "acme/two-GGUF",
        ): "acme/two-GGUF matches several files: acme/two-GGUF/a-Q4_K_M.gguf, acme/two-GGUF/b/b-Q4_K_M.gguf",
        (
            "pull",
            "nobody/missing",
        ): "nobody/missing is not in the local Hugging Face cache (offline mode is on)",
        (
            "pull",
            "acme/tiny-GGUF/nope.gguf",
        ): "acme/tiny-GGUF/nope.gguf is not in the local cache and offline mode is on",
    }
    for args, expected in cases.items():
        result = llmrun(hub_env, *args)
        assert result.returncode == 1, args
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], result.stderr
        assert "Traceback" not in result.stderr


def test_run_with_a_hub_model_and_models_listing(hub_env: dict[str, str]) -> None:
    result = llmrun(hub_env, "run", "-m", "acme/tiny-GGUF:Q4_1", "Say hi", "-n", "4", "--temp", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()
    assert "tiny-Q4_1" in result.stderr
    listing = llmrun(hub_env, "models")
    assert listing.returncode == 0, listing.stderr
    out = listing.stdout
    for ref in (
        "(default)",
        "acme/tiny-GGUF/tiny-Q4_1.gguf",
        "acme/tiny-GGUF/tiny-Q8_0.gguf",
        "acme/two-GGUF/b/b-Q4_K_M.gguf",
    ):
        assert ref in out
    assert "135M" in out and "Q4_1" in out
    assert "README" not in out


def test_the_embedded_models_path_is_whole_where_it_is_not_below_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`llmrun models` run outside the checkout showed `../../work/main/.venv/...`."""
    from llmrun.cli.models import _shown

    inside = tmp_path / "venv" / "model.gguf"
    monkeypatch.chdir(tmp_path)
    assert _shown(str(inside)) == str(Path("venv") / "model.gguf")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert _shown(str(inside)) == str(inside)


ESCAPES = "\x1b]0;PWN\x07\x1b[41mRED"


def test_models_lists_names_with_escapes_clean(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file in the Hugging Face cache named with escape sequences was listed as it was named:
    `llmrun models` set the window title and turned the terminal red."""
    from typer.testing import CliRunner

    from llmrun.cli.app import app

    hub = tmp_path / "hub"
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"not a gguf file at all")
    add_repo(hub, "org/repo", {f"{ESCAPES}.gguf": broken, f"sub{ESCAPES}/x.gguf": broken})
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    result = CliRunner().invoke(app, ["models"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.stderr
    assert "\x1b" not in result.stdout
    assert "org/repo/RED.gguf" in result.stdout and "org/repo/subRED/x.gguf" in result.stdout


def test_a_model_files_own_strings_are_listed_clean() -> None:
    """The architecture column is the model file's own string: it is cleaned as well."""
    import dataclasses

    from rich.console import Console

    from llmrun.cli.models import models_table
    from llmrun.runners.gguf import read_gguf
    from llmrun.runners.models import ListedModel, default_model_path

    path = default_model_path()
    info = read_gguf(path)
    info = dataclasses.replace(
        info, metadata={**info.metadata, "general.architecture": f"llama{ESCAPES}"}
    )
    listed = ListedModel(f"o/r/{ESCAPES}.gguf", f"/x/{ESCAPES}.gguf", "hub", 1, info)
    console = Console(width=300, record=True, file=open(os.devnull, "w"))  # noqa: SIM115
    console.print(models_table([listed]))
    text = console.export_text(styles=False)
    assert "\x1b" not in text and "llamaRED" in text and "o/r/RED.gguf" in text


def test_pull_names_the_file_clean_on_a_terminal_and_whole_in_a_pipe(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`llmrun pull` prints the file's path: a terminal gets it without escapes, a pipe (a
    script that opens the file) as it is."""
    from types import SimpleNamespace

    from typer.testing import CliRunner

    from llmrun.cli import models
    from llmrun.cli.app import app

    path = f"/hub/org/repo/{ESCAPES}.gguf"
    monkeypatch.setattr(models, "resolve_model", lambda ref: SimpleNamespace(path=path))
    monkeypatch.setattr(models, "read_gguf", lambda path: None)  # no file behind the name
    piped = CliRunner().invoke(app, ["pull", "org/repo"])
    assert piped.exit_code == 0, piped.stderr
    assert piped.stdout == path + "\n"
    monkeypatch.setattr(models.os, "isatty", lambda fd: True)
    shown = CliRunner().invoke(app, ["pull", "org/repo"])
    assert shown.stdout == "/hub/org/repo/RED.gguf\n"


def hub_online(llmrun_env: dict[str, str], server: FakeHub) -> dict[str, str]:
    """llmrun_env against a fake Hub: online, its own cache, no token from the shell."""
    env = {**llmrun_env, "HF_ENDPOINT": url(server)}
    for name in ("HF_HUB_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_VERBOSITY"):
        env.pop(name, None)
    return env


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmrun: error:"), lines
    return lines[0]


def test_a_hub_that_echoes_the_token_never_gets_it_printed(llmrun_env: dict[str, str]) -> None:
    """A Hub answering 500 with the request's Authorization header in its words: `pull`
    printed `token=Bearer hf_...` (HF_TOKEN, and bench's typed -hft, "never printed"), after
    23 s of retries and 11 lines of huggingface_hub's retry log."""
    with fake_hub("err500") as server:
        env = hub_online(llmrun_env, server)
        started = time.monotonic()
        line = one_line(llmrun({**env, "HF_TOKEN": "hf_SECRETXYZ123"}, "pull", "a/b:Q4_K_M"))
        assert time.monotonic() - started < 15
        assert "hf_SECRET" not in line and "SECRETXYZ" not in line, line
        assert "500" in line and "boom" in line, line
        assert sum("/tree/" in p for p in server.requests) == 1 + HUB_RETRIES
        typed = llmrun(env, "bench", "-hf", "a/b:Q4_K_M", "-hft", "hf_TYPEDSECRET9")
        typed_line = one_line(typed)
        assert "TYPEDSECRET" not in typed_line and "boom" in typed_line, typed_line


def test_hub_words_take_every_token_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", "s3cr3t-value")
    words = hub_words(
        RuntimeError(
            "a s3cr3t-value b Authorization: Bearer abc.def c hf_abcdefghijklmnopqrstuvwxyz12"
            "\nd hf_models"
        )
    )
    assert "s3cr3t" not in words and "abc.def" not in words and "abcdefgh" not in words
    assert "hf_models" in words  # a name, not a token (a real one is hf_ and 34 characters)
    assert "\n" not in words
    assert len(hub_words(RuntimeError("x" * 100_000))) < 400


def test_a_hub_that_never_answers_is_given_up_on(llmrun_env: dict[str, str]) -> None:
    """A Hub that accepts the connection and never answers: `pull` waited for ever (the
    listing went out with no timeout), only Ctrl-C ended it. Now HF_HUB_DOWNLOAD_TIMEOUT
    bounds every request, and the end is one line."""
    with fake_hub("hang") as server:
        env = {
            **hub_online(llmrun_env, server),
            "HF_HUB_DOWNLOAD_TIMEOUT": "1",
            "HF_HUB_ETAG_TIMEOUT": "1",
        }
        for ref, words in (
            ("a/b:Q4_K_M", "no answer within 1 s"),
            ("a/b/m-Q4_K_M.gguf", "the Hub cannot be reached"),
        ):
            started = time.monotonic()
            line = one_line(llmrun(env, "pull", ref, timeout=60))
            assert time.monotonic() - started < 30, ref
            assert words in line, line


def test_a_huge_reference_is_not_said_back_whole(hub_env: dict[str, str]) -> None:
    """`llmrun pull "a/$(printf 'b%.0s' {1..100000})"` said the 100 KB argument back whole."""
    huge = "b" * 100_000
    for args, words in (
        (("pull", f"a/{huge}"), "is no Hub repository: an owner's or a repository's name is at"),
        (("pull", f"a/b/{huge}.gguf"), "is not a file in the repository (a path there is at"),
        (("pull", f"/nowhere/{huge}"), "is no Hub reference"),
        (("run", "-m", f"/nowhere/{huge}.gguf", "hi"), "model file not found: /nowhere/bbb"),
    ):
        result = llmrun(hub_env, *args)
        assert result.returncode in (1, 2), result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], lines[0][:400]
        assert len(lines[0]) < 500 and "characters)" in lines[0], lines[0][:400]


def test_a_repository_of_many_files_is_not_listed_whole() -> None:
    """A listing of 200,000 GGUF files made one 3.4 MB line: `it has: f000000-Q4.gguf, ...`."""
    files = [f"f{i:06d}-Q4.gguf" for i in range(200_000)]
    with pytest.raises(HubError) as missing:
        choose_gguf("a/b", files, "Q4_K_M")
    text = str(missing.value)
    assert text.endswith("f000009-Q4.gguf and 199,990 more") and len(text) < 400, text[:400]
    with pytest.raises(AmbiguousModelError) as several:
        choose_gguf("a/b", files, "Q4")
    text = str(several.value)
    assert text.endswith("a/b/f000009-Q4.gguf and 199,990 more") and len(text) < 500
    assert len(several.value.candidates) == 200_000


def test_a_hub_listing_of_many_files_is_one_short_line(llmrun_env: dict[str, str]) -> None:
    with fake_hub("many", n_files=20_000) as server:
        line = one_line(llmrun(hub_online(llmrun_env, server), "pull", "a/b:Q4_K_M"))
    assert line.startswith("llmrun: error: a/b has no Q4_K_M file; it has: f000000-Q4.gguf,")
    assert "and 19,990 more" in line and len(line) < 500, line[:500]


def test_a_cached_entry_that_is_no_file_is_named_as_what_it_is(
    llmrun_env: dict[str, str], model_path: str
) -> None:
    """`-m a/b/fifo.gguf`, where the cache holds a FIFO in a snapshot that no refs/main names
    (`llmrun models` lists it), said `not in the local cache and the Hub cannot be reached`;
    where refs/main names it, `pull` printed the FIFO's path as a model's, exit 0."""
    hub = Path(llmrun_env["HF_HOME"]) / "hub"
    for repo, ref in (("a/b", False), ("c/d", True)):
        snapshot = hub / f"models--{repo.replace('/', '--')}" / "snapshots" / COMMIT
        snapshot.mkdir(parents=True)
        os.mkfifo(snapshot / "fifo.gguf")
        (snapshot / "zero.gguf").symlink_to("/dev/zero")
        (snapshot / "m.gguf").symlink_to(model_path)
        if ref:
            (snapshot.parent.parent / "refs").mkdir()
            (snapshot.parent.parent / "refs" / "main").write_text(COMMIT)
        for name in ("fifo.gguf", "zero.gguf"):
            for args in (("pull", f"{repo}/{name}"), ("run", "-m", f"{repo}/{name}", "hi")):
                line = one_line(llmrun(llmrun_env, *args))
                assert line.endswith(
                    f"{name}: is a device, a FIFO or a socket, not a GGUF file"
                    " (llama.cpp maps the weights from a file on disk)"
                ), line
        pulled = llmrun(llmrun_env, "pull", f"{repo}/m.gguf")
        assert pulled.returncode == 0 and pulled.stdout.strip().endswith("m.gguf"), pulled.stderr
    missing = one_line(llmrun(llmrun_env, "pull", "a/b/nothing.gguf"))
    assert "a/b/nothing.gguf is not in the local cache and offline mode is on" in missing
