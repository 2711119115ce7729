"""The `kv_transfer_params` request field (docs/disaggregation.md), parsed and checked; torch-free.

- `{"do_remote_decode": true}`: a prefill request: run the prompt, pin its KV blocks, answer with the
  params a decode pod needs (`RemoteDecode`);
- `{"do_remote_prefill": true, "transfer_id": ..., "num_tokens": N, "block_size": B,
  "kv_cache_dtype": ..., "model_fingerprint": ..., "remote_url": "http://pod:port"}`: a decode request
  whose prompt blocks are pulled from `remote_url` (`RemotePrefill`);
- null, `{}` or both flags false: no transfer.

Unknown keys and wrong types are refused (a ValueError naming the key; the server answers 400).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

FIELD = "kv_transfer_params"
_TRANSFER_ID = re.compile(r"[A-Za-z0-9_-]{1,128}")
_PREFILL_KEYS = {
    "do_remote_prefill",
    "do_remote_decode",
    "transfer_id",
    "num_tokens",
    "block_size",
    "kv_cache_dtype",
    "model_fingerprint",
    "remote_url",
}


class KVParamsError(ValueError):
    def __init__(self, message: str, param: str = FIELD) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class RemoteDecode:
    """This pod runs the prompt; a decode pod generates."""


@dataclass(frozen=True)
class RemotePrefill:
    """A prefill pod ran the prompt; pull its blocks from `remote_url`."""

    transfer_id: str
    num_tokens: int
    block_size: int
    kv_cache_dtype: str
    model_fingerprint: str
    remote_url: str

    def transfer_url(self) -> str:
        return f"{self.remote_url.rstrip('/')}/v1/kv/transfers/{self.transfer_id}"


def _flag(d: dict[str, Any], key: str) -> bool:
    v = d.get(key, False)
    if not isinstance(v, bool):
        raise KVParamsError(f"'{FIELD}.{key}' must be a boolean", f"{FIELD}.{key}")
    return v


def _int(d: dict[str, Any], key: str) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise KVParamsError(f"'{FIELD}.{key}' must be a positive integer", f"{FIELD}.{key}")
    return v


def _str(d: dict[str, Any], key: str) -> str:
    v = d.get(key)
    if not isinstance(v, str) or not v or len(v) > 2048:
        raise KVParamsError(f"'{FIELD}.{key}' must be a non-empty string", f"{FIELD}.{key}")
    return v


def parse_kv_transfer_params(value: Any) -> RemoteDecode | RemotePrefill | None:
    """The request's transfer, or None; raises KVParamsError naming the key."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise KVParamsError(f"'{FIELD}' must be an object")
    unknown = sorted(set(value) - _PREFILL_KEYS)
    if unknown:
        raise KVParamsError(f"unrecognized parameter '{FIELD}.{unknown[0]}'", f"{FIELD}.{unknown[0]}")
    decode, prefill = _flag(value, "do_remote_decode"), _flag(value, "do_remote_prefill")
    if decode and prefill:
        raise KVParamsError(f"'{FIELD}' sets both do_remote_decode and do_remote_prefill")
    if decode:
        extra = sorted(set(value) - {"do_remote_decode", "do_remote_prefill"})
        if extra:
            raise KVParamsError(
                f"'{FIELD}.{extra[0]}' belongs to a do_remote_prefill request", f"{FIELD}.{extra[0]}"
            )
        return RemoteDecode()
    if not prefill:
        return None
    transfer_id = _str(value, "transfer_id")
    if not _TRANSFER_ID.fullmatch(transfer_id):
        raise KVParamsError(
            f"'{FIELD}.transfer_id' has characters other than A-Z a-z 0-9 _ -", f"{FIELD}.transfer_id"
        )
    url = _str(value, "remote_url") if "remote_url" in value else ""
    if not url:
        raise KVParamsError(
            f"'{FIELD}.remote_url' is required (the router fills it with the prefill pod's URL)",
            f"{FIELD}.remote_url",
        )
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise KVParamsError(f"'{FIELD}.remote_url' must be an http(s) base URL", f"{FIELD}.remote_url")
    return RemotePrefill(
        transfer_id,
        _int(value, "num_tokens"),
        _int(value, "block_size"),
        _str(value, "kv_cache_dtype"),
        _str(value, "model_fingerprint"),
        url,
    )
