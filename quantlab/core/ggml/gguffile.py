"""Reading and writing GGUF files at the byte level: tensors as llama.cpp stores them, metadata copied raw.

    f = read_gguf("model.gguf")
    f.arch, f.tensors["blk.0.attn_v.weight"].type, f.tensors["blk.0.attn_v.weight"].raw   # "llama", "q6_k", bytes
    f.type_counts()                                                                        # {"q4_k": 96, "f32": 61}

The header is parsed here rather than by gguf.GGUFReader, which decodes every array (28 s for Gemma-3's
262k-token vocabulary): string arrays are skipped (their value here is their length), each metadata entry's bytes
are kept so a writer can copy it verbatim (write_gguf), and tensor data is a memory map. A truncated or corrupt
file fails naming the file; a tensor of a type quantlab cannot read names the tensor and its type.
"""
from __future__ import annotations

import mmap
import os
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .registry import GGML_BY_ID, GGMLType

FLOAT_TYPES = {0: ("f32", np.float32), 1: ("f16", np.float16), 30: ("bf16", np.uint16)}  # unquantized types
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
STRING, ARRAY, UINT32 = 8, 9, 4
DEFAULT_ALIGNMENT = 32


@dataclass(frozen=True)
class GGUFHeader:
    meta: dict  # key -> value (numeric arrays as tuples, string arrays as their length)
    kv_bytes: dict[str, bytes]  # key -> the entry's bytes as stored (key, type, value), for a verbatim copy
    tensors: dict[str, tuple[tuple[int, ...], int, int]]  # name -> (shape in ne order, type id, data offset)
    data_start: int
    version: int


def read_header(path: str | Path) -> GGUFHeader:
    """The header of a GGUF file (version 2 or 3); ValueError naming the file if it is not one."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        pos = 0

        def take(fmt: str):
            nonlocal pos
            v = struct.unpack_from(fmt, buf, pos)[0]
            pos += struct.calcsize(fmt)
            return v

        def string() -> str:
            nonlocal pos
            n = take("<Q")
            if pos + n > len(buf):
                raise ValueError("a string runs past the end of the file")
            pos += n
            return bytes(buf[pos - n:pos]).decode("utf-8", errors="replace")

        def value(kind: int):
            nonlocal pos
            if kind == STRING:
                return string()
            if kind == ARRAY:
                item, count = take("<I"), take("<Q")
                if item in _SCALARS:
                    fmt = f"<{count}{_SCALARS[item][1]}"
                    numbers = struct.unpack_from(fmt, buf, pos)
                    pos += struct.calcsize(fmt)
                    return numbers
                for _ in range(count):
                    value(item)
                return count
            if kind not in _SCALARS:
                raise ValueError(f"unknown metadata value type {kind}")
            return take(_SCALARS[kind])

        try:
            if len(buf) < 24 or bytes(buf[:4]) != b"GGUF":
                raise ValueError("no GGUF magic")
            pos = 4
            version, n_tensors, n_kv = take("<I"), take("<Q"), take("<Q")
            meta, kv_bytes = {}, {}
            for _ in range(n_kv):
                start = pos
                key = string()
                meta[key] = value(take("<I"))
                kv_bytes[key] = bytes(buf[start:pos])
            tensors = {}
            for _ in range(n_tensors):
                name = string()
                shape = tuple(take("<Q") for _ in range(take("<I")))
                tensors[name] = (shape, take("<I"), take("<Q"))
            align = int(meta.get("general.alignment", DEFAULT_ALIGNMENT))
            data_start = -(-pos // align) * align
            for name, (shape, type_id, offset) in tensors.items():
                if data_start + offset + _nbytes(shape, type_id) > len(buf):
                    raise ValueError(f"tensor {name!r} runs past the end of the file (truncated?)")
        except (ValueError, struct.error, UnicodeDecodeError) as e:
            raise ValueError(f"{path} is not a readable GGUF file (truncated or corrupt?): {e}") from None
    return GGUFHeader(meta, kv_bytes, tensors, data_start, version)


def _type_name(type_id: int) -> str:
    if type_id in FLOAT_TYPES:
        return FLOAT_TYPES[type_id][0]
    if type_id in GGML_BY_ID:
        return GGML_BY_ID[type_id].name
    import gguf

    known = gguf.GGMLQuantizationType._value2member_map_
    return gguf.GGMLQuantizationType(type_id).name.lower() if type_id in known else f"type id {type_id}"


def _nbytes(shape: tuple[int, ...], type_id: int) -> int:
    import gguf

    numel = int(np.prod(shape)) if shape else 1
    if type_id in FLOAT_TYPES:
        return numel * np.dtype(FLOAT_TYPES[type_id][1]).itemsize
    if type_id not in gguf.GGMLQuantizationType._value2member_map_:
        raise ValueError(f"unknown tensor type id {type_id}")
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(type_id)]
    return numel // block * size


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type: str  # quantlab's name: "q4_k", "f32", ...
    shape: tuple[int, ...]  # torch order: (rows, columns) for a matrix
    raw: np.ndarray  # quantized: (rows, bytes per row) uint8; float types: the values, shaped (a read-only view)

    @property
    def ggml(self) -> GGMLType | None:
        return next((t for t in GGML_BY_ID.values() if t.name == self.type), None)

    def floats(self) -> torch.Tensor:
        """The tensor's values in float32 (dequantized where quantized), in the file's row order."""
        if self.ggml is None:
            data = self.raw.astype(np.uint32) << 16 if self.type == "bf16" else self.raw
            return torch.from_numpy(np.array(data.view(np.float32) if self.type == "bf16" else data,
                                             dtype=np.float32)).reshape(self.shape)
        t = self.ggml
        return t.dequantize(torch.from_numpy(np.array(self.raw)).reshape(-1, t.type_size)).reshape(self.shape)


@dataclass(frozen=True)
class GGUFContents:
    path: Path
    arch: str
    header: GGUFHeader
    tensors: dict[str, GGUFTensor]

    @property
    def metadata(self) -> dict:
        return self.header.meta

    def type_counts(self) -> dict[str, int]:
        return dict(sorted(Counter(t.type for t in self.tensors.values()).items()))


def read_metadata(path: str | Path) -> dict:
    """The file's metadata (string arrays as their length); the header alone is read."""
    return read_header(path).meta


def read_gguf(path: str | Path) -> GGUFContents:
    """The file's metadata and tensors; tensor data are read-only views of a memory map."""
    path = Path(path)
    header = read_header(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name, (ne, type_id, offset) in header.tensors.items():
        shape = tuple(int(n) for n in reversed(ne))  # GGUF lists ne0 (the row length) first
        start = header.data_start + offset
        chunk = data[start:start + _nbytes(ne, type_id)]
        if type_id in FLOAT_TYPES:
            kind, dtype = FLOAT_TYPES[type_id]
            tensors[name] = GGUFTensor(name, kind, shape, chunk.view(dtype).reshape(shape))
        elif type_id in GGML_BY_ID:
            t = GGML_BY_ID[type_id]
            rows = int(np.prod(shape[:-1])) if len(shape) > 1 else 1
            tensors[name] = GGUFTensor(name, t.name, shape, chunk.reshape(rows, shape[-1] // t.block * t.type_size))
        else:
            readable = ", ".join([*(k for k, _ in FLOAT_TYPES.values()), *(t.name for t in GGML_BY_ID.values())])
            raise ValueError(f"{path}: tensor {name!r} is {_type_name(type_id)}, a type quantlab cannot read; "
                             f"readable: {readable}")
    return GGUFContents(path, str(header.meta.get("general.architecture", "")), header, tensors)


# ---- writing ----------------------------------------------------------------------------------------------------

def _gguf_string(s: str) -> bytes:
    b = s.encode("utf-8")
    return struct.pack("<Q", len(b)) + b


def kv_uint32(key: str, value: int) -> bytes:
    return _gguf_string(key) + struct.pack("<II", UINT32, value)


def kv_string(key: str, value: str) -> bytes:
    return _gguf_string(key) + struct.pack("<I", STRING) + _gguf_string(value)


def kv_strings(key: str, values: list[str]) -> bytes:
    return _gguf_string(key) + struct.pack("<IIQ", ARRAY, STRING, len(values)) + b"".join(map(_gguf_string, values))


def write_gguf(path: str | Path, kv: list[bytes], tensors: list[tuple[str, tuple[int, ...], int, np.ndarray]],
               alignment: int = DEFAULT_ALIGNMENT) -> None:
    """A GGUF v3 file: metadata entries as bytes (kv_* or copied from read_header's kv_bytes, general.architecture
    first), tensors as (name, shape in ne order, type id, data as stored). Written to a temporary file, renamed."""
    path = Path(path)
    info, offset = [], 0
    for name, ne, type_id, data in tensors:
        if data.nbytes != _nbytes(ne, type_id):
            raise ValueError(f"{name}: {data.nbytes} bytes for a {_type_name(type_id)} tensor of shape {ne}")
        info.append(_gguf_string(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}Q", *ne)
                    + struct.pack("<IQ", type_id, offset))
        offset += -(-data.nbytes // alignment) * alignment
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv)) + b"".join(kv) + b"".join(info)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(head + b"\0" * (-len(head) % alignment))
        for _, _, _, data in tensors:
            f.write(np.ascontiguousarray(data).tobytes())
            f.write(b"\0" * (-data.nbytes % alignment))
    os.replace(tmp, path)
