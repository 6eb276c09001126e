"""Sampled tokens' log-probabilities in OpenAI's two shapes: completions' lists, chat's content entries."""

from __future__ import annotations

from pagedllm.entrypoints.openai import protocol as p


def _top(top: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely tokens (the sampler also reports the chosen token, which may rank below)."""
    return sorted(top.items(), key=lambda item: -item[1])[:k]


def completion_logprobs(
    tokenizer, token_ids: list[int], logprobs: list[dict[int, float]], k: int, text_offset: int = 0
) -> p.CompletionLogprobs:
    """`tokens`, `token_logprobs`, `top_logprobs` (k entries, plus the chosen token as vLLM reports it)
    and `text_offset` counted from `text_offset` (the length of text already sent for this choice)."""
    out = p.CompletionLogprobs()
    for token_id, top in zip(token_ids, logprobs, strict=True):
        token = tokenizer.decode([token_id])
        out.tokens.append(token)
        out.token_logprobs.append(top[token_id])
        entries = dict(_top(top, k))
        entries[token_id] = top[token_id]
        out.top_logprobs.append({tokenizer.decode([t]): lp for t, lp in entries.items()})
        out.text_offset.append(text_offset)
        text_offset += len(token)
    return out


def chat_logprobs(
    tokenizer, token_ids: list[int], logprobs: list[dict[int, float]], k: int
) -> p.ChatLogprobs:
    """One entry per sampled token with its `top_logprobs`: exactly the k most likely tokens."""

    def entry(token_id: int, logprob: float) -> p.TopLogprob:
        token = tokenizer.decode([token_id])
        return p.TopLogprob(token=token, logprob=logprob, bytes=list(token.encode("utf-8")))

    content = []
    for token_id, top in zip(token_ids, logprobs, strict=True):
        chosen = entry(token_id, top[token_id])
        others = [entry(t, lp) for t, lp in _top(top, k)]
        content.append(p.ChatTokenLogprob(**chosen.model_dump(), top_logprobs=others))
    return p.ChatLogprobs(content=content)
