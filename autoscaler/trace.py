"""Arrival traces, one request per row/line:

- CSV with a header `t_seconds,prompt_tokens,output_tokens`;
- Mooncake FAST'25 JSONL (`.jsonl`): `timestamp` (ms), `input_length`, `output_length` and, optionally,
  `hash_ids`: ids of the prompt's 512-token blocks (two requests sharing a leading run of ids share
  that prefix), which feed the simulated replicas' prefix cache.

`scale_trace` stretches a trace in time (`--time-scale`) or thickens it (`--rate-scale`: the same
duration with R x the requests); `repeat_trace` plays it again after itself (a warm fleet's hour);
`shift_mix` makes its prompts heavier from one moment on (the same users, longer contexts);
`load_per_minute` reports what a trace asks of a fleet.
Bad input raises TraceError naming the file and line.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

HEADER = ("t_seconds", "prompt_tokens", "output_tokens")


@dataclass(frozen=True)
class TraceRequest:
    t: float
    prompt_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...] = ()  # prompt block ids (HASH_BLOCK_TOKENS each), () when unknown


HASH_BLOCK_TOKENS = 512  # Mooncake's hash_ids block size
JSONL_FIELDS = ("timestamp", "input_length", "output_length")


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


def _positive_int(value: Any, field: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(f"{where}: {field} must be an integer, got {json.dumps(value)}")
    if value < 1:
        raise TraceError(f"{where}: {field} must be >= 1, got {value}")
    return value


def parse_jsonl(text: str, name: str = "<trace>") -> list[TraceRequest]:
    """Mooncake-format JSONL: one object per line with timestamp (ms), input_length, output_length
    and optional hash_ids. Blank lines are skipped."""
    out: list[TraceRequest] = []
    last_ms = 0.0
    for line_no, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{name}:{line_no}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not a JSON object: {exc.msg}") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        missing = [f for f in JSONL_FIELDS if f not in obj]
        if missing:
            raise TraceError(
                f"{where}: missing field(s) {', '.join(missing)} (need {', '.join(JSONL_FIELDS)})"
            )
        ts = obj["timestamp"]
        if isinstance(ts, bool) or not isinstance(ts, int | float) or not math.isfinite(ts) or ts < 0:
            raise TraceError(f"{where}: timestamp must be a finite number of ms >= 0, got {json.dumps(ts)}")
        if ts < last_ms:
            raise TraceError(
                f"{where}: timestamp {ts} goes back in time (previous line {last_ms}); sort the file"
            )
        prompt = _positive_int(obj["input_length"], "input_length", where)
        output = _positive_int(obj["output_length"], "output_length", where)
        hashes = obj.get("hash_ids", [])
        if not isinstance(hashes, list) or any(isinstance(h, bool) or not isinstance(h, int) for h in hashes):
            raise TraceError(f"{where}: hash_ids must be a list of integers")
        if len(hashes) > -(-prompt // HASH_BLOCK_TOKENS):
            raise TraceError(
                f"{where}: {len(hashes)} hash_ids for {prompt} input tokens "
                f"(at most one per {HASH_BLOCK_TOKENS}-token block)"
            )
        out.append(TraceRequest(ts / 1000.0, prompt, output, tuple(hashes)))
        last_ms = float(ts)
    if not out:
        raise TraceError(f"{name}: no requests")
    return out


def load_trace(path: str | Path) -> list[TraceRequest]:
    """A .jsonl file is read as Mooncake JSONL, anything else as CSV."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise TraceError(f"{p}: cannot read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError:
        raise TraceError(f"{p}: not a text file") from None
    if p.suffix.lower() == ".jsonl":
        return parse_jsonl(text, str(p))
    return parse_trace(text, str(p))


def scale_trace(
    requests: Sequence[TraceRequest], time_scale: float = 1.0, rate_scale: float = 1.0
) -> list[TraceRequest]:
    """time_scale stretches the trace (2: the same requests over twice the time, half the rate).
    rate_scale keeps the timeline and multiplies the request count: request i appears
    floor((i+1)R) - floor(iR) times (R < 1 thins the trace evenly, R > 1 repeats requests), and a
    copy's hash_ids are shifted into a range of their own, so copies are other users' prompts and do
    not share a prefix cache with the original. Deterministic."""
    if not time_scale > 0 or not rate_scale > 0:
        raise ValueError("time_scale and rate_scale must be > 0")
    out: list[TraceRequest] = []
    for i, r in enumerate(requests):
        copies = math.floor((i + 1) * rate_scale + 1e-9) - math.floor(i * rate_scale + 1e-9)
        for c in range(copies):
            hashes = r.hash_ids if c == 0 else tuple(h + c * (1 << 40) for h in r.hash_ids)
            out.append(replace(r, t=r.t * time_scale, hash_ids=hashes))
    if not out:
        raise ValueError(f"rate_scale {rate_scale:g} leaves no request of {len(requests)}")
    return out


REPEAT_HASH_STRIDE = 1 << 48  # a repeat's hash_ids range: above scale_trace's copies (1 << 40 each)


def repeat_period(requests: Sequence[TraceRequest]) -> float:
    """The time one pass of a trace takes when it is played again right after itself (`repeat_trace`):
    its span plus one mean gap between arrivals, so the next pass's first request keeps the spacing."""
    if not requests:
        raise ValueError("an empty trace has no period")
    first, last = min(r.t for r in requests), max(r.t for r in requests)
    gap = (last - first) / (len(requests) - 1) if len(requests) > 1 else 1.0
    return last - first + max(gap, 1e-3)


def repeat_trace(requests: Sequence[TraceRequest], passes: int) -> list[TraceRequest]:
    """The trace played `passes` times back to back, each pass `repeat_period` after the one before:
    what a long-running fleet sees when the traffic keeps its shape (the fleet simulator judges the
    last pass with the earlier ones as warm-up). A later pass's hash_ids are shifted into a range of
    their own: its prompts are new users' and find nothing of the earlier passes in a prefix cache.
    Pure and deterministic."""
    if passes < 1:
        raise ValueError(f"passes must be >= 1, got {passes}")
    period = repeat_period(requests)
    return [
        replace(r, t=r.t + k * period, hash_ids=tuple(h + k * REPEAT_HASH_STRIDE for h in r.hash_ids))
        for k in range(passes)
        for r in requests
    ]


def shift_mix(requests: Sequence[TraceRequest], factor: float, at_s: float) -> list[TraceRequest]:
    """The trace with the token mix `factor` times heavier from `at_s` on, at the same arrivals: every
    prompt before at_s is cut to 1 / factor of its length (its leading hash_ids kept: the same
    conversation, less of it), the later ones are as recorded. What a fleet sees when its traffic turns
    from chat to long-document work within a minute: the load per request changes, the request rate
    does not, and every per-request capacity learnt before is too high after. Pure and deterministic."""
    if factor < 1.0:
        raise ValueError(f"factor must be >= 1 (how many times heavier the mix gets), got {factor:g}")
    out: list[TraceRequest] = []
    for r in requests:
        if r.t >= at_s:
            out.append(r)
            continue
        tokens = max(1, math.floor(r.prompt_tokens / factor))
        blocks = math.ceil(tokens / HASH_BLOCK_TOKENS)
        out.append(replace(r, prompt_tokens=tokens, hash_ids=r.hash_ids[:blocks]))
    return out


def load_per_minute(requests: Sequence[TraceRequest]) -> list[dict[str, float]]:
    """Per minute of the trace: requests/s, prompt tokens/s, output tokens/s."""
    minutes: dict[int, list[int]] = {}
    for r in requests:
        m = minutes.setdefault(int(r.t // 60.0), [0, 0, 0])
        m[0] += 1
        m[1] += r.prompt_tokens
        m[2] += r.output_tokens
    last = int(requests[-1].t // 60.0) if requests else -1
    out = []
    for i in range(last + 1):
        n, p, o = minutes.get(i, [0, 0, 0])
        out.append(
            {
                "minute": i,
                "requests_per_s": round(n / 60.0, 3),
                "prompt_tokens_per_s": round(p / 60.0, 1),
                "output_tokens_per_s": round(o / 60.0, 1),
            }
        )
    return out


def format_trace(requests: Iterable[TraceRequest]) -> str:
    lines = [",".join(HEADER)]
    lines += [f"{r.t:.3f},{r.prompt_tokens},{r.output_tokens}" for r in requests]
    return "\n".join(lines) + "\n"


def write_trace(path: str | Path, requests: Iterable[TraceRequest]) -> None:
    Path(path).write_text(format_trace(requests))
