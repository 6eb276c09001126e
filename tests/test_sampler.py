"""The sampler's filters against a plain-Python oracle, and its draws against those probabilities."""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.engine.sampler import SampleRow, _filtered_probs, sample
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


@pytest.mark.parametrize("kwargs", [dict(temperature=5e-324), dict(temperature=1e-6), dict(top_p=5e-324)])
def test_extreme_values_sample_the_likeliest_token(kwargs):
    """Found by fuzzing the server: a temperature below 1e-5 is greedy (vLLM's rule; dividing by it
    overflows), and a top_p that rounds to 0 in float32 still keeps the likeliest token."""
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(0))
    rows = [SampleRow(SamplingParams(**kwargs), torch.Generator().manual_seed(i)) for i in range(3)]
    assert [s.token_id for s in sample(logits.clone(), rows)] == logits.argmax(dim=-1).tolist()
