"""What a generation returns, shaped like vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    """One generated sequence of a request (a request with n > 1 has n of these)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after an engine step (final once `finished`)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # With SamplingParams.prompt_logprobs, one entry per prompt token as vLLM gives them: None for the
    # first (nothing predicts it), then the token's log-probability and the top ones at its position;
    # the positions computed so far while a long prompt is prefilled in chunks.
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class BeamSearchSequence:
    """One beam of `LLM.beam_search`, as vLLM returns it: `tokens` include the prompt's, and `text`
    is all of them decoded."""

    tokens: list[int]
    cum_logprob: float
    text: str
    finish_reason: str | None = None  # "stop" (ended with EOS) or "length"
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The beam_width best beams of one prompt, best first."""

    sequences: list[BeamSearchSequence]
