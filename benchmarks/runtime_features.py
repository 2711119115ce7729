"""What does each runtime feature buy, and what does it cost under load? One subcommand per feature;
each prints one JSON document with the machine.

    python benchmarks/runtime_features.py speculative --threads 1 --prompts 3   # n-gram / draft speculation
    python benchmarks/runtime_features.py prefix-cache --requests 64            # prefix caching on vs off
    python benchmarks/runtime_features.py lora --batch 32 --adapters 8          # multi-LoRA vs the base model

Structured output (grammars) is benchmarks/grammar_bench.py.
"""

from __future__ import annotations

from harness import dispatch

COMMANDS = {
    "speculative": "features.speculative",
    "prefix-cache": "features.prefix_cache",
    "lora": "features.lora",
}

if __name__ == "__main__":
    dispatch(__doc__ or "", COMMANDS)
