"""The output processor: runs a `GenerationRequest` on the engine and turns the engine's token
streams into per-choice text deltas. It knows nothing of HTTP.

Each of a request's choices (n per prompt, for each prompt of a batch) is its own engine request,
`{request_id}-{choice}`, with seed+choice when a seed is given; prefix caching makes the shared prompt
cheap. The engine streams of the choices are merged into one sequence of `Delta`s. Per choice, a
`TextStream` detokenizes and applies stop strings; when a stop string appears the choice is aborted in
the engine at once. Logprobs get their token text here, and the request metrics (TTFT, inter-token
latency, queue time, end-to-end latency, finish reasons, token counts) are observed here.

Per-request hook: `RequestState._process` sees every engine output of every choice (new token ids,
logprobs, finish reason) and produces that choice's `Delta`; a feature that post-processes generated
text per request (tool-call parsing, say) belongs there, keyed on a field of the `GenerationRequest`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvpilot.runtime.engine.protocol import Engine, EngineDeadError, QueueFullError
from kvpilot.runtime.engine.sampling_params import SamplingParams
from kvpilot.runtime.serving.detokenizer import TextStream
from kvpilot.runtime.serving.errors import APIError, engine_dead_error, queue_full_error
from kvpilot.runtime.serving.metrics import ServerMetrics
from kvpilot.runtime.serving.prepare import GenerationRequest
from kvpilot.runtime.serving.tool_calls import ToolCall, ToolCallStreamer

log = logging.getLogger("kvpilot.server")

# Logprobs can be -inf in float32; JSON has no infinity, so clamp like vLLM does.
MIN_LOGPROB = -9999.0

Spawn = Callable[[Coroutine[Any, Any, Any]], None]


@dataclass(frozen=True)
class TokenText:
    """How a token appears in logprobs: its text and its exact bytes."""

    text: str
    bytes: list[int]


# (token, logprob, top alternatives); None, None for the first token of an echoed prompt
LogprobEntry = tuple[TokenText, float | None, list[tuple[TokenText, float]] | None]


def clamp_logprob(lp: float) -> float:
    return lp if lp >= MIN_LOGPROB else MIN_LOGPROB


def choice_params(params: SamplingParams, choice: int) -> SamplingParams:
    """Each of the n choices is its own engine request, with seed+choice so that they differ."""
    return params if params.seed is None else replace(params, seed=params.seed + choice)


@dataclass
class Choice:
    """One choice's state while it generates."""

    index: int
    engine_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: TextStream
    echo_text: str = ""
    cache_salt: str | None = None  # isolates this request's prefix-cache entries (per tenant)
    lora: str | None = None  # the LoRA adapter it runs with (None: the base model)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    engine_done: bool = False  # the engine finished it (no abort needed)
    first_token_time: float | None = None
    last_token_time: float | None = None
    queue_time_seen: bool = False
    output_tokens: int = 0  # tokens generated so far (the output-length histogram)
    text_offset: int = 0  # where the next logprob token's text starts (completions' text_offset)
    logprobs: list[LogprobEntry] = field(default_factory=list)  # echo's first when echo_logprobs
    tools: ToolCallStreamer | None = None  # chat with tools: splits the text into content and calls
    echo_logprobs: bool = False  # completions' echo with logprobs
    prompt_logprobs_k: int | None = None  # vLLM's prompt_logprobs
    prompt_logprobs: list[dict[str, Any] | None] | None = None  # their response entries, once known
    prompt_only: bool = False  # max_tokens 0: the generated token is left out
    kv_transfer_params: dict[str, Any] | None = None  # a do_remote_decode request's, once finished

    @property
    def tool_calls(self) -> list[ToolCall]:
        return self.tools.calls if self.tools is not None else []

    @property
    def want_logprobs(self) -> bool:
        return self.params.logprobs is not None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class Delta:
    """What one engine output added to a choice: text, logprobs, and whether it finished."""

    choice: Choice
    text: str
    logprobs: list[LogprobEntry]
    text_offset: int  # where the first logprob token's text starts
    finished: bool
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # OpenAI tool_calls delta entries
    echo: str = ""  # a stream's echo with logprobs: the prompt, sent with its logprobs


class OutputMerger:
    """Interleaves the engine streams of several choices; one stream is read directly."""

    def __init__(self, streams: dict[int, AsyncIterator[Any]]) -> None:
        self._streams = streams
        self.open = set(streams)
        self._queue: asyncio.Queue[tuple[int, Any, BaseException | None]] = asyncio.Queue()
        self._tasks: dict[int, asyncio.Task[None]] = {}
        if len(streams) > 1:
            self._tasks = {i: asyncio.create_task(self._pump(i, s)) for i, s in streams.items()}

    async def _pump(self, index: int, stream: AsyncIterator[Any]) -> None:
        try:
            async for out in stream:
                self._queue.put_nowait((index, out, None))
            self._queue.put_nowait((index, None, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:
            self._queue.put_nowait((index, None, e))

    async def next(self) -> tuple[int, Any]:
        """(choice index, RequestOutput), or (index, None) when that stream ended."""
        if not self._tasks:
            (index,) = self.open
            try:
                return index, await anext(self._streams[index])
            except StopAsyncIteration:
                return index, None
        while True:
            index, out, exc = await self._queue.get()
            if index not in self.open:
                continue  # leftovers of a choice we already closed
            if exc is not None:
                raise exc
            return index, out

    async def close(self, index: int) -> None:
        self.open.discard(index)
        task = self._tasks.pop(index, None)
        if task is not None:
            task.cancel()
        else:
            await _aclose(self._streams[index])

    async def close_all(self) -> None:
        for index in list(self.open):
            await self.close(index)
        for task in self._tasks.values():
            task.cancel()


async def _aclose(stream: AsyncIterator[Any]) -> None:
    aclose: Callable[[], Awaitable[None]] | None = getattr(stream, "aclose", None)
    if aclose is not None:
        try:
            await aclose()
        except Exception:
            log.debug("closing an engine stream failed", exc_info=True)


class OutputProcessor:
    """Shared by all requests of one server: the metrics, the token-text cache of logprobs, and
    `spawn` (the server's way to run clean-up in the background)."""

    def __init__(self, metrics: ServerMetrics, spawn: Spawn) -> None:
        self.metrics = metrics
        self.spawn = spawn
        self._tokenizer: Any = None
        self._token_text: dict[int, TokenText] = {}

    def attach_tokenizer(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._token_text.clear()

    def new_request(self, engine: Engine, gen: GenerationRequest) -> RequestState:
        return RequestState(self, engine, gen)

    def logprob_entries(self, logprobs: Sequence[Any] | None) -> list[LogprobEntry]:
        if not logprobs:
            return []
        text = self.token_text
        return [
            (text(lp.token_id), clamp_logprob(lp.logprob), [(text(t), clamp_logprob(v)) for t, v in lp.top])
            for lp in logprobs
        ]

    def echo_entries(self, prompt: Sequence[int], lps: Sequence[Any], k: int) -> list[LogprobEntry]:
        """An echoed prompt's logprob entries (the engine's prompt logprobs, `k` alternatives each)."""
        text = self.token_text
        return [
            (text(t), None, None)
            if lp is None
            else (text(t), clamp_logprob(lp.logprob), [(text(a), clamp_logprob(v)) for a, v in lp.top[:k]])
            for t, lp in zip(prompt, lps, strict=True)
        ]

    def prompt_logprob_dicts(self, lps: Sequence[Any], k: int) -> list[dict[str, Any] | None]:
        """vLLM's prompt_logprobs: per prompt token None (the first) or {token id: {logprob, rank,
        decoded_token}} with the prompt token first, then its top `k` alternatives."""
        out: list[dict[str, Any] | None] = []
        for lp in lps:
            if lp is None:
                out.append(None)
                continue
            d = {str(lp.token_id): self._vllm_logprob(lp.token_id, lp.logprob, lp.rank)}
            for rank, (t, v) in enumerate(lp.top[:k], start=1):
                d.setdefault(str(t), self._vllm_logprob(t, v, rank))
            out.append(d)
        return out

    def _vllm_logprob(self, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {
            "logprob": clamp_logprob(logprob),
            "rank": rank,
            "decoded_token": self.token_text(token_id).text,
        }

    def token_text(self, token_id: int) -> TokenText:
        t = self._token_text.get(token_id)
        if t is None:
            tok = self._tokenizer
            text = tok.decode([token_id], skip_special_tokens=False)
            token_bytes = getattr(tok, "token_bytes", None)
            raw = token_bytes(token_id) if token_bytes is not None else text.encode("utf-8")
            t = TokenText(text, list(raw))
            self._token_text[token_id] = t
        return t


class RequestState:
    """One request's run: `submit()` its choices to the engine, iterate `deltas()`, and `close()`
    when done (always: it aborts whatever is still running in the engine)."""

    def __init__(self, processor: OutputProcessor, engine: Engine, gen: GenerationRequest) -> None:
        self.processor = processor
        self.engine = engine
        self.gen = gen
        self.arrival = time.monotonic()
        self.choices: list[Choice] = []
        for p_idx, prompt in enumerate(gen.prompts):
            for i in range(gen.n):
                index = p_idx * gen.n + i
                params = choice_params(prompt.params, i)
                self.choices.append(
                    Choice(
                        index=index,
                        engine_id=f"{gen.request_id}-{index}",
                        prompt_token_ids=prompt.token_ids,
                        params=params,
                        stream=TextStream(engine.tokenizer, params, prompt.token_ids),
                        echo_text=prompt.echo_text,
                        cache_salt=gen.cache_salt,
                        lora=gen.lora,
                        text_offset=0 if gen.echo_logprobs else len(prompt.echo_text),
                        tools=ToolCallStreamer(gen.tools, gen.tool_choice) if gen.tool_choice else None,
                        echo_logprobs=gen.echo_logprobs,
                        prompt_logprobs_k=gen.prompt_logprobs,
                        prompt_only=gen.prompt_only,
                    )
                )
        self._streams: dict[int, AsyncIterator[Any]] = {}
        # the engine could not use a request's pulled KV blocks (their reason): the server counts it
        self.on_kv_fallback: Callable[[str], None] = lambda reason: None
        self._merger: OutputMerger | None = None
        self._deltas: AsyncGenerator[Delta, None] | None = None

    @property
    def engine_ids(self) -> list[str]:
        return [c.engine_id for c in self.choices]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.gen.prompts)

    @property
    def completion_tokens(self) -> int:
        return sum(c.stream.num_tokens for c in self.choices)

    @property
    def aborted(self) -> bool:
        return any(c.finish_reason == "abort" for c in self.choices)

    def submit(self) -> None:
        """Add every choice to the engine; raises APIError (429 queue full, 503 engine dead, 400)."""
        metrics = self.processor.metrics
        for c in self.choices:
            self._streams[c.index] = self._submit(c)
            metrics.admitted_prompt_lengths.observe(len(c.prompt_token_ids))
        metrics.prompt_tokens.inc(self.prompt_tokens)
        self._merger = OutputMerger(self._streams)

    def _submit(self, c: Choice) -> AsyncIterator[Any]:
        kv = self.gen.engine_kv if c.index == 0 else None  # the KV transfer rides on the first choice
        try:
            return self.engine.add_request(
                c.engine_id, c.prompt_token_ids, c.params, cache_salt=c.cache_salt, lora=c.lora, kv=kv
            )
        except ValueError as e:  # (GuidedSpecError names its field)
            raise APIError(str(e), param=getattr(e, "param", "prompt")) from None
        except QueueFullError:
            raise queue_full_error() from None
        except EngineDeadError:
            raise engine_dead_error() from None

    def deltas(self) -> AsyncGenerator[Delta, None]:
        assert self._merger is not None, "submit() first"
        self._deltas = self._run(self._merger)
        return self._deltas

    async def _run(self, merger: OutputMerger) -> AsyncGenerator[Delta, None]:
        by_index = {c.index: c for c in self.choices}
        while merger.open:
            try:
                index, out = await merger.next()
            except EngineDeadError:
                raise engine_dead_error() from None
            except ValueError as e:  # the engine rejected the request after queueing it
                # (a grammar the engine could not compile names its field: GuidedSpecError.param)
                raise APIError(str(e), param=getattr(e, "param", "prompt")) from None
            c = by_index[index]
            if out is None:  # the stream ended without a finish reason: the engine dropped it
                delta = Delta(c, c.stream.finish(), [], c.text_offset, True)
                self._finish(c, "abort", None, engine_done=True)
            else:
                delta = self._process(c, out)
            if c.finished:
                await merger.close(index)
                if not c.engine_done:  # stopped by a stop string: free its engine slot now
                    c.engine_done = True
                    self.processor.spawn(self.engine.abort(c.engine_id))
            yield delta

    def _process(self, c: Choice, out: Any) -> Delta:
        """One engine output of one choice -> its delta (the per-request hook point)."""
        metrics = self.processor.metrics
        co = out.output
        new: list[int] = [] if c.prompt_only else list(co.new_token_ids)
        entries: list[LogprobEntry] = []
        echo = ""
        if out.prompt_logprobs is not None:
            if c.prompt_logprobs_k is not None:
                c.prompt_logprobs = self.processor.prompt_logprob_dicts(
                    out.prompt_logprobs, c.prompt_logprobs_k
                )
            if c.echo_logprobs:
                k = c.params.logprobs or 0
                entries = self.processor.echo_entries(c.prompt_token_ids, out.prompt_logprobs, k)
                echo = c.echo_text
        if out.kv_transfer_params is not None:
            c.kv_transfer_params = out.kv_transfer_params
        if out.kv_fallback is not None:
            self.on_kv_fallback(out.kv_fallback)
        now = time.monotonic()
        m = out.metrics
        if not c.queue_time_seen and m is not None and m.first_scheduled_time is not None:
            metrics.queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
            c.queue_time_seen = True
        if new:
            c.output_tokens += len(new)
            metrics.generation_tokens.inc(len(new))
            if c.first_token_time is None:
                c.first_token_time = now
                metrics.ttft.observe(now - self.arrival)
            elif c.last_token_time is not None:
                # Outputs may carry several tokens (the engine coalesces); spread the gap over them.
                per_token = (now - c.last_token_time) / len(new)
                for _ in new:
                    metrics.itl.observe(per_token)
            c.last_token_time = now
        text = c.stream.push(new)
        if c.want_logprobs and not c.prompt_only:
            entries += self.processor.logprob_entries(co.logprobs)
        if c.stream.stop_str is not None:
            self._finish(c, "stop", c.stream.stop_str, engine_done=co.finish_reason is not None)
        elif co.finish_reason is not None and c.prompt_only:
            self._finish(c, "length", None, engine_done=True)
        elif co.finish_reason is not None:
            text += c.stream.finish()
            self._finish(c, co.finish_reason, co.stop_reason, engine_done=True)
        offset = c.text_offset
        c.text_offset += sum(len(t.text) for t, _, _ in entries)
        c.logprobs.extend(entries)
        calls: list[dict[str, Any]] = []
        if c.tools is not None:
            part = c.tools.feed(text)
            text, calls = part.content, part.tool_calls
            if c.finished:
                end = c.tools.finish()
                text, calls = text + end.content, calls + end.tool_calls
                if c.tools.calls and c.finish_reason == "stop":
                    c.finish_reason = "tool_calls"
        return Delta(c, text, entries, offset, c.finished, calls, echo)

    def _finish(self, c: Choice, reason: str, stop_reason: int | str | None, engine_done: bool) -> None:
        c.finish_reason = reason
        c.stop_reason = stop_reason
        c.engine_done = engine_done
        metrics = self.processor.metrics
        metrics.request_finished(reason, c.output_tokens, len(c.prompt_token_ids))
        metrics.e2e.observe(time.monotonic() - self.arrival)

    def close(self) -> None:
        """Abort what still runs in the engine and release the streams (in the background)."""
        spawn = self.processor.spawn
        for c in self.choices:
            if c.index in self._streams and not c.engine_done:
                spawn(self.engine.abort(c.engine_id))
                if not c.finished:
                    c.finish_reason = "abort"
                    self.processor.metrics.request_finished("abort")
        if self._deltas is not None:
            spawn(self._deltas.aclose())
        if self._merger is not None:
            spawn(self._merger.close_all())
