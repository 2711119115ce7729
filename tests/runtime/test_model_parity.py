"""Our models against Hugging Face transformers, through the paged KV cache, on the CPU in float32.

- SmolLM2-135M-Instruct (the builtin Q4_1 GGUF): transformers dequantizes and un-permutes the same
  file independently; one prefill must give the same logits at every position, and 32 greedy decode
  steps through the paged cache must pick the same tokens as `generate`.
- Varlen batches: sequences of different lengths in one flat batch, chunked prefill and a decode
  mixed into a prefill step give the logits of running each sequence alone.
- Tiny random-weight Qwen2 (q/k/v bias), Mistral (sharded safetensors) and Llama (tied embeddings,
  llama3 rope scaling, head_dim != hidden / heads) directories, written with transformers.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from kvpilot.kernels.attention import AttentionMetadata, KVCacheLayer, TorchReferenceBackend
from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.load.loader import LoadedModel, load_model
from kvpilot.runtime.models import CausalLM, ModelArchConfig

# Logits may differ from transformers by at most this fraction of the largest reference logit
# (float32; the models run the same math with a different op order: fused qkv / gate_up matmuls).
REL_TOL = 1e-3
# When greedy decoding diverges, transformers' top-2 logits at that step must be this close (a tie).
TIE_TOL = 1e-3
DECODE_STEPS = 32

PROMPT = [
    {
        "role": "user",
        "content": "Explain in two sentences why the sky is blue, and then name three colors of a sunset.",
    }
]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


class PagedKV:
    """A small KV pool with per-sequence block tables: the block manager and model runner, in brief.

    Blocks are handed out in a shuffled order so that block tables are really followed.
    """

    def __init__(
        self, arch: ModelArchConfig, num_blocks: int = 64, block_size: int = 16, seed: int = 0
    ) -> None:
        shape = (num_blocks, block_size, arch.num_key_value_heads, arch.head_dim)
        self.caches = [
            KVCacheLayer(torch.zeros(shape), torch.zeros(shape)) for _ in range(arch.num_hidden_layers)
        ]
        self.block_size = block_size
        self.free = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(
        self, batch: list[tuple[int, list[int]]]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Flat (input_ids, positions, metadata) for new tokens of several sequences (seq id, tokens)."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qlens: list[int] = []
        slens: list[int] = []
        for seq, tokens in batch:
            start = self.lens.get(seq, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * bs < end:
                table.append(self.free.pop())
            slots += [table[p // bs] * bs + p % bs for p in range(start, end)]
            ids += tokens
            positions += range(start, end)
            qlens.append(len(tokens))
            slens.append(end)
            self.lens[seq] = end
        width = max(len(self.tables[seq]) for seq, _ in batch)
        tables = torch.zeros(len(batch), width, dtype=torch.int32)
        for row, (seq, _) in enumerate(batch):
            tables[row, : len(self.tables[seq])] = torch.tensor(self.tables[seq], dtype=torch.int32)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor([0, *itertools.accumulate(qlens)], dtype=torch.int32),
            seq_lens=torch.tensor(slens, dtype=torch.int32),
            block_tables=tables,
            query_lens_cpu=qlens,
            seq_lens_cpu=slens,
            max_query_len=max(qlens),
            max_seq_len=max(slens),
        )
        return torch.tensor(ids, dtype=torch.int64), torch.tensor(positions, dtype=torch.int64), meta

    def logits(self, model: CausalLM, batch: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Run one step and return the logits of every new token [T, vocab]."""
        return self.forward(model, *self.step(batch))

    @torch.inference_mode()
    def forward(
        self, model: CausalLM, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        hidden = model(ids, positions, self.caches, meta, TorchReferenceBackend())
        return model.compute_logits(hidden)


def rel_diff(ours: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(max abs difference, that difference relative to the largest reference logit)."""
    diff = float((ours - ref).abs().max())
    return diff, diff / float(ref.abs().max())


# ---------------------------------------------------------------------------------------------
# SmolLM2 against transformers


# `hf_smollm2` (transformers' model from the same GGUF, float32) is a session fixture in conftest.py.


@pytest.fixture(scope="module")
def prompt_ids(smollm2_fp32: LoadedModel) -> list[int]:
    tok = smollm2_fp32.tokenizer
    ids = tok.encode(tok.apply_chat_template(PROMPT, add_generation_prompt=True))
    assert len(ids) > 3 * 16  # spans several KV blocks
    return ids


def test_prefill_logits_match_transformers(
    smollm2_fp32: LoadedModel, hf_smollm2: Any, prompt_ids: list[int]
) -> None:
    ours = PagedKV(smollm2_fp32.arch).logits(smollm2_fp32.model, [(0, prompt_ids)])
    with torch.inference_mode():
        ref = hf_smollm2(torch.tensor([prompt_ids])).logits[0].float()
    assert ours.shape == ref.shape == (len(prompt_ids), smollm2_fp32.arch.vocab_size)
    all_abs, all_rel = rel_diff(ours, ref)
    last_abs, last_rel = rel_diff(ours[-1], ref[-1])
    print(
        f"\nSmolLM2 prefill ({len(prompt_ids)} tokens): max |diff| all positions {all_abs:.3g} ({all_rel:.2g} of "
        f"logit scale {float(ref.abs().max()):.1f}), last position {last_abs:.3g}"
    )
    assert all_rel <= REL_TOL
    assert last_rel <= REL_TOL
    assert int(ours[-1].argmax()) == int(ref[-1].argmax())


def test_greedy_decode_matches_transformers_generate(
    smollm2_fp32: LoadedModel, hf_smollm2: Any, prompt_ids: list[int]
) -> None:
    kv = PagedKV(smollm2_fp32.arch)
    step_logits = [kv.logits(smollm2_fp32.model, [(0, prompt_ids)])[-1]]
    ours = [int(step_logits[-1].argmax())]
    for _ in range(DECODE_STEPS - 1):
        ids, positions, meta = kv.step([(0, [ours[-1]])])
        assert meta.decode_only
        step_logits.append(kv.forward(smollm2_fp32.model, ids, positions, meta)[-1])
        ours.append(int(step_logits[-1].argmax()))

    prompt = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = hf_smollm2.generate(
            prompt,
            # explicit: SmolLM2's pad token is <|im_end|>, which the prompt contains; without a mask
            # transformers would infer one that hides those tokens
            attention_mask=torch.ones_like(prompt),
            max_new_tokens=DECODE_STEPS,
            do_sample=False,
            eos_token_id=None,
            output_logits=True,
            return_dict_in_generate=True,
        )
    ref = out.sequences[0, len(prompt_ids) :].tolist()
    assert len(ref) == DECODE_STEPS

    worst = 0.0
    for i, (mine, theirs) in enumerate(zip(ours, ref, strict=True)):
        _, rel = rel_diff(step_logits[i], out.logits[i][0].float())  # same prefix so far: same logits
        worst = max(worst, rel)
        assert rel <= REL_TOL, f"step {i}: logits differ by {rel:.3g} of scale"
        if mine != theirs:
            top2 = out.logits[i][0].float().topk(2).values
            gap = float(top2[0] - top2[1])
            assert gap < TIE_TOL, f"step {i}: we chose {mine}, transformers {theirs}, top-2 gap {gap:.3g}"
            print(f"\ngreedy decode: diverged at step {i} on a near-tie (top-2 gap {gap:.2g})")
            break
    print(
        f"\ngreedy decode: {DECODE_STEPS} steps, worst per-step logit diff {worst:.2g} of scale; "
        f"tokens equal: {ours == ref}"
    )


def test_varlen_batch_matches_separate_runs(smollm2_fp32: LoadedModel, prompt_ids: list[int]) -> None:
    model, arch = smollm2_fp32.model, smollm2_fp32.arch
    short, long = prompt_ids[:7], prompt_ids
    alone_short = PagedKV(arch, seed=1).logits(model, [(0, short)])
    alone_long = PagedKV(arch, seed=2).logits(model, [(0, long)])
    together = PagedKV(arch, seed=3).logits(model, [(0, short), (1, long)])
    assert rel_diff(together[: len(short)], alone_short)[1] <= 1e-4
    assert rel_diff(together[len(short) :], alone_long)[1] <= 1e-4


def test_chunked_prefill_with_mixed_decode(smollm2_fp32: LoadedModel, prompt_ids: list[int]) -> None:
    """A prompt prefilled in two chunks, the second sharing a step with another sequence's decode."""
    model, arch = smollm2_fp32.model, smollm2_fp32.arch
    other = prompt_ids[:9]
    full = PagedKV(arch, seed=4).logits(model, [(0, prompt_ids)])
    ref_other = PagedKV(arch, seed=5).logits(model, [(1, [*other, 42])])

    kv = PagedKV(arch, seed=6)
    cut = 21  # not a block boundary
    first = kv.logits(model, [(0, prompt_ids[:cut]), (1, other)])
    second = kv.logits(model, [(1, [42]), (0, prompt_ids[cut:])])
    assert rel_diff(first[:cut], full[:cut])[1] <= 1e-4
    assert rel_diff(second[1:], full[cut:])[1] <= 1e-4
    assert rel_diff(second[0], ref_other[-1])[1] <= 1e-4


# ---------------------------------------------------------------------------------------------
# Tiny random-weight Hugging Face directories

TINY_VOCAB = 96


def _tiny_hf_model(kind: str) -> Any:
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        rms_norm_eps=1e-6,
        eos_token_id=2,
        bos_token_id=1,
    )
    if kind == "qwen2":
        cfg = tf.Qwen2Config(**common, tie_word_embeddings=False)
        return tf.Qwen2ForCausalLM(cfg)
    if kind == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=None, tie_word_embeddings=False)
        return tf.MistralForCausalLM(cfg)
    if kind == "qwen3":  # q/k RMSNorm per head; head_dim wider than hidden / heads, as in Qwen3-0.6B
        cfg = tf.Qwen3Config(**common, head_dim=32, tie_word_embeddings=False, rope_theta=1000000.0)
        return tf.Qwen3ForCausalLM(cfg)
    if kind == "wide_heads":  # head_dim 320: past the CPU attention kernel's 256
        cfg = tf.LlamaConfig(**common, head_dim=320, tie_word_embeddings=False)
        return tf.LlamaForCausalLM(cfg)
    rope = {
        "rope_type": "llama3",
        "rope_theta": 50000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    cfg = tf.LlamaConfig(**common, head_dim=32, tie_word_embeddings=True, rope_parameters=rope)
    return tf.LlamaForCausalLM(cfg)


def _write_tiny_tokenizer(directory: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, TINY_VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": "<s>",
        "eos_token": "</s>",
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def make_tiny_hf_dir(kind: str, directory: Path) -> Any:
    torch.manual_seed(1234)
    model = _tiny_hf_model(kind).to(torch.float32).eval()
    with torch.no_grad():  # random everything, biases and norms included (transformers zeroes biases)
        for param in model.parameters():
            param.normal_(0.0, 0.2)
    shard = "40KB" if kind == "mistral" else "50MB"
    model.save_pretrained(directory, max_shard_size=shard)
    _write_tiny_tokenizer(directory)
    return model


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "mistral", "llama"])
def test_tiny_hf_dir_matches_transformers(kind: str, tmp_path: Path) -> None:
    hf = make_tiny_hf_dir(kind, tmp_path)
    if kind == "mistral":
        assert (tmp_path / "model.safetensors.index.json").is_file()  # sharded checkpoint
    loaded = load_model(EngineConfig(model=str(tmp_path)), torch.device("cpu"), torch.float32)
    arch = loaded.arch
    assert arch.qkv_bias == (kind == "qwen2")
    assert arch.tie_word_embeddings == (kind == "llama")
    assert arch.qk_norm == ("head" if kind == "qwen3" else None)
    assert loaded.tokenizer.eos_token_ids == {2}

    ids = torch.randint(3, TINY_VOCAB, (29,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    kv = PagedKV(arch, num_blocks=16, block_size=8)
    prefill = kv.logits(loaded.model, [(0, ids[:20])])
    decodes = [kv.logits(loaded.model, [(0, [t])]) for t in ids[20:]]
    ours = torch.cat([prefill, *decodes])
    _, rel = rel_diff(ours, ref)
    print(f"\ntiny {kind}: max logit diff {rel:.2g} of scale")
    assert rel <= REL_TOL


def test_heads_past_the_cpu_kernel_run_on_the_torch_path(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A model whose heads the C attention kernel cannot take (head_dim 320 > 256) is served: the
    runner picks torch's reference attention at start-up and says so, instead of the kernel refusing
    the first forward; greedy tokens equal transformers'."""
    from kvpilot.runtime.engine.build import build_engine
    from kvpilot.runtime.engine.sampling_params import SamplingParams

    hf = make_tiny_hf_dir("wide_heads", tmp_path)
    with caplog.at_level("WARNING", logger="kvpilot.kernels.attention"):
        engine = build_engine(
            EngineConfig(
                model=str(tmp_path), device="cpu", dtype="float32", kv_cache_dtype="float32", max_num_seqs=2
            )
        )
    assert engine.runner.backend.name == "torch"
    warned = [r.getMessage() for r in caplog.records if "CPU attention" in r.getMessage()]
    assert len(warned) == 1 and "head_dim 320" in warned[0] and "256" in warned[0]
    ids = torch.randint(3, TINY_VOCAB, (23,), generator=torch.Generator().manual_seed(5)).tolist()
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    (seq,) = engine.generate([ids], greedy)
    with torch.inference_mode():
        want = hf.generate(
            torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(ids) :].tolist()
    assert seq.output_token_ids == want
