"""Prefill/decode disaggregation: the KV transfer between pods (docs/disaggregation.md).

- `wire.py`: the framed, versioned, checksummed byte stream (pure, torch-free);
- `params.py`: the `kv_transfer_params` request and response field (torch-free);
- `pins.py`: the prefill side's pinned transfers, their TTL and cap (torch-free);
- `blocks.py`: a KV pool's logical block content to and from frame payloads (torch);
- `client.py`: the decode side's pull, with a deadline and a byte bound (torch-free, aiohttp).
"""
