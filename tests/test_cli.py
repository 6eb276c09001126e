"""The `pagedllm` command in-process: beam search, penalties and engine flags reach the engine, and what a new
user meets: one clear line per mistake, before any model loads; help that shows the defaults."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from helpers import assert_all_blocks_free

from pagedllm import BeamSearchParams, SamplingParams
from pagedllm.engine.speculative import SpeculativeConfig
from pagedllm.entrypoints import cli

PROMPT = "The capital of France is"
# smollm2_llm's storage (float32 weights and KV cache), which these runs are compared with (and whose loaded
# model they share), so that the CLI prints what that engine computes
SMALL = [
    "--kv-cache-memory",
    "32MiB",
    "--max-model-len",
    "512",
    "--quantization",
    "none",
    "--kv-cache-dtype",
    "float32",
]


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
    # serve leaves it to the server (vLLM's CPU server default), generate takes EngineConfig's
    assert cli._engine_kwargs(parse(["serve"]))["max_num_batched_tokens"] is None
    assert cli._engine_kwargs(parse(["generate", "x"]))["max_num_batched_tokens"] == 8192
    for command in (["generate", "x"], ["serve"]):
        assert cli._engine_kwargs(parse(command))["disable_hybrid_kv_cache_manager"] is False
        flag = "--disable-hybrid-kv-cache-manager"
        assert cli._engine_kwargs(parse([*command, flag]))["disable_hybrid_kv_cache_manager"] is True


def test_every_kv_cache_dtype_is_a_choice_and_reaches_the_engine(capsys, caplog):
    """generate and serve take every kv_cache_dtype name; a quantized cache's start-up line counts its
    blocks as codes plus a float32 scale per token and KV head (SmolLM2: 30 layers, 3 KV heads of 64)."""
    from pagedllm.engine.config import KV_CACHE_DTYPES

    parse = cli.build_parser().parse_args
    for name in ["auto", *KV_CACHE_DTYPES]:
        for command in (["generate", "x"], ["serve"]):
            assert cli._engine_kwargs(parse([*command, "--kv-cache-dtype", name]))["kv_cache_dtype"] == name
    caplog.set_level("INFO", logger="pagedllm")
    assert cli.main(["generate", PROMPT, "--max-tokens", "2", *SMALL, "--kv-cache-dtype", "int8"]) == 0
    block_bytes = 2 * 30 * 64 * 3 * (64 + 4)  # K and V, every layer, 64 tokens (int8's default), 3 heads
    blocks = 32 * 2**20 // block_bytes
    assert f"{blocks} blocks of 64 tokens ({blocks * 64} tokens" in caplog.text, caplog.text


def test_an_unknown_kv_cache_dtype_names_the_choices(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "hi", "--kv-cache-dtype", "int4"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "invalid choice: 'int4'" in err and "'fp8_e4m3'" in err


def test_beam_width_with_chat_is_refused(capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", "--chat", "hi", "--beam-width", "2"])
    assert info.value.code == 2 and "--beam-width" in capsys.readouterr().err


@pytest.fixture
def no_model_loads(monkeypatch):
    """Fail the test if the command gets as far as loading a model."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr("pagedllm.engine.build.load_shared_model", refuse)


def _error_line(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["generate", ""], "the prompt is empty (got '')"),
        (["generate", "hi", "  "], "prompt 2 is empty (got '  ')"),
        (["generate", "hi", "--max-tokens", "-3"], "--max-tokens must be an integer >= 1, got -3"),
        (["generate", "hi", "--temperature", "-1"], "--temperature must be >= 0, got -1.0"),
        (["generate", "hi", "--speculative-config", "{"], "--speculative-config is not JSON (Expecting"),
        (["serve", "--speculative-config", "[4]"], "--speculative-config must be a JSON object, got '[4]'"),
        (
            ["generate", "hi", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
            "num_speculative_tokens must be a positive integer, got 0",
        ),
        (
            ["serve", "--speculative-config", '{"method": "draft_model", "num_speculative_tokens": 2}'],
            "method 'draft_model' with model None",
        ),
    ],
)
def test_bad_input_is_named_before_the_model_loads(capsys, no_model_loads, argv, words):
    assert words in _error_line(capsys, argv)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA and sees a GPU")
def test_cuda_on_a_cpu_torch_is_one_line(capsys, no_model_loads):
    assert "device='cuda'" in _error_line(capsys, ["generate", "hi", "--device", "cuda"])


def test_max_model_len_beyond_the_context_is_refused(capsys, tiny_chat_model, monkeypatch):
    argv = ["generate", "hi", "--model", str(tiny_chat_model), "--max-model-len", "100000"]
    line = _error_line(capsys, argv)
    assert "max_model_len=100000" in line and "context of 4096 tokens" in line
    assert "PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN=1" in line
    monkeypatch.setenv("PAGEDLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    argv[argv.index("100000")] = "5000"
    assert cli.main([*argv, "--max-tokens", "2", "--kv-cache-memory", "4MiB"]) == 0


def test_help_shows_defaults_that_match_the_python_api(capsys):
    for command in ("generate", "serve"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        out = " ".join(capsys.readouterr().out.split())  # help lines wrap anywhere
        assert "(default: 1GiB)" in out  # EngineConfig's kv_cache_memory, the README's settings table
        assert "(default: smollm2-135m)" in out
    assert "(default: 127.0.0.1)" in out and "(default: 30.0)" in out


def test_bench_help_has_a_line_per_benchmark(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    for name, (_, line) in cli.BENCHMARKS.items():
        assert f"  {name:<16} {line}" in out


def test_pictures_without_matplotlib_say_which_extra(capsys, monkeypatch, tmp_path):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else find_spec(name, *a)
    )
    with pytest.raises(SystemExit) as info:
        cli.main(["bench", "memory", "--num-requests", "5", "--plot", str(tmp_path / "map.png")])
    assert info.value.code == 2
    assert "pip install 'pagedllm[viz]'" in capsys.readouterr().err
    assert not (tmp_path / "map.png").exists()


def test_speculative_config_reaches_the_engine_and_keeps_the_greedy_text(capsys, smollm2_llm):
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}'
    parse = cli.build_parser().parse_args
    assert cli._engine_kwargs(parse(["serve", "--speculative-config", spec]))["speculative_config"] == {
        "method": "ngram",
        "num_speculative_tokens": 3,
        "prompt_lookup_max": 2,
    }
    draft = '{"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 2}'
    kwargs = cli._engine_kwargs(parse(["serve", "--speculative-config", draft]))
    assert SpeculativeConfig.from_dict(kwargs["speculative_config"]) == SpeculativeConfig(
        "draft_model", 2, model="qwen2.5-coder-0.5b"
    )
    prompt = "one two three, one two three, one two three,"
    texts = []
    for extra in ([], ["--speculative-config", spec]):
        assert cli.main(["generate", prompt, "--max-tokens", "24", *SMALL, *extra]) == 0
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].startswith(prompt)
