"""`pagedllm bench tiers`: time to first token of a prompt asked again, from each prefix cache tier
against computing it again.

Per prompt length (random token ids), side by side in one process:
  recompute  an engine without tiers, its device cache about one prompt large, warmed by one short
             request, computes the prompt (nothing is written anywhere on the way);
  host       an engine with a host and a disk tier, warmed the same way, computes the prompt (its blocks
             are written through to disk: untimed), then a second prompt of that length, which evicts
             the first from the device cache into host memory, then is asked the first again;
  disk       a second engine started on the same folder (a restart: empty device cache, empty host
             memory), warmed the same way, is asked the first again: its blocks come from the files,
             checked, via host memory (the files were just written: the operating system's page cache
             holds them);
  cold       a third engine on the folder, after the same short request (its weights paged in) and with
             the files evicted from the page cache (a sync, then posix_fadvise DONTNEED on each): the same
             read from the disk itself.
A length beyond the model's context (less the 8 tokens generated) is cut to fit it.
Every run's greedy tokens are compared with the recompute run's (`same`). Each row also says what ran
(attention backend, CPU build, linear method per weight type, threads). The last columns are the engine's
own cost model (what it decides with: a tier's block is loaded only if that is faster than prefilling
its tokens), in seconds for the prompt's blocks, so the lines' crossing can be read off over lengths.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import torch

from pagedllm.bench import flags
from pagedllm.workload import make_prompts

OUTPUT_LEN = 8


def timed(engine, request_id: str, prompt: list[int], params) -> tuple[float, list[int]]:
    """Seconds from adding the request to its first token, and its tokens."""
    start = time.perf_counter()
    engine.add_request(request_id, prompt, params)
    ttft = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            if ttft is None and out.outputs[0].token_ids:
                ttft = time.perf_counter() - start
            if out.finished:
                tokens = out.outputs[0].token_ids
    return ttft, tokens


def evict_from_page_cache(folder: str) -> int:
    """Write the folder's files out and drop their pages from the page cache; returns how many."""
    os.sync()
    count = 0
    for sub in [entry.path for entry in os.scandir(folder) if entry.is_dir()]:  # a folder per fingerprint
        for entry in os.scandir(sub):
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
            count += 1
    return count


def run_length(args, length: int, prompts: list[list[int]], folder: str) -> dict:
    from pagedllm import LLM, SamplingParams

    params = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
    settings = dict(
        num_kv_blocks=(length + OUTPUT_LEN) // args.block_size + 2,  # one prompt and its decode
        block_size=args.block_size,
        max_model_len=length + OUTPUT_LEN + 1,
        kv_cache_dtype=args.kv_cache_dtype,
        kv_offload_memory=args.kv_offload_memory,
        kv_offload_dir=folder,
        max_num_seqs=1,
    )
    plain = LLM(args.model, **{**settings, "kv_offload_memory": None, "kv_offload_dir": None}).engine
    timed(plain, "warm-up", prompts[2], params)  # shorter than a block: nothing of it is cached
    recompute, want = timed(plain, "recompute", prompts[0], params)
    info = plain.run_info().describe()
    assert plain.stats().kv_all_free, "KV blocks leaked"
    del plain
    first = LLM(args.model, **settings)
    engine = first.engine
    timed(engine, "warm-up", prompts[2], params)
    timed(engine, "write", prompts[0], params)  # its blocks are written through to the tiers
    timed(engine, "evict", prompts[1], params)  # the first prompt's blocks move down to host memory
    host, host_tokens = timed(engine, "host", prompts[0], params)
    stats = engine.stats()  # its prefill estimate: the restarted engine computes one block only
    assert stats.kv_all_free, "KV blocks leaked"
    del first, engine
    restarted = LLM(args.model, **settings).engine
    timed(restarted, "warm-up", prompts[2], params)
    disk, disk_tokens = timed(restarted, "disk", prompts[0], params)
    costs = restarted.stats().kv_tiers
    assert restarted.stats().kv_all_free, "KV blocks leaked"
    del restarted
    again = LLM(args.model, **settings).engine
    timed(again, "warm-up", prompts[2], params)  # shorter than a block: nothing of it is cached
    evict_from_page_cache(folder)
    cold_disk, cold_tokens = timed(again, "cold", prompts[0], params)
    cold_costs = again.stats().kv_tiers
    assert again.stats().kv_all_free, "KV blocks leaked"
    blocks = (length - 1) // args.block_size
    return {
        "tokens": length,
        "recompute": recompute,
        "host": host,
        "disk": disk,
        "cold": cold_disk,
        "same": host_tokens == want and disk_tokens == want and cold_tokens == want,
        "host_hits": stats.kv_tiers.counters.host_hit_blocks,
        "disk_hits": costs.counters.disk_hit_blocks,
        "model_prefill": (stats.kv_tiers.prefill_seconds_per_token or 0.0) * length,
        "model_host": (stats.kv_tiers.host_load_seconds_per_block or 0.0) * blocks,
        "model_disk": (costs.disk_load_seconds_per_block or 0.0) * blocks,
        "model_cold": (cold_costs.disk_load_seconds_per_block or 0.0) * blocks,
        "ran": info,
    }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pagedllm bench tiers", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    flags.add_model(parser)
    parser.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 256, 512, 1024, 2048, 4096, 8192])
    parser.add_argument("--block-size", type=int, default=16)
    flags.add_kv_cache_dtype(parser)
    parser.add_argument("--kv-offload-memory", default="2GiB", help="the host tier")
    parser.add_argument("--dir", default=None, help="the disk tier's folder (default: a temporary one)")
    flags.add_threads(parser)
    flags.add_seed(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    flags.apply_threads(args)
    from pagedllm.models.loader import read_config, resolve_checkpoint

    config = read_config(resolve_checkpoint(args.model))
    vocab, longest = config.vocab_size, config.max_position_embeddings - OUTPUT_LEN - 1
    rows = []
    for i, length in enumerate(min(length, longest) for length in args.prompt_lens):
        folder = args.dir or tempfile.mkdtemp(prefix="pagedllm-tiers-")
        try:
            rows.append(
                run_length(args, length, make_prompts([length, length, 8], vocab, args.seed + i), folder)
            )
        finally:
            if args.dir is None:
                shutil.rmtree(folder, ignore_errors=True)
    print(
        f"model {args.model}, KV {args.kv_cache_dtype}, block {args.block_size}, one request at a time, "
        f"{torch.get_num_threads()} threads: time to first token (s) of a prompt asked again"
    )
    head = (
        f"{'tokens':>7}{'recompute':>11}{'host':>9}{'disk':>9}{'cold':>9}{'host x':>8}{'disk x':>8}"
        f"{'cold x':>8}{'same':>6}{'| model: prefill':>17}{'host':>9}{'disk':>9}{'cold':>9}"
    )
    print(head)
    for r in rows:
        print(
            f"{r['tokens']:>7}{r['recompute']:>11.3f}{r['host']:>9.3f}{r['disk']:>9.3f}{r['cold']:>9.3f}"
            f"{r['recompute'] / r['host']:>8.1f}{r['recompute'] / r['disk']:>8.1f}"
            f"{r['recompute'] / r['cold']:>8.1f}{str(r['same']):>6}"
            f"{r['model_prefill']:>17.3f}{r['model_host']:>9.4f}{r['model_disk']:>9.4f}{r['model_cold']:>9.4f}"
            f"  ({r['ran']})"
        )
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
