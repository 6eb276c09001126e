"""SamplingParams: how to pick each next token and when to stop (vLLM's names and defaults)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

SAMPLING_EPS = 1e-5  # temperatures below this sample greedily


@dataclass(frozen=True)
class GuidedDecodingParams:
    """vLLM's name: `json` is a JSON schema (a dict or its text); `json_object` allows any JSON object.
    `any_whitespace=False` allows no whitespace but json.dumps' separators (`, ` and `: `): small models
    given the freedom can fill the output with newlines (xgrammar's own warning; vLLM's
    disable_any_whitespace)."""

    json: dict | str | None = None
    json_object: bool = False
    any_whitespace: bool = True

    def __post_init__(self) -> None:
        if (self.json is None) == (not self.json_object):
            raise ValueError("guided decoding needs exactly one of json (a schema) or json_object=True")

    @property
    def schema_text(self) -> str | None:
        if self.json is None:
            return None
        return self.json if isinstance(self.json, str) else json.dumps(self.json)  # key order matters


@dataclass
class SamplingParams:
    """Per-request sampling settings. temperature 0 means greedy."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0  # subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence of the token in the output
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or the output
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    # Each prompt token's log-probability and the top ones at its position (vLLM's): computed in the prefill.
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    guided_decoding: GuidedDecodingParams | None = None  # output constrained to a JSON grammar
    stop_strings: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.stop_strings = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        in_2 = "must be in [-2, 2]"
        checks = [
            (isinstance(self.n, int) and self.n >= 1, "n", self.n, "must be an integer >= 1"),
            (self.temperature >= 0, "temperature", self.temperature, "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k, "must be -1, 0 or >= 1"),
            (0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", self.presence_penalty, in_2),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", self.frequency_penalty, in_2),
            (self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "must be > 0"),
            (
                self.max_tokens is None or (isinstance(self.max_tokens, int) and self.max_tokens >= 1),
                "max_tokens",
                self.max_tokens,
                "must be an integer >= 1",
            ),
            (self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0"),
            (self.logprobs is None or self.logprobs >= 0, "logprobs", self.logprobs, "must be >= 0"),
            (
                self.prompt_logprobs is None or self.prompt_logprobs >= 0,
                "prompt_logprobs",
                self.prompt_logprobs,
                "must be >= 0",
            ),
            (all(s for s in self.stop_strings), "stop", self.stop, "must not contain empty strings"),
        ]
        for ok, name, value, rule in checks:
            if not ok:
                raise ValueError(f"{name} {rule}, got {value!r}")

    @property
    def greedy(self) -> bool:
        """temperature 0, or so close to it that dividing the logits by it would overflow (vLLM's 1e-5)."""
        return self.temperature < SAMPLING_EPS

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)


@dataclass
class BeamSearchParams:
    """Beam search settings, shaped like vLLM's; the search itself is Hugging Face's (do_sample=False).

    `length_penalty` and `early_stopping` mean what they mean in Hugging Face `generate`: a finished
    sequence scores cumulative_logprob / generated_len ** length_penalty, and the search stops once
    beam_width sequences are finished and (early_stopping=True) at once, (False, the default) when the
    best running beam can no longer beat them at its current length, ("never") when it cannot at any
    length. `temperature` is accepted for vLLM compatibility and, as in vLLM, does not change the
    search: beams are ranked by the model's log-probabilities.
    """

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        checks = [
            (isinstance(self.beam_width, int) and self.beam_width >= 1, "beam_width", "an integer >= 1"),
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "an integer >= 1"),
            (self.temperature >= 0, "temperature", ">= 0"),
            (self.early_stopping in (True, False, "never"), "early_stopping", "True, False or 'never'"),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")
