"""Tokenizers for served models: built from GGUF metadata or read from a Hugging Face `tokenizer.json`.

`Tokenizer` wraps a `tokenizers.Tokenizer` with what the engine needs beyond encode/decode: the set of
end-of-generation ids, raw token bytes for incremental detokenization, and the chat template
rendered in a jinja2 sandbox the way transformers renders it.

GGUF byte-level BPE tokenizers split text before BPE with the regex llama.cpp uses for the file's
`tokenizer.ggml.pre` (for SmolLM: every digit alone, then the GPT-2 pattern), so encodings match
llama.cpp and the model's original tokenizer.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

log = logging.getLogger(__name__)

# GGUF token types (llama.cpp `llama_token_type`)
TOKEN_TYPE_CONTROL = 3
TOKEN_TYPE_USER_DEFINED = 4

# Control tokens that end a turn or a document; llama.cpp treats these as end-of-generation too.
END_OF_GENERATION_TEXTS = frozenset(
    {
        "<|endoftext|>",
        "<|im_end|>",
        "<|eot_id|>",
        "<|eom_id|>",
        "<|end|>",
        "<end_of_turn>",
        "<|end_of_text|>",
        "<EOT>",
        "<｜end▁of▁sentence｜>",
    }
)

_GPT2_SPLIT = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"""
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` -> the regexes llama.cpp applies in sequence before BPE (the GPT-2 one last
# for the families that end with it).
_DIGITS_THEN_GPT2 = (r"\p{N}", _GPT2_SPLIT)
GGUF_PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("gpt2", "default", "phi-2", "jina-es", "jina-de", "olmo", "poro-chat"), (_GPT2_SPLIT,)),
    **dict.fromkeys(
        ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b"), _DIGITS_THEN_GPT2
    ),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "dbrx", "smaug-bpe"), (_LLAMA3_SPLIT,)),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "megrez"), (_QWEN2_SPLIT,)),
}


@lru_cache(maxsize=1)
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {b: chr(c) for b, c in zip(printable, chars, strict=True)}


@lru_cache(maxsize=1)
def unicode_to_byte() -> dict[str, int]:
    return {c: b for b, c in byte_to_unicode().items()}


class Tokenizer:
    """What the engine, detokenizer and server use; construct with `from_gguf` or `from_hf_dir`."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token_id: int | None,
        eos_token_ids: set[int],
        pad_token_id: int | None = None,
        chat_template: str | None = None,
        special_tokens: Mapping[str, str | None] | None = None,
        byte_level: bool = False,
    ) -> None:
        if not eos_token_ids:
            raise ValueError("a tokenizer needs at least one end-of-sequence token id")
        self.backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_ids = frozenset(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.chat_template = chat_template
        # bos_token / eos_token / unk_token / pad_token strings, as chat templates see them
        self.special_tokens = dict(special_tokens or {})
        self.byte_level = byte_level

    # -- construction ------------------------------------------------------------------------

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        from kvpilot.runtime.load.gguf_reader import GGUFFile

        with GGUFFile(path) as f:
            return tokenizer_from_gguf_metadata(f.metadata, source=str(path))

    @classmethod
    def from_hf_dir(cls, directory: str | Path) -> Tokenizer:
        return tokenizer_from_hf_dir(Path(directory))

    # -- encode / decode ---------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def eos_token_id(self) -> int:
        """The primary end-of-sequence id (the one the model config names)."""
        eos = self.special_tokens.get("eos_token")
        token_id = self.backend.token_to_id(eos) if eos else None
        return token_id if token_id is not None else min(self.eos_token_ids)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids; `add_special_tokens` adds what the model's post-processor adds (e.g. BOS)."""
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        token = self.backend.id_to_token(token_id)
        return None if token is None else str(token)

    def token_to_id(self, token: str) -> int | None:
        token_id = self.backend.token_to_id(token)
        return None if token_id is None else int(token_id)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return [self.id_to_token(i) or "" for i in ids]

    @cached_property
    def all_special_ids(self) -> frozenset[int]:
        added = self.backend.get_added_tokens_decoder()
        return frozenset(int(i) for i, tok in added.items() if tok.special)

    def is_special(self, token_id: int) -> bool:
        return token_id in self.all_special_ids

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for, for incremental UTF-8-safe detokenization.

        Byte-level BPE tokens map back exactly; sentencepiece tokens turn `▁` into a space and
        `<0xAB>` into the byte (so a leading space that `decode` would strip is kept). Special tokens
        give their text.
        """
        return self._token_bytes_table[token_id] if token_id < len(self._token_bytes_table) else b""

    @cached_property
    def _token_bytes_table(self) -> list[bytes]:
        specials = {int(i): str(t.content) for i, t in self.backend.get_added_tokens_decoder().items()}
        table = []
        for token_id in range(self.vocab_size):
            token = self.backend.id_to_token(token_id)
            if token is None:
                table.append(b"")
            elif token_id in specials:
                table.append(specials[token_id].encode("utf-8"))
            else:
                table.append(self._piece_bytes(str(token)))
        return table

    def _piece_bytes(self, token: str) -> bytes:
        if self.byte_level:
            to_byte = unicode_to_byte()
            return b"".join(bytes([to_byte[c]]) if c in to_byte else c.encode("utf-8") for c in token)
        if len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            try:
                return bytes([int(token[3:5], 16)])
            except ValueError:
                pass
        return token.replace("▁", " ").encode("utf-8")

    # -- chat --------------------------------------------------------------------------------

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **kwargs: Any,
    ) -> str:
        """Render the conversation with the model's chat template (sandboxed jinja2).

        Raises ValueError when the model has no chat template, and jinja2's TemplateError when the
        template rejects the conversation (through its `raise_exception`).
        """
        if not self.chat_template:
            raise ValueError("this model has no chat template; use the completions API instead")
        context: dict[str, Any] = {
            **{k: v for k, v in self.special_tokens.items() if v is not None},
            **kwargs,
            "messages": [dict(m) for m in messages],
            "tools": [dict(t) for t in tools] if tools is not None else None,
            "add_generation_prompt": add_generation_prompt,
        }
        return compile_chat_template(self.chat_template).render(**context)


# ---------------------------------------------------------------------------------------------
# Chat templates


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # Unlike jinja's builtin, no HTML escaping: templates put JSON into prompts, not web pages.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_chat_template(source: str) -> jinja2.Template:
    """The environment transformers renders chat templates in: sandboxed, immutable, trimmed blocks."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


# ---------------------------------------------------------------------------------------------
# GGUF


def tokenizer_from_gguf_metadata(fields: Mapping[str, Any], source: str = "<gguf>") -> Tokenizer:
    """Build the tokenizer a GGUF's `tokenizer.*` metadata describes (byte-level BPE only)."""
    kind = fields.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(
            f"{source}: tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') GGUF tokenizers are "
            "supported (use a Hugging Face directory with tokenizer.json for other models)"
        )
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    types: list[int] = list(fields.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in fields.get("tokenizer.ggml.merges") or []]
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False, byte_fallback=False
        )
    )
    backend.pre_tokenizer = _gguf_pre_tokenizer(fields.get("tokenizer.ggml.pre"))
    backend.decoder = decoders.ByteLevel()
    _add_gguf_added_tokens(backend, tokens, types)

    def token_at(key: str) -> int | None:
        value = fields.get(f"tokenizer.ggml.{key}")
        return int(value) if value is not None else None

    bos, eos = token_at("bos_token_id"), token_at("eos_token_id")
    pad, unk = token_at("padding_token_id"), token_at("unknown_token_id")
    add_bos = bool(fields.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(fields.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = _bos_eos_post_processor(
        tokens, bos if add_bos else None, eos if add_eos else None
    )
    eos_ids = _gguf_eos_ids(tokens, types, [eos, token_at("eot_token_id"), token_at("eom_token_id")])
    names = {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad}
    return Tokenizer(
        backend,
        bos_token_id=bos,
        eos_token_ids=eos_ids,
        pad_token_id=pad,
        chat_template=fields.get("tokenizer.chat_template"),
        special_tokens={
            k: tokens[v] if v is not None and 0 <= v < len(tokens) else None for k, v in names.items()
        },
        byte_level=True,
    )


def _gguf_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    splits = GGUF_PRE_TOKENIZER_SPLITS.get(pre or "default")
    if splits is None:
        log.warning("unknown tokenizer.ggml.pre %r; splitting text with the GPT-2 pattern", pre)
        splits = (_GPT2_SPLIT,)
    steps: list[pre_tokenizers.PreTokenizer] = [
        pre_tokenizers.Split(Regex(pattern), behavior="isolated") for pattern in splits
    ]
    steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(steps)


def _add_gguf_added_tokens(backend: tokenizers.Tokenizer, tokens: list[str], types: list[int]) -> None:
    # Control tokens (<|im_start|>, ...) are special: matched whole, skipped by skip_special_tokens.
    # User-defined tokens are matched whole too, but are ordinary text.
    special = [
        AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types, strict=True) if k == 3
    ]
    user = [
        AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types, strict=True) if k == 4
    ]
    if special:
        backend.add_special_tokens(special)
    if user:
        backend.add_tokens(user)


def _bos_eos_post_processor(tokens: list[str], bos: int | None, eos: int | None) -> processors.PostProcessor:
    single, pair, specials = ["$A"], ["$A", "$B"], []
    if bos is not None:
        single, pair = [tokens[bos], *single], [tokens[bos], "$A", tokens[bos], "$B"]
        specials.append((tokens[bos], bos))
    if eos is not None:
        single, pair = [*single, tokens[eos]], [*pair, tokens[eos]]
        specials.append((tokens[eos], eos))
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def _gguf_eos_ids(tokens: list[str], types: list[int], declared: list[int | None]) -> set[int]:
    ids = {i for i in declared if i is not None}
    ids |= {
        i
        for i, (t, k) in enumerate(zip(tokens, types, strict=True))
        if k == 3 and t in END_OF_GENERATION_TEXTS
    }
    return ids


# ---------------------------------------------------------------------------------------------
# Hugging Face directory


def tokenizer_from_hf_dir(directory: Path) -> Tokenizer:
    """tokenizer.json plus tokenizer_config.json (chat template, special tokens) and the eos ids from
    generation_config.json / config.json."""
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory}: expected tokenizer.json (a Hugging Face fast tokenizer)")
    backend = tokenizers.Tokenizer.from_file(str(path))
    tok_cfg = _read_json(directory / "tokenizer_config.json")
    names = {
        key: _token_text(tok_cfg.get(key)) for key in ("bos_token", "eos_token", "unk_token", "pad_token")
    }
    eos_ids = _hf_eos_ids(directory, backend, names.get("eos_token"))
    if not eos_ids:
        raise ValueError(
            f"{directory}: no eos token in tokenizer_config.json, generation_config.json or config.json"
        )
    bos = names.get("bos_token")
    pad = names.get("pad_token")
    return Tokenizer(
        backend,
        bos_token_id=backend.token_to_id(bos) if bos else None,
        eos_token_ids=eos_ids,
        pad_token_id=backend.token_to_id(pad) if pad else None,
        chat_template=_hf_chat_template(directory, tok_cfg),
        special_tokens=names,
        byte_level=_is_byte_level(backend),
    )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # serialized AddedToken
        content = value.get("content")
        return str(content) if content is not None else None
    return str(value) if value is not None else None


def _hf_eos_ids(directory: Path, backend: tokenizers.Tokenizer, eos_text: str | None) -> set[int]:
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        value = _read_json(directory / name).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
        if ids:
            break  # generation_config.json, when it names eos ids, is what generation uses
    if eos_text and (eos_id := backend.token_to_id(eos_text)) is not None:
        ids.add(int(eos_id))
    return ids


def _hf_chat_template(directory: Path, tok_cfg: Mapping[str, Any]) -> str | None:
    template = tok_cfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    if template is None and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text(encoding="utf-8")
    return str(template) if template is not None else None


def _is_byte_level(backend: tokenizers.Tokenizer) -> bool:
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    kinds = {decoder.get("type")} | {
        d.get("type") for d in decoder.get("decoders", []) if isinstance(d, dict)
    }
    return "ByteLevel" in kinds
