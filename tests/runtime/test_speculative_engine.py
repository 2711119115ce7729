"""Speculative decoding in the engine on the real SmolLM2 weights: greedy outputs are those of the
non-speculative engine and of Hugging Face transformers, whatever the batch, KV pressure, chunking
or prefix caching; proposal slots are released; bad settings are refused naming the flag."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import pytest

from kvpilot.runtime.cli import add_arguments, build_config
from kvpilot.runtime.engine.core import LLMEngine
from kvpilot.runtime.engine.sampling_params import SamplingParams
from tests.runtime.greedy_reference import Reference, assert_matches_reference, hf_greedy

MAX_NEW = 16
NGRAM = {"speculative_method": "ngram", "num_speculative_tokens": 4}
QUOTES = [
    "The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the clocks "
    "were striking thirteen.",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
]
TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Q: What is 12 times 7?\nA:",
]


@pytest.fixture(scope="module")
def prompts(make_engine: Callable[..., LLMEngine]) -> list[list[int]]:
    tok = make_engine().tokenizer
    out = [tok.encode(t) for t in TEXTS]
    for q in QUOTES:  # "repeat this text": the continuation quotes the prompt, n-grams hit
        chat = tok.apply_chat_template(
            [{"role": "user", "content": f"Repeat this text exactly:\n{q}"}], add_generation_prompt=True
        )
        out.append(tok.encode(chat, add_special_tokens=False))
    return out


@pytest.fixture(scope="module")
def references(
    prompts: list[list[int]], hf_smollm2: Any, make_engine: Callable[..., LLMEngine]
) -> list[Reference]:
    eos = set(make_engine().eos_token_ids)
    return [hf_greedy(hf_smollm2, p, MAX_NEW, eos) for p in prompts]


@pytest.fixture(scope="module")
def plain_outputs(make_engine: Callable[..., LLMEngine], prompts: list[list[int]]) -> list[list[int]]:
    return [s.output_token_ids for s in make_engine().generate(prompts, greedy())]


def greedy(n: int = MAX_NEW, **kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, **kw)


def check(
    engine: LLMEngine,
    prompts: list[list[int]],
    refs: list[Reference],
    plain: list[list[int]],
    label: str,
    require_speculation: bool = True,
) -> None:
    seqs = engine.generate(prompts, greedy())
    for i, (seq, ref, want) in enumerate(zip(seqs, refs, plain, strict=True)):
        assert seq.output_token_ids == want, f"{label} prompt {i}: differs from the plain engine"
        assert_matches_reference(seq.output_token_ids, ref, f"{label} prompt {i}")
    assert engine.block_manager.usage == 0.0, "blocks leaked after every request finished"
    engine.block_manager.check_invariants()
    stats = engine.stats()
    assert stats.spec_num_draft_tokens is not None and stats.spec_num_accepted_tokens is not None
    if require_speculation:
        assert 0 < stats.spec_num_accepted_tokens <= stats.spec_num_draft_tokens, "nothing was speculated"


@pytest.mark.parametrize("k", [1, 8])
def test_ngram_single_requests_match_plain_and_hf(
    make_engine: Callable[..., LLMEngine],
    prompts: list[list[int]],
    references: list[Reference],
    plain_outputs: list[list[int]],
    k: int,
) -> None:
    engine = make_engine(speculative_method="ngram", num_speculative_tokens=k, speculative_adaptive=False)
    steps = 0
    for i, p in enumerate(prompts):
        before = engine.num_steps
        (seq,) = engine.generate([p], greedy())
        assert seq.output_token_ids == plain_outputs[i], f"k={k} prompt {i}"
        assert_matches_reference(seq.output_token_ids, references[i], f"k={k} prompt {i}")
        steps += engine.num_steps - before
    stats = engine.stats()
    assert stats.spec_num_accepted_tokens is not None and stats.spec_num_accepted_tokens > 0
    # accepted proposals are tokens that needed no step of their own
    total_out = sum(len(o) for o in plain_outputs)
    assert steps == total_out - stats.spec_num_accepted_tokens
    assert engine.block_manager.usage == 0.0
    engine.block_manager.check_invariants()


def test_quoting_prompt_needs_far_fewer_steps(
    make_engine: Callable[..., LLMEngine], prompts: list[list[int]]
) -> None:
    plain = make_engine()
    spec = make_engine(**NGRAM)
    a = plain.generate([prompts[3]], greedy(48))[0].output_token_ids
    b = spec.generate([prompts[3]], greedy(48))[0].output_token_ids
    assert a == b
    assert spec.num_steps * 2 < plain.num_steps, (spec.num_steps, plain.num_steps)
    st = spec.stats()
    assert (
        st.spec_num_drafts and st.spec_num_emitted_tokens == st.spec_num_accepted_tokens + st.spec_num_drafts
    )


def test_ngram_batch_matches_plain_and_hf(
    make_engine: Callable[..., LLMEngine],
    prompts: list[list[int]],
    references: list[Reference],
    plain_outputs: list[list[int]],
) -> None:
    engine = make_engine(enable_prefix_caching=False, speculative_adaptive=False, **NGRAM)
    check(engine, prompts, references, plain_outputs, "batch")


def test_ngram_adaptive_batch_matches(
    make_engine: Callable[..., LLMEngine],
    prompts: list[list[int]],
    references: list[Reference],
    plain_outputs: list[list[int]],
) -> None:
    engine = make_engine(**NGRAM)
    # five sequences together: the CPU cost model (S = 6) finds speculation not worth it at first
    check(engine, prompts, references, plain_outputs, "adaptive", require_speculation=False)
    # alone, a quoting request speculates
    before = engine.stats().spec_num_accepted_tokens or 0
    (seq,) = engine.generate([prompts[3]], greedy())
    assert seq.output_token_ids == plain_outputs[3]
    assert (engine.stats().spec_num_accepted_tokens or 0) > before


def test_ngram_chunked_prefill_matches(
    make_engine: Callable[..., LLMEngine],
    prompts: list[list[int]],
    references: list[Reference],
    plain_outputs: list[list[int]],
) -> None:
    # a 16-token budget: prefill chunks, decodes and whole proposal sets compete for each step
    engine = make_engine(
        max_num_batched_tokens=16, enable_prefix_caching=False, speculative_adaptive=False, **NGRAM
    )
    check(engine, prompts, references, plain_outputs, "chunked")


def test_ngram_under_kv_pressure_preempts_and_matches(
    make_engine: Callable[..., LLMEngine],
    prompts: list[list[int]],
    references: list[Reference],
    plain_outputs: list[list[int]],
) -> None:
    # three copies of a quoting prompt in a pool where two fit at admission but not once both have
    # grown by a block: proposals are dropped and then a sequence is preempted and recomputed
    probe = make_engine()
    bm = probe.block_manager
    # the last token computed is at position len + MAX_NEW - 2
    grown = bm.blocks_needed(len(prompts[3]) + MAX_NEW - 1)
    assert grown > bm.blocks_needed(len(prompts[3]))
    engine = make_engine(
        kv_cache_memory=(2 * grown - 1) * probe.runner.geometry.bytes_per_block,
        enable_prefix_caching=False,
        speculative_adaptive=False,
        **NGRAM,
    )
    check(engine, [prompts[3]] * 3, [references[3]] * 3, [plain_outputs[3]] * 3, "pressure")
    assert engine.stats().num_preemptions > 0


def test_ngram_with_prefix_caching_cold_and_warm(
    make_engine: Callable[..., LLMEngine],
    prompts: list[list[int]],
    references: list[Reference],
    plain_outputs: list[list[int]],
) -> None:
    engine = make_engine(enable_prefix_caching=True, speculative_adaptive=False, **NGRAM)
    check(engine, prompts, references, plain_outputs, "cold cache")
    check(engine, prompts, references, plain_outputs, "warm cache")
    # a request whose prompt is an earlier request's prompt + output reuses blocks that were
    # completed by accepted proposals
    (first,) = engine.generate([prompts[3]], greedy())
    (again,) = engine.generate([first.token_ids], greedy(8))
    assert again.num_cached_tokens >= (len(first.token_ids) // 16 - 1) * 16
    plain = make_engine().generate([first.token_ids], greedy(8))[0]
    assert again.output_token_ids == plain.output_token_ids


def test_penalties_min_tokens_logprobs_and_lengths_are_those_of_plain_decoding(
    make_engine: Callable[..., LLMEngine], prompts: list[list[int]]
) -> None:
    params = [
        greedy(20, repetition_penalty=1.3, logprobs=2),
        greedy(20, frequency_penalty=0.5, presence_penalty=0.3),
        greedy(17, min_tokens=17, ignore_eos=True, logprobs=0),
    ]
    batch = [prompts[3], prompts[4], prompts[3]]
    plain = make_engine().generate(batch, params)
    spec = make_engine(speculative_adaptive=False, **NGRAM).generate(batch, params)
    for a, b in zip(plain, spec, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert len(a.logprobs) == len(b.logprobs)
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-3)
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
    assert len(spec[2].output_token_ids) == 17 and spec[2].finish_reason == "length"


def test_seeded_sampling_with_ngram_runs_and_is_reproducible(
    make_engine: Callable[..., LLMEngine], prompts: list[list[int]]
) -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9, seed=7, max_tokens=32)
    engine = make_engine(speculative_adaptive=False, **NGRAM)
    a = engine.generate([prompts[3]], params)[0].output_token_ids
    b = engine.generate([prompts[3]], params)[0].output_token_ids
    assert a == b and len(a) > 0
    st = engine.stats()
    assert st.spec_num_accepted_tokens is not None and st.spec_num_accepted_tokens > 0
    assert engine.block_manager.usage == 0.0


def test_disable_by_batch_size_turns_speculation_off(
    make_engine: Callable[..., LLMEngine], prompts: list[list[int]], plain_outputs: list[list[int]]
) -> None:
    engine = make_engine(speculative_disable_by_batch_size=2, speculative_adaptive=False, **NGRAM)
    seqs = engine.generate(prompts, greedy())
    assert [s.output_token_ids for s in seqs] == plain_outputs
    assert engine.stats().spec_num_draft_tokens == 0  # five requests ran together throughout
    assert make_engine().stats().spec_num_draft_tokens is None  # off: the metric is absent


def _config(*argv: str) -> Any:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return build_config(parser.parse_args(list(argv)))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--speculative-method", "ngram", "--num-speculative-tokens", "0"], "--num-speculative-tokens"),
        (["--speculative-method", "ngram", "--num-speculative-tokens", "17"], "--num-speculative-tokens"),
        (["--speculative-method", "ngram"], "needs --num-speculative-tokens"),
        (["--num-speculative-tokens", "3"], "needs --speculative-method"),
        (["--speculative-method", "draft", "--num-speculative-tokens", "3"], "--speculative-model"),
        (
            ["--speculative-method", "ngram", "--num-speculative-tokens", "3", "--prompt-lookup-min", "5"],
            "--prompt-lookup-min",
        ),
    ],
)
def test_bad_speculative_settings_are_refused_naming_the_flag(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _config(*argv)


def test_speculative_settings_from_a_config_file(tmp_path: Any) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("speculative_method: ngram\nnum_speculative_tokens: 5\nprompt_lookup_max: 3\n")
    cfg = _config("--config", str(path))
    assert (cfg.speculative_method, cfg.num_speculative_tokens, cfg.prompt_lookup_max) == ("ngram", 5, 3)
    path.write_text("speculative_method: ngram\nnum_speculative_tokens: 40\n")
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        _config("--config", str(path))
