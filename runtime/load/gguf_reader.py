"""A fast, read-only GGUF parser: metadata as Python values, tensors as memory-mapped bytes.

`gguf.GGUFReader` builds a numpy view per array element, which takes seconds for a 49k-token
vocabulary; this reads the same layout with `struct` in a fraction of that, and leaves
dequantization to `gguf.quants.dequantize`.

Layout (little-endian): magic "GGUF", version u32, tensor count u64, metadata count u64, metadata
key/value pairs, tensor infos (name, dims in ggml order, type, offset), then tensor data aligned to
`general.alignment` (32 by default).

A model split into parts (llama.cpp's `gguf-split`, `convert_hf_to_gguf.py --split-max-size`, the Hub's
50 GB file limit: NAME-00001-of-00003.gguf, ...) opens as one file from any of its parts: the first part
holds the metadata, every part its own tensors (`split.no`, `split.count`, `split.tensors.count`).
"""

from __future__ import annotations

import contextlib
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# A part of a split model: NAME-00001-of-00003.gguf (gguf-split's and gguf-py's naming).
SPLIT_PART = re.compile(r"^(?P<stem>.+)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$", re.IGNORECASE)

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
    part: int = 0  # which file of a split model holds it (GGUFFile.paths)

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


def split_parts(path: Path) -> list[Path] | None:
    """The files of the split model `path` is a part of, in order (None: not named as a part). A
    missing part is an error naming it."""
    m = SPLIT_PART.match(path.name)
    if m is None:
        return None
    count = int(m["count"])
    if not 1 <= int(m["no"]) <= count:
        raise ValueError(f"{path}: part {int(m['no'])} of {count} is not a part of a split model")
    width = len(m["no"])
    parts = [
        path.with_name(f"{m['stem']}-{i:0{width}d}-of-{m['count']}{path.suffix}") for i in range(1, count + 1)
    ]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"{path}: a model split into {count} parts; missing {', '.join(missing)} beside it"
        )
    return parts


def gguf_models(files: list[Path]) -> list[list[Path]]:
    """.gguf files grouped into models: a file alone, or the parts of one split model (same folder, name
    and part count) together, in order of their first file."""
    models: dict[tuple[Path, str, str] | Path, list[Path]] = {}
    for f in sorted(files):
        m = SPLIT_PART.match(f.name)
        key: tuple[Path, str, str] | Path = f if m is None else (f.parent, m["stem"].lower(), m["count"])
        models.setdefault(key, []).append(f)
    return list(models.values())


class GGUFFile:
    """An open GGUF file, or all the parts of a split one: `metadata` (dict, the first part's),
    `tensors` (name -> info, file order), `load(name)`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        parts = split_parts(self.path) or [self.path]
        self.paths = parts
        self._bufs: list[mmap.mmap] = []
        self.tensors: dict[str, GGUFTensorInfo] = {}
        self.metadata: dict[str, Any] = {}
        try:
            for i, part in enumerate(parts):
                version, metadata = self._read_part(part, i)
                if i == 0:
                    self.version, self.metadata = version, metadata
                self._check_part(part, i, len(parts), metadata)
        except BaseException:
            self.close()
            raise
        expected = self.metadata.get("split.tensors.count")
        if len(parts) > 1 and expected is not None and int(expected) != len(self.tensors):
            raise ValueError(
                f"{self.path}: the split model's {len(parts)} parts hold {len(self.tensors)} tensors, "
                f"its first part says {int(expected)}"
            )

    def _read_part(self, path: Path, index: int) -> tuple[int, dict[str, Any]]:
        """Maps one file and adds its tensors; returns its version and metadata."""
        with path.open("rb") as f:
            buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._bufs.append(buf)
        if buf[:4] != GGUF_MAGIC:
            raise ValueError(f"{path}: not a GGUF file (magic {buf[:4]!r}, expected b'GGUF')")
        cur = _Cursor(buf, 4)
        version = cur.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: unsupported GGUF version {version} (expected 2 or 3)")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            metadata[key] = cur.value(cur.scalar("<I"))
        raw_infos = [self._tensor_info(cur) for _ in range(n_tensors)]
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cur.pos // alignment) * alignment
        for name, shape, gtype, offset in raw_infos:
            if name in self.tensors:
                raise ValueError(
                    f"{path}: tensor {name} is also in {self.paths[self.tensors[name].part].name}"
                )
            block, type_size = GGML_QUANT_SIZES[gtype]
            n_bytes = int(np.prod(shape, dtype=np.int64)) // block * type_size
            self.tensors[name] = GGUFTensorInfo(name, shape, gtype, data_start + offset, n_bytes, index)
        return version, metadata

    def _check_part(self, path: Path, index: int, count: int, metadata: dict[str, Any]) -> None:
        """A part's own split keys agree with its name; a file whose keys say it is one part of
        several, named otherwise, is refused (its other parts could not be found)."""
        says = int(metadata.get("split.count", 1))
        if count == 1 and says > 1:
            raise ValueError(
                f"{path}: part {int(metadata.get('split.no', 0)) + 1} of a model split into {says} parts, "
                "named without the NAME-00001-of-0000N.gguf pattern that finds the others"
            )
        if count > 1 and (says != count or int(metadata.get("split.no", -1)) != index):
            raise ValueError(
                f"{path}: its split keys say part {int(metadata.get('split.no', -1)) + 1} of {says}; "
                f"its name, part {index + 1} of {count}"
            )

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
        data = np.frombuffer(
            self._bufs[info.part], dtype=np.uint8, count=info.n_bytes, offset=info.data_offset
        )
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
        for buf in self._bufs:
            with contextlib.suppress(BufferError):
                buf.close()

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
