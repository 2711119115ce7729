"""Incremental detokenization and stop strings, per generated choice.

`IncrementalDetokenizer` turns a growing list of token ids into text deltas without ever emitting
half a UTF-8 character. It decodes two small windows that start at the same token (vLLM's
prefix/read offsets) and emits the difference only when the longer window does not end in U+FFFD,
the replacement character a decoder produces for an incomplete byte sequence. Starting both windows
at the same token keeps decoders that treat the first token specially (SentencePiece's leading
space) consistent, and decoding only a window keeps each step O(1) in the sequence length.
For byte-level BPE (GPT-2, SmolLM2, Llama 3) the concatenated deltas equal ``decode(all_ids)``.

`StopStringMatcher` finds stop strings in the text and holds back the longest tail that could
still become one, so a stop string is never emitted, not even in part.

`TextStream` combines both for one choice, the way the server uses them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvpilot.runtime.engine.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens decoded as context in front of the output (enough for any leading-space rule).
PROMPT_CONTEXT_TOKENS = 5


class TokenDecoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: TokenDecoder,
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character; decoding across it would misalign the windows.
            context = []
        self._ids: list[int] = context
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)

    @property
    def output_token_ids(self) -> list[int]:
        return self._ids[self._num_context :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def push(self, new_token_ids: Sequence[int]) -> str:
        """Add tokens; return the text that became final (possibly "")."""
        self._ids.extend(new_token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of the sequence: whatever is still held back (even an incomplete character)."""
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]


class StopStringMatcher:
    """Feed text deltas; get back the part that is safe to emit.

    A stop string is recognised when it completes; among several, the one that completes first wins
    (so the result does not depend on how the text was split into deltas). The output is cut before
    it, or after it with ``include_stop_str_in_output``.
    """

    def __init__(self, stop: Sequence[str], include_stop_str_in_output: bool = False) -> None:
        self.stops = [s for s in stop if s]
        self._include = include_stop_str_in_output
        self._max_len = max((len(s) for s in self.stops), default=0)
        self.text = ""  # everything accepted so far (cut at the stop string once found)
        self._emitted = 0
        self.stop_str: str | None = None

    @property
    def stopped(self) -> bool:
        return self.stop_str is not None

    def push(self, delta: str, check: bool = True) -> str:
        """Add text; when `check` is false (min_tokens not reached) no stop string can end here."""
        if self.stopped or not delta:
            return ""
        old_len = len(self.text)
        self.text += delta
        if check and self.stops:
            match = self._first_completed(old_len)
            if match is not None:
                start, stop = match
                cut = start + len(stop) if self._include else max(start, self._emitted)
                self.text = self.text[:cut]
                self.stop_str = stop
                return self._emit(len(self.text))
        return self._emit(len(self.text) - self._holdback())

    def flush(self) -> str:
        return self._emit(len(self.text))

    def _emit(self, upto: int) -> str:
        if upto <= self._emitted:
            return ""
        out = self.text[self._emitted : upto]
        self._emitted = upto
        return out

    def _first_completed(self, old_len: int) -> tuple[int, str] | None:
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for s in self.stops:
            # Only matches that end inside the new text: older ones were seen (or suppressed) before.
            i = self.text.find(s, max(0, old_len - len(s) + 1))
            if i < 0:
                continue
            key = (i + len(s), i, s)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _holdback(self) -> int:
        if self._include or not self.stops:
            return 0
        text = self.text
        for k in range(min(self._max_len, len(text) - self._emitted), 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0


class TextStream:
    """Token ids in, text deltas out, for one choice: detokenization plus stop strings."""

    def __init__(
        self, tokenizer: TokenDecoder, params: SamplingParams, prompt_token_ids: Sequence[int] = ()
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self._stops = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        self._min_tokens = params.min_tokens
        self.num_tokens = 0
        self.text = ""  # everything emitted so far

    @property
    def stop_str(self) -> str | None:
        """The stop string that ended the text, or None."""
        return self._stops.stop_str

    def push(self, new_token_ids: Sequence[int]) -> str:
        if self._stops.stopped:
            return ""
        self.num_tokens += len(new_token_ids)
        delta = self._detok.push(new_token_ids)
        out = self._stops.push(delta, check=self.num_tokens >= self._min_tokens)
        self.text += out
        return out

    def finish(self) -> str:
        """The sequence ended for another reason: release held-back text."""
        if self._stops.stopped:
            return ""
        out = self._stops.push(self._detok.flush(), check=self.num_tokens >= self._min_tokens)
        out += self._stops.flush() if not self._stops.stopped else ""
        self.text += out
        return out
