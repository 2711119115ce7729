"""`kvpilot crds`: print the generated CRD YAML, write it into a folder, or check a folder is current."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvpilot.api.crd import CRD_FILENAME, render_crd_yaml


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output", "-o", metavar="DIR", help=f"write DIR/{CRD_FILENAME} instead of printing")
    parser.add_argument(
        "--check",
        action="store_true",
        help="with --output: exit 1 (and write nothing) when the file differs from what the models generate",
    )


def run(args: argparse.Namespace) -> int:
    text = render_crd_yaml()
    if not args.output:
        if args.check:
            print("--check needs --output DIR", file=sys.stderr)
            return 2
        sys.stdout.write(text)
        return 0
    path = Path(args.output) / CRD_FILENAME
    if args.check:
        current = path.read_text() if path.exists() else None
        if current != text:
            print(f"{path} is out of date: run `kvpilot crds --output {args.output}`", file=sys.stderr)
            return 1
        print(f"{path} is up to date")
        return 0
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    print(f"wrote {path}")
    return 0
