"""The roofline replica model (autoscaler/replica_model.py) against published serving figures: what the
simulator predicts for the same GPU, model, dtype and request shapes, side by side with the figure and
its citation. Prints one JSON object (and a markdown table with --markdown).

    python benchmarks/simulator_vs_published.py [--markdown]

Deterministic (no measurement here; seconds of CPU). Each prediction runs the fleet simulator with one
static replica on a trace shaped like the published benchmark:
- offline throughput (TensorRT-LLM's trtllm-bench: every request queued at once, fixed ISL/OSL): N
  requests at t = 0, output tokens / makespan, twice: as the simulator's default replica runs (256
  sequences, bf16 KV cache, vLLM's defaults) and set up like the benchmark (2048 sequences, nearer
  trtllm-bench's CUDA-graph batch sizes up to 8192; fp8 KV cache, as NVIDIA's ModelOpt FP8 checkpoints
  quantize it);
- closed loop at concurrency C (vllm bench serve --max-concurrency C, or a load generator's sweep):
  C x 20 requests at t = 0 on a replica with max_num_seqs = C, so a finished request's slot is
  refilled at once, as a client with C workers does; TPOT p50 and output tokens/s.
The figures' own settings are listed with each row. Errors are (predicted - published) / published.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Any

import harness

from kvpilot.autoscaler.calibration import Calibration
from kvpilot.autoscaler.fleet_policies import StaticPolicy
from kvpilot.autoscaler.replica_model import GPUS, MODELS, Gpu, calibration_by_name, calibration_for
from kvpilot.autoscaler.simulator import simulate
from kvpilot.autoscaler.slo import Slo
from kvpilot.autoscaler.trace import TraceRequest

TRTLLM = (
    "https://github.com/NVIDIA/TensorRT-LLM/blob/00f37686aa854010d68bcbd0f4ab000221541ca6/"
    "docs/source/performance/perf-overview.md"
)
TRTLLM_SETUP = (
    "TensorRT-LLM perf overview, table 'Llama 3.1 8B': nvidia/Llama-3.1-8B-Instruct-FP8, TP1, "
    "trtllm-bench throughput (PyTorch backend), all requests queued at once, fixed ISL/OSL; "
    "Total Output Throughput (tokens/s)"
)
INFERENCEBENCH = "https://yobitelcomm.github.io/bench/recipes/concurrency-sweep/"
INFERENCEBENCH_SETUP = (
    "InferenceBench concurrency sweep: one H100-80GB-HBM3, vLLM 0.21.0, Llama-3.1-8B-Instruct fp16, "
    "workload llm.inference.chatbot-short (prompt/output lengths not stated; 512/128 assumed here: "
    "TPOT at low concurrency is the weight read, almost independent of them); tpot_p50"
)
MUSGRAVE = "https://johnmusgrave.com/p/vllm-throughput-latency-sweep-on"
MUSGRAVE_SETUP = (
    "vLLM 0.23.0 throughput-latency sweep: one A100 40GB, Llama-3.1-8B-Instruct bf16, "
    "vllm bench serve random 1024 in / 128 out, --ignore-eos, --max-concurrency C; decode at C=1 "
    "'about 75 tokens/sec', throughput at C=8 '6.6x' that of C=1"
)
# Not in the simulator's GPU table (it has the 80 GB A100): the 40 GB SXM part, datasheet figures, the
# same efficiency factors as the table's A100.
A100_40GB = replace(
    GPUS["a100"],
    name="A100 SXM 40GB",
    hbm_bytes=40e9,
    bandwidth_bytes_s=1.555e12,
    source="NVIDIA A100 Tensor Core GPU datasheet (40GB SXM): 40 GB HBM2, 1,555 GB/s, 312 TFLOP/s bf16",
)
NO_SLO = Slo(ttft_s=1e9, tpot_s=1e9, ttft_prefill_factor=0.0)


def run_batch(cal: Calibration, n: int, prompt: int, output: int) -> dict[str, float]:
    """n requests at t = 0 on one replica: output tokens/s over the makespan, TTFT and TPOT p50."""
    trace = [TraceRequest(0.0, prompt, output) for _ in range(n)]
    # Every request waits (a benchmark client's queue), none is rejected.
    res = simulate(
        trace, StaticPolicy(1), replace(cal, startup_s=0.0, max_queue_len=n), slo=NO_SLO, warmup_s=0.0
    )
    if res.rejected:
        raise RuntimeError(f"{res.rejected} of {n} requests rejected")
    return {
        "output_tokens_s": n * output / res.last_finish_s,
        "tpot_p50_s": res.tpot_p50_s,
        "ttft_p50_s": res.ttft_p50_s,
    }


def offline(cal: Calibration, isl: int, osl: int, batch: int) -> float:
    c = replace(cal, max_num_seqs=batch)
    # Enough requests for several turns of a full batch (the KV pool may hold fewer than `batch`).
    fit = max(1, min(batch, c.kv_capacity_tokens // (isl + osl)))
    return run_batch(c, 4 * fit, isl, osl)["output_tokens_s"]


def closed_loop(cal: Calibration, concurrency: int, prompt: int, output: int) -> dict[str, float]:
    return run_batch(replace(cal, max_num_seqs=concurrency), 20 * concurrency, prompt, output)


def err(pred: float, pub: float) -> float:
    return round((pred - pub) / pub, 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    started = time.time()
    rows: list[dict[str, Any]] = []

    # TensorRT-LLM, Llama 3.1 8B FP8, offline output throughput (tokens/s).
    trt = {
        "h100": {(128, 128): 28_312, (128, 2048): 22_714, (1000, 1000): 15_220, (2048, 128): 3_450,
                 (5000, 500): 3_459, (20000, 2000): 1_351},
        "h200": {(128, 128): 27_911, (1000, 1000): 17_744, (2048, 128): 3_538, (5000, 500): 3_902},
    }  # fmt: skip
    for gpu, figures in trt.items():
        cal = calibration_by_name(f"{gpu}/llama-3.1-8b/fp8", startup_s=0.0)
        like = calibration_for(GPUS[gpu], MODELS["llama-3.1-8b"], "fp8", kv_dtype="fp8", startup_s=0.0)
        for (isl, osl), pub in figures.items():
            p256 = offline(cal, isl, osl, 256)
            p2048 = offline(like, isl, osl, 2048)
            rows.append(
                {
                    "pair": f"{gpu}/llama-3.1-8b/fp8",
                    "figure": f"offline output tokens/s, ISL/OSL {isl}/{osl}",
                    "published": pub,
                    "predicted": round(p256, 1),
                    "error": err(p256, pub),
                    "predicted_as_benchmarked": round(p2048, 1),
                    "error_as_benchmarked": err(p2048, pub),
                    "source": TRTLLM,
                    "setup": TRTLLM_SETUP,
                }
            )

    # InferenceBench, H100 bf16, TPOT p50 by concurrency.
    h100 = calibration_by_name("h100/llama-3.1-8b", startup_s=0.0)
    for conc, pub_ms in ((1, 6.48), (4, 6.59), (16, 10.94)):
        pred = closed_loop(h100, conc, 512, 128)["tpot_p50_s"] * 1000.0
        rows.append(
            {
                "pair": "h100/llama-3.1-8b",
                "figure": f"TPOT p50 ms at concurrency {conc}",
                "published": pub_ms,
                "predicted": round(pred, 2),
                "error": err(pred, pub_ms),
                "source": INFERENCEBENCH,
                "setup": INFERENCEBENCH_SETUP,
            }
        )

    # Musgrave, A100 40GB bf16: decode tokens/s at C=1 and the C=8 / C=1 throughput ratio.
    a100 = calibration_for(A100_40GB, MODELS["llama-3.1-8b"], startup_s=0.0, name="A100 40GB")
    one = closed_loop(a100, 1, 1024, 128)
    eight = closed_loop(a100, 8, 1024, 128)
    rows.append(
        {
            "pair": "a100-40gb/llama-3.1-8b",
            "figure": "decode tokens/s at concurrency 1 (1 / TPOT)",
            "published": 75.0,
            "predicted": round(1.0 / one["tpot_p50_s"], 1),
            "error": err(1.0 / one["tpot_p50_s"], 75.0),
            "source": MUSGRAVE,
            "setup": MUSGRAVE_SETUP,
        }
    )
    ratio = eight["output_tokens_s"] / one["output_tokens_s"]
    rows.append(
        {
            "pair": "a100-40gb/llama-3.1-8b",
            "figure": "output throughput, concurrency 8 over 1",
            "published": 6.6,
            "predicted": round(ratio, 2),
            "error": err(ratio, 6.6),
            "source": MUSGRAVE,
            "setup": MUSGRAVE_SETUP,
        }
    )
    out = {
        "model": "autoscaler/replica_model.py roofline (efficiency factors as committed: "
        + ", ".join(f"{k} bw x{g.bandwidth_efficiency} flops x{g.flops_efficiency}" for k, g in GPUS.items())
        + ")",
        "a100_40gb": _gpu_dict(A100_40GB),
        "rows": rows,
        "mean_abs_error": round(sum(abs(r["error"]) for r in rows) / len(rows), 3),
        "mean_abs_error_as_benchmarked": round(
            sum(abs(r.get("error_as_benchmarked", r["error"])) for r in rows) / len(rows), 3
        ),
        "machine": harness.machine(),
        "wall_s": round(time.time() - started, 1),
    }
    harness.emit(out)
    if args.markdown:
        print()
        harness.print_table(
            [
                "pair",
                "figure",
                "published",
                "predicted (default replica)",
                "error",
                "predicted (2048 seqs, fp8 KV)",
                "error",
                "source",
            ],
            (
                [
                    r["pair"],
                    r["figure"],
                    f"{r['published']:g}",
                    f"{r['predicted']:g}",
                    f"{r['error'] * 100:+.0f}%",
                    f"{r['predicted_as_benchmarked']:g}"
                    if r.get("predicted_as_benchmarked") is not None
                    else "",
                    f"{r['error_as_benchmarked'] * 100:+.0f}%"
                    if r.get("predicted_as_benchmarked") is not None
                    else "",
                    r["source"],
                ]
                for r in rows
            ),
        )


def _gpu_dict(g: Gpu) -> dict[str, Any]:
    return {"name": g.name, "hbm_gb": g.hbm_bytes / 1e9, "bandwidth_tb_s": g.bandwidth_bytes_s / 1e12}


if __name__ == "__main__":
    main()
