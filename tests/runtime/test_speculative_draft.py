"""Draft-model speculation on the real SmolLM2 target: a tiny random-weight draft with SmolLM2's
tokenizer (low acceptance, identical greedy outputs), SmolLM2 as its own draft (near-total
acceptance, which only holds while the draft's KV cache stays in step through rollbacks and
preemption), and drafts with another vocabulary refused naming the flag."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.build import engine_from_loaded
from kvpilot.runtime.engine.core import LLMEngine
from kvpilot.runtime.engine.sampling_params import SamplingParams
from kvpilot.runtime.load.loader import LoadedModel, load_model

MAX_NEW = 16
TEXTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Repeat this text exactly: the quick brown fox jumps over the lazy dog, the quick brown fox",
]


def write_tiny_draft(directory: Path, target: LoadedModel, vocab_size: int | None = None) -> None:
    """A 2-layer random-weight Llama; with the target's tokenizer unless vocab_size is given."""
    import transformers as tf

    vocab = vocab_size or int(target.arch.vocab_size)
    cfg = tf.LlamaConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=target.max_model_len,
        tie_word_embeddings=True,
        eos_token_id=2,
        bos_token_id=1,
    )
    torch.manual_seed(4321)
    model = tf.LlamaForCausalLM(cfg).to(torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(directory)
    if vocab_size is None:
        target.tokenizer.backend.save(str(directory / "tokenizer.json"))
        config = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    else:
        from tokenizers import Tokenizer, models, pre_tokenizers

        words = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
        tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.Whitespace()
        tok.save(str(directory / "tokenizer.json"))
        config = {"bos_token": "<s>", "eos_token": "</s>"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory: pytest.TempPathFactory, smollm2_fp32: LoadedModel) -> Path:
    d = tmp_path_factory.mktemp("tiny-draft")
    write_tiny_draft(d, smollm2_fp32)
    return d


@pytest.fixture(scope="module")
def tiny_draft(draft_dir: Path) -> LoadedModel:
    return load_model(EngineConfig(model=str(draft_dir)), torch.device("cpu"), torch.float32)


@pytest.fixture(scope="module")
def prompts(smollm2_fp32: LoadedModel) -> list[list[int]]:
    return [smollm2_fp32.tokenizer.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def plain_outputs(make_engine: Callable[..., LLMEngine], prompts: list[list[int]]) -> list[list[int]]:
    return [s.output_token_ids for s in make_engine().generate(prompts, greedy())]


def greedy(n: int = MAX_NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


def draft_engine(
    target: LoadedModel, draft: LoadedModel, draft_path: str, k: int = 3, **overrides: Any
) -> LLMEngine:
    settings: dict[str, Any] = {
        "dtype": "float32",
        "kv_cache_memory": 256 * 2**20,
        "speculative_method": "draft",
        "speculative_model": draft_path,
        "num_speculative_tokens": k,
        "speculative_adaptive": False,
        **overrides,
    }
    return engine_from_loaded(target, EngineConfig(**settings), draft=draft)


def finish(engine: LLMEngine) -> None:
    assert engine.block_manager.usage == 0.0
    engine.block_manager.check_invariants()


def test_random_draft_keeps_greedy_outputs(
    smollm2_fp32: LoadedModel,
    tiny_draft: LoadedModel,
    draft_dir: Path,
    prompts: list[list[int]],
    plain_outputs: list[list[int]],
) -> None:
    engine = draft_engine(smollm2_fp32, tiny_draft, str(draft_dir), enable_prefix_caching=True)
    for label in ("cold", "warm prefix cache"):
        seqs = engine.generate(prompts, greedy())
        assert [s.output_token_ids for s in seqs] == plain_outputs, label
        finish(engine)
    st = engine.stats()
    assert st.spec_num_draft_tokens and st.spec_num_accepted_tokens is not None
    assert st.spec_num_accepted_tokens < st.spec_num_draft_tokens  # a random draft is mostly wrong


def test_the_target_as_its_own_draft_is_almost_always_accepted(
    smollm2_fp32: LoadedModel, prompts: list[list[int]]
) -> None:
    """Acceptance stays near 1 only if the draft's K/V is exactly the context: catch-up after
    a rejection, after a full acceptance (two tokens) and after preemption all have to be right."""
    probe = engine_from_loaded(smollm2_fp32, EngineConfig(dtype="float32", kv_cache_memory=256 * 2**20))
    prompt = prompts[1][:18]  # 2 blocks; its last computed position (18 + 16 - 2) needs a 3rd
    want = probe.generate([prompt], greedy())[0].output_token_ids
    grown = probe.block_manager.blocks_needed(len(prompt) + MAX_NEW - 1)
    assert grown == 3
    engine = draft_engine(
        smollm2_fp32,
        smollm2_fp32,
        "smollm2-135m-instruct",
        k=4,
        enable_prefix_caching=False,
        kv_cache_memory=(2 * grown - 2) * probe.runner.geometry.bytes_per_block,
    )
    seqs = engine.generate([prompt] * 3, greedy())
    assert [s.output_token_ids for s in seqs] == [want] * 3
    st = engine.stats()
    assert st.num_preemptions > 0
    assert st.spec_num_draft_tokens and st.spec_num_accepted_tokens is not None
    assert st.spec_num_accepted_tokens >= 0.9 * st.spec_num_draft_tokens, st
    finish(engine)


def test_sampling_with_a_draft_is_seeded_and_frees_everything(
    smollm2_fp32: LoadedModel, tiny_draft: LoadedModel, draft_dir: Path, prompts: list[list[int]]
) -> None:
    engine = draft_engine(smollm2_fp32, tiny_draft, str(draft_dir))
    params = SamplingParams(temperature=0.8, top_k=50, seed=3, max_tokens=12)
    a = engine.generate(prompts, params)
    b = engine.generate(prompts, params)
    assert [s.output_token_ids for s in a] == [s.output_token_ids for s in b]
    assert all(len(s.output_token_ids) > 0 for s in a)
    finish(engine)


def test_a_draft_with_another_vocabulary_is_refused(smollm2_fp32: LoadedModel, tmp_path: Path) -> None:
    write_tiny_draft(tmp_path, smollm2_fp32, vocab_size=96)
    cfg = EngineConfig(
        dtype="float32",
        kv_cache_memory=64 * 2**20,
        speculative_method="draft",
        speculative_model=str(tmp_path),
        num_speculative_tokens=3,
    )
    with pytest.raises(ValueError, match=r"--speculative-model .*tokenizer is not the target model's"):
        engine_from_loaded(smollm2_fp32, cfg)
    cfg.speculative_model = str(tmp_path / "missing")
    with pytest.raises(ValueError, match="--speculative-model"):
        engine_from_loaded(smollm2_fp32, cfg)
