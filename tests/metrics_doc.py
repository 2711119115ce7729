"""The runtime's metric contract, kept in the repository: docs/runtime.md's "## Metrics" table is the one
list. tests/runtime/test_metrics.py holds it equal to what the server registers; the dashboard and alert
tests (tests/charts) check their queries against it."""

from __future__ import annotations

import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "runtime.md"
# kvpilot's own names, and the Model Server Protocol's `vllm:*` names (with a colon)
DOC_ROW = re.compile(r"^\| `((?:kvpilot_|vllm:)[\w:]+)` \| (\w+) \| ([^|]+) \| [^|]*\S[^|]* \|$")


def documented_metrics() -> dict[str, tuple[str, frozenset[str]]]:
    """docs/runtime.md's "## Metrics" table: exposed name -> (type, labels)."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    rows: dict[str, tuple[str, frozenset[str]]] = {}
    for line in section.splitlines():
        m = DOC_ROW.match(line)
        if m:
            assert m[1] not in rows, f"{m[1]} is listed twice in docs/runtime.md"
            rows[m[1]] = (m[2], frozenset(re.findall(r"`(\w+)`", m[3])))
    return rows


def documented_sample_names() -> frozenset[str]:
    """The sample names the table's metrics expose: a histogram's _bucket, _count and _sum, the others
    as listed (counters with _total)."""
    names: set[str] = set()
    for name, (kind, _) in documented_metrics().items():
        names |= {f"{name}_bucket", f"{name}_count", f"{name}_sum"} if kind == "histogram" else {name}
    return frozenset(names)
