"""How fast one simulated replica is: the numbers the fleet simulator's engine model runs on.

Step time of one continuous-batching step (the shape every paged-KV engine has):
    step_s = step_overhead_s + decode_s_per_seq * decoding_seqs + prefill_s_per_token * prefill_tokens
             + max(memory_s, compute_s)
    memory_s  = weight_read_s + expert_read_s * experts touched + kv_read_s_per_token * context tokens
    compute_s = compute_s_per_token * tokens + attn_s_per_token_pair * attention pairs
The first line is the linear model fitted to the CPU runtime (benchmarks/calibrate_simulator.py); the
roofline terms (replica_model.py: GPU x model from first principles) are 0 there. A GPU calibration has
the linear coefficients at 0 and the roofline ones set: `--calibration h100/llama-3.1-8b`.

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
    # Roofline terms (replica_model.calibration_for); 0 in a fitted linear calibration.
    weight_read_s: float = 0.0  # reading the weights every token goes through, once per step
    expert_read_s: float = 0.0  # reading one expert (all layers), per expert the step touches
    num_experts: int = 0
    experts_per_token: int = 0
    kv_read_s_per_token: float = 0.0  # reading one token of context's KV
    compute_s_per_token: float = 0.0  # 2 x active params FLOPs, per token computed
    attn_s_per_token_pair: float = 0.0  # attention FLOPs per (query token, key token) pair
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_kv_blocks: int = 2048
    startup_s: float = 60.0
    max_queue_len: int = 1024
    # P/D disaggregation (pd_simulator.py): the KV bytes of one prompt token (K and V of every layer,
    # all tensor-parallel shards; the default is an 8B GQA model's, 2 x 32 layers x 8 KV heads x 128 x
    # 2 bytes) and the link a decode pod pulls them over. Default 25 GB/s: one 200 Gb/s RDMA NIC
    # (InfiniBand HDR / RoCE), what P/D deployments run on; 100 GbE is 12.5 GB/s, NVLink within a
    # node several times more.
    kv_bytes_per_token: float = 131072.0
    kv_link_bytes_s: float = 25e9
    source: str = "assumed defaults (8B fp16 on one 48 GB GPU); replace with the runtime's measurements"

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "source" and (not isinstance(value, int | float) or value < 0):
                raise ValueError(f"calibration {f.name} must be a number >= 0, got {value!r}")
        if self.kv_link_bytes_s <= 0:
            raise ValueError("calibration kv_link_bytes_s must be > 0")
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
        if self.experts_per_token > self.num_experts or (self.num_experts and not self.experts_per_token):
            raise ValueError("calibration experts_per_token must be in [1, num_experts] for a MoE")

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_kv_blocks * self.block_size

    @property
    def roofline(self) -> bool:
        return (
            self.weight_read_s > 0
            or self.compute_s_per_token > 0
            or self.kv_read_s_per_token > 0
            or self.attn_s_per_token_pair > 0
        )

    def step_seconds(
        self,
        decoding_seqs: float,
        prefill_tokens: float,
        context_tokens: float = 0.0,
        attn_pairs: float = 0.0,
    ) -> float:
        """One step: `decoding_seqs` sequences emit a token, `prefill_tokens` prompt tokens are
        computed (fractional in slo.py's steady-state averages); the roofline terms also take the KV tokens the step reads (`context_tokens`, all
        sequences' context) and the attention (query, key) pairs it computes (`attn_pairs`)."""
        linear = (
            self.step_overhead_s
            + self.decode_s_per_seq * decoding_seqs
            + self.prefill_s_per_token * prefill_tokens
        )
        if not self.roofline:
            return linear
        tokens = decoding_seqs + prefill_tokens
        memory = self.weight_read_s + self.kv_read_s_per_token * context_tokens
        if self.num_experts and tokens > 0:
            k, e = self.experts_per_token, self.num_experts
            memory += self.expert_read_s * e * (1.0 - (1.0 - k / e) ** tokens)
        compute = self.compute_s_per_token * tokens + self.attn_s_per_token_pair * attn_pairs
        return linear + max(memory, compute)

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
