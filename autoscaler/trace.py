"""Arrival traces: CSV with a header `t_seconds,prompt_tokens,output_tokens`, one row per request."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

HEADER = ("t_seconds", "prompt_tokens", "output_tokens")


@dataclass(frozen=True)
class TraceRequest:
    t: float
    prompt_tokens: int
    output_tokens: int


class TraceError(ValueError):
    """A trace file that cannot be used; the message names the file and line."""


def parse_trace(text: str, name: str = "<trace>") -> list[TraceRequest]:
    rows = csv.reader(io.StringIO(text))
    header = next(rows, None)
    if header is None:
        raise TraceError(f"{name}: empty file; expected the header {','.join(HEADER)}")
    if tuple(h.strip() for h in header) != HEADER:
        raise TraceError(f"{name}:1: expected the header {','.join(HEADER)}, got {','.join(header)}")
    out: list[TraceRequest] = []
    last_t = 0.0
    for row in rows:
        line = rows.line_num
        if not row or all(not c.strip() for c in row):
            continue
        if len(row) != 3:
            raise TraceError(f"{name}:{line}: expected 3 columns ({','.join(HEADER)}), got {len(row)}")
        try:
            t = float(row[0])
        except ValueError:
            raise TraceError(f"{name}:{line}: t_seconds {row[0].strip()!r} is not a number") from None
        if not t >= 0.0 or t == float("inf"):
            raise TraceError(f"{name}:{line}: t_seconds must be a finite number >= 0, got {row[0].strip()}")
        if t < last_t:
            raise TraceError(
                f"{name}:{line}: t_seconds {t} goes back in time (previous row {last_t}); sort the file"
            )
        vals: list[int] = []
        for col, raw in zip(HEADER[1:], row[1:], strict=True):
            try:
                v = int(raw)
            except ValueError:
                raise TraceError(f"{name}:{line}: {col} {raw.strip()!r} is not an integer") from None
            if v < 1:
                raise TraceError(f"{name}:{line}: {col} must be >= 1, got {v}")
            vals.append(v)
        out.append(TraceRequest(t, vals[0], vals[1]))
        last_t = t
    if not out:
        raise TraceError(f"{name}: no requests after the header")
    return out


def load_trace(path: str | Path) -> list[TraceRequest]:
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise TraceError(f"{p}: cannot read: {exc.strerror or exc}") from exc
    return parse_trace(text, str(p))


def format_trace(requests: Iterable[TraceRequest]) -> str:
    lines = [",".join(HEADER)]
    lines += [f"{r.t:.3f},{r.prompt_tokens},{r.output_tokens}" for r in requests]
    return "\n".join(lines) + "\n"


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    Path(path).write_text(format_trace(requests))
