"""`pagedllm bench latency`: one user chatting. One request at a time: the time to first token for
prompts of each `--prompt-lens` length, then `--output-len` greedy tokens (EOS ignored): decode tokens/s
(the tokens after the first over the time after the first) and the p50 / p99 inter-token latency.

pagedllm runs once per `--quantization` value (`auto`: a GGUF file's own blocks), on the same random
token prompts. `--llama-cpp` adds llama.cpp (llama-cpp-python, when importable; never a pagedllm
dependency) on the same GGUF file: `--llama-cpp-types file F32` runs the file as shipped and an F32
copy of it (the same weights as pagedllm's float32, made once with llama_model_quantize and cached). llama.cpp
runs in a child process with libgomp's default wait policy (llama_cpp_peer.py says why), with the same
thread count, its llama-bench batch defaults and its float16 K/V cache (`--kv-cache-dtype bfloat16`
gives pagedllm's cache the same size). Printed: a row per system and prompt length, then
decode tokens/s and TTFT ratios of every pagedllm row against every llama.cpp row, measured in this run.
`same` counts the leading greedy tokens equal to the first pagedllm row's for the same prompt.
`--profile` adds, per pagedllm run, where a decode step after the first prompt goes (bench/profile.py).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from pagedllm.bench.profile import MachineRates, profile_decode, step_breakdown
from pagedllm.engine.config import KV_CACHE_DTYPES
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
    profile: list[str] = field(default_factory=list, repr=False)  # --profile: the decode step op by op


def run_pagedllm(
    args, quantization: str, prompts: list[list[int]], warmup: list[int], rates: MachineRates | None
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
        kv_cache_dtype=args.kv_cache_dtype,
        max_model_len=max(len(p) for p in [*prompts, warmup]) + args.output_len + room,
        max_num_seqs=1,
    )
    engine = llm.engine
    llm.generate([warmup], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    runs = []
    for i, prompt in enumerate(prompts):
        start = time.perf_counter()
        engine.add_request(f"latency-{i}", prompt, params)
        stamps, tokens = [], []
        while engine.has_unfinished_requests():
            outputs = engine.step()
            stamps.append(time.perf_counter())
            tokens = outputs[0].outputs[0].token_ids if outputs else tokens
        runs.append(Run(len(prompt), stamps[0] - start, _gaps(stamps), list(tokens)))
    profile = []
    if rates is not None:
        ops = profile_decode(engine, prompts[:1], PROFILED_STEPS)
        itl = statistics.median(runs[0].itl_s)
        profile = step_breakdown(ops, rates, engine.config.torch_dtype, unprofiled_step_s=itl)
    assert engine.stats().kv_all_free, "KV blocks leaked"
    name = f"pagedllm {engine.loaded_model.linear_method}"
    return System(name, engine.weight_bytes / 2**20, runs, profile)


PROFILED_STEPS = 8  # --profile: decode steps profiled after the first prompt


def _gaps(stamps: list[float]) -> list[float]:
    return [b - a for a, b in zip(stamps, stamps[1:], strict=False)]


PEER = Path(__file__).with_name("llama_cpp_peer.py")


def _peer(job: dict) -> object:
    """Run llama_cpp_peer.py on `job` in a child process with libgomp's default wait policy."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run(
        [sys.executable, str(PEER)], input=json.dumps(job), capture_output=True, text=True, env=env
    )
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp child failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout)


def llama_cpp_gguf(parser: argparse.ArgumentParser, model: str) -> Path:
    """The GGUF file a --llama-cpp run gives llama.cpp, or a parser error saying what is missing."""
    from pagedllm.models.loader import gguf_file

    if importlib.util.find_spec("llama_cpp") is None:
        parser.error("--llama-cpp needs llama-cpp-python (pip install llama-cpp-python; docs/BENCHMARKS.md)")
    gguf = gguf_file(model)
    if gguf is None:
        parser.error(f"--llama-cpp runs a GGUF file; model {model!r} is not one")
    return gguf


def llama_cpp_file(gguf: Path, gguf_type: str) -> Path:
    """The GGUF to run for a --llama-cpp-types entry: the file itself, or a copy in another type (made once,
    cached next to pagedllm's converted models)."""
    from pagedllm.models.gguf_loader import cache_root

    if gguf_type == "file":
        return gguf
    target = cache_root() / f"{gguf.stem}.{gguf_type}.gguf"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        _peer({"mode": "quantize", "source": str(gguf), "target": str(partial), "ftype": gguf_type})
        partial.rename(target)
    return target


def run_llama_cpp(args, gguf: Path, gguf_type: str, prompts: list[list[int]], warmup: list[int]) -> System:
    path = llama_cpp_file(gguf, gguf_type)
    job = {
        "mode": "generate",
        "model": str(path),
        "threads": torch.get_num_threads(),
        "n_ctx": max(len(p) for p in [*prompts, warmup]) + args.output_len,
        "prompts": prompts,
        "warmup": warmup,
        "output_len": args.output_len,
    }
    runs = []
    for prompt, result in zip(prompts, _peer(job), strict=True):
        stamps = result["token_times_s"]
        runs.append(Run(len(prompt), result["ttft_s"], _gaps(stamps), result["tokens"]))
    label = _gguf_type_name(gguf) if gguf_type == "file" else gguf_type
    return System(f"llama.cpp {label}", path.stat().st_size / 2**20, runs)


def _gguf_type_name(gguf: Path) -> str:
    """The file's main tensor type, e.g. Q4_1 (the most common type among its 2-D tensors)."""
    from collections import Counter

    from gguf import GGUFReader

    types = Counter(t.tensor_type.name for t in GGUFReader(gguf).tensors if len(t.shape) == 2)
    return types.most_common(1)[0][0]


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
    parser.add_argument("--model", default="smollm2-135m", help="built-in name, HF folder or .gguf file")
    parser.add_argument(
        "--quantization",
        nargs="+",
        default=["none", "auto"],
        choices=["auto", "none", "int8", "int4", "gguf"],
        help="pagedllm runs once per value (auto: a GGUF file's own blocks)",
    )
    parser.add_argument("--dtype", default="auto", help="pagedllm's activations (auto: float32 on the CPU)")
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[200, 1000, 4000])
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=["auto", *KV_CACHE_DTYPES],
        help="pagedllm's K/V storage (auto: the model's dtype); llama.cpp keeps its default, float16 K/V",
    )
    parser.add_argument("--llama-cpp", action="store_true", help="also run llama.cpp (llama-cpp-python)")
    parser.add_argument(
        "--llama-cpp-types",
        nargs="+",
        default=["F32", "file"],
        help="GGUF types llama.cpp runs: 'file' = the model file as shipped, else a llama_ftype name "
        "(F32, F16, Q8_0, ...) converted from it once",
    )
    parser.add_argument("--threads", type=int, default=None, help="threads for both (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print, for each pagedllm run, where a decode step after the first prompt goes: matmuls "
        "by weight type (time, bytes, GB/s), attention, the rest, against the read and GEMM rates",
    )
    parser.add_argument("--json", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.output_len < 3:
        parser.error(f"--output-len must be at least 3, got {args.output_len}")
    if args.threads:
        torch.set_num_threads(args.threads)
    from pagedllm.models.loader import read_config, resolve_checkpoint

    gguf = llama_cpp_gguf(parser, args.model) if args.llama_cpp else None
    vocab = read_config(resolve_checkpoint(args.model)).vocab_size
    prompts = make_prompts(args.prompt_lens, vocab, args.seed)
    warmup = make_prompts([16], vocab, args.seed + 1)[0]
    rates = MachineRates.measure() if args.profile else None
    systems = [run_pagedllm(args, q, prompts, warmup, rates) for q in args.quantization]
    if args.llama_cpp:
        systems += [run_llama_cpp(args, gguf, t, prompts, warmup) for t in args.llama_cpp_types]
    if args.json:
        print(json.dumps({"config": vars(args), "systems": [asdict(s) for s in systems]}, indent=2))
        return 0
    print(
        f"model {args.model}, one request at a time, random-token prompts of {args.prompt_lens} tokens, "
        f"{args.output_len} greedy output tokens each, {torch.get_num_threads()} threads"
    )
    for line in report(systems):
        print(line)
    for system in systems:
        if system.profile:
            print(f"profile ({system.name}, after the {args.prompt_lens[0]}-token prompt):")
            print("\n".join(system.profile))
    return 0


if __name__ == "__main__":
    sys.exit(main())
