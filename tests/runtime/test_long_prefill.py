"""A long prompt on the default path (the builtin GGUF's blocks, float32 activations): computed in
prefill chunks of any size it gives the log-probabilities and the greedy answer it gives in one step.

The chunk size decides which kernels run (a chunk of 96 rows takes the tiled float-activation matmul,
more rows dequantize + torch's matmul; the attention kernel's tiles start at absolute key positions
whatever the chunk), so the sums differ only in order: every position's log-probability agrees to
float32 rounding, and a chunk that attended to the wrong keys (a wrong causal bound or context at a
chunk boundary) would miss by far more."""

from __future__ import annotations

import pytest

from kvpilot.kernels import isa, qlinear
from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.sampling_params import SamplingParams
from tests.needs import missing
from tests.runtime.quality import TEXT

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOL = 1e-3  # float32 against float32, the sums in another order (tests/runtime/test_prompt_logprobs.py)
PROMPT_TOKENS = 400
ANSWER_TOKENS = 8


def prompt_and_answer(chunk: int) -> tuple[list[float], list[int]]:
    """The prompt's log-probabilities (positions 1..) and the greedy answer, prefill in `chunk`s."""
    from kvpilot.runtime.engine.build import build_engine

    engine = build_engine(
        EngineConfig(
            kv_cache_memory=2**27, max_num_seqs=2, max_num_batched_tokens=chunk, enable_prefix_caching=False
        )
    )
    ids = engine.tokenizer.encode(TEXT, add_special_tokens=False)
    prompt = (ids * (PROMPT_TOKENS // len(ids) + 1))[:PROMPT_TOKENS]
    params = SamplingParams(max_tokens=ANSWER_TOKENS, temperature=0.0, ignore_eos=True, prompt_logprobs=1)
    engine.add_request("r", prompt, params)
    seq = engine.requests["r"].seq
    steps, carried = 0, []
    while engine.has_unfinished():
        steps += 1
        carried += [o.prompt_logprobs for o in engine.step() if o.prompt_logprobs is not None]
    assert len(carried) == 1
    assert steps >= ANSWER_TOKENS + (PROMPT_TOKENS + chunk - 1) // chunk - 1  # it did run in chunks
    lps = carried[0]
    assert len(lps) == len(prompt) and lps[0] is None
    assert all(lp is not None and lp.token_id == t for lp, t in zip(lps[1:], prompt[1:], strict=True))
    return [lp.logprob for lp in lps[1:] if lp is not None], list(seq.output_token_ids)


def test_a_long_prompt_in_chunks_scores_and_answers_as_in_one_step() -> None:
    if not qlinear.available():
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    if isa.selected() not in ("avx512", "avx2"):
        pytest.skip("the default path dequantizes at the generic ISA level")
    whole, answer = prompt_and_answer(2048)
    for chunk in (96, 250):
        lps, got = prompt_and_answer(chunk)
        worst = max(abs(a - b) for a, b in zip(lps, whole, strict=True))
        assert worst < TOL, f"chunks of {chunk}: a prompt log-probability differs by {worst:.2e}"
        assert got == answer
