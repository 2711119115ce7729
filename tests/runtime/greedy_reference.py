"""Greedy decoding with Hugging Face transformers, and the near-tie rule for comparing against it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

NEAR_TIE = 1e-3


@dataclass
class Reference:
    tokens: list[int]
    logits: list[torch.Tensor]  # the raw logits HF chose each token from


def hf_greedy(model: Any, prompt: list[int], max_new_tokens: int, eos_ids: set[int]) -> Reference:
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=sorted(eos_ids),
            pad_token_id=sorted(eos_ids)[0],
            output_logits=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return Reference(tokens, [x[0].float() for x in out.logits])


def greedy_deficits(model: Any, prompt: list[int], tokens: list[int]) -> list[float]:
    """How far below HF's best logit each of `tokens` is, with HF reading prompt + tokens (teacher
    forcing): 0.0 where a token is HF's own greedy choice in that context."""
    if not tokens:
        return []
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].float()
    chosen = logits.gather(1, torch.tensor(tokens).unsqueeze(1)).squeeze(1)
    return (logits.max(dim=1).values - chosen).tolist()


def assert_matches_reference(ours: list[int], ref: Reference, label: str = "") -> None:
    """Identical token for token, except that the sequences may part at a proven near-tie.

    At the first position where they differ, HF's two best logits must be within NEAR_TIE and our
    token must be one of those two; after that point the contexts differ, so comparison stops.
    """
    for j, (a, b) in enumerate(zip(ours, ref.tokens, strict=False)):
        if a == b:
            continue
        top2 = torch.topk(ref.logits[j], 2)
        gap = float(top2.values[0] - top2.values[1])
        assert gap < NEAR_TIE and a in top2.indices.tolist(), (
            f"{label}: token {j} differs ({a} vs HF {b}) and HF's top-2 gap {gap:.2e} is no near-tie"
        )
        return
    assert len(ours) == len(ref.tokens), f"{label}: length {len(ours)} vs HF {len(ref.tokens)}"
