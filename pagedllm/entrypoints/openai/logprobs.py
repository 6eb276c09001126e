"""Log-probabilities in OpenAI's two shapes (completions' lists, chat's content entries) and vLLM's
prompt_logprobs."""

from __future__ import annotations

from pagedllm.entrypoints.openai import protocol as p


def _top(top: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely tokens (the sampler also reports the chosen token, which may rank below)."""
    return sorted(top.items(), key=lambda item: -item[1])[:k]


def completion_logprobs(
    tokenizer,
    token_ids: list[int],
    logprobs: list[dict[int, float] | None],
    k: int,
    text_offset: int = 0,
) -> p.CompletionLogprobs:
    """`tokens`, `token_logprobs`, `top_logprobs` (k entries, plus the chosen token as vLLM reports it)
    and `text_offset` counted from `text_offset` (the length of text already sent for this choice). A
    None entry (an echoed prompt's first token, which nothing predicts) gives nulls, as OpenAI's."""
    out = p.CompletionLogprobs()
    for token_id, top in zip(token_ids, logprobs, strict=True):
        token = tokenizer.decode([token_id])
        out.tokens.append(token)
        out.text_offset.append(text_offset)
        text_offset += len(token)
        if top is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(top[token_id])
        entries = dict(_top(top, k))
        entries[token_id] = top[token_id]
        out.top_logprobs.append({tokenizer.decode([t]): lp for t, lp in entries.items()})
    return out


def prompt_logprobs(
    tokenizer, entries: list[dict[int, float] | None], k: int
) -> list[dict[int, p.PromptLogprob] | None]:
    """vLLM's `prompt_logprobs` of a choice: per prompt token (the first None) the token and the k most
    likely, each with its rank where known (the top k's; the token's own when it is among them)."""
    out: list[dict[int, p.PromptLogprob] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranks = {t: rank for rank, (t, _) in enumerate(_top(entry, k), start=1)}
        out.append(
            {
                t: p.PromptLogprob(logprob=lp, rank=ranks.get(t), decoded_token=tokenizer.decode([t]))
                for t, lp in entry.items()
            }
        )
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
