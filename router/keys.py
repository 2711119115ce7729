"""Routing keys: the prompt's leading blocks as chained hashes, from a request body or token ids.

The router has no tokenizer, so its blocks are runs of `block_chars` characters of the prompt text
(64 characters are about 16 tokens, the runtime's KV block); the simulator, which has token ids, can
use `token_blocks`. Block i's hash covers blocks 0..i, so two prompts share block hashes exactly as
far as they share a prefix, which is what a pod's prefix cache reuses.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvpilot.router.policy import RouteKey, stable_hash

BLOCK_CHARS = 64
MAX_BLOCKS = 256  # about 4k tokens: the leading part is what decides prefix reuse
# A request's KV footprint estimate is capped (about 16M tokens, past any context window): the
# client's max_tokens is the pod's to validate, and an absurd one (10**4000) must not overflow the
# policies' float arithmetic.
MAX_FOOTPRINT_BLOCKS = 1 << 20


def chain_hashes(chunks: Sequence[bytes]) -> tuple[int, ...]:
    out: list[int] = []
    parent = 0
    for chunk in chunks:
        parent = stable_hash(parent.to_bytes(8, "big") + chunk)
        out.append(parent)
    return tuple(out)


def text_blocks(text: str, block_chars: int = BLOCK_CHARS, max_blocks: int = MAX_BLOCKS) -> tuple[int, ...]:
    """Hashes of the text's full blocks (a trailing partial block is not cacheable, as in the runtime)."""
    n = min(len(text) // block_chars, max_blocks)
    return chain_hashes(
        [text[i * block_chars : (i + 1) * block_chars].encode("utf-8", "replace") for i in range(n)]
    )


def token_blocks(
    tokens: Sequence[int], block_size: int = 16, max_blocks: int = MAX_BLOCKS
) -> tuple[int, ...]:
    n = min(len(tokens) // block_size, max_blocks)
    return chain_hashes(
        [b",".join(str(t).encode() for t in tokens[i * block_size : (i + 1) * block_size]) for i in range(n)]
    )


def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return ""


def prompt_text(body: Mapping[str, Any], chat: bool) -> str:
    """The text the pod will see first: chat messages in order, or the (first) completion prompt."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list):
            return ""
        return "".join(
            f"<{m.get('role', '')}>{_content_text(m.get('content'))}\n"
            for m in messages
            if isinstance(m, Mapping)
        )
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, int):  # one prompt of token ids
            return ",".join(str(t) for t in prompt)
        if isinstance(first, list):  # several prompts of token ids
            return ",".join(str(t) for t in first)
        return str(first)
    return prompt if isinstance(prompt, str) else ""


def request_key(
    body: Mapping[str, Any], chat: bool, session: str | None = None, block_chars: int = BLOCK_CHARS
) -> RouteKey:
    blocks = text_blocks(prompt_text(body, chat), block_chars)
    max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
    # KV footprint in blocks: the prompt plus the tokens it may generate (about 4 characters a token).
    gen_blocks = 0
    if isinstance(max_tokens, int) and max_tokens > 0:
        gen_blocks = min(max_tokens, MAX_FOOTPRINT_BLOCKS * block_chars) * 4 // block_chars
    size = min(MAX_FOOTPRINT_BLOCKS, max(1, len(blocks) + gen_blocks))
    return RouteKey(blocks=blocks, session=session or None, size_blocks=size)
