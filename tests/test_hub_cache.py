"""runners/hub_cache.py reads the Hugging Face cache as huggingface_hub's own scan_cache_dir
does, without importing it: the same repositories, snapshots, refs and files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from llmrun.runners import hub_cache

from .conftest import HANG_S


def _blob(root: Path, repo: str, name: str, data: bytes, mtime: float) -> Path:
    blob = root / repo / "blobs" / name
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    os.utime(blob, (mtime, mtime))
    return blob


def _link(root: Path, repo: str, commit: str, rel: str, blob: Path) -> None:
    path = root / repo / "snapshots" / commit / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to(os.path.relpath(blob, path.parent))


@pytest.fixture
def cache(tmp_path: Path) -> Path:
    root = tmp_path / "hub"
    repo = "models--Owner--Some-Model-GGUF"
    a = _blob(root, repo, "aaa", b"GGUF-a", 1_000.0)
    b = _blob(root, repo, "bbb", b"GGUF-b", 2_000.0)
    _link(root, repo, "c1", "model-Q4_0.gguf", a)
    _link(root, repo, "c1", "sub/dir/model-Q8_0.gguf", b)
    _link(root, repo, "c2", "model-Q4_0.gguf", a)
    (root / repo / "refs").mkdir()
    (root / repo / "refs" / "main").write_text("c2")
    (root / repo / "refs" / "pr").mkdir()
    (root / repo / "refs" / "pr" / "1").write_text("c1")
    other = "models--x--y"
    _link(root, other, "c9", "gone.gguf", root / other / "blobs" / "missing")
    c = _blob(root, other, "ccc", b"x", 3_000.0)
    _link(root, other, "c9", "here.gguf", c)
    (root / "datasets--x--z").mkdir()
    (root / "version.txt").write_text("1")
    return root


def test_the_layout_read_as_huggingface_hub_reads_it(cache: Path) -> None:
    from huggingface_hub import scan_cache_dir

    theirs = {
        (r.repo_id, rev.commit_hash): (
            set(rev.refs),
            sorted(str(f.file_path.relative_to(rev.snapshot_path)) for f in rev.files),
            rev.last_modified,
        )
        for r in scan_cache_dir(cache).repos
        if r.repo_type == "model"
        for rev in r.revisions
    }
    ours = {
        (s.repo_id, s.commit): (set(s.refs), list(s.files), s.last_modified)
        for s in hub_cache.snapshots(str(cache))
        if s.repo_id != "x/y"  # huggingface_hub drops a repo with a missing blob whole
    }
    assert ours == theirs


def test_a_missing_blob_leaves_out_that_file_only(cache: Path) -> None:
    assert hub_cache.repo_files("x/y", str(cache)) == ["here.gguf"]


def test_main_wins_over_a_newer_snapshot(cache: Path) -> None:
    assert hub_cache.repo_files("owner/some-model-gguf", str(cache)) == ["model-Q4_0.gguf"]
    assert hub_cache.repo_files("nobody/none", str(cache)) is None
    assert list(hub_cache.snapshots(str(cache / "absent"))) == []


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"HF_HUB_CACHE": "/a/hub"}, "/a/hub"),
        ({"HUGGINGFACE_HUB_CACHE": "/legacy"}, "/legacy"),
        ({"HF_HOME": "/home/hf"}, "/home/hf/hub"),
        ({"XDG_CACHE_HOME": "/xdg"}, "/xdg/huggingface/hub"),
        ({}, os.path.expanduser("~/.cache/huggingface/hub")),
    ],
)
def test_the_cache_is_where_huggingface_hub_looks(
    env: dict[str, str], expected: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HOME", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert hub_cache.cache_dir() == expected


@pytest.mark.parametrize(
    "content",
    [b"\xd4\x8f garbage", b"../../../../../tmp/evil", b"c2" * 21, b"0" * 39 + b"\n"],
)
def test_a_damaged_ref_is_named_before_huggingface_hub_reads_it(
    cache: Path, content: bytes
) -> None:
    ref = cache / "models--Owner--Some-Model-GGUF" / "refs" / "main"
    ref.write_bytes(content)
    problem = hub_cache.damaged_ref("Owner/Some-Model-GGUF", str(cache))
    assert problem is not None and "is not a commit hash" in problem


def test_a_huge_ref_is_not_read_whole(cache: Path) -> None:
    ref = cache / "models--Owner--Some-Model-GGUF" / "refs" / "main"
    with open(ref, "wb") as f:
        f.truncate(2 << 30)  # sparse: huggingface_hub's path handling hung on one of these
    assert "is not a commit hash" in (
        hub_cache.damaged_ref("Owner/Some-Model-GGUF", str(cache)) or ""
    )


def test_a_commit_hash_or_no_ref_is_fine(cache: Path) -> None:
    ref = cache / "models--Owner--Some-Model-GGUF" / "refs" / "main"
    ref.write_text("0123456789abcdef0123456789abcdef01234567")
    assert hub_cache.damaged_ref("Owner/Some-Model-GGUF", str(cache)) is None
    assert hub_cache.damaged_ref("nobody/none", str(cache)) is None


def test_run_names_a_damaged_cache_in_one_line(cache: Path, llmrun_env: dict[str, str]) -> None:
    import subprocess

    from .conftest import which_llmrun

    (cache / "models--Owner--Some-Model-GGUF" / "refs" / "main").write_bytes(b"\xd4\x8f")
    env = {**llmrun_env, "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [which_llmrun(), "run", "-m", "Owner/Some-Model-GGUF/model-Q4_0.gguf", "-n", "1", "hi"],
        env=env,
        capture_output=True,
        text=True,
        timeout=HANG_S,
        stdin=subprocess.DEVNULL,
    )
    assert done.returncode == 1, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert "cache of Owner/Some-Model-GGUF is damaged" in last and "internal error" not in last


def test_a_fifo_among_the_refs_blocks_nothing(cache: Path) -> None:
    refs = cache / "models--Owner--Some-Model-GGUF" / "refs"
    (refs / "main").unlink()
    os.mkfifo(refs / "main")
    os.mkfifo(refs / "other")
    assert "not a regular file" in (
        hub_cache.damaged_ref("Owner/Some-Model-GGUF", str(cache)) or ""
    )
    assert len(list(hub_cache.snapshots(str(cache)))) == 3  # listed, no ref read from the pipes
