"""The default settings answer as faithfully to the model's float32 reference as transformers' bf16
does, at every CPU kernel level this machine can run (issue 22: the AVX-512 BF16 default once
answered "What is the capital of France?" with "L'Étoile, la Marseillaise, la femme, ...").

Each level runs in its own process (KVPILOT_CPU_ISA, read once in kernels/switches.py; the avx2 level
also caps torch's ATen, oneDNN and MKL, as an AVX2-only CPU). Measured on tests/runtime/quality.py's
public-domain text (teacher-forced next-token agreement over ~670 tokens) and chat questions (greedy
answers identical to float32's); benchmarks/runtime_quality.py dtype prints the same figures for every path.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from kvpilot.kernels import isa
from tests.needs import require_module
from tests.runtime.quality import ANSWER_TOKENS, QUESTIONS, TEXT, agreement, same_answers
from tests.runtime.test_default_path import HERE_ACTIVATIONS

if TYPE_CHECKING:
    from kvpilot.runtime.engine.core import LLMEngine

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from quality import dtype as dtype_quality  # noqa: E402

pytestmark = pytest.mark.slow
ASKED = QUESTIONS[:8]  # transformers' generate is the slow part of the test; the benchmark asks all


@pytest.fixture(scope="module")
def float32_reference(make_engine: Callable[..., LLMEngine]) -> dict[str, Any]:
    """kvpilot's float32 choices and answers (they equal transformers' float32 ones: the parity tests)."""
    from kvpilot.runtime.engine.sampling_params import SamplingParams

    engine = make_engine()
    tok = engine.tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    prompts = [
        tok.encode(tok.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in ASKED
    ]
    params = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS)
    answers = [s.output_token_ids for s in engine.generate(prompts, params)]
    return {
        "text_ids": ids,
        "prompts": prompts,
        "choices": engine.next_token_choices(ids),
        "answers": answers,
    }


@pytest.fixture(scope="module")
def transformers_bf16(float32_reference: dict[str, Any]) -> dict[str, float]:
    """What transformers in bfloat16 gets on the same measures: the bar."""
    require_module("transformers", "pip install -e .[test]")
    from kvpilot.runtime.config import DEFAULT_MODEL
    from kvpilot.runtime.load.loader import resolve_model_path
    from kvpilot.runtime.load.tokenizer import Tokenizer

    eos = sorted(Tokenizer.from_gguf(resolve_model_path(DEFAULT_MODEL)).eos_token_ids)
    ref = float32_reference
    hf = dtype_quality.run_hf("bfloat16", ref["text_ids"], ref["prompts"], eos)
    return {
        "teacher_forced": agreement(hf["choices"], ref["choices"]),
        "answers": same_answers(hf["answers"], ref["answers"]),
    }


@pytest.mark.parametrize("level", isa.runnable())
def test_default_dtype_tracks_float32_at_least_as_well_as_transformers_bf16(
    level: str, float32_reference: dict[str, Any], transformers_bf16: dict[str, float], tmp_path: Path
) -> None:
    ours = dtype_quality.spawn(f"kvpilot:auto@{level}", tmp_path / "out.json")
    ref = float32_reference
    assert ours["text_ids"] == ref["text_ids"]
    teacher = agreement(ours["choices"], ref["choices"])
    answers = same_answers(ours["answers"][: len(ASKED)], ref["answers"])
    france = ours["answer_text"][ASKED.index("What is the capital of France?")]
    summary = f"level {level}: {teacher:.4f} / {answers} answers vs transformers bf16 {transformers_bf16}"
    assert "Paris" in france, f"{summary}; France: {france!r}"
    assert teacher >= transformers_bf16["teacher_forced"], summary
    assert answers >= transformers_bf16["answers"], summary
    assert teacher >= 0.97, summary  # a floor of its own: the measured figures are in docs/runtime.md


def test_the_default_path_on_a_q4_k_m_style_file_tracks_its_float32_model(
    transformers_bf16: dict[str, float], tmp_path: Path
) -> None:
    """A file mixing Q4_1 with Q6_K (every ffn_down) and Q5_0 (odd layers' attn_v, so their fused
    q/k/v mixes widths), as Q4_K_M files mix Q4_K and Q6_K: the default path takes it (those types
    requantized to int8 at load) and answers as faithfully to that file's float32 model as
    transformers' bf16 does to the builtin's."""
    from quality import requant

    from kvpilot.runtime.config import DEFAULT_MODEL
    from kvpilot.runtime.load.loader import resolve_model_path

    mixed = tmp_path / "mixed.gguf"
    types = set(requant.write_mixed_file(resolve_model_path(DEFAULT_MODEL), mixed).values())
    assert {"Q4_1", "Q6_K", "Q5_0"} <= types
    ref = dtype_quality.spawn(
        "kvpilot:float32+quantization=none+kv=float32", tmp_path / "ref.json", model=mixed
    )
    ours = dtype_quality.spawn("kvpilot:auto", tmp_path / "ours.json", model=mixed)
    # its Q4_1 layers (defaults.FOUR_BIT_TYPES): the builtin file's choice on this machine
    assert (ours["quantization"], ours["qmatmul_activations"]) == ("auto", HERE_ACTIVATIONS)
    teacher = agreement(ours["choices"], ref["choices"])
    answers = same_answers(ours["answers"][: len(ASKED)], ref["answers"][: len(ASKED)])
    summary = f"{teacher:.4f} / {answers} answers vs transformers bf16 {transformers_bf16}"
    assert teacher >= transformers_bf16["teacher_forced"], summary
    assert answers >= transformers_bf16["answers"], summary
