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
    RUN_HEAD_BYTES,
    KVLayout,
    Run,
    StreamHeader,
    WireError,
    decode_stream,
    encode_end,
    encode_header,
    encode_run_head,
    encode_stream,
    layout_mismatch,
    plan_runs,
    stream_length,
)

LAYOUT = KVLayout("fp", "int8", block_size=2, num_layers=3, num_kv_heads=2, head_dim=4)


def data_of(layout: KVLayout, run: Run) -> bytes:
    size = run.num_blocks * layout.block_payload_bytes
    return bytes((run.layer * 31 + run.first_block * 7 + i) % 256 for i in range(size))


def stream(
    first: int = 1, n: int = 3, layout: KVLayout = LAYOUT, max_bytes: int = 2**20
) -> tuple[bytes, list[Run]]:
    runs = plan_runs(layout, first, n, max_bytes)
    return encode_stream(StreamHeader(layout, 9, first, n), [(r, data_of(layout, r)) for r in runs]), runs


def test_round_trip_keeps_every_run_in_place() -> None:
    raw, runs = stream()
    assert runs == [Run(layer, 1, 3) for layer in range(3)]  # one frame per layer when it fits
    out = decode_stream(raw, LAYOUT, 1, 3)
    assert out.header.num_tokens == 9 and out.header.layout == LAYOUT
    assert [r.run for r in out.runs] == runs
    assert [bytes(r.data) for r in out.runs] == [data_of(LAYOUT, r) for r in runs]
    # int8: K and V plus a float16 scale per (token, head) each
    assert LAYOUT.block_payload_bytes == 2 * (2 * 2 * 4 * 1 + 2 * 2 * 2)
    assert LAYOUT.run_parts(3) == [("k", 48), ("v", 48), ("k_scale", 24), ("v_scale", 24)]
    assert out.data_bytes == 3 * 3 * LAYOUT.block_payload_bytes
    header = StreamHeader(LAYOUT, 9, 1, 3)
    assert stream_length(header, runs) == len(raw)


def test_a_layer_cut_into_runs_is_read_whatever_the_cut() -> None:
    one_block = LAYOUT.block_payload_bytes
    assert plan_runs(LAYOUT, 1, 3, 2 * one_block + 1) == [
        Run(layer, first, n) for layer in range(3) for first, n in ((1, 2), (3, 1))
    ]
    assert plan_runs(LAYOUT, 0, 2, 1) == [
        Run(layer, b, 1) for layer in range(3) for b in (0, 1)
    ]  # >= 1 block
    for max_bytes in (1, 2 * one_block, 10**6):
        raw, runs = stream(max_bytes=max_bytes)
        out = decode_stream(raw, LAYOUT, 1, 3)
        assert [r.run for r in out.runs] == runs
        assert stream_length(StreamHeader(LAYOUT, 9, 1, 3), runs) == len(raw)


def test_every_flipped_payload_byte_fails_the_checksum() -> None:
    raw, _ = stream()
    header_len = FRAME_HEAD_BYTES + struct.unpack_from("<I", raw, 8)[0]
    first_run_data = header_len + RUN_HEAD_BYTES
    for pos in (10 + FRAME_HEAD_BYTES, first_run_data, first_run_data + 100, len(raw) - 3):
        bad = bytearray(raw)
        bad[pos] ^= 0x40
        with pytest.raises(WireError) as e:
            decode_stream(bytes(bad), LAYOUT, 1, 3)
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
        decode_stream(mutate(raw), LAYOUT, 1, 3)  # type: ignore[operator]
    assert e.value.reason == reason


def frames(runs: list[Run], end: tuple[int, int] | None = None) -> bytes:
    """A stream of intact frames carrying `runs` as given (right or wrong)."""
    parts = [encode_header(StreamHeader(LAYOUT, 9, 1, 3))]
    for r in runs:
        data = data_of(LAYOUT, r)
        parts += [encode_run_head(r, data), data]
    n = sum(r.num_blocks for r in runs)
    parts.append(encode_end(*(end or (len(runs), n * LAYOUT.block_payload_bytes))))
    return b"".join(parts)


@pytest.mark.parametrize(
    "runs",
    [
        [Run(layer, first, n) for layer in range(3) for first, n in ((2, 2), (1, 1))],  # order
        [Run(layer, 1, 3) for layer in (0, 2, 1)],  # layer order
        [Run(layer, first, n) for layer in range(3) for first, n in ((1, 2), (2, 2))],  # overlap
        [Run(layer, 1, 2) for layer in range(3)],  # a block missing
        [Run(layer, 1, 3) for layer in range(2)],  # a layer missing
        [Run(0, 1, 3), Run(0, 1, 3), Run(1, 1, 3), Run(2, 1, 3)],  # a layer twice
        [Run(layer, 1, 4) for layer in range(3)],  # more than asked
    ],
)
def test_runs_out_of_order_or_other_than_asked_are_refused(runs: list[Run]) -> None:
    with pytest.raises(WireError) as e:
        decode_stream(frames(runs), LAYOUT, 1, 3)
    assert e.value.reason == "protocol"


def test_the_end_frame_must_count_what_came() -> None:
    good = [Run(layer, 1, 3) for layer in range(3)]
    assert decode_stream(frames(good), LAYOUT, 1, 3).data_bytes == 9 * LAYOUT.block_payload_bytes
    with pytest.raises(WireError) as e:
        decode_stream(frames(good, end=(4, 9 * LAYOUT.block_payload_bytes)), LAYOUT, 1, 3)
    assert e.value.reason == "protocol"


def test_a_stream_of_other_blocks_than_asked_is_a_mismatch() -> None:
    raw, _ = stream(first=1)
    with pytest.raises(WireError) as e:  # the header says blocks 1..3, the reader asked for 0..2
        decode_stream(raw, LAYOUT, 0, 3)
    assert e.value.reason == "mismatch"


def test_a_version_1_stream_is_a_mismatch() -> None:
    raw = encode_stream(StreamHeader(LAYOUT, 9, 0, 0, version=1), [])
    with pytest.raises(WireError) as e:
        decode_stream(raw, LAYOUT, 0, 0)
    assert e.value.reason == "mismatch" and "version 1" in str(e.value)


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
    raw = encode_stream(StreamHeader(remote, 9, 0, 0), [])
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
