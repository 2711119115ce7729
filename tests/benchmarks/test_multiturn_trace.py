"""benchmarks/traces/multiturn.py: the conversation traces the autoscaler's battery judges it on. The
prefix sharing must be what a real prompt's would be, or the simulated prefix caches (and kv-aware
routing) are judged on something no user sends."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "traces"))

from multiturn import BLOCK, Shape, generate  # noqa: E402

from kvpilot.autoscaler.trace import parse_jsonl  # noqa: E402


def _rows() -> list[dict]:
    return generate(Shape(requests=600, duration_s=600.0, continue_p=0.6), seed=3)  # type: ignore[return-value]


def test_the_trace_is_valid_mooncake_jsonl_and_seeded() -> None:
    rows = _rows()
    text = "".join(json.dumps(r) + "\n" for r in rows)
    parsed = parse_jsonl(text, "multiturn")  # sorted, ids within one per 512-token block
    assert len(parsed) == len(rows) > 300
    assert all(len(r.hash_ids) == -(-r.prompt_tokens // BLOCK) for r in parsed)
    assert rows == _rows()  # same seed, same trace
    assert rows != generate(Shape(requests=600, duration_s=600.0, continue_p=0.6), seed=4)


def test_a_later_turn_shares_exactly_the_full_blocks_of_the_turn_before() -> None:
    rows = _rows()
    followed = 0
    for i, r in enumerate(rows):
        ids, n = r["hash_ids"], int(r["input_length"])
        full = n // BLOCK
        # the next turn of the same session: a longer prompt that starts with this one's full blocks
        for later in rows[i + 1 :]:
            lids = later["hash_ids"]
            if (
                int(later["input_length"]) > n and lids[: max(full, 1)] == ids[: max(full, 1)] and full > 16
            ):  # past any system prompt (<= 8000 tokens)
                followed += 1
                if n % BLOCK:  # the partial last block grew: a new id from there on
                    assert lids[full] != ids[full]
                break
    assert followed > 20


def test_sessions_share_only_their_system_prompt_blocks() -> None:
    rows = _rows()
    firsts: dict[int, list[list[int]]] = {}
    for r in rows:
        firsts.setdefault(r["hash_ids"][0], []).append(r["hash_ids"])
    shared = [group for group in firsts.values() if len({tuple(g) for g in group}) > 1]
    assert shared  # a popular system prompt opens many sessions
    for group in shared:
        common = 0
        while all(len(g) > common and g[common] == group[0][common] for g in group):
            common += 1
        # never the whole prompt: past the system prompt each session's blocks are its own
        assert common < min(len(g) for g in group)
