"""A sequence: one stream of tokens the engine is generating, and the request that owns it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagedllm.engine.guided import Guide


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # not in the KV cache: needs a prefill of all its tokens
    RUNNING = "running"  # in the KV cache: prefilling (maybe in chunks), then decoding
    SWAPPED = "swapped"  # its blocks sit in the host pool
    FINISHED = "finished"


@dataclass
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
    num_cached_tokens: int = 0  # tokens whose K/V are in the cache (computed in an earlier step)
    awaiting: bool = False  # a computed beam whose next token its beam search has not chosen yet
    num_prefix_hits: int = 0  # prompt tokens served by the prefix cache at first admission
    arrival_step: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    # Incremental detokenizer state: tokens before prefix_offset are already in `text`.
    prefix_offset: int = 0
    read_offset: int = 0
    guide: Guide | None = None  # its place in the request's grammar (guided decoding)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def max_new_tokens(self, max_model_len: int) -> int:
        """How many more tokens this sequence may still generate."""
        room = max_model_len - self.num_tokens
        if self.params.max_tokens is not None:
            room = min(room, self.params.max_tokens - len(self.output_token_ids))
        return max(room, 0)
