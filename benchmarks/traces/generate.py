"""Generate the arrival traces in this folder (seeded; rerun to reproduce them byte for byte).

    python benchmarks/traces/generate.py [--out benchmarks/traces]

Arrivals are a non-homogeneous Poisson process (thinning) whose rate follows each scenario's shape,
with per-minute multiplicative noise; prompt and output lengths are log-normal (chat-like: median
prompt 400 tokens, median output 150), clipped to [16, 4096] and [1, 1024].
The shapes were written down before any policy was tuned on them and are not adjusted to a policy.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvpilot.autoscaler.trace import TraceRequest, write_trace

Rate = Callable[[float], float]


def _ramp(t: float, t0: float, t1: float, r0: float, r1: float) -> float:
    return r0 + (r1 - r0) * min(1.0, max(0.0, (t - t0) / (t1 - t0)))


def bursty(rng: np.random.Generator) -> tuple[float, Rate]:
    """90 minutes: quiet periods, ramps, short spikes, a sudden surge."""
    spikes = sorted(rng.uniform(1850, 2250, size=2))

    def rate(t: float) -> float:
        if t < 600:
            r = 3.0
        elif t < 1200:
            r = 1.0
        elif t < 1800:
            r = _ramp(t, 1200, 1800, 1.0, 12.0)
        elif t < 2400:
            r = 12.0 * (2.0 if any(s <= t < s + 120 for s in spikes) else 1.0)
        elif t < 3000:
            r = _ramp(t, 2400, 3000, 12.0, 4.0)
        elif t < 3600:
            r = 0.5
        elif t < 3840:
            r = 15.0
        elif t < 4800:
            r = 5.0
        else:
            r = _ramp(t, 4800, 5400, 5.0, 2.0)
        return r

    return 5400.0, rate


def diurnal(rng: np.random.Generator) -> tuple[float, Rate]:
    """A day compressed into two hours, with three unannounced short bursts."""
    period = 7200.0
    bursts = sorted(rng.uniform(600, 6600, size=3))

    def rate(t: float) -> float:
        r = 1.0 + 15.0 * math.sin(math.pi * t / period) ** 2
        if any(b <= t < b + 120 for b in bursts):
            r *= 1.5
        return r

    return period, rate


def flash_crowd(rng: np.random.Generator) -> tuple[float, Rate]:
    """An hour at a steady base, then a crowd (6x in 30 s, 8 minutes, slow decay) and a smaller one."""

    def crowd(t: float, t0: float, rise: float, hold: float, tau: float, peak: float) -> float:
        if t < t0:
            return 0.0
        if t < t0 + rise:
            return peak * (t - t0) / rise
        if t < t0 + rise + hold:
            return peak
        return peak * math.exp(-(t - t0 - rise - hold) / tau)

    def rate(t: float) -> float:
        return 4.0 + crowd(t, 1200, 30, 480, 150, 20.0) + crowd(t, 2700, 20, 180, 60, 8.0)

    return 3600.0, rate


SCENARIOS: dict[str, tuple[int, Callable[[np.random.Generator], tuple[float, Rate]]]] = {
    "bursty": (1, bursty),
    "diurnal": (2, diurnal),
    "flash_crowd": (3, flash_crowd),
}


def generate(seed: int, shape: Callable[[np.random.Generator], tuple[float, Rate]]) -> list[TraceRequest]:
    rng = np.random.default_rng(seed)
    duration, base_rate = shape(rng)
    minutes = math.ceil(duration / 60.0)
    noise = np.exp(rng.normal(0.0, 0.15, size=minutes))  # per-minute multiplicative noise

    def rate(t: float) -> float:
        return base_rate(t) * float(noise[min(minutes - 1, int(t // 60))])

    peak = max(rate(x) for x in np.arange(0.0, duration, 1.0)) * 1.05
    out: list[TraceRequest] = []
    t = 0.0
    while True:
        t += float(rng.exponential(1.0 / peak))
        if t >= duration:
            break
        if rng.uniform() * peak > rate(t):
            continue
        prompt = int(np.clip(rng.lognormal(math.log(400), 0.9), 16, 4096))
        output = int(np.clip(rng.lognormal(math.log(150), 0.8), 1, 1024))
        out.append(TraceRequest(round(t, 3), prompt, output))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(Path(__file__).parent))
    args = parser.parse_args()
    for name, (seed, shape) in SCENARIOS.items():
        reqs = generate(seed, shape)
        path = Path(args.out) / f"{name}.csv"
        write_trace(path, reqs)
        print(f"{path}: {len(reqs)} requests over {reqs[-1].t:.0f} s ({path.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
