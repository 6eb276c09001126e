"""`pagedllm bench kernel`: paged decode attention vs contiguous attention on the same data.

Each case builds one batch of sequences (random context lengths) and times, in interleaved repetitions,
after checking that all three agree:
  paged       the backend reading K/V through block tables whose blocks are scattered at random
  in-order    the same backend on the same values laid out contiguously: each sequence's blocks
              consecutive and in order, so paged / in-order is the cost of paging itself
  contiguous  a dense baseline: per-sequence scaled_dot_product_attention over K/V stored as
              [Hkv, C, D] (GQA group folded into the query dim) on CPU; one padded, masked SDPA call
              over the whole batch on CUDA (a per-sequence loop there would time kernel launches)
It reports the medians, the ratios paged / in-order and paged / contiguous, and the rate at which the
paged kernel reads K/V (bytes of every sequence's K and V per second) against two read rates the same
process measures on this machine, same threads: a `sum` over a 512 MiB tensor (memory read in order)
and torch's `embedding_bag` summing the same cache blocks in the same block-table order (what memory
delivers for paged attention's access pattern, timed round-robin with the kernels). On the CPU the
caches lie in memory as the engine allocates them (head-major, huge pages: ops/kv_cache.py).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from pagedllm.ops import BACKENDS, get_backend_name
from pagedllm.ops.synthetic import PagedBatch, random_paged_batch

SHAPES = {  # name: (num_heads, num_kv_heads, head_dim)
    "issue": (12, 4, 64),
    "smollm2": (9, 3, 64),
    "gemma3": (4, 1, 256),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class Row:
    shape: str
    backend: str
    dtype: str
    num_seqs: int
    tokens: int
    paged_ms: float
    in_order_ms: float  # the same backend, each sequence's blocks consecutive in memory
    contiguous_ms: float
    paging_ratio: float  # paged / in-order: the cost of scattered blocks alone
    ratio: float  # paged / contiguous baseline
    kv_gb_s: float  # K/V bytes of all sequences / paged time
    read_gb_s: float  # this machine's read bandwidth, measured in the same process
    bandwidth_fraction: float  # kv_gb_s / read_gb_s
    block_read_gb_s: float  # the same scattered blocks summed by embedding_bag, in table order
    block_read_fraction: float  # kv_gb_s / block_read_gb_s
    contiguous_impl: str
    threads: int
    device: str


def _backend_module(name: str):
    import importlib

    return importlib.import_module(f"pagedllm.ops.{BACKENDS[name]}")


def per_sequence_attention(batch: PagedBatch, scale: float) -> Callable[[], torch.Tensor]:
    """Dense decode attention, one SDPA call per sequence over its K/V stored as [Hkv, C, D]."""
    q = batch.q
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = batch.keys[0].shape[1]
    keys = [k.transpose(0, 1).contiguous() for k in batch.keys]
    values = [v.transpose(0, 1).contiguous() for v in batch.values]

    def run() -> torch.Tensor:
        out = torch.empty_like(q)
        for s in range(num_seqs):
            rows = q[s].view(num_kv_heads, num_heads // num_kv_heads, head_dim)  # GQA group as query rows
            out[s] = F.scaled_dot_product_attention(rows, keys[s], values[s], scale=scale).flatten(0, 1)
        return out

    return run


def padded_batch_attention(batch: PagedBatch, scale: float) -> Callable[[], torch.Tensor]:
    """Dense decode attention, one masked SDPA call over K/V padded to [S, Hkv, max_context, D]."""
    q = batch.q
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = batch.keys[0].shape[1]
    max_len = max(k.shape[0] for k in batch.keys)
    k_pad = q.new_zeros(num_seqs, num_kv_heads, max_len, head_dim)
    v_pad = q.new_zeros(num_seqs, num_kv_heads, max_len, head_dim)
    for s, (k, v) in enumerate(zip(batch.keys, batch.values, strict=True)):
        k_pad[s, :, : k.shape[0]] = k.transpose(0, 1)
        v_pad[s, :, : v.shape[0]] = v.transpose(0, 1)
    mask = torch.arange(max_len, device=q.device)[None, :] < batch.context_lens.long()[:, None]
    rows = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    mask = mask[:, None, None, :]
    return lambda: F.scaled_dot_product_attention(rows, k_pad, v_pad, attn_mask=mask, scale=scale).view_as(q)


def block_read(batch: PagedBatch) -> tuple[Callable[[], torch.Tensor], int]:
    """A pure read of the batch's K/V blocks in block-table order (torch's embedding_bag summing each
    sequence's blocks), and the bytes it reads: the access pattern of paged attention without its math."""
    rows = []  # per cache one row per block: a view in its memory order, slot-major or head-major
    for cache in (batch.k_cache, batch.v_cache):
        memory_order = cache if cache.is_contiguous() else cache.transpose(1, 2)
        assert memory_order.is_contiguous(), "expected a slot-major or head-major cache"
        rows.append(memory_order.flatten(1))
    block_size = batch.k_cache.shape[1]
    counts = [-(-int(n) // block_size) for n in batch.context_lens.tolist()]
    ids = torch.cat([batch.block_tables[s, :n] for s, n in enumerate(counts)]).long()
    offsets = torch.tensor([0, *counts[:-1]], device=ids.device).cumsum(0)
    ids, offsets = ids.to(batch.q.device), offsets.to(batch.q.device)

    def run() -> torch.Tensor:
        return sum(F.embedding_bag(ids, r, offsets, mode="sum").sum() for r in rows)

    return run, 2 * ids.numel() * rows[0].shape[1] * rows[0].element_size()


def _timed(fn: Callable[[], torch.Tensor], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3


def median_ms(
    variants: dict[str, Callable[[], torch.Tensor]], reps: int, warmup: int, device: torch.device
) -> dict[str, float]:
    """Median milliseconds of each variant, timed round-robin so all see the same machine load."""
    for _ in range(warmup):
        for fn in variants.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(reps):
        for name, fn in variants.items():
            times[name].append(_timed(fn, device))
    return {name: statistics.median(t) for name, t in times.items()}


def run_case(shape: str, backend: str, dtype: str, context_lens: list[int], args: argparse.Namespace) -> Row:
    num_heads, num_kv_heads, head_dim = SHAPES[shape]
    device = torch.device(args.device)
    sizes = (num_heads, num_kv_heads, head_dim, args.block_size, DTYPES[dtype], device)
    paged, in_order = (
        random_paged_batch(
            context_lens, [1] * len(context_lens), *sizes, seed=args.seed, scattered=scattered,
            head_major=device.type == "cpu",
        )
        for scattered in (True, False)
    )  # the same values; only where the blocks lie differs  # fmt: skip
    scale = 1.0 / math.sqrt(head_dim)
    ops = _backend_module(backend)

    def through_tables(b: PagedBatch) -> Callable[[], torch.Tensor]:
        inputs = (b.q, b.k_cache, b.v_cache, b.block_tables, b.context_lens, scale)
        return lambda: ops.paged_decode_attention(*inputs)

    dense = padded_batch_attention if device.type == "cuda" else per_sequence_attention
    variants = {
        "paged": through_tables(paged),
        "in_order": through_tables(in_order),
        "contiguous": dense(paged, scale),
    }
    read_blocks, block_bytes = block_read(paged)
    tol = 2e-2 if dtype == "bf16" else 1e-4
    expected = variants["contiguous"]().float()
    for name in ("paged", "in_order"):
        torch.testing.assert_close(variants[name]().float(), expected, atol=tol, rtol=tol)
    ms = median_ms({**variants, "block_read": read_blocks}, args.reps, args.warmup, device)
    block_read_gb_s = block_bytes / ms["block_read"] / 1e6
    kv_bytes = 2 * sum(context_lens) * num_kv_heads * head_dim * paged.k_cache.element_size()
    kv_gb_s = kv_bytes / ms["paged"] / 1e6
    return Row(
        shape=shape,
        backend=backend,
        dtype=dtype,
        num_seqs=len(context_lens),
        tokens=sum(context_lens),
        paged_ms=round(ms["paged"], 4),
        in_order_ms=round(ms["in_order"], 4),
        contiguous_ms=round(ms["contiguous"], 4),
        paging_ratio=round(ms["paged"] / ms["in_order"], 3),
        ratio=round(ms["paged"] / ms["contiguous"], 3),
        kv_gb_s=round(kv_gb_s, 4),
        read_gb_s=round(args.read_gb_s, 2),
        bandwidth_fraction=round(kv_gb_s / args.read_gb_s, 5),
        block_read_gb_s=round(block_read_gb_s, 4),
        block_read_fraction=round(kv_gb_s / block_read_gb_s, 5),
        contiguous_impl="padded-batch-sdpa" if device.type == "cuda" else "per-sequence-sdpa",
        threads=torch.get_num_threads(),
        device=device.type,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagedllm bench kernel", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backends", nargs="+", choices=sorted(BACKENDS), help="default: the device's")
    p.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32", "bf16"])
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["issue", "gemma3"])
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--min-context", type=int, default=64)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="one JSON object per case instead of a table")
    args = p.parse_args(argv)
    if not 1 <= args.min_context <= args.max_context:
        p.error(f"need 1 <= --min-context <= --max-context, got {args.min_context}, {args.max_context}")
    if args.backends is None:
        if args.device == "cuda":
            args.backends = ["triton", "sdpa", "torch"]
        else:
            args.backends = ["cpu", "sdpa", "torch"]
    return args


def read_bandwidth_gb_s(device: torch.device, reps: int = 5) -> float:
    """GB/s of a sum over a 512 MiB float32 tensor (best of reps): what reading memory costs here."""
    x = torch.ones(128 * 2**20, device=device)
    best = min(_timed(x.sum, device) for _ in range(reps))
    return x.numel() * x.element_size() / best / 1e6


def iter_rows(args: argparse.Namespace) -> Iterator[Row]:
    """Run every (shape, backend, dtype) case on one set of context lengths."""
    rng = random.Random(args.seed)
    context_lens = [rng.randint(args.min_context, args.max_context) for _ in range(args.num_seqs)]
    if "cpu" in args.backends and get_backend_name("cpu") != "cpu":
        raise RuntimeError("the cpu backend is unavailable here (see the warning above)")
    args.read_gb_s = read_bandwidth_gb_s(torch.device(args.device))
    for shape in args.shapes:
        for backend in args.backends:
            for dtype in args.dtypes:
                yield run_case(shape, backend, dtype, context_lens, args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if not args.json:
        print(
            "paged decode (blocks scattered) vs the same backend on in-order blocks vs dense SDPA: "
            f"{args.num_seqs} seqs, context {args.min_context}-{args.max_context}, block {args.block_size}, "
            f"{torch.get_num_threads()} threads, {args.device}, median of {args.reps} interleaved reps"
        )
        print(
            f"{'shape':8} {'backend':8} {'dtype':5} {'paged ms':>9} {'in-order ms':>11} {'contig ms':>9} "
            f"{'paged/in-order':>14} {'paged/contig':>12} {'K/V GB/s':>9} {'of read bw':>10} "
            f"{'block read GB/s':>15} {'of block read':>13}"
        )
    for row in iter_rows(args):
        if args.json:
            print(json.dumps(asdict(row)), flush=True)
        else:
            cells = f"{row.paged_ms:9.3f} {row.in_order_ms:11.3f} {row.contiguous_ms:9.3f}"
            ratios = f"{row.paging_ratio:14.2f} {row.ratio:12.2f}"
            bandwidth = f"{row.kv_gb_s:9.1f} {row.bandwidth_fraction:10.0%} "
            bandwidth += f"{row.block_read_gb_s:15.1f} {row.block_read_fraction:13.0%}"
            print(f"{row.shape:8} {row.backend:8} {row.dtype:5} {cells} {ratios} {bandwidth}", flush=True)
    if not args.json:
        print("block read: the paged case's K/V blocks summed in block-table order by torch's embedding_bag")
        print(f"read bandwidth of this machine (sum over 512 MiB, same threads): {args.read_gb_s:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
