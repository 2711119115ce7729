"""The request side of the OpenAI-compatible API: body parsing, request models, validation, and the
conversion of a request into what the engine runs (`prepare_completion` / `prepare_chat`).

Validation lives here and only here, in three steps that each name the parameter they refuse:
1. the pydantic models: types (strict mode: a string where a number belongs is an error, not a
   coercion) and value ranges as field constraints;
2. `validate_request()`: combinations and features this server does not implement;
3. `to_sampling_params()`: what depends on the prompt and the server (context length, KV pool).

Seams for new request features:
- a request field that changes how tokens are chosen becomes a field of `SamplingParams` (one per
  sequence, what the engine sees) in `SamplingFields.to_sampling_params`;
- a field that changes how output is turned into a response (tool calls, say) travels on
  `GenerationRequest` to the output processor and the renderers;
- `REFUSED_FIELDS` (refused_fields.py) lists the vLLM fields whose meaning is not implemented; implementing one means
  deleting its entry and adding the field to a model below.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from kvpilot.request_body import BodyError, parse_json_object
from kvpilot.runtime.engine.kv_transfer.params import (
    KVParamsError,
    RemoteDecode,
    RemotePrefill,
    parse_kv_transfer_params,
)
from kvpilot.runtime.engine.sampling_params import SamplingParams
from kvpilot.runtime.grammar.request import guided_spec
from kvpilot.runtime.grammar.structured_output import GuidedSpec, GuidedSpecError
from kvpilot.runtime.serving.errors import APIError
from kvpilot.runtime.serving.refused_fields import check_refused_fields
from kvpilot.runtime.serving.tool_calls import (
    Tool,
    ToolChoice,
    ToolError,
    guided_for_tools,
    parse_tool_choice,
    parse_tools,
)

MAX_N = 128
MAX_LOGPROBS = 20
MAX_CHOICES = 1024  # n * number of prompts in one request
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # torch's generator seeds; seed + choice index stays in range


class ChatTokenizer(Protocol):
    """What the API layer needs from runtime/load/tokenizer.py's Tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str: ...


# ----------------------------------------------------------------------------------------------
# Body parsing


def parse_json_body(body: bytes) -> dict[str, Any]:
    """The body as a dict, or APIError (400): the rules the router applies too (kvpilot/request_body.py)."""
    try:
        return parse_json_object(body)
    except BodyError as e:
        raise APIError(e.message, param=e.param) from None


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "function-after", "function-before"}
_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def _loc_to_param(loc: Sequence[int | str]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'; drops pydantic's union-member tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in _TYPE_TAGS or "[" in part or part[:1].isupper() or not part.replace("_", "a").isalnum():
            continue
        else:
            out += f".{part}" if out else part
    return out


def validation_error_to_api(e: ValidationError) -> APIError:
    err = e.errors(include_url=False)[0]
    param = _loc_to_param(err["loc"])
    msg = err["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if err["type"] == "missing":
        return APIError(f"'{param}' is a required parameter", param=param)
    if err["type"] == "extra_forbidden":
        return APIError(f"unrecognized parameter '{param}'", param=param)
    if err["type"] in _RANGE_ERRORS:  # "Input should be greater than 0" -> "'top_p' must be greater than 0"
        bound = msg.removeprefix("Input should be ")
        return APIError(f"'{param}' must be {bound}, got {err['input']!r}", param=param)
    return APIError(f"invalid value for '{param}': {msg}", param=param)


# ----------------------------------------------------------------------------------------------
# Requests


class _Strict(BaseModel):
    # allow_inf_nan: JSON has NaN/Infinity literals in Python's parser and 1e999 overflows to inf;
    # every float field refuses them (a NaN temperature would compare false with every bound).
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage (so far) in every chunk; needs include_usage

    @property
    def continuous(self) -> bool:
        return self.include_usage and self.continuous_usage_stats


class SamplingFields(_Strict):
    """Parameters shared by /v1/completions and /v1/chat/completions (OpenAI plus vLLM extras).
    Ranges are field constraints; `validate_request` checks what spans fields."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)  # 0 or -1 disables top-k
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # prefix caching: requests with different salts never share cached blocks (vLLM's name)
    cache_salt: str | None = Field(None, min_length=1, max_length=256)
    # structured output (OpenAI's response_format; vLLM's guided_* extras), checked in guided_spec()
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | bool | str | None = None  # JSON Schema allows true and false
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    _guided: GuidedSpec | None = PrivateAttr(None)  # set by validate_request()
    # prefill/decode disaggregation (docs/disaggregation.md; runtime/engine/kv_transfer/params.py)
    kv_transfer_params: dict[str, Any] | None = None
    _kv: RemoteDecode | RemotePrefill | None = PrivateAttr(None)  # set by validate_request()

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and any(s == "" for s in v):
            raise ValueError("stop strings must not be empty")
        return v

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous

    @property
    def prompt_param(self) -> str:
        """The parameter that carries the prompt, named in errors about its length."""
        return "prompt"

    def _requested_max_tokens(self) -> tuple[int | None, str]:
        return self.max_tokens, "max_tokens"

    def _logprobs(self) -> int | None:
        raise NotImplementedError

    def _prompt_logprobs(self) -> int | None:
        return None

    def check_model(self, served_name: str, adapters: Collection[str] = ()) -> str | None:
        """The LoRA adapter the request names in `model` (None: the base model); 404 for others."""
        if self.model is None or self.model == served_name:
            return None
        if self.model in adapters:
            return self.model
        also = f" and the LoRA adapters {sorted(adapters)}" if adapters else ""
        raise APIError(
            f"The model '{self.model}' does not exist; this server serves '{served_name}'{also}.",
            status=404,
            param="model",
            code="model_not_found",
        )

    def validate_request(self) -> None:
        """Checks that span fields, and features that are refused; subclasses add their own."""
        if self.logit_bias:
            raise APIError("'logit_bias' is not supported", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise APIError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        so = self.stream_options
        if so is not None and so.continuous_usage_stats and not so.include_usage:
            raise APIError(
                "'stream_options.continuous_usage_stats' requires 'stream_options.include_usage'",
                param="stream_options.continuous_usage_stats",
            )
        if self.stop_token_ids and any(t < 0 for t in self.stop_token_ids):
            raise APIError("'stop_token_ids' must be non-negative token ids", param="stop_token_ids")
        try:
            self._kv = parse_kv_transfer_params(self.kv_transfer_params)
        except KVParamsError as e:
            raise APIError(str(e), param=e.param) from None
        if isinstance(self._kv, RemoteDecode) and self.stream:
            raise APIError(
                "'kv_transfer_params' do_remote_decode answers one body: it needs 'stream' false",
                param="kv_transfer_params",
            )
        if isinstance(self._kv, RemoteDecode) and self.n != 1:
            raise APIError("'kv_transfer_params' do_remote_decode needs 'n' 1", param="kv_transfer_params")
        self._guided = self.guided_spec()
        if self._guided is not None and self.min_tokens > 0:
            # min_tokens bans EOS where the grammar may allow nothing else
            raise APIError("'min_tokens' cannot be combined with structured output", param="min_tokens")

    @property
    def kv_transfer(self) -> RemoteDecode | RemotePrefill | None:
        """The request's KV transfer (checked by validate_request)."""
        return self._kv

    def guided_spec(self) -> GuidedSpec | None:
        """The structured-output constraint the request asks for (checked: a bad schema, regex or
        grammar is a 400 naming the field and the problem)."""
        try:
            return guided_spec(
                {
                    "response_format": self.response_format,
                    "guided_json": self.guided_json,
                    "guided_regex": self.guided_regex,
                    "guided_choice": self.guided_choice,
                    "guided_grammar": self.guided_grammar,
                }
            )
        except GuidedSpecError as e:
            raise APIError(str(e), param=e.param) from None

    def to_sampling_params(
        self, prompt_len: int, max_model_len: int, kv_capacity: int | None = None
    ) -> SamplingParams:
        """Check the request against the prompt's length and build the engine's per-sequence
        parameters. `kv_capacity`: the tokens the whole KV pool holds (the longest sequence that can
        ever run), when known. Every request field that changes how the engine picks tokens is
        mapped here."""
        max_tokens, mt_param = self._requested_max_tokens()
        prompt_param = self.prompt_param
        if prompt_len >= max_model_len:
            raise APIError(
                f"This model's maximum context length is {max_model_len} tokens, but the prompt has "
                f"{prompt_len} tokens, which leaves no room for the completion. Please shorten the prompt.",
                param=prompt_param,
            )
        fits = max_model_len if kv_capacity is None else min(max_model_len, kv_capacity)
        if max_tokens is None:
            # vLLM's default: whatever fits, here in the context and in the KV pool
            if prompt_len >= fits:
                raise APIError(
                    f"the prompt has {prompt_len} tokens, but this server's KV cache holds at most {fits} "
                    "tokens for one request, which leaves no room for the completion. Please shorten the "
                    "prompt.",
                    param=prompt_param,
                )
            max_tokens = fits - prompt_len
        elif prompt_len + max_tokens > max_model_len:
            raise APIError(
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the "
                f"completion). Please reduce the prompt or '{mt_param}'.",
                param=mt_param,
            )
        elif prompt_len + max_tokens > fits:
            raise APIError(
                f"the request needs {prompt_len + max_tokens} tokens of KV cache ({prompt_len} in the prompt, "
                f"{max_tokens} in the completion), but this server's KV cache holds at most {fits} tokens "
                f"for one request. Please reduce the prompt or '{mt_param}'.",
                param=mt_param,
            )
        if self.min_tokens > max_tokens:
            raise APIError(
                f"'min_tokens' ({self.min_tokens}) must not exceed the completion's maximum of {max_tokens} "
                f"tokens ('{mt_param}' or what fits after the prompt)",
                param="min_tokens",
            )
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k is None else self.top_k,
            min_p=0.0 if self.min_p is None else self.min_p,
            seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            logprobs=self._logprobs(),
            prompt_logprobs=self._prompt_logprobs(),
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            guided=self._guided,
        )


class CompletionRequest(SamplingFields):
    prompt: Any = None  # str | list[str] | list[int] | list[list[int]], checked in prompt_list()
    max_tokens: int | None = Field(None, ge=0)  # 0: with echo, the prompt alone (scoring it)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM's
    suffix: str | None = None
    best_of: int | None = None

    def validate_request(self) -> None:
        super().validate_request()
        self.prompt_list()
        if self.suffix:
            raise APIError("'suffix' is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError("'best_of' is not supported (use 'n')", param="best_of")
        if self.max_tokens == 0 and not (self.echo and self.min_tokens == 0):
            raise APIError("'max_tokens' 0 asks for the prompt alone: it needs 'echo'", param="max_tokens")
        if self.prompt_logprobs is not None and self.stream:  # as vLLM
            raise APIError("'prompt_logprobs' is not available with 'stream'", param="prompt_logprobs")

    @property
    def echo_logprobs(self) -> bool:
        """Echo with logprobs: the prompt's tokens come first in the choice's logprobs."""
        return self.echo and self.logprobs is not None

    def _requested_max_tokens(self) -> tuple[int | None, str]:
        # max_tokens 0: the engine generates one token, which the response leaves out
        return (1 if self.max_tokens == 0 else self.max_tokens), "max_tokens"

    def _logprobs(self) -> int | None:
        return self.logprobs

    def _prompt_logprobs(self) -> int | None:
        ks = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(ks) if ks else None

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts as given: each is text or token ids. Each becomes n choices."""
        p = self.prompt
        if p is None:
            raise APIError("'prompt' is a required parameter", param="prompt")
        if isinstance(p, str):
            prompts: list[str | list[int]] = [p]
        elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
            prompts = list(p)
        elif isinstance(p, list) and p and all(_is_token_id(x) for x in p):
            prompts = [list(p)]
        elif (
            isinstance(p, list)
            and p
            and all(isinstance(x, list) and all(_is_token_id(t) for t in x) for x in p)
        ):
            prompts = [list(x) for x in p]
        elif isinstance(p, list) and not p:
            raise APIError("'prompt' must not be empty", param="prompt")
        else:
            raise APIError(
                "'prompt' must be a string, a list of strings, a list of token ids "
                "or a list of lists of token ids",
                param="prompt",
            )
        for i, one in enumerate(prompts):
            if len(one) == 0:
                where = "prompt" if len(prompts) == 1 else f"prompt[{i}]"
                raise APIError(f"'{where}' must not be empty", param="prompt")
        if len(prompts) * self.n > MAX_CHOICES:
            raise APIError(
                f"too many choices: {len(prompts)} prompts x n={self.n} exceeds {MAX_CHOICES}", param="n"
            )
        return prompts


def _is_token_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class TextContentPart(_Strict):
    type: str
    text: str | None = None


class FunctionCall(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class MessageToolCall(_Strict):
    """A call an earlier assistant turn made (the history of a tool-calling loop)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # role assistant
    tool_call_id: str | None = None  # role tool: the call this message answers

    def text(self, index: int) -> str:
        if self.content is None:
            if self.role == "assistant":
                return ""
            raise APIError(
                f"'messages[{index}].content' is required for role '{self.role}'",
                param=f"messages[{index}].content",
            )
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise APIError(
                    f"'messages[{index}].content[{j}]': only text content parts are supported, "
                    f"got type '{part.type}'",
                    param=f"messages[{index}].content[{j}].type",
                )
            texts.append(part.text)
        return "\n".join(texts)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(default_factory=list)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the last (assistant) turn stays open and goes on
    echo: bool = False  # vLLM's: prepend the last message; not implemented, refused when true
    _tools: list[Tool] = PrivateAttr(default_factory=list)  # set by validate_request()
    _tool_choice: ToolChoice = PrivateAttr(default_factory=lambda: ToolChoice("none"))

    @property
    def prompt_param(self) -> str:
        return "messages"

    def validate_request(self) -> None:
        super().validate_request()
        if not self.messages:
            raise APIError("'messages' must be a non-empty list", param="messages")
        # the legacy function-calling fields: use tools / tool_choice
        if self.functions:
            raise APIError(
                "'functions' is not supported (deprecated by OpenAI); use 'tools'", param="functions"
            )
        if self.function_call not in (None, "none"):
            raise APIError(
                "'function_call' is not supported (deprecated by OpenAI); use 'tool_choice'",
                param="function_call",
            )
        self._check_tools()
        if self.echo:
            raise APIError("'echo' is not supported for chat completions", param="echo")
        if self.continue_final_message:
            if self.add_generation_prompt:
                raise APIError(
                    "'continue_final_message' needs 'add_generation_prompt' false",
                    param="continue_final_message",
                )
            if self.messages[-1].role != "assistant" or self.uses_tools:
                raise APIError(
                    "'continue_final_message' continues a final assistant message, without tools",
                    param="continue_final_message",
                )
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError("'top_logprobs' requires 'logprobs' to be true", param="top_logprobs")

    def _check_tools(self) -> None:
        """tools / tool_choice -> the tool-call settings; `required` or a named function constrain
        the output with a grammar, which no other structured-output field may also do."""
        try:
            tools = parse_tools(self.tools) if self.tools is not None else []
            choice = parse_tool_choice(self.tool_choice, tools)
            if self.parallel_tool_calls is False:
                choice = replace(choice, parallel=False)
            spec = guided_for_tools(tools, choice)
        except ToolError as e:
            raise APIError(str(e), param=e.param) from None
        self._tools, self._tool_choice = tools, choice
        if spec is not None:
            if self._guided is not None:
                raise APIError(
                    f"'tool_choice' {choice.mode!r} constrains the output, so it cannot be combined with "
                    f"'{self._guided.param.split('.')[0]}'",
                    param="tool_choice",
                )
            if self.min_tokens > 0:
                raise APIError("'min_tokens' cannot be combined with structured output", param="min_tokens")
            self._guided = spec
        for i, m in enumerate(self.messages):
            if m.role == "tool" and not m.tool_call_id:
                raise APIError(
                    f"'messages[{i}].tool_call_id' is required for role 'tool'",
                    param=f"messages[{i}].tool_call_id",
                )
            if m.tool_calls is not None and m.role != "assistant":
                raise APIError(
                    f"'messages[{i}].tool_calls' is only allowed for role 'assistant'",
                    param=f"messages[{i}].tool_calls",
                )

    @property
    def tool_settings(self) -> tuple[list[Tool], ToolChoice]:
        return self._tools, self._tool_choice

    @property
    def uses_tools(self) -> bool:
        """Whether the prompt or the output involve tools (tools given, or tool turns in history)."""
        return bool(self._tools) or any(m.role == "tool" or m.tool_calls for m in self.messages)

    def _requested_max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def _logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for i, m in enumerate(self.messages):
            msg: dict[str, Any] = {"role": m.role, "content": m.text(i)}
            if m.name is not None:
                msg["name"] = m.name
            if m.tool_calls is not None:
                msg["tool_calls"] = [c.model_dump() for c in m.tool_calls]
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
        return out


def parse_request(body: bytes, kind: type[CompletionRequest] | type[ChatCompletionRequest]) -> Any:
    data = parse_json_body(body)
    check_refused_fields({k: v for k, v in data.items() if k not in kind.model_fields})
    try:
        req = kind.model_validate(data)
    except ValidationError as e:
        raise validation_error_to_api(e) from None
    req.validate_request()
    return req


def parse_completion_request(body: bytes) -> CompletionRequest:
    req: CompletionRequest = parse_request(body, CompletionRequest)
    return req


def parse_chat_request(body: bytes) -> ChatCompletionRequest:
    req: ChatCompletionRequest = parse_request(body, ChatCompletionRequest)
    return req


def check_token_ids(ids: Sequence[int], vocab_size: int | None, param: str) -> None:
    limit = vocab_size if vocab_size is not None else float("inf")
    bad = [t for t in ids if not 0 <= t < limit]
    if bad:
        raise APIError(f"'{param}' contains token id {bad[0]} outside the vocabulary", param=param)
