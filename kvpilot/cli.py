"""The `kvpilot` command: one CLI, one subcommand per part.

Each part owns its flags in its own `cli.py` (``add_arguments(parser)`` and ``run(args) -> int``);
this module only dispatches, and imports a part lazily so that `kvpilot operator` never loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

# subcommand -> (module, help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("kvpilot.runtime.cli", "serve a model with the OpenAI-compatible API"),
    "bench": ("kvpilot.runtime.bench_cli", "offline throughput benchmark of the runtime"),
    "operator": ("kvpilot.operator.cli", "run the InferenceModel operator"),
    "crds": ("kvpilot.api.crds_cli", "print or write the generated CRD YAML"),
    "autoscaler": ("kvpilot.autoscaler.cli", "run the autoscaler, or simulate a policy on a trace"),
    "router": ("kvpilot.router.cli", "route OpenAI requests to the pods of many models (one endpoint)"),
}

# Top-level modules of pyproject's `runtime` extra (the operator, router and autoscaler need none).
RUNTIME_EXTRA_MODULES = frozenset(
    {"torch", "numpy", "gguf", "tokenizers", "safetensors", "jinja2", "tqdm", "xgrammar", "jsonschema"}
)


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvpilot", description="kvpilot: LLM inference fleets on Kubernetes"
    )
    from kvpilot import __version__

    parser.add_argument("--version", action="version", version=f"kvpilot {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    # Only the chosen subcommand's module is imported (keeps `kvpilot operator` free of torch).
    chosen = next((a for a in (argv or []) if not a.startswith("-")), None)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if chosen == name:
            try:
                mod = importlib.import_module(module)
            except ModuleNotFoundError as exc:
                if exc.name is None or exc.name.split(".")[0] not in RUNTIME_EXTRA_MODULES:
                    raise
                parser.error(
                    f"`kvpilot {name}` needs the runtime extra ({exc.name} is not installed): "
                    "pip install 'kvpilot[runtime]'"
                )
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(args_list)
    args = parser.parse_args(args_list)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 2
    result: int = run(args)
    return result
