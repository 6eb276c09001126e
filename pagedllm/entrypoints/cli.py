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
    "snapshot": "pagedllm.bench.snapshot",  # what the dashboard's GET /v1/kv costs next to a step
    "latency": "pagedllm.bench.latency",  # one user: time to first token, decode tok/s (vs llama.cpp)
    "quality": "pagedllm.bench.quality",  # perplexity and greedy agreement per weight storage
    "linear": "pagedllm.bench.linear",  # the matmul kernels and libraries on the model's shapes
}


def _generate(args: argparse.Namespace) -> int:
    from pagedllm import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        **{name: getattr(args, name) for name in WEIGHT_ARGS},
    )
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed
    )
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": p} for p in args.prompt], params)
    else:
        outputs = llm.generate(args.prompt, params)
    for output in outputs:
        if len(outputs) > 1:
            print(f"--- {output.prompt if output.prompt is not None else '(chat)'}")
        print(output.outputs[0].text if args.chat else output.prompt + output.outputs[0].text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from pagedllm.entrypoints.openai.server import main as serve

    return serve(
        args.model,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        device=args.device,
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        **{name: getattr(args, name) for name in KV_ARGS + WEIGHT_ARGS},
    )


WEIGHT_ARGS = ("quantization", "memory_budget")


def add_weight_args(parser: argparse.ArgumentParser) -> None:
    """How the weights are stored, and a memory budget they share with the KV cache (EngineConfig names)."""
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=["auto", "none", "int8", "int4", "gguf"],
        help="weight storage: auto keeps a GGUF file's own quantized blocks (gguf), else none; int8 / int4 "
        "quantize at load time (weight-only)",
    )
    parser.add_argument(
        "--memory-budget",
        default=None,
        help="weights + KV cache, e.g. 1GiB: the KV cache gets what the weights leave (overrides "
        "--kv-cache-memory)",
    )


KV_ARGS = ("block_size", "max_num_seqs", "kv_layout", "contiguous_reserve", "enable_prefix_caching")


def _add_kv_args(parser: argparse.ArgumentParser) -> None:
    """The KV cache's shape and batch limit (EngineConfig names): what the dashboard helps to tune."""
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="sequences per step at most")
    parser.add_argument("--kv-layout", default="paged", choices=["paged", "contiguous"])
    parser.add_argument("--contiguous-reserve", default="max", choices=["max", "pow2"], help="slab size")
    parser.add_argument("--enable-prefix-caching", action="store_true", help="reuse cached prompt blocks")


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
    gen.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    gen.add_argument("--device", default="cpu")
    gen.add_argument("--kv-cache-memory", default="256MiB")
    gen.add_argument("--max-model-len", type=int, default=None)
    add_weight_args(gen)
    gen.set_defaults(func=_generate)

    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    serve.add_argument("--model", default="smollm2-135m", help="built-in name, HF folder or .gguf file")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--served-model-name", default=None, help="the model name clients use (default: --model)"
    )
    serve.add_argument("--dtype", default="auto", help="auto, float32, bfloat16 or float16")
    serve.add_argument("--device", default="cpu")
    serve.add_argument("--kv-cache-memory", default="1GiB")
    serve.add_argument("--max-model-len", type=int, default=None)
    _add_kv_args(serve)
    add_weight_args(serve)
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
