"""Beam search in the engine against Hugging Face `generate(num_beams=k, do_sample=False)`.

Both define the search the same way when HF gets the same EOS ids as the engine, `do_sample=False`,
and no other logits processor (no repetition penalty, no min length): see pagedllm.engine.beam_search.
"""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from helpers import FLOAT32_KV, assert_all_blocks_free
from transformers import AutoModelForCausalLM

from pagedllm import LLM, BeamSearchParams, SamplingParams
from pagedllm.engine.beam_search import BeamSearch

EOS = [73, 255]  # tokens the tiny model produces often, so beams end early and are scored on EOS


@pytest.fixture(scope="module")
def tiny_eos_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama with two frequent tokens as its EOS ids."""
    folder = tmp_path_factory.mktemp("tiny-eos")
    shutil.copytree(tiny_llama_dir, folder, dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((folder / name).read_text())
        config["eos_token_id"] = EOS
        (folder / name).write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def tiny_hf(tiny_eos_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_eos_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tiny_prompts():
    rng = random.Random(1)
    return [[rng.randrange(384) for _ in range(n)] for n in (3, 10, 17, 33, 50)]


def hf_beam_search(hf, prompt: list[int], params: BeamSearchParams, eos: list[int] | None):
    """HF's k best sequences (generated tokens) and their scores, for one prompt (no padding)."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            num_beams=params.beam_width,
            num_return_sequences=params.beam_width,
            max_new_tokens=params.max_tokens,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
            eos_token_id=None if params.ignore_eos else eos,
            pad_token_id=-1,  # never a token: marks the end of a sequence that finished early
            output_scores=True,
            return_dict_in_generate=True,
        )
    rows = [[t for t in row[len(prompt) :].tolist() if t != -1] for row in out.sequences]
    return rows, out.sequences_scores.tolist()


def assert_same_beams(ours, hf_rows, hf_scores, prompt_len: int, length_penalty: float):
    assert [s.tokens[prompt_len:] for s in ours.sequences] == hf_rows
    scores = [s.cum_logprob / (len(s.tokens) - prompt_len) ** length_penalty for s in ours.sequences]
    assert scores == pytest.approx(hf_scores, abs=1e-4)


@pytest.mark.parametrize(
    ("beam_width", "length_penalty", "early_stopping"),
    [(2, 1.0, False), (4, 1.0, False), (4, 2.0, "never"), (3, -0.5, True), (4, 0.0, False)],
)
def test_tiny_model_matches_hugging_face(
    tiny_eos_dir, tiny_hf, tiny_prompts, beam_width, length_penalty, early_stopping
):
    llm = LLM(str(tiny_eos_dir), num_kv_blocks=256, **FLOAT32_KV)
    params = BeamSearchParams(
        beam_width, max_tokens=20, length_penalty=length_penalty, early_stopping=early_stopping
    )
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in tiny_prompts], params)
    finish_reasons = set()
    for prompt, out in zip(tiny_prompts, outputs, strict=True):
        rows, scores = hf_beam_search(tiny_hf, prompt, params, EOS)
        assert_same_beams(out, rows, scores, len(prompt), length_penalty)
        assert out.sequences[0].tokens[: len(prompt)] == prompt
        finish_reasons |= {s.finish_reason for s in out.sequences}
        for s in out.sequences:
            assert (s.finish_reason == "stop") == (s.tokens[-1] in EOS)
    assert "stop" in finish_reasons  # the EOS path was exercised
    assert_all_blocks_free(llm)


def test_ignore_eos_runs_every_beam_to_max_tokens(tiny_eos_dir, tiny_hf, tiny_prompts):
    llm = LLM(str(tiny_eos_dir), num_kv_blocks=256, **FLOAT32_KV)
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    for prompt, out in zip(
        tiny_prompts, llm.beam_search([{"prompt_token_ids": p} for p in tiny_prompts], params), strict=True
    ):
        rows, scores = hf_beam_search(tiny_hf, prompt, params, None)
        assert_same_beams(out, rows, scores, len(prompt), 1.0)
        assert all(len(s.tokens) == len(prompt) + 12 and s.finish_reason == "length" for s in out.sequences)
    assert_all_blocks_free(llm)


def test_beams_share_blocks_and_pruned_beams_free_theirs_at_once(tiny_eos_dir, tiny_prompts):
    """After every step each block in use belongs to a live beam, and beams share their common prefix."""
    llm = LLM(str(tiny_eos_dir), num_kv_blocks=256, block_size=4)
    engine = llm.engine
    engine.add_request(
        "beams", tiny_prompts[3], BeamSearchParams(beam_width=4, max_tokens=20, ignore_eos=True)
    )
    shared_steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        snapshot = engine.kv_snapshot()  # every sequence in the cache: the live beams
        assert snapshot["queues"]["swapped"] == 0
        tables = [seq["table"] for seq in snapshot["seqs"]]
        held = {block for table in tables for block in table}
        assert sum(ref > 0 for ref in snapshot["blocks"]["ref"]) == len(held)
        shared_steps += len(held) < sum(len(t) for t in tables)
    assert shared_steps > 10
    assert_all_blocks_free(llm)


def test_beams_of_many_prompts_batch_with_sampling_requests_and_survive_preemption(
    tiny_eos_dir, tiny_prompts
):
    """A cache too small for everything at once: beams are preempted like any sequence, the results
    are those of a roomy cache, and ordinary requests in the same batches are unaffected."""
    params = BeamSearchParams(beam_width=4, max_tokens=20)
    greedy = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    roomy = LLM(str(tiny_eos_dir), num_kv_blocks=256, block_size=4)
    expected = roomy.beam_search([{"prompt_token_ids": p} for p in tiny_prompts], params)
    expected_greedy = roomy.generate([{"prompt_token_ids": p} for p in tiny_prompts], greedy)
    for mode in ("recompute", "swap"):
        small = LLM(
            str(tiny_eos_dir), num_kv_blocks=40, block_size=4, preemption_mode=mode, max_num_batched_tokens=24
        )
        engine = small.engine
        for i, prompt in enumerate(tiny_prompts):
            engine.add_request(f"beam-{i}", prompt, params)
            engine.add_request(f"greedy-{i}", prompt, greedy)
        finished = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out
        assert engine.stats().num_preemptions > 0, mode
        for i, (beams, plain) in enumerate(zip(expected, expected_greedy, strict=True)):
            got = finished[f"beam-{i}"]
            prompt_len = len(got.prompt_token_ids)
            assert [o.token_ids for o in got.outputs] == [s.tokens[prompt_len:] for s in beams.sequences], (
                mode,
                i,
            )
            assert finished[f"greedy-{i}"].outputs[0].token_ids == plain.outputs[0].token_ids
        assert_all_blocks_free(small)
    assert_all_blocks_free(roomy)


def test_contiguous_layout_gives_the_same_beams(tiny_eos_dir, tiny_prompts):
    """A contiguous fork copies the parent's slab slot by slot: the beams are the paged ones."""
    params = BeamSearchParams(beam_width=3, max_tokens=16)
    prompts = [{"prompt_token_ids": p} for p in tiny_prompts]
    paged = LLM(str(tiny_eos_dir), num_kv_blocks=256)
    contiguous = LLM(str(tiny_eos_dir), num_kv_blocks=256, kv_layout="contiguous", contiguous_reserve="pow2")
    expected = [[s.tokens for s in out.sequences] for out in paged.beam_search(prompts, params)]
    assert [[s.tokens for s in out.sequences] for out in contiguous.beam_search(prompts, params)] == expected
    assert_all_blocks_free(paged)
    assert_all_blocks_free(contiguous)


def test_abort_frees_every_beam(tiny_eos_dir, tiny_prompts):
    llm = LLM(str(tiny_eos_dir), num_kv_blocks=256)
    engine = llm.engine
    engine.add_request("b", tiny_prompts[2], BeamSearchParams(beam_width=4, max_tokens=50, ignore_eos=True))
    for _ in range(5):
        engine.step()
    assert engine.stats().num_running == 4  # the beams
    engine.abort_request("b")
    assert_all_blocks_free(llm)


def test_bookkeeping_by_hand():
    """Two beams, EOS id 9: the top-ranked EOS continuation finishes, the next best two run on."""
    search = BeamSearch(BeamSearchParams(beam_width=2, max_tokens=10), eos_token_ids=[9], max_new_tokens=10)
    assert search.num_candidates == 4
    beams = [([1], -1.0), ([2], -1.5)]
    top = [([-0.1, -0.2, -3.0, -4.0], [9, 5, 6, 7]), ([-0.3, -0.4, -5.0, -6.0], [4, 9, 6, 7])]
    running = search.step(beams, top)
    # ranked: (0, 9) -1.1, (0, 5) -1.2, (1, 4) -1.8, (1, 9) -1.9: only the first is a top-2 EOS
    assert [(c.parent, c.token_id) for c in running] == [(0, 5), (1, 4)]
    assert [(h.token_ids, h.finish_reason) for h in search.finished] == [([1, 9], "stop")]
    assert search.finished[0].score == pytest.approx(-1.1 / 2)
    assert not search.done


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"beam_width": 0}, "beam_width"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
    ],
)
def test_bad_beam_search_params_name_the_value(kwargs, name):
    with pytest.raises(ValueError, match=name):
        BeamSearchParams(**({"beam_width": 2, "max_tokens": 4} | kwargs))


@pytest.mark.parametrize("beam_width", [2, 4])
def test_real_model_matches_hugging_face(smollm2_llm, hf_smollm2, beam_width):
    tok = smollm2_llm.get_tokenizer()
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2? Answer with one number."}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    prompts = [tok.encode(p) for p in ("The capital of France is", "def fibonacci(n):")] + [list(chat)]
    params = BeamSearchParams(beam_width, max_tokens=16)
    outputs = smollm2_llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    eos = sorted(smollm2_llm.engine.eos_token_ids)
    for ids, out in zip(prompts, outputs, strict=True):
        rows, scores = hf_beam_search(hf_smollm2, ids, params, eos)
        assert_same_beams(out, rows, scores, len(ids), 1.0)
        assert out.sequences[0].text == tok.decode(out.sequences[0].tokens, skip_special_tokens=True)
    assert outputs[-1].sequences[0].finish_reason == "stop"  # the chat answer ends with EOS
    assert_all_blocks_free(smollm2_llm)
