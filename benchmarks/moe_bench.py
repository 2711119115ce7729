#!/usr/bin/env python
"""kvpilot vs Hugging Face transformers `generate` on a random-weight Mixture-of-Experts model with
OLMoE-1B-7B's layer shapes (hidden 2048, 16 heads, 64 experts of width 1024, top-8, vocabulary
50304) and fewer layers, so that two copies fit this machine. Both engines get the same weights
(transformers' random init, copied into kvpilot through its checkpoint names), the same batch of
prompts and the same number of new tokens; greedy, EOS ignored.

Prints one JSON document: the machine, the configuration, and
* `generate`: output tokens/s of each engine for the whole batch (prefill + decode, wall clock),
  best of `--rounds` rounds run alternately (kvpilot, HF, kvpilot, ...) so that load from other
  work on a shared machine hits both; HF runs with each experts implementation it offers here
  (`eager` loop, `grouped_mm`) and the faster one is the baseline; the ratio kvpilot / HF.
* `moe_layer`: milliseconds of one MoE block at T tokens: kvpilot's grouped path (`moe_grouped`),
  a `torch._grouped_mm` variant of it, and transformers' experts forward.

Usage:
    python benchmarks/moe_bench.py                        # 2 layers, batch 32
    python benchmarks/moe_bench.py --layers 1 --batch 8 --new-tokens 8 --rounds 1   # smoke run
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch loads (see bench_runtime.py)

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runtime_harness import cpu_probe, machine_info
from workload import best_seconds

OLMOE_1B_7B = dict(
    vocab_size=50304,
    hidden_size=2048,
    intermediate_size=1024,
    num_attention_heads=16,
    num_key_value_heads=16,
    num_experts=64,
    num_experts_per_tok=8,
    norm_topk_prob=False,
    max_position_embeddings=4096,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
)


def build_hf(layers: int, dtype: torch.dtype, seed: int) -> Any:
    import transformers as tf

    cfg = tf.OlmoeConfig(**OLMOE_1B_7B, num_hidden_layers=layers, pad_token_id=1, eos_token_id=None)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        model = tf.OlmoeForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():  # explicit random weights (norms stay 1)
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02)
    model.generation_config.eos_token_id = None
    return model


def checkpoint_tensors(hf: Any) -> Iterator[tuple[str, torch.Tensor]]:
    """transformers' in-memory OLMoE (experts fused as [E, 2I, H] / [E, H, I]) under checkpoint names."""
    for name, t in hf.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            prefix, inter = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{prefix}{e}.gate_proj.weight", t[e, :inter]
                yield f"{prefix}{e}.up_proj.weight", t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                yield f"{prefix}{e}.down_proj.weight", t[e]
        else:
            yield name, t


def build_kvpilot(hf: Any, dtype: torch.dtype, args: argparse.Namespace) -> Any:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    from kvpilot.runtime.config import EngineConfig
    from kvpilot.runtime.engine import LLMEngine
    from kvpilot.runtime.loader import LoadedModel, build_model, hf_arch_config
    from kvpilot.runtime.tokenizer import Tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        hf.config.architectures = ["OlmoeForCausalLM"]
        hf.config.save_pretrained(tmp)  # config.json only: the weights come from memory
        vocab = {f"t{i}": i for i in range(hf.config.vocab_size)}
        HFTokenizer(models.WordLevel(vocab, unk_token="t0")).save(f"{tmp}/tokenizer.json")
        Path(tmp, "tokenizer_config.json").write_text(json.dumps({"eos_token": "t2"}))
        arch = hf_arch_config(Path(tmp))
        tokenizer = Tokenizer.from_hf_dir(tmp)
        model = build_model(arch, torch.device("cpu"), dtype)
        model.load_weights(checkpoint_tensors(hf))
    cfg = EngineConfig(
        model="olmoe-shaped",
        device="cpu",
        dtype=str(dtype).removeprefix("torch."),  # type: ignore[arg-type]
        threads=args.threads,
        max_num_seqs=args.batch,
        max_num_batched_tokens=args.max_batched_tokens,
        kv_cache_memory=int(args.kv_gib * 2**30),
    )
    loaded = LoadedModel(
        model.eval(), tokenizer, arch, "olmoe-shaped", 4096, Path("."), torch.device("cpu"), dtype
    )
    return LLMEngine.from_loaded(loaded, cfg)


def run_kvpilot(engine: Any, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    from kvpilot.runtime.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    t0 = time.perf_counter()
    seqs = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    assert all(len(s.output_token_ids) == new for s in seqs)
    return dt, [list(s.output_token_ids) for s in seqs]


def run_hf(hf: Any, prompts: list[list[int]], new: int) -> tuple[float, list[list[int]]]:
    ids = torch.tensor(prompts)  # equal lengths: no padding
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=1,
        )
    dt = time.perf_counter() - t0
    assert out.shape[1] == ids.shape[1] + new
    return dt, out[:, ids.shape[1] :].tolist()


def moe_layer_times(hf: Any, engine: Any, tokens: list[int], seconds: float) -> dict[str, Any]:
    """ms per MoE block forward (router excluded: same for all) at T tokens, first layer's weights."""
    from kvpilot.runtime.models.moe import moe_grouped, route

    block = engine.runner.model.model.layers[0].mlp
    experts = block.experts
    w13t = experts.w13.transpose(1, 2).contiguous()
    w2t = experts.w2.transpose(1, 2).contiguous()
    hf_experts = hf.model.layers[0].mlp.experts
    k = block.top_k

    def grouped_mm(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        t, flat = x.shape[0], ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.cumsum(torch.bincount(flat, minlength=w13t.shape[0]), 0).to(torch.int32)
        h = torch._grouped_mm(x.index_select(0, order // k), w13t, offs=offs)
        inter = h.shape[1] // 2
        o = torch._grouped_mm(F.silu(h[:, :inter]) * h[:, inter:], w2t, offs=offs)
        un = torch.empty_like(o)
        un[order] = o
        return torch.bmm(weights.to(x.dtype).unsqueeze(1), un.view(t, k, -1)).squeeze(1)

    out: dict[str, Any] = {}
    g = torch.Generator().manual_seed(0)
    for t in tokens:
        x = (torch.randn(t, experts.w13.shape[2], generator=g) * 0.5).to(experts.w13.dtype)
        weights, ids = route(block.gate(x), k, block.renormalize)
        ref = moe_grouped(x, experts.w13, experts.w2, weights, ids)
        row: dict[str, Any] = {
            "kvpilot_grouped_ms": round(
                1e3
                * best_seconds(partial(moe_grouped, x, experts.w13, experts.w2, weights, ids), seconds, 3),
                1,
            ),
        }
        try:
            torch.testing.assert_close(grouped_mm(x, weights, ids), ref, rtol=2e-2, atol=2e-2)
            row["torch_grouped_mm_ms"] = round(
                1e3 * best_seconds(partial(grouped_mm, x, weights, ids), seconds, 3), 1
            )
        except (RuntimeError, AssertionError) as e:
            row["torch_grouped_mm_ms"] = f"unavailable: {str(e).splitlines()[0][:120]}"
        for impl in ("eager", "grouped_mm"):
            hf.set_experts_implementation(impl)
            with torch.inference_mode():
                row[f"hf_{impl}_ms"] = round(
                    1e3 * best_seconds(partial(hf_experts, x, ids, weights.to(x.dtype)), seconds, 3), 1
                )
        out[f"T={t}"] = row
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--max-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-gib", type=float, default=0.5)
    ap.add_argument(
        "--layer-tokens", default="1,32,256", help="T values for the MoE layer timing ('' to skip)"
    )
    ap.add_argument("--layer-seconds", type=float, default=1.5)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)

    record: dict[str, Any] = {"machine": machine_info(), "config": vars(args) | {"model": OLMOE_1B_7B}}
    t0 = time.perf_counter()
    hf = build_hf(args.layers, dtype, args.seed)
    engine = build_kvpilot(hf, dtype, args)
    record["build_s"] = round(time.perf_counter() - t0, 1)
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(3, OLMOE_1B_7B["vocab_size"], (args.batch, args.prompt_len), generator=g).tolist()
    useful = args.batch * args.new_tokens

    # warm-up (one short request each)
    run_kvpilot(engine, prompts[:2], 2)
    run_hf(hf, prompts[:2], 2)
    times: dict[str, list[float]] = {"kvpilot": [], "hf_eager": [], "hf_grouped_mm": []}
    tokens: dict[str, list[list[int]]] = {}
    probes: list[float] = []
    for _ in range(args.rounds):
        probes.append(cpu_probe())
        dt, tokens["kvpilot"] = run_kvpilot(engine, prompts, args.new_tokens)
        times["kvpilot"].append(dt)
        for impl in ("eager", "grouped_mm"):
            hf.set_experts_implementation(impl)
            dt, tokens[f"hf_{impl}"] = run_hf(hf, prompts, args.new_tokens)
            times[f"hf_{impl}"].append(dt)
    best = {k: min(v) for k, v in times.items()}
    hf_best = min(("hf_eager", "hf_grouped_mm"), key=lambda k: best[k])

    def agree(a: list[list[int]], b: list[list[int]]) -> float:
        return round(sum(x[0] == y[0] for x, y in zip(a, b, strict=True)) / len(a), 3)

    record["generate"] = {
        "output_tokens": useful,
        "wall_s": {k: [round(x, 2) for x in v] for k, v in times.items()},
        "output_tok_per_s": {k: round(useful / v, 1) for k, v in best.items()},
        "hf_baseline": hf_best,
        "kvpilot_vs_hf": round(best[hf_best] / best["kvpilot"], 2),
        "goal": ">= 3x at batch 32",
        # bf16 random weights: near-tied logits can pick different tokens; the first token of each
        # sequence comes from the same prompt in both engines
        "first_token_agreement_vs_hf": agree(tokens["kvpilot"], tokens[hf_best]),
        "cpu_probe_gflops": probes,
    }
    if args.layer_tokens:
        record["moe_layer"] = moe_layer_times(
            hf, engine, [int(t) for t in args.layer_tokens.split(",")], args.layer_seconds
        )
    record["machine"]["load_avg_end"] = [round(x, 2) for x in os.getloadavg()]
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
