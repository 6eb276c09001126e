"""A sequence: one stream of tokens the engine is generating, and the request that owns it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from pagedllm.engine.guided import Guide
    from pagedllm.engine.sampler import Sample


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not in the KV cache: needs a prefill of all its tokens
    RUNNING = "running"  # in the KV cache: prefilling (maybe in chunks), then decoding
    SWAPPED = "swapped"  # its blocks sit in the host pool
    FINISHED = "finished"


@dataclass(eq=False)  # a sequence is itself: queues find it by identity
class Sequence:
    """Token ids and progress of one generated sequence (its KV lives under seq_id in the allocator)."""

    seq_id: str
    request_id: str
    index: int  # which of the request's n outputs
    prompt_token_ids: list[int]
    params: SamplingParams
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    status: SequenceStatus = SequenceStatus.WAITING
    # Tokens whose K/V are in the cache, counting those the step being run computes (the scheduler adds
    # a step's tokens when it schedules them, as vLLM v1 does): all of them once its prompt is computed,
    # but the newest, sampled token, whose K/V the next step computes.
    num_cached_tokens: int = 0
    awaiting: bool = False  # a computed beam whose next token its beam search has not chosen yet
    loading_kv: bool = False  # waiting while its prefix blocks are read from the disk tier
    # Speculative decoding: tokens proposed to follow it, verified by the next step (the scheduler keeps
    # those it schedules, counted in num_cached_tokens, until update_from_output settles them).
    draft_token_ids: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None  # [len(drafts), vocab]: the q each was drawn from (sampled)
    num_prefix_hits: int = 0  # prompt tokens served by the prefix cache at first admission
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    # Incremental detokenizer state: tokens before prefix_offset are already in `text`.
    prefix_offset: int = 0
    read_offset: int = 0
    guide: Guide | None = None  # its place in the request's grammar (guided decoding)
    # SamplingParams.prompt_logprobs: the entries of prompt tokens 1, 2, ... gathered so far, one list
    # shared by the request's sequences (a forked one that is prefilled again gathers nothing twice).
    prompt_logprobs: list[dict[int, float]] | None = None
    lora_int_id: int | None = None  # the LoRA adapter it runs under (None: the base); keys its cached blocks

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def admissible(self) -> bool:
        """Waiting, it may be admitted now: not a beam awaiting its search, not waiting for its KV reads."""
        return not (self.awaiting or self.loading_kv)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def needs_prompt_logprobs(self) -> bool:
        """It asked for prompt log-probabilities and some are still to be computed."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids) - 1

    def append_token(self, smp: Sample) -> None:
        """The next token, with its log-probabilities when the request asked for them."""
        self.output_token_ids.append(smp.token_id)
        if smp.logprob is not None:
            self.cumulative_logprob += smp.logprob
            self.output_logprobs.append(smp.top_logprobs)

    def max_new_tokens(self, max_model_len: int) -> int:
        """How many more tokens this sequence may still generate."""
        room = max_model_len - self.num_tokens
        if self.params.max_tokens is not None:
            room = min(room, self.params.max_tokens - len(self.output_token_ids))
        return max(room, 0)
