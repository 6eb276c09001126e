"""`pagedllm bench speculative`: one user editing code, with and without speculative decoding.

The prompt asks the model to rename a function in a file and return the whole file, so most of the
answer is in the prompt: what n-gram prompt lookup is for. The same greedy request (EOS ends it, at most
`--output-len` tokens) runs on an engine without speculation and on one with `--speculative-config`,
alternately `--repeats` times, both engines loaded side by side (they share the weights). Printed per
system: decode tokens/s (the tokens after the first over the time after the first, the median run),
and for the speculating one the acceptance rate of its drafts and the mean tokens a verify pass
yields; `same` says whether the two outputs are token for token equal.

`--draft-model M` measures a draft model instead (speculative_config {"model": M, ...}) on general chat
prompts, each run answering every one of CHAT_PROMPTS in turn: one speculating engine per k of
`--num-speculative-tokens`, all side by side with the engine without speculation (and, with
`--draft-vocab-size N`, one per k whose draft's LM head covers only N tokens). The forward and propose
columns are means over the steps that computed no prompt tokens: a decode step, or a verify pass.

With `--llama-cpp` (a GGUF model, llama-cpp-python installed) llama-cpp-python (llama.cpp's library
under its Python generate loop) answers the same prompts on the same file in a process of its own
(bench/peers.py) after pagedllm's engines in every round, without speculation ("llama-cpp-python") and
with its prompt-lookup draft ("llama-cpp-python LlamaPromptLookupDecoding N") at each
`--llama-cpp-lookup` draft length N (its best is the bar: llama-cpp-python suggests 10 on GPUs, 2 on
CPUs). `--batch-sizes N ...` also sends N
code-editing requests at once (each renaming to a name of its own) and prints output tok/s with and
without speculation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from pagedllm.bench import flags, llama_cpp
from pagedllm.bench.peers import peer_env

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


CHAT_PROMPTS = [
    "Why is the sky blue? Explain it to a curious ten-year-old in one paragraph.",
    "Give me five tips for sleeping better, one sentence each.",
    "Write a short story, about 120 words, about a lighthouse keeper who finds a message in a bottle.",
    "What should I pack for a weekend hiking trip in the mountains in autumn?",
]
# 3 drafts: a verify pass of 4 rows stays in the GGUF matmuls' few-row regime; matches of 2+ tokens
# propose fewer drafts that fail (docs/JOURNAL.md, "Speculative decoding").
DEFAULT_SPEC = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_max=4, prompt_lookup_min=2)


def timed_run(engine, request_id: str, prompt: list[int], params) -> tuple[list[int], int, float]:
    """The request's tokens, and its decode tokens and seconds after the first token."""
    engine.add_request(request_id, prompt, params)
    stamps, tokens = [], []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if outputs and outputs[0].outputs[0].token_ids != tokens:
            tokens = outputs[0].outputs[0].token_ids
            stamps.append((time.perf_counter(), len(tokens)))
    (t0, n0), (t1, n1) = stamps[0], stamps[-1]
    return list(tokens), n1 - n0, t1 - t0


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
    flags.add_model(parser, default="qwen2.5-coder-0.5b")
    parser.add_argument("--speculative-config", default=json.dumps(DEFAULT_SPEC), help="JSON, as vLLM's")
    parser.add_argument(
        "--draft-model", default=None, help="a draft model instead of --speculative-config, on chat prompts"
    )
    parser.add_argument(
        "--num-speculative-tokens", type=int, nargs="+", default=[3], help="with --draft-model: each k"
    )
    parser.add_argument(
        "--draft-vocab-size",
        type=int,
        nargs="*",
        default=[],
        help="with --draft-model: also each k with the draft's LM head over this many tokens (FR-Spec)",
    )
    flags.add_quantization(parser)
    parser.add_argument("--output-len", type=int, default=400, help="greedy tokens at most (EOS ends)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each engine, alternating")
    flags.add_kv_cache_memory(parser, "256MiB")
    flags.add_threads(parser)
    parser.add_argument(
        "--llama-cpp",
        action="store_true",
        help="run llama-cpp-python on the same GGUF beside (child process)",
    )
    parser.add_argument(
        "--llama-cpp-lookup",
        type=int,
        nargs="+",
        default=[2, 3, 10],
        help="num_pred_tokens of llama-cpp-python's LlamaPromptLookupDecoding runs (max_ngram_size 2, its "
        "default)",
    )
    parser.add_argument(
        "--batch-sizes",
        type=int,
        nargs="*",
        default=[],
        help="also send this many requests at once (each renaming to its own name): output tok/s",
    )
    return parser


def llama_cpp_runs(gguf, prompts: list[list[int]], params, stop_ids, lookup: dict | None) -> list[tuple]:
    """llama-cpp-python's answer to each prompt (in its own process), as timed_run gives pagedllm's:
    tokens, decode tokens, seconds."""
    job = {
        "model": str(gguf),
        "threads": torch.get_num_threads(),
        "n_ctx": max(map(len, prompts)) + params.max_tokens + 16,
        "prompts": prompts,
        "warmup": prompts[0][:16],
        "output_len": params.max_tokens,
        "stop_ids": sorted(stop_ids),
        "prompt_lookup": lookup,
    }
    runs = []
    results, _ = llama_cpp.generate(job)
    for result in results:
        stamps = result["token_times_s"]
        runs.append((result["tokens"], len(stamps) - 1, stamps[-1] - stamps[0]))
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.speculative_config = flags.json_object("--speculative-config", args.speculative_config)
    except ValueError as error:
        parser.error(str(error))
    flags.apply_threads(args)
    from pagedllm import LLM, SamplingParams

    peers: dict[str, dict | None] = {}
    gguf = llama_cpp.gguf_of(parser, args.model, "--llama-cpp") if args.llama_cpp else None
    if args.llama_cpp:
        peers[llama_cpp.LLAMA_CPP_PYTHON] = None
        for n in args.llama_cpp_lookup:
            peers[f"{llama_cpp.PROMPT_LOOKUP} {n}"] = {"max_ngram_size": 2, "num_pred_tokens": n}

    max_num_seqs = max([1, *args.batch_sizes])
    common = dict(
        quantization=args.quantization, kv_cache_memory=args.kv_cache_memory, max_num_seqs=max_num_seqs
    )
    configs = {"speculative": args.speculative_config}
    if args.draft_model:
        configs = {
            f"draft k={k}" + (f" vocab {n}" if n else ""): {
                "model": args.draft_model,
                "num_speculative_tokens": k,
                **({"draft_vocab_size": n} if n else {}),
            }
            for k in args.num_speculative_tokens
            for n in [None, *args.draft_vocab_size]
        }
    systems = {"no speculation": LLM(args.model, **common)}
    systems.update({name: LLM(args.model, speculative_config=c, **common) for name, c in configs.items()})
    tokenizer = systems["no speculation"].get_tokenizer()
    texts = CHAT_PROMPTS if args.draft_model else [instruction()]
    prompts = [chat_prompt(tokenizer, text) for text in texts]
    params = SamplingParams(max_tokens=args.output_len, temperature=0.0)
    for llm in systems.values():  # warm-up: first-call costs out of the timed runs
        llm.generate([prompts[0]], SamplingParams(max_tokens=8, temperature=0.0))
    rates: dict[str, list[float]] = {name: [] for name in [*systems, *peers]}
    tokens: dict[str, list[list[int]]] = {}
    before = {name: systems[name].engine.stats() for name in configs}
    traces: dict[str, list] = {name: [] for name in systems}  # each timed step's phases
    for name, llm in systems.items():
        llm.engine.add_step_observer(traces[name].append)
    plain_info = systems["no speculation"].engine.run_info()
    eos = plain_info.eos_token_ids
    for i in range(args.repeats):
        for name, llm in systems.items():
            runs = [timed_run(llm.engine, f"{name}-{i}-{j}", p, params) for j, p in enumerate(prompts)]
            tokens[name] = [run[0] for run in runs]
            rates[name].append(sum(run[1] for run in runs) / sum(run[2] for run in runs))
        for name, lookup in peers.items():
            runs = llama_cpp_runs(gguf, prompts, params, eos, lookup)
            tokens[name] = [run[0] for run in runs]
            rates[name].append(sum(run[1] for run in runs) / sum(run[2] for run in runs))
    base = statistics.median(rates["no speculation"])
    what = "general chat requests" if args.draft_model else "one code-editing request"
    spec_text = f"draft model {args.draft_model}" if args.draft_model else json.dumps(args.speculative_config)
    print(
        f"model {args.model}, {what} ({sum(map(len, prompts))} prompt tokens, "
        f"{sum(map(len, tokens['no speculation']))} output tokens), {torch.get_num_threads()} threads, "
        f"{args.repeats} runs each, speculative_config {spec_text}; pagedllm ran: {plain_info.describe()}"
        + (f"; {llama_cpp.LLAMA_CPP_PYTHON} ran: {peer_env().describe()}" if peers else "")
    )
    columns = ("forward ms/step", "propose ms/step")  # means over the steps that prefilled nothing
    width = max(22, *(len(name) + 2 for name in rates))
    print(
        f"{'system':<{width}}{'decode tok/s':>14}{'runs':>22}"
        + "".join(f"{c:>17}" for c in columns)
        + f"{'same':>6}"
    )
    for name in rates:
        runs = " ".join(f"{r:.1f}" for r in rates[name])
        phases = ("forward", "propose")
        decodes = [t for t in traces.get(name, []) if not t.prefill_tokens]  # prompts' steps left out
        steps = [1e3 * statistics.mean(t.seconds[p] for t in decodes) for p in phases] if decodes else []
        step_text = "".join(f"{ms:>17.1f}" for ms in steps) or f"{'-':>17}{'-':>17}"
        same = "yes" if tokens[name] == tokens["no speculation"] else "no"
        print(f"{name:<{width}}{statistics.median(rates[name]):>14.1f}{runs:>22}{step_text}{same:>6}")
    for name in configs:
        stats = systems[name].engine.stats()
        drafts = stats.spec_draft_tokens - before[name].spec_draft_tokens
        accepted = stats.spec_accepted_tokens - before[name].spec_accepted_tokens
        verifies = stats.spec_verifies - before[name].spec_verifies
        pairs = [s / b for s, b in zip(rates[name], rates["no speculation"], strict=True)]
        print(
            f"{name}: speed-up {statistics.median(rates[name]) / base:.2f}x "
            f"(per run {min(pairs):.2f}-{max(pairs):.2f}x); acceptance rate "
            f"{accepted / max(drafts, 1):.1%} ({accepted} of {drafts} drafts), mean accepted length "
            f"{1 + accepted / max(verifies, 1):.2f} tokens per verify pass; "
            f"same tokens: {tokens[name] == tokens['no speculation']}"
        )
    if peers:
        plain_peer = llama_cpp.LLAMA_CPP_PYTHON
        best = max((n for n in peers if n != plain_peer), key=lambda n: statistics.median(rates[n]))
        for name in configs:
            pairs = [s / b for s, b in zip(rates[name], rates[best], strict=True)]
            print(
                f"{name} / {best} (llama-cpp-python's best prompt lookup): "
                f"{statistics.median(rates[name]) / statistics.median(rates[best]):.2f}x "
                f"(per round {min(pairs):.2f}-{max(pairs):.2f}x); "
                f"without speculation / {plain_peer}: {base / statistics.median(rates[plain_peer]):.2f}x"
            )
    for n in args.batch_sizes:
        batch = [chat_prompt(tokenizer, instruction(f"weighted_mean_{j}")) for j in range(n)]
        batch_rates: dict[str, list[float]] = {name: [] for name in systems}
        for i in range(args.repeats):
            for name, llm in systems.items():
                batch_rates[name].append(batch_run(llm.engine, f"{name}-batch{n}-{i}", batch, params))
        runs = "; ".join(f"{name} " + " ".join(f"{r:.1f}" for r in batch_rates[name]) for name in systems)
        plain = statistics.median(batch_rates["no speculation"])
        ratios = ", ".join(f"{name} {statistics.median(batch_rates[name]) / plain:.2f}x" for name in configs)
        print(f"{n} requests at once: output tok/s {plain:.1f} without speculation; {ratios} ({runs})")
    for llm in systems.values():
        assert llm.engine.stats().kv_all_free, "KV blocks leaked"
    return 0


if __name__ == "__main__":
    sys.exit(main())
