"""Assertions shared by tests that run the engine."""

from __future__ import annotations

import torch


def assert_all_blocks_free(llm_or_engine) -> None:
    """Every engine test ends here: no request left, every KV block back in the free pool."""
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    assert not engine.has_unfinished_requests()
    assert engine.allocator.all_free(), engine.allocator.usage()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face transformers' greedy continuation of one prompt (the oracle), never stopping at EOS."""
    tokens: list[int] = []
    with torch.inference_mode():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(max_new_tokens):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=out.past_key_values, use_cache=True)
    return tokens
