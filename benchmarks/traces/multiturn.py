"""Multi-turn conversation traces in the Mooncake JSONL format, with prefix-sharing hash_ids (seeded).

    python benchmarks/traces/multiturn.py --out /tmp/multiturn.jsonl [--seed 1] [--requests 11000]
        [--duration 3600] [--wave 0.3] [--context-median 6000] [--output-median 200]

A stand-in for production chat traffic that no policy was tuned on: the autoscaler's goals are judged
on traces it has not seen, and the public synthetic trace is stationary and Poisson with few turns.
Sessions arrive as a non-homogeneous Poisson process (a slow wave of +-`--wave` over the hour, times
a log-normal factor per 5 minutes); a session opens with one of 20 shared system prompts (Zipf
popularity) and its own context, then asks Geometric(0.6) turns (mean 1.7); each later turn arrives after
the previous answer (its output at 30 ms a token) and an exponential think time (mean 45 s), and its
prompt is the previous prompt + the answer + a new user message. hash_ids are Mooncake's: one id
per 512-token block, equal ids for an equal prefix (shared system-prompt blocks across sessions, the
whole previous turn within a session; a block whose end moves gets a new id). Defaults give about
11,000 requests in an hour with prompts averaging ~12.6k tokens (43% of their blocks seen before) and outputs ~300 tokens, the scale of
the production conversation trace the issue describes; the shape parameters were written down before
any policy ran on them.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK = 512  # Mooncake's hash block


@dataclass(frozen=True)
class Shape:
    requests: int = 11000
    duration_s: float = 3600.0
    wave: float = 0.3  # relative amplitude of the hour's slow wave
    noise_sigma: float = 0.15  # log-normal factor per 5 minutes
    system_prompts: int = 20
    system_median: float = 1500.0
    context_median: float = 8000.0
    context_sigma: float = 0.8
    message_median: float = 200.0
    output_median: float = 200.0
    output_sigma: float = 0.9
    continue_p: float = 0.4  # another turn follows with this probability
    think_mean_s: float = 45.0
    decode_s_per_token: float = 0.03
    max_prompt: int = 128_000


def _lognormal(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(median * math.exp(sigma * rng.standard_normal())))))


class _BlockIds:
    """One integer per distinct block content key, in order of first use."""

    def __init__(self) -> None:
        self._ids: dict[tuple[int | str, ...], int] = {}

    def get(self, key: tuple[int | str, ...]) -> int:
        return self._ids.setdefault(key, len(self._ids))


def _hash_ids(ids: _BlockIds, system: int, system_len: int, session: int, prompt: int) -> list[int]:
    """Blocks wholly inside the shared system prompt are keyed by it; any other block by the session,
    its index and where its content ends (a partial last block changes id once the prompt grows)."""
    out = []
    for i in range(-(-prompt // BLOCK)):
        end = min(prompt, (i + 1) * BLOCK)
        key: tuple[int | str, ...] = ("sys", system, i) if end <= system_len else (session, i, end)
        out.append(ids.get(key))
    return out


def generate(shape: Shape, seed: int) -> list[dict[str, int | list[int]]]:
    rng = np.random.default_rng(seed)
    turns_mean = 1.0 / (1.0 - shape.continue_p)
    base_rate = shape.requests / turns_mean / shape.duration_s  # sessions per second
    phase = rng.uniform(0, 2 * math.pi)
    noise = np.exp(shape.noise_sigma * rng.standard_normal(int(shape.duration_s // 300) + 1))
    peak = base_rate * (1 + shape.wave) * float(noise.max())

    def rate(t: float) -> float:
        wave = 1 + shape.wave * math.sin(2 * math.pi * t / shape.duration_s + phase)
        return base_rate * wave * float(noise[int(t // 300)])

    zipf = 1.0 / np.arange(1, shape.system_prompts + 1)
    zipf /= zipf.sum()
    system_lens = [_lognormal(rng, shape.system_median, 0.5, 64, 8000) for _ in range(shape.system_prompts)]
    ids = _BlockIds()
    heap: list[tuple[float, int, int, int, int]] = []  # (t, session, system, prompt, turns left)
    t, session = 0.0, 0
    while True:  # session starts by thinning
        t += rng.exponential(1.0 / peak)
        if t >= shape.duration_s:
            break
        if rng.uniform() * peak > rate(t):
            continue
        system = int(rng.choice(shape.system_prompts, p=zipf))
        prompt = system_lens[system] + _lognormal(rng, shape.context_median, shape.context_sigma, 16, 100_000)
        turns = int(rng.geometric(1.0 - shape.continue_p))  # 1 + Geometric: mean 1 / (1 - p)
        heapq.heappush(heap, (t, session, system, min(prompt, shape.max_prompt), turns))
        session += 1
    rows: list[dict[str, int | list[int]]] = []
    while heap:
        t, s, system, prompt, turns = heapq.heappop(heap)
        if t >= shape.duration_s:
            continue
        output = _lognormal(rng, shape.output_median, shape.output_sigma, 1, 4096)
        rows.append(
            {
                "timestamp": int(t * 1000),
                "input_length": prompt,
                "output_length": output,
                "hash_ids": _hash_ids(ids, system, system_lens[system], s, prompt),
            }
        )
        if turns > 1:
            message = _lognormal(rng, shape.message_median, 1.0, 4, 8000)
            nxt = t + output * shape.decode_s_per_token + rng.exponential(shape.think_mean_s)
            grown = prompt + output + message
            if grown <= shape.max_prompt:
                heapq.heappush(heap, (nxt, s, system, grown, turns - 1))
    return rows


def summary(rows: list[dict[str, int | list[int]]]) -> dict[str, float]:
    inputs = [int(r["input_length"]) for r in rows]  # type: ignore[arg-type]
    outputs = [int(r["output_length"]) for r in rows]  # type: ignore[arg-type]
    seen: set[int] = set()
    reused = total = 0
    for r in rows:
        for h in r["hash_ids"]:  # type: ignore[union-attr]
            total += 1
            reused += h in seen
            seen.add(h)
    return {
        "requests": len(rows),
        "minutes": round(int(rows[-1]["timestamp"]) / 60000.0, 1),  # type: ignore[arg-type]
        "input_mean": round(statistics.fmean(inputs)),
        "output_mean": round(statistics.fmean(outputs)),
        "block_reuse": round(reused / max(1, total), 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the JSONL file to write")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--requests", type=int, default=Shape.requests, help="about this many requests")
    p.add_argument("--duration", type=float, default=Shape.duration_s, help="seconds")
    p.add_argument("--wave", type=float, default=Shape.wave, help="the slow wave's relative amplitude")
    p.add_argument("--context-median", type=float, default=Shape.context_median, help="tokens")
    p.add_argument("--output-median", type=float, default=Shape.output_median, help="tokens")
    p.add_argument("--continue-p", type=float, default=Shape.continue_p, help="P(another turn follows)")
    args = p.parse_args()
    if args.requests < 1 or args.duration <= 0 or not 0 <= args.wave < 1 or not 0 <= args.continue_p < 1:
        p.error("--requests must be >= 1, --duration > 0, --wave and --continue-p in [0, 1)")
    shape = Shape(
        requests=args.requests,
        duration_s=args.duration,
        wave=args.wave,
        context_median=args.context_median,
        output_median=args.output_median,
        continue_p=args.continue_p,
    )
    rows = generate(shape, args.seed)
    Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(json.dumps({"out": args.out, "seed": args.seed, **summary(rows)}))


if __name__ == "__main__":
    main()
