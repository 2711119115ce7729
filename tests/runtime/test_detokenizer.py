from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from fake_engine import FakeTokenizer, bpe_tokenizer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvpilot.runtime.engine.sampling_params import SamplingParams
from kvpilot.runtime.load.tokenizer import Tokenizer
from kvpilot.runtime.serving.detokenizer import (
    REPLACEMENT_CHAR,
    IncrementalDetokenizer,
    StopStringMatcher,
    TextStream,
)

TOK = FakeTokenizer()
VOCAB = bpe_tokenizer().get_vocab_size()
NUM_SPECIAL = 3  # ids 0..2 are the special tokens

ids_strategy = st.lists(st.integers(min_value=NUM_SPECIAL, max_value=VOCAB - 1), max_size=60)
chunks_strategy = st.lists(st.integers(min_value=1, max_value=4), min_size=1, max_size=60)
text_strategy = st.text(
    alphabet=st.sampled_from(list("abc STOPé日本🤖👍🏽\n—")) | st.characters(codec="utf-8"), max_size=60
)
PROFILE = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def chunked(ids: Sequence[int], sizes: Sequence[int]) -> list[list[int]]:
    out, i = [], 0
    for s in itertools_cycle(sizes):
        if i >= len(ids):
            break
        out.append(list(ids[i : i + s]))
        i += s
    return out


def itertools_cycle(sizes: Sequence[int]):  # type: ignore[no-untyped-def]
    while True:
        yield from sizes


def run_detok(ids: Sequence[int], sizes: Sequence[int], prompt: Sequence[int] = ()) -> list[str]:
    d = IncrementalDetokenizer(TOK, prompt)
    deltas = [d.push(c) for c in chunked(ids, sizes)]
    deltas.append(d.flush())
    return deltas


@PROFILE
@given(ids=ids_strategy, sizes=chunks_strategy)
def test_random_tokens_concat_equals_decode(ids: list[int], sizes: list[int]) -> None:
    deltas = run_detok(ids, sizes)
    final = TOK.decode(ids)
    assert "".join(deltas) == final
    if REPLACEMENT_CHAR not in final:
        assert not any(REPLACEMENT_CHAR in d for d in deltas)
    # Only the flush may carry an incomplete character.
    assert not any(d.endswith(REPLACEMENT_CHAR) for d in deltas[:-1])


@PROFILE
@given(text=text_strategy, sizes=chunks_strategy, prompt=text_strategy)
def test_real_text_never_emits_replacement_char(text: str, sizes: list[int], prompt: str) -> None:
    ids = TOK.encode(text)
    deltas = run_detok(ids, sizes, TOK.encode(prompt))
    assert "".join(deltas) == TOK.decode(ids) == text
    assert not any(REPLACEMENT_CHAR in d for d in deltas)


def test_multibyte_character_split_across_tokens_is_held() -> None:
    ids = TOK.encode("🤖")
    assert len(ids) > 1  # the test tokenizer splits it
    d = IncrementalDetokenizer(TOK)
    assert [d.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert d.push(ids[-1:]) == "🤖"


def test_special_tokens_skipped_or_kept() -> None:
    ids = [*TOK.encode("hi"), 2, *TOK.encode(" there")]
    assert "".join(run_detok(ids, [1])) == "hi there"
    d = IncrementalDetokenizer(TOK, skip_special_tokens=False)
    assert "".join(d.push([i]) for i in ids) + d.flush() == "hi<|im_end|> there"


def reference_stop(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    best = None
    for s in stops:
        if not s:
            continue
        i = text.find(s)
        if i >= 0 and (best is None or (i + len(s), i) < (best[0] + len(best[1]), best[0])):
            best = (i, s)
    if best is None:
        return text, None
    i, s = best
    return text[: i + len(s)] if include else text[:i], s


@PROFILE
@given(data=st.data(), text=text_strategy, sizes=chunks_strategy, include=st.booleans())
def test_stop_strings_never_emitted(data: st.DataObject, text: str, sizes: list[int], include: bool) -> None:
    stops = data.draw(
        st.lists(
            st.builds(
                lambda a, b: text[min(a, b) : max(a, b)], st.integers(0, len(text)), st.integers(0, len(text))
            )
            | text_strategy,
            max_size=3,
        )
    )
    params = SamplingParams(stop=stops, include_stop_str_in_output=include)
    stream = TextStream(TOK, params)
    deltas = [stream.push(c) for c in chunked(TOK.encode(text), sizes)]
    deltas.append(stream.finish())
    out = "".join(deltas)
    expected, stop = reference_stop(text, stops, include)
    assert out == expected == stream.text
    assert stream.stop_str == stop
    if not include:
        assert not any(s and s in out for s in stops)


def test_stop_string_split_across_many_tokens_is_held_then_dropped() -> None:
    text = "Hello world! STOP and more"
    stream = TextStream(TOK, SamplingParams(stop=["STOP"]))
    emitted = []
    for i in TOK.encode(text):
        emitted.append(stream.push([i]))
        assert "S" not in "".join(emitted)
    assert "".join(emitted) + stream.finish() == "Hello world! "
    assert stream.stop_str == "STOP"


def test_partial_stop_prefix_released_when_it_does_not_complete() -> None:
    m = StopStringMatcher(["STOP"])
    assert m.push("abc ST") == "abc "
    assert m.push("ART") == "START"
    assert m.push(" STO") == " "
    assert m.flush() == "STO"
    assert not m.stopped


def test_include_stop_str_in_output() -> None:
    m = StopStringMatcher(["END"], include_stop_str_in_output=True)
    assert m.push("one EN") == "one EN"
    assert m.push("D two") == "D"
    assert m.stopped and m.text == "one END"


def test_stop_completing_first_wins() -> None:
    m = StopStringMatcher(["abcd", "bc"])
    assert m.push("xabcd") == "xa"
    assert m.stop_str == "bc"


def test_stop_strings_ignored_before_min_tokens() -> None:
    ids = TOK.encode("ab STOP cd STOP ef")
    params = SamplingParams(stop=["STOP"], min_tokens=len(TOK.encode("ab STOP")) + 1, max_tokens=100)
    stream = TextStream(TOK, params)
    out = "".join(stream.push([i]) for i in ids) + stream.finish()
    assert out == "ab STOP cd "


def test_nothing_after_stop() -> None:
    stream = TextStream(TOK, SamplingParams(stop=["world"]))
    assert stream.push(TOK.encode("Hello world")) == "Hello "
    assert stream.push(TOK.encode("more")) == ""
    assert stream.finish() == ""
    assert stream.text == "Hello "


# -- the real SmolLM2 tokenizer (byte-level BPE from the builtin GGUF) ------------------------------


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_gguf_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_gguf_path)


@PROFILE
@given(ids=st.lists(st.integers(min_value=0, max_value=49151), max_size=40), sizes=chunks_strategy)
def test_smollm2_random_tokens_concat_equals_decode(
    smollm2_tokenizer: Tokenizer, ids: list[int], sizes: list[int]
) -> None:
    d = IncrementalDetokenizer(smollm2_tokenizer)
    deltas = [d.push(c) for c in chunked(ids, sizes)]
    deltas.append(d.flush())
    final = smollm2_tokenizer.decode(ids)
    assert "".join(deltas) == final
    if REPLACEMENT_CHAR not in final:
        assert not any(REPLACEMENT_CHAR in x for x in deltas)


@PROFILE
@given(text=text_strategy, sizes=chunks_strategy, data=st.data())
def test_smollm2_text_with_chat_prompt_and_stops(
    smollm2_tokenizer: Tokenizer, text: str, sizes: list[int], data: st.DataObject
) -> None:
    tok = smollm2_tokenizer
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "hi"}]), add_special_tokens=False
    )
    ids = tok.encode(text, add_special_tokens=False)
    stops = data.draw(
        st.lists(st.sampled_from([text[i : i + 3] for i in range(len(text))] or ["zz"]), max_size=2)
    )
    stream = TextStream(tok, SamplingParams(stop=stops), prompt)
    deltas = [stream.push(c) for c in chunked(ids, sizes)]
    deltas.append(stream.finish())
    out = "".join(deltas)
    # (SmolLM2's vocabulary lacks a few lead bytes, e.g. 0xF1, so rare characters do not round-trip.)
    final = tok.decode(ids)
    expected, _ = reference_stop(final, stops, include=False)
    assert out == expected
    if REPLACEMENT_CHAR not in final:
        assert not any(REPLACEMENT_CHAR in x for x in deltas)
    assert not any(s and s in out for s in stops)
