"""Synthetic Llama models of real shapes: random Q4_0 weights, a real model's tokenizer.

Decode and prefill speed depend on a model's shape and quantization, not on its weights' values,
so a file with Llama-3.1-8B's shape and random Q4_0 blocks runs as fast as the real model. Where
nothing can be downloaded (the GPU machine), such files stand in for real models: `strip` keeps a
real model's metadata (tokenizer, chat template) without its tensors, `make` writes a model of
a named shape around it. Standard library only: it runs under any python3.

    python3 benchmarks/synth_gguf.py strip REAL.gguf tok.gguf
    python3 benchmarks/synth_gguf.py make tok.gguf 8b out.gguf
"""

from __future__ import annotations

import argparse
import random
import struct
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

GGUF_MAGIC = b"GGUF"
ALIGNMENT = 32  # general.alignment's default; the header written here keeps it
HEADER_READ_MAX = 256 << 20  # a tokenizer's metadata is a few MB; refuse anything absurd
TYPE_F32, TYPE_Q4_0 = 0, 2
FILE_TYPE_Q4_0 = 2  # llama_ftype MOSTLY_Q4_0
Q4_0_BLOCK = (32, 18)  # elements, bytes: a float16 scale and 16 bytes of 4-bit values

# GGUF value types: fixed-size scalars, then string (8) and array (9)
_SCALAR = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY, _UINT32, _FLOAT32 = 8, 9, 4, 6


@dataclass(frozen=True)
class Shape:
    """A Llama architecture's dimensions (config.json's hidden_size, num_hidden_layers, ...)."""

    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    n_ff: int
    tied_embeddings: bool  # the output layer reuses the token embedding

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


SHAPES = {
    "135m": Shape(576, 30, 9, 3, 1536, tied_embeddings=True),  # SmolLM2-135M
    "1b": Shape(2048, 16, 32, 8, 8192, tied_embeddings=True),  # Llama-3.2-1B
    "8b": Shape(4096, 32, 32, 8, 14336, tied_embeddings=False),  # Llama-3.1-8B
    "70b": Shape(8192, 80, 64, 8, 28672, tied_embeddings=False),  # Llama-3.1-70B
}


@dataclass(frozen=True)
class KeyValue:
    """One metadata entry: its key, and its type and value exactly as the file encodes them."""

    key: str
    encoded: bytes  # the value type (uint32) and the value's bytes

    @property
    def value_type(self) -> int:
        return int(struct.unpack_from("<I", self.encoded)[0])

    def text(self) -> str:
        if self.value_type != _STRING:
            raise ValueError(f"{self.key} is not a string")
        (n,) = struct.unpack_from("<Q", self.encoded, 4)
        return self.encoded[12 : 12 + n].decode("utf-8")

    def array_length(self) -> int:
        if self.value_type != _ARRAY:
            raise ValueError(f"{self.key} is not an array")
        return int(struct.unpack_from("<Q", self.encoded, 8)[0])


@dataclass(frozen=True)
class Tensor:
    name: str
    dims: tuple[int, ...]  # ne0 first, as GGUF stores them
    ggml_type: int
    n_in: int = 0  # inputs per output (ne0): scales the random weights

    @property
    def n_bytes(self) -> int:
        n = 1
        for d in self.dims:
            n *= d
        if self.ggml_type == TYPE_F32:
            return 4 * n
        per, size = Q4_0_BLOCK
        return n // per * size


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.data):
            raise ValueError("the GGUF header ends early")
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def unpack(self, fmt: str) -> int:
        return int(struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0])

    def skip_value(self, value_type: int, depth: int = 0) -> None:
        if value_type in _SCALAR:
            self.take(struct.calcsize(_SCALAR[value_type]))
        elif value_type == _STRING:
            self.take(self.unpack("<Q"))
        elif value_type == _ARRAY and depth < 2:
            item_type, count = self.unpack("<I"), self.unpack("<Q")
            if item_type in _SCALAR:
                self.take(count * struct.calcsize(_SCALAR[item_type]))
            else:
                for _ in range(count):
                    self.skip_value(item_type, depth + 1)
        else:
            raise ValueError(f"unknown GGUF value type {value_type}")


def read_metadata(path: Path) -> list[KeyValue]:
    """A GGUF file's metadata entries, values kept as encoded (tensors are not read)."""
    with path.open("rb") as f:
        data = f.read(HEADER_READ_MAX)
    cur = _Cursor(data)
    if cur.take(4) != GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    version = cur.unpack("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported")
    cur.unpack("<Q")  # tensors
    entries = []
    for _ in range(cur.unpack("<Q")):
        key = cur.take(cur.unpack("<Q")).decode("utf-8")
        start = cur.pos
        cur.skip_value(cur.unpack("<I"))
        entries.append(KeyValue(key, data[start : cur.pos]))
    return entries


def _string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str, value_type: int, value: str | int | float) -> KeyValue:
    if value_type == _STRING:
        return KeyValue(key, struct.pack("<I", _STRING) + _string(str(value)))
    return KeyValue(key, struct.pack("<I", value_type) + struct.pack(_SCALAR[value_type], value))


def _header(entries: list[KeyValue], tensors: list[Tensor]) -> bytes:
    """The file up to the tensor data, padded to the alignment."""
    parts = [GGUF_MAGIC, struct.pack("<IQQ", 3, len(tensors), len(entries))]
    parts += [_string(kv.key) + kv.encoded for kv in entries]
    offset = 0
    for t in tensors:
        parts.append(_string(t.name) + struct.pack("<I", len(t.dims)))
        parts.append(b"".join(struct.pack("<Q", d) for d in t.dims))
        parts.append(struct.pack("<IQ", t.ggml_type, offset))
        offset += _padded(t.n_bytes)
    head = b"".join(parts)
    return head + b"\0" * (-len(head) % ALIGNMENT)


def _padded(n: int) -> int:
    return n + (-n % ALIGNMENT)


def strip(src: Path, dst: Path) -> int:
    """Write src's metadata alone (no tensors) to dst; returns its size in bytes."""
    head = _header(read_metadata(src), [])
    dst.write_bytes(head)
    return len(head)


def model_metadata(tokenizer: list[KeyValue], shape_name: str) -> list[KeyValue]:
    """llama's hyperparameters for the shape, then the tokenizer's entries (tokens, merges, chat
    template) with the source model's own architecture keys left out."""
    shape = SHAPES[shape_name]
    by_key = {kv.key: kv for kv in tokenizer}
    if "tokenizer.ggml.tokens" not in by_key:
        raise ValueError("the tokenizer file has no tokenizer.ggml.tokens")
    source_arch = by_key["general.architecture"].text() if "general.architecture" in by_key else ""
    n_vocab = by_key["tokenizer.ggml.tokens"].array_length()
    a = "llama."
    own = [
        _kv("general.architecture", _STRING, "llama"),
        _kv("general.name", _STRING, f"synthetic-{shape_name}"),
        _kv("general.file_type", _UINT32, FILE_TYPE_Q4_0),
        _kv(a + "context_length", _UINT32, 8192),
        _kv(a + "embedding_length", _UINT32, shape.n_embd),
        _kv(a + "block_count", _UINT32, shape.n_layer),
        _kv(a + "feed_forward_length", _UINT32, shape.n_ff),
        _kv(a + "attention.head_count", _UINT32, shape.n_head),
        _kv(a + "attention.head_count_kv", _UINT32, shape.n_head_kv),
        _kv(a + "rope.dimension_count", _UINT32, shape.head_dim),
        _kv(a + "rope.freq_base", _FLOAT32, 500000.0),
        _kv(a + "attention.layer_norm_rms_epsilon", _FLOAT32, 1e-5),
        _kv(a + "vocab_size", _UINT32, n_vocab),
    ]
    replaced = {kv.key for kv in own}
    kept = [
        kv
        for kv in tokenizer
        if kv.key not in replaced
        and kv.key != "general.alignment"
        and not (source_arch and kv.key.startswith(source_arch + "."))
    ]
    return own + kept


def tensors(shape: Shape, n_vocab: int) -> list[Tensor]:
    """The tensors llama.cpp's llama loader expects, in its names."""
    e, kv = shape.n_embd, shape.n_head_kv * shape.head_dim

    def q(name: str, n_in: int, n_out: int) -> Tensor:
        return Tensor(name, (n_in, n_out), TYPE_Q4_0, n_in)

    def norm(name: str) -> Tensor:
        return Tensor(name, (e,), TYPE_F32)

    out = [q("token_embd.weight", e, n_vocab), norm("output_norm.weight")]
    if not shape.tied_embeddings:
        out.append(q("output.weight", e, n_vocab))
    for i in range(shape.n_layer):
        p = f"blk.{i}."
        out += [
            norm(p + "attn_norm.weight"),
            q(p + "attn_q.weight", e, e),
            q(p + "attn_k.weight", e, kv),
            q(p + "attn_v.weight", e, kv),
            q(p + "attn_output.weight", e, e),
            norm(p + "ffn_norm.weight"),
            q(p + "ffn_gate.weight", e, shape.n_ff),
            q(p + "ffn_up.weight", e, shape.n_ff),
            q(p + "ffn_down.weight", shape.n_ff, e),
        ]
    return out


def write_model(tokenizer: Path, shape_name: str, dst: Path, *, seed: int = 0) -> int:
    """Write a model of the shape with the tokenizer file's metadata; returns its size."""
    if shape_name not in SHAPES:
        raise ValueError(f"unknown shape {shape_name!r}: one of {', '.join(SHAPES)}")
    entries = model_metadata(read_metadata(tokenizer), shape_name)
    n_vocab = next(kv for kv in entries if kv.key == "tokenizer.ggml.tokens").array_length()
    plan = tensors(SHAPES[shape_name], n_vocab)
    pool = bytearray(random.Random(seed).randbytes(Q4_0_BLOCK[1] << 20))  # 1 Mi random blocks
    written = 0
    with dst.open("wb") as f:
        written += f.write(_header(entries, plan))
        for t in plan:
            written += _write_tensor(f, t, pool)
    return written


def _write_tensor(f: BinaryIO, t: Tensor, pool: bytearray) -> int:
    if t.ggml_type == TYPE_F32:
        data = struct.pack("<f", 1.0) * (t.n_bytes // 4)  # RMS norm weights of one
        return f.write(data + b"\0" * (-len(data) % ALIGNMENT))
    # Random 4-bit values with a scale that keeps activations in range (about 1/sqrt(n_in)),
    # so the model computes finite logits and samples real tokens.
    scale = struct.pack("<e", 1.0 / (4.6 * t.n_in**0.5))
    n_blocks = len(pool) // Q4_0_BLOCK[1]
    pool[0 :: Q4_0_BLOCK[1]] = scale[:1] * n_blocks
    pool[1 :: Q4_0_BLOCK[1]] = scale[1:] * n_blocks
    written = 0
    for chunk in _chunks(t.n_bytes, len(pool)):
        written += f.write(memoryview(pool)[:chunk])
    return written + f.write(b"\0" * (-t.n_bytes % ALIGNMENT))


def _chunks(total: int, size: int) -> Iterator[int]:
    while total > 0:
        yield min(total, size)
        total -= size


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command", required=True)
    s = sub.add_parser("strip", help="keep a GGUF file's metadata, drop its tensors")
    s.add_argument("src", type=Path)
    s.add_argument("dst", type=Path)
    m = sub.add_parser("make", help="write a synthetic model of a shape")
    m.add_argument("tokenizer", type=Path)
    m.add_argument("shape", choices=sorted(SHAPES))
    m.add_argument("dst", type=Path)
    args = ap.parse_args(argv)
    try:
        if args.command == "strip":
            size = strip(args.src, args.dst)
        else:
            size = write_model(args.tokenizer, args.shape, args.dst)
    except (OSError, ValueError) as e:
        print(f"synth_gguf: {e}", file=sys.stderr)
        return 1
    print(f"{args.dst}: {size / 2**20:,.1f} MiB")
    return 0


if __name__ == "__main__":
    import script  # benchmarks/script.py: Ctrl-C is exit 130

    script.run(main)
