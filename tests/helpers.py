"""Assertions shared by tests that run the engine."""

from __future__ import annotations

import torch


def assert_all_blocks_free(llm_or_engine) -> None:
    """Every engine test ends here: no request left, every KV block back in the free pool."""
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    assert not engine.has_unfinished_requests()
    assert engine.allocator.all_free(), engine.allocator.usage()


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Hugging Face transformers' greedy continuation of one prompt (the oracle), EOS ignored."""
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt_ids]),
            attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()
