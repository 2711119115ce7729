"""The KV transfer's wire format: pure encode and decode, no torch, no I/O.

`GET /v1/kv/transfers/{id}?from_block=K` answers one stream of frames (docs/disaggregation.md, "Wire
protocol"). Every frame is a 16-byte head and a payload:

    magic  b"KVPF"             4 bytes
    kind   u8                  1 HEADER, 2 BLOCK, 3 END
    flags  u8                  0
    rsvd   u16                 0
    length u32                 payload bytes
    crc32  u32                 zlib.crc32 of the payload

(all little-endian). The stream is one HEADER, then one BLOCK per (layer, block) in layer-major order
(layer 0's blocks K..K+n-1, then layer 1's, ...), then one END:

- HEADER payload: a UTF-8 JSON object, `StreamHeader.to_json()`: version, the model fingerprint, the
  storage dtype, the scale dtype (quantized caches), block size, layers, KV heads and head size of this
  tensor-parallel rank, the rank and the group size, the prompt's token count, the first block and the
  block count.
- BLOCK payload: layer u32, block u32 (the block's index in the prompt), then the block's logical
  content, each row-major: K [block_size, kv_heads, head_dim], V (same), and for int8/fp8 caches the K
  and V scales [block_size, kv_heads] (float16). The layout a pod's kernels store blocks in (transposed
  K, head-major V) never reaches the wire.
- END payload: frames u32 (BLOCK frames sent), data bytes u64 (their payload bytes).

The decoder checks every frame's magic, kind, length and checksum, the header against the reader's own
layout, that each (layer, block) arrives once and in order, and the END counts: any fault is a
`WireError` with a reason the decode side counts (`kvpilot_kv_transfer_failures_total{reason}`).
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import asdict, dataclass

VERSION = 1
MAGIC = b"KVPF"
HEADER, BLOCK, END = 1, 2, 3
_HEAD = struct.Struct("<4sBBHII")
_BLOCK_ID = struct.Struct("<II")
_END = struct.Struct("<IQ")
FRAME_HEAD_BYTES = _HEAD.size
MAX_HEADER_BYTES = 64 * 1024
CONTENT_TYPE = "application/octet-stream"

# storage dtypes the runtime's KV caches use, by torch's name, and their element sizes
ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "float8_e4m3fn": 1}
SCALE_DTYPE = "float16"  # kernels/quant.SCALE_DTYPE


def transfer_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Pure: the prompt blocks a transfer carries: every full block before the last prompt token (the
    decode pod computes that token itself, which gives it the logits of the first output token)."""
    return max(0, num_prompt_tokens - 1) // block_size


class WireError(ValueError):
    """A stream that cannot be used. `reason`: checksum | truncated | protocol | mismatch."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class KVLayout:
    """What a pod's KV blocks are: two pods can exchange blocks only when these are equal."""

    model_fingerprint: str
    dtype: str  # the storage dtype's torch name (ITEMSIZE's keys)
    block_size: int
    num_layers: int
    num_kv_heads: int  # of this tensor-parallel rank
    head_dim: int
    tp_rank: int = 0
    tp_size: int = 1

    @property
    def quantized(self) -> bool:
        return self.dtype in ("int8", "float8_e4m3fn")

    @property
    def scale_dtype(self) -> str | None:
        return SCALE_DTYPE if self.quantized else None

    @property
    def kv_bytes(self) -> int:
        """Bytes of one block's K (or V) of one layer."""
        return self.block_size * self.num_kv_heads * self.head_dim * ITEMSIZE[self.dtype]

    @property
    def scale_bytes(self) -> int:
        """Bytes of one block's K (or V) scales of one layer (0 unless quantized)."""
        return self.block_size * self.num_kv_heads * 2 if self.quantized else 0

    @property
    def block_payload_bytes(self) -> int:
        """A BLOCK frame's content after its (layer, block) ids."""
        return 2 * (self.kv_bytes + self.scale_bytes)

    @property
    def bytes_per_block(self) -> int:
        """One block of every layer on the wire (frame heads included)."""
        return self.num_layers * (FRAME_HEAD_BYTES + _BLOCK_ID.size + self.block_payload_bytes)

    def stream_bytes(self, num_blocks: int) -> int:
        """An upper bound on a whole stream of `num_blocks` blocks."""
        return 2 * FRAME_HEAD_BYTES + MAX_HEADER_BYTES + _END.size + num_blocks * self.bytes_per_block


@dataclass(frozen=True)
class StreamHeader:
    layout: KVLayout
    num_tokens: int  # the prompt's tokens (the blocks cover its full blocks before the last token)
    first_block: int
    num_blocks: int
    version: int = VERSION

    def to_json(self) -> bytes:
        d = {"version": self.version, **asdict(self.layout), "scale_dtype": self.layout.scale_dtype}
        d |= {"num_tokens": self.num_tokens, "first_block": self.first_block, "num_blocks": self.num_blocks}
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> StreamHeader:
        try:
            d = json.loads(raw)
            ints = ("block_size", "num_layers", "num_kv_heads", "head_dim", "tp_rank", "tp_size")
            layout = KVLayout(str(d["model_fingerprint"]), str(d["dtype"]), **{k: _int(d[k]) for k in ints})
            header = cls(layout, _int(d["num_tokens"]), _int(d["first_block"]), _int(d["num_blocks"]))
            version = _int(d["version"])
        except (ValueError, KeyError, TypeError) as e:
            raise WireError("protocol", f"bad header: {e}") from None
        if version != VERSION:
            raise WireError("mismatch", f"wire version {version}, this pod reads {VERSION}")
        if layout.dtype not in ITEMSIZE:
            raise WireError("mismatch", f"unknown KV dtype {layout.dtype!r}")
        return header


def _int(v: object) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"expected a non-negative integer, got {v!r}")
    return v


def layout_mismatch(remote: KVLayout, local: KVLayout) -> str | None:
    """Pure: why blocks of `remote` cannot go into `local`'s pool (None: they can)."""
    for name in ("model_fingerprint", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim"):
        a, b = getattr(remote, name), getattr(local, name)
        if a != b:
            return f"{name} differs: the prefill pod has {a!r}, this pod {b!r}"
    if (remote.tp_rank, remote.tp_size) != (local.tp_rank, local.tp_size):
        return (
            f"tensor-parallel rank {remote.tp_rank}/{remote.tp_size} sent to rank "
            f"{local.tp_rank}/{local.tp_size}"
        )
    return None


# -- encoding ------------------------------------------------------------------------------------


def frame_head(kind: int, length: int, crc: int) -> bytes:
    return _HEAD.pack(MAGIC, kind, 0, 0, length, crc)


def encode_header(header: StreamHeader) -> bytes:
    payload = header.to_json()
    return frame_head(HEADER, len(payload), zlib.crc32(payload)) + payload


def encode_block_head(layer: int, block: int, data: bytes | memoryview) -> bytes:
    """The bytes that precede `data` in a BLOCK frame (frame head and ids): send them, then `data`."""
    ids = _BLOCK_ID.pack(layer, block)
    crc = zlib.crc32(data, zlib.crc32(ids))
    return frame_head(BLOCK, len(ids) + len(data), crc) + ids


def encode_end(num_frames: int, data_bytes: int) -> bytes:
    payload = _END.pack(num_frames, data_bytes)
    return frame_head(END, len(payload), zlib.crc32(payload)) + payload


def encode_stream(header: StreamHeader, blocks: list[list[bytes]]) -> bytes:
    """A whole stream in memory (tests, small transfers): `blocks[layer][i]` is block first_block + i."""
    parts = [encode_header(header)]
    frames = data = 0
    for layer, per_layer in enumerate(blocks):
        for i, payload in enumerate(per_layer):
            parts += [encode_block_head(layer, header.first_block + i, payload), payload]
            frames += 1
            data += len(payload)
    parts.append(encode_end(frames, data))
    return b"".join(parts)


# -- decoding ------------------------------------------------------------------------------------


@dataclass
class DecodedKV:
    header: StreamHeader
    blocks: list[list[memoryview]]  # [layer][i]: block first_block + i's payload (after its ids)

    @property
    def data_bytes(self) -> int:
        return sum(len(b) for per_layer in self.blocks for b in per_layer)


def _frame(buf: memoryview, pos: int) -> tuple[int, memoryview, int]:
    """(kind, payload, next position) of the frame at `pos`."""
    if len(buf) - pos < FRAME_HEAD_BYTES:
        raise WireError("truncated", f"the stream ends inside a frame head at byte {pos}")
    magic, kind, _, _, length, crc = _HEAD.unpack_from(buf, pos)
    if magic != MAGIC:
        raise WireError("protocol", f"bad frame magic at byte {pos}")
    start = pos + FRAME_HEAD_BYTES
    if len(buf) - start < length:
        raise WireError("truncated", f"the stream ends inside a frame at byte {pos}")
    payload = buf[start : start + length]
    if zlib.crc32(payload) != crc:
        raise WireError("checksum", f"frame at byte {pos} fails its crc32")
    return kind, payload, start + length


def decode_stream(raw: bytes | memoryview, local: KVLayout, first_block: int, num_blocks: int) -> DecodedKV:
    """Check and split a whole stream; `local`: this pod's layout; the stream must carry exactly the
    blocks first_block .. first_block + num_blocks - 1. Raises WireError."""
    buf = memoryview(raw)
    kind, payload, pos = _frame(buf, 0)
    if kind != HEADER or len(payload) > MAX_HEADER_BYTES:
        raise WireError("protocol", "the stream does not start with a header frame")
    header = StreamHeader.from_json(bytes(payload))
    why = layout_mismatch(header.layout, local)
    if why is not None:
        raise WireError("mismatch", why)
    if (header.first_block, header.num_blocks) != (first_block, num_blocks):
        raise WireError(
            "mismatch",
            f"the stream carries blocks {header.first_block}+{header.num_blocks}, "
            f"asked for {first_block}+{num_blocks}",
        )
    size = local.block_payload_bytes
    blocks: list[list[memoryview]] = [[] for _ in range(local.num_layers)]
    frames = 0
    for layer in range(local.num_layers):
        for i in range(num_blocks):
            kind, payload, pos = _frame(buf, pos)
            if kind != BLOCK or len(payload) != _BLOCK_ID.size + size:
                raise WireError("protocol", f"expected block frame {layer}/{first_block + i}")
            got = _BLOCK_ID.unpack_from(payload)
            if got != (layer, first_block + i):
                raise WireError(
                    "protocol", f"block frame {got} out of order: expected {layer, first_block + i}"
                )
            blocks[layer].append(payload[_BLOCK_ID.size :])
            frames += 1
    kind, payload, pos = _frame(buf, pos)
    if kind != END or len(payload) != _END.size:
        raise WireError("protocol", "expected the end frame")
    if _END.unpack_from(payload) != (frames, frames * size):
        raise WireError("protocol", "the end frame's counts differ from the frames received")
    if pos != len(buf):
        raise WireError("protocol", f"{len(buf) - pos} bytes after the end frame")
    return DecodedKV(header, blocks)
