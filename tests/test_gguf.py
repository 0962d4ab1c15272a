from __future__ import annotations

import re
import struct
from pathlib import Path

import pytest

from llmrun.runners.errors import InvalidModelFileError, ModelNotFoundError
from llmrun.runners.gguf import GGML_BLOCKS, _Reader, read_gguf
from llmrun.runners.library import llama_lib


def test_reads_the_embedded_model(model_file: str) -> None:
    info = read_gguf(model_file)
    assert info.version == 3
    assert info.architecture == "llama"
    assert info.quantization == "Q4_1"
    assert 130e6 < info.n_params < 140e6
    assert info.n_ctx_train == 8192
    assert info.chat_template and "im_start" in info.chat_template
    assert info.data_size_bytes <= info.file_size_bytes


def test_block_sizes_agree_with_ggml() -> None:
    import ctypes

    lib = llama_lib()
    ggml = ctypes.CDLL(str(Path(lib.__file__).parent / "lib" / "libggml-base.so"))
    ggml.ggml_blck_size.restype = ctypes.c_int64
    ggml.ggml_type_size.restype = ctypes.c_size_t
    for type_id, (per_block, block_bytes) in GGML_BLOCKS.items():
        assert ggml.ggml_blck_size(type_id) == per_block, type_id
        assert ggml.ggml_type_size(type_id) == block_bytes, type_id


def test_missing_file() -> None:
    with pytest.raises(ModelNotFoundError):
        read_gguf("/no/such/model.gguf")


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"PK\x03\x04" + b"\0" * 64, "not a GGUF file"),
        (b"GGUF" + struct.pack("<IQQ", 99, 0, 0), "unsupported GGUF version 99"),
        (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 10) + b"abc", "truncated"),
        (b"short", "not a GGUF file"),
    ],
)
def test_bad_files(tmp_path: Path, content: bytes, problem: str) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(content)
    with pytest.raises(InvalidModelFileError, match=problem):
        read_gguf(path)


def test_truncated_tensor_data(tmp_path: Path, model_file: str) -> None:
    data = Path(model_file).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(InvalidModelFileError, match="truncated GGUF file: tensor data needs"):
        read_gguf(cut)


def test_directory(tmp_path: Path) -> None:
    with pytest.raises(InvalidModelFileError, match="directory"):
        read_gguf(tmp_path)


def _string_array(strings: list[bytes]) -> bytes:
    """A GGUF header of one key, `tokenizer.ggml.tokens`, holding `strings` (more than the
    reader keeps, so it steps over them)."""
    key = b"tokenizer.ggml.tokens"
    body = b"".join(struct.pack("<Q", len(s)) + s for s in strings)
    return (
        b"GGUF"
        + struct.pack("<IQQ", 3, 0, 1)
        + struct.pack("<Q", len(key))
        + key
        + struct.pack("<IIQ", 9, 8, len(strings))  # an array (9) of strings (8)
        + body
    )


@pytest.mark.parametrize("cut", [1, 7, 8, 9, 300])
def test_a_header_cut_inside_a_long_string_array_is_truncated(tmp_path: Path, cut: int) -> None:
    """The string arrays a header steps over (a vocabulary) end early: one line, wherever the
    cut falls (inside a length, inside a string, past a length that points beyond the end)."""
    header = _string_array([b"tok%d" % i for i in range(100)])
    path = tmp_path / "cut.gguf"
    path.write_bytes(header[:-cut])
    with pytest.raises(InvalidModelFileError, match=r"truncated GGUF file \(header ends early\)"):
        read_gguf(path)


@pytest.mark.parametrize(
    ("count", "says"),
    [
        (100, "truncated GGUF file (header ends early)"),
        (2**40, "corrupt GGUF header (array too long)"),
    ],
)
def test_an_array_count_past_the_end_is_truncated_unless_no_array_is_that_long(
    tmp_path: Path, count: int, says: str
) -> None:
    """`head -c 2000` of a model cuts it inside its vocabulary, whose count (49,152) is more
    than the bytes left: that was "corrupt GGUF header (array too long)". A file cut short
    says so; only a count no array reaches is called corrupt."""
    header = _string_array([b"tok%d" % i for i in range(100)])
    where = header.index(struct.pack("<Q", 100))
    path = tmp_path / "cut.gguf"
    path.write_bytes(header[:where] + struct.pack("<Q", count) + b"\0" * 40)
    with pytest.raises(InvalidModelFileError, match=re.escape(says)):
        read_gguf(path)


def test_a_string_length_past_the_end_is_truncated(tmp_path: Path) -> None:
    strings = [b"tok%d" % i for i in range(100)]
    header = _string_array(strings)
    tail = struct.pack("<Q", len(strings[-1])) + strings[-1]
    path = tmp_path / "long.gguf"
    path.write_bytes(header[: -len(tail)] + struct.pack("<Q", 1 << 40) + strings[-1])
    with pytest.raises(InvalidModelFileError, match=r"truncated GGUF file \(header ends early\)"):
        read_gguf(path)


def test_a_whole_long_string_array_is_stepped_over(tmp_path: Path) -> None:
    path = tmp_path / "whole.gguf"
    path.write_bytes(_string_array([b"tok%d" % i for i in range(100)]) + b"\0" * 64)
    info = read_gguf(path)
    assert info.metadata["tokenizer.ggml.tokens"] is None  # stepped over, not kept


@pytest.mark.parametrize(
    ("data", "count", "end"),
    [
        (struct.pack("<Q", 0), 1, 8),  # an empty string that ends the data
        (struct.pack("<Q", 1) + b"x", 1, 9),  # a string that ends the data
        (struct.pack("<Q", 1) + b"x" + struct.pack("<Q", 0), 2, 17),
        (b"", 0, 0),
    ],
)
def test_strings_that_end_exactly_at_the_end_are_whole(data: bytes, count: int, end: int) -> None:
    reader = _Reader(data, "p")
    reader.skip_strings(count)
    assert reader.pos == end


@pytest.mark.parametrize(
    ("data", "count"),
    [
        (struct.pack("<Q", 2) + b"x", 1),  # one byte short
        (struct.pack("<Q", 0)[:7], 1),  # a length cut short
        (struct.pack("<Q", 0), 2),  # a second string that is not there
    ],
)
def test_strings_past_the_end_are_truncated(data: bytes, count: int) -> None:
    with pytest.raises(InvalidModelFileError, match=r"truncated GGUF file \(header ends early\)"):
        _Reader(data, "p").skip_strings(count)


def _model_header(fields: list[tuple[str, int, bytes]]) -> bytes:
    """A GGUF header of a llama model with no tensors: general.architecture, then `fields`
    (key, GGUF value type, the value's encoded bytes)."""
    kvs = [("general.architecture", 8, struct.pack("<Q", 5) + b"llama"), *fields]
    body = b"".join(
        struct.pack("<Q", len(k)) + k.encode() + struct.pack("<I", t) + v for k, t, v in kvs
    )
    header = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kvs)) + body
    return header + b"\0" * (-len(header) % 32)  # the tensor data (none) starts aligned


def _u32_array(values: list[int]) -> bytes:
    return struct.pack("<IQ", 4, len(values)) + b"".join(struct.pack("<I", v) for v in values)


@pytest.mark.parametrize(
    "name", ["block_count", "context_length", "embedding_length", "attention.key_length"]
)
@pytest.mark.parametrize("values", [[30], [], [30, 30]])
def test_a_count_that_is_one_number_is_refused_as_an_array(
    tmp_path: Path, name: str, values: list[int]
) -> None:
    """llama.block_count = [30] passed the check (arrays were allowed for every count) and
    then int([30]) was an internal error in run, chat, bench, serve and tune."""
    path = tmp_path / "arr.gguf"
    path.write_bytes(_model_header([(f"llama.{name}", 9, _u32_array(values))]))
    with pytest.raises(InvalidModelFileError) as caught:
        read_gguf(path)
    assert (
        f"corrupt GGUF header (llama.{name} = an array of {len(values)}; llama.cpp needs a"
        f" whole number 1.." in str(caught.value)
    )


def test_per_layer_head_counts_may_be_arrays(tmp_path: Path) -> None:
    """llama.cpp reads head counts and the feed-forward length per layer (OpenELM's)."""
    path = tmp_path / "per_layer.gguf"
    path.write_bytes(
        _model_header(
            [
                ("llama.block_count", 4, struct.pack("<I", 2)),
                ("llama.attention.head_count", 9, _u32_array([4, 8])),
                ("llama.attention.head_count_kv", 9, _u32_array([2, 2])),
                ("llama.feed_forward_length", 9, _u32_array([64, 128])),
            ]
        )
    )
    info = read_gguf(path)
    assert info.metadata["llama.attention.head_count"] == [4, 8]


def test_per_layer_counts_of_a_model_of_more_than_64_layers_are_read(tmp_path: Path) -> None:
    """An 80-layer model's per-layer head counts (deci's, Nemotron-51B's) were skipped as a
    long array and the file refused: `head_count_kv = None`."""
    path = tmp_path / "deep.gguf"
    path.write_bytes(
        _model_header(
            [
                ("llama.block_count", 4, struct.pack("<I", 80)),
                ("llama.attention.head_count_kv", 9, _u32_array([8] * 79 + [0])),
                ("llama.feed_forward_length", 9, _u32_array([64] * 80)),
            ]
        )
    )
    info = read_gguf(path)
    assert info.metadata["llama.attention.head_count_kv"] == [8] * 79 + [0]


@pytest.mark.parametrize(
    ("field", "says"),
    [
        (("llama.block_count", 8, struct.pack("<Q", 3) + b"abc"), "a string of 3 characters"),
        (("tokenizer.ggml.tokens", 4, struct.pack("<I", 5)), "5; not an array"),
    ],
)
def test_a_count_of_the_wrong_type_is_one_line(
    tmp_path: Path, field: tuple[str, int, bytes], says: str
) -> None:
    path = tmp_path / "wrong.gguf"
    path.write_bytes(_model_header([field]))
    with pytest.raises(InvalidModelFileError, match=re.escape(says)):
        read_gguf(path)
