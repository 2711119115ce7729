"""scripts/gpu_check.sh and benchmarks/gpu_bench.py, in the parts a CPU can run.

The benchmark's `--device cpu --tiny` mode runs every phase the GPU run has (random-weight model from a
config, measured KV sizing path aside, decode at several batches, prefill, the bandwidth fraction, the
backend comparison, the quantized decode, the optional MoE model) on small shapes; the script refuses to run without a GPU.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def load_bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "benchmarks" / "gpu_bench.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_tiny_cpu_run_writes_every_figure(tmp_path: Path) -> None:
    bench = load_bench()
    out = tmp_path / "r" / "gpu_bench.json"
    args = ["--device", "cpu", "--tiny", "--batches", "1,3", "--decode-tokens", "4", "--prompt-len", "8"]
    args += ["--prefill-len", "32", "--copy-bytes", str(1 << 20), "--moe", "--compare-backends"]
    args += ["--quantization", "int4"]
    result = bench.main([*args, "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result, default=str))
    ll = result["llama"]
    assert [d["batch"] for d in ll["decode"]] == [1, 3]
    for d in ll["decode"]:
        # every sequence decoded 4 tokens after its first: batch x 4 tokens in 4 steps
        assert d["steps"] == 4 and d["tokens_per_s"] > 0
    assert ll["prefill"]["tokens_per_s"] > 0 and ll["prefill"]["prompt_len"] == 32
    prof = ll["batch1_profile"]  # on the CPU: no device time, the host's ops ranked
    assert prof["steps"] == 16 and prof["device_ms_per_step"] == 0 and prof["top_host_ms_per_step"]
    bw = ll["batch1_bandwidth"]
    assert bw["fraction_of_copy_bandwidth"] > 0 and bw["bytes_per_step"] > 0
    assert ll["cuda_graphs"] is None  # CPU: eager
    assert {(r["block_size"], r["enforce_eager"]) for r in result["backends"]} == {(16, False), (16, True)}
    q = result["quantized"]  # int4 after the bfloat16 figures: 5/8 of a byte a weight, not 2 bytes
    assert q["method"] == "int4" and q["group_size"] == 32 and q["matmul"] == "cpu (qlinear.matmul)"
    assert q["linear_bytes_after"] < q["linear_bytes_before"] / 3
    assert [d["batch"] for d in q["decode"]] == [1, 3] and all(d["steps"] == 4 for d in q["decode"])
    assert all(d["ratio_to_unquantized"] > 0 for d in q["decode"]) and q["batch1_bytes_per_s"] > 0
    # Mixtral-shaped: measured when the runtime has the MoE class, else recorded as skipped with the reason
    assert "skipped" in result["mixtral"] or result["mixtral"]["decode"]


def test_bytes_a_batch1_decode_step_reads_count_every_weight_but_the_embedding() -> None:
    bench = load_bench()
    loaded = bench.random_model(
        bench.LLAMA_8B | bench.TINY_OVERRIDES, torch.device("cpu"), torch.float32, "t"
    )
    engine = bench.engine_for(loaded, 2, kv_cache_memory=1 << 20)
    weights = sum(p.numel() for p in loaded.model.parameters()) * 4
    embed = loaded.arch.vocab_size * loaded.arch.hidden_size * 4
    per_token = engine.runner.geometry.bytes_per_token
    assert bench.decode_bytes_per_step(loaded, engine, 10) == weights - embed + int(10 * per_token)


def test_a_batch1_step_of_a_mixture_of_experts_reads_only_the_routed_experts() -> None:
    """The first GPU run reported 118% of the copy bandwidth for the Mixtral shape: every expert was
    counted, while a token reads top-k of them."""
    from kvpilot.runtime.models.moe import FusedMoE

    bench = load_bench()
    loaded = bench.random_model(bench.MIXTRAL | bench.TINY_OVERRIDES, torch.device("cpu"), torch.float32, "t")
    engine = bench.engine_for(loaded, 2, kv_cache_memory=1 << 20)
    arch = loaded.arch
    assert 0 < arch.num_experts_per_tok < arch.num_experts
    experts = sum(
        p.numel() for m in loaded.model.modules() if isinstance(m, FusedMoE) for p in m.parameters()
    )
    weights = sum(p.numel() for p in loaded.model.parameters())
    embed = 0 if arch.tie_word_embeddings else arch.vocab_size * arch.hidden_size
    routed = experts * arch.num_experts_per_tok / arch.num_experts
    want = int((weights - embed - experts + routed) * 4)
    assert abs(bench.decode_bytes_per_step(loaded, engine, 0) - want) <= 8


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gpu_check_refuses_without_a_gpu(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check.sh"), str(tmp_path / "results")],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "sees no CUDA device" in proc.stderr
    assert (tmp_path / "results").is_dir() and not any((tmp_path / "results").iterdir())


def test_gpu_check_usage() -> None:
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], capture_output=True, text=True)
    assert proc.returncode != 0 and "usage: scripts/gpu_check.sh RESULTS_DIR" in proc.stderr


def test_triton_qmatmul_micro_benchmark_runs_tiny_on_the_cpu(tmp_path: Path) -> None:
    """benchmarks/micro/triton_qmatmul.py (scripts/gpu_check.sh runs it on a GPU): every implementation
    timed and checked against the dequantized matmul, per-token sums written."""
    spec = importlib.util.spec_from_file_location(
        "triton_qmatmul", ROOT / "benchmarks/micro/triton_qmatmul.py"
    )
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    result = bench.main(["--tiny", "--out", str(tmp_path / "q.json")])
    assert json.loads((tmp_path / "q.json").read_text()) == result
    assert len(result["rows"]) == 4  # int4 and int8, m 1 and 16
    for row in result["rows"]:
        cells = {k: v for k, v in row.items() if isinstance(v, dict)}
        assert set(cells) == {"bf16_dense", "tiles", "splitk_picked", "splitk_small"}
        assert all(c["ok"] and c["us"] > 0 for c in cells.values())
    assert set(result["per_token_ms"]) == {"int4 m=1", "int4 m=16", "int8 m=1", "int8 m=16"}
