"""A long prompt on the default path (the builtin GGUF's blocks): computed in prefill chunks of any
size it gives the log-probabilities and the greedy answer it gives in one step.

With float32 activations (`--qmatmul-activations float`) the chunk size decides which kernels run (a
chunk of 96 rows takes the tiled float-activation matmul, more rows dequantize + torch's matmul; the
attention kernel's tiles start at absolute key positions whatever the chunk), so the sums differ
only in order: every position's log-probability agrees to float32 rounding, and a chunk that attended
to the wrong keys (a wrong causal bound or context at a chunk boundary) would miss by far more.

With the activations rounded to bfloat16 (the default where the CPU has AVX512-BF16), a sum-order
difference of one float32 ulp moves an activation across a bfloat16 rounding boundary now and then
(the kernel's chains of partial sums depend on how many rows a chunk leaves in its last pass), and
that step of 2^-8 carries on through the layers: measured on the AMD EPYC (2026-12-03), chunks of
96 and 128 bit-identical to one step, chunks of 250 0.009 apart on average and 0.147 at worst, the
same answer. That is the rounding's noise, not a wrong key, so it has its own bound. A bfloat16 KV cache
(the CPU default under float32 activations) rounds the keys and values the same way and gets the
same bound (measured: chunks of 96 0.084 apart at worst, 0.007 on average); a float32 cache keeps the
float32 bound."""

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


def prompt_and_answer(
    chunk: int, activations: str | None = None, kv_cache_dtype: str = "auto"
) -> tuple[list[float], list[int]]:
    """The prompt's log-probabilities (positions 1..) and the greedy answer, prefill in `chunk`s
    (`activations`: --qmatmul-activations; None: the default path's)."""
    from kvpilot.runtime.engine.build import build_engine

    engine = build_engine(
        EngineConfig(
            kv_cache_memory=2**27,
            max_num_seqs=2,
            max_num_batched_tokens=chunk,
            enable_prefix_caching=False,
            qmatmul_activations=activations,
            kv_cache_dtype=kv_cache_dtype,
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


# bfloat16 activations: the bound on the worst position and on the mean (measured 0.147 and 0.009)
TOL_BF16, MEAN_TOL_BF16 = 0.5, 0.03


@pytest.mark.parametrize(
    ("activations", "kv_cache_dtype"), [("float", "float32"), ("float", "auto"), ("bf16", "auto")]
)
def test_a_long_prompt_in_chunks_scores_and_answers_as_in_one_step(
    activations: str, kv_cache_dtype: str
) -> None:
    if not qlinear.available():
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    if isa.selected() not in ("avx512", "avx2"):
        pytest.skip("the default path dequantizes at the generic ISA level")
    whole, answer = prompt_and_answer(2048, activations, kv_cache_dtype)
    for chunk in (96, 250):
        lps, got = prompt_and_answer(chunk, activations, kv_cache_dtype)
        diffs = [abs(a - b) for a, b in zip(lps, whole, strict=True)]
        worst, mean = max(diffs), sum(diffs) / len(diffs)
        summary = f"chunks of {chunk}: a prompt log-probability differs by {worst:.2e} (mean {mean:.2e})"
        if (activations, kv_cache_dtype) == ("float", "float32"):  # nothing rounded to bfloat16
            assert worst < TOL, summary
        else:
            assert worst < TOL_BF16 and mean < MEAN_TOL_BF16, summary
        assert got == answer
