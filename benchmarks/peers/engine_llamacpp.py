"""runtime_vs_peers.py's adapter for llama.cpp: llama-server (built by benchmarks/build_llamacpp.sh,
cached in benchmarks/.build/) with continuous batching, driven over HTTP like kvpilot serve."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvpilot.net import free_port
from peers.loadgen import HttpServer, Server
from peers.measure import BUILD_DIR, HERE

DEFAULT_LLAMACPP_VERSION = "0.3.36"


def llamacpp_binary(version: str, explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    # build_llamacpp.sh's folder: LLAMACPP_BUILD_DIR when set, as there
    build = Path(os.environ.get("LLAMACPP_BUILD_DIR", BUILD_DIR))
    path = build / f"llama.cpp-{version}" / "bin" / "llama-server"
    if not path.exists():
        print(f"building llama-server {version} (benchmarks/build_llamacpp.sh) ...", file=sys.stderr)
        subprocess.run(["bash", str(HERE / "build_llamacpp.sh"), version], check=True, stdout=sys.stderr)
    return path


def llamacpp_server(args: argparse.Namespace, gguf_path: Path, binary: Path) -> Server:
    port = free_port()
    argv = [
        str(binary),
        "-m",
        str(gguf_path),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "-t",
        str(args.llamacpp_threads or args.threads),
        "-tb",
        str(args.llamacpp_threads or args.threads),
        "-np",
        str(args.llamacpp_slots),
        "-c",
        str(args.llamacpp_slots * args.llamacpp_ctx_per_slot),
        "-b",
        "2048",
        "-ub",
        str(args.llamacpp_ubatch),
        "--cont-batching",
        "--no-webui",
        *args.llamacpp_extra.split(),
    ]
    return Server("llamacpp", argv, port, "/health", BUILD_DIR / "logs" / "llama-server.log")


def llamacpp_engine(args: argparse.Namespace, gguf_path: Path, warm_prompt: list[int]) -> HttpServer:
    """llama-server as an engine under test (builds the binary first when needed)."""
    binary = llamacpp_binary(args.llamacpp_version, args.llamacpp_bin)
    srv = llamacpp_server(args, gguf_path, binary)
    rel = binary.is_relative_to(HERE.parent)
    cfg: dict[str, Any] = {
        "llama_cpp_python_sdist": args.llamacpp_version,
        "binary": str(binary.relative_to(HERE.parent)) if rel else str(binary),
        "argv": srv.argv[1:],
        "weights": f"the same GGUF ({gguf_path.name}), run as stored",
        "transport": "llama-server /v1/completions, openai client (same requests as kvpilot serve)",
    }
    return HttpServer("llamacpp", srv, cfg, warm_prompt)
