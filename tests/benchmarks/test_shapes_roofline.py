"""benchmarks/peers/shapes.py (the real-shape checkpoints' tensors, config and files) and
benchmarks/peers/roofline.py (bytes per decode step, bandwidth and compute lines): the arithmetic,
checked against numbers known from elsewhere (the published parameter counts of Llama-3.2-1B and
Llama-3.1-8B, the FLOP count runtime_vs_peers.py already uses)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

from peers import roofline as rl  # noqa: E402
from peers import shapes  # noqa: E402
from peers.measure import ModelDims  # noqa: E402

from kvpilot.kernels.qlinear import QuantizedWeight  # noqa: E402


def test_shapes_have_the_published_parameter_counts() -> None:
    # Llama-3.2-1B: 1,235,814,400 parameters (tied embeddings); Llama-3.1-8B: 8,030,261,248
    assert shapes.SHAPES["llama-1b"].params == 1_235_814_400
    assert shapes.SHAPES["llama-8b"].params == 8_030_261_248
    assert shapes.SHAPES["llama-3b"].params == 3_212_749_824  # Llama-3.2-3B's count


@pytest.mark.parametrize("name", sorted(shapes.SHAPES))
def test_layer_matmul_params_agree_with_the_flop_count_of_the_gguf_dims(name: str) -> None:
    s = shapes.SHAPES[name]
    dims = ModelDims(s.layers, s.hidden, s.intermediate, s.heads, s.kv_heads, s.vocab)
    assert dims.head_dim == s.head_dim
    assert dims.layer_params == s.layer_linear_params
    # everything but the norms and the embedding/LM head is a layer matmul
    head = s.vocab * s.hidden * (1 if s.tied else 2)
    norms = (2 * s.layers + 1) * s.hidden
    assert s.params == s.layer_linear_params + head + norms


def test_config_pads_the_vocabulary_and_ties_as_the_shape_says() -> None:
    one = shapes.hf_config(shapes.SHAPES["llama-1b"], 1, 2)
    eight = shapes.hf_config(shapes.SHAPES["llama-8b"], 1, 2)
    assert one["vocab_size"] == eight["vocab_size"] == 128256  # > SmolLM2's 49152: the converter pads
    assert one["tie_word_embeddings"] is True and eight["tie_word_embeddings"] is False
    assert (one["hidden_size"], one["num_hidden_layers"], one["head_dim"]) == (2048, 16, 64)
    assert (eight["intermediate_size"], eight["num_key_value_heads"], eight["head_dim"]) == (14336, 8, 128)
    names = [n for n, _ in shapes.SHAPES["llama-8b"].tensors()]
    assert "lm_head.weight" in names
    assert "lm_head.weight" not in [n for n, _ in shapes.SHAPES["llama-1b"].tensors()]


def test_shard_plan_keeps_order_and_the_size_limit() -> None:
    one = shapes.shard_plan(shapes.SHAPES["llama-1b"])
    assert len(one) == 1 and shapes.shard_names(1) == ["model.safetensors"]
    s = shapes.SHAPES["llama-8b"]
    plan = shapes.shard_plan(s)
    assert [n for shard in plan for n in shard] == [n for n, _ in s.tensors()]
    size = dict(s.tensors())
    for shard in plan:
        assert sum(2 * torch.Size(size[n]).numel() for n in shard) <= shapes.SHARD_BYTES
    assert len(plan) == 4  # 16 GB of bf16 in files of <= 4 GiB
    assert shapes.shard_names(4)[-1] == "model-00004-of-00004.safetensors"


def test_model_spec_parsing() -> None:
    assert shapes.parse_model("llama-1b") == ("llama-1b", "q4_k_m")
    assert shapes.parse_model("llama-8b:q8_0") == ("llama-8b", "q8_0")
    with pytest.raises(ValueError, match="expected SHAPE"):
        shapes.parse_model("llama-1b:q5_k")
    with pytest.raises(ValueError, match="expected SHAPE"):
        shapes.parse_model("llama-70b")


def test_gguf_decode_bytes_count_the_embedding_only_when_it_is_the_lm_head() -> None:
    blocks = {"blk.0.attn_q.weight": 100, "blk.0.ffn_down.weight": 300, "output_norm.weight": 8}
    tied = {**blocks, "token_embd.weight": 1000}
    untied = {**tied, "output.weight": 700}
    assert rl.gguf_decode_weight_bytes(tied) == 1408  # the table is the LM head: read whole
    assert rl.gguf_decode_weight_bytes(untied) == 1108  # one row of the table only


def test_bandwidth_and_compute_lines() -> None:
    # llama-1b's f16 KV: 16 layers x K and V x 8 heads x 64 x 2 bytes
    assert rl.kv_bytes_per_token(16, 8, 64, 2) == 32768
    assert rl.mean_decode_context(100, 64) == 132
    line = rl.bandwidth_line(1e9, 1e5, 100, decode_tok_per_s=10.0, bandwidth=1e11)
    assert line["bytes_per_step_mb"] == 1010.0
    assert line["achieved_gb_s"] == 10.1
    assert line["fraction_of_copy_bandwidth"] == 0.101
    assert line["ceiling_decode_tok_per_s"] == 99.0
    assert "fraction_of_read_bandwidth" not in line  # no read-only figure measured: no line
    read = rl.bandwidth_line(1e9, 1e5, 100, decode_tok_per_s=10.0, bandwidth=1e11, read_bandwidth=5e10)
    assert read["fraction_of_copy_bandwidth"] == 0.101
    assert read["fraction_of_read_bandwidth"] == 0.202
    assert read["read_ceiling_decode_tok_per_s"] == 49.5
    c = rl.compute_line(model_flops=2e12, wall_s=10.0, peak_gflops=800.0)
    assert c == {"model_gflops_per_s": 200.0, "peak_gflops": 800.0, "fraction_of_matmul_peak": 0.25}


class _Head(torch.nn.Module):
    def __init__(self, weight: torch.nn.Parameter | None = None, q: QuantizedWeight | None = None) -> None:
        super().__init__()
        if weight is not None:
            self.weight = weight
        self.qweight = q


class _Model(torch.nn.Module):
    def __init__(self, tied: bool, quantized: bool) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(10, 4)  # 160 bytes
        self.proj = torch.nn.Linear(4, 4, bias=False)  # 64 bytes
        self.register_buffer("rotary_cos", torch.zeros(100))  # left out
        if quantized:  # 8-bit [10, 4]: 40 packed bytes + 10 float16 scales
            q = QuantizedWeight(
                8, 4, torch.zeros(10, 4, dtype=torch.int8), torch.zeros(10, 1).half(), None, 10, 4
            )
            self.lm_head = _Head(q=q)
        elif tied:
            self.lm_head = _Head(weight=self.embed_tokens.weight)
        else:
            self.lm_head = _Head(weight=torch.nn.Parameter(torch.zeros(10, 4)))


@pytest.mark.parametrize(
    ("tied", "quantized", "expected"), [(True, False, 224), (False, False, 224), (False, True, 124)]
)
def test_module_weight_bytes(tied: bool, quantized: bool, expected: int) -> None:
    # the projection + the LM head (the tied one is the embedding's storage, counted once)
    assert rl.module_weight_bytes(_Model(tied, quantized)) == expected


def test_build_script_refuses_an_unknown_target() -> None:
    res = subprocess.run(
        ["bash", str(BENCH / "build_llamacpp.sh"), "--target", "llama-cli"], capture_output=True, text=True
    )
    assert res.returncode == 2
    assert "--target must be llama-server or llama-quantize" in res.stderr


def test_roofline_summary_takes_both_fractions_and_leaves_out_engines_without_lines() -> None:
    from runtime_vs_peers import roofline_summary

    lines = {
        "copy_bandwidth_gb_s": 20.0,
        "matmul_peak_gflops": 300.0,
        "kvpilot": {
            "batch_1_bandwidth": {"fraction_of_copy_bandwidth": 0.5, "fraction_of_read_bandwidth": 0.9},
            "batch_compute": {"fraction_of_matmul_peak": 0.25},
        },
        "llamacpp": {"batch_1_bandwidth": {"fraction_of_copy_bandwidth": 0.4}},
        "hf": {},
    }
    assert roofline_summary(lines) == {
        "kvpilot": {
            "batch_1_fraction_of_copy_bandwidth": 0.5,
            "batch_1_fraction_of_read_bandwidth": 0.9,
            "batch_fraction_of_matmul_peak": 0.25,
        },
        "llamacpp": {
            "batch_1_fraction_of_copy_bandwidth": 0.4,
            "batch_1_fraction_of_read_bandwidth": None,
            "batch_fraction_of_matmul_peak": None,
        },
    }


def test_the_read_probe_reads_every_byte_at_a_plausible_rate() -> None:
    """measure.read_bandwidth builds read_bandwidth.c with the runtime's toolchain and checks the sum of
    what each pass read against the buffer's (so no pass was skipped or cut short); the rates are
    positive and the ceiling is the best of the prefetch distances."""
    from peers.measure import READ_PREFETCH_BYTES, read_bandwidth

    r = read_bandwidth(2, nbytes=8 << 20, rounds=2)
    assert r["bytes"] == 8 << 20 and r["threads"] == 2
    assert set(r["gb_s_by_prefetch_bytes"]) == {str(pf) for pf in READ_PREFETCH_BYTES}
    assert r["read_gb_s"] == max(r["gb_s_by_prefetch_bytes"].values()) > 0.1
    odd = read_bandwidth(3, nbytes=(1 << 20) + 1000, rounds=1)  # cut to whole 64-byte lines per thread
    assert odd["bytes"] % (64 * 3) == 0 and odd["bytes"] <= (1 << 20) + 1000
