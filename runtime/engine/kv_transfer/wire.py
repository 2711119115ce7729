"""The KV transfer's wire format: pure encode and decode, no torch, no I/O.

`GET /v1/kv/transfers/{id}?from_block=K&rank=R` answers one stream of frames (docs/disaggregation.md,
"Wire protocol", version 2). Every frame is a 16-byte head and a payload:

    magic  b"KVPF"             4 bytes
    kind   u8                  1 HEADER, 2 BLOCKS, 3 END
    flags  u8                  0
    rsvd   u16                 0
    length u32                 payload bytes
    crc32  u32                 zlib.crc32 of the payload

(all little-endian). The stream is one HEADER, then BLOCKS frames in layer-major order, each a run of
consecutive blocks of one layer (layer 0's blocks K..K+n-1 in one or more runs, then layer 1's, ...),
then one END:

- HEADER payload: a UTF-8 JSON object, `StreamHeader.to_json()`: version, the model fingerprint, the
  storage dtype, the scale dtype (quantized caches), block size, layers, KV heads and head size of this
  tensor-parallel rank, the rank and the group size, the prompt's token count, the first block and the
  block count.
- BLOCKS payload: layer u32, first block u32 (its index in the prompt), count u32, then the run's
  logical content, each row-major over its `count` blocks: K [count, block_size, kv_heads, head_dim],
  V (same), and for int8/fp8 caches the K and V scales [count, block_size, kv_heads] (float16). The
  layout a pod's kernels store blocks in (transposed K, head-major V) never reaches the wire. A sender
  cuts a layer into runs of at most `MAX_FRAME_BYTES` (1 MiB); a reader takes any cut.
- END payload: frames u32 (BLOCKS frames sent), data bytes u64 (their payload bytes after the ids).

Runs of many blocks keep the per-frame work (a head, a checksum call, an await) to a few hundred per
stream, and each run's data is one contiguous slice both sides read and write in place (blocks.py).

The decoder (`StreamChecker`, frame by frame as they arrive, or `decode_stream` for a whole buffer)
checks every frame's magic, kind, length (never more than the blocks still expected) and checksum,
the header against the reader's own layout, that the runs cover each layer's blocks once and in
order, and the END counts: any fault is a `WireError` with a reason the decode side counts
(`kvpilot_kv_transfer_failures_total{reason}`).
"""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import asdict, dataclass

VERSION = 2
MAGIC = b"KVPF"
HEADER, BLOCKS, END = 1, 2, 3
_HEAD = struct.Struct("<4sBBHII")
_RUN_ID = struct.Struct("<III")
_END = struct.Struct("<IQ")
FRAME_HEAD_BYTES = _HEAD.size
RUN_ID_BYTES = _RUN_ID.size
RUN_HEAD_BYTES = FRAME_HEAD_BYTES + RUN_ID_BYTES  # what precedes a BLOCKS frame's data
END_FRAME_BYTES = FRAME_HEAD_BYTES + _END.size
MAX_HEADER_BYTES = 64 * 1024
# the sender's cut: a run's data stays under this (at least one block). Small enough that a run's
# checksum reads what its gather just wrote while it is still in the CPU's cache, and that the next
# run's gather overlaps this one's send; large enough that the per-frame work is noise (~200 frames
# for 4k tokens of SmolLM2 in float32)
MAX_FRAME_BYTES = 2**20
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
        """One block of one layer on the wire: its K and V (and their scales)."""
        return 2 * (self.kv_bytes + self.scale_bytes)

    def run_parts(self, num_blocks: int) -> list[tuple[str, int]]:
        """Pure: a BLOCKS frame's data, in order: (part, bytes) for `num_blocks` blocks."""
        parts = [("k", num_blocks * self.kv_bytes), ("v", num_blocks * self.kv_bytes)]
        if self.quantized:
            parts += [("k_scale", num_blocks * self.scale_bytes), ("v_scale", num_blocks * self.scale_bytes)]
        return parts


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


@dataclass(frozen=True)
class Run:
    """Blocks first_block .. first_block + num_blocks - 1 (indices in the prompt) of one layer."""

    layer: int
    first_block: int
    num_blocks: int


def plan_runs(
    layout: KVLayout, first_block: int, num_blocks: int, max_bytes: int = MAX_FRAME_BYTES
) -> list[Run]:
    """Pure: the sender's BLOCKS frames, layer-major, each at most `max_bytes` of data (one block at least)."""
    per = max(1, max_bytes // max(1, layout.block_payload_bytes))
    end = first_block + num_blocks
    return [
        Run(layer, b, min(per, end - b))
        for layer in range(layout.num_layers)
        for b in range(first_block, end, per)
    ]


def stream_length(header: StreamHeader, runs: list[Run]) -> int:
    """Pure: the exact bytes of a stream of `runs` after `header` (the response's Content-Length)."""
    data = sum(r.num_blocks for r in runs) * header.layout.block_payload_bytes
    return FRAME_HEAD_BYTES + len(header.to_json()) + len(runs) * RUN_HEAD_BYTES + data + END_FRAME_BYTES


# -- encoding ------------------------------------------------------------------------------------


def frame_head(kind: int, length: int, crc: int) -> bytes:
    return _HEAD.pack(MAGIC, kind, 0, 0, length, crc)


def encode_header(header: StreamHeader) -> bytes:
    payload = header.to_json()
    return frame_head(HEADER, len(payload), zlib.crc32(payload)) + payload


def encode_run_head(run: Run, data: bytes | memoryview) -> bytes:
    """The bytes that precede `data` in a BLOCKS frame (frame head and ids): send them, then `data`.
    Computes the checksum over `data` (blocking: large runs belong off the event loop)."""
    ids = _RUN_ID.pack(run.layer, run.first_block, run.num_blocks)
    crc = zlib.crc32(data, zlib.crc32(ids))
    return frame_head(BLOCKS, len(ids) + len(data), crc) + ids


def encode_end(num_frames: int, data_bytes: int) -> bytes:
    payload = _END.pack(num_frames, data_bytes)
    return frame_head(END, len(payload), zlib.crc32(payload)) + payload


def encode_stream(header: StreamHeader, runs: list[tuple[Run, bytes]]) -> bytes:
    """A whole stream in memory (tests, small transfers)."""
    parts = [encode_header(header)]
    for run, data in runs:
        parts += [encode_run_head(run, data), data]
    parts.append(encode_end(len(runs), sum(len(d) for _, d in runs)))
    return b"".join(parts)


# -- decoding ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BlockRun:
    """A received BLOCKS frame: `run`'s blocks, `data` their content as `KVLayout.run_parts` says."""

    run: Run
    data: memoryview


@dataclass
class DecodedKV:
    header: StreamHeader
    runs: list[BlockRun]  # layer-major; each layer's runs cover its blocks once, in order

    @property
    def data_bytes(self) -> int:
        return sum(len(r.data) for r in self.runs)


@dataclass(frozen=True)
class FrameHead:
    kind: int
    length: int
    crc: int


def check_crc(payload_parts: tuple[bytes | bytearray | memoryview, ...], crc: int) -> None:
    """Raise WireError(checksum) unless the parts' crc32, in order, is `crc`."""
    got = 0
    for part in payload_parts:
        got = zlib.crc32(part, got)
    if got != crc:
        raise WireError("checksum", "a frame fails its crc32")


class StreamChecker:
    """The decode side's check of one stream, frame by frame as it arrives (pure; the caller reads
    the bytes and checks the BLOCKS frames' checksums, possibly off its event loop: `check_crc`).
    `local`: this pod's layout; the stream must carry exactly blocks first_block .. + num_blocks - 1.

    Order: `head()` of each frame, then for HEADER `header(payload)`, for BLOCKS `run_ids(first 12
    payload bytes)` (the data follows), for END `end(payload)`, which returns the frames' count."""

    def __init__(self, local: KVLayout, first_block: int, num_blocks: int) -> None:
        self.local = local
        self.first, self.n = first_block, num_blocks
        self.header_seen = False
        self.layer, self.next = 0, first_block  # the next block expected
        self.frames = 0
        if num_blocks == 0:
            self.layer = local.num_layers

    @property
    def blocks_done(self) -> bool:
        return self.layer >= self.local.num_layers

    def head(self, raw: bytes | bytearray | memoryview) -> FrameHead:
        if len(raw) < FRAME_HEAD_BYTES:
            raise WireError("truncated", "the stream ends inside a frame head")
        magic, kind, _, _, length, crc = _HEAD.unpack_from(raw)
        if magic != MAGIC:
            raise WireError("protocol", "bad frame magic")
        if not self.header_seen:
            if kind != HEADER or length > MAX_HEADER_BYTES:
                raise WireError("protocol", "the stream does not start with a header frame")
        elif kind == BLOCKS:
            if self.blocks_done:
                raise WireError("protocol", "a block frame after the last layer's blocks")
            left = self.first + self.n - self.next
            if not _RUN_ID.size < length <= _RUN_ID.size + left * self.local.block_payload_bytes:
                raise WireError(
                    "protocol", f"a block frame of {length} bytes, {left} blocks left in the layer"
                )
        elif kind == END:
            if not self.blocks_done:
                raise WireError("protocol", f"the end frame before layer {self.layer}'s block {self.next}")
            if length != _END.size:
                raise WireError("protocol", "the end frame's length")
        else:
            raise WireError("protocol", f"unexpected frame kind {kind}")
        return FrameHead(kind, length, crc)

    def header(self, payload: bytes) -> StreamHeader:
        header = StreamHeader.from_json(payload)
        why = layout_mismatch(header.layout, self.local)
        if why is not None:
            raise WireError("mismatch", why)
        if (header.first_block, header.num_blocks) != (self.first, self.n):
            raise WireError(
                "mismatch",
                f"the stream carries blocks {header.first_block}+{header.num_blocks}, asked for {self.first}+{self.n}",
            )
        self.header_seen = True
        return header

    def run_ids(self, ids: bytes | bytearray | memoryview, length: int) -> Run:
        """The run a BLOCKS frame of `length` payload bytes carries, checked against what is due."""
        run = Run(*_RUN_ID.unpack_from(ids))
        if (run.layer, run.first_block) != (self.layer, self.next):
            raise WireError(
                "protocol", f"block run {run} out of order: expected layer {self.layer} block {self.next}"
            )
        if run.num_blocks < 1 or length != _RUN_ID.size + run.num_blocks * self.local.block_payload_bytes:
            raise WireError("protocol", f"block run {run} does not match its frame's {length} bytes")
        self.next += run.num_blocks
        if self.next == self.first + self.n:
            self.layer, self.next = self.layer + 1, self.first
        self.frames += 1
        return run

    def end(self, payload: bytes | bytearray | memoryview) -> None:
        if _END.unpack_from(payload) != (
            self.frames,
            self.n * self.local.num_layers * self.local.block_payload_bytes,
        ):
            raise WireError("protocol", "the end frame's counts differ from the frames received")


def decode_stream(raw: bytes | memoryview, local: KVLayout, first_block: int, num_blocks: int) -> DecodedKV:
    """Check and split a whole stream in memory (the runs' data are views into `raw`). Raises WireError."""
    buf = memoryview(raw)
    checker = StreamChecker(local, first_block, num_blocks)
    pos = 0
    header: StreamHeader | None = None
    runs: list[BlockRun] = []
    while True:
        head = checker.head(buf[pos : pos + FRAME_HEAD_BYTES])
        pos += FRAME_HEAD_BYTES
        payload = buf[pos : pos + head.length]
        if len(payload) < head.length:
            raise WireError("truncated", f"the stream ends inside a frame at byte {pos}")
        check_crc((payload,), head.crc)
        pos += head.length
        if head.kind == HEADER:
            header = checker.header(bytes(payload))
        elif head.kind == BLOCKS:
            runs.append(BlockRun(checker.run_ids(payload, head.length), payload[_RUN_ID.size :]))
        else:
            checker.end(payload)
            break
    if pos != len(buf):
        raise WireError("protocol", f"{len(buf) - pos} bytes after the end frame")
    assert header is not None
    return DecodedKV(header, runs)
