"""Per-token mask overhead of the grammar engines kvpilot could use for structured output.

For each engine (xgrammar, llguidance, outlines-core) and each JSON schema below: compile the schema
for the SmolLM2 tokenizer (vocabulary 49152), then walk a valid document token by token, computing
the next-token bitmask and advancing the matcher with the document's token at every step, which is
exactly the work the sampler adds per guided sequence and decode step. Prints one JSON object.

    .venv/bin/python benchmarks/grammar_bench.py engines [--repeats 3]

An engine that is not installed is reported as such, not skipped silently.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import harness
import torch

from kvpilot.runtime.load.loader import builtin_model_path
from kvpilot.runtime.load.tokenizer import Tokenizer

SCHEMAS: dict[str, tuple[dict[str, Any], Any]] = {
    "flat": (
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
            "required": ["name", "age"],
        },
        {"name": "Ada Lovelace", "age": 36},
    ),
    "nested": (
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer", "minimum": 0},
                        "email": {"type": "string"},
                        "role": {"enum": ["admin", "editor", "viewer"]},
                    },
                    "required": ["id", "email", "role"],
                },
                "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
                "parent": {"anyOf": [{"type": "null"}, {"type": "integer"}]},
            },
            "required": ["user", "tags", "score", "parent"],
        },
        {
            "user": {"id": 4711, "email": "someone@example.com", "role": "editor"},
            "tags": ["inference", "kubernetes", "paged attention", "structured output"],
            "score": 0.8125,
            "parent": None,
        },
    ),
}


class _Walker:
    """One engine's compile + per-token (mask, advance) steps."""

    name: str

    def compile(self, schema: str) -> Any: ...

    def walk(self, compiled: Any, tokens: list[int], bitmask: torch.Tensor) -> None: ...


def _xgrammar(tok: Tokenizer) -> _Walker:
    import xgrammar as xgr

    vocab = [tok.token_bytes(i) for i in range(tok.vocab_size)]
    info = xgr.TokenizerInfo(
        vocab, xgr.VocabType.RAW, vocab_size=tok.vocab_size, stop_token_ids=sorted(tok.eos_token_ids)
    )
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    class W(_Walker):
        name = f"xgrammar {xgr.__version__ if hasattr(xgr, '__version__') else ''}".strip()

        def compile(self, schema: str) -> Any:
            return compiler.compile_json_schema(schema)

        def walk(self, compiled: Any, tokens: list[int], bitmask: torch.Tensor) -> None:
            m = xgr.GrammarMatcher(compiled)
            for t in tokens:
                m.fill_next_token_bitmask(bitmask, 0)
                assert m.accept_token(t), t
            m.fill_next_token_bitmask(bitmask, 0)

    return W()


def _llguidance(tok: Tokenizer) -> _Walker:
    import llguidance
    import llguidance.torch as llt

    class G:
        def __init__(self) -> None:
            self.eos_token_id = tok.eos_token_id
            self.bos_token_id = tok.bos_token_id
            self.tokens = [tok.token_bytes(i) for i in range(tok.vocab_size)]
            self.special_token_ids = sorted(tok.all_special_ids)

        def __call__(self, s: bytes | str) -> list[int]:
            text = s.decode("utf-8", "replace") if isinstance(s, bytes) else s
            return tok.encode(text, add_special_tokens=False)

    lltok = llguidance.LLTokenizer(llguidance.TokenizerWrapper(G()))

    class W(_Walker):
        name = "llguidance"

        def compile(self, schema: str) -> Any:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
            err = llguidance.LLMatcher.validate_grammar(grammar, lltok)
            assert not err, err
            return grammar

        def walk(self, compiled: Any, tokens: list[int], bitmask: torch.Tensor) -> None:
            m = llguidance.LLMatcher(lltok, compiled)  # the grammar compiles lazily, per matcher
            for t in tokens:
                llt.fill_next_token_bitmask(m, bitmask, 0)
                assert m.consume_token(t), m.get_error()
            llt.fill_next_token_bitmask(m, bitmask, 0)

    return W()


def _outlines_core(tok: Tokenizer) -> _Walker:
    import outlines_core as oc

    eos = tok.eos_token_id
    pieces: dict[bytes, list[int]] = {}
    for i in range(tok.vocab_size):
        if i in tok.all_special_ids:
            continue
        pieces.setdefault(tok.token_bytes(i), []).append(i)
    vocabulary = oc.Vocabulary(eos, pieces)

    class W(_Walker):
        name = "outlines-core"

        def compile(self, schema: str) -> Any:
            return oc.Index(oc.json_schema.build_regex_from_schema(schema), vocabulary)

        def walk(self, compiled: Any, tokens: list[int], bitmask: torch.Tensor) -> None:
            g = oc.Guide(compiled)
            mask = bitmask[0]
            for t in tokens:
                g.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())
                g.advance(t)
            g.write_mask_into(mask.data_ptr(), mask.numel(), mask.element_size())

    return W()


ENGINES: dict[str, Callable[[Tokenizer], _Walker]] = {
    "xgrammar": _xgrammar,
    "llguidance": _llguidance,
    "outlines-core": _outlines_core,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    tok = Tokenizer.from_gguf(builtin_model_path("smollm2-135m-instruct"))
    bitmask = torch.zeros(1, (tok.vocab_size + 31) // 32, dtype=torch.int32)
    report: dict[str, Any] = {"cpu": harness.cpu_model(), "vocab_size": tok.vocab_size, "engines": {}}
    for key, make in ENGINES.items():
        try:
            t0 = time.perf_counter()
            walker = make(tok)
            setup_s = time.perf_counter() - t0
        except ImportError as e:
            report["engines"][key] = {"error": f"not installed: {e}"}
            continue
        per_schema: dict[str, Any] = {}
        for sname, (schema, doc) in SCHEMAS.items():
            text = json.dumps(doc)
            tokens = tok.encode(text, add_special_tokens=False)
            t0 = time.perf_counter()
            try:
                compiled = walker.compile(json.dumps(schema))
            except Exception as e:  # an engine that cannot compile a schema is a finding, not a crash
                per_schema[sname] = {"error": f"{type(e).__name__}: {e}"}
                continue
            compile_s = time.perf_counter() - t0
            times = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                walker.walk(compiled, tokens, bitmask)
                times.append(time.perf_counter() - t0)
            best = min(times)
            per_schema[sname] = {
                "tokens": len(tokens),
                "compile_ms": round(compile_s * 1e3, 2),
                "per_token_us_best": round(best / (len(tokens) + 1) * 1e6, 1),
                "per_token_us_median": round(statistics.median(times) / (len(tokens) + 1) * 1e6, 1),
            }
        report["engines"][key] = {
            "name": walker.name,
            "tokenizer_setup_ms": round(setup_s * 1e3, 1),
            **per_schema,
        }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
