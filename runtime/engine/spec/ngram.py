"""Prompt-lookup proposals for speculative decoding (`--speculative-method ngram`).

The proposal is what followed the most recent earlier occurrence of the sequence's last n tokens,
for the longest n in [min_n, max_n] that occurs earlier in the prompt or the output. Text that
quotes its input (summaries, edits, code completion, "repeat this text") is proposed correctly
many tokens at a time; elsewhere there is usually no match and nothing is proposed.
"""

from __future__ import annotations

from collections.abc import Sequence


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` tokens continuing the longest (then most recent) earlier match of the last n
    tokens of `token_ids`, min_n <= n <= max_n; [] when there is none. Pure."""
    if k <= 0 or min_n < 1 or max_n < min_n:
        return []
    ids = list(token_ids)
    end = len(ids)
    if end < min_n + 1:
        return []
    last = ids[-1]
    best_len, best_pos = 0, -1
    # candidate match ends: earlier positions holding the last token, most recent first
    for i in range(end - 2, -1, -1):
        if ids[i] != last:
            continue
        n = 1
        limit = min(max_n, i + 1)
        while n < limit and ids[i - n] == ids[end - 1 - n]:
            n += 1
        if n > best_len:
            best_len, best_pos = n, i
            if n >= max_n:
                break
    if best_len < min_n:
        return []
    return ids[best_pos + 1 : best_pos + 1 + k]
