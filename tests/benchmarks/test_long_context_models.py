"""benchmarks/peers/long_context.py's --model resolution: which file each engine loads, and a run the
model cannot take refused before any engine starts, naming the flag."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import workload as wl  # noqa: E402
from peers import long_context as lc  # noqa: E402
from peers import shapes  # noqa: E402


def test_the_builtin_within_its_trained_context_runs_as_shipped(tmp_path: Path) -> None:
    files = lc.model_files("smollm2", [1024, 4096], 64, tmp_path)
    assert files.gguf == wl.smollm2_gguf() == files.tokenizer
    assert (files.context, files.trained_context, files.vllm_model) == (8192, 8192, None)
    assert not list(tmp_path.iterdir())  # no copy made
    assert lc.vllm_long_context_flags(4096 + 64, files.trained_context) == []


def test_a_gguf_path_is_held_to_its_own_context(tmp_path: Path) -> None:
    path = str(wl.smollm2_gguf())
    files = lc.model_files(path, [8000], 64, tmp_path)
    assert (files.gguf, files.context, files.vllm_model) == (Path(path), 8192, None)
    with pytest.raises(SystemExit, match=r"--lengths: 16384 prompt tokens \+ 64 output tokens exceed"):
        lc.model_files(path, [1024, 16384], 64, tmp_path)


def test_a_shape_is_served_to_vllm_from_its_bfloat16_directory_without_overrides() -> None:
    # the shape's own context (32,768) needs no copy and no --hf-overrides at 16k
    assert shapes.SHAPES["llama-1b"].max_positions == lc.LONG_CONTEXT
    assert lc.vllm_long_context_flags(16384 + 128, shapes.SHAPES["llama-1b"].max_positions) == []
    assert lc.vllm_long_context_flags(16384 + 128) != []  # the builtin's trained 8,192 does


def test_an_unknown_model_names_the_flag(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="--model 'llama-70b'"):
        lc.model_files("llama-70b", [1024], 64, tmp_path)
