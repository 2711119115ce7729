"""The front end's part of prefill/decode disaggregation (docs/disaggregation.md): the role checks of
`kv_transfer_params`, the decode side's pull (off the engine loop, within `--kv-transfer-timeout`,
bounded in bytes), and the prefill side's `GET` / `DELETE /v1/kv/transfers/{id}`. Torch-free: the KV
tensors are read through the engine's `KVTransferPort` (runtime/engine/protocol.py).

A decode request never fails because of its transfer: any fault is counted and the prompt is
computed here instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from typing import Any

import aiohttp
from aiohttp import web

from kvpilot.runtime.engine.kv_transfer.client import ByteBudget, PullError, new_session, pull_ranks, release
from kvpilot.runtime.engine.kv_transfer.params import FIELD, RemoteDecode, RemotePrefill
from kvpilot.runtime.engine.kv_transfer.wire import (
    CONTENT_TYPE,
    KVLayout,
    Run,
    StreamHeader,
    encode_end,
    encode_header,
    encode_run_head,
    plan_runs,
    stream_length,
    transfer_blocks,
)
from kvpilot.runtime.engine.protocol import Engine, KVExport, KVImport, KVTransferPort, TransferReader
from kvpilot.runtime.serving.errors import APIError
from kvpilot.runtime.serving.metrics import ServerMetrics
from kvpilot.runtime.serving.prepare import GenerationRequest

log = logging.getLogger("kvpilot.server")

Spawn = Callable[[Coroutine[Any, Any, Any]], None]


def run_frame(reader: TransferReader, run: Run, rank: int) -> tuple[bytes, memoryview]:
    """One BLOCKS frame of a transfer's tensor-parallel rank `rank`: (frame head and ids, data).
    Blocking (the gather and the checksum): call it off the event loop."""
    data = reader.export_run(run.layer, run.first_block, run.num_blocks, rank)
    return encode_run_head(run, data), data


def rank_layouts(layout: KVLayout) -> list[KVLayout]:
    """Pure: every tensor-parallel rank's layout, given rank 0's (the ranks hold equal head shards)."""
    return [replace(layout, tp_rank=rank) for rank in range(layout.tp_size)]


def pull_bytes(layout: KVLayout, num_blocks: int) -> int:
    """The blocks' bytes, every rank's shard."""
    return num_blocks * layout.num_layers * layout.block_payload_bytes * layout.tp_size


def early_mismatch(kv: RemotePrefill, layout: KVLayout, num_prompt_tokens: int) -> str | None:
    """Pure: why the offered blocks cannot fit this pod, known before any pull (None: they may)."""
    if kv.model_fingerprint != layout.model_fingerprint:
        return "the prefill pod runs another model (or other weights' settings)"
    if kv.block_size != layout.block_size:
        return f"block size {kv.block_size}, this pod uses {layout.block_size}"
    if kv.kv_cache_dtype != layout.dtype:
        return f"KV dtype {kv.kv_cache_dtype}, this pod stores {layout.dtype}"
    if kv.num_tokens != num_prompt_tokens:
        return f"the transfer holds {kv.num_tokens} prompt tokens, this request has {num_prompt_tokens}"
    return None


class KVTransferFront:
    def __init__(self, metrics: ServerMetrics, api_key: str | None, spawn: Spawn) -> None:
        self.metrics = metrics
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._spawn = spawn
        self._session: aiohttp.ClientSession | None = None
        self._budget: ByteBudget | None = None

    def add_routes(self, app: web.Application, require_engine: Callable[[], Engine]) -> None:
        self._require_engine = require_engine
        app.router.add_get("/v1/kv/transfers/{transfer_id}", self.get_transfer)
        app.router.add_delete("/v1/kv/transfers/{transfer_id}", self.delete_transfer)
        app.on_cleanup.append(self._close)

    async def _close(self, app: web.Application) -> None:
        if self._session is not None:
            await self._session.close()

    # -- requests with kv_transfer_params ------------------------------------------------------
    async def prepare(self, engine: Engine, gen: GenerationRequest) -> GenerationRequest:
        """Check the request's transfer against this pod's role and, on the decode side, pull the
        blocks: the request with what its first choice hands the engine (gen.engine_kv)."""
        kv = gen.kv_transfer
        if kv is None:
            return gen
        port = engine.kv_transfer
        if port is None:
            raise APIError(f"'{FIELD}': this server's engine does not transfer KV blocks", param=FIELD)
        if isinstance(kv, RemoteDecode):
            if port.role == "decode":
                raise APIError(
                    f"'{FIELD}' do_remote_decode: this pod runs --kv-role decode; send prefills to a "
                    "prefill (or both) pod",
                    param=FIELD,
                )
            return replace(gen, engine_kv=KVExport())
        if port.role == "prefill":
            raise APIError(
                f"'{FIELD}' do_remote_prefill: this pod runs --kv-role prefill; send decodes to a "
                "decode (or both) pod",
                param=FIELD,
            )
        return replace(gen, engine_kv=await self._pull(port, gen, kv))

    def _fallback(self, reason: str, failed: bool = True) -> None:
        if failed:
            self.metrics.kv_failure(reason)
        self.metrics.kv_fallback(reason)

    async def _pull(self, port: KVTransferPort, gen: GenerationRequest, kv: RemotePrefill) -> KVImport | None:
        prompt = gen.prompts[0].token_ids
        layout = port.layout
        url = kv.transfer_url()
        if gen.prompt_logprobs is not None or gen.echo_logprobs:  # every prompt position runs here
            self._fallback("prompt_logprobs", failed=False)
            self._release(url)
            return None
        why = early_mismatch(kv, layout, len(prompt))
        if why is not None:
            log.warning("KV transfer %s not pulled: %s", kv.transfer_id, why)
            self._fallback("mismatch")
            self._release(url)
            return None
        total = transfer_blocks(len(prompt), layout.block_size)
        have = port.cached_prefix_blocks(prompt, gen.cache_salt, gen.lora)
        if have >= total:  # this pod's prefix cache holds them all: nothing to pull
            self._release(url)
            return None
        deadline = time.monotonic() + port.timeout
        budget = self._pull_budget(port)
        done: Callable[[], None] | None = None
        started = time.monotonic()
        try:
            done = await budget.acquire(pull_bytes(layout, total - have), deadline)
            # one stream per tensor-parallel rank, each that rank's heads, side by side
            layouts = rank_layouts(layout)
            decoded = await pull_ranks(
                self._client(), url, have, total - have, layouts, deadline, self._headers
            )
        except PullError as e:
            if done is not None:
                done()
            log.warning(
                "KV transfer %s failed (%s): %s; computing the prompt here", kv.transfer_id, e.reason, e
            )
            self._fallback(e.reason)
            self._release(url)
            return None
        self.metrics.kv_transfer_seconds.observe(time.monotonic() - started)
        self.metrics.kv_bytes_received.inc(sum(d.data_bytes for d in decoded))
        self._release(url)
        return KVImport(have, total - have, [d.runs for d in decoded], done)

    def _release(self, url: str) -> None:
        self._spawn(release(self._client(), url, self._headers))

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = new_session()
        return self._session

    def _pull_budget(self, port: KVTransferPort) -> ByteBudget:
        if self._budget is None:  # pulled blocks held at once: at most a pool's worth
            engine = self._require_engine()
            blocks = engine.kv_capacity_tokens // port.layout.block_size
            self._budget = ByteBudget(pull_bytes(port.layout, blocks))
        return self._budget

    def response_params(self, params: dict[str, Any] | None, base_url: str) -> dict[str, Any] | None:
        """The prefill response's kv_transfer_params (None: not pinned, counted)."""
        if params is None:
            self.metrics.kv_failure("pin_capacity")
            return None
        return {**params, "remote_url": base_url}

    def observe_engine_fallback(self, reason: str) -> None:
        """The engine could not use pulled blocks (RequestOutput.kv_fallback)."""
        self._fallback(reason, failed=False)

    # -- the prefill side's endpoints ----------------------------------------------------------
    def _port(self) -> KVTransferPort:
        port = self._require_engine().kv_transfer
        if port is None or port.role == "decode":
            raise APIError("this pod serves no KV transfers", status=404, type="not_found_error")
        return port

    @staticmethod
    def _query_int(request: web.Request, name: str) -> int:
        raw = request.query.get(name, "0")
        if not raw.isdigit() or len(raw) > 9:
            raise APIError(f"'{name}' must be a non-negative integer", param=name)
        return int(raw)

    async def get_transfer(self, request: web.Request) -> web.StreamResponse:
        port = self._port()
        layout = port.layout
        first = self._query_int(request, "from_block")
        rank = self._query_int(request, "rank")
        if rank >= layout.tp_size:
            raise APIError(
                f"this pod has {layout.tp_size} tensor-parallel rank(s): 'rank' 0..{layout.tp_size - 1}",
                status=404,
                type="not_found_error",
                param="rank",
            )
        layout = replace(layout, tp_rank=rank)
        with port.open_transfer(request.match_info["transfer_id"]) as reader:
            if reader is None:
                raise APIError("unknown, released or expired KV transfer", status=404, type="not_found_error")
            if first > reader.num_blocks:
                raise APIError(
                    f"'from_block' is past the transfer's {reader.num_blocks} blocks", param="from_block"
                )
            header = StreamHeader(layout, reader.num_tokens, first, reader.num_blocks - first)
            runs = plan_runs(layout, first, header.num_blocks)
            resp = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE})
            resp.content_length = stream_length(header, runs)  # one body, not HTTP chunks
            await resp.prepare(request)
            await resp.write(encode_header(header))
            data = await self._write_runs(resp, reader, runs, rank)
            await resp.write(encode_end(len(runs), data))
            await resp.write_eof()
        self.metrics.kv_bytes_sent.inc(data)
        return resp

    @staticmethod
    async def _write_runs(
        resp: web.StreamResponse, reader: TransferReader, runs: list[Run], rank: int
    ) -> int:
        """Write the BLOCKS frames, each gathered and checksummed in a worker thread while the one
        before it is being sent; the data bytes written."""
        if not runs:
            return 0
        ahead = asyncio.ensure_future(asyncio.to_thread(run_frame, reader, runs[0], rank))
        data = 0
        try:
            for i in range(len(runs)):
                head, payload = await ahead
                if i + 1 < len(runs):
                    ahead = asyncio.ensure_future(asyncio.to_thread(run_frame, reader, runs[i + 1], rank))
                await resp.write(head)
                await resp.write(payload)
                data += len(payload)
        finally:
            if not ahead.done():  # the client left mid-stream: let the gather end before the pin closes
                await asyncio.gather(ahead, return_exceptions=True)
        return data

    async def delete_transfer(self, request: web.Request) -> web.Response:
        port = self._port()
        transfer_id = request.match_info["transfer_id"]
        if not port.release_transfer(transfer_id):
            raise APIError("unknown, released or expired KV transfer", status=404, type="not_found_error")
        return web.json_response({"id": transfer_id, "object": "kv_transfer", "released": True})
