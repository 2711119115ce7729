"""`logit_rows` (CausalLM.forward): the model returns the rows the runner samples from, and its last
layer runs o_proj and the MLP (the experts, in a MoE model) on those rows alone; every row's K/V is
still cached, so the steps after see the same context. Checked on the real SmolLM2 (dense) and on
tiny random-weight MoE models (OLMoE: experts in the last layer; Qwen2-MoE: a dense last layer)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

from kvpilot.kernels.attention import TorchReferenceBackend
from kvpilot.runtime.config import EngineConfig
from kvpilot.runtime.engine.build import engine_from_loaded
from kvpilot.runtime.load.loader import LoadedModel, load_model
from kvpilot.runtime.models.llama import last_layer_rows
from tests.runtime.test_model_parity import PagedKV
from tests.runtime.test_moe import TINY_VOCAB, make_tiny_moe_dir

# (seq id, new tokens) per step; `rows`: the flat rows sampled in that step (the last of a sequence
# whose prompt is complete), as the model runner's prepare_batch picks them
STEPS: list[tuple[list[tuple[int, list[int]]], list[int]]] = [
    ([(0, list(range(3, 14))), (1, list(range(20, 27)))], [10, 17]),  # two whole prompts
    ([(0, [40]), (1, list(range(50, 60)))], [0]),  # a decode and a middle chunk: row 0 only
    ([(1, list(range(60, 66)))], []),  # a middle chunk alone: nothing sampled
    ([(0, [41]), (1, [70, 71, 72])], [0, 3]),  # a decode and a last chunk
    ([(1, [73]), (0, [42])], [0, 1]),  # decodes, every row sampled
]


def _run(model: Any, arch: Any, use_rows: bool) -> tuple[list[torch.Tensor], list[int], PagedKV]:
    """Each step's sampled rows' final hidden states, and the row counts the last layer's MLP saw."""
    kv = PagedKV(arch, num_blocks=32, block_size=8, seed=5)
    mlp_rows: list[int] = []
    hook = model.model.layers[-1].mlp.register_forward_hook(lambda m, a, o: mlp_rows.append(a[0].shape[0]))
    outs = []
    try:
        with torch.inference_mode():
            for batch, rows in STEPS:
                ids, positions, meta = kv.step(batch)
                index = torch.tensor(rows, dtype=torch.int64)
                if use_rows:
                    hidden = model(ids, positions, kv.caches, meta, TorchReferenceBackend(), index)
                else:
                    hidden = model(ids, positions, kv.caches, meta, TorchReferenceBackend()).index_select(
                        0, index
                    )
                outs.append(hidden)
    finally:
        hook.remove()
    return outs, mlp_rows, kv


def _check(loaded: LoadedModel) -> None:
    got, seen, kv_got = _run(loaded.model, loaded.arch, use_rows=True)
    want, seen_all, kv_want = _run(loaded.model, loaded.arch, use_rows=False)
    assert seen_all == [18, 11, 6, 4, 2]  # without: the last layer's MLP on every row
    assert seen == [2, 1, 2, 2]  # with: on the sampled rows, and not at all in the step without any
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        # fewer rows in one matmul may change float summation order, nothing else
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    for a, b in zip(kv_got.caches, kv_want.caches, strict=True):  # the same K/V in every layer
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)


def test_dense_model_runs_its_last_layer_on_the_logit_rows(smollm2_fp32: LoadedModel) -> None:
    _check(smollm2_fp32)


@pytest.mark.parametrize("family", ["olmoe", "qwen2moe"])
def test_moe_model_runs_its_last_layer_on_the_logit_rows(family: str, tmp_path: Any) -> None:
    make_tiny_moe_dir(family, tmp_path)
    loaded = load_model(EngineConfig(model=str(tmp_path)), torch.device("cpu"), torch.float32)
    assert loaded.arch.vocab_size == TINY_VOCAB
    last = loaded.model.model.layers[-1].mlp
    assert type(last).__name__ == ("LlamaMLP" if family == "qwen2moe" else "SparseMoeBlock")
    _check(loaded)


def test_greedy_tokens_through_the_engine_are_unchanged(smollm2_fp32: LoadedModel) -> None:
    """Chunked prefill (16-token chunks next to decodes): the engine with the last layer on the sample
    rows gives the tokens of a model that runs it on every row."""
    from kvpilot.runtime.engine.sampling_params import SamplingParams

    cfg = EngineConfig(
        model="smollm2",
        max_num_batched_tokens=16,
        max_num_seqs=4,
        kv_cache_memory=2**26,
        enable_prefix_caching=False,
    )
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [[1, *range(300, 340)], [1, 2683, 9139, 30]]  # 41 tokens: three chunks
    on = [o.output_token_ids for o in engine_from_loaded(smollm2_fp32, cfg).generate(prompts, params)]
    every_row = copy.copy(smollm2_fp32)
    every_row.model = copy.deepcopy(smollm2_fp32.model)
    forward = every_row.model.forward

    def on_every_row(*args: Any) -> torch.Tensor:  # the model as before: all rows, then select
        hidden = forward(*args[:5])
        return hidden if args[5] is None else hidden.index_select(0, args[5])

    every_row.model.forward = on_every_row  # type: ignore[method-assign]
    engine = engine_from_loaded(every_row, cfg)
    off = [o.output_token_ids for o in engine.generate(prompts, params)]
    assert on == off


def test_last_layer_rows_is_none_when_every_row_is_kept() -> None:
    assert last_layer_rows(None, 5) is None
    assert last_layer_rows(torch.arange(5), 5) is None
    rows = torch.tensor([4, 1])
    assert last_layer_rows(rows, 5) is rows
    assert last_layer_rows(torch.empty(0, dtype=torch.int64), 5).numel() == 0  # type: ignore[union-attr]
