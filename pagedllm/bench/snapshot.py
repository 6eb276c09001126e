"""`pagedllm bench snapshot`: what the dashboard's GET /v1/kv costs the engine, next to an engine step.

The engine runs `--num-seqs` requests (random-token prompts, lengths uniform in `--input-len`, EOS
ignored) until every one of them is running and decoding. Then, for `--steps` steps, it times each
step and right after it what /v1/kv does: the snapshot taken on the engine thread between two steps
(the engine waits for it), and the JSON encoding the server then does on its event loop thread (the
engine does not wait for it). Printed: the mean of each, and the snapshot's share of a step. Only
the ratio measured in one run means anything; the machine must be quiet.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from pagedllm.bench import flags
from pagedllm.workload import make_prompts, parse_range


def make_llm(args):
    """The engine the bench measures, with room for `--num-seqs` sequences at once."""
    from pagedllm import LLM

    return LLM(
        args.model,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        max_num_seqs=args.num_seqs,
        kv_layout=args.kv_layout,
    )


def measure(engine, args) -> tuple[dict, dict]:
    """The means over the timed steps, and the last /v1/kv payload timed (what its JSON size counts)."""
    from fastapi.responses import JSONResponse

    from pagedllm import SamplingParams
    from pagedllm.entrypoints.openai.dashboard import kv_payload
    from pagedllm.entrypoints.openai.metrics import EngineMetrics

    info = engine.run_info()
    prompts = make_prompts([args.input_len] * args.num_seqs, info.vocab_size, args.seed)
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"snap-{i}", ids, params)
    most = 0

    def check_whole_batch() -> None:
        """Every sequence running, none preempted or finished: else the cache is too small."""
        stats = engine.stats()
        preemptions = stats.num_preemptions
        if (
            stats.num_running != args.num_seqs
            or preemptions
            or engine.get_num_unfinished_requests() < args.num_seqs
        ):
            for request_id in engine.unfinished_request_ids():
                engine.abort_request(request_id)
            raise SystemExit(
                f"at most {most} of {args.num_seqs} sequences ran at once ({preemptions} preemptions): "
                f"raise --kv-cache-memory (now {args.kv_cache_memory})"
            )

    # Prefill everything first: the timed steps are decode steps of the whole batch.
    started: set[str] = set()  # requests that have their first token
    while len(started) < args.num_seqs:
        started |= {out.request_id for out in engine.step() if out.outputs[0].token_ids}
        stats = engine.stats()
        most = max(most, stats.num_running)
        if stats.num_preemptions or engine.get_num_unfinished_requests() < args.num_seqs:
            break
    check_whole_batch()
    metrics = EngineMetrics()
    step_ms, snapshot_ms, encode_ms, size = [], [], [], 0
    for _ in range(args.steps):
        start = time.perf_counter()
        engine.step()
        stepped = time.perf_counter()
        payload = kv_payload(engine, metrics)
        snapped = time.perf_counter()
        size = len(JSONResponse(payload).body)
        encoded = time.perf_counter()
        step_ms.append(1e3 * (stepped - start))
        snapshot_ms.append(1e3 * (snapped - stepped))
        encode_ms.append(1e3 * (encoded - snapped))
    check_whole_batch()
    running = engine.stats().num_running
    for request_id in engine.unfinished_request_ids():
        engine.abort_request(request_id)
    assert engine.stats().kv_all_free, "KV blocks leaked"
    result = {
        "running": running,
        "num_blocks": payload["num_blocks"],
        "steps": args.steps,
        "step_ms": statistics.mean(step_ms),
        "snapshot_ms": statistics.mean(snapshot_ms),
        "encode_ms": statistics.mean(encode_ms),
        "snapshot_per_step": statistics.mean(snapshot_ms) / statistics.mean(step_ms),
        "json_bytes": size,
        "ran": info.describe(),
    }
    return result, payload


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm bench snapshot",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    flags.add_model(parser)
    parser.add_argument("--num-seqs", type=int, default=256, help="sequences running in every timed step")
    parser.add_argument("--input-len", default="16-64", help="LO-HI prompt tokens (uniform)")
    parser.add_argument("--steps", type=int, default=10, help="timed decode steps")
    flags.add_kv_cache_memory(parser, "2GiB")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-layout", default="paged", choices=["paged", "contiguous"])
    flags.add_seed(parser)
    flags.add_json(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.input_len = parse_range(args.input_len)
    except ValueError:
        parser.exit(2, f"pagedllm bench snapshot: error: --input-len must be LO-HI, got {args.input_len!r}\n")
    result, _ = measure(make_llm(args).engine, args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(
        f"{result['running']} sequences decoding, {args.kv_layout} KV of {args.kv_cache_memory} "
        f"({result['num_blocks']:,} blocks), model {args.model}; means over {args.steps} steps:"
    )
    print(f"engine step                    {result['step_ms']:9.2f} ms")
    print(
        f"snapshot (engine thread)       {result['snapshot_ms']:9.2f} ms = "
        f"{result['snapshot_per_step']:.2%} of a step"
    )
    print(
        f"JSON encoding (server thread)  {result['encode_ms']:9.2f} ms, {result['json_bytes']:,} bytes "
        "(the engine does not wait for it)"
    )
    print(f"ran: {result['ran']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
