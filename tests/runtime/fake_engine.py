"""Test doubles for the server-protocol tests ONLY: a small byte-level BPE tokenizer and a fake engine
that implements the `Engine` contract (runtime/engine/protocol.py) the server talks to. Real end-to-end tests use the real
engine and the SmolLM2 model.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from kvpilot.runtime.engine.protocol import (
    HEALTHY,
    CompletionOutput,
    EngineHealth,
    EngineStats,
    KVExport,
    KVImport,
    KVTransferPort,
    QueueFullError,
    RequestMetrics,
    RequestOutput,
    TokenLogprob,
)
from kvpilot.runtime.engine.sampling_params import SamplingParams
from kvpilot.runtime.grammar.structured_output import CompiledGuided, GuidedSpec, GuidedSpecError
from kvpilot.runtime.lora.errors import LoRAError
from kvpilot.runtime.lora.request import LoadedAdapter

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "Hello world! héllo wörld, naïve café. 日本語のテキスト。中文文本 🤖🚀👍🏽 emoji ✓ — “quotes”",
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Ελληνικά κείμενο, русский текст, עברית, العربية, हिन्दी, 한국어",
    "kvpilot serves models with paged attention and prefix caching. STOP here. The end.",
]


@functools.cache
def bpe_tokenizer(vocab_size: int = 400) -> Tokenizer:
    """A GPT-2-style byte-level BPE whose merges split multi-byte characters across tokens."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    return tok


class FakeTokenizer:
    """The slice of runtime/load/tokenizer.py's Tokenizer the server uses."""

    def __init__(self) -> None:
        self._tok = bpe_tokenizer()
        self.eos_token_ids = [self._tok.token_to_id("<|im_end|>"), self._tok.token_to_id("<|endoftext|>")]
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        parts = [f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages]
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)


@dataclass
class FakeStats:
    kv_cache_usage: float = 0.25
    num_running: int = 0
    num_waiting: int = 0
    num_preemptions: int = 3
    prefix_cache_queries: int = 100
    prefix_cache_hits: int = 40
    oom_recoveries: int = 1


@dataclass
class FakeEngine:
    """Generates a fixed script of text token by token (`script`), cycling, with `delay` s per token.

    The starting point in the script depends on the seed, so different seeds give different text.
    """

    script: str = "Hello world! This is kvpilot speaking. 日本語 🤖 STOP and more text after the stop. "
    delay: float = 0.0
    max_model_len: int = 256
    model_name: str = "fake-model"
    max_waiting: int | None = None  # add_request raises QueueFullError past this many unfinished
    max_queue_len: int = 1024  # the server refuses requests with more choices than this (400)
    kv_capacity_tokens: int = 1 << 20  # the whole KV pool; max_tokens defaults to what fits
    kv_transfer: KVTransferPort | None = None  # no KV blocks to transfer: kv_transfer_params is a 400
    tokenizer: FakeTokenizer = field(default_factory=FakeTokenizer)
    added: list[tuple[str, list[int], SamplingParams]] = field(default_factory=list)
    aborted: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    started: bool = False
    shut_down: bool = False
    _live: set[str] = field(default_factory=set)
    _abort_events: dict[str, asyncio.Event] = field(default_factory=dict)

    def start(self) -> None:
        self.started = True

    async def shutdown(self, timeout: float = 30.0) -> None:
        self.shut_down = True

    def num_unfinished(self) -> int:
        return len(self._live)

    def stats(self) -> EngineStats:
        f = FakeStats(num_running=len(self._live))
        return EngineStats(
            model_name=self.model_name,
            kv_cache_usage=f.kv_cache_usage,
            num_running=f.num_running,
            num_waiting=f.num_waiting,
            num_blocks=100,
            block_size=16,
            num_preemptions=f.num_preemptions,
            prefix_cache_queries=f.prefix_cache_queries,
            prefix_cache_hits=f.prefix_cache_hits,
            oom_recoveries=f.oom_recoveries,
            prompt_tokens=0,
            generation_tokens=0,
            num_steps=0,
            kv_transfers_pending=0,
        )

    def health(self) -> EngineHealth:
        return HEALTHY

    @property
    def loras(self) -> list[LoadedAdapter]:
        return []

    @property
    def lora_enabled(self) -> bool:
        return False

    async def add_lora(self, name: str, path: str) -> None:
        raise LoRAError("the test engine serves no adapters")

    async def remove_lora(self, name: str) -> None:
        raise LoRAError("the test engine serves no adapters")

    async def compile_grammar(self, spec: GuidedSpec) -> CompiledGuided:
        raise GuidedSpecError("response_format", "the test engine compiles no grammars")

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        ev = self._abort_events.get(request_id)
        if ev is not None:
            ev.set()

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        lora: str | None = None,
        kv: KVExport | KVImport | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if kv is not None:
            raise ValueError("the test engine transfers no KV blocks")
        if lora is not None:
            raise ValueError(f"the test engine serves no adapter {lora!r}")
        self.last_cache_salt = cache_salt
        if len(prompt_token_ids) + 1 > self.max_model_len:
            raise ValueError("prompt too long")
        if self.max_waiting is not None and len(self._live) >= self.max_waiting:
            raise QueueFullError("queue full")
        if request_id in self._live:
            raise ValueError(f"duplicate request id {request_id}")
        self.added.append((request_id, list(prompt_token_ids), params))
        self._live.add(request_id)
        self._abort_events[request_id] = asyncio.Event()
        return self._generate(request_id, list(prompt_token_ids), params)

    async def _generate(
        self, request_id: str, prompt: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        script_ids = self.tokenizer.encode(self.script)
        offset = (params.seed or 0) % len(script_ids)
        stream = itertools.islice(itertools.cycle(script_ids), offset, None)
        generated: list[int] = []
        aborted = self._abort_events[request_id]
        try:
            while True:
                await asyncio.sleep(self.delay)
                if aborted.is_set():
                    yield self._out(request_id, prompt, [], None, "abort", None)
                    return
                tok = next(stream)
                generated.append(tok)
                finish, stop_reason = None, None
                if len(generated) >= params.min_tokens and tok in params.stop_token_ids:
                    finish, stop_reason = "stop", tok
                elif len(generated) >= params.max_tokens:
                    finish = "length"
                lp = None
                if params.logprobs is not None:
                    top = [(tok, -0.5), (0, -1.5), (1, -2.5)][: params.logprobs]
                    lp = [TokenLogprob(tok, -0.5, top)]
                yield self._out(request_id, prompt, [tok], lp, finish, stop_reason)
                if finish:
                    self.finished.append(request_id)
                    return
        finally:
            self._live.discard(request_id)

    @staticmethod
    def _out(
        rid: str,
        prompt: list[int],
        new: list[int],
        lp: list[TokenLogprob] | None,
        finish: str | None,
        stop_reason: int | str | None,
    ) -> RequestOutput:
        out = CompletionOutput(new, lp, finish, stop_reason)
        now = time.monotonic()
        return RequestOutput(
            rid, prompt, out, finish is not None, 0, RequestMetrics(now - 0.002, now - 0.001)
        )


class LiveServer:
    """Runs `serve()` with an `OpenAIServer` on 127.0.0.1 (random port) in a background thread,
    so both the sync and the async `openai` clients can talk to it from the test."""

    def __init__(
        self,
        engine: Any | None = None,
        api_key: str | None = None,
        shutdown_timeout: float = 5.0,
        load_engine: Any = None,
        model_name: str = "fake-model",
    ) -> None:
        from kvpilot.runtime.serving.server import OpenAIServer, ServerSettings

        self.engine = engine
        self.settings = ServerSettings(
            model_name=model_name, api_key=api_key, shutdown_timeout=shutdown_timeout
        )
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._ready = threading.Event()
        self.port = 0
        self.server: Any = self.call_sync(self._make_server(OpenAIServer))
        self._stop: asyncio.Event = self.call_sync(self._make_event())
        from kvpilot.runtime.serving.lifecycle import serve

        self._done = asyncio.run_coroutine_threadsafe(
            serve(
                self.server,
                "127.0.0.1",
                0,
                load_engine=load_engine,
                shutdown_timeout=shutdown_timeout,
                stop=self._stop,
                install_signals=False,
                on_listening=self._on_listening,
            ),
            self._loop,
        )
        if not self._ready.wait(10):
            raise RuntimeError("server did not start")

    async def _make_server(self, cls: Any) -> Any:
        return cls(self.settings, self.engine)

    @staticmethod
    async def _make_event() -> asyncio.Event:
        return asyncio.Event()

    def _on_listening(self, port: int) -> None:
        self.port = port
        self._ready.set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def call_sync(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def begin_shutdown(self) -> None:
        """What SIGTERM does."""
        self._loop.call_soon_threadsafe(self._stop.set)

    def wait_exit(self, timeout: float = 20.0) -> int:
        return int(self._done.result(timeout))

    def close(self) -> None:
        if not self._done.done():
            self.begin_shutdown()
            with contextlib.suppress(Exception):
                self.wait_exit()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        if not self._thread.is_alive():
            self._loop.close()
