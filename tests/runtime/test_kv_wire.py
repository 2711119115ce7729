"""The KV transfer's pure parts: the wire format (runtime/engine/kv_transfer/wire.py), the request
field (params.py) and the prefill side's pin table (pins.py)."""

from __future__ import annotations

import struct

import pytest

from kvpilot.runtime.engine.kv_transfer.params import (
    KVParamsError,
    RemoteDecode,
    RemotePrefill,
    parse_kv_transfer_params,
)
from kvpilot.runtime.engine.kv_transfer.pins import PinTable
from kvpilot.runtime.engine.kv_transfer.wire import (
    FRAME_HEAD_BYTES,
    KVLayout,
    StreamHeader,
    WireError,
    decode_stream,
    encode_block_head,
    encode_end,
    encode_header,
    encode_stream,
    layout_mismatch,
)

LAYOUT = KVLayout("fp", "int8", block_size=2, num_layers=3, num_kv_heads=2, head_dim=4)


def blocks(layout: KVLayout, first: int, n: int) -> list[list[bytes]]:
    size = layout.block_payload_bytes
    return [[bytes((layer * 31 + b * 7 + i) % 256 for i in range(size)) for b in range(first, first + n)]
            for layer in range(layout.num_layers)]  # fmt: skip


def stream(first: int = 1, n: int = 2, layout: KVLayout = LAYOUT) -> tuple[bytes, list[list[bytes]]]:
    data = blocks(layout, first, n)
    return encode_stream(StreamHeader(layout, 9, first, n), data), data


def test_round_trip_keeps_every_block_in_place() -> None:
    raw, data = stream()
    out = decode_stream(raw, LAYOUT, 1, 2)
    assert out.header.num_tokens == 9 and out.header.layout == LAYOUT
    assert [[bytes(b) for b in layer] for layer in out.blocks] == data
    # int8: K and V plus a float16 scale per (token, head) each
    assert LAYOUT.block_payload_bytes == 2 * (2 * 2 * 4 * 1 + 2 * 2 * 2)
    assert out.data_bytes == 3 * 2 * LAYOUT.block_payload_bytes


def test_every_flipped_payload_byte_fails_the_checksum() -> None:
    raw, _ = stream()
    header_len = FRAME_HEAD_BYTES + struct.unpack_from("<I", raw, 8)[0]
    first_block_payload = header_len + FRAME_HEAD_BYTES + 8
    for pos in (10 + FRAME_HEAD_BYTES, first_block_payload, len(raw) - 3):
        bad = bytearray(raw)
        bad[pos] ^= 0x40
        with pytest.raises(WireError) as e:
            decode_stream(bytes(bad), LAYOUT, 1, 2)
        assert e.value.reason == "checksum", pos


@pytest.mark.parametrize(
    ("mutate", "reason"),
    [
        (lambda raw: raw[:-5], "truncated"),
        (lambda raw: raw[: len(raw) // 2], "truncated"),
        (lambda raw: raw + b"x", "protocol"),
        (lambda raw: b"XXXX" + raw[4:], "protocol"),
    ],
)
def test_cut_or_garbled_streams_are_refused(mutate: object, reason: str) -> None:
    raw, _ = stream()
    with pytest.raises(WireError) as e:
        decode_stream(mutate(raw), LAYOUT, 1, 2)  # type: ignore[operator]
    assert e.value.reason == reason


def test_blocks_out_of_order_or_other_than_asked_are_refused() -> None:
    data = blocks(LAYOUT, 1, 2)
    header = StreamHeader(LAYOUT, 9, 1, 2)
    with pytest.raises(WireError) as e:  # the header says blocks 1..2, the reader asked for 0..1
        decode_stream(encode_stream(header, data), LAYOUT, 0, 2)
    assert e.value.reason == "mismatch"
    parts = [encode_header(header)]
    for layer in range(LAYOUT.num_layers):
        for block in (2, 1):  # each frame intact, the order wrong
            payload = data[layer][block - 1]
            parts += [encode_block_head(layer, block, payload), payload]
    parts.append(encode_end(6, 6 * LAYOUT.block_payload_bytes))
    with pytest.raises(WireError) as e:
        decode_stream(b"".join(parts), LAYOUT, 1, 2)
    assert e.value.reason == "protocol"


@pytest.mark.parametrize(
    "field", ["model_fingerprint", "dtype", "block_size", "num_layers", "num_kv_heads", "head_dim", "tp_size"]
)
def test_a_layout_that_differs_in_anything_is_a_mismatch(field: str) -> None:
    other = {
        "model_fingerprint": "other",
        "dtype": "float8_e4m3fn",
        "block_size": 4,
        "num_layers": 2,
        "num_kv_heads": 1,
        "head_dim": 8,
        "tp_size": 2,
    }
    remote = KVLayout(**{**LAYOUT.__dict__, field: other[field]})
    assert layout_mismatch(remote, LAYOUT) is not None
    raw = encode_stream(StreamHeader(remote, 9, 0, 0), [[] for _ in range(remote.num_layers)])
    with pytest.raises(WireError) as e:
        decode_stream(raw, LAYOUT, 0, 0)
    assert e.value.reason == "mismatch"


def test_params_parse_both_kinds_and_refuse_what_they_cannot_do() -> None:
    assert parse_kv_transfer_params(None) is None
    assert parse_kv_transfer_params({}) is None
    assert parse_kv_transfer_params({"do_remote_decode": True}) == RemoteDecode()
    ok = {
        "do_remote_prefill": True,
        "transfer_id": "ab12",
        "num_tokens": 40,
        "block_size": 16,
        "kv_cache_dtype": "float32",
        "model_fingerprint": "f",
        "remote_url": "http://10.0.0.1:8000",
    }
    p = parse_kv_transfer_params(ok)
    assert isinstance(p, RemotePrefill) and p.transfer_url() == "http://10.0.0.1:8000/v1/kv/transfers/ab12"
    for bad, param in [
        ("x", "kv_transfer_params"),
        ({"do_remote_decode": True, "do_remote_prefill": True}, "kv_transfer_params"),
        ({"do_remote_decode": 1}, "kv_transfer_params.do_remote_decode"),
        ({**ok, "remote_engine_id": "e"}, "kv_transfer_params.remote_engine_id"),
        ({**ok, "transfer_id": "../../etc"}, "kv_transfer_params.transfer_id"),
        ({**ok, "remote_url": "file:///x"}, "kv_transfer_params.remote_url"),
        ({k: v for k, v in ok.items() if k != "remote_url"}, "kv_transfer_params.remote_url"),
        ({**ok, "num_tokens": 0}, "kv_transfer_params.num_tokens"),
        ({"do_remote_decode": True, "transfer_id": "a"}, "kv_transfer_params.transfer_id"),
    ]:
        with pytest.raises(KVParamsError) as e:
            parse_kv_transfer_params(bad)
        assert e.value.param == param, bad


def test_pins_expire_after_the_ttl_but_never_under_a_reader() -> None:
    now = [0.0]
    table = PinTable(max_blocks=10, ttl=30.0, clock=lambda: now[0])
    assert table.add("a", [1, 2, 3], 50) and table.add("b", [4], 20)
    assert not table.add("c", list(range(7)), 100)  # over the cap: 4 + 7 > 10
    assert table.pending == 2 and table.pinned_blocks == 4
    reader = table.open("a")
    assert reader is not None and table.open("zzz") is None
    now[0] = 31.0
    assert table.open("b") is None  # expired: no new reader
    assert table.take_freeable() == [[4]]  # "a" is being read: kept
    table.close(reader)
    assert table.take_freeable() == [[1, 2, 3]]
    assert table.pending == 0 and table.pinned_blocks == 0


def test_a_release_frees_once_and_then_is_unknown() -> None:
    table = PinTable(max_blocks=10, ttl=30.0, clock=lambda: 0.0)
    table.add("a", [1], 20)
    assert table.release("a") and not table.release("a")
    assert table.open("a") is None
    assert table.take_freeable() == [[1]] and table.take_freeable() == []
