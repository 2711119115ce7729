"""The adaptive rule: how many tokens to propose for one sequence in one step.

Cost model (one step of the target model): a step that computes N tokens costs
    cost(N) = 1 + N / S
units of a one-token step, where S (the saturation size, in tokens) is where compute time equals
the fixed per-step cost of reading the weights. Below S a step is bandwidth-bound and extra tokens
are nearly free; beyond it every token costs compute. A draft model adds k of its own steps, each
`draft_cost` times a target step of the same batch.

With per-position acceptance a (the chance that a proposal is accepted given the ones before it
were), k proposals yield E(a, k) = 1 + a + ... + a^k tokens per step. In a batch of B decoding
sequences that all propose k tokens, one sequence's token rate is
    rate(k) = E(a, k) / (cost(B (k + 1)) + k * draft_cost * cost(B))
The rule takes the k in 0..k_max with the highest rate, and 0 (no speculation) unless it beats the
plain rate(0) = 1 / cost(B) by `margin`. So it speculates fully at batch 1 with good acceptance, less
as the batch grows and each extra token costs compute, and not at all once the batch saturates the
step or acceptance is poor. The acceptance estimate is per request, Laplace-smoothed:
a = (accepted + 1) / (accepted + rejected + 2), so a new request starts at 0.5.
"""

from __future__ import annotations

# Saturation sizes per device kind. CPU: measured with SmolLM2-135M in bf16 on the 2-core AVX-512
# test machine (benchmarks/runtime_features.py speculative, docs/benchmarks.md): a step of 8 tokens costs ~3x a
# one-token step, of 32 tokens ~6x, so S ~ 4-6. GPU: an unmeasured estimate (a GPU saturates far later).
DEFAULT_SATURATION_TOKENS = {"cpu": 6.0, "cuda": 256.0}


def acceptance_estimate(num_accepted: int, num_rejected: int) -> float:
    """Per-position acceptance of one request: accepted proposals over proposals tested
    (accepted + the one rejection that ends a step), Laplace-smoothed."""
    return (num_accepted + 1.0) / (num_accepted + num_rejected + 2.0)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens one verification step yields: the accepted prefix plus the target's own token."""
    return sum(acceptance**i for i in range(k + 1))


def step_cost(num_tokens: float, saturation_tokens: float) -> float:
    return 1.0 + num_tokens / saturation_tokens


def token_rate(
    k: int, acceptance: float, batch_size: int, saturation_tokens: float, draft_cost: float
) -> float:
    """One sequence's tokens per one-token-step unit of time when the batch proposes k each."""
    cost = step_cost(batch_size * (k + 1), saturation_tokens)
    cost += k * draft_cost * step_cost(batch_size, saturation_tokens)
    return expected_tokens(acceptance, k) / cost


def choose_num_spec_tokens(
    k_max: int,
    acceptance: float,
    batch_size: int,
    saturation_tokens: float,
    draft_cost: float = 0.0,
    margin: float = 0.05,
) -> int:
    """The number of tokens to propose (0..k_max) under the cost model above. Pure."""
    if k_max <= 0 or batch_size < 1:
        return 0
    plain = token_rate(0, acceptance, batch_size, saturation_tokens, draft_cost)
    best_k, best = 0, plain * (1.0 + margin)
    for k in range(1, k_max + 1):
        rate = token_rate(k, acceptance, batch_size, saturation_tokens, draft_cost)
        if rate > best:
            best_k, best = k, rate
    return best_k
