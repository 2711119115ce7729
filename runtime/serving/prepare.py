"""Preparation: a parsed OpenAI request (runtime/serving/request.py), tokenized and checked against
what the server can run (`ServingLimits`), as the engine runs it: one `SamplingParams` per choice
(`prepare_completion` / `prepare_chat`)."""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from kvpilot.runtime.engine.kv_transfer.params import RemoteDecode, RemotePrefill
from kvpilot.runtime.engine.protocol import KVExport, KVImport
from kvpilot.runtime.engine.sampling_params import SamplingParams
from kvpilot.runtime.grammar.structured_output import CompiledGuided, GuidedSpec
from kvpilot.runtime.serving.errors import APIError
from kvpilot.runtime.serving.request import (
    ChatTokenizer,
    SamplingFields,
    check_token_ids,
    parse_chat_request,
    parse_completion_request,
)
from kvpilot.runtime.serving.tool_calls import (
    Tool,
    ToolChoice,
    render_chat,
)


@dataclass(frozen=True)
class ServingLimits:
    """What a request is checked against, from the engine."""

    max_model_len: int
    kv_capacity_tokens: int  # the whole KV pool: the longest sequence that can ever run
    max_queue_len: int  # a request with more choices than this could never be admitted
    vocab_size: int | None


@dataclass
class PromptInput:
    """One prompt of a request; it becomes `n` choices, each its own engine sequence."""

    token_ids: list[int]
    params: SamplingParams  # per prompt: the default max_tokens depends on its length
    echo_text: str = ""  # completions with echo: the prompt, put in front of each choice's text


@dataclass
class GenerationRequest:
    """A validated, tokenized request: what the output processor runs and the renderers answer."""

    kind: Literal["completion", "chat"]
    request_id: str
    prompts: list[PromptInput]
    n: int
    stream: bool
    include_usage: bool
    continuous_usage: bool
    cache_salt: str | None = None  # isolates this request's prefix-cache entries (per tenant)
    # chat with tools: the output is parsed into tool calls (runtime/serving/tool_calls.py)
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice | None = None
    lora: str | None = None  # the LoRA adapter named in `model` (None: the base model)
    # completions: echo's tokens lead the logprobs; vLLM's prompt_logprobs (k); max_tokens 0
    echo_logprobs: bool = False
    prompt_logprobs: int | None = None
    prompt_only: bool = False
    # disaggregation: what the request asks (kv_transfer_params), and what its first choice hands
    # the engine (runtime/serving/kv_transfer.py decides)
    kv_transfer: RemoteDecode | RemotePrefill | None = None
    engine_kv: KVExport | KVImport | None = None

    @property
    def num_choices(self) -> int:
        return self.n * len(self.prompts)

    @property
    def guided(self) -> GuidedSpec | None:
        """The request's structured-output constraint (one spec for all its prompts)."""
        return self.prompts[0].params.guided if self.prompts else None

    def with_compiled_grammar(self, compiled: CompiledGuided) -> GenerationRequest:
        """The same request with its constraint's compiled grammar attached for the engine."""
        prompts = []
        for p in self.prompts:
            assert p.params.guided is not None
            guided = p.params.guided.with_compiled(compiled)
            prompts.append(replace(p, params=replace(p.params, guided=guided)))
        return replace(self, prompts=prompts)


def _check_admissible(num_choices: int, limits: ServingLimits) -> None:
    """Each choice waits in the engine's queue; more than --max-queue-len can never be admitted
    (a 429 would be retried forever), so that is the client's error."""
    if num_choices > limits.max_queue_len:
        raise APIError(
            f"the request asks for {num_choices} choices (n x prompts), more than this server's "
            f"--max-queue-len of {limits.max_queue_len}; lower 'n' or split the request",
            param="n",
        )


def _params(req: SamplingFields, prompt_len: int, limits: ServingLimits) -> SamplingParams:
    params = req.to_sampling_params(prompt_len, limits.max_model_len, limits.kv_capacity_tokens)
    check_token_ids(params.stop_token_ids, limits.vocab_size, "stop_token_ids")
    return params


def prepare_completion(
    body: bytes,
    tokenizer: ChatTokenizer,
    limits: ServingLimits,
    served_name: str,
    adapters: Collection[str] = (),
) -> GenerationRequest:
    req = parse_completion_request(body)
    lora = req.check_model(served_name, adapters)
    prompts = req.prompt_list()
    _check_admissible(len(prompts) * req.n, limits)
    if req.kv_transfer is not None and len(prompts) != 1:
        raise APIError("'kv_transfer_params' needs a single prompt", param="kv_transfer_params")
    inputs: list[PromptInput] = []
    for prompt in prompts:
        if isinstance(prompt, str):
            ids = list(tokenizer.encode(prompt, add_special_tokens=True))
            if not ids:
                raise APIError("'prompt' encodes to zero tokens", param="prompt")
        else:
            ids = prompt
            check_token_ids(ids, limits.vocab_size, "prompt")
        echo = ""
        if req.echo:
            echo = prompt if isinstance(prompt, str) else tokenizer.decode(ids, skip_special_tokens=False)
        inputs.append(PromptInput(ids, _params(req, len(ids), limits), echo))
    return GenerationRequest(
        "completion",
        f"cmpl-{uuid.uuid4().hex}",
        inputs,
        req.n,
        req.stream,
        req.include_usage,
        req.continuous_usage,
        req.cache_salt,
        lora=lora,
        echo_logprobs=req.echo_logprobs,
        prompt_logprobs=req.prompt_logprobs,
        prompt_only=req.max_tokens == 0,
        kv_transfer=req.kv_transfer,
    )


_OPEN_TURN = "\x00kvpilot-open-turn\x00"


def _render_open_turn(tokenizer: ChatTokenizer, messages: list[dict[str, Any]]) -> str:
    """The conversation rendered up to the end of its last message's text: what follows it in the
    template (the end-of-turn tokens) is cut, so the model goes on with that message."""
    last = {**messages[-1], "content": messages[-1]["content"] + _OPEN_TURN}
    rendered = tokenizer.apply_chat_template([*messages[:-1], last], add_generation_prompt=False)
    if _OPEN_TURN not in rendered:
        raise ValueError("the template does not render the final message's text as given")
    return rendered[: rendered.rindex(_OPEN_TURN)]


def prepare_chat(
    body: bytes,
    tokenizer: ChatTokenizer,
    limits: ServingLimits,
    served_name: str,
    adapters: Collection[str] = (),
) -> GenerationRequest:
    req = parse_chat_request(body)
    lora = req.check_model(served_name, adapters)
    _check_admissible(req.n, limits)
    messages = req.template_messages()
    tools, tool_choice = req.tool_settings
    try:
        if req.uses_tools:  # the tools (and tool turns) through the template, or the fallback block
            rendered = render_chat(tokenizer, messages, tools, tool_choice, req.add_generation_prompt)
        elif req.continue_final_message:
            rendered = _render_open_turn(tokenizer, messages)
        else:
            rendered = tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt
            )
    except Exception as e:
        raise APIError(
            f"'messages' could not be formatted with the chat template: {e}", param="messages"
        ) from None
    # The template already has the special tokens (BOS) it wants.
    ids = list(tokenizer.encode(rendered, add_special_tokens=False))
    return GenerationRequest(
        "chat",
        f"chatcmpl-{uuid.uuid4().hex}",
        [PromptInput(ids, _params(req, len(ids), limits))],
        req.n,
        req.stream,
        req.include_usage,
        req.continuous_usage,
        req.cache_salt,
        tools,
        tool_choice if tool_choice.mode != "none" else None,
        lora=lora,
        kv_transfer=req.kv_transfer,
    )
