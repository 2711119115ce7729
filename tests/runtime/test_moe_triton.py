"""The MoE layer's Triton path (`moe_triton`, kernels/triton_moe.py wired into `FusedMoE`).

Without a GPU the kernel runs on CPU tensors under Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before any kernel is imported); on a GPU (scripts/gpu_check.sh runs `-m gpu`)
the same tests run on CUDA tensors. Shapes stay tiny so the interpreter is quick:
- `FusedMoE` forced to the Triton backend against `moe_reference`: float32, bfloat16 and float16,
  one token up to more than a tile of rows per expert, an expert that gets no token;
- expert parallelism: each "rank's" partial over its experts, summing to the whole;
- a tiny random-weight OLMoE with every MoE layer on the Triton path against transformers;
- `moe_backend_name`, the choice the layer makes per input;
- benchmarks/moe_bench.py --backend-layer (what scripts/gpu_check.sh runs on CUDA), on a toy layer.
Triton missing: skipped locally, a failure under CI (tests/needs.py).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.needs import require_module

require_module("triton", "it comes with torch's Linux wheels (pip install triton)")

from kvpilot.runtime.config import EngineConfig  # noqa: E402
from kvpilot.runtime.load.loader import load_model  # noqa: E402
from kvpilot.runtime.models.moe import (  # noqa: E402
    FusedMoE,
    moe_backend_name,
    moe_reference,
    moe_triton,
    route,
)
from tests.runtime.test_model_parity import PagedKV, rel_diff  # noqa: E402
from tests.runtime.test_moe import REL_TOL, TINY_VOCAB, make_tiny_moe_dir  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("one_torch_thread")]

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2, torch.float16: 3e-3}  # of the largest output


def _experts(e: int, h: int, i: int, seed: int) -> FusedMoE:
    g = torch.Generator().manual_seed(seed)
    layer = FusedMoE(e, h, i)
    layer.w13.data = torch.randn(e, 2 * i, h, generator=g) / h**0.5
    layer.w2.data = torch.randn(e, h, i, generator=g) / i**0.5
    return layer


def _inputs(t: int, e: int, k: int, h: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, h, generator=g)
    logits = torch.randn(t, e, generator=g)
    logits[:, -1] = -1e4  # the last expert gets no token: an empty group
    weights, ids = route(logits, k, renormalize=True)
    return x, weights, ids


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("t", "e", "k"), [(1, 4, 2), (9, 8, 2), (70, 6, 3)])  # 70 * 3 / 5: > a 32-row tile
def test_fused_moe_on_triton_matches_reference(dtype: torch.dtype, t: int, e: int, k: int) -> None:
    layer = _experts(e, 48, 40, seed=t).to(DEVICE, dtype)  # 48 / 40: not multiples of the tiles
    layer.backend = "triton"
    x, weights, ids = _inputs(t, e, k, 48, seed=t)
    x, weights, ids = x.to(DEVICE, dtype), weights.to(DEVICE), ids.to(DEVICE)
    assert layer.backend_for(x) == "triton"
    got = layer(x, weights, ids).float()
    ref = moe_reference(x.float(), layer.w13.float(), layer.w2.float(), weights, ids)
    assert float((got - ref).abs().max() / ref.abs().max()) < TOL[dtype]


@pytest.mark.parametrize("ranks", [2, 4])
def test_triton_expert_shards_sum_to_whole(ranks: int) -> None:
    layer = _experts(8, 32, 24, seed=ranks)
    x, weights, ids = _inputs(30, 8, 2, 32, seed=ranks)
    w13, w2 = layer.w13.data.to(DEVICE), layer.w2.data.to(DEVICE)
    x, weights, ids = x.to(DEVICE), weights.to(DEVICE), ids.to(DEVICE)
    per = 8 // ranks
    parts = [
        moe_triton(x, w13[r * per : (r + 1) * per], w2[r * per : (r + 1) * per], weights, ids, r * per)
        for r in range(ranks)
    ]
    whole = moe_reference(x, w13, w2, weights, ids)
    torch.testing.assert_close(sum(parts), whole, rtol=1e-5, atol=1e-5)
    assert not any(p.isnan().any() for p in parts)  # others' rows (never written) are zeroed


def test_empty_batch() -> None:
    layer = _experts(4, 32, 16, seed=0).to(DEVICE)
    layer.backend = "triton"
    x, weights, ids = _inputs(3, 4, 2, 32, seed=0)
    out = layer(x[:0].to(DEVICE), weights[:0].to(DEVICE), ids[:0].to(DEVICE))
    assert out.shape == (0, 32)


def test_tiny_olmoe_on_the_triton_path_matches_transformers(tmp_path: Path) -> None:
    if DEVICE.type == "cuda":  # PagedKV is a CPU helper; on a GPU, gpu_bench's MoE engine run covers this
        pytest.skip("the interpreter's whole-model check (CPU tensors)")
    hf = make_tiny_moe_dir("olmoe", tmp_path)
    loaded = load_model(EngineConfig(model=str(tmp_path)), torch.device("cpu"), torch.float32)
    layers = [m for m in loaded.model.modules() if isinstance(m, FusedMoE)]
    assert len(layers) == 2
    for m in layers:
        m.backend = "triton"
    ids = torch.randint(3, TINY_VOCAB, (21,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    kv = PagedKV(loaded.arch, num_blocks=16, block_size=8)
    ours = [kv.logits(loaded.model, [(0, ids[:17])])]
    ours += [kv.logits(loaded.model, [(0, [t])]) for t in ids[17:]]
    _, rel = rel_diff(torch.cat(ours), ref)
    assert rel <= REL_TOL, rel


def test_backend_choice() -> None:
    bf16, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    assert moe_backend_name("cuda", bf16, False, True, True) == "grouped_mm"
    assert moe_backend_name("cuda", bf16, False, True, False) == "triton"  # SM < 80
    assert moe_backend_name("cuda", f16, False, True, True) == "triton"
    assert moe_backend_name("cuda", f32, False, True, True) == "triton"
    assert moe_backend_name("cuda", f16, False, False, True) == "grouped"  # no Triton
    assert moe_backend_name("cuda", bf16, True, True, True) == "grouped"  # quantized experts
    assert moe_backend_name("cpu", bf16, False, True, True) == "grouped"
    layer = _experts(4, 32, 16, seed=0)
    assert layer.backend_for(torch.zeros(1, 32)) == "grouped"  # CPU, chosen
    layer.backend = "bogus"
    with pytest.raises(ValueError, match="MoE backend must be one of"):
        layer.backend_for(torch.zeros(1, 32))
    layer.backend = "triton"
    layer.quantize("int8", 0)
    with pytest.raises(ValueError, match="quantized experts run on the 'grouped' backend"):
        layer.backend_for(torch.zeros(1, 32))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke run; gpu_check.sh runs the real one")
def test_backend_layer_benchmark_smoke_run(tmp_path: Path) -> None:
    out = tmp_path / "moe_backends.json"
    root = Path(__file__).resolve().parents[2]
    args = ["--backend-layer", "--tiny", "--threads", "1", "--out", str(out)]
    proc = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "moe_bench.py"), *args],
        capture_output=True,
        text=True,
        env=dict(os.environ, TRITON_INTERPRET="1"),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(out.read_text())
    assert result["backends"] == ["grouped", "triton"]  # CPU: no grouped_mm (it needs CUDA)
    for t in ("T=1", "T=32"):
        for name in result["backends"]:
            cell = result[t][name]
            assert cell["max_rel_err"] < 3e-2 and cell["ms"] > 0, (t, name, cell)
