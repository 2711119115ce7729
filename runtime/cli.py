"""`kvpilot serve [MODEL]`: flags, `--config FILE`, and the serving process.

Precedence: EngineConfig defaults < the `--config` YAML file < flags given on the command line.
Every flag defaults to "not given" (argparse.SUPPRESS), so only what the user typed overrides the
file. Invalid settings print a message naming the field and exit with status 2.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import re
import sys
from pathlib import Path
from typing import Any, get_args

import yaml
from pydantic import ValidationError

from kvpilot.kernels.switches import ACTIVATIONS
from kvpilot.runtime.config import EXIT_GRACE_S, ConfigError, EngineConfig, KVCacheDtype
from kvpilot.runtime.engine.build import build_async_engine

log = logging.getLogger("kvpilot.serve")

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "ki": 1024,
    "kib": 1024,
    "mi": 1024**2,
    "mib": 1024**2,
    "gi": 1024**3,
    "gib": 1024**3,
    "ti": 1024**4,
    "tib": 1024**4,
}


def parse_bytes(text: str) -> int:
    """'536870912', '512MiB', '2GiB', '1.5G' -> bytes (argparse type: errors name the flag)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: use bytes or a suffix like 512MiB, 2GiB, 1.5GB"
        )
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"invalid size {text!r}: must be positive")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid integer {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    s = argparse.SUPPRESS
    parser.add_argument(
        "model",
        nargs="?",
        default=s,
        help="builtin name (default smollm2-135m-instruct), a .gguf file or a Hugging Face-style directory",
    )
    parser.add_argument(
        "--config", metavar="FILE", default=s, help="YAML settings (flags given here override it)"
    )
    g = parser.add_argument_group("server")
    g.add_argument("--host", default=s, help="address to listen on (default 0.0.0.0)")
    g.add_argument("--port", type=int, default=s, help="port to listen on (default 8000)")
    g.add_argument("--served-model-name", default=s, help="model name clients use (default: from MODEL)")
    g.add_argument(
        "--api-key", default=s, help="require 'Authorization: Bearer KEY' on /v1/* (or KVPILOT_API_KEY)"
    )
    g.add_argument(
        "--max-queue-len", type=_positive_int, default=s, help="waiting requests beyond this get 429"
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=s,
        help="seconds in-flight requests get on SIGTERM (default 30); the process ends at most 10 s "
        "later, even with the engine stuck",
    )
    g.add_argument(
        "--engine-stall-timeout",
        type=float,
        default=s,
        metavar="SECONDS",
        help="an engine loop without progress this long while it has work fails /health and /ready "
        "(default 60; 0: never)",
    )
    e = parser.add_argument_group("engine")
    e.add_argument("--device", choices=["auto", "cpu", "cuda"], default=s)
    e.add_argument("--dtype", choices=["auto", "float32", "bfloat16", "float16"], default=s)
    e.add_argument(
        "--max-model-len", type=_positive_int, default=s, help="context length (default: the model's)"
    )
    e.add_argument("--max-num-seqs", type=_positive_int, default=s, help="sequences per batch")
    e.add_argument("--max-num-batched-tokens", type=_positive_int, default=s, help="token budget per step")
    e.add_argument(
        "--block-size",
        type=_positive_int,
        default=s,
        help="tokens per KV block (default: 256 on CUDA with flash-attn, else 16)",
    )
    e.add_argument("--kv-cache-dtype", choices=list(get_args(KVCacheDtype)), default=s)
    e.add_argument(
        "--kv-cache-memory", type=parse_bytes, default=s, metavar="BYTES", help="KV pool size, e.g. 2GiB"
    )
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=s)
    e.add_argument(
        "--quantization",
        choices=["int8", "int4", "auto", "none"],
        default=s,
        help="weight-only quantization of the linear layers and the LM head (auto: the checkpoint's own: "
        "a GGUF's Q8_0/Q4_x blocks, GPTQ, AWQ; none: dequantized at load). Default: the default path "
        "(auto with float activations for such a GGUF on an AVX2/AVX-512 CPU, else none; logged at start)",
    )
    e.add_argument(
        "--quantization-group-size", type=int, choices=[32, 64, 128], default=s, help="int4 group size"
    )
    e.add_argument("--tensor-parallel-size", type=_positive_int, default=s)
    e.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        default=s,
        help="MoE models: whole experts per tensor-parallel rank instead of every expert split across them",
    )
    e.add_argument("--gpu-memory-utilization", type=float, default=s)
    e.add_argument("--threads", type=_positive_int, default=s, help="torch threads on CPU")
    e.add_argument("--seed", type=int, default=s)
    e.add_argument(
        "--enforce-eager", action="store_true", default=s, help="no CUDA graphs: decode steps run eagerly"
    )
    so = parser.add_argument_group("structured output")
    so.add_argument(
        "--grammar-compile-timeout",
        type=float,
        default=s,
        metavar="SECONDS",
        help="a grammar that takes longer to compile is refused with 400 (default 10)",
    )
    so.add_argument(
        "--grammar-compile-memory",
        type=parse_bytes,
        default=s,
        metavar="BYTES",
        help="memory one grammar's compile may use, e.g. 2GiB; more is refused with 400 (default 2GiB)",
    )
    so.add_argument(
        "--grammar-compile-workers",
        type=_positive_int,
        default=s,
        help="worker processes that compile grammars, each one at a time (default 2)",
    )
    so.add_argument(
        "--grammar-compile-queue",
        type=int,
        default=s,
        help="distinct grammars that may wait for a worker; beyond this 429 (default 64)",
    )
    so.add_argument(
        "--grammar-max-bytes",
        type=parse_bytes,
        default=s,
        metavar="BYTES",
        help="largest schema, regex, grammar or choice list; larger is refused with 400 (default 256KiB)",
    )
    sp = parser.add_argument_group("speculative decoding")
    sp.add_argument("--speculative-method", choices=["ngram", "draft"], default=s)
    sp.add_argument(
        "--num-speculative-tokens", type=int, default=s, metavar="K", help="tokens proposed per step, 1..16"
    )
    sp.add_argument("--speculative-model", default=s, metavar="PATH", help="draft model for 'draft'")
    sp.add_argument("--prompt-lookup-min", type=int, default=s, help="ngram: shortest match (default 1)")
    sp.add_argument("--prompt-lookup-max", type=int, default=s, help="ngram: longest match (default 4)")
    sp.add_argument(
        "--speculative-adaptive",
        action=argparse.BooleanOptionalAction,
        default=s,
        help="adapt the proposal length to acceptance and batch load (default on)",
    )
    sp.add_argument(
        "--speculative-disable-by-batch-size",
        type=_positive_int,
        default=s,
        help="no speculation while this many sequences run",
    )
    lo = parser.add_argument_group("LoRA adapters")
    lo.add_argument(
        "--enable-lora",
        action="store_true",
        default=s,
        help="serve PEFT LoRA adapters (implied by --lora-modules and --enable-lora-runtime-updates)",
    )
    lo.add_argument(
        "--lora-modules",
        nargs="+",
        default=s,
        metavar="NAME=PATH",
        help="adapters to load at start; a request's `model` picks one by NAME",
    )
    lo.add_argument(
        "--max-loras", type=_positive_int, default=s, help="adapters resident at once (default 4)"
    )
    lo.add_argument(
        "--max-lora-rank", type=_positive_int, default=s, help="largest adapter rank accepted (default 16)"
    )
    lo.add_argument(
        "--enable-lora-runtime-updates",
        action="store_true",
        default=s,
        help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter; they need the API key",
    )
    lo.add_argument(
        "--allow-lora-updates-without-api-key",
        action="store_true",
        default=s,
        help="let those endpoints answer when no API key is set: anyone who reaches the port can then "
        "load adapters from this machine's disk (implies --enable-lora-runtime-updates)",
    )
    ks = parser.add_argument_group("kernel switches (environment variables override them: docs/runtime.md)")
    ks.add_argument(
        "--cpu-isa",
        choices=["auto", "avx512", "avx2", "generic"],
        default=s,
        help="ISA level the CPU kernels are built for (default auto: the best this CPU runs; KVPILOT_CPU_ISA)",
    )
    ks.add_argument(
        "--cpu-kernels",
        action=argparse.BooleanOptionalAction,
        default=s,
        help="the C kernels on CPU (default on; off: the torch paths; KVPILOT_DISABLE_CPU_KERNEL=1)",
    )
    ks.add_argument(
        "--qmatmul-activations",
        choices=list(ACTIVATIONS),
        default=s,
        help="quantized matmuls on CPU: int8 activations (the default under --quantization), int16 "
        "(rounded per block of 32 to 16 bits, weights exact), bf16 (activations rounded to bfloat16, "
        "weights exact) or float (the exact product); default: the default path's "
        "(KVPILOT_QMATMUL_ACTIVATIONS)",
    )
    ks.add_argument(
        "--cpu-decoder-stack",
        action=argparse.BooleanOptionalAction,
        default=s,
        help="a CPU decode step's decoder layers in one C call where the model allows (default on; "
        "KVPILOT_CPU_DECODER_STACK)",
    )
    ks.add_argument(
        "--kernel-cache-dir",
        default=s,
        metavar="DIR",
        help="where built CPU kernels are cached (default ~/.cache/kvpilot/kernels; KVPILOT_KERNEL_CACHE)",
    )
    pd = parser.add_argument_group("prefill/decode disaggregation (docs/disaggregation.md)")
    pd.add_argument(
        "--kv-role",
        choices=["prefill", "decode", "both"],
        default=s,
        help="prefill: run prompts and hand their KV blocks over (GET /v1/kv/transfers/ID); decode: admit "
        "requests whose KV arrives from a prefill pod; both (default): an aggregated pod that accepts either",
    )
    pd.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=s,
        metavar="SECONDS",
        help="decode side: deadline of one KV pull; past it the prompt is recomputed locally (default 10)",
    )
    pd.add_argument(
        "--kv-transfer-ttl",
        type=float,
        default=s,
        metavar="SECONDS",
        help="prefill side: how long a transfer's blocks stay pinned when the decode pod never releases "
        "them (default 30)",
    )
    pd.add_argument(
        "--kv-transfer-pin-fraction",
        type=float,
        default=s,
        metavar="SHARE",
        help="prefill side: share of the KV pool pinned transfers may hold (default 0.5); beyond it a prefill "
        "answers without kv_transfer_params and the decode pod recomputes",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


_NOT_CONFIG = {"config", "log_level", "_run", "command"}


def build_config(args: argparse.Namespace) -> EngineConfig:
    """Defaults < --config file < explicit flags. Raises ValueError with a message naming the field."""
    data: dict[str, Any] = {}
    config_path = getattr(args, "config", None)
    if config_path:
        try:
            loaded = yaml.safe_load(Path(config_path).read_text())
        except OSError as e:
            raise ValueError(f"--config {config_path}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise ValueError(f"--config {config_path}: not valid YAML: {e}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ValueError(f"--config {config_path}: expected a mapping of settings at the top level")
        data.update(loaded)
    flags = {k: v for k, v in vars(args).items() if k not in _NOT_CONFIG}
    if "lora_modules" in flags:
        from kvpilot.runtime.lora.adapter import parse_lora_modules

        flags["lora_modules"] = parse_lora_modules(flags["lora_modules"])
    data.update(flags)
    try:
        return EngineConfig.model_validate(data)
    except ValidationError as e:
        raise ValueError(_describe(e, config_path, set(flags))) from None


def _describe(e: ValidationError, config_path: str | None, from_flags: set[str]) -> str:
    lines = []
    for err in e.errors(include_url=False):
        field = ".".join(str(p) for p in err["loc"]) or "config"
        top = str(err["loc"][0]) if err["loc"] else ""
        if top in from_flags:
            where = f"--{top.replace('_', '-')}"
        elif config_path:
            where = f"{config_path}: {field}"
        else:
            where = field
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown setting"
        lines.append(f"invalid setting {where}: {msg}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=getattr(logging, str(getattr(args, "log_level", "info")).upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        cfg = build_config(args)
        api_key = cfg.resolved_api_key()
    except (ValueError, OSError) as e:
        print(f"kvpilot serve: {e}", file=sys.stderr)
        return 2
    try:
        return asyncio.run(_serve(cfg, api_key))
    except ConfigError as e:
        print(f"kvpilot serve: {e}", file=sys.stderr)
        return 2


async def _serve(cfg: EngineConfig, api_key: str | None) -> int:
    from kvpilot.runtime.lora.access import startup_notice
    from kvpilot.runtime.serving.lifecycle import exit_deadline_on, serve
    from kvpilot.runtime.serving.server import OpenAIServer, ServerSettings

    settings = ServerSettings(
        model_name=cfg.model_name,
        api_key=api_key,
        shutdown_timeout=cfg.shutdown_timeout,
        lora_runtime_updates=cfg.enable_lora_runtime_updates,
        lora_updates_without_api_key=cfg.allow_lora_updates_without_api_key,
    )
    notice = startup_notice(
        cfg.enable_lora_runtime_updates, bool(api_key), cfg.allow_lora_updates_without_api_key
    )
    if notice is not None:
        log.log(*notice)
    server = OpenAIServer(settings)

    def load() -> Any:
        if cfg.threads is not None:
            import torch

            torch.set_num_threads(cfg.threads)

        return build_async_engine(cfg)

    log.info("loading model %s (device=%s, dtype=%s)", cfg.model, cfg.device, cfg.dtype)
    stop = asyncio.Event()
    # SIGTERM always ends the process: at most EXIT_GRACE_S after --shutdown-timeout, stuck engine or not
    deadline = asyncio.ensure_future(exit_deadline_on(stop, cfg.shutdown_timeout + EXIT_GRACE_S))
    try:
        return await serve(
            server, cfg.host, cfg.port, load_engine=load, shutdown_timeout=cfg.shutdown_timeout, stop=stop
        )
    finally:
        deadline.cancel()
