"""The GGUF-built tokenizer against transformers' GGUF tokenizer, and the chat template renderer."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import pytest

from kvpilot.runtime.load.tokenizer import (
    Tokenizer,
    byte_to_unicode,
    compile_chat_template,
    tokenizer_from_gguf_metadata,
)

TEXTS = [
    "Hello world!",
    "",
    "The quick brown fox jumps over the lazy dog.",
    "日本語のテキスト、中文。한국어 텍스트",
    "emoji 😀🎉 family 👩‍👩‍👧 flags 🇫🇷🇯🇵",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    "whitespace runs:   three,\t\ttabs,\n\n\nnewlines,   \n  mixed  ",
    "   leading and trailing   ",
    "price: $1,234.56 and pi=3.14159 in 2024",
    "don't I'LL we've they'd",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "fake <|im_start special> tokens <|endoftext|> inside",
    "ÀÉÎõü ß Ωμέγα Привет мир",
    "a\r\nb\rc",
    "x" * 200,
    "https://example.com/path?q=1&r=2#frag",
    '{"key": [1, 2, {"nested": null}]}',
]

# Whitespace right before a digit. SmolLM2's tokenizer (and llama.cpp for `tokenizer.ggml.pre` =
# "smollm") splits every digit off first, so "  12" keeps its two spaces together ("ĠĠ", "1", "2").
# transformers' GGUF converter does not know "smollm" and uses plain GPT-2 splitting, which yields
# "Ġ", "Ġ", "1", "2" instead; we follow the model's own tokenizer here, so these are checked apart.
DIGIT_SPACING = {
    "x  12": ["x", "ĠĠ", "1", "2"],
    "1 2  3": ["1", "Ġ", "2", "ĠĠ", "3"],
}

CONVERSATIONS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "日本語で答えて 😀"},
    ],
]


@pytest.fixture(scope="module")
def ours(smollm2_gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf_path)


@pytest.fixture(scope="module")
def hf(smollm2_gguf_path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_gguf_path.parent, gguf_file=smollm2_gguf_path.name)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_matches_transformers(ours: Tokenizer, hf: Any, text: str) -> None:
    assert ours.encode(text) == hf.encode(text)
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("text", TEXTS)
def test_decode_round_trips(ours: Tokenizer, hf: Any, text: str) -> None:
    ids = ours.encode(text)
    assert ours.decode(ids, skip_special_tokens=False) == text
    assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize(("text", "tokens"), DIGIT_SPACING.items())
def test_digits_split_like_llama_cpp(ours: Tokenizer, text: str, tokens: list[str]) -> None:
    assert ours.convert_ids_to_tokens(ours.encode(text)) == tokens


def test_special_ids(ours: Tokenizer, hf: Any) -> None:
    assert ours.bos_token_id == hf.bos_token_id == 1
    assert ours.eos_token_id == hf.eos_token_id == 2  # <|im_end|>
    assert ours.eos_token_ids == {0, 2}  # <|endoftext|> ends generation too
    assert ours.pad_token_id == 2
    assert ours.vocab_size == len(hf) == 49152
    assert ours.is_special(1) and not ours.is_special(100)
    assert ours.encode("<|im_start|>")[0] == 1  # matched whole


def test_token_bytes_rebuild_utf8(ours: Tokenizer) -> None:
    text = "emoji 😀 and 日本 ok <|im_end|>"
    ids = ours.encode(text)
    pieces = [ours.token_bytes(i) for i in ids]
    assert b"".join(pieces).decode("utf-8") == text
    # the emoji spans several byte tokens, none of them valid UTF-8 alone
    assert any(not _is_utf8(p) for p in pieces)
    assert ours.token_bytes(10**9) == b""


def _is_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def test_byte_to_unicode_is_a_bijection() -> None:
    table = byte_to_unicode()
    assert len(table) == 256 and len(set(table.values())) == 256
    assert table[ord("A")] == "A" and table[ord(" ")] == "Ġ"


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_chat_template_matches_transformers(
    ours: Tokenizer, hf: Any, messages: list[dict[str, str]], add_generation_prompt: bool
) -> None:
    expected = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == expected


def test_chat_template_helpers_and_sandbox() -> None:
    template = (
        "{% if messages | length == 0 %}{{ raise_exception('no messages') }}{% endif %}"
        "{{ bos_token }}{{ messages | tojson }}|{{ strftime_now('%Y') | length }}"
    )
    tok = Tokenizer(
        _tiny_backend(),
        bos_token_id=1,
        eos_token_ids={2},
        chat_template=template,
        special_tokens={"bos_token": "<s>"},
    )
    assert tok.apply_chat_template([{"role": "user", "content": "é<>"}]) == (
        '<s>[{"role": "user", "content": "é<>"}]|4'
    )
    with pytest.raises(jinja2.TemplateError, match="no messages"):
        tok.apply_chat_template([])
    with pytest.raises(jinja2.exceptions.SecurityError):
        compile_chat_template("{{ ''.__class__.__mro__[1].__subclasses__() }}").render()


def test_no_chat_template_is_a_clear_error() -> None:
    tok = Tokenizer(_tiny_backend(), bos_token_id=None, eos_token_ids={2})
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_non_bpe_gguf_tokenizer_is_rejected() -> None:
    with pytest.raises(ValueError, match="only byte-level BPE"):
        tokenizer_from_gguf_metadata(
            {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": ["a"]}, "x.gguf"
        )


def test_hf_dir_tokenizer(ours: Tokenizer, tmp_path: Path) -> None:
    """The same vocabulary saved as tokenizer.json, with a generation config naming the eos ids."""
    ours.backend.save(str(tmp_path / "tokenizer.json"))
    config = {
        "bos_token": {"content": "<|im_start|>"},
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "chat_template": ours.chat_template,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    for text in TEXTS:
        assert tok.encode(text) == ours.encode(text)
    assert tok.eos_token_ids == {0, 2}
    assert tok.bos_token_id == 1
    assert tok.byte_level
    assert tok.token_bytes(tok.encode(" é")[0]) == ours.token_bytes(ours.encode(" é")[0])
    assert tok.apply_chat_template(CONVERSATIONS[0]) == ours.apply_chat_template(CONVERSATIONS[0])


def test_hf_dir_without_tokenizer_json(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        Tokenizer.from_hf_dir(tmp_path)


def _tiny_backend() -> Any:
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    return Backend(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
