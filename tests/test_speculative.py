"""Speculative decoding with n-gram prompt lookup and with a draft model: lossless against the same
engine without it.

Greedy output must be token for token the non-speculative engine's (built-in models, repetitive prompts
so that drafts are proposed, accepted and rejected, in batches beside requests that do not speculate;
draft models: the target itself, accepting nearly all, and a tiny random model of its vocabulary,
accepting few); sampled output must keep the target distribution (a chi-square test against the exact
distribution of a tiny-vocabulary model, computed by Hugging Face transformers, with drafts from prompt
lookup and from another tiny model whose q the rejection rule must use).
"""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import FLOAT32_KV, assert_all_blocks_free

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.speculative import NgramProposer, SpeculativeConfig, accepted_length

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}


def draft(model, k: int = 3) -> dict:
    """A draft-model speculative_config (vLLM's spelling: the method is inferred from `model`)."""
    return {"model": str(model), "num_speculative_tokens": k}


CODE = (
    "def area(width, height):\n    return width * height\n\n"
    "def perimeter(width, height):\n    return 2 * (width + height)\n\n"
    "# The same two functions, with type hints:\n"
)
PROMPTS = [
    CODE,
    "one two three four, one two three four, one two three four,",
    "The cat sat on the mat. The dog sat on the log. The cat sat on",
    "Tell me about the ocean.",
]


def proposer(k=4, lo=1, hi=4) -> NgramProposer:
    return NgramProposer(SpeculativeConfig("ngram", k, prompt_lookup_max=hi, prompt_lookup_min=lo))


def test_ngram_proposes_what_followed_the_longest_recurring_suffix():
    # suffix [7, 8] recurs at 1..2 (followed by 9, 1) and [8] alone at 5 (followed by 7): the longer wins
    assert proposer().propose([5, 7, 8, 9, 1, 8, 7, 2, 7, 8]) == [9, 1, 8, 7]
    assert proposer(k=2).propose([5, 7, 8, 9, 1, 8, 7, 2, 7, 8]) == [9, 1]
    assert proposer().propose([5, 7, 8, 9, 1, 8, 7, 2, 7, 8], max_tokens=1) == [9]
    assert proposer().propose([1, 2, 3, 1, 2, 4, 1, 2]) == [4, 1, 2]  # the latest of equal matches
    assert proposer().propose([1, 2, 3, 4]) == []  # nothing recurs
    assert proposer(lo=3).propose([1, 2, 3, 9, 2, 3]) == []  # recurs, but shorter than prompt_lookup_min
    assert proposer(lo=2, hi=2).propose([1, 2, 3, 9, 2, 3]) == [9, 2, 3]
    assert proposer().propose([4, 4]) == [4] and proposer().propose([4]) == []


def test_accepted_length_stops_at_the_first_rejected_draft():
    assert accepted_length([3, 9, 9], [3, 4]) == 2  # draft 3 accepted, 4 rejected: the target's 9 follows
    assert accepted_length([3, 4, 5], [3, 4]) == 3  # both accepted, plus the bonus token
    assert accepted_length([1], []) == 1


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram"}, "needs 'method' \\(or 'model'\\) and 'num_speculative_tokens'"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be a positive"),
        ({"method": "ngram", "num_speculative_tokens": 2, "lookup": 3}, "unknown keys \\['lookup'\\]"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "'draft_model' with model None"),
        ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "'ngram' with model 'x'"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, "prompt_lookup_max": 2},
            "prompt_lookup_min 3 exceeds prompt_lookup_max 2",
        ),
        ("ngram", "must be a dict"),
        ({"model": "x", "num_speculative_tokens": 2, "draft_vocab_size": 0}, "draft_vocab_size must"),
        ({"method": "ngram", "num_speculative_tokens": 2, "draft_vocab_size": 8}, "needs 'model'"),
    ],
)
def test_bad_speculative_config_is_refused_naming_it(config, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=config)


def test_a_draft_model_is_inferred_from_model_as_vllm_infers_it():
    inferred = SpeculativeConfig.from_dict({"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 2})
    named = {"method": "draft_model", "model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 2}
    assert inferred == SpeculativeConfig.from_dict(named)
    assert (inferred.method, inferred.model) == ("draft_model", "qwen2.5-coder-0.5b")


def test_a_draft_model_of_another_vocabulary_is_refused_naming_both_sizes(tiny_llama_dir):
    with pytest.raises(ValueError, match="vocabulary of 384 tokens, the target model 'smollm2-135m' 49152"):
        LLM("smollm2-135m", kv_cache_memory="8MiB", speculative_config=draft(tiny_llama_dir))


def test_prompt_lookup_bounds_default_as_vllm_sets_them():
    assert SpeculativeConfig("ngram", 3, prompt_lookup_max=4).prompt_lookup_min == 4
    assert SpeculativeConfig("ngram", 3, prompt_lookup_min=2).prompt_lookup_max == 2
    both = SpeculativeConfig("ngram", 3)
    assert (both.prompt_lookup_min, both.prompt_lookup_max) == (5, 5)


def run(engine, requests) -> dict[str, list]:
    """Add every (prompt, params) at once, step to the end; each request's outputs, by index."""
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.outputs
    return [done[str(i)] for i in range(len(requests))]


def same_outputs(spec, base, logprobs_atol=1e-3) -> None:
    for s_outs, b_outs in zip(spec, base, strict=True):
        for s, b in zip(s_outs, b_outs, strict=True):
            assert (s.token_ids, s.text, s.finish_reason) == (b.token_ids, b.text, b.finish_reason)
            assert getattr(s, "stop_reason", None) == getattr(b, "stop_reason", None)
            if getattr(b, "logprobs", None):
                for s_top, b_top in zip(s.logprobs, b.logprobs, strict=True):
                    assert s_top.keys() == b_top.keys()
                    assert all(abs(s_top[t] - b_top[t]) < logprobs_atol for t in b_top)


def mixed_requests(max_tokens: int) -> list:
    """Greedy requests that speculate (with stops, logprobs, penalties, min_tokens) beside a beam search
    and a short request that never drafts (its max_tokens leaves no room after the newest token)."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [
        (PROMPTS[0], greedy),
        (PROMPTS[1], SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=2)),
        (PROMPTS[2], SamplingParams(max_tokens=max_tokens, temperature=0.0, stop=["mat", " log"])),
        (PROMPTS[3], SamplingParams(max_tokens=max_tokens, temperature=0.0, frequency_penalty=0.5)),
        (PROMPTS[1], SamplingParams(max_tokens=max_tokens, temperature=0.0, min_tokens=max_tokens // 2)),
        (PROMPTS[0], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)),
        (PROMPTS[2], BeamSearchParams(beam_width=2, max_tokens=8)),
    ]


def check_lossless(base: LLM, max_tokens: int, logprobs_atol: float, speculative_config=NGRAM) -> LLM:
    """`base` against an engine of the same settings (sharing its weights) that speculates; returns it."""
    config = base.engine.config
    spec = LLM(**{**vars(config), "speculative_config": speculative_config})
    requests = mixed_requests(max_tokens)
    steps = base.engine.num_steps
    same_outputs(run(spec.engine, requests), run(base.engine, requests), logprobs_atol)
    stats = spec.engine.stats()
    assert stats.spec_verifies > 0 and stats.spec_accepted_tokens < stats.spec_draft_tokens
    assert spec.engine.num_steps <= base.engine.num_steps - steps  # a verify pass yields 1 token or more
    assert base.engine.stats().spec_draft_tokens == 0
    assert_all_blocks_free(spec)  # a draft model's pool too
    assert_all_blocks_free(base)
    return spec


def test_greedy_speculation_is_token_for_token_the_engine_without_it_smollm2(smollm2_llm):
    """In float32 (smollm2_llm's storage) a verify pass's logprobs are a decode's to rounding."""
    spec = check_lossless(smollm2_llm, 48, logprobs_atol=1e-4)
    assert spec.engine.stats().spec_accepted_tokens > 0


def test_the_target_as_its_own_draft_model_accepts_nearly_every_draft(smollm2_llm):
    """Its draft cache computes what the target's does (same weights, its own blocks), so a draft is
    rejected only where a near-tie falls the other way in a verify pass's rounding: wrong draft K/V
    (a slot not rolled back, a token not caught up) would show as rejections."""
    spec = check_lossless(smollm2_llm, 48, logprobs_atol=1e-4, speculative_config=draft("smollm2-135m"))
    stats = spec.engine.stats()
    assert stats.spec_acceptance_rate > 0.9 and stats.spec_mean_accepted_length > 3.5


def test_a_draft_over_part_of_the_vocabulary_is_lossless_and_proposes_only_from_it(smollm2_llm):
    """The target as its own draft with an LM head of SmolLM2's first 1,024 tokens and its special ones
    (FR-Spec): every draft is from the subset, a token outside it is never proposed (so fewer drafts are
    accepted than the > 90% of the whole head), and the output stays the target's."""
    config = {**draft("smollm2-135m"), "draft_vocab_size": 1024}
    spec = LLM(**{**vars(smollm2_llm.engine.config), "speculative_config": config})
    proposer = spec.engine.proposer
    subset = set(proposer.vocab_ids.tolist())
    assert set(range(1024)) <= subset and smollm2_llm.engine.eos_token_ids <= subset and len(subset) < 1100
    proposed: list[int] = []
    propose_batch = proposer.propose_batch

    def recording(*args):
        drafts = propose_batch(*args)
        proposed.extend(t for d in drafts for t in d.token_ids)
        return drafts

    proposer.propose_batch = recording
    requests = mixed_requests(48)
    same_outputs(run(spec.engine, requests), run(smollm2_llm.engine, requests), logprobs_atol=1e-4)
    outputs = {t for out in run(smollm2_llm.engine, requests) for o in out for t in o.token_ids}
    assert proposed and set(proposed) <= subset and outputs - subset  # the target wrote tokens beyond it
    assert 0.2 < spec.engine.stats().spec_acceptance_rate < 0.9
    assert_all_blocks_free(spec)
    assert_all_blocks_free(smollm2_llm)


def test_a_random_draft_model_of_the_same_vocabulary_is_lossless(smollm2_llm, tiny_chat_model):
    """A tiny random Llama with SmolLM2's tokenizer: nearly every draft is rejected and rolled back."""
    spec = check_lossless(smollm2_llm, 32, logprobs_atol=1e-4, speculative_config=draft(tiny_chat_model, 4))
    assert spec.engine.stats().spec_acceptance_rate < 0.5


def test_an_aborted_or_forked_request_frees_its_draft_blocks(smollm2_llm):
    spec = LLM(**{**vars(smollm2_llm.engine.config), "speculative_config": draft("smollm2-135m")})
    engine = spec.engine
    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=40, temperature=0.0))
    engine.add_request("b", PROMPTS[1], SamplingParams(max_tokens=12, n=3, temperature=0.8, seed=1))
    for _ in range(4):
        engine.step()
    assert not engine.proposer.all_free() and engine.stats().spec_verifies > 0
    engine.abort_request("a")
    while engine.has_unfinished_requests():
        engine.step()
    assert_all_blocks_free(spec)


def test_greedy_speculation_is_token_for_token_the_engine_without_it_gemma3(int16_activations):
    """The file's own blocks on their exact path (int16 x): activations are rounded per row block, and a
    verify pass's several rows take another attention kernel than one decode row, so logprobs agree only to
    ~1e-3 (tokens exactly). With the default int8 x a code one step apart where a value sits on a rounding
    boundary turned that last-bit difference into request 0's token 3 (the top two 0.034 apart): speculation
    on the default path is lossless up to such near-ties, as vLLM's is up to the hardware's numerics."""
    gemma3 = LLM("gemma3-270m", kv_cache_memory="64MiB", max_model_len=1024)
    spec = check_lossless(gemma3, 32, logprobs_atol=2e-2)
    assert spec.engine.stats().spec_accepted_tokens > 0


@pytest.mark.parametrize("config", [NGRAM, draft("smollm2-135m")], ids=["ngram", "draft"])
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_between_verify_passes_keeps_the_tokens(mode, config, smollm2_llm):
    """12 blocks of 16 for 4 sequences growing to ~90 tokens: speculating sequences are preempted and come
    back (recomputed, or swapped in), and every token is still the engine's without speculation (a draft
    model's 12 blocks: a sequence it has no room for does not speculate)."""
    kwargs = dict(
        num_kv_blocks=12, max_model_len=512, preemption_mode=mode, quantization="none", **FLOAT32_KV
    )
    greedy = SamplingParams(max_tokens=56, temperature=0.0, ignore_eos=True)
    requests = [(prompt, greedy) for prompt in PROMPTS]
    spec = LLM("smollm2-135m", speculative_config=config, **kwargs)
    same_outputs(run(spec.engine, requests), run(smollm2_llm.engine, requests))
    stats = spec.engine.stats()
    assert stats.num_preemptions > 0 and stats.spec_accepted_tokens > 0
    assert_all_blocks_free(spec)


@pytest.mark.parametrize("draft_model", [False, True], ids=["ngram", "draft"])
def test_contiguous_layout_and_a_small_token_budget_speculate_losslessly(tiny_llama_dir, draft_model):
    """Slabs hold the lookahead slots too; a budget of 6 tokens for 3 decodes caps the drafts at 3 (a
    draft model proposes 4, the scheduler verifies fewer: its cache keeps only what was accepted)."""
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 8, list(range(40, 70))]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    requests = [(p, greedy) for p in prompts]
    config = draft(tiny_llama_dir, 4) if draft_model else NGRAM
    for kwargs in (dict(kv_layout="contiguous"), dict(max_num_batched_tokens=32)):
        base = LLM(str(tiny_llama_dir), kv_cache_memory="8MiB", **kwargs)
        spec = LLM(str(tiny_llama_dir), kv_cache_memory="8MiB", speculative_config=config, **kwargs)
        same_outputs(run(spec.engine, requests), run(base.engine, requests))
        assert spec.engine.stats().spec_accepted_tokens > 0
        assert_all_blocks_free(spec)


VOCAB, SAMPLED = 4, 3  # a model over 4 tokens; the joint distribution of 3 sampled tokens: 64 cells


@pytest.fixture(scope="module")
def tiny_vocab_model(tmp_path_factory):
    """A random Llama over 4 tokens whose next-token distributions are far from uniform (drafts copied
    from the prompt are accepted about a third of the time)."""
    return tiny_vocab_llama(tmp_path_factory, seed=1)


@pytest.fixture(scope="module")
def tiny_vocab_draft(tmp_path_factory):
    """Another such model (its own weights): a draft model whose q is far from the target's p."""
    return tiny_vocab_llama(tmp_path_factory, seed=2)[0]


def tiny_vocab_llama(tmp_path_factory, seed: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(15.0)
    folder = tmp_path_factory.mktemp("tiny-vocab")
    model.save_pretrained(folder)
    return folder, model


def exact_joint(model, prompt: list[int], temperature: float) -> torch.Tensor:
    """P(x1, x2, x3 | prompt) for every one of the 64 continuations, by transformers' forward."""
    conts = torch.tensor(list(itertools.product(range(VOCAB), repeat=SAMPLED)))
    ids = torch.cat([torch.tensor(prompt).expand(len(conts), -1), conts], dim=1)
    with torch.no_grad():
        logprobs = (model(ids).logits[:, len(prompt) - 1 : -1] / temperature).log_softmax(-1)
    return logprobs.gather(2, conts[:, :, None]).squeeze(2).sum(1).exp()


def chi_square_p(llm, prompt, n, temperature, expected) -> float:
    """The p-value of n sampled 3-token continuations against `expected` (cells expecting fewer than 5
    samples pooled into one)."""
    from scipy.stats import chisquare

    params = SamplingParams(max_tokens=SAMPLED, temperature=temperature, ignore_eos=True)
    torch.manual_seed(0)
    counts = torch.zeros(VOCAB**SAMPLED, dtype=torch.float64)
    for out in llm.generate([prompt] * n, params):
        a, b, c = out.outputs[0].token_ids
        counts[(a * VOCAB + b) * VOCAB + c] += 1
    big = expected * n >= 5
    observed = torch.cat([counts[big], counts[~big].sum()[None]])
    wanted = torch.cat([expected[big], expected[~big].sum()[None]]) * n
    return chisquare(observed.numpy(), wanted.numpy()).pvalue


@pytest.mark.parametrize("proposer", ["ngram", "draft", "draft-subset"])
def test_sampling_with_speculation_keeps_the_target_distribution(
    proposer, tiny_vocab_model, tiny_vocab_draft, monkeypatch
):
    """1,500 sampled continuations with drafts at every step (the prompt holds every token, so the lookup
    always proposes from the second step on; the draft model proposes from the first, drawn from its own
    q; each draft is accepted or rejected at random) against the exact joint distribution: a chi-square
    test over the 64 cells, passed by the engine with and without speculation, and failed by far by a rule
    that accepts every draft; also with the draft's LM head over 3 of the 4 tokens (FR-Spec: its q is 0
    at the fourth, which only the residual (p - q)+ gives). (Taking a draft model's q one-hot would keep
    the distribution too, accepting less: the sampler test below.)"""
    from pagedllm.engine import sampler

    folder, hf = tiny_vocab_model
    prompt, temperature, n = [0, 1, 2, 3, 0, 1, 2, 3], 1.0, 1500
    expected = exact_joint(hf, prompt, temperature).double()
    expected /= expected.sum()  # float32 rounding
    config = NGRAM if proposer == "ngram" else draft(tiny_vocab_draft, 3)
    if proposer == "draft-subset":  # tokens 0, 1 and EOS (2): q renormalised over them, 3 never drafted
        config["draft_vocab_size"] = 2
    plain = LLM(str(folder), kv_cache_memory="16MiB", enable_prefix_caching=False)
    spec = LLM(str(folder), kv_cache_memory="16MiB", enable_prefix_caching=False, speculative_config=config)
    assert chi_square_p(plain, prompt, n, temperature, expected) > 1e-3
    assert chi_square_p(spec, prompt, n, temperature, expected) > 1e-3
    if proposer == "draft-subset":
        assert spec.engine.proposer.vocab_ids.tolist() == [0, 1, 2]
    stats = spec.engine.stats()
    assert stats.spec_draft_tokens >= n and 0.1 < stats.spec_acceptance_rate < 0.9
    draw = sampler._draw
    always_accept = lambda probs, d, q, gen: draw(probs, None, q, gen) if d is None else torch.tensor(d)  # noqa: E731
    monkeypatch.setattr(sampler, "_draw", always_accept)
    assert chi_square_p(spec, prompt, 500, temperature, expected) < 1e-6
    for llm in (plain, spec):
        assert_all_blocks_free(llm)


def test_the_rejection_rule_draws_from_the_target_distribution():
    """The sampler alone: one row with a draft token, 20,000 times, against its softmax."""
    from scipy.stats import chisquare

    from pagedllm.engine.sampler import SampleRow, sample

    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0]])
    target = logits.softmax(-1)[0].double()
    target /= target.sum()
    gen = torch.Generator().manual_seed(0)
    for draft in (3, 2):  # the likeliest token, and an unlikely one
        row = SampleRow(SamplingParams(temperature=1.0), gen, draft_token_id=draft)
        counts = torch.bincount(
            torch.tensor([sample(logits.clone(), [row])[0].token_id for _ in range(20000)]), minlength=5
        )
        assert chisquare(counts.numpy(), (target * 20000).numpy()).pvalue > 1e-3


def test_the_rejection_rule_with_a_drafts_q_draws_from_the_target_distribution():
    """A draft drawn from q each time, verified with q (accepted with min(1, p/q), else drawn from
    (p - q)+): the tokens follow p, however far q is from it, and a draft is accepted with probability
    sum(min(p, q)), more than the sum(p q) of taking q one-hot (which keeps p too)."""
    from scipy.stats import chisquare

    from pagedllm.engine.sampler import SampleRow, sample

    logits = torch.tensor([[1.0, 0.2, -0.5, 2.0, 0.0]])
    target = logits.softmax(-1)[0].double()
    target /= target.sum()
    q = torch.tensor([0.05, 0.5, 0.3, 0.1, 0.05])
    gen = torch.Generator().manual_seed(0)
    tokens, drafts = [], torch.multinomial(q, 20000, replacement=True, generator=gen).tolist()
    for draft in drafts:
        row = SampleRow(SamplingParams(temperature=1.0), gen, draft_token_id=draft, draft_probs=q)
        tokens.append(sample(logits.clone(), [row])[0].token_id)
    counts = torch.bincount(torch.tensor(tokens), minlength=5)
    assert chisquare(counts.numpy(), (target * 20000).numpy()).pvalue > 1e-3
    accepted = sum(t == d for t, d in zip(tokens, drafts, strict=True)) / 20000
    assert abs(accepted - torch.minimum(target, q.double()).sum().item()) < 0.015
    assert accepted > (target * q.double()).sum().item() + 0.15
