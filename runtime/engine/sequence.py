"""One request's state as the engine tracks it (one per generated choice)."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

import torch

from kvpilot.runtime.engine.protocol import TokenLogprob
from kvpilot.runtime.engine.sampling_params import SamplingParams
from kvpilot.runtime.lora.request import LoRARequest

if TYPE_CHECKING:
    from kvpilot.runtime.grammar.structured_output import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids (prompt then output), the blocks that hold their KV, and timing for metrics."""

    def __init__(
        self,
        seq_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        eos_token_ids: frozenset[int] = frozenset(),
        cache_salt: str | None = None,
        arrival_time: float | None = None,
        lora: LoRARequest | None = None,
    ) -> None:
        self.seq_id = seq_id
        self.lora = lora  # the adapter this sequence runs with (None: the base model)
        self.params = params
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.eos_token_ids = eos_token_ids
        self.cache_salt = cache_salt
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.num_computed_tokens = 0  # tokens whose K/V are in the cache
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at first admission
        self.num_preemptions = 0
        self.logprobs: list[TokenLogprob] = []
        # params.prompt_logprobs: the logprob of prompt token i + 1 at index i, filled chunk by chunk
        self.prompt_logprobs: list[TokenLogprob] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(params.seed)
        # structured output: the matcher of params.guided, advanced with each committed output token
        # (preemption recomputes the KV of tokens already committed, so it never moves the matcher)
        self.grammar: GrammarState | None = None
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None  # the benchmarks' time to first token
        # Speculative decoding (runtime/engine/spec/speculative.py): this step's proposed tokens, which follow
        # token_ids but are not part of the sequence until verified; the draft model's probability
        # rows for them (draft proposals under sampling); and the request's running tallies.
        self.spec_token_ids: list[int] = []
        self.spec_draft_probs: torch.Tensor | None = None
        self.spec_num_proposed = 0
        self.spec_num_accepted = 0
        self.spec_num_rejected = 0  # verification steps that ended at a rejected proposal
        self.draft_num_computed = 0  # tokens whose K/V the draft model holds (draft method only)
        # disaggregation (runtime/engine/kv_transfer/engine_side.py): pin the prompt's blocks when
        # this finishes (prefill side) and the response params that gives; why pulled blocks went unused
        self.kv_export = False
        self.kv_transfer_params: dict[str, object] | None = None
        self.kv_fallback: str | None = None

    # -- views ---------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asks for prompt logprobs and some are still to be computed (its prefill must then run
        every prompt position through the model: it does not read the prefix cache)."""
        return (
            self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens - 1
        )

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    # -- updates -------------------------------------------------------------------------------
    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        self.token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)

    def check_stop(self) -> bool:
        """Stop on max_tokens, an EOS token or a stop token id; stop strings are the detokenizer's job."""
        p = self.params
        n_out = self.num_output_tokens
        if n_out == 0:
            return False
        last = self.token_ids[-1]
        if n_out >= p.min_tokens:
            if not p.ignore_eos and last in self.eos_token_ids:
                self.finish_reason, self.stop_reason = "stop", None
                return True
            if last in p.stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", last
                return True
        if self.grammar is not None and self.grammar.is_terminated:
            # the grammar accepted its stop token: nothing may follow, even with ignore_eos
            self.finish_reason, self.stop_reason = "stop", None
            return True
        if n_out >= p.max_tokens:
            self.finish_reason = "length"
            return True
        return False
