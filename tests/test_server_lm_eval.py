"""lm-eval as a real client of the server: its `local-completions` model runs a loglikelihood task (echo +
logprobs requests) and a generation task on a tiny local dataset (tests/data/lm_eval, nothing from a hub),
and each choice's loglikelihood is the one transformers gives the same tokens."""

from __future__ import annotations

from pathlib import Path

import lm_eval
import pytest
import torch
from helpers import FLOAT32_KV, running_server, wait_until_idle
from lm_eval.tasks import TaskManager
from transformers import AutoTokenizer

from pagedllm.entrypoints.openai.server import build_app

TASKS = Path(__file__).parent / "data" / "lm_eval"
MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def served():
    """The built-in SmolLM2 in float32, its KV cache too (as the transformers oracle computes it), behind the
    real server."""
    app = build_app(MODEL, kv_cache_memory="32MiB", max_model_len=1024, quantization="none", **FLOAT32_KV)
    engine = app.state.engine.engine
    with running_server(app) as base:
        yield base, engine


def hf_loglikelihood(hf, tokenizer, context: str, continuation: str) -> float:
    """The continuation's log-probability after the context, split into tokens as lm-eval splits it
    (the context's trailing spaces go to the continuation; the whole text is encoded once)."""
    spaces = len(context) - len(context.rstrip())
    context, continuation = context[: len(context) - spaces], context[len(context) - spaces :] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False).input_ids
    start = len(tokenizer(context, add_special_tokens=False).input_ids)
    with torch.inference_mode():
        logprobs = hf(torch.tensor([whole])).logits[0].float().log_softmax(dim=-1)
    return sum(logprobs[i - 1, whole[i]].item() for i in range(start, len(whole)))


def test_lm_eval_local_completions_runs_both_tasks_with_transformers_scores(served, hf_smollm2, monkeypatch):
    base, engine = served
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.chdir(TASKS)  # the task files name their data relative to here
    tokenizer_path = str(engine.loaded_model.path)  # the model's own folder: nothing from a hub
    results = lm_eval.simple_evaluate(
        model="local-completions",
        model_args={
            "model": MODEL,
            "base_url": f"{base}/v1/completions",
            "tokenizer_backend": "huggingface",
            "tokenizer": tokenizer_path,
            "max_retries": 1,
        },
        tasks=["pagedllm_capitals_choice", "pagedllm_capitals_generate"],
        task_manager=TaskManager(include_path=str(TASKS)),
        batch_size=4,  # several prompts in one request
        log_samples=True,
    )
    wait_until_idle(engine)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)

    samples = results["samples"]["pagedllm_capitals_choice"]
    assert len(samples) == 4
    acc = acc_norm = 0
    for sample in samples:
        served_lls = [ll for ll, _ in sample["filtered_resps"]]
        expected = [hf_loglikelihood(hf_smollm2, tokenizer, *args) for args in sample["arguments"]]
        assert served_lls == pytest.approx(expected, abs=2e-4)  # a sum of 1-3 tokens' float32 logprobs
        choices = sample["doc"]["choices"]
        normed = [ll / len(choice) for ll, choice in zip(expected, choices, strict=True)]  # lm-eval's
        acc += max(range(len(choices)), key=expected.__getitem__) == sample["target"]
        acc_norm += max(range(len(choices)), key=normed.__getitem__) == sample["target"]
    scores = results["results"]["pagedllm_capitals_choice"]
    assert (scores["acc,none"], scores["acc_norm,none"]) == (acc / len(samples), acc_norm / len(samples))

    samples = results["samples"]["pagedllm_capitals_generate"]
    assert len(samples) == 4
    matches = 0
    for sample in samples:
        context, gen_kwargs = sample["arguments"][0]
        ids = tokenizer(context, add_special_tokens=False).input_ids
        with torch.inference_mode():
            out = hf_smollm2.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False)
        text = tokenizer.decode(out[0, len(ids) :])
        for stop in gen_kwargs["until"]:
            text = text.split(stop)[0]
        assert sample["filtered_resps"][0] == text
        matches += text.replace(" ", "").lower() == sample["target"].replace(" ", "").lower()
    assert results["results"]["pagedllm_capitals_generate"]["exact_match,none"] == matches / len(samples)
