"""runtime_vs_peers.py's adapter for Hugging Face transformers: `model.generate` on static, left-padded
batches, greedy, loaded from the same GGUF (dequantized)."""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path
from typing import Any

import torch
import workload as wl

from peers.measure import BenchEngine, single_stream_figures


def load_hf(gguf_path: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    model = model.to(dtype).eval()
    # never stop early: lengths come from max_new_tokens only (the equivalent of ignore_eos)
    model.generation_config.eos_token_id = None
    return model


class _TimingStreamer:
    """A transformers streamer that only records when each new token arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: Any) -> None:
        if not self._prompt_seen:
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_generate_batch(
    model: Any, batch: list[wl.Request], pad_id: int, streamer: Any = None
) -> tuple[int, float]:
    width = max(r.prompt_len for r in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):
        ids[i, width - r.prompt_len :] = torch.tensor(r.prompt_ids)
        mask[i, width - r.prompt_len :] = 1
    new = max(r.max_tokens for r in batch)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new,
            do_sample=False,
            pad_token_id=pad_id,
            eos_token_id=None,
            streamer=streamer,
        )
    dt = time.perf_counter() - t0
    generated = int(out.shape[1] - width)
    if generated != new:
        raise RuntimeError(f"HF generated {generated} tokens, expected {new}")
    return generated * len(batch), dt


def hf_pick_dtype(
    gguf_path: Path, pad_id: int, reqs: list[wl.Request]
) -> tuple[torch.dtype, dict[str, float]]:
    """Time a small batch in fp32 and bf16; the faster one is the fastest HF configuration here."""
    probe = [wl.Request(i, r.prompt_ids[:64], 16) for i, r in enumerate(reqs[:8])]
    times: dict[str, float] = {}
    for dt in (torch.float32, torch.bfloat16):
        model = load_hf(gguf_path, dt)
        hf_generate_batch(model, probe[:2], pad_id)  # warm up
        _, t = hf_generate_batch(model, probe, pad_id)
        times[str(dt).removeprefix("torch.")] = round(t, 2)
        del model
        gc.collect()
    best = torch.bfloat16 if times["bfloat16"] < times["float32"] else torch.float32
    return best, times


class HFGenerate(BenchEngine):
    name = "hf"

    def __init__(self, args: argparse.Namespace, gguf_path: Path, probe_reqs: list[wl.Request]) -> None:
        self.args, self.gguf_path, self.probe_reqs = args, gguf_path, probe_reqs
        self.model: Any = None
        self.pad_id = 2

    def setup(self, record: dict[str, Any]) -> None:
        if self.args.hf_dtype == "auto":
            dtype, probe = hf_pick_dtype(self.gguf_path, self.pad_id, self.probe_reqs)
            record["dtype_probe_s"] = probe
        else:
            dtype = getattr(torch, self.args.hf_dtype)
        self.model = load_hf(self.gguf_path, dtype)
        record["config"] = {
            "dtype": str(dtype).removeprefix("torch."),
            "threads": self.args.threads,
            "batch_size": self.args.hf_batch_size,
            "padding": "left",
            "attn_implementation": getattr(self.model.config, "_attn_implementation", None),
            "loaded_from": f"from_pretrained(dir, gguf_file={self.gguf_path.name!r}) (dequantized)",
            "transport": "in-process model.generate, static batches in submission order, greedy",
            "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        }
        hf_generate_batch(self.model, [wl.Request(0, self.probe_reqs[0].prompt_ids[:32], 4)], self.pad_id)

    def batch(self, reqs: list[wl.Request], tag: str) -> dict[str, Any]:
        return run_hf_batch(self.model, reqs, self.args.hf_batch_size, self.pad_id)

    def single(self, req: wl.Request) -> dict[str, Any]:
        return hf_single_stream(self.model, req, self.pad_id)

    def close(self) -> None:
        self.model = None
        gc.collect()


def run_hf_batch(model: Any, reqs: list[wl.Request], batch_size: int, pad_id: int) -> dict[str, Any]:
    generated = 0
    batches = []
    t0 = time.perf_counter()
    for i in range(0, len(reqs), batch_size):
        batch = reqs[i : i + batch_size]
        n, dt = hf_generate_batch(model, batch, pad_id)
        generated += n
        batches.append(round(dt, 2))
    wall = time.perf_counter() - t0
    useful = sum(r.max_tokens for r in reqs)
    return {
        "wall_s": round(wall, 2),
        "output_tokens": useful,
        "generated_tokens_incl_padding_rows": generated,
        "output_tok_per_s": round(useful / wall, 1),
        "total_tok_per_s": round((useful + sum(r.prompt_len for r in reqs)) / wall, 1),
        "batch_wall_s": batches,
    }


def hf_single_stream(model: Any, req: wl.Request, pad_id: int) -> dict[str, Any]:
    streamer = _TimingStreamer()
    t0 = time.perf_counter()
    hf_generate_batch(model, [req], pad_id, streamer=streamer)
    return single_stream_figures(t0, streamer.times, len(streamer.times))
