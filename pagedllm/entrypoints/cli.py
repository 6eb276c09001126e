"""The `pagedllm` command: generate text, serve a model, run a benchmark, or draw the KV cache."""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import os
import sys

BENCHMARKS = {  # name: (module, what it measures)
    "memory": ("pagedllm.bench.memory", "KV slots holding live tokens, paged vs contiguous (no model)"),
    "kernel": ("pagedllm.bench.kernel", "paged decode attention vs in-order blocks vs dense SDPA"),
    "throughput": (
        "pagedllm.bench.throughput",
        "the engine offline: paged vs contiguous slabs (vs HF, vLLM)",
    ),
    "chunked-prefill": ("pagedllm.bench.chunked_prefill", "decode stalls when a long prompt arrives"),
    "sharing": ("pagedllm.bench.sharing", "KV memory saved by sharing blocks (parallel sampling, beams)"),
    "snapshot": ("pagedllm.bench.snapshot", "what the dashboard's GET /v1/kv costs next to an engine step"),
    "serve": ("pagedllm.bench.serve", "load generator and soak test for any OpenAI-compatible server"),
    "latency": ("pagedllm.bench.latency", "one user: time to first token, decode tok/s (vs llama.cpp)"),
    "speculative": (
        "pagedllm.bench.speculative",
        "one user editing code: decode tok/s with and without speculative decoding",
    ),
    "tiers": ("pagedllm.bench.tiers", "TTFT of a prompt asked again: host / disk prefix tiers vs recompute"),
    "quality": ("pagedllm.bench.quality", "perplexity and greedy agreement per weight storage"),
    "linear": ("pagedllm.bench.linear", "the matmul kernels and libraries on the model's shapes"),
    "lora": ("pagedllm.bench.lora", "requests over several LoRA adapters vs the base alone, vs llama-server"),
}


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default after its help, unless the help already says it (or there is none)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default in (None, False) or "default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _defaults(cls) -> dict:
    """A dataclass's field defaults: the CLI shows the same ones the Python API uses."""
    import dataclasses

    return {f.name: f.default for f in dataclasses.fields(cls)}


def _checked(make, **flags):
    """make(**flags), a bad value named as the user typed it (`max_tokens ...` -> `--max-tokens ...`)."""
    try:
        return make(**flags)
    except ValueError as error:
        name, _, rest = str(error).partition(" ")
        if name in flags:
            raise ValueError(f"--{name.replace('_', '-')} {rest}") from None
        raise


def _generate(args: argparse.Namespace) -> int:
    from pagedllm import BeamSearchParams, SamplingParams

    # Everything the user typed is checked before the model loads (seconds), and named as typed.
    for i, prompt in enumerate(args.prompt, 1):
        if not prompt.strip():
            where = f"prompt {i} " if len(args.prompt) > 1 else "the prompt "
            raise ValueError(f"{where}is empty (got {prompt!r})")
    if args.beam_width and args.chat:
        raise ValueError("--beam-width does not combine with --chat")
    if args.beam_width:
        params = _checked(
            BeamSearchParams,
            beam_width=args.beam_width,
            max_tokens=args.max_tokens,
            length_penalty=args.length_penalty,
        )
    else:
        params = _checked(
            SamplingParams,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repetition_penalty,
        )
    from pagedllm import LLM

    # One-shot: the cache's pages are committed as its few used blocks are written, not all at start-up.
    llm = LLM(args.model, **_engine_kwargs(args), prefault_kv_cache=False)
    if args.beam_width:
        for prompt, output in zip(args.prompt, llm.beam_search(args.prompt, params), strict=True):
            if len(args.prompt) > 1:
                print(f"--- {prompt}")
            for i, beam in enumerate(output.sequences):
                print(f"[beam {i}, cumulative logprob {beam.cum_logprob:.3f}] {beam.text}")
        return 0
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
    from pagedllm.entrypoints.openai.limits import ServerLimits

    limits = ServerLimits(
        api_key=args.api_key,
        max_request_body_bytes=args.max_request_body_bytes,
        max_concurrent_requests=args.max_concurrent_requests,
        max_n=args.max_n,
        max_logprobs=args.max_logprobs,
    )
    lora = _lora_kwargs(args)
    if args.data_parallel_size is None:
        from pagedllm.entrypoints.openai.server import main as serve
    else:  # every replica serves --lora-modules; adapters are not loaded at run time through the ingress
        serve = _replicas_main(args)
    return serve(
        args.model,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        limits=limits,
        shutdown_timeout=args.shutdown_timeout,
        generation_config=args.generation_config,
        reasoning_parser=args.reasoning_parser,
        **_engine_kwargs(args),
        **{name: getattr(args, name) for name in KV_ARGS},
        **lora,
    )


def _lora_kwargs(args: argparse.Namespace) -> dict:
    """--enable-lora and its settings as build_serving's keywords ({} without it); --lora-modules'
    name=path pairs as a dict."""
    if not args.enable_lora:
        if args.lora_modules:
            raise SystemExit("--lora-modules needs --enable-lora")
        return {}
    modules = {}
    for item in args.lora_modules or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora-modules takes name=path pairs, got {item!r}")
        modules[name] = path
    settings = ("max_loras", "max_lora_rank", "max_cpu_loras")
    return {"enable_lora": True, "lora_modules": modules, **{name: getattr(args, name) for name in settings}}


def _add_lora_args(parser: argparse.ArgumentParser, defaults: dict) -> None:
    """LoRA adapters served beside the model, as vLLM's flags spell them."""
    group = parser.add_argument_group("LoRA adapters")
    group.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT folders)")
    group.add_argument(
        "--lora-modules",
        nargs="+",
        default=None,
        metavar="NAME=PATH",
        help="adapters a request's model names",
    )
    group.add_argument(
        "--max-loras", type=int, default=defaults["max_loras"], help="adapters one step runs at most"
    )
    group.add_argument(
        "--max-lora-rank", type=int, default=defaults["max_lora_rank"], help="largest adapter rank served"
    )
    group.add_argument(
        "--max-cpu-loras", type=int, default=None, help="adapters kept in memory (default: --max-loras)"
    )


def _replicas_main(args: argparse.Namespace):
    """`pagedllm serve --data-parallel-size N`: replicas.main with its settings bound (Ray is optional)."""
    try:
        from pagedllm.entrypoints.openai import replicas
    except ImportError as error:
        raise ImportError(
            f"--data-parallel-size needs Ray Serve: pip install 'pagedllm[replicas]' ({error})"
        ) from error
    if args.tensor_parallel_size != 1:
        raise ValueError(
            "--data-parallel-size runs one engine process a replica: --tensor-parallel-size must be 1"
        )
    n = args.data_parallel_size
    from pagedllm._runtime import usable_cpus

    cpus = args.cpus_per_replica or max(1, usable_cpus() // n)
    settings = replicas.ReplicaSettings(
        n, cpus, args.routing, args.routing_imbalanced_threshold, args.routing_load_tokens
    )
    return functools.partial(replicas.main, settings=settings, address=args.address)


PARALLEL_ARGS = ("tensor_parallel_size", "distributed_init_method", "nnodes", "distributed_timeout")


ENGINE_ARGS = (
    "dtype",
    "device",
    "kv_cache_memory",
    "kv_cache_dtype",
    "max_model_len",
    "max_num_batched_tokens",
    "enable_prefix_caching",
    "enable_chunked_prefill",
    "disable_hybrid_kv_cache_manager",
    "quantization",
    "memory_budget",
    "speculative_config",
    "kv_offload_memory",
    "kv_offload_dir",
    "kv_offload_disk",
    *PARALLEL_ARGS,
)


def _engine_kwargs(args: argparse.Namespace) -> dict:
    kwargs = {name: getattr(args, name) for name in ENGINE_ARGS}
    from pagedllm.bench.flags import json_object

    kwargs["speculative_config"] = json_object("--speculative-config", args.speculative_config)
    return kwargs


def _add_engine_args(parser: argparse.ArgumentParser, defaults: dict) -> None:
    """EngineConfig settings, spelled as vLLM's CLI spells them, with EngineConfig's defaults."""
    from pagedllm.engine.config import KV_CACHE_DTYPES
    from pagedllm.models import DEFAULT_MODEL

    parser.add_argument("--model", default=DEFAULT_MODEL, help="built-in name, HF folder or .gguf file")
    parser.add_argument(
        "--dtype", default=defaults["dtype"], help="auto (float32 on CPU), float32, bfloat16 or float16"
    )
    parser.add_argument("--device", default=defaults["device"], help="cpu or cuda")
    parser.add_argument(
        "--kv-cache-memory", default=defaults["kv_cache_memory"], help="KV cache size, e.g. 512MiB"
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default=defaults["kv_cache_dtype"],
        choices=["auto", *KV_CACHE_DTYPES],
        help="K/V storage; auto: float16 under float32 activations on the CPU (llama.cpp's default cache, "
        "half float32's bytes), else the activations' dtype; float32: the exact cache; bfloat16: half its "
        "bytes; int8 / fp8 (= fp8_e4m3): codes with a float32 scale per token and KV head, 4x the tokens of "
        "float32 in the same memory",
    )
    parser.add_argument(
        "--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=defaults["max_num_batched_tokens"],
        help="tokens per step (prefill chunk budget; serve's default on the CPU: 256 a CPU, 512 to 2048)",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=defaults["enable_prefix_caching"],
        help="reuse the KV blocks of prompt prefixes seen before",
    )
    parser.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=defaults["enable_chunked_prefill"],
        help="prefill long prompts in chunks alongside the running decodes",
    )
    parser.add_argument(
        "--disable-hybrid-kv-cache-manager",
        action="store_true",
        help="keep every layer's K/V for every token (by default a sliding-window layer's blocks go back "
        "to the pool once they leave its window: Gemma 3's 15 local layers of 18)",
    )
    parser.add_argument(
        "--quantization",
        default=defaults["quantization"],
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
    parser.add_argument(
        "--speculative-config",
        default=None,
        help='speculative decoding, as JSON (vLLM\'s): \'{"method": "ngram", "num_speculative_tokens": 4, '
        '"prompt_lookup_max": 4}\'',
    )
    _add_offload_args(parser, defaults)
    _add_parallel_args(parser, defaults)


def _add_offload_args(parser: argparse.ArgumentParser, defaults: dict) -> None:
    """The prefix cache's tiers below the device cache (host memory, disk)."""
    parser.add_argument(
        "--kv-offload-memory",
        default=None,
        help="host memory for prefix blocks the KV cache evicts, e.g. 4GiB (beside --kv-cache-memory; "
        "swap preemption shares it); loaded back on a prefix hit",
    )
    parser.add_argument(
        "--kv-offload-dir",
        default=None,
        help="folder for a disk tier: every cached prefix block is also written there (checksummed), and "
        "found again after a restart on the same model files and settings",
    )
    parser.add_argument(
        "--kv-offload-disk",
        default=defaults["kv_offload_disk"],
        help="most bytes the disk tier's files take, e.g. 20GiB (least recently used go first)",
    )


KV_ARGS = ("block_size", "max_num_seqs", "kv_layout", "contiguous_reserve")


def _add_kv_args(parser: argparse.ArgumentParser, defaults: dict) -> None:
    """The KV cache's shape and batch limit (EngineConfig names): what the dashboard helps to tune."""
    parser.add_argument(
        "--block-size",
        type=int,
        default=defaults["block_size"],
        help="tokens per KV block (default: the KV cache dtype's: 16 float32, 32 bfloat16, 64 int8 / fp8)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=defaults["max_num_seqs"], help="sequences per step at most"
    )
    parser.add_argument("--kv-layout", default=defaults["kv_layout"], choices=["paged", "contiguous"])
    parser.add_argument(
        "--contiguous-reserve",
        default=defaults["contiguous_reserve"],
        choices=["max", "pow2"],
        help="slab size",
    )


def _add_server_args(parser: argparse.ArgumentParser, limits: dict) -> None:
    """What a server left running needs: sampling defaults, an API key, limits, a graceful shutdown."""
    from pagedllm.entrypoints.openai.reasoning import PARSERS

    parser.add_argument(
        "--generation-config",
        default="auto",
        help="sampling fields a request leaves unset: auto (the model's generation_config.json), "
        "vllm (vLLM's own), or a folder holding one (default: auto)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default=None,
        choices=PARSERS,
        help="split a reasoning model's <think> block off as reasoning_content (vLLM's; default: none)",
    )
    parser.add_argument(
        "--api-key",
        default=None,
        help="require `Authorization: Bearer KEY` on /v1/* (default: $PAGEDLLM_API_KEY, else none)",
    )
    parser.add_argument(
        "--max-request-body-bytes", type=int, default=limits["max_request_body_bytes"], help="larger get 413"
    )
    parser.add_argument(
        "--max-concurrent-requests",
        type=int,
        default=limits["max_concurrent_requests"],
        help="/v1 requests in flight at once; more get 429",
    )
    parser.add_argument("--max-n", type=int, default=limits["max_n"], help="completions per prompt at most")
    parser.add_argument(
        "--max-logprobs", type=int, default=limits["max_logprobs"], help="logprobs / top_logprobs at most"
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT: seconds running requests may take to finish before they are aborted",
    )


def _add_replica_args(parser: argparse.ArgumentParser) -> None:
    """Engine replicas on Ray Serve behind one endpoint (pip install 'pagedllm[replicas]')."""
    group = parser.add_argument_group("replicas (Ray Serve)")
    group.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=None,
        help="engine replicas behind this one endpoint, as Ray Serve deployments (default: one engine)",
    )
    group.add_argument(
        "--address",
        default=None,
        help="a running Ray cluster to join (`ray start --head`; default: start one)",
    )
    group.add_argument(
        "--cpus-per-replica", type=int, default=None, help="CPUs Ray gives each replica (default: usable / N)"
    )
    group.add_argument(
        "--routing",
        choices=["kv", "prefix", "pow2", "round-robin"],
        default="kv",
        help="request routing: by the replicas' KV cache events, Ray's PrefixCacheAffinityRouter, Serve's "
        "power of two choices, or round robin",
    )
    group.add_argument(
        "--routing-imbalanced-threshold",
        type=float,
        default=4,
        help="prefix routing: a gap in queue lengths above this routes by load instead of prefix",
    )
    group.add_argument(
        "--routing-load-tokens",
        type=float,
        default=64,
        help="kv routing: uncached prompt tokens that one more request in flight on a replica is worth",
    )


def _add_parallel_args(parser: argparse.ArgumentParser, defaults: dict) -> None:
    """Tensor parallelism over processes and machines (the same command on every machine, but --node-rank)."""
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=defaults["tensor_parallel_size"],
        help="ranks the model is split over",
    )
    parser.add_argument(
        "--distributed-init-method",
        default=defaults["distributed_init_method"],
        help="tcp://HOST:PORT of node 0 (several machines)",
    )
    parser.add_argument("--nnodes", type=int, default=defaults["nnodes"], help="machines the ranks run on")
    parser.add_argument(
        "--node-rank", type=int, default=0, help="this machine's index; > 0 runs its ranks as workers only"
    )
    parser.add_argument(
        "--distributed-timeout",
        type=float,
        default=defaults["distributed_timeout"],
        help="seconds rank 0 waits for a rank in a step",
    )


def _worker_node(args: argparse.Namespace) -> int | None:
    """Run this process's ranks as workers if it is not where rank 0 runs (None: it is)."""
    from pagedllm.engine.parallel import worker

    if "TORCHELASTIC_RUN_ID" in os.environ and int(os.environ["RANK"]) > 0:  # started by torchrun
        return worker.run_torchrun_rank()
    if args.node_rank == 0:
        return None
    if not 0 < args.node_rank < args.nnodes or args.distributed_init_method is None:
        raise ValueError(
            f"--node-rank {args.node_rank} needs --nnodes > {args.node_rank} and --distributed-init-method"
        )
    return worker.run_node(
        args.distributed_init_method, args.tensor_parallel_size, args.nnodes, args.node_rank
    )


def build_parser() -> argparse.ArgumentParser:
    from pagedllm.engine.config import EngineConfig
    from pagedllm.entrypoints.openai.limits import ServerLimits

    defaults = _defaults(EngineConfig)  # the CLI's engine defaults are EngineConfig's, as in the README
    parser = argparse.ArgumentParser(prog="pagedllm", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser(
        "generate", help="complete one or more prompts and print the text", formatter_class=_HelpFormatter
    )
    gen.add_argument("prompt", nargs="+", help="prompt text (several prompts run as one batch)")
    gen.add_argument("--chat", action="store_true", help="send each prompt as a user chat message")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--seed", type=int, default=None, help="sampling seed")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's presence penalty")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's frequency penalty")
    gen.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="Hugging Face's repetition penalty"
    )
    gen.add_argument("--beam-width", type=int, default=0, help="beam search with this many beams (0: off)")
    gen.add_argument("--length-penalty", type=float, default=1.0, help="beam search length penalty")
    _add_engine_args(gen, defaults)
    gen.set_defaults(func=_generate)

    serve = sub.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API", formatter_class=_HelpFormatter
    )
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    serve.add_argument("--port", type=int, default=8000, help="TCP port")
    serve.add_argument(
        "--served-model-name", default=None, help="the model name clients use (default: --model)"
    )
    _add_engine_args(serve, {**defaults, "max_num_batched_tokens": None})  # the server's own default
    _add_kv_args(serve, defaults)
    _add_server_args(serve, _defaults(ServerLimits))
    _add_lora_args(serve, defaults)
    _add_replica_args(serve)
    serve.set_defaults(func=_serve)

    lines = "\n".join(f"  {name:<16} {line}" for name, (_, line) in BENCHMARKS.items())
    bench = sub.add_parser(
        "bench",
        help=f"run a benchmark: {', '.join(BENCHMARKS)} (options after the name go to it)",
        description=f"benchmarks (`pagedllm bench NAME --help` for each one's options):\n{lines}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench.add_argument("name", choices=list(BENCHMARKS), help="which benchmark")
    sub.add_parser("viz", help="draw the KV cache of a real run, paged vs contiguous (pagedllm viz --help)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("pagedllm").setLevel(logging.INFO)  # e.g. how many KV blocks fit
    parser = build_parser()
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in BENCHMARKS:
        return importlib.import_module(BENCHMARKS[argv[1]][0]).main(argv[2:])
    if argv[:1] == ["viz"]:
        return importlib.import_module("pagedllm.viz.report").main(argv[1:])
    args = parser.parse_args(argv)
    try:
        if hasattr(args, "node_rank") and (code := _worker_node(args)) is not None:
            return code
        return args.func(args)
    except (ValueError, FileNotFoundError, ImportError) as error:
        parser.exit(2, f"pagedllm: error: {error}\n")


if __name__ == "__main__":
    sys.exit(main())
