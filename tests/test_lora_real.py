"""A real adapter (tests/data/smollm2-answer-lora, trained by tests/data/train_answer_lora.py): on
questions it was not trained on, pagedllm's text under it takes the trained format ("ANSWER: ...") where
the base's does not, and its tokens are peft's greedy tokens on the same float weights."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import assert_all_blocks_free
from models_helpers import hf_greedy

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.models.loader import resolve_checkpoint

pytest.importorskip("peft")

ADAPTER = Path(__file__).parent / "data" / "smollm2-answer-lora"
ANSWER = LoRARequest("answer", 1, str(ADAPTER))
HELD_OUT = ["What is the capital of Egypt?", "What color is snow?", "Who was Albert Einstein?"]
GREEDY = SamplingParams(temperature=0, max_tokens=16)


def chat_prompts(llm: LLM) -> list[list[int]]:
    tokenizer = llm.engine.tokenizer
    return [
        list(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for q in HELD_OUT
    ]


def test_the_trained_adapter_is_seen_in_the_text_and_equals_peft():
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    llm = LLM(
        "smollm2-135m", quantization="none", enable_lora=True, max_lora_rank=8, kv_cache_memory="32MiB",
        max_model_len=512,
    )  # fmt: skip
    prompts = chat_prompts(llm)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    under = llm.generate(inputs, GREEDY, lora_request=ANSWER)
    base = llm.generate(inputs, GREEDY)
    for question, with_adapter, without in zip(HELD_OUT, under, base, strict=True):
        assert with_adapter.outputs[0].text.startswith("ANSWER: "), (question, with_adapter.outputs[0].text)
        assert not without.outputs[0].text.startswith("ANSWER"), (question, without.outputs[0].text)
    assert "Cairo" in under[0].outputs[0].text
    hf = AutoModelForCausalLM.from_pretrained(
        resolve_checkpoint("smollm2-135m", float_weights=True), dtype=torch.float32
    )
    peft_model = PeftModel.from_pretrained(hf, ADAPTER).eval()
    eos = set(llm.engine.eos_token_ids)
    for prompt, out in zip(prompts, under, strict=True):
        ours = out.outputs[0].token_ids
        expected = hf_greedy(peft_model, [prompt], GREEDY.max_tokens)[0]
        # hf_greedy runs past EOS; ours stops there (the reply "ANSWER: x." ends with <|im_end|>)
        assert ours == expected[: len(ours)] and (len(ours) == len(expected) or ours[-1] in eos)
    assert_all_blocks_free(llm)


def test_the_trained_adapter_over_the_default_gguf_blocks():
    """The built-in model as it loads by default (its GGUF blocks): the adapter's format still shows."""
    llm = LLM("smollm2-135m", enable_lora=True, max_lora_rank=8, kv_cache_memory="32MiB", max_model_len=512)
    outputs = llm.generate([{"prompt_token_ids": p} for p in chat_prompts(llm)], GREEDY, lora_request=ANSWER)
    assert all(out.outputs[0].text.startswith("ANSWER: ") for out in outputs), [
        o.outputs[0].text for o in outputs
    ]
    assert_all_blocks_free(llm)
