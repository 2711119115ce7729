"""vLLM request fields this server does not implement, and the check that refuses them by name."""

from __future__ import annotations

from typing import Any

from kvpilot.runtime.serving.errors import APIError

# vLLM request fields whose meaning this server does not implement. A client that sends one expects
# it to act (constrain, adapt, truncate, reshape the output); dropping it silently would return
# plausible but wrong results, so a request carrying one with a value other than those listed as
# neutral is refused with a 400 naming the field, unless the request's model implements it.
# Keep this the single list; docs/runtime.md mirrors it.
REFUSED_FIELDS: dict[str, tuple[str, tuple[Any, ...]]] = {
    # name: (what it is, values that ask for nothing and are accepted)
    # guided_json/regex/choice/grammar and response_format are implemented (runtime/grammar/request.py)
    "guided_whitespace_pattern": ("a guided-decoding whitespace pattern", (None,)),
    "guided_decoding_backend": ("a guided-decoding backend other than xgrammar", (None, "xgrammar")),
    "structured_outputs": ("vLLM's structured_outputs object (use guided_* or response_format)", (None,)),
    "logits_processors": ("custom logits processors", (None, [])),
    "lora_request": ("a vLLM LoRARequest object; name the adapter in 'model' instead", (None,)),
    "prompt_logprobs": ("prompt logprobs on chat completions; /v1/completions has them", (None,)),
    "allowed_token_ids": ("allowed token ids", (None,)),
    "bad_words": ("bad words", (None, [])),
    "use_beam_search": ("beam search", (None, False)),
    "length_penalty": ("beam search", (None, 1, 1.0)),
    "truncate_prompt_tokens": ("prompt truncation", (None,)),
    "return_tokens_as_token_ids": ("token-id output", (None, False)),
    "return_token_ids": ("token-id output", (None, False)),
    "spaces_between_special_tokens": ("special-token spacing control", (None, True)),
    "add_special_tokens": ("special-token control of the prompt", (None,)),
    "chat_template": ("a per-request chat template", (None,)),
    "chat_template_kwargs": ("chat template arguments", (None, {})),
    "documents": ("documents for the chat template", (None, [])),
    "mm_processor_kwargs": ("multimodal input", (None, {})),
    "prompt_embeds": ("prompt embeddings", (None,)),
    "priority": ("priority scheduling", (None, 0)),
    "vllm_xargs": ("vLLM extension arguments", (None, {})),
    "reasoning_effort": ("reasoning control", (None,)),
    "modalities": ("output modalities other than text", (None, ["text"])),
    "audio": ("audio output", (None,)),
}


def check_refused_fields(data: dict[str, Any]) -> None:
    for name, value in data.items():
        entry = REFUSED_FIELDS.get(name)
        if entry is None:
            continue
        what, neutral = entry
        # compare types too: True == 1 in Python, but `"priority": true` is not the neutral 0
        if any(value == v and type(v) is type(value) for v in neutral):
            continue
        raise APIError(f"'{name}' ({what}) is not supported by this server", param=name)
