"""`pagedllm bench chunked-prefill`: how long running requests stall when a long prompt arrives.

`--num-running` requests (random prompts of `--running-prompt-len` tokens) decode; once each has
produced `--warm-tokens` tokens a prompt of `--long-prompt-len` random tokens arrives. The run goes on
until the newcomer has its first token and every running request has produced `--after-tokens` more.
Two engines on the same model and requests: without chunked prefill the whole prompt is prefilled in
one step with the decodes (`--max-num-batched-tokens` is raised to fit it), so every running request
waits for it; with chunked prefill (vLLM v1's policy) each step decodes the running requests and
spends the rest of `--max-num-batched-tokens` on the next chunk of the prompt.

Printed per engine: the running requests' median gap between two tokens before the arrival, their
longest gap from the arrival on, the newcomer's time to first token, and in how many steps (chunks)
its prompt was prefilled; then the ratio of the longest gaps. Timings: run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass

from pagedllm.bench import flags
from pagedllm.bench.table import aligned


@dataclass
class Result:
    engine: str
    max_num_batched_tokens: int
    median_gap_before_s: float  # running requests, between two tokens, before the long prompt arrived
    max_gap_after_s: float  # running requests, longest gap between two tokens from the arrival on
    long_ttft_s: float  # the long prompt: arrival to first token
    long_prefill_steps: int  # steps in which part of the long prompt was computed
    ran: str  # attention backend, CPU build, linear method per weight type, threads (RunInfo.describe)


def run_engine(args: argparse.Namespace, chunked: bool) -> Result:
    from pagedllm import LLM, SamplingParams

    budget = args.max_num_batched_tokens if chunked else max(8192, args.long_prompt_len + args.num_running)
    llm = LLM(
        args.model,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.long_prompt_len + 64,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    rng = random.Random(args.seed)
    info = engine.run_info()
    vocab = info.vocab_size
    llm.generate([[rng.randrange(vocab) for _ in range(16)]], SamplingParams(max_tokens=2))  # warm-up
    running = [f"run-{i}" for i in range(args.num_running)]
    decode = SamplingParams(max_tokens=10**6, temperature=0, ignore_eos=True)
    for request_id in running:
        engine.add_request(request_id, [rng.randrange(vocab) for _ in range(args.running_prompt_len)], decode)
    long_prompt = [rng.randrange(vocab) for _ in range(args.long_prompt_len)]

    stamps: dict[str, list[float]] = {request_id: [] for request_id in running}  # token arrival times
    arrival = long_first = None
    prefill_tokens: list[int] = []  # each step's, from the long prompt's arrival to its first token

    def watch(trace) -> None:
        if arrival is not None and long_first is None:
            prefill_tokens.append(trace.prefill_tokens)

    engine.add_step_observer(watch)
    while long_first is None or min(map(len, stamps.values())) < args.warm_tokens + args.after_tokens:
        if arrival is None and min(map(len, stamps.values())) >= args.warm_tokens:
            engine.add_request("long", long_prompt, SamplingParams(max_tokens=1, temperature=0))
            arrival = time.perf_counter()
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            if out.request_id == "long":
                # A step of a chunked prefill may report the request without a token: the first token
                # is the one that appears.
                if long_first is None and out.outputs[0].token_ids:
                    long_first = now
            elif len(out.outputs[0].token_ids) > len(stamps[out.request_id]):
                stamps[out.request_id].append(now)
    engine.remove_step_observer(watch)
    for request_id in running:
        engine.abort_request(request_id)
    assert engine.stats().kv_all_free, "KV blocks leaked"
    # The running requests were all decoding when it arrived: the prompt tokens computed since are the
    # long prompt's, unless a preempted request computed its prompt again.
    if sum(prefill_tokens) != len(long_prompt):
        raise SystemExit(
            f"a request was preempted while the long prompt was prefilled ({sum(prefill_tokens)} prompt "
            f"tokens computed for its {len(long_prompt)}): raise --kv-cache-memory "
            f"(now {args.kv_cache_memory})"
        )
    gaps = [(b, b - a) for s in stamps.values() for a, b in zip(s, s[1:], strict=False)]
    return Result(
        "chunked" if chunked else "unchunked",
        budget,
        statistics.median(gap for end, gap in gaps if end <= arrival),
        max(gap for end, gap in gaps if end > arrival),
        long_first - arrival,
        sum(n > 0 for n in prefill_tokens),
        info.describe(),
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm bench chunked-prefill",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    flags.add_model(parser)
    parser.add_argument("--num-running", type=int, default=16)
    parser.add_argument("--running-prompt-len", type=int, default=64)
    parser.add_argument("--long-prompt-len", type=int, default=4000)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512, help="the chunked engine's budget")
    parser.add_argument("--warm-tokens", type=int, default=4, help="tokens per running request before")
    parser.add_argument("--after-tokens", type=int, default=8, help="tokens per running request after")
    flags.add_kv_cache_memory(parser, "1GiB")
    flags.add_threads(parser)
    flags.add_seed(parser)
    flags.add_json(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    flags.apply_threads(args)
    results = [run_engine(args, chunked) for chunked in (False, True)]
    if args.json:
        print(json.dumps({"config": vars(args), "rows": [asdict(r) for r in results]}, indent=2))
        return 0
    print(
        f"{args.num_running} requests decoding ({args.running_prompt_len}-token prompts), then a "
        f"{args.long_prompt_len}-token prompt arrives; model {args.model}"
    )
    header = [
        "engine",
        "budget",
        "gap before (median)",
        "longest gap after",
        "long prompt TTFT",
        "prefill steps",
        "ran",
    ]
    table = [header] + [
        [
            r.engine,
            str(r.max_num_batched_tokens),
            f"{1000 * r.median_gap_before_s:.0f} ms",
            f"{1000 * r.max_gap_after_s:.0f} ms",
            f"{r.long_ttft_s:.2f} s",
            str(r.long_prefill_steps),
            r.ran,
        ]
        for r in results
    ]
    print("\n".join(aligned(table)))
    unchunked, chunked = results
    print(
        f"longest gap: unchunked / chunked = {unchunked.max_gap_after_s / chunked.max_gap_after_s:.2f}x; "
        f"long prompt TTFT: chunked / unchunked = {chunked.long_ttft_s / unchunked.long_ttft_s:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
