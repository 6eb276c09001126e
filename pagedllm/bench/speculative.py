"""`pagedllm bench speculative`: one user editing code, with and without speculative decoding.

The prompt asks the model to rename a function in a file and return the whole file, so most of the
answer is in the prompt: what n-gram prompt lookup is for. The same greedy request (EOS ends it, at most
`--output-len` tokens) runs on an engine without speculation and on one with `--speculative-config`,
alternately `--repeats` times, both engines loaded side by side (they share the weights). Printed per
system: decode tokens/s (the tokens after the first over the time after the first, the median run),
and for the speculating one the acceptance rate of its drafts and the mean tokens a verify pass
yields; `same` says whether the two outputs are token for token equal.

With `--llama-cpp` (a GGUF model, llama-cpp-python installed) llama.cpp runs the same request on the same
file in a child process after pagedllm's pair in every round, without speculation and with its own
prompt-lookup decoding (`LlamaPromptLookupDecoding`) at each `--llama-cpp-lookup` draft length (its best
is the bar: llama-cpp-python suggests 10 on GPUs, 2 on CPUs).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time

import torch

SOURCE = '''import math


def compute(values, weights=None):
    """The weighted mean of values (equal weights by default)."""
    if weights is None:
        weights = [1.0] * len(values)
    if len(weights) != len(values):
        raise ValueError("values and weights differ in length")
    total = sum(w * v for w, v in zip(weights, values))
    return total / sum(weights)


def spread(values):
    """The standard deviation of values around their mean."""
    mean = compute(values)
    return math.sqrt(compute([(v - mean) ** 2 for v in values]))


def summary(values):
    """Mean, spread, smallest and largest value, as a dict."""
    return {
        "mean": compute(values),
        "spread": spread(values),
        "min": min(values),
        "max": max(values),
    }


if __name__ == "__main__":
    data = [3.0, 1.5, 4.0, 1.0, 5.5, 9.0, 2.5, 6.0]
    print(summary(data))
    print(compute(data, weights=[1, 2, 1, 2, 1, 2, 1, 2]))
'''


def instruction(new_name: str = "weighted_mean") -> str:
    return (
        f"Rename the function `compute` to `{new_name}` everywhere in this file, change nothing else, "
        "and reply with the whole file in one Python code block.\n\n```python\n" + SOURCE + "```"
    )


def chat_prompt(tokenizer, text: str) -> list[int]:
    messages = [{"role": "user", "content": text}]
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    )


# 3 drafts: a verify pass of 4 rows stays in the GGUF matmuls' few-row regime; matches of 2+ tokens
# propose fewer drafts that fail (docs/JOURNAL.md, "Speculative decoding").
DEFAULT_SPEC = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4, prompt_lookup_min=2)


def timed_run(engine, request_id: str, prompt: list[int], params) -> tuple[list[int], float]:
    """The request's tokens, and its decode tokens/s after the first token."""
    engine.add_request(request_id, prompt, params)
    stamps, tokens = [], []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if outputs and outputs[0].outputs[0].token_ids != tokens:
            tokens = outputs[0].outputs[0].token_ids
            stamps.append((time.perf_counter(), len(tokens)))
    (t0, n0), (t1, n1) = stamps[0], stamps[-1]
    return list(tokens), (n1 - n0) / (t1 - t0)


def batch_run(engine, tag: str, prompts: list[list[int]], params) -> float:
    """Output tokens per second of requests sent at once, from the first step to the last token."""
    for j, prompt in enumerate(prompts):
        engine.add_request(f"{tag}-{j}", prompt, params)
    start, total = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        total += sum(len(out.outputs[0].token_ids) for out in engine.step() if out.finished)
    return total / (time.perf_counter() - start)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm bench speculative",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="qwen2.5-coder-0.5b", help="built-in name, HF folder or .gguf")
    parser.add_argument("--speculative-config", default=json.dumps(DEFAULT_SPEC), help="JSON, as vLLM's")
    parser.add_argument("--quantization", default="auto", help="weight storage (auto: a GGUF's own blocks)")
    parser.add_argument("--output-len", type=int, default=400, help="greedy tokens at most (EOS ends)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each engine, alternating")
    parser.add_argument("--kv-cache-memory", default="256MiB")
    parser.add_argument("--threads", type=int, default=None, help="default: torch's")
    parser.add_argument("--llama-cpp", action="store_true", help="run llama.cpp on the same GGUF beside")
    parser.add_argument(
        "--llama-cpp-lookup",
        type=int,
        nargs="+",
        default=[2, 3, 10],
        help="num_pred_tokens of llama.cpp's prompt lookup runs (max_ngram_size 2, its default)",
    )
    parser.add_argument(
        "--batch-sizes",
        type=int,
        nargs="*",
        default=[],
        help="also send this many requests at once (each renaming to its own name): output tok/s",
    )
    return parser


def llama_cpp_run(gguf, prompt: list[int], params, stop_ids, lookup: dict | None) -> tuple[list[int], float]:
    """llama.cpp's tokens for the request, and its decode tokens/s after the first token (as timed_run)."""
    from pagedllm.bench.latency import _peer

    job = {
        "mode": "generate",
        "model": str(gguf),
        "threads": torch.get_num_threads(),
        "n_ctx": len(prompt) + params.max_tokens + 16,
        "prompts": [prompt],
        "warmup": prompt[:16],
        "output_len": params.max_tokens,
        "stop_ids": sorted(stop_ids),
        "prompt_lookup": lookup,
    }
    (result,) = _peer(job)
    stamps = result["token_times_s"]
    return result["tokens"], (len(stamps) - 1) / (stamps[-1] - stamps[0])


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def main(argv: list[str] | None = None) -> int:
    from pagedllm.entrypoints.cli import json_object

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.speculative_config = json_object("--speculative-config", args.speculative_config)
    except ValueError as error:
        parser.error(str(error))
    if args.threads:
        torch.set_num_threads(args.threads)
    from pagedllm import LLM, SamplingParams
    from pagedllm.models.loader import gguf_file

    peers: dict[str, dict | None] = {}
    gguf = gguf_file(args.model)
    if args.llama_cpp:
        if importlib.util.find_spec("llama_cpp") is None:
            parser.error(
                "--llama-cpp needs llama-cpp-python (docs/BENCHMARKS.md, Setting up the comparisons)"
            )
        if gguf is None:
            parser.error(f"--llama-cpp runs a GGUF file; model {args.model!r} is not one")
        peers["llama.cpp"] = None
        for n in args.llama_cpp_lookup:
            peers[f"llama.cpp lookup {n}"] = {"max_ngram_size": 2, "num_pred_tokens": n}

    common = dict(
        quantization=args.quantization,
        kv_cache_memory=args.kv_cache_memory,
        max_num_seqs=max([1, *args.batch_sizes]),
    )
    systems = {
        "no speculation": LLM(args.model, **common),
        "speculative": LLM(args.model, speculative_config=args.speculative_config, **common),
    }
    tokenizer = systems["no speculation"].engine.tokenizer
    prompt = chat_prompt(tokenizer, instruction())
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0)
    for llm in systems.values():  # warm-up: first-call costs out of the timed runs
        llm.generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))
    rates: dict[str, list[float]] = {name: [] for name in systems}
    tokens: dict[str, list[int]] = {}
    before = systems["speculative"].engine.stats()
    for i in range(args.repeats):
        for name, llm in systems.items():
            tokens[name], rate = timed_run(llm.engine, f"{name}-{i}", prompt, params)
            rates[name].append(rate)
        for name, lookup in peers.items():
            tokens[name], rate = llama_cpp_run(
                gguf, prompt, params, systems["no speculation"].engine.eos_token_ids, lookup
            )
            rates.setdefault(name, []).append(rate)
    stats = systems["speculative"].engine.stats()
    drafts = stats.spec_draft_tokens - before.spec_draft_tokens
    accepted = stats.spec_accepted_tokens - before.spec_accepted_tokens
    verifies = stats.spec_verifies - before.spec_verifies
    base, spec = (statistics.median(rates[name]) for name in systems)
    print(
        f"model {args.model}, one code-editing request ({len(prompt)} prompt tokens, "
        f"{len(tokens['speculative'])} output tokens), {torch.get_num_threads()} threads, "
        f"{args.repeats} runs each, speculative_config {json.dumps(args.speculative_config)}"
    )
    print(f"{'system':<22}{'decode tok/s':>14}{'runs':>22}{'output tokens':>15}{'same prefix':>13}")
    for name in rates:
        runs = " ".join(f"{r:.1f}" for r in rates[name])
        same = common_prefix(tokens[name], tokens["no speculation"])
        print(f"{name:<22}{statistics.median(rates[name]):>14.1f}{runs:>22}{len(tokens[name]):>15}{same:>13}")
    print(
        f"speed-up {spec / base:.2f}x; acceptance rate {accepted / max(drafts, 1):.1%} "
        f"({accepted} of {drafts} drafts), mean accepted length {1 + accepted / max(verifies, 1):.2f} "
        f"tokens per verify pass; same tokens: {tokens['speculative'] == tokens['no speculation']}"
    )
    if peers:
        best = max((n for n in peers if n != "llama.cpp"), key=lambda n: statistics.median(rates[n]))
        lows = [s / b for s, b in zip(rates["speculative"], rates[best], strict=True)]
        print(
            f"speculative / {best} (llama.cpp's best prompt lookup): "
            f"{spec / statistics.median(rates[best]):.2f}x (per round {min(lows):.2f}-{max(lows):.2f}x); "
            f"without speculation / llama.cpp: {base / statistics.median(rates['llama.cpp']):.2f}x"
        )
    for n in args.batch_sizes:
        prompts = [chat_prompt(tokenizer, instruction(f"weighted_mean_{j}")) for j in range(n)]
        batch_rates: dict[str, list[float]] = {name: [] for name in systems}
        for i in range(args.repeats):
            for name, llm in systems.items():
                batch_rates[name].append(batch_run(llm.engine, f"{name}-batch{n}-{i}", prompts, params))
        base, spec = (statistics.median(batch_rates[name]) for name in systems)
        runs = "; ".join(f"{name} " + " ".join(f"{r:.1f}" for r in batch_rates[name]) for name in systems)
        print(
            f"{n} requests at once: output tok/s {base:.1f} without, {spec:.1f} with speculation, "
            f"{spec / base:.2f}x ({runs})"
        )
    for llm in systems.values():
        assert llm.engine.stats().kv_all_free, "KV blocks leaked"
    return 0


if __name__ == "__main__":
    sys.exit(main())
