"""MoE models under tensor parallelism and expert parallelism (CPU, gloo, real worker processes).

- Tiny random-weight models of every family (tests/runtime/test_moe.py): Mixtral, Qwen2-MoE (shared
  expert, a dense layer, q/k/v bias), Qwen3-MoE (per-head q/k norm) and OLMoE (q/k norm over the
  whole projection, so its sum of squares is all-reduced; one KV head, replicated on both ranks):
  batched greedy generation with chunked prefill at tp=2 (every expert's width split) and at tp=2
  with --enable-expert-parallel (whole experts per rank) gives tp=1's logits and tokens, the experts
  running on the fused C call (kernels/cpu_moe.py; checked on rank 0, this process).
- Sizes that do not divide the experts or widths are refused before any process starts, naming the
  sizes that work; expert parallelism on a dense model is refused.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from pathlib import Path

import pytest

from kvpilot.kernels import cpu_moe
from kvpilot.runtime.engine.build import build_engine
from kvpilot.runtime.engine.core import LLMEngine
from kvpilot.runtime.engine.tp.runner import TPModelRunner, check_tensor_parallel
from kvpilot.runtime.models import ModelArchConfig
from tests.runtime.test_moe import make_tiny_moe_dir
from tests.runtime.test_tensor_parallel import compare, engine_config, run, start, tiny_prompts

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("no_tp_leftovers")]

__all__ = ["start"]  # the fixture, shared with test_tensor_parallel


@pytest.mark.parametrize("family", ["mixtral", "qwen2moe", "qwen3moe", "olmoe"])
def test_moe_tp2_and_expert_parallel_match_tp1(
    family: str, tmp_path: Path, start: Callable[..., LLMEngine]
) -> None:
    overrides = {"num_key_value_heads": 1} if family == "olmoe" else {}
    make_tiny_moe_dir(family, tmp_path, **overrides)
    settings = {"block_size": 8, "max_num_batched_tokens": 32}
    one = start(engine_config(str(tmp_path), 1, **settings))
    ref = run(one, tiny_prompts(), max_tokens=10)
    one.runner.close()

    results = {}
    for ep in (False, True):
        engine = start(engine_config(str(tmp_path), 2, enable_expert_parallel=ep, **settings))
        assert isinstance(engine.runner, TPModelRunner)
        experts = engine.runner.shard.model.layers[0].mlp.experts
        arch = engine.runner.loaded.arch
        if ep:  # half of the experts each, whole
            assert experts.num_local_experts == arch.num_experts // 2
            assert experts.intermediate_per_rank == arch.moe_intermediate_size
        else:  # every expert, half of its width
            assert experts.num_local_experts == arch.num_experts
            assert experts.intermediate_per_rank == arch.moe_intermediate_size // 2
        label = f"{family} tp=2{' EP' if ep else ''}"
        results[label] = compare(run(engine, tiny_prompts(), max_tokens=10), ref, label)
        # rank 0 (this process) ran its share of the experts on the fused C call (kernels/cpu_moe.py)
        assert experts.last_path == ("cpu_fused" if cpu_moe.available() else "grouped"), label
        engine.runner.close()
    print(f"\n{family}: worst logit difference vs tp=1 (of scale): {results}")


def _moe_arch(**fields: object) -> ModelArchConfig:
    base: dict[str, object] = dict(
        architecture="Qwen2MoeForCausalLM",
        vocab_size=96,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        head_dim=8,
        num_experts=6,
        num_experts_per_tok=2,
        moe_intermediate_size=40,
    )
    base.update(fields)
    return ModelArchConfig(**base)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("tp", "ep", "message"),
    [
        (4, False, None),
        (8, False, None),
        (2, True, None),
        (
            4,
            True,
            r"--tensor-parallel-size 4 with --enable-expert-parallel does not divide the model's "
            r"6 experts; sizes this model supports: 1, 2$",
        ),
        (3, False, r"--tensor-parallel-size 3 does not divide the model's 8 attention heads"),
    ],
)
def test_check_moe_sizes(tp: int, ep: bool, message: str | None) -> None:
    arch = _moe_arch()  # 8 heads, 6 experts of width 40, no dense layers: intermediate_size 96 is unused
    if message is None:
        check_tensor_parallel(arch, tp, ep)
    else:
        with pytest.raises(ValueError, match=message):
            check_tensor_parallel(arch, tp, ep)


def test_check_moe_widths() -> None:
    arch = _moe_arch(moe_intermediate_size=36, shared_expert_intermediate_size=20)
    with pytest.raises(
        ValueError, match=r"expert width of 36 or its shared-expert width of 20; .*: 1, 2, 4$"
    ):
        check_tensor_parallel(arch, 8)
    # under expert parallelism the routed experts stay whole, the shared expert is still split
    with pytest.raises(ValueError, match=r"6 experts or its shared-expert width of 20; .*: 1, 2$"):
        check_tensor_parallel(arch, 8, expert_parallel=True)
    dense_layer = _moe_arch(dense_mlp_layers=(1,), intermediate_size=100)
    with pytest.raises(ValueError, match=r"MLP width of 100"):
        check_tensor_parallel(dense_layer, 8)


def test_expert_parallel_refusals_before_any_process_starts(tmp_path: Path) -> None:
    make_tiny_moe_dir("mixtral", tmp_path)  # 8 experts of width 32, 4 heads, 2 KV heads
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3 .*sizes this model supports: 1, 2, 4$"):
        build_engine(engine_config(str(tmp_path), 3, enable_expert_parallel=True))
    dense = _moe_arch(num_experts=0, architecture="LlamaForCausalLM")
    with pytest.raises(ValueError, match=r"--enable-expert-parallel needs a Mixture-of-Experts model"):
        check_tensor_parallel(dense, 2, expert_parallel=True)
    with pytest.raises(ValueError, match=r"--enable-expert-parallel needs a Mixture-of-Experts model"):
        build_engine(engine_config("smollm2-135m-instruct", 1, enable_expert_parallel=True))
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("kvpilot-tp")]
