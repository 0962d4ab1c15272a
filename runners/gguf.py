"""Read and check GGUF headers without llama.cpp.

llama.cpp aborts the whole process on some malformed files, so every file is checked here
first: magic, version, that the metadata parses, and that every tensor's data lies inside the
file. The same pass yields the facts `llmrun models` lists (architecture, quantization,
parameter count) without loading any weights.
"""

from __future__ import annotations

import math
import mmap
import os
import stat
import struct
from dataclasses import dataclass, field
from typing import Any

from .errors import DIRECTORY, NOT_A_FILE, InvalidModelFileError, ModelNotFoundError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

# ggml tensor type id -> (elements per block, bytes per block), from ggml-common.h.
GGML_BLOCKS: dict[int, tuple[int, int]] = {
    0: (1, 4),  # F32
    1: (1, 2),  # F16
    2: (32, 18),  # Q4_0
    3: (32, 20),  # Q4_1
    6: (32, 22),  # Q5_0
    7: (32, 24),  # Q5_1
    8: (32, 34),  # Q8_0
    9: (32, 36),  # Q8_1
    10: (256, 84),  # Q2_K
    11: (256, 110),  # Q3_K
    12: (256, 144),  # Q4_K
    13: (256, 176),  # Q5_K
    14: (256, 210),  # Q6_K
    15: (256, 292),  # Q8_K
    16: (256, 66),  # IQ2_XXS
    17: (256, 74),  # IQ2_XS
    18: (256, 98),  # IQ3_XXS
    19: (256, 50),  # IQ1_S
    20: (32, 18),  # IQ4_NL
    21: (256, 110),  # IQ3_S
    22: (256, 82),  # IQ2_S
    23: (256, 136),  # IQ4_XS
    24: (1, 1),  # I8
    25: (1, 2),  # I16
    26: (1, 4),  # I32
    27: (1, 8),  # I64
    28: (1, 8),  # F64
    29: (256, 56),  # IQ1_M
    30: (1, 2),  # BF16
    34: (256, 54),  # TQ1_0
    35: (256, 66),  # TQ2_0
    39: (32, 17),  # MXFP4
}

# llama_ftype (general.file_type) -> the name users know the quantization by.
FILE_TYPES: dict[int, str] = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    19: "IQ2_XXS",
    20: "IQ2_XS",
    21: "Q2_K_S",
    22: "IQ3_XS",
    23: "IQ3_XXS",
    24: "IQ1_S",
    25: "IQ4_NL",
    26: "IQ3_S",
    27: "IQ3_M",
    28: "IQ2_S",
    29: "IQ2_M",
    30: "IQ4_XS",
    31: "IQ1_M",
    32: "BF16",
    36: "TQ1_0",
    37: "TQ2_0",
    38: "MXFP4_MOE",
}

# GGUF value types 0-7 and 10-12, fixed-size scalars, as struct formats (8: string, 9: array):
# uint8 int8 uint16 int16 uint32 int32 float32 bool, then uint64 int64 float64
SCALAR_FORMATS = {t: f"<{c}" for t, c in zip((*range(8), 10, 11, 12), "BbHhIif?Qqd", strict=True)}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")
# Arrays longer than this (token lists, merges) are skipped, not materialised.
_KEEP_ARRAY_MAX = 64
_MAX_STRING = 64 * 1024 * 1024
_MAX_ARRAY = 2**32  # items in one array: past this a count is damaged, not cut short
_MAX_NESTING = 8  # arrays of arrays: llama.cpp itself reads no deeper than 2
LLAMA_MAX_LAYERS = 512  # llama.cpp asserts on block_count beyond this
_TRUNCATED = "truncated GGUF file (header ends early)"


@dataclass(frozen=True)
class GGUFInfo:
    """What a GGUF header says about a model, read without loading it."""

    path: str
    version: int
    file_size_bytes: int
    metadata: dict[str, Any] = field(repr=False)
    n_tensors: int
    n_params: int
    data_size_bytes: int

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    @property
    def name(self) -> str:
        """The file name without .gguf: what users recognise (general.name is often odd)."""
        base = os.path.basename(self.path)
        return base[:-5] if base.lower().endswith(".gguf") else base

    @property
    def quantization(self) -> str:
        file_type = self.metadata.get("general.file_type")
        if file_type is None:
            return "unknown"
        return FILE_TYPES.get(int(file_type), f"type {file_type}")

    @property
    def n_ctx_train(self) -> int | None:
        value = self.metadata.get(f"{self.architecture}.context_length")
        return int(value) if value is not None else None

    @property
    def chat_template(self) -> str | None:
        value = self.metadata.get("tokenizer.chat_template")
        return str(value) if value else None


class _Reader:
    """Cursor over the file's bytes (memory-mapped: only the header pages are touched)."""

    def __init__(self, buf: Any, path: str) -> None:
        self.buf = buf
        self.pos = 0
        self.path = path

    def _need(self, n: int) -> None:
        if self.pos + n > len(self.buf):
            raise InvalidModelFileError(self.path, _TRUNCATED)

    def scalar(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        self._need(size)
        value = struct.unpack_from(fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        if n > _MAX_STRING:
            raise InvalidModelFileError(self.path, "corrupt GGUF header (string too long)")
        self._need(n)
        text = bytes(self.buf[self.pos : self.pos + n]).decode("utf-8", errors="replace")
        self.pos += n
        return text

    def skip_strings(self, count: int) -> None:
        """Step over `count` strings (a vocabulary's 49,152, its merges): the loop keeps its
        cursor and bound local, as a call per string took 45 ms of every load."""
        unpack, buf, pos, end = _U64.unpack_from, self.buf, self.pos, len(self.buf)
        for _ in range(count):
            if pos + 8 > end:
                raise InvalidModelFileError(self.path, _TRUNCATED)
            pos += 8 + unpack(buf, pos)[0]
        self.pos = pos
        self._need(0)

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in SCALAR_FORMATS:
            return self.scalar(SCALAR_FORMATS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            if depth >= _MAX_NESTING:
                raise InvalidModelFileError(
                    self.path, "corrupt GGUF header (arrays nested too deep)"
                )
            itype = self.scalar("<I")
            n = self.scalar("<Q")
            if n > len(self.buf):  # more items than the file has bytes
                if n > _MAX_ARRAY:  # no array is that long: the count itself is damaged
                    raise InvalidModelFileError(self.path, "corrupt GGUF header (array too long)")
                # a vocabulary's count, say, in a file cut short (`head -c 2000 model.gguf`)
                raise InvalidModelFileError(self.path, _TRUNCATED)
            # numbers one per layer are kept for as many layers as llama.cpp allows: an
            # 80-layer model's per-layer head counts were skipped and then refused as None
            if n <= _KEEP_ARRAY_MAX or (itype in SCALAR_FORMATS and n <= LLAMA_MAX_LAYERS):
                return [self.value(itype, depth + 1) for _ in range(n)]
            if itype in SCALAR_FORMATS:
                self.pos += n * struct.calcsize(SCALAR_FORMATS[itype])
                self._need(0)
            elif itype == _STRING:
                self.skip_strings(n)
            else:
                for _ in range(n):
                    self.value(itype, depth + 1)
            return None
        raise InvalidModelFileError(self.path, f"corrupt GGUF header (unknown value type {vtype})")


def _shown(value: Any) -> str:
    """A header value for a message: a number as it is, an array or string by its size (a
    64 MiB string would be a 64 MiB line)."""
    if isinstance(value, list):
        return f"an array of {len(value)}"
    if isinstance(value, str):
        return f"a string of {len(value):,} characters"
    return repr(value)


def _check_model_fields(path: str, metadata: dict[str, Any]) -> None:
    """The header fields llama.cpp asserts on (and then aborts) rather than rejects."""
    arch = metadata.get("general.architecture")
    if arch is None:
        return  # not a model (a vocabulary, a LoRA): llama.cpp says what it thinks
    if not isinstance(arch, str) or not arch:
        raise InvalidModelFileError(path, "corrupt GGUF header (general.architecture)")
    # (name, low, high, per_layer): llama.cpp reads a per-layer array only for the head
    # counts and the feed-forward length (get_key_or_arr); every other count is one number,
    # and llmrun reads it so (int(), the layers to offload, the trained context).
    count_fields = (
        ("block_count", 1, LLAMA_MAX_LAYERS, False),
        ("embedding_length", 1, 1 << 20, False),
        ("context_length", 1, 1 << 30, False),
        ("attention.head_count", 0, 1 << 16, True),
        ("attention.head_count_kv", 0, 1 << 16, True),
        ("feed_forward_length", 0, 1 << 24, True),
        ("attention.key_length", 1, 1 << 16, False),
        ("attention.value_length", 1, 1 << 16, False),
    )
    for name, low, high, per_layer in count_fields:
        key = f"{arch}.{name}"
        if key not in metadata:
            continue
        value = metadata[key]
        values = value if isinstance(value, list) and per_layer else [value]  # None: no count
        if not values or not all(type(v) is int and low <= v <= high for v in values):
            shown = _shown(value)
            need = f"a whole number {low}..{high}" + (", or one per layer" if per_layer else "")
            raise InvalidModelFileError(
                path, f"corrupt GGUF header ({key} = {shown}; llama.cpp needs {need})"
            )
    tokens = metadata.get("tokenizer.ggml.tokens")  # an array: llmrun counts its items
    if tokens is not None and not isinstance(tokens, list):
        raise InvalidModelFileError(
            path, f"corrupt GGUF header (tokenizer.ggml.tokens = {_shown(tokens)}; not an array)"
        )
    for name in (
        "attention.layer_norm_rms_epsilon",
        "attention.layer_norm_epsilon",
        "rope.freq_base",
        "rope.freq_scale",
    ):
        key = f"{arch}.{name}"
        value = metadata.get(key, 0)  # absent: nothing to check
        if not (type(value) in (int, float) and 0 <= value < math.inf):
            raise InvalidModelFileError(
                path,
                f"corrupt GGUF header ({key} = {_shown(value)}; llama.cpp needs a number >= 0)",
            )
    file_type = metadata.get("general.file_type")
    if file_type is not None and type(file_type) is not int:
        raise InvalidModelFileError(
            path, f"corrupt GGUF header (general.file_type {_shown(file_type)})"
        )


def read_gguf(path: str | os.PathLike[str]) -> GGUFInfo:
    """Parse the header of a GGUF file and check that its tensor data is all there."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise ModelNotFoundError(path)
    if os.path.isdir(path):
        raise InvalidModelFileError(path, DIRECTORY)
    if not stat.S_ISREG(os.stat(path).st_mode):  # it was "too short": size 0
        raise InvalidModelFileError(path, NOT_A_FILE)
    file_size = os.path.getsize(path)
    if file_size < 24:
        raise InvalidModelFileError(path, "not a GGUF file (too short)")
    try:
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            if buf[:4] != GGUF_MAGIC:
                raise InvalidModelFileError(path, "not a GGUF file (bad magic bytes)")
            r = _Reader(buf, path)
            r.pos = 4
            version, n_tensors, n_kv = r.scalar("<I"), r.scalar("<Q"), r.scalar("<Q")
            if version not in SUPPORTED_VERSIONS:
                raise InvalidModelFileError(path, f"unsupported GGUF version {version}")
            if n_tensors > 1_000_000 or n_kv > 1_000_000:
                raise InvalidModelFileError(path, "corrupt GGUF header (absurd counts)")
            metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key = r.string()
                metadata[key] = r.value(r.scalar("<I"))
            tensors = []
            for _ in range(n_tensors):
                r.string()  # name
                n_dims = r.scalar("<I")
                if n_dims > 8:
                    raise InvalidModelFileError(path, "corrupt GGUF header (tensor rank)")
                dims = [r.scalar("<Q") for _ in range(n_dims)]
                tensors.append((dims, r.scalar("<I"), r.scalar("<Q")))
            header_end = r.pos
    except OSError as e:
        raise InvalidModelFileError(path, f"cannot be read ({e.strerror or e})") from None
    _check_model_fields(path, metadata)
    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment <= 0 or alignment & (alignment - 1):
        raise InvalidModelFileError(
            path, f"corrupt GGUF header (general.alignment {alignment!r} is not a power of two)"
        )
    data_start = -(-header_end // alignment) * alignment
    n_params = 0
    data_end = data_start
    for dims, ggml_type, offset in tensors:
        n_elements = math.prod(dims)
        n_params += n_elements
        block = GGML_BLOCKS.get(ggml_type)
        if block is None:  # a type newer than this table: llama.cpp will judge it
            continue
        per_block, block_bytes = block
        data_end = max(data_end, data_start + offset + n_elements // per_block * block_bytes)
    if data_end > file_size:
        raise InvalidModelFileError(
            path,
            f"truncated GGUF file: tensor data needs {data_end} bytes, the file has {file_size}",
        )
    return GGUFInfo(
        path=path,
        version=version,
        file_size_bytes=file_size,
        metadata=metadata,
        n_tensors=n_tensors,
        n_params=n_params,
        data_size_bytes=data_end - data_start,
    )
