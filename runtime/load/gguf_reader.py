"""A fast, read-only GGUF parser: metadata as Python values, tensors as memory-mapped bytes.

`gguf.GGUFReader` builds a numpy view per array element, which takes seconds for a 49k-token
vocabulary; this reads the same layout with `struct` in a fraction of that, and leaves
dequantization to `gguf.quants.dequantize`.

Layout (little-endian): magic "GGUF", version u32, tensor count u64, metadata count u64, metadata
key/value pairs, tensor infos (name, dims in ggml order, type, offset), then tensor data aligned to
`general.alignment` (32 by default).
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value type -> (struct format, numpy dtype) for fixed-size scalars
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"),
    1: ("<b", "<i1"),
    2: ("<H", "<u2"),
    3: ("<h", "<i2"),
    4: ("<I", "<u4"),
    5: ("<i", "<i4"),
    6: ("<f", "<f4"),
    7: ("<?", "<u1"),
    10: ("<Q", "<u8"),
    11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_STRING, _ARRAY, _BOOL = 8, 9, 7


@dataclass(frozen=True)
class GGUFTensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy (row-major) order: ggml dims reversed, e.g. (out, in) for a matrix
    ggml_type: GGMLQuantizationType
    data_offset: int  # absolute offset in the file
    n_bytes: int

    @property
    def type_name(self) -> str:
        return self.ggml_type.name


class _Cursor:
    def __init__(self, buf: mmap.mmap, offset: int = 0) -> None:
        self.buf = buf
        self.pos = offset

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        raw = self.buf[self.pos : self.pos + n]
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            return self.array()
        if vtype not in _SCALARS:
            raise ValueError(f"unknown GGUF metadata value type {vtype} at byte {self.pos}")
        return self.scalar(_SCALARS[vtype][0])

    def array(self) -> Any:
        etype, count = self.scalar("<I"), self.scalar("<Q")
        if etype in _SCALARS:  # numeric arrays in one read
            dtype = np.dtype(_SCALARS[etype][1])
            values = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
            self.pos += dtype.itemsize * count
            return [bool(v) for v in values] if etype == _BOOL else values.tolist()
        return [self.value(etype) for _ in range(count)]


class GGUFFile:
    """An open GGUF file: `metadata` (dict), `tensors` (name -> info, file order), `load(name)`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with self.path.open("rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        if self._buf[:4] != GGUF_MAGIC:
            raise ValueError(f"{self.path}: not a GGUF file (magic {self._buf[:4]!r}, expected b'GGUF')")
        cur = _Cursor(self._buf, 4)
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            raise ValueError(f"{self.path}: unsupported GGUF version {self.version} (expected 2 or 3)")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("<I"))
        raw_infos = [self._tensor_info(cur) for _ in range(n_tensors)]
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cur.pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensorInfo] = {}
        for name, shape, gtype, offset in raw_infos:
            block, type_size = GGML_QUANT_SIZES[gtype]
            n_bytes = int(np.prod(shape, dtype=np.int64)) // block * type_size
            self.tensors[name] = GGUFTensorInfo(name, shape, gtype, data_start + offset, n_bytes)

    @staticmethod
    def _tensor_info(cur: _Cursor) -> tuple[str, tuple[int, ...], GGMLQuantizationType, int]:
        name = cur.string()
        dims = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
        gtype = GGMLQuantizationType(cur.scalar("<I"))
        offset = cur.scalar("<Q")
        return name, tuple(reversed(dims)), gtype, offset

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as uint8 [..., row bytes] (a read-only view of the mapped file)."""
        info = self.tensors[name]
        block, type_size = GGML_QUANT_SIZES[info.ggml_type]
        *lead, last = info.shape
        data = np.frombuffer(self._buf, dtype=np.uint8, count=info.n_bytes, offset=info.data_offset)
        return data.reshape(*lead, last // block * type_size)

    def load(self, name: str) -> np.ndarray:
        """The tensor dequantized to a fresh, writable float32 array of shape `info.shape`."""
        info = self.tensors[name]
        out = dequantize(self.raw(name), info.ggml_type)
        if out.dtype != np.float32 or not out.flags.writeable:
            out = out.astype(np.float32)  # a copy: never hand out a view of the mapped file
        return out.reshape(info.shape)

    def close(self) -> None:
        # BufferError: a caller still holds a raw() view; the mapping goes away with it.
        with contextlib.suppress(BufferError):
            self._buf.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
