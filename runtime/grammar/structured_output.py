"""Structured output: grammars that constrain what a sequence may generate, on xgrammar.

Three parts, one job each:
- `GuidedSpec`: what a request asked for (a JSON schema, any JSON object, a regex, a choice among
  strings, an EBNF grammar), as plain data carried in `SamplingParams`. `check_spec()` checks in
  Python, cheaply, what needs no compile (a JSON schema's nesting, references and keywords xgrammar
  would ignore), so the API layer refuses those at once with a 400 that names the field. The rest
  (the JSON Schema metaschema check, xgrammar's parse and compile) runs first in a limited worker
  process (runtime/grammar/service.py, runtime/grammar/worker.py): a grammar xgrammar crashes on,
  or that compiles too long or too big, never reaches the server process or the engine loop.
- `GrammarCompiler`: one per tokenizer; compiles a spec into xgrammar's token-level automaton
  (`CompiledGuided`). The server compiles a request's spec before the engine sees it and hands it
  over in `GuidedSpec.compiled`; the engine compiles (and caches by spec) only specs that come
  without one (offline use: `LLMEngine.generate`).
- `GrammarState`: one per sequence (one per choice): the matcher that advances with each committed
  token. The sampler asks every guided row of the batch for its allowed-token bits into one
  [rows, vocab/32] int32 bitmask and applies it to the logits at once (`apply_bitmask`).

Why xgrammar: measured per-token mask cost on the SmolLM2 tokenizer (benchmarks/grammar_bench.py engines,
docs/runtime.md) was ~5 us against ~35-60 us for llguidance and ~240 us for outlines-core, it ships
CPU wheels for Python 3.11, and its matcher rolls back tokens, which speculative decoding needs.

EOS is one of the grammar's stop tokens: the mask allows it only where the grammar accepts, and a
matcher that accepted it is terminated (the sequence stops even with ignore_eos).
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from kvpilot.runtime.grammar.analysis import find_dead_rule
from kvpilot.runtime.grammar.json_limits import MAX_JSON_DEPTH, JSONDepthError, loads_limited
from kvpilot.runtime.grammar.schema_checks import SchemaProblem, check_schema_valid, unenforced_keyword

if TYPE_CHECKING:
    import torch
    import xgrammar

GuidedKind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]

# Compact JSON: small models that may emit arbitrary whitespace tend to emit a lot of it.
_SEPARATORS = (", ", ": ")
_CACHE_SIZE = 256
_ERR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class GuidedSpecError(ValueError):
    """A guided-decoding request that cannot be compiled; `param` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"'{param}': {message}")
        self.param = param
        self.problem = message


@dataclass(frozen=True)
class CompiledGuided:
    """A spec compiled for one tokenizer: what a sequence's matcher is made from."""

    grammar: xgrammar.CompiledGrammar
    vocab_size: int

    def new_state(self) -> GrammarState:
        import xgrammar as xgr

        return GrammarState(xgr.GrammarMatcher(self.grammar), self.vocab_size)

    @property
    def memory_bytes(self) -> int:
        return int(self.grammar.memory_size_bytes)


@dataclass(frozen=True)
class GuidedSpec:
    """A structured-output constraint. `source` is the schema (JSON text), regex, grammar (EBNF), or
    the JSON list of choices; `param` is the request field it came from (for error messages).
    `compiled`: the grammar the server compiled for it (None until then; not part of equality)."""

    kind: GuidedKind
    source: str = ""
    param: str = "response_format"
    compiled: CompiledGuided | None = field(default=None, compare=False, repr=False)

    @classmethod
    def json_schema(cls, schema: Any, param: str) -> GuidedSpec:
        """A schema given as an object, a boolean, or JSON text (held to the body's nesting limit)."""
        if isinstance(schema, str):
            try:
                schema = loads_limited(schema)
            except json.JSONDecodeError as e:
                raise GuidedSpecError(param, f"the schema is not valid JSON: {e.msg}") from None
            except JSONDepthError:
                raise GuidedSpecError(
                    param, f"the schema nests deeper than {MAX_JSON_DEPTH} levels"
                ) from None
            except ValueError as e:  # an integer literal beyond Python's int_max_str_digits
                raise GuidedSpecError(
                    param, f"the schema is not acceptable JSON: {str(e).split(';')[0]}"
                ) from None
        if schema is False:
            raise GuidedSpecError(
                param, "the schema is false, which no value satisfies: no output can follow it"
            )
        if not isinstance(schema, dict | bool):
            raise GuidedSpecError(param, "a JSON schema must be an object or a boolean")
        return cls("json_schema", json.dumps(schema), param)  # key order is the output order

    @classmethod
    def choice(cls, choices: Sequence[str], param: str) -> GuidedSpec:
        return cls("choice", json.dumps(list(choices)), param)

    def cache_key(self) -> tuple[str, str]:
        return (self.kind, self.source)

    def with_compiled(self, compiled: CompiledGuided) -> GuidedSpec:
        return replace(self, compiled=compiled)


def _clean(exc: Exception) -> str:
    """xgrammar's messages start with a timestamp and a C++ source location; keep the message."""
    return _ERR_PREFIX.sub("", str(exc).strip()).strip()


def _ebnf_literal(text: str) -> str:
    # EBNF string literals take the same escapes as JSON strings (\" \\ \n \uXXXX)
    return json.dumps(text, ensure_ascii=False)


def _choice_ebnf(source: str) -> str:
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in json.loads(source))


def check_spec(spec: GuidedSpec, enforced: bool = True) -> None:
    """What the API layer refuses at once (linear, a few ms for the largest schema a body can hold):
    a JSON schema nested too deeply or (`enforced`: it will constrain output) with a keyword or
    reference the grammar cannot enforce. Raises GuidedSpecError naming the field. Validating it
    against the JSON Schema metaschema (`validate_schema`, pure Python: 1.4 s for 240 KB) and
    everything xgrammar does run in a grammar worker process (runtime/grammar/service.py)."""
    if spec.kind != "json_schema":
        return
    try:
        schema = loads_limited(spec.source)
    except JSONDepthError:
        raise GuidedSpecError(spec.param, f"the schema nests deeper than {MAX_JSON_DEPTH} levels") from None
    except ValueError as e:
        raise GuidedSpecError(spec.param, str(e)) from None
    problem = unenforced_keyword(schema) if enforced else None
    if problem is not None:
        raise GuidedSpecError(spec.param, problem)


def validate_schema(spec: GuidedSpec) -> None:
    """A JSON schema spec must be valid JSON Schema (jsonschema's metaschema check)."""
    if spec.kind != "json_schema":
        return
    try:
        check_schema_valid(loads_limited(spec.source))
    except JSONDepthError:
        raise GuidedSpecError(spec.param, f"the schema nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (SchemaProblem, ValueError) as e:
        raise GuidedSpecError(spec.param, str(e)) from None


def grammar_of(spec: GuidedSpec) -> xgrammar.Grammar:
    """The tokenizer-independent grammar for `spec` (xgrammar's parser: run it on client input only
    in a grammar worker process); raises GuidedSpecError naming the field."""
    import xgrammar as xgr

    try:
        if spec.kind == "json_schema":
            return xgr.Grammar.from_json_schema(spec.source, any_whitespace=False, separators=_SEPARATORS)
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema(
                '{"type": "object"}', any_whitespace=False, separators=_SEPARATORS
            )
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.source)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_ebnf(spec.source))
        return xgr.Grammar.from_ebnf(spec.source)
    except (RuntimeError, ValueError) as e:
        what = {
            "json_schema": "unsupported or invalid JSON schema",
            "json_object": "JSON object grammar",
            "regex": "invalid regular expression",
            "choice": "invalid choice list",
            "grammar": "invalid EBNF grammar",
        }[spec.kind]
        # xgrammar quotes the input in its message, cut at a byte offset: past non-ASCII text the
        # message itself may not decode
        detail = "the parser failed near non-ASCII text" if isinstance(e, UnicodeDecodeError) else _clean(e)
        raise GuidedSpecError(spec.param, f"{what}: {detail}") from None


def dead_end_problem(grammar: xgrammar.Grammar) -> str | None:
    """Why no output can follow `grammar` to its end (grammar_analysis.py), or None."""
    dead = find_dead_rule(str(grammar))
    if dead is None:
        return None
    if dead.is_root:
        return (
            "no output can satisfy it: it has no finite instance (every way through it recurses "
            "forever or needs a character that nothing matches), so generation could never end"
        )
    return (
        f"part of it can never end (rule '{dead.rule}' of its grammar has no finite expansion): "
        "output that enters it could only be cut off by max_tokens"
    )


def first_token_problem(compiled: xgrammar.CompiledGrammar, vocab_size: int) -> str | None:
    """A compiled grammar that allows no first token (not even EOS) matches nothing."""
    import xgrammar as xgr

    bitmask = new_bitmask(1, vocab_size)
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask, 0)
    if bool((bitmask != 0).any()):
        return None
    return "no output can satisfy it: it allows no first token"


class GrammarCompiler:
    """Compiles specs for one tokenizer; thread-safe (the engine thread compiles offline specs, the
    grammar service's threads compile a request's spec)."""

    def __init__(self, token_bytes: Sequence[bytes], stop_token_ids: Sequence[int], vocab_size: int) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.vocab_size = vocab_size
        self.tokenizer_info = xgr.TokenizerInfo(
            list(token_bytes), xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids)
        )
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, cache_enabled=False)
        self._cache: OrderedDict[tuple[str, str], xgrammar.CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        digest = hashlib.sha256(f"{vocab_size}:{sorted(stop_token_ids)}:".encode())
        for b in token_bytes:
            digest.update(len(b).to_bytes(4, "little") + b)
        # names the tokenizer in the grammar service's cache keys
        self.fingerprint = digest.hexdigest()[:16]

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: int | None = None) -> GrammarCompiler:
        """From runtime/load/tokenizer.py's Tokenizer; `vocab_size`: the model's logit width when larger."""
        n = tokenizer.vocab_size
        # special tokens (other than EOS, a stop token) get no bytes: xgrammar then never allows them,
        # where their text ("<|im_start|>") would otherwise pass for string content
        special = set(tokenizer.all_special_ids) - set(tokenizer.eos_token_ids)
        return cls(
            [b"" if i in special else tokenizer.token_bytes(i) for i in range(n)],
            sorted(tokenizer.eos_token_ids),
            max(n, vocab_size or 0),
        )

    def build(self, spec: GuidedSpec) -> CompiledGuided:
        """Compile `spec`, uncached and unchecked: for a spec a grammar worker has vetted."""
        return CompiledGuided(self._compiler.compile_grammar(grammar_of(spec)), self.vocab_size)

    def compile(self, spec: GuidedSpec) -> xgrammar.CompiledGrammar:
        """Offline use (a spec without `compiled`): checked like the grammar worker checks it, minus
        its time and memory limits, and cached by spec."""
        key = spec.cache_key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        check_spec(spec)
        validate_schema(spec)
        grammar = grammar_of(spec)
        problem = dead_end_problem(grammar)
        compiled = self._compiler.compile_grammar(grammar)
        problem = problem or first_token_problem(compiled, self.vocab_size)
        if problem is not None:
            raise GuidedSpecError(spec.param, problem)
        with self._lock:
            self._cache[key] = compiled
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def new_state(self, spec: GuidedSpec) -> GrammarState:
        """The matcher for one sequence: from the server's compiled grammar, else compiled here."""
        if spec.compiled is not None:
            return spec.compiled.new_state()
        return GrammarState(self._xgr.GrammarMatcher(self.compile(spec)), self.vocab_size)

    @property
    def cache_size(self) -> int:
        return len(self._cache)


class LazyGrammarCompiler:
    """The engine's compiler, built on first use (the tokenizer's vocabulary takes about a second);
    `get` may be called from any thread (the engine warms it up in the background)."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self._compiler: GrammarCompiler | None = None
        self._lock = threading.Lock()

    def get(self) -> GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = GrammarCompiler.for_tokenizer(self._tokenizer)
            return self._compiler


class GrammarState:
    """One sequence's matcher. `accept` advances it by a committed token; `fill` writes the allowed
    next tokens into a bitmask row; `probe` writes the masks of several positions along proposed
    tokens (speculative decoding) and leaves the matcher where it was."""

    def __init__(self, matcher: xgrammar.GrammarMatcher, vocab_size: int) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.num_accepted = 0

    def accept(self, token_id: int) -> bool:
        ok = bool(self.matcher.accept_token(token_id))
        if ok:
            self.num_accepted += 1
        return ok

    @property
    def is_terminated(self) -> bool:
        return bool(self.matcher.is_terminated())

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)

    def probe(self, proposal: Sequence[int], bitmask: torch.Tensor, first_row: int) -> int:
        """Masks for position 0..len(proposal) into rows first_row..; a proposal the grammar refuses
        ends the walk (its row masks it, so verification rejects it; later rows stay all-allowed).
        Returns how many proposals the grammar accepted; the matcher is rolled back to where it was."""
        walked = 0
        for i in range(len(proposal) + 1):
            if self.matcher.is_terminated():  # a proposed stop token ends the sequence there
                break
            self.fill(bitmask, first_row + i)
            if i == len(proposal) or not self.matcher.accept_token(proposal[i]):
                break
            walked += 1
        if walked:
            self.matcher.rollback(walked)
        return walked


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab/32)] int32, every token allowed (-1 is all bits set). (torch and xgrammar are
    imported where they are used: the HTTP front end imports this module for the request checks
    and stays free of the model stack.)"""
    import torch

    return torch.full((rows, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """Set disallowed tokens' logits to -inf in place, for the given rows (all by default) at once."""
    import xgrammar as xgr

    vocab = logits.shape[1]
    width = bitmask.shape[1] * 32
    if width < vocab:  # tokens past the grammar's vocabulary are never allowed
        logits[rows if rows is not None else slice(None), width:] = float("-inf")
    xgr.apply_token_bitmask_inplace(
        logits, bitmask.to(logits.device), vocab_size=min(vocab, width), indices=rows
    )
