"""llama.cpp itself, timed by its own `llama-bench` binary (`pagedllm bench latency --llama-bench PATH`).

llama-bench runs each test `-r` times in C++, with no Python between tokens: `pp N` (a prompt of N
tokens, one batch, prompt-processing tokens/s) and `tg N` (N tokens generated one at a time on an empty
context, tokens/s). It runs in its own process with its own environment (bench/peers.py), its own
defaults (batch 2048, micro-batch 512, float16 K/V), and the thread count given; `-o json` prints one
object per test (llama.cpp's tools/llama-bench README, "JSON"), parsed here.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from pagedllm.bench.peers import PeerEnv


@dataclass(frozen=True)
class LlamaBenchResult:
    """One llama-bench test: pp (n_prompt > 0, n_gen 0) or tg (n_gen > 0, n_prompt 0)."""

    test: str  # "pp512", "tg128"
    tokens_per_s: float  # llama-bench's avg_ts
    stddev_tokens_per_s: float
    repetitions: int
    threads: int
    build: str  # "8cf427ff (5163)"
    backends: str
    type_k: str
    type_v: str
    model_type: str


def command(binary: Path, gguf: Path, prompt_lens: list[int], output_len: int, threads: int, reps: int):
    """The argv: one pp test per prompt length and one tg test, JSON on stdout."""
    return [
        str(binary),
        "-m",
        str(gguf),
        "-p",
        ",".join(map(str, prompt_lens)),
        "-n",
        str(output_len),
        "-t",
        str(threads),
        "-r",
        str(reps),
        "-o",
        "json",
    ]


def parse(text: str) -> list[LlamaBenchResult]:
    """llama-bench's `-o json` output: a list of test objects; a ValueError naming what is missing."""
    try:
        tests = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"llama-bench printed no JSON ({error}): {text[:200]!r}") from None
    if not isinstance(tests, list):
        raise ValueError(f"llama-bench's JSON is not a list of tests: {text[:200]!r}")
    results = []
    for test in tests:
        try:
            n_prompt, n_gen = test["n_prompt"], test["n_gen"]
            if (n_prompt > 0) == (n_gen > 0):
                raise ValueError(f"a test with n_prompt {n_prompt} and n_gen {n_gen} is neither pp nor tg")
            results.append(
                LlamaBenchResult(
                    test=f"pp{n_prompt}" if n_prompt else f"tg{n_gen}",
                    tokens_per_s=float(test["avg_ts"]),
                    stddev_tokens_per_s=float(test["stddev_ts"]),
                    repetitions=len(test.get("samples_ts", [])),
                    threads=int(test["n_threads"]),
                    build=f"{test['build_commit']} ({test['build_number']})",
                    backends=test["backends"],
                    type_k=test["type_k"],
                    type_v=test["type_v"],
                    model_type=test["model_type"],
                )
            )
        except KeyError as error:
            raise ValueError(f"a llama-bench test lacks {error}: {test}") from None
    return results


def run(
    binary: Path,
    gguf: Path,
    prompt_lens: list[int],
    output_len: int,
    threads: int,
    env: PeerEnv,
    reps: int = 5,
) -> list[LlamaBenchResult]:
    """Run llama-bench once on every test; its parsed results."""
    if not binary.is_file():
        raise FileNotFoundError(f"--llama-bench {binary}: no such file")
    argv = command(binary, gguf, prompt_lens, output_len, threads, reps)
    done = subprocess.run(argv, capture_output=True, text=True, env=env.env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
    return parse(done.stdout)


def report(results: list[LlamaBenchResult], env: PeerEnv) -> list[str]:
    """Printed lines: a row per test, then what ran."""
    lines = [f"{'llama.cpp llama-bench':<26}{'test':>8}{'tok/s':>12}{'+-':>8}{'reps':>6}"]
    for r in results:
        lines.append(
            f"{'':<26}{r.test:>8}{r.tokens_per_s:>12.2f}{r.stddev_tokens_per_s:>8.2f}{r.repetitions:>6}"
        )
    if results:
        first = results[0]
        lines.append(
            f"  ran: llama.cpp build {first.build}, {first.backends}, {first.model_type}, "
            f"{first.threads} threads, K/V {first.type_k}/{first.type_v}; {env.describe()}"
        )
    return lines
