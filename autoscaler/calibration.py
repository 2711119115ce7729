"""How fast one simulated replica is: the numbers the fleet simulator's engine model runs on.

Step time of one continuous-batching step (the shape every paged-KV engine has):
    step_s = step_overhead_s + decode_s_per_seq * decoding_seqs + prefill_s_per_token * prefill_tokens

The defaults are ASSUMED, not measured: an 8B-class fp16 model on one 48 GB GPU (L40S class) —
~22 ms to stream the weights once per step, ~0.4 ms per decoding sequence (its KV reads),
~8k prompt tokens/s prefill, 2048 KV blocks of 16 tokens (32k tokens after weights and activations),
60 s from pod start to Ready (image cached, weights loaded from a local volume).

To calibrate from the runtime, run `python benchmarks/calibrate_simulator.py` on the target hardware
with the settings pods run with (`--threads`, `--max-num-seqs`, `--kv-cache-memory`): it times the
real engine's steps, fits the three coefficients by least squares, reads the KV pool size, times
`kvpilot serve` to /ready, writes the JSON (the field names below) and checks the fit by replaying
Poisson arrivals through the engine and the simulator. Pass the file with --calibration.
benchmarks/calibration/smollm2-cpu.json is such a file for SmolLM2 on a shared 2-core CPU.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Calibration:
    step_overhead_s: float = 0.022
    decode_s_per_seq: float = 0.0004
    prefill_s_per_token: float = 0.00012
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int = 2048
    startup_s: float = 60.0
    max_queue_len: int = 1024
    source: str = "assumed defaults (8B fp16 on one 48 GB GPU); replace with the runtime's measurements"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "source" and (not isinstance(value, int | float) or value < 0):
                raise ValueError(f"calibration {f.name} must be a number >= 0, got {value!r}")
        if self.step_overhead_s <= 0 and self.decode_s_per_seq <= 0:
            raise ValueError("calibration: a step must take time (step_overhead_s or decode_s_per_seq > 0)")
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "num_kv_blocks",
            "max_queue_len",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"calibration {name} must be >= 1")

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    def step_seconds(self, decoding_seqs: int, prefill_tokens: int) -> float:
        return (
            self.step_overhead_s
            + self.decode_s_per_seq * decoding_seqs
            + self.prefill_s_per_token * prefill_tokens
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        known = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(
                f"unknown calibration field(s): {', '.join(unknown)} (known: {', '.join(known)})"
            )
        return cls(**data)

    @classmethod
    def from_file(cls, path: str | Path) -> Calibration:
        try:
            data = json.loads(Path(path).read_text())
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}: not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError(f"{path}: expected a JSON object of calibration fields")
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{path}: {exc}") from exc
