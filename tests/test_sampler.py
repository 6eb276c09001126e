"""The sampler: filters against a plain-Python oracle, draws against those probabilities, and the
penalties with vLLM's semantics, by hand and against Hugging Face's repetition penalty."""

from __future__ import annotations

import math

import pytest
import torch
from helpers import assert_all_blocks_free
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from pagedllm.engine.sampler import SampleRow, _filtered_probs, apply_penalties, sample
from pagedllm.sampling_params import SamplingParams

LOGITS = [2.0, -1.0, 0.5, 3.1, 1.7, -0.3, 2.6, 0.0]  # no ties


def oracle(logits: list[float], temperature: float, top_k: int, top_p: float, min_p: float) -> list[float]:
    """vLLM's definitions and order, one step at a time: temperature; min-p (drop tokens less likely than
    min_p times the most likely one); top-k; top-p (the smallest head whose mass reaches top_p)."""
    weights = [math.exp(x / temperature) for x in logits]
    order = sorted(range(len(logits)), key=lambda i: -weights[i])
    kept = [i for i in order if weights[i] >= min_p * weights[order[0]]]
    kept = kept[:top_k] if top_k else kept
    total, mass, head = sum(weights[i] for i in kept), 0.0, []
    for i in kept:
        if mass < top_p:
            head.append(i)
        mass += weights[i] / total
    norm = sum(weights[i] for i in head)
    return [weights[i] / norm if i in head else 0.0 for i in range(len(logits))]


CASES = [
    dict(top_k=3),
    dict(top_k=1),
    dict(top_p=0.6),
    dict(top_p=0.95, temperature=0.5),
    dict(min_p=0.2),
    dict(min_p=0.05, temperature=2.0),
    dict(top_k=5, top_p=0.8, min_p=0.3, temperature=0.7),
    dict(top_p=0.7, min_p=0.25),  # min-p first: top-p's mass is then taken over fewer tokens
]


@pytest.mark.parametrize("kwargs", CASES, ids=[str(c) for c in CASES])
def test_filtered_probabilities_match_the_oracle(kwargs):
    params = SamplingParams(**kwargs)
    probs = _filtered_probs(torch.tensor([LOGITS]), [SampleRow(params)])[0]
    expected = oracle(LOGITS, params.temperature, params.top_k, params.top_p, params.min_p)
    torch.testing.assert_close(probs / probs.sum(), torch.tensor(expected), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("kwargs", [dict(top_k=3), dict(min_p=0.3, temperature=0.8)])
def test_draws_follow_the_filtered_distribution(kwargs):
    """4,000 seeded draws: only allowed tokens, each about as often as its probability says."""
    params = SamplingParams(**kwargs)
    generator = torch.Generator().manual_seed(0)
    rows = [SampleRow(params, generator)] * 4000
    drawn = torch.tensor([s.token_id for s in sample(torch.tensor([LOGITS] * len(rows)), rows)])
    freq = torch.bincount(drawn, minlength=len(LOGITS)).float() / len(rows)
    expected = torch.tensor(oracle(LOGITS, params.temperature, params.top_k, params.top_p, params.min_p))
    assert torch.equal(freq > 0, expected > 0)
    torch.testing.assert_close(freq, expected, atol=0.03, rtol=0)


def test_banned_tokens_are_never_chosen_and_logprobs_are_a_log_softmax():
    logits = torch.tensor([LOGITS, LOGITS])
    rows = [
        SampleRow(SamplingParams(temperature=0, logprobs=2), banned_token_ids=(3, 6)),
        SampleRow(SamplingParams(temperature=0, logprobs=2)),
    ]
    banned, free = sample(logits.clone(), rows)
    assert (banned.token_id, free.token_id) == (0, 3)  # the best token that is not banned
    expected = torch.tensor(LOGITS).log_softmax(dim=-1)
    assert free.logprob == pytest.approx(expected[3].item())
    assert free.top_logprobs == pytest.approx({3: expected[3].item(), 6: expected[6].item()})


def test_penalties_by_hand():
    """Prompt [2], output [3, 3, 1]; presence 0.5, frequency 0.25, repetition 2."""
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2)
    row = SampleRow(params, prompt_token_ids=[2], output_token_ids=[3, 3, 1])
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    # token 0: unseen, 2.0 | token 1: -1 * 2 (negative: multiplied) - 0.25 - 0.5 = -2.75
    # token 2: prompt only, 0.5 / 2 = 0.25 | token 3: 3 / 2 - 2 * 0.25 - 0.5 = 0.5 | token 4: unseen, 0.0
    expected = torch.tensor([[2.0, -2.75, 0.25, 0.5, 0.0]])
    torch.testing.assert_close(apply_penalties(logits.clone(), [row]), expected)
    assert sample(logits.clone(), [row])[0].token_id == 0  # the unpenalized argmax would be token 3
    unpenalized = SampleRow(SamplingParams(temperature=0), prompt_token_ids=[2], output_token_ids=[3, 3, 1])
    assert sample(logits.clone(), [unpenalized])[0].token_id == 3


def test_logprobs_are_the_models_not_the_penalized_ones():
    params = SamplingParams(temperature=0, logprobs=1, frequency_penalty=2.0)
    logits = torch.tensor([[1.0, 3.0, 0.0]])
    smp = sample(logits.clone(), [SampleRow(params, output_token_ids=[1, 1])])[0]
    assert smp.token_id == 0  # 3 - 2 * 2 = -1 < 1
    assert smp.logprob == pytest.approx(torch.log_softmax(logits[0], -1)[0].item())


@pytest.mark.parametrize("penalty", [1.3, 0.7])
def test_repetition_penalty_equals_hugging_face_processor(penalty):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 3
    prompts = [[1, 5, 5, 9], [0], [49, 2]]
    outputs = [[3, 9, 9], [], [2, 17]]
    rows = [
        SampleRow(SamplingParams(repetition_penalty=penalty), prompt_token_ids=p, output_token_ids=o)
        for p, o in zip(prompts, outputs, strict=True)
    ]
    ours = apply_penalties(logits.clone(), rows)
    hf = RepetitionPenaltyLogitsProcessor(penalty)
    for i, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        expected = hf(torch.tensor([p + o]), logits[i : i + 1].clone())
        torch.testing.assert_close(ours[i : i + 1], expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
    ],
)
def test_bad_penalties_name_the_value(kwargs, name):
    with pytest.raises(ValueError, match=f"{name} .*{list(kwargs.values())[0]}"):
        SamplingParams(**kwargs)


def test_greedy_with_repetition_penalty_matches_hugging_face_generate(smollm2_llm, hf_smollm2):
    tok = smollm2_llm.get_tokenizer()
    prompts = [
        "List the days of the week: Monday, Tuesday,",
        "The capital of France is Paris. The capital of",
    ]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.3)
    outputs = smollm2_llm.generate(prompts, params)
    plain = smollm2_llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    for prompt, out, base in zip(prompts, outputs, plain, strict=True):
        ids = torch.tensor([tok.encode(prompt)])
        with torch.inference_mode():
            hf = hf_smollm2.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=24,
                repetition_penalty=1.3,
                eos_token_id=None,
                pad_token_id=0,
            )
        assert out.outputs[0].token_ids == hf[0, ids.shape[1] :].tolist(), prompt
        assert out.outputs[0].token_ids != base.outputs[0].token_ids  # the penalty changed the text
    assert_all_blocks_free(smollm2_llm)


@pytest.mark.parametrize("kwargs", [dict(temperature=5e-324), dict(temperature=1e-6), dict(top_p=5e-324)])
def test_extreme_values_sample_the_likeliest_token(kwargs):
    """Found by fuzzing the server: a temperature below 1e-5 is greedy (vLLM's rule; dividing by it
    overflows), and a top_p that rounds to 0 in float32 still keeps the likeliest token."""
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    rows = [SampleRow(SamplingParams(**kwargs), torch.Generator().manual_seed(i)) for i in range(3)]
    assert [s.token_id for s in sample(logits.clone(), rows)] == logits.argmax(dim=-1).tolist()


@pytest.mark.parametrize("penalty", [5e-324, 1e-30, 1e30, 3.4028235e38, 1e300])
def test_extreme_repetition_penalties_still_sample(penalty):
    """Found by fuzzing the server: a tiny penalty overflowed a boosted logit to +inf (NaN probabilities),
    a huge one could not become a float32. Now a tiny one makes a seen positive-logit token certain and a
    huge one forbids every seen token, greedy and sampled alike. Two seen tokens both at the largest
    float32 overflowed again under a temperature below 1 (the server's fuzzing, once more)."""
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 1.0]])
    for temperature in (0.0, 0.5, 1.0):
        params = SamplingParams(temperature=temperature, repetition_penalty=penalty)
        row = SampleRow(params, torch.Generator().manual_seed(0), prompt_token_ids=[2], output_token_ids=[3])
        token = sample(logits.clone(), [row])[0].token_id
        assert token in ((2, 3) if penalty < 1 else (0, 4))
