"""Where a KV transfer's time goes, in one process (benchmarks/kv_transfer_bench.py --profile): the
prefill side's export (gather from a pool laid out as the CPU kernels store it, checksum), the decode
side's check of the whole stream (frames, checksums), and the import into such a pool, next to a plain
copy of the same bytes. SmolLM2-135M's KV geometry (30 layers, 3 KV heads of 64, blocks of 16);
best of `repeats`, in ms."""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from typing import Any

import torch

from kvpilot.kernels import quant
from kvpilot.runtime.engine.kv_transfer.blocks import export_run, import_run, layout_of
from kvpilot.runtime.engine.kv_transfer.wire import (
    StreamHeader,
    decode_stream,
    encode_end,
    encode_header,
    encode_run_head,
    plan_runs,
)
from kvpilot.runtime.engine.runner import KVGeometry, allocate_kv_cache


def _best_ms(fn: Callable[[], object], repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return round(best * 1000, 2)


def profile(kv_cache_dtype: str, block_tokens: int, repeats: int) -> dict[str, Any]:
    dtype = quant.storage_dtype(kv_cache_dtype, torch.float32, "cpu")
    geo = KVGeometry(num_layers=30, num_kv_heads=3, head_dim=64, block_size=16, dtype=dtype)
    n = block_tokens // geo.block_size
    src = allocate_kv_cache(geo, n + 8, torch.device("cpu"), tiled=True)
    dst = allocate_kv_cache(geo, n + 8, torch.device("cpu"), tiled=True)
    for layer in src:
        for t in (layer.k, layer.v, layer.k_scale, layer.v_scale):
            if t is not None:  # any bits (int8 / fp8 / fp16 scales: small integers' bit patterns)
                bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()]
                t.view(bits).random_(0, 127)
    layout = layout_of(geo, "profile")
    ids = list(range(3, 3 + n))
    runs = plan_runs(layout, 0, n)
    header = StreamHeader(layout, block_tokens + 1, 0, n)
    datas = [export_run(src[r.layer], ids[r.first_block : r.first_block + r.num_blocks]) for r in runs]
    raw = b"".join([encode_header(header), *(b for r, d in zip(runs, datas, strict=True) for b in (encode_run_head(r, d), d)),
                    encode_end(len(runs), sum(len(d) for d in datas))])  # fmt: skip
    decoded = decode_stream(raw, layout, 0, n)
    writable = [memoryview(bytearray(r.data)) for r in decoded.runs]  # as the pull receives them

    def gather() -> None:
        for r in runs:
            export_run(src[r.layer], ids[r.first_block : r.first_block + r.num_blocks])

    def checksum() -> None:
        for d in datas:
            zlib.crc32(d)

    def put() -> None:
        for r, data in zip(decoded.runs, writable, strict=True):
            import_run(dst[r.run.layer], ids[r.run.first_block : r.run.first_block + r.run.num_blocks], data)

    put()
    assert all(torch.equal(dst[i].k[ids[0]], src[i].k[ids[0]]) for i in (0, geo.num_layers - 1))
    out = {
        "dtype": str(dtype).removeprefix("torch."),
        "blocks": n,
        "frames": len(runs),
        "stream_bytes": len(raw),
        "export_gather_ms": _best_ms(gather, repeats),
        "export_crc32_ms": _best_ms(checksum, repeats),
        "decode_check_ms": _best_ms(lambda: decode_stream(raw, layout, 0, n), repeats),
        "import_ms": _best_ms(put, repeats),
        "memcpy_ms": _best_ms(lambda: bytearray(raw), repeats),
    }
    return out
