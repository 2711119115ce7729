"""The default path (runtime/load/defaults.py): with no --quantization, a GGUF stored in quantized
blocks runs from them on a CPU with the tiled kernels, with activations rounded to bfloat16 where
the CPU multiplies 4-bit codes by them natively (AVX512-BF16), else to 16 bits per block of 32
(vpmaddwd, at 512 bits on AVX-512); everything else is
dequantized at load; explicit settings always win. How well the default tracks float32 is
tests/runtime/test_default_quality.py's (it builds the engine from the defaults)."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from kvpilot.kernels import isa, qlinear, switches
from kvpilot.runtime.cli import add_arguments, build_config
from kvpilot.runtime.config import DEFAULT_MODEL, EngineConfig
from kvpilot.runtime.load.defaults import (
    CheckpointFacts,
    choose_default,
    describe,
    gguf_facts,
    resolve_default,
)
from kvpilot.runtime.load.loader import resolve_model_path
from tests.needs import missing

BUILTIN = CheckpointFacts(gguf=True, linear_types=frozenset({"Q4_1"}), head_type="Q8_0")
CPU = {
    "device_type": "cpu",
    "kernel_level": "avx512",
    "cpu_kernels": True,
    "tensor_parallel_size": 1,
    "lora": False,
}


def test_builtin_gguf_stores_every_linear_and_the_head_in_blocks() -> None:
    assert gguf_facts(resolve_model_path(DEFAULT_MODEL)) == BUILTIN


# what the machine running the tests gets by default (its kernels' level)
HERE_ACTIVATIONS = "bf16" if isa.bf16_dot(isa.selected()) else "int16"


@pytest.mark.parametrize("level", ["avx512", "avx2"])
def test_the_files_blocks_where_the_tiled_kernels_run(level: str) -> None:
    """Without AVX512-BF16 (every AVX2-only CPU, the AVX-512 Xeons before Cooper Lake) the activations
    are rounded to 16 bits per block of 32: never the slower float32 kernel."""
    choice = choose_default(BUILTIN, **{**CPU, "kernel_level": level})
    assert (choice.quantization, choice.qmatmul_activations) == ("auto", "int16")
    assert "Q4_1/Q8_0 blocks" in choice.why
    assert "16 bits per block of 32" in choice.why
    assert ("at 512 bits" in choice.why) == (level == "avx512")


@pytest.mark.parametrize(
    ("facts", "activations"),
    [
        (BUILTIN, "bf16"),  # Q4_1 layers (the Q8_0 head: the float kernel on rounded activations)
        (CheckpointFacts(True, frozenset({"Q4_K", "Q6_K"}), "Q6_K"), "bf16"),  # Q4_K_M
        (CheckpointFacts(True, frozenset({"Q8_0"}), "Q8_0"), "int16"),  # no 4-bit codes: no gain
        (CheckpointFacts(True, frozenset({"Q5_K", "Q6_K"}), "Q6_K"), "int16"),  # all requantized to int8
    ],
)
def test_bf16_activations_where_the_cpu_multiplies_4_bit_codes_by_them(
    facts: CheckpointFacts, activations: str
) -> None:
    choice = choose_default(facts, **CPU, cpu_bf16=True)
    assert (choice.quantization, choice.qmatmul_activations) == ("auto", activations)
    assert ("rounded to bfloat16" in choice.why) == (activations == "bf16")


@pytest.mark.parametrize(
    ("facts", "why"),
    [
        # Q4_K_M: Q4_K layers, Q6_K head, attn_v and half the ffn_down
        (CheckpointFacts(True, frozenset({"Q4_K", "Q6_K"}), "Q6_K"), "own Q4_K blocks (Q6_K requantized"),
        (CheckpointFacts(True, frozenset({"Q5_K", "Q6_K"}), "Q6_K"), "(Q5_K/Q6_K requantized"),  # Q5_K_M
        (CheckpointFacts(True, frozenset({"Q5_0"}), "Q8_0"), "own Q8_0 blocks (Q5_0 requantized"),
        (CheckpointFacts(True, frozenset({"IQ4_XS"}), "Q6_K"), "quantized weights (IQ4_XS/Q6_K requantized"),
    ],
)
def test_files_of_other_quantized_types_take_the_blocks_path_requantized(
    facts: CheckpointFacts, why: str
) -> None:
    choice = choose_default(facts, **CPU)
    assert (choice.quantization, choice.qmatmul_activations) == ("auto", "int16")
    assert why in choice.why


@pytest.mark.parametrize(
    ("facts", "changes", "why"),
    [
        (CheckpointFacts(gguf=False), {}, "not a GGUF"),
        (BUILTIN, {"device_type": "cuda"}, "on cuda"),
        (BUILTIN, {"kernel_level": "generic"}, "generic level"),
        (BUILTIN, {"cpu_kernels": False}, "no tiled CPU kernels"),
        (BUILTIN, {"tensor_parallel_size": 2}, "not measured"),
        (BUILTIN, {"lora": True}, "not measured"),
        (CheckpointFacts(True, frozenset({"Q4_1"}), "Q8_0", moe=True), {}, "not measured"),
        (CheckpointFacts(True, frozenset({"Q4_K", "F16"}), "Q6_K"), {}, "F16, Q4_K, Q6_K"),
        (CheckpointFacts(True, frozenset({"F16"}), "F16"), {}, "F16"),
        (CheckpointFacts(True, frozenset(), "Q8_0"), {}, "not all in quantized blocks"),
    ],
)
def test_everything_else_is_dequantized_at_load(
    facts: CheckpointFacts, changes: dict[str, Any], why: str
) -> None:
    choice = choose_default(facts, **{**CPU, **changes})
    assert choice.quantization == "none"
    assert why in choice.why


def test_explicit_settings_win() -> None:
    cpu = torch.device("cpu")

    def resolved(**settings: Any) -> tuple[str | None, str | None]:
        cfg, _ = resolve_default(EngineConfig(**settings), cpu, kernel_level="avx512", cpu_kernels=True)
        return cfg.quantization, cfg.qmatmul_activations

    assert resolved() == ("auto", "bf16" if isa.bf16_dot("avx512") else "int16")
    assert resolved(qmatmul_activations="int8") == ("auto", "int8")
    assert resolved(qmatmul_activations="float") == ("auto", "float")
    assert resolved(qmatmul_activations="bf16") == ("auto", "bf16")
    assert resolved(quantization="auto") == ("auto", "int8")  # --quantization alone: int8 as before
    assert resolved(quantization="int4") == ("int4", "int8")
    assert resolved(quantization="int4", qmatmul_activations="float") == ("int4", "float")
    assert resolved(quantization="none") == ("none", "int8")
    cfg, choice = resolve_default(EngineConfig(), cpu, kernel_level="generic", cpu_kernels=True)
    assert cfg.quantization == "none" and choice is not None
    assert describe(choice, "int8").startswith("default path (no --quantization given): --quantization none:")


def test_cli_takes_quantization_none() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert build_config(parser.parse_args(["--quantization", "none"])).quantization == "none"
    assert build_config(parser.parse_args([])).qmatmul_activations is None  # the default path decides


def test_default_engine_runs_the_files_blocks_and_says_so(caplog: pytest.LogCaptureFixture) -> None:
    from kvpilot.runtime.engine.build import build_engine

    if not qlinear.available():
        missing("a C compiler for the CPU kernels", "install gcc or clang")
    if isa.selected() not in ("avx512", "avx2"):  # hardware: the generic level's choice is tested above
        pytest.skip("the default path dequantizes at the generic ISA level (tested above)")
    with caplog.at_level(logging.INFO, logger="kvpilot.runtime.engine.build"):
        engine = build_engine(EngineConfig(kv_cache_memory=2**24, max_num_seqs=2))
    flags = f"--quantization auto --qmatmul-activations {HERE_ACTIVATIONS}"
    assert any(f"default path (no --quantization given): {flags}" in r.message for r in caplog.records)
    assert switches.current().qmatmul_activations == HERE_ACTIVATIONS
    layer = engine.runner.model.model.layers[0]
    assert layer.mlp.gate_up_proj.qweight is not None and layer.mlp.gate_up_proj.qweight.tiled
    assert engine.runner.model.lm_head.qweight is not None  # the tied Q8_0 embedding, from its blocks
    # the KV cache: bfloat16 under the float32 activations, said at start; float32 on request
    assert engine.runner.geometry.dtype == torch.bfloat16
    assert any("KV cache in bfloat16 under float32 activations" in r.message for r in caplog.records)
    unrounded = build_engine(EngineConfig(kv_cache_dtype="float32", kv_cache_memory=2**24, max_num_seqs=2))
    assert unrounded.runner.geometry.dtype == torch.float32
    # an explicit --quantization none is the dequantized model
    engine = build_engine(EngineConfig(quantization="none", kv_cache_memory=2**24, max_num_seqs=2))
    assert engine.runner.model.model.layers[0].mlp.gate_up_proj.qweight is None
