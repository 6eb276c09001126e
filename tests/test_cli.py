"""The `pagedllm generate` command in-process: beam search, penalties and engine flags reach the engine."""

from __future__ import annotations

import pytest
from helpers import assert_all_blocks_free

from pagedllm import BeamSearchParams, SamplingParams
from pagedllm.entrypoints import cli

PROMPT = "The capital of France is"
SMALL = ["--kv-cache-memory", "32MiB", "--max-model-len", "512"]


def test_beam_width_prints_every_beam_best_first(capsys, smollm2_llm):
    assert cli.main(["generate", PROMPT, "--beam-width", "2", "--max-tokens", "8", *SMALL]) == 0
    beams = smollm2_llm.beam_search(PROMPT, BeamSearchParams(beam_width=2, max_tokens=8))[0].sequences
    expected = "".join(
        f"[beam {i}, cumulative logprob {b.cum_logprob:.3f}] {b.text}\n" for i, b in enumerate(beams)
    )
    assert capsys.readouterr().out == expected
    assert_all_blocks_free(smollm2_llm)


def test_penalties_reach_the_sampler(capsys, smollm2_llm):
    args = [
        "generate",
        PROMPT,
        "--max-tokens",
        "12",
        "--repetition-penalty",
        "1.5",
        "--presence-penalty",
        "1",
    ]
    assert cli.main(args + SMALL) == 0
    expected = smollm2_llm.generate(
        PROMPT, SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.5, presence_penalty=1)
    )[0]
    assert capsys.readouterr().out == expected.prompt + expected.outputs[0].text + "\n"


def test_engine_flags_spelled_as_vllm():
    parse = cli.build_parser().parse_args
    assert cli._engine_kwargs(parse(["generate", "x"]))["enable_prefix_caching"] is True
    flags = ["generate", "x", "--no-enable-prefix-caching", "--no-enable-chunked-prefill"]
    kwargs = cli._engine_kwargs(parse([*flags, "--max-num-batched-tokens", "512"]))
    assert (kwargs["enable_prefix_caching"], kwargs["enable_chunked_prefill"]) == (False, False)
    assert kwargs["max_num_batched_tokens"] == 512


def test_beam_width_with_chat_is_refused(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "--chat", "hi", "--beam-width", "2"])
    assert info.value.code == 2 and "--beam-width" in capsys.readouterr().err
