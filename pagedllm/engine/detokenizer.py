"""Incremental detokenization: new text per generated token, and stop-string handling."""

from __future__ import annotations

from pagedllm.engine.sequence import Sequence

PROMPT_CONTEXT_TOKENS = 5  # prompt tokens decoded along with the output, so word boundaries come out right


def start(seq: Sequence) -> None:
    """Point the offsets at the end of the prompt; output text starts empty."""
    seq.text = ""
    seq.prefix_offset = 0
    seq.read_offset = len(seq.prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])


def _window(seq: Sequence) -> list[int]:
    context = seq.prompt_token_ids[
        len(seq.prompt_token_ids) - min(PROMPT_CONTEXT_TOKENS, len(seq.prompt_token_ids)) :
    ]
    return context + seq.output_token_ids


def decode_new_text(tokenizer, seq: Sequence) -> str:
    """Append the text the newest token completes to seq.text and return it ("" while a multi-byte
    character is still incomplete)."""
    ids = _window(seq)
    skip = seq.params.skip_special_tokens
    prefix_text = tokenizer.decode(ids[seq.prefix_offset : seq.read_offset], skip_special_tokens=skip)
    full_text = tokenizer.decode(ids[seq.prefix_offset :], skip_special_tokens=skip)
    if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
        return ""
    new_text = full_text[len(prefix_text) :]
    seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
    seq.text += new_text
    return new_text


def find_stop_string(seq: Sequence, new_text: str) -> str | None:
    """If a stop string now appears in the text, cut the text there and return the stop string."""
    for stop in seq.params.stop_strings:
        # Only the tail that new_text could have completed needs searching.
        search_from = max(0, len(seq.text) - len(new_text) - len(stop) + 1)
        index = seq.text.find(stop, search_from)
        if index != -1:
            end = index + len(stop) if seq.params.include_stop_str_in_output else index
            seq.text = seq.text[:end]
            return stop
    return None
