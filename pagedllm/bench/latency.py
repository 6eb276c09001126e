"""`pagedllm bench latency`: one user chatting. One request at a time: the time to first token for
prompts of each `--prompt-lens` length, then `--output-len` greedy tokens (EOS ignored): decode tokens/s
(the tokens after the first over the time after the first) and the p50 / p99 inter-token latency. Each
token is stamped in the step it appears in: a prompt longer than the step's token budget
(`--max-num-batched-tokens`) is prefilled over several steps, all inside its time to first token.

pagedllm runs once per `--quantization` value (`auto`: a GGUF file's own blocks), on the same random
token prompts. Each peer runs in its own process with its own environment (bench/peers.py), named as
what it is. `--llama-cpp` adds llama-cpp-python (llama.cpp's library under its Python generate loop,
when importable; never a pagedllm dependency) on the same GGUF file: `--llama-cpp-types file F32` runs
the file as shipped and an F32 copy of it (the same weights as pagedllm's float32, made once with
llama_model_quantize and cached), with the same thread count and llama-bench's batch defaults;
`--llama-cpp-cache-types` and `--llama-cpp-flash-attn` pick its K/V type (f16 by default: pagedllm's
`--kv-cache-dtype float16`; pagedllm runs once per K/V dtype given too) and flash attention,
a run per combination. `--llama-bench PATH`
times llama.cpp itself with its C++ benchmark binary (bench/llama_bench.py): prompt processing (pp) per
prompt length and generation (tg) tokens/s. Printed: a row per system and prompt length and what ran
(pagedllm: attention backend, CPU build, linear method per weight type, threads; a peer: its process
and settings), then decode tokens/s and TTFT ratios of every pagedllm row against every llama-cpp-python
row, measured in this run. `same` counts the leading greedy tokens equal to the first pagedllm row's
for the same prompt. `--profile` adds, per pagedllm run, where a decode step after the first prompt goes
(bench/profile.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pagedllm.bench import flags, llama_bench, llama_cpp
from pagedllm.bench.peers import peer_env
from pagedllm.bench.profile import MachineRates, profile_decode, step_breakdown
from pagedllm.workload import first_difference, make_prompts


@dataclass
class Run:
    """One request: its prompt length, time to first token, and each later token's gap to the one before."""

    prompt_len: int
    ttft_s: float
    itl_s: list[float]
    tokens: list[int] = field(repr=False)

    @property
    def decode_tok_s(self) -> float:
        return len(self.itl_s) / sum(self.itl_s)

    def itl_percentile(self, q: int) -> float:
        return statistics.quantiles(self.itl_s, n=100, method="inclusive")[q - 1]


@dataclass
class System:
    name: str
    weight_mib: float
    runs: list[Run]
    ran: str = ""  # what ran: pagedllm's RunInfo.describe(), a peer's process and settings
    profile: list[str] = field(default_factory=list, repr=False)  # --profile: the decode step op by op


def timed_request(engine, request_id: str, prompt: list[int], params) -> Run:
    """One request alone on the engine: each token stamped in the step it appears in. A prompt longer
    than the step's token budget is prefilled over several steps that give no token: its time to first
    token covers them all, and its first gap is a decode step's."""
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    stamps: list[float] = []
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            new = out.outputs[0].token_ids
            stamps += [now] * (len(new) - len(tokens))
            tokens = list(new)
    return Run(len(prompt), stamps[0] - start, _gaps(stamps), tokens)


def run_pagedllm(
    args,
    quantization: str,
    kv_dtype: str,
    prompts: list[list[int]],
    warmup: list[int],
    rates: MachineRates | None,
) -> System:
    """pagedllm's runs of the prompts, one at a time; with `rates` (--profile), then decode steps after
    the first prompt, op by op."""
    from pagedllm import LLM, SamplingParams

    room = PROFILED_STEPS + 2 if rates is not None else 0  # profile_decode's steps after the prompt
    llm = LLM(
        args.model,
        dtype=args.dtype,
        quantization=quantization,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=kv_dtype,
        max_model_len=max(len(p) for p in [*prompts, warmup]) + args.output_len + room,
        max_num_seqs=1,
        **({"max_num_batched_tokens": args.max_num_batched_tokens} if args.max_num_batched_tokens else {}),
    )
    engine = llm.engine
    llm.generate([warmup], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    runs = [timed_request(engine, f"latency-{i}", prompt, params) for i, prompt in enumerate(prompts)]
    profile = []
    if rates is not None:
        ops = profile_decode(engine, prompts[:1], PROFILED_STEPS)
        itl = statistics.median(runs[0].itl_s)
        profile = step_breakdown(ops, rates, engine.config.torch_dtype, unprofiled_step_s=itl)
    assert engine.stats().kv_all_free, "KV blocks leaked"
    info = engine.run_info()
    name = f"pagedllm {info.linear_method}" + (f" {info.kv_dtype}" if len(args.kv_cache_dtype) > 1 else "")
    return System(name, info.weight_bytes / 2**20, runs, info.describe(), profile)


PROFILED_STEPS = 8  # --profile: decode steps profiled after the first prompt


def _gaps(stamps: list[float]) -> list[float]:
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


@dataclass(frozen=True)
class PeerSettings:
    """One llama-cpp-python configuration: the file's type, its K/V type, its flash attention."""

    gguf_type: str  # a --llama-cpp-types entry
    cache_type: str  # llama.cpp's name: f16, bf16, f32, q8_0
    flash_attn: bool


def peer_settings(args) -> list[PeerSettings]:
    """Every combination of the --llama-cpp-* lists that llama.cpp can run: a quantized V cache needs
    its flash attention."""
    return [
        PeerSettings(t, c, fa == "on")
        for t in args.llama_cpp_types
        for c in args.llama_cpp_cache_types
        for fa in args.llama_cpp_flash_attn
        if fa == "on" or not c.startswith("q")
    ]


def run_llama_cpp(
    args, gguf: Path, peer: PeerSettings, prompts: list[list[int]], warmup: list[int]
) -> System:
    """llama-cpp-python's generate loop on the file (or its copy in another type), in its own process."""
    path = llama_cpp.file_in_type(gguf, peer.gguf_type)
    job = {
        "model": str(path),
        "threads": torch.get_num_threads(),
        "n_ctx": max(len(p) for p in [*prompts, warmup]) + args.output_len,
        "prompts": prompts,
        "warmup": warmup,
        "output_len": args.output_len,
        "cache_type": peer.cache_type,
        "flash_attn": peer.flash_attn,
    }
    results, env = llama_cpp.generate(job)
    runs = []
    for prompt, result in zip(prompts, results, strict=True):
        stamps = result["token_times_s"]
        runs.append(Run(len(prompt), result["ttft_s"], _gaps(stamps), result["tokens"]))
    label = llama_cpp.main_type(gguf) if peer.gguf_type == "file" else peer.gguf_type
    if len(args.llama_cpp_cache_types) > 1:
        label += f" {peer.cache_type}"
    if len(args.llama_cpp_flash_attn) > 1:
        label += " fa" if peer.flash_attn else " no-fa"
    ran = (
        f"{job['threads']} threads, n_batch 2048, n_ubatch 512, K/V {peer.cache_type}, flash attention "
        f"{'on' if peer.flash_attn else 'off'}; {env.describe()}"
    )
    return System(f"{llama_cpp.LLAMA_CPP_PYTHON} {label}", path.stat().st_size / 2**20, runs, ran)


HEADER = (
    f"{'system':<22}{'weights MiB':>12}{'prompt':>8}{'TTFT ms':>10}{'decode tok/s':>14}"
    f"{'ITL p50 ms':>12}{'ITL p99 ms':>12}{'same':>6}"
)


def report(systems: list[System]) -> list[str]:
    lines = [HEADER]
    reference = systems[0].runs
    for system in systems:
        for run, ref in zip(system.runs, reference, strict=True):
            lines.append(
                f"{system.name:<22}{system.weight_mib:>12.1f}{run.prompt_len:>8}{run.ttft_s * 1e3:>10.1f}"
                f"{run.decode_tok_s:>14.1f}{run.itl_percentile(50) * 1e3:>12.2f}"
                f"{run.itl_percentile(99) * 1e3:>12.2f}{first_difference(run.tokens, ref.tokens):>6}"
            )
        lines.append(f"  ran: {system.ran}")
    ours = [s for s in systems if s.name.startswith("pagedllm")]
    peers = [s for s in systems if not s.name.startswith("pagedllm")]
    for a in ours:
        for b in peers:
            decode = ", ".join(
                f"{x.decode_tok_s / y.decode_tok_s:.2f}x ({x.prompt_len})"
                for x, y in zip(a.runs, b.runs, strict=True)
            )
            ttft = ", ".join(
                f"{y.ttft_s / x.ttft_s:.2f}x ({x.prompt_len})" for x, y in zip(a.runs, b.runs, strict=True)
            )
            lines.append(f"{a.name} / {b.name}: decode tok/s {decode}; TTFT speed-up {ttft}")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm bench latency",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    flags.add_model(parser)
    flags.add_quantization(parser, default=["none", "auto"], many=True)
    flags.add_dtype(parser, help="pagedllm's activations (auto: float32 on the CPU)")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[200, 1000, 4000])
    parser.add_argument("--output-len", type=int, default=128)
    flags.add_kv_cache_memory(parser, "512MiB")
    flags.add_kv_cache_dtype(
        parser,
        default=["auto"],
        many=True,
        help="pagedllm's K/V storage (auto: the engine's, float16 under float32 activations on the CPU)",
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="pagedllm's tokens per step (default: the engine's); a longer prompt is prefilled in chunks",
    )
    parser.add_argument(
        "--llama-cpp", action="store_true", help="also run llama-cpp-python's generate loop (child process)"
    )
    parser.add_argument(
        "--llama-cpp-types",
        nargs="+",
        default=["F32", "file"],
        help="GGUF types llama-cpp-python runs: 'file' = the model file as shipped, else a llama_ftype name "
        "(F32, F16, Q8_0, ...) converted from it once",
    )
    parser.add_argument(
        "--llama-cpp-cache-types",
        nargs="+",
        default=["f16"],
        choices=["f32", "f16", "bf16", "q8_0"],
        help="llama-cpp-python's K/V types (llama.cpp's --cache-type-k/-v names; f16 is its default, "
        "pagedllm's float16; q8_0 about the bytes of its int8), a run each",
    )
    parser.add_argument(
        "--llama-cpp-flash-attn",
        nargs="+",
        default=["off"],
        choices=["off", "on"],
        help="llama-cpp-python's flash attention, a run each (off: llama-cpp-python's default; llama.cpp's "
        "own tools resolve theirs to on for the CPU); a q8_0 cache runs only with on",
    )
    parser.add_argument(
        "--llama-bench",
        type=Path,
        metavar="PATH",
        default=None,
        help="also time llama.cpp itself: its llama-bench binary at PATH on the same GGUF file (pp per "
        "prompt length, tg of --output-len), in its own process",
    )
    flags.add_threads(parser, help="threads for every system (default: torch's)")
    flags.add_seed(parser)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print, for each pagedllm run, where a decode step after the first prompt goes: matmuls "
        "by weight type (time, bytes, GB/s), attention, the rest, against the read and GEMM rates",
    )
    flags.add_json(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.output_len < 3:
        parser.error(f"--output-len must be at least 3, got {args.output_len}")
    flags.apply_threads(args)
    from pagedllm.models.loader import read_config, resolve_checkpoint

    peers = peer_settings(args)
    if args.llama_cpp and not peers:
        parser.error("--llama-cpp-cache-types q8_0 needs --llama-cpp-flash-attn on (llama.cpp's rule)")
    gguf = llama_cpp.gguf_of(parser, args.model, "--llama-cpp") if args.llama_cpp else None
    if args.llama_bench is not None:
        gguf = llama_cpp.gguf_of(parser, args.model, "--llama-bench", python=False)
        if not args.llama_bench.is_file():
            parser.error(f"--llama-bench {args.llama_bench}: no such file")
    vocab = read_config(resolve_checkpoint(args.model)).vocab_size
    prompts = make_prompts(args.prompt_lens, vocab, args.seed)
    warmup = make_prompts([16], vocab, args.seed + 1)[0]
    rates = MachineRates.measure() if args.profile else None
    systems = [
        run_pagedllm(args, q, kv, prompts, warmup, rates)
        for q in args.quantization
        for kv in args.kv_cache_dtype
    ]
    if args.llama_cpp:
        systems += [run_llama_cpp(args, gguf, peer, prompts, warmup) for peer in peers]
    bench_env = peer_env()
    llama_bench_results = []
    if args.llama_bench is not None:
        threads = torch.get_num_threads()
        llama_bench_results = llama_bench.run(
            args.llama_bench, gguf, args.prompt_lens, args.output_len, threads, bench_env
        )
    if args.json:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        report_json = {"config": config, "systems": [asdict(s) for s in systems]}
        report_json["llama_bench"] = [asdict(r) for r in llama_bench_results]
        print(json.dumps(report_json, indent=2))
        return 0
    print(
        f"model {args.model}, one request at a time, random-token prompts of {args.prompt_lens} tokens, "
        f"{args.output_len} greedy output tokens each, {torch.get_num_threads()} threads"
    )
    for line in report(systems):
        print(line)
    if llama_bench_results:
        print("\n".join(llama_bench.report(llama_bench_results, bench_env)))
    for system in systems:
        if system.profile:
            print(f"profile ({system.name}, after the {args.prompt_lens[0]}-token prompt):")
            print("\n".join(system.profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
