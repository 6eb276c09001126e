"""LoRA adapters under speculative decoding, beam search and a bf16 base (issue 49).

Speculation must stay lossless under an adapter: the draft (prompt lookup, or a draft model on its own
base) proposes, the target verifies under the request's adapter, so greedy tokens equal the same engine's
without speculation. Beam search under an adapter equals transformers' `generate(num_beams=k)` on the
peft model. A bf16 base with an adapter is held to the fp32 peft oracle within bf16's rounding.
"""

from __future__ import annotations

import pytest
import torch
from helpers import FLOAT32_KV, assert_all_blocks_free
from test_beam_search import assert_same_beams, hf_beam_search
from test_lora import ALL, ATTENTION, make_adapter, tokens

from pagedllm import LLM, BeamSearchParams, LoRARequest, SamplingParams

pytest.importorskip("peft")

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
# repetitive prompts, so that prompt lookup proposes drafts the target accepts and rejects
PROMPTS = [[5, 6, 7, 8] * 6, [9, 10, 11] * 8, list(range(40, 70)), [300, 1, 2, 300, 1]]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
SETTINGS = dict(
    enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=128, block_size=16, **FLOAT32_KV
)


@pytest.fixture(scope="module")
def loras(tiny_llama_dir, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("adapters")
    return {
        "attn": LoRARequest("attn", 1, str(make_adapter(tiny_llama_dir, root / "attn", ATTENTION, seed=1))),
        "all": LoRARequest("all", 2, str(make_adapter(tiny_llama_dir, root / "all", ALL, seed=2))),
    }


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_greedy_speculation_under_adapters_is_the_engine_without_it(method, tiny_llama_dir, loras):
    """Two adapters and the base in the same steps; the draft model is the base itself, run without the
    adapters (its drafts follow the base, the verification the adapter: some accepted, some not)."""
    config = NGRAM if method == "ngram" else {"model": str(tiny_llama_dir), "num_speculative_tokens": 3}
    per_prompt = [loras["attn"], None, loras["all"], loras["attn"]]
    plain = LLM(str(tiny_llama_dir), **SETTINGS)
    spec = LLM(str(tiny_llama_dir), speculative_config=config, **SETTINGS)
    expected = tokens(plain.generate(PROMPTS, GREEDY, lora_request=per_prompt))
    assert tokens(spec.generate(PROMPTS, GREEDY, lora_request=per_prompt)) == expected
    base = tokens(plain.generate(PROMPTS, GREEDY))
    assert all(expected[i] != base[i] for i in (0, 2, 3)), "an adapter changed no token: the test is blind"
    stats = spec.engine.stats()
    assert stats.spec_accepted_tokens > 0
    assert_all_blocks_free(spec)
    assert_all_blocks_free(plain)


def _peft_model(base, adapter: LoRARequest | None):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    return (PeftModel.from_pretrained(model, adapter.lora_path) if adapter else model).eval()


def test_beam_search_under_adapters_equals_peft_beam_search(tiny_llama_dir, loras):
    """The beams of three prompts batched together, two under an adapter and one on the base, each equal
    to transformers' beam search (with peft's adapter where the prompt has one), scores to 1e-4."""
    llm = LLM(str(tiny_llama_dir), **SETTINGS)
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    prompts = PROMPTS[1:]
    per_prompt = [loras["all"], None, loras["attn"]]
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params, lora_request=per_prompt)
    oracles = {lora.lora_name if lora else None: _peft_model(tiny_llama_dir, lora) for lora in per_prompt}
    base_rows = hf_beam_search(oracles[None], prompts[0], params, None)[0]
    for prompt, lora, out in zip(prompts, per_prompt, outputs, strict=True):
        rows, scores = hf_beam_search(oracles[lora.lora_name if lora else None], prompt, params, None)
        assert_same_beams(out, rows, scores, len(prompt), params.length_penalty)
    assert [s.tokens[len(prompts[0]) :] for s in outputs[0].sequences] != base_rows
    assert_all_blocks_free(llm)


# bf16 keeps 8 significant bits: the base's weights, the activations and the adapter's A and B are each
# rounded by up to 2^-9 relative, so the tiny model's logits (at most ~5 here) move by a few hundredths
# (0.05 at most measured). Greedy then picks the fp32 oracle's top token except at its near-ties: teacher
# forced on our tokens, every token we pick must be within BF16_LOGIT_TOL of the oracle's best logit (an
# adapter applied wrong, its scale or one of its pieces missed, moves logits by ~1: these adapters change
# most tokens), off the oracle's argmax at a few near-ties a prompt (measured: the base alone 1 in 96
# tokens; the adapter's update summed in float32, 4 of 24 on the prompt whose output cycles, within 0.044;
# the same update rounded to bf16 between shrink and expand, 1-2), and the adapter's tokens must still
# differ from the base's.
BF16_LOGIT_TOL = 0.1
BF16_NEAR_TIES = 4  # tokens a prompt off the oracle's argmax


def test_a_bf16_base_with_an_adapter_keeps_to_the_fp32_peft_oracle(tiny_llama_dir, loras):
    llm = LLM(str(tiny_llama_dir), **{**SETTINGS, "dtype": "bfloat16", "kv_cache_dtype": "auto"})
    lora = loras["all"]
    ours = tokens(llm.generate(PROMPTS, GREEDY, lora_request=lora))
    oracle = _peft_model(tiny_llama_dir, lora)
    for prompt, got in zip(PROMPTS, ours, strict=True):
        with torch.inference_mode():
            logits = oracle(torch.tensor([prompt + got])).logits[0, len(prompt) - 1 : -1]
        gaps = logits.max(dim=1).values - logits.gather(1, torch.tensor(got)[:, None])[:, 0]
        assert gaps.max().item() <= BF16_LOGIT_TOL, (prompt, gaps.tolist())
        assert (gaps > 0).sum().item() <= BF16_NEAR_TIES, (prompt, gaps.tolist())
    base = tokens(llm.generate(PROMPTS, GREEDY))
    assert sum(a != b for a, b in zip(ours, base, strict=True)) >= 3
    assert_all_blocks_free(llm)
