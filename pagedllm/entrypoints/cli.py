"""The `pagedllm` command: generate text, serve, run a benchmark, or draw the KV cache."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

BENCHMARKS = {
    "memory": "pagedllm.bench.memory",  # paged vs contiguous KV waste, no model needed
    "kernel": "pagedllm.bench.kernel",  # paged vs contiguous attention kernels
    "throughput": "pagedllm.bench.throughput",  # paged vs contiguous (vs HF) on a real model
    "chunked-prefill": "pagedllm.bench.chunked_prefill",  # decode stalls when a long prompt arrives
    "sharing": "pagedllm.bench.sharing",  # KV memory saved by sharing blocks (parallel sampling, beams)
    "snapshot": "pagedllm.bench.snapshot",  # what the dashboard's GET /v1/kv costs next to a step
}


def _generate(args: argparse.Namespace) -> int:
    from pagedllm import LLM, BeamSearchParams, SamplingParams

    if args.beam_width and args.chat:
        raise ValueError("--beam-width does not combine with --chat")
    llm = LLM(args.model, **_engine_kwargs(args))
    if args.beam_width:
        params = BeamSearchParams(args.beam_width, args.max_tokens, length_penalty=args.length_penalty)
        for prompt, output in zip(args.prompt, llm.beam_search(args.prompt, params), strict=True):
            if len(args.prompt) > 1:
                print(f"--- {prompt}")
            for i, beam in enumerate(output.sequences):
                print(f"[beam {i}, cumulative logprob {beam.cum_logprob:.3f}] {beam.text}")
        return 0
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
    )
    if args.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in args.prompt], params)
    else:
        outputs = llm.generate(args.prompt, params)
    for prompt, output in zip(args.prompt, outputs, strict=True):
        if len(outputs) > 1:
            print(f"--- {prompt}")
        print(output.outputs[0].text if args.chat else output.prompt + output.outputs[0].text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.server import main as serve

    return serve(
        args.model,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        **_engine_kwargs(args),
        **{name: getattr(args, name) for name in KV_ARGS},
    )


ENGINE_ARGS = (
    "dtype",
    "device",
    "kv_cache_memory",
    "kv_cache_dtype",
    "max_model_len",
    "max_num_batched_tokens",
    "enable_prefix_caching",
    "enable_chunked_prefill",
)


def _engine_kwargs(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in ENGINE_ARGS}


def _add_engine_args(parser: argparse.ArgumentParser, kv_cache_memory: str) -> None:
    """EngineConfig settings, spelled as vLLM's CLI spells them."""
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--kv-cache-memory", default=kv_cache_memory)
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16"],
        help="auto: the model's dtype",
    )
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="tokens per step (prefill chunk budget)"
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse the KV blocks of prompt prefixes seen before (default: on)",
    )
    parser.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="prefill long prompts in chunks alongside the running decodes (default: on)",
    )


KV_ARGS = ("block_size", "max_num_seqs", "kv_layout", "contiguous_reserve")


def _add_kv_args(parser: argparse.ArgumentParser) -> None:
    """The KV cache's shape and batch limit (EngineConfig names): what the dashboard helps to tune."""
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step at most")
    parser.add_argument("--kv-layout", default="paged", choices=["paged", "contiguous"])
    parser.add_argument("--contiguous-reserve", default="max", choices=["max", "pow2"], help="slab size")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="complete one or more prompts and print the text")
    gen.add_argument("prompt", nargs="+", help="prompt text (several prompts run as one batch)")
    gen.add_argument("--model", default="smollm2-135m", help="built-in name, HF folder or .gguf file")
    gen.add_argument("--chat", action="store_true", help="send each prompt as a user chat message")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--presence-penalty", type=float, default=0.0)
    gen.add_argument("--frequency-penalty", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--beam-width", type=int, default=0, help="beam search with this many beams (0: off)")
    gen.add_argument("--length-penalty", type=float, default=1.0, help="beam search length penalty")
    _add_engine_args(gen, kv_cache_memory="256MiB")
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    serve.add_argument("--model", default="smollm2-135m", help="built-in name, HF folder or .gguf file")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--served-model-name", default=None, help="the model name clients use (default: --model)"
    )
    _add_engine_args(serve, kv_cache_memory="1GiB")
    _add_kv_args(serve)
    serve.set_defaults(func=_serve)

    bench = sub.add_parser("bench", help="run a benchmark (options after the name go to it)")
    bench.add_argument("name", choices=sorted(BENCHMARKS))
    sub.add_parser("viz", help="draw the KV cache of a real run, paged vs contiguous (pagedllm viz --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagedllm").setLevel(logging.INFO)  # e.g. how many KV blocks fit
    parser = build_parser()
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in BENCHMARKS:
        return importlib.import_module(BENCHMARKS[argv[1]]).main(argv[2:])
    if argv[:1] == ["viz"]:
        return importlib.import_module("pagedllm.viz.report").main(argv[1:])
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, ImportError) as error:
        parser.exit(2, f"pagedllm: error: {error}\n")


if __name__ == "__main__":
    sys.exit(main())
