"""What does structured output (a JSON schema, a grammar) cost? One subcommand per question; each
prints one JSON object with the machine.

    python benchmarks/grammar_bench.py engines --repeats 3          # per-token mask cost of xgrammar, llguidance, outlines-core
    python benchmarks/grammar_bench.py throughput --batch-sizes 1 32  # decode tokens/s with and without a schema
    python benchmarks/grammar_bench.py stall --props 2000           # the worst stall a hostile schema causes others
"""

from __future__ import annotations

from harness import dispatch

COMMANDS = {
    "engines": "features.grammar_engines",
    "throughput": "features.structured_output",
    "stall": "features.grammar_stall",
}

if __name__ == "__main__":
    dispatch(__doc__ or "", COMMANDS)
