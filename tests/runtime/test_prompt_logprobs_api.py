"""Prompt logprobs over HTTP with the official `openai` client: /v1/completions' echo + logprobs (what
lm-eval's local-completions sends for every log-likelihood task: token ids, echo, logprobs=1,
max_tokens=1, temperature 0) and max_tokens=0, and vLLM's prompt_logprobs; a real engine on SmolLM2
in float32 that prefills in 16-token chunks with prefix caching on, against transformers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest
import torch
from fake_engine import LiveServer

from tests.runtime.quality import TEXT

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("one_torch_thread")]

TOL = 1e-3


@pytest.fixture(scope="module")
def served(make_engine: Callable[..., Any]) -> Iterator[tuple[openai.OpenAI, Any]]:
    from kvpilot.runtime.engine.async_engine import AsyncEngine

    engine = AsyncEngine(
        make_engine(max_model_len=512, max_num_batched_tokens=16, enable_prefix_caching=True)
    )
    engine.start()
    live = LiveServer(engine, model_name=engine.model_name)
    yield openai.OpenAI(base_url=live.url + "/v1", api_key="none", max_retries=0, timeout=120), engine
    live.close()


@pytest.fixture(scope="module")
def prompt(served: tuple[openai.OpenAI, Any]) -> list[int]:
    ids: list[int] = served[1].tokenizer.encode(TEXT, add_special_tokens=False)
    return ids[:60]


@pytest.fixture(scope="module")
def reference(hf_smollm2: Any, prompt: list[int]) -> list[float]:
    """transformers' teacher-forced logprob of each prompt token after the first (float32)."""
    with torch.inference_mode():
        logp = torch.log_softmax(hf_smollm2(torch.tensor([prompt])).logits[0].float(), dim=-1)
    return [logp[i - 1, prompt[i]].item() for i in range(1, len(prompt))]


@pytest.fixture(scope="module")
def first_choices(make_engine: Callable[..., Any], prompt: list[int]) -> list[int]:
    """The model's first choice after each prefix of the prompt (a separate, offline engine)."""
    return list(make_engine(max_model_len=512).next_token_choices(prompt))


def close(a: list[float], b: list[float]) -> float:
    assert len(a) == len(b)
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_echo_with_logprobs_as_lm_eval_sends_it(
    served: tuple[openai.OpenAI, Any], prompt: list[int], reference: list[float], first_choices: list[int]
) -> None:
    c, engine = served
    out = c.completions.create(
        model=engine.model_name, prompt=prompt, echo=True, logprobs=1, max_tokens=1, temperature=0, seed=1234
    )
    choice = out.choices[0]
    lp = choice.logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs and lp.text_offset
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(prompt) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert close([float(x) for x in lp.token_logprobs[1 : len(prompt)]], reference) < TOL
    prompt_text = engine.tokenizer.decode(prompt, skip_special_tokens=False)
    assert choice.text.startswith(prompt_text) and len(choice.text) > len(prompt_text)
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    # lm-eval's parse_logprobs: the continuation's sum and whether every token was the greedy one
    ctxlen = 40
    cont = lp.token_logprobs[ctxlen:-1]
    assert sum(cont) == pytest.approx(sum(reference[ctxlen - 1 :]), abs=20 * TOL)
    greedy = [tok == max(top.values()) for tok, top in zip(cont, lp.top_logprobs[ctxlen:-1], strict=True)]
    argmax = [t == prompt[i + 1] for i, t in enumerate(first_choices)]
    assert greedy == argmax[ctxlen - 1 :]
    assert out.usage is not None and out.usage.completion_tokens == 1


def test_max_tokens_zero_scores_the_prompt_alone(
    served: tuple[openai.OpenAI, Any], prompt: list[int], reference: list[float]
) -> None:
    c, engine = served
    text = engine.tokenizer.decode(prompt, skip_special_tokens=False)
    for _ in range(2):  # the second time the prompt's blocks are in the prefix cache
        out = c.completions.create(model=engine.model_name, prompt=text, echo=True, logprobs=3, max_tokens=0)
        choice = out.choices[0]
        assert choice.text == text and choice.finish_reason == "length"
        lp = choice.logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert len(lp.token_logprobs) == len(prompt)
        assert close([float(x) for x in lp.token_logprobs[1:]], reference) < TOL
        assert all(len(top) == 3 for top in lp.top_logprobs[1:])
        assert out.usage is not None and out.usage.completion_tokens == 0


def test_vllm_prompt_logprobs(
    served: tuple[openai.OpenAI, Any], prompt: list[int], reference: list[float]
) -> None:
    c, engine = served
    out = c.completions.create(
        model=engine.model_name, prompt=prompt, max_tokens=2, temperature=0, extra_body={"prompt_logprobs": 2}
    )
    choice = out.choices[0]
    plp = (choice.model_extra or {})["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None
    got = [entry[str(t)]["logprob"] for entry, t in zip(plp[1:], prompt[1:], strict=True)]
    assert close(got, reference) < TOL
    for entry, t in zip(plp[1:], prompt[1:], strict=True):
        assert next(iter(entry)) == str(t)  # the prompt token first, then the top 2
        assert sorted(v["rank"] for v in entry.values())[:2] == [1, 2] and 2 <= len(entry) <= 3
        assert all(
            v["decoded_token"] == engine.tokenizer.decode([int(k)], skip_special_tokens=False)
            for k, v in entry.items()
        )
    assert choice.logprobs is None and not choice.text.startswith(engine.tokenizer.decode(prompt[:5]))


def test_streamed_echo_with_logprobs_equals_the_whole_response(
    served: tuple[openai.OpenAI, Any], prompt: list[int]
) -> None:
    c, engine = served
    args: dict[str, Any] = dict(
        model=engine.model_name, prompt=prompt[:30], echo=True, logprobs=2, max_tokens=4, temperature=0
    )
    whole = c.completions.create(**args).choices[0]
    text, lps, offsets = "", [], []
    for chunk in c.completions.create(stream=True, **args):
        for ch in chunk.choices:
            text += ch.text
            if ch.logprobs is not None:
                lps += ch.logprobs.token_logprobs or []
                offsets += ch.logprobs.text_offset or []
    assert whole.logprobs is not None
    assert (
        text == whole.text and lps == whole.logprobs.token_logprobs and offsets == whole.logprobs.text_offset
    )


def test_refusals_name_their_field(served: tuple[openai.OpenAI, Any]) -> None:
    c, engine = served
    m = engine.model_name
    cases: list[tuple[Callable[[], Any], str]] = [
        (lambda: c.completions.create(model=m, prompt="Hi", max_tokens=0), "max_tokens"),
        (
            lambda: c.completions.create(
                model=m, prompt="Hi", max_tokens=0, echo=True, extra_body={"min_tokens": 1}
            ),
            "max_tokens",
        ),
        (
            lambda: c.completions.create(
                model=m, prompt="Hi", stream=True, extra_body={"prompt_logprobs": 1}
            ),
            "prompt_logprobs",
        ),
        (
            lambda: c.completions.create(model=m, prompt="Hi", extra_body={"prompt_logprobs": -1}),
            "prompt_logprobs",
        ),
        (
            lambda: c.chat.completions.create(
                model=m, messages=[{"role": "user", "content": "Hi"}], extra_body={"prompt_logprobs": 1}
            ),
            "prompt_logprobs",
        ),
    ]
    for call, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert isinstance(info.value.body, dict) and info.value.body.get("param") == param, info.value.body
