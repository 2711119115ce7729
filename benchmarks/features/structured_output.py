"""Decode throughput with and without a JSON schema (structured output), at batch 1 and 32.

Both runs decode the same number of steps for every sequence: the unconstrained run ignores EOS,
and the schema needs a string of at least `--min-chars` characters, so no guided sequence can end
before `--max-tokens`. Only decode steps are timed (from the step after every sequence has its first
token to the end), so prefill does not dilute the difference. The two runs alternate `--rounds`
times and the best of each is reported (a shared machine's noise only ever slows a run down). The
grammar's own work (mask fill + apply in the sampler, matcher advance in the engine) is also timed
inside the guided runs, which gives its share of the step time independent of the machine's load.
Prints one JSON object.

    .venv/bin/python benchmarks/grammar_bench.py throughput [--batch-sizes 1 32] [--max-tokens 32] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch
from harness import cpu_model

from kvpilot.runtime.config import DEFAULT_MODEL, EngineConfig
from kvpilot.runtime.engine import sampler as sampler_module
from kvpilot.runtime.engine.build import build_engine
from kvpilot.runtime.engine.core import LLMEngine
from kvpilot.runtime.engine.sampling_params import SamplingParams
from kvpilot.runtime.grammar.structured_output import GrammarState, GuidedSpec


def schema(min_chars: int) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 24},
            "story": {"type": "string", "minLength": min_chars},
        },
        "required": ["title", "story"],
    }


class GrammarTimer:
    """Wall time spent in the grammar's per-step work (wraps the sampler's mask and the matcher's
    advance while installed)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._saved: list[tuple[Any, str, Any]] = []

    def _wrap(self, owner: Any, name: str) -> None:
        fn = getattr(owner, name)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t0

        self._saved.append((owner, name, fn))
        setattr(owner, name, timed)

    def __enter__(self) -> GrammarTimer:
        self._wrap(sampler_module, "masked_by_grammar")
        self._wrap(GrammarState, "accept")
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, fn in reversed(self._saved):
            setattr(owner, name, fn)


def decode_rate(engine: LLMEngine, prompt: list[int], batch: int, params: SamplingParams) -> dict[str, float]:
    ids = [f"b{batch}-{i}-{time.monotonic_ns()}" for i in range(batch)]
    for rid in ids:
        engine.add_request(rid, prompt, params)
    seqs = [engine.requests[rid].seq for rid in ids]
    while any(s.num_output_tokens == 0 for s in seqs):
        engine.step()
    start_tokens = sum(s.num_output_tokens for s in seqs)
    t0 = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - t0
    tokens = sum(s.num_output_tokens for s in seqs) - start_tokens
    assert all(s.finish_reason == "length" for s in seqs), [s.finish_reason for s in seqs]
    return {"decode_tokens": tokens, "seconds": round(elapsed, 3), "tok_per_s": round(tokens / elapsed, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--min-chars", type=int, default=1000)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads or os.cpu_count() or 1)
    cfg = EngineConfig(model=DEFAULT_MODEL, dtype=args.dtype, kv_cache_memory=512 * 2**20, max_model_len=1024)
    engine = build_engine(cfg)
    tok = engine.tokenizer
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a story as JSON."}]))
    spec = GuidedSpec.json_schema(schema(args.min_chars), "guided_json")
    engine.grammar_compiler.compile(spec)  # built once per server; not part of decoding
    plain = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, ignore_eos=True, seed=1)
    guided = SamplingParams(max_tokens=args.max_tokens, temperature=1.0, seed=1, guided=spec)
    decode_rate(engine, prompt, 2, plain)  # warm-up
    rows = []
    for batch in args.batch_sizes:
        bases, guideds, grammar_share = [], [], []
        for _ in range(args.rounds):
            bases.append(decode_rate(engine, prompt, batch, plain))
            with GrammarTimer() as timer:
                g = decode_rate(engine, prompt, batch, guided)
            guideds.append(g)
            # (the timer also counts the first step's mask, which is outside the timed decode: an upper bound)
            grammar_share.append(timer.seconds / g["seconds"])
        base = max(bases, key=lambda r: r["tok_per_s"])
        with_schema = max(guideds, key=lambda r: r["tok_per_s"])
        rows.append(
            {
                "batch": batch,
                "unconstrained_best": base,
                "json_schema_best": with_schema,
                "cost_pct_best_vs_best": round(100 * (1 - with_schema["tok_per_s"] / base["tok_per_s"]), 1),
                "all_tok_per_s": {
                    "unconstrained": [r["tok_per_s"] for r in bases],
                    "json_schema": [r["tok_per_s"] for r in guideds],
                },
                "grammar_share_of_decode_pct": [round(100 * x, 2) for x in grammar_share],
                "grammar_ms_per_step": round(
                    1e3 * min(grammar_share) * with_schema["seconds"] / (args.max_tokens - 1), 3
                ),
            }
        )
    print(
        json.dumps(
            {
                "cpu": cpu_model(),
                "threads": torch.get_num_threads(),
                "model": DEFAULT_MODEL,
                "dtype": args.dtype,
                "max_tokens": args.max_tokens,
                "results": rows,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
