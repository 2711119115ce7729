"""Prompt log-probabilities (SamplingParams.prompt_logprobs) against transformers' teacher-forced
log-probabilities of the same GGUF in float32: in one prefill, in chunks smaller than the prompt,
with the prompt's blocks already in the prefix cache, and after preemption."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
import torch

from kvpilot.runtime.engine.protocol import RequestOutput, TokenLogprob
from kvpilot.runtime.engine.sampling_params import SamplingParams
from tests.runtime.quality import TEXT

if TYPE_CHECKING:
    from kvpilot.runtime.engine.core import LLMEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-3  # float32 against float32: the same weights, a different order of sums
K = 3


@pytest.fixture(scope="module")
def prompt(make_engine: Callable[..., LLMEngine]) -> list[int]:
    ids: list[int] = make_engine().tokenizer.encode(TEXT, add_special_tokens=False)
    return ids[:90]


@pytest.fixture(scope="module")
def reference(hf_smollm2: Any, prompt: list[int]) -> torch.Tensor:
    """transformers' log-softmax at every position of the prompt, float32 [len, vocab]."""
    with torch.inference_mode():
        logits = hf_smollm2(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def run(
    engine: LLMEngine, prompts: list[list[int]], params: list[SamplingParams]
) -> dict[str, list[RequestOutput]]:
    """Every RequestOutput of each request, by request id ("r0", "r1", ...)."""
    outs: dict[str, list[RequestOutput]] = {f"r{i}": [] for i in range(len(prompts))}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
    return outs


def prompt_logprobs_of(outs: list[RequestOutput]) -> list[TokenLogprob | None]:
    """The one output that carries them (they are sent once)."""
    carried = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
    assert len(carried) == 1, f"prompt logprobs sent {len(carried)} times"
    return carried[0]


def check(lps: list[TokenLogprob | None], prompt: list[int], ref: torch.Tensor) -> None:
    assert len(lps) == len(prompt) and lps[0] is None
    diffs = []
    for i, lp in enumerate(lps[1:], start=1):
        assert lp is not None and lp.token_id == prompt[i]
        row = ref[i - 1]
        diffs.append(abs(lp.logprob - row[prompt[i]].item()))
        assert lp.rank == int((row > row[prompt[i]]).sum()) + 1 or abs(lp.logprob - row.max().item()) < TOL
        vals, ids = row.topk(K)
        assert [t for t, _ in lp.top] == ids.tolist() or max(
            abs(a - b) for a, b in zip(vals.tolist(), [v for _, v in lp.top], strict=True)
        ) < TOL
        assert max(abs(v - row[t].item()) for t, v in lp.top) < TOL
    assert max(diffs) < TOL, f"max |kvpilot - transformers| = {max(diffs):.2e}"


def test_prompt_logprobs_match_transformers(
    make_engine: Callable[..., LLMEngine], prompt: list[int], reference: torch.Tensor
) -> None:
    engine = make_engine()
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=K)
    outs = run(engine, [prompt], [params])["r0"]
    check(prompt_logprobs_of(outs), prompt, reference)
    # the request still generates as one without prompt logprobs does
    plain = engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))[0]
    assert [t for o in outs for t in o.output.new_token_ids] == plain.output_token_ids


def test_prompt_logprobs_in_prefill_chunks(
    make_engine: Callable[..., LLMEngine], prompt: list[int], reference: torch.Tensor
) -> None:
    """A 90-token prompt in chunks of 16 (the smallest step), beside a request without them."""
    engine = make_engine(max_num_batched_tokens=16)
    other = prompt[5:40]
    outs = run(
        engine,
        [prompt, other],
        [
            SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=K),
            SamplingParams(max_tokens=3, temperature=0.0),
        ],
    )
    check(prompt_logprobs_of(outs["r0"]), prompt, reference)
    assert all(o.prompt_logprobs is None for o in outs["r1"])
    alone = make_engine().generate([other], SamplingParams(max_tokens=3, temperature=0.0))[0]
    assert [t for o in outs["r1"] for t in o.output.new_token_ids] == alone.output_token_ids


def test_prompt_logprobs_with_the_prompt_in_the_prefix_cache(
    make_engine: Callable[..., LLMEngine], prompt: list[int], reference: torch.Tensor
) -> None:
    """The prompt's blocks are cached by an earlier request: a request for prompt logprobs computes
    every position anyway (it does not read the cache), and the cache still serves the others."""
    engine = make_engine(enable_prefix_caching=True)
    first = run(engine, [prompt], [SamplingParams(max_tokens=1, temperature=0.0)])["r0"]
    assert first[-1].num_cached_tokens == 0
    outs = run(engine, [prompt], [SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=K)])["r0"]
    assert outs[-1].num_cached_tokens == 0
    check(prompt_logprobs_of(outs), prompt, reference)
    again = run(engine, [prompt], [SamplingParams(max_tokens=1, temperature=0.0)])["r0"]
    assert again[-1].num_cached_tokens > 0


def test_prompt_logprobs_survive_preemption(
    make_engine: Callable[..., LLMEngine], prompt: list[int], reference: torch.Tensor
) -> None:
    """A KV pool too small for both requests: one is preempted and recomputed; its prompt logprobs
    are each recorded once, and still right."""
    probe = make_engine()
    block_bytes = probe.runner.geometry.bytes_per_block
    blocks = (len(prompt) + 40) // probe.block_manager.block_size + 2
    engine = make_engine(
        kv_cache_memory=blocks * block_bytes, max_num_batched_tokens=32, enable_prefix_caching=False
    )
    outs = run(
        engine,
        [prompt, prompt[::-1]],
        [SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, prompt_logprobs=K)] * 2,
    )
    assert engine.scheduler.num_preemptions > 0
    check(prompt_logprobs_of(outs["r0"]), prompt, reference)
    assert len(prompt_logprobs_of(outs["r1"])) == len(prompt)


def test_prompt_logprobs_with_no_alternatives(
    make_engine: Callable[..., LLMEngine], prompt: list[int]
) -> None:
    outs = run(make_engine(), [prompt[:10]], [SamplingParams(max_tokens=1, prompt_logprobs=0)])["r0"]
    lps = prompt_logprobs_of(outs)
    assert len(lps) == 10 and all(lp is not None and lp.top == [] for lp in lps[1:])
