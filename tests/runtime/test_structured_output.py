"""Structured output in the engine: the real SmolLM2 model generating under xgrammar masks.

Outputs must parse and validate against their schema at temperature 0 and 1; the matcher state
must survive preemption (recompute) and speculative decoding (rolled back on rejected proposals);
bad schemas, regexes and grammars are refused naming the field.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
import torch

from kvpilot.runtime.engine.core import LLMEngine
from kvpilot.runtime.engine.sampler import Sampler, SamplingRow
from kvpilot.runtime.engine.sampling_params import SamplingParams
from kvpilot.runtime.grammar.structured_output import (
    GuidedSpec,
    GuidedSpecError,
    apply_bitmask,
    new_bitmask,
)

pytestmark = pytest.mark.timeout(600)

# Bounded (maxLength / maxItems) so that greedy decoding of a 135M model always reaches the end.
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested": {
        "type": "object",
        "properties": {
            "person": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 20},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string", "maxLength": 20}},
                        "required": ["city"],
                    },
                },
                "required": ["name", "address"],
            }
        },
        "required": ["person"],
    },
    "array": {
        "type": "object",
        "properties": {
            "colors": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["colors"],
    },
    "enum": {
        "type": "object",
        "properties": {"mood": {"enum": ["happy", "sad", "angry"]}, "ok": {"type": "boolean"}},
        "required": ["mood", "ok"],
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 65},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
        },
        "required": ["age", "score"],
    },
    "any_of": {
        "type": "object",
        "properties": {
            "id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 999}, {"type": "null"}]},
            "kind": {"anyOf": [{"const": "cat"}, {"const": "dog"}]},
        },
        "required": ["id", "kind"],
    },
}


def chat_prompt(engine: LLMEngine, text: str) -> list[int]:
    tok = engine.tokenizer
    ids: list[int] = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
    return ids


@pytest.fixture(scope="module")
def engine(make_engine: Callable[..., LLMEngine]) -> LLMEngine:
    return make_engine()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_outputs_validate_against_each_schema(engine: LLMEngine, temperature: float) -> None:
    names = list(SCHEMAS)
    prompts = [chat_prompt(engine, f"Reply with a JSON object ({name}).") for name in names]
    params = [
        SamplingParams(
            max_tokens=120,
            temperature=temperature,
            seed=7,
            guided=GuidedSpec.json_schema(SCHEMAS[name], "guided_json"),
        )
        for name in names
    ]
    for name, seq in zip(names, engine.generate(prompts, params), strict=True):
        text = engine.tokenizer.decode(seq.output_token_ids)
        assert seq.finish_reason == "stop", (name, text)
        assert seq.output_token_ids[-1] in engine.eos_token_ids  # EOS only once the grammar accepts
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_unconstrained_output_is_not_json(engine: LLMEngine) -> None:
    """The same prompt without a schema: the model answers in prose, so the mask is what makes JSON."""
    seq = engine.generate(
        [chat_prompt(engine, "Reply with a JSON object (enum).")],
        SamplingParams(max_tokens=40, temperature=0),
    )[0]
    text = engine.tokenizer.decode(seq.output_token_ids)
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_regex_choice_grammar_and_json_object(engine: LLMEngine) -> None:
    specs = [
        GuidedSpec("regex", r"[0-9]{3}-[a-z]{2}", "guided_regex"),
        GuidedSpec.choice(["blue", "green, of course"], "guided_choice"),
        GuidedSpec("grammar", 'root ::= "Answer: " ("yes" | "no")', "guided_grammar"),
        GuidedSpec("json_object", "", "response_format"),
    ]
    prompt = chat_prompt(engine, "What is your favourite color?")
    seqs = engine.generate(
        [prompt] * len(specs), [SamplingParams(max_tokens=60, temperature=0, guided=s) for s in specs]
    )
    texts = [engine.tokenizer.decode(s.output_token_ids) for s in seqs]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", texts[0]), texts[0]
    assert texts[1] in ("blue", "green, of course")
    assert texts[2] in ("Answer: yes", "Answer: no")
    assert isinstance(json.loads(texts[3]), dict)
    assert all(s.finish_reason == "stop" for s in seqs)


def test_n_choices_each_follow_their_own_matcher(engine: LLMEngine) -> None:
    """Sampled choices of one spec diverge but each is valid: matchers are per sequence."""
    schema = SCHEMAS["array"]
    spec = GuidedSpec.json_schema(schema, "guided_json")
    prompt = chat_prompt(engine, "List some colors as JSON.")
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=s, guided=spec) for s in range(4)]
    texts = [engine.tokenizer.decode(s.output_token_ids) for s in engine.generate([prompt] * 4, params)]
    for t in texts:
        jsonschema.validate(json.loads(t), schema)
    assert len(set(texts)) > 1
    assert engine.grammar_compiler.cache_size >= 1


def test_preemption_keeps_the_grammar_state(engine: LLMEngine) -> None:
    """A sequence preempted mid-output (its KV freed and recomputed) continues exactly as an
    uninterrupted one: the matcher follows committed tokens, which preemption keeps."""
    spec = GuidedSpec.json_schema(SCHEMAS["nested"], "guided_json")
    prompt = chat_prompt(engine, "Describe a person as JSON.")
    params = SamplingParams(max_tokens=60, temperature=0, guided=spec)
    reference = engine.generate([prompt], params)[0].output_token_ids

    engine.add_request("preempted", prompt, params)
    seq = engine.requests["preempted"].seq
    while seq.num_output_tokens < 8:
        engine.step()
    engine.scheduler._preempt(seq)  # what the scheduler does when blocks run out
    assert seq.num_computed_tokens == 0 and not seq.block_table  # its KV is recomputed later
    while engine.has_unfinished():
        engine.step()
    assert seq.num_preemptions == 1
    assert seq.output_token_ids == reference


def test_speculative_decoding_respects_and_rolls_back_the_grammar(
    make_engine: Callable[..., LLMEngine],
) -> None:
    spec_engine = make_engine(
        speculative_method="ngram", num_speculative_tokens=4, speculative_adaptive=False
    )
    plain = make_engine()
    spec = GuidedSpec.json_schema(SCHEMAS["array"], "guided_json")
    prompt = chat_prompt(plain, 'Repeat exactly: {"colors": ["red", "red", "red"]}')
    params = SamplingParams(max_tokens=60, temperature=0, guided=spec)
    want = plain.generate([prompt], params)[0]
    got = spec_engine.generate([prompt], params)[0]
    assert got.spec_num_proposed > 0  # the n-gram proposer did propose under the grammar
    assert got.output_token_ids == want.output_token_ids
    jsonschema.validate(json.loads(plain.tokenizer.decode(got.output_token_ids)), SCHEMAS["array"])
    # sampled: valid too, though the tokens may differ
    sampled = spec_engine.generate(
        [prompt] * 3, SamplingParams(max_tokens=60, temperature=1.0, seed=3, guided=spec)
    )
    for s in sampled:
        jsonschema.validate(json.loads(plain.tokenizer.decode(s.output_token_ids)), SCHEMAS["array"])


def test_ignore_eos_still_stops_when_the_grammar_is_done(engine: LLMEngine) -> None:
    spec = GuidedSpec.choice(["yes", "no"], "guided_choice")
    seq = engine.generate(
        [chat_prompt(engine, "Yes or no?")],
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, guided=spec),
    )[0]
    assert seq.finish_reason == "stop"
    assert engine.tokenizer.decode(seq.output_token_ids) in ("yes", "no")


def test_sampler_masks_only_guided_rows_and_reports_raw_logprobs(engine: LLMEngine) -> None:
    spec = GuidedSpec.choice(["yes"], "guided_choice")
    state = engine.grammar_compiler.new_state(spec)
    vocab = engine.tokenizer.vocab_size
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    free = int(logits[1].argmax())
    params = SamplingParams(temperature=0, logprobs=0)
    rows = [SamplingRow(params, grammar=state), SamplingRow(params)]
    out = Sampler().sample(logits, rows)
    assert engine.tokenizer.decode([out.token_ids[0]]) in ("yes", "y", "ye")
    assert out.token_ids[1] == free  # the unguided row is untouched
    raw = torch.log_softmax(logits, dim=-1)
    lp = out.logprobs[0]
    assert lp is not None and lp.logprob == pytest.approx(float(raw[0, out.token_ids[0]]), abs=1e-5)


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        (GuidedSpec("regex", "a(b", "guided_regex"), "invalid regular expression"),
        (GuidedSpec("grammar", "root ::= undefined_rule", "guided_grammar"), "invalid EBNF grammar"),
        (GuidedSpec("json_schema", '{"type": "bogus"}', "guided_json"), "invalid JSON schema"),
        (
            GuidedSpec("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}', "guided_json"),
            "minimum",
        ),
        (
            GuidedSpec("json_schema", '{"properties": {"a": {"$ref": "#/nope"}}}', "response_format"),
            "nope",
        ),
    ],
)
def test_bad_specs_are_refused_naming_field_and_problem(
    engine: LLMEngine, spec: GuidedSpec, problem: str
) -> None:
    with pytest.raises(GuidedSpecError) as info:  # the offline compile: the worker's checks, in-process
        engine.grammar_compiler.compile(spec)
    assert info.value.param == spec.param
    assert problem in str(info.value)
    assert str(info.value).startswith(f"'{spec.param}'")


def test_schema_given_as_text_must_be_json() -> None:
    with pytest.raises(GuidedSpecError, match="not valid JSON"):
        GuidedSpec.json_schema("{oops", "guided_json")
    with pytest.raises(GuidedSpecError, match="must be an object"):
        GuidedSpec.json_schema([1, 2], "guided_json")


def test_prefix_cache_hits_do_not_change_guided_output(make_engine: Callable[..., LLMEngine]) -> None:
    """The grammar changes no KV: a request served from cached prompt blocks generates the same."""
    engine = make_engine(enable_prefix_caching=True)
    spec = GuidedSpec.json_schema(SCHEMAS["enum"], "guided_json")
    prompt = chat_prompt(engine, "How do you feel today? " * 8)  # several full blocks to reuse
    params = SamplingParams(max_tokens=40, temperature=0, guided=spec)
    first = engine.generate([prompt], params)[0]
    second = engine.generate([prompt], params)[0]
    assert first.num_cached_tokens == 0 and second.num_cached_tokens >= engine.block_manager.block_size
    assert second.output_token_ids == first.output_token_ids
    jsonschema.validate(json.loads(engine.tokenizer.decode(second.output_token_ids)), SCHEMAS["enum"])


def test_special_tokens_are_never_allowed_inside_the_grammar(engine: LLMEngine) -> None:
    """'<|im_start|>' is text a JSON string could hold, but as a token it is never allowed."""
    state = engine.grammar_compiler.new_state(GuidedSpec("regex", '"[^"]*"', "guided_regex"))
    assert state.accept(engine.tokenizer.encode('"', add_special_tokens=False)[0])
    bitmask = new_bitmask(1, engine.tokenizer.vocab_size)
    state.fill(bitmask, 0)
    logits = torch.zeros(1, engine.tokenizer.vocab_size)
    apply_bitmask(logits, bitmask)
    allowed = set(torch.nonzero(logits[0] == 0).flatten().tolist())
    tok = engine.tokenizer
    assert tok.encode("abc", add_special_tokens=False)[0] in allowed
    assert not (set(tok.all_special_ids) - set(tok.eos_token_ids)) & allowed
