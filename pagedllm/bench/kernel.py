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

`--kv-dtype` stores the caches in another dtype than the queries' (float32, bfloat16, or int8 / fp8 codes
with their scales, as kv_cache_dtype does); the dense baseline then attends over the values the cache
holds, and K/V bytes are what the cache holds (ops.kv_block_bytes: a quantized cache's scales included).
The cpu kernels' decode over an int8 cache is checked against the reference on the query codes it
attends with (attended_query). `--kv-sweep` times decode with every sequence at each `--contexts`
length, the caches in each `--kv-dtype` side by side (interleaved in one run), each checked against the
reference first. Each cache dtype's blocks hold its default number of tokens (kv.default_block_size: the
engine's when block_size is unset) unless `--block-size` sets one for all.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F

from pagedllm import ops
from pagedllm.bench import flags
from pagedllm.kv import default_block_size
from pagedllm.models.loader import DEFAULT_MODEL
from pagedllm.ops import BACKENDS, kv_block_bytes, reference
from pagedllm.ops.kv_cache import is_quantized, kv_blocks
from pagedllm.ops.synthetic import PagedBatch, random_paged_batch

SHAPES = {  # name: (num_heads, num_kv_heads, head_dim)
    "issue": (12, 4, 64),
    "smollm2": (9, 3, 64),
    "gemma3": (4, 1, 256),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}  # the queries' (and by default the caches')
KV_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
}
SAME_AS_QUERIES = {"fp32": "float32", "bf16": "bfloat16"}
SWEEP_CONTEXTS = [1024, 4096, 16384]
SWEEP_KV_DTYPES = ["float32", "bfloat16", "int8"]


@dataclasses.dataclass
class Row:
    shape: str
    backend: str
    dtype: str  # the queries'
    kv_dtype: str  # the caches'
    block_size: int  # tokens per cache block
    num_seqs: int
    tokens: int
    paged_ms: float
    in_order_ms: float  # the same backend, each sequence's blocks consecutive in memory
    contiguous_ms: float
    paging_ratio: float  # paged / in-order: the cost of scattered blocks alone
    ratio: float  # paged / contiguous baseline
    kv_gb_s: float  # K/V bytes of all sequences (scales included) / paged time
    read_gb_s: float  # this machine's read bandwidth, measured in the same process
    bandwidth_fraction: float  # kv_gb_s / read_gb_s
    block_read_gb_s: float  # the same scattered blocks summed by embedding_bag, in table order
    block_read_fraction: float  # kv_gb_s / block_read_gb_s
    contiguous_impl: str
    threads: int
    device: str


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
    rows = []  # per cache one row per block: its memory, slot-major or head-major
    for cache in (batch.k_cache, batch.v_cache):
        if is_quantized(cache.dtype):  # codes and scales, read as float32 words: only the read counts
            rows.append(kv_blocks(cache).view(torch.float32))
            continue
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


def block_size_of(kv_dtype: str, args: argparse.Namespace) -> int:
    """Tokens per block of a kv_dtype cache: --block-size, else the dtype's default (the engine's)."""
    return args.block_size or default_block_size(KV_DTYPES[kv_dtype].itemsize)


def describe_blocks(kv_dtypes: list[str], args: argparse.Namespace) -> str:
    """The block sizes of the caches a table reports, for its header."""
    if args.block_size is not None:
        return f"block {args.block_size}"
    return "blocks " + ", ".join(f"{kv} {block_size_of(kv, args)}" for kv in kv_dtypes)


def make_batch(
    shape: str, dtype: str, kv_dtype: str, context_lens: list[int], args: argparse.Namespace, scattered: bool
) -> PagedBatch:
    """One query per sequence in `dtype` over caches of `kv_dtype` in the engine's memory order for the
    device; its contiguous keys and values are the values the caches hold, in the queries' dtype."""
    num_heads, num_kv_heads, head_dim = SHAPES[shape]
    queries, cache = DTYPES[dtype], KV_DTYPES[kv_dtype]
    quantized = is_quantized(cache)
    block_size = block_size_of(kv_dtype, args)
    b = random_paged_batch(
        context_lens, [1] * len(context_lens), num_heads, num_kv_heads, head_dim, block_size,
        queries if quantized else cache, args.device, seed=args.seed, scattered=scattered,
        head_major=torch.device(args.device).type == "cpu", kv_dtype=cache if quantized else None,
    )  # fmt: skip

    if quantized:  # the values the blocks hold: dequantized (and the keys unsmoothed)
        held = [
            reference.gather_kv(b.k_cache, b.v_cache, table, int(n))
            for table, n in zip(b.block_tables, b.context_lens, strict=True)
        ]
        b.keys, b.values = [k for k, _ in held], [v for _, v in held]
    b.q, b.keys, b.values = (
        b.q.to(queries),
        [k.to(queries) for k in b.keys],
        [v.to(queries) for v in b.values],
    )
    return b


def _through_tables(backend: str, b: PagedBatch, scale: float) -> Callable[[], torch.Tensor]:
    q, args, attend = b.q, b.args(scale, decode=True), ops.backend(backend).paged_attention
    return lambda: attend(q, args)


def attended_query(backend: str, b: PagedBatch, scale: float) -> torch.Tensor:
    """The query the backend's decode attends with: b.q, except that the cpu kernels meet an int8 cache's
    key codes with the query's own int16 codes (reference.int8_decode_query)."""
    if backend == "cpu" and b.k_cache.dtype == torch.int8:
        return reference.int8_decode_query(b.q, b.k_cache, scale).to(b.q.dtype)
    return b.q


def _kv_bytes(shape: str, kv_dtype: str, tokens: int) -> int:
    """Bytes of `tokens` tokens' K and V as a cache of kv_dtype holds them (a quantized one's scales too)."""
    _, num_kv_heads, head_dim = SHAPES[shape]
    return 2 * tokens * kv_block_bytes(1, num_kv_heads, head_dim, KV_DTYPES[kv_dtype])


def run_case(
    shape: str, backend: str, dtype: str, kv_dtype: str, context_lens: list[int], args: argparse.Namespace
) -> Row:
    device = torch.device(args.device)
    paged, in_order = (
        make_batch(shape, dtype, kv_dtype, context_lens, args, scattered) for scattered in (True, False)
    )  # the same values; only where the blocks lie differs
    scale = 1.0 / math.sqrt(SHAPES[shape][2])
    dense = padded_batch_attention if device.type == "cuda" else per_sequence_attention
    variants = {
        "paged": _through_tables(backend, paged, scale),
        "in_order": _through_tables(backend, in_order, scale),
        "contiguous": dense(paged, scale),
    }
    read_blocks, block_bytes = block_read(paged)
    tol = 2e-2 if dtype == "bf16" else 1e-4
    expected = dense(dataclasses.replace(paged, q=attended_query(backend, paged, scale)), scale)().float()
    for name in ("paged", "in_order"):
        torch.testing.assert_close(variants[name]().float(), expected, atol=tol, rtol=tol)
    ms = median_ms({**variants, "block_read": read_blocks}, args.reps, args.warmup, device)
    block_read_gb_s = block_bytes / ms["block_read"] / 1e6
    kv_gb_s = _kv_bytes(shape, kv_dtype, sum(context_lens)) / ms["paged"] / 1e6
    return Row(
        shape=shape,
        backend=backend,
        dtype=dtype,
        kv_dtype=kv_dtype,
        block_size=block_size_of(kv_dtype, args),
        num_seqs=len(context_lens),
        tokens=sum(context_lens),
        paged_ms=ms["paged"],
        in_order_ms=ms["in_order"],
        contiguous_ms=ms["contiguous"],
        paging_ratio=ms["paged"] / ms["in_order"],
        ratio=ms["paged"] / ms["contiguous"],
        kv_gb_s=kv_gb_s,
        read_gb_s=args.read_gb_s,
        bandwidth_fraction=kv_gb_s / args.read_gb_s,
        block_read_gb_s=block_read_gb_s,
        block_read_fraction=kv_gb_s / block_read_gb_s,
        contiguous_impl="padded-batch-sdpa" if device.type == "cuda" else "per-sequence-sdpa",
        threads=torch.get_num_threads(),
        device=device.type,
    )


@dataclasses.dataclass
class SweepRow:
    """Paged decode at one context length, per KV dtype (in --kv-dtype's order), timed round-robin."""

    shape: str
    backend: str
    dtype: str  # the queries'
    context: int  # of every sequence
    num_seqs: int
    block_size: dict[str, int]  # tokens per cache block
    paged_ms: dict[str, float]
    kv_gb_s: dict[str, float]  # K/V bytes the cache holds (scales included) / paged time
    threads: int
    device: str


def sweep_case(shape: str, backend: str, dtype: str, context: int, args: argparse.Namespace) -> SweepRow:
    """Every --kv-dtype's cache of the same values, each checked against the reference on its own
    blocks, then timed in interleaved repetitions."""
    lens = [context] * args.num_seqs
    scale = 1.0 / math.sqrt(SHAPES[shape][2])
    variants = {}
    for kv_dtype in args.kv_dtype:
        b = make_batch(shape, dtype, kv_dtype, lens, args, scattered=True)
        b.keys = b.values = []  # the contiguous copies: only the paged kernel is timed here
        variants[kv_dtype] = _through_tables(backend, b, scale)
        tol = 2e-2 if dtype == "bf16" else 1e-4
        expected = reference.paged_attention(
            attended_query(backend, b, scale), b.args(scale, decode=True)
        ).float()
        torch.testing.assert_close(variants[kv_dtype]().float(), expected, atol=tol, rtol=tol)
    ms = median_ms(variants, args.reps, args.warmup, torch.device(args.device))
    tokens = sum(lens)
    return SweepRow(
        shape=shape,
        backend=backend,
        dtype=dtype,
        context=context,
        num_seqs=args.num_seqs,
        block_size={kv: block_size_of(kv, args) for kv in ms},
        paged_ms=ms,
        kv_gb_s={kv: _kv_bytes(shape, kv, tokens) / ms[kv] / 1e6 for kv in ms},
        threads=torch.get_num_threads(),
        device=torch.device(args.device).type,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pagedllm bench kernel", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--backends",
        nargs="+",
        choices=sorted(BACKENDS),
        help="default: the device's (--kv-sweep: its kernel)",
    )
    p.add_argument(
        "--dtypes",
        nargs="+",
        choices=sorted(DTYPES),
        help="the queries' (default: fp32 bf16; --kv-sweep: fp32)",
    )
    p.add_argument(
        "--kv-dtype",
        nargs="+",
        choices=list(KV_DTYPES),
        help="the caches' dtype (default: the queries'; --kv-sweep: " + " ".join(SWEEP_KV_DTYPES) + ")",
    )
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=["issue", "gemma3"])
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--min-context", type=int, default=64)
    p.add_argument("--max-context", type=int, default=1024)
    p.add_argument(
        "--kv-sweep",
        action="store_true",
        help="decode with every sequence at each --contexts length, one column per --kv-dtype",
    )
    p.add_argument(
        "--contexts",
        nargs="+",
        type=int,
        help="--kv-sweep's context lengths (default: " + " ".join(map(str, SWEEP_CONTEXTS)) + ")",
    )
    p.add_argument(
        "--block-size",
        type=int,
        help="tokens per cache block, for every KV dtype (default: each dtype's, the engine's default)",
    )
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    flags.add_threads(p)
    flags.add_seed(p, help="seed of the random queries and caches")
    flags.add_json(p, help="one JSON object per case instead of a table")
    p.add_argument(
        "--decoder-layer",
        metavar="MODEL",
        nargs="?",
        const=DEFAULT_MODEL,
        help="instead: one request's decode steps (200-token prompt, 128 steps) on MODEL's own weights with "
        "its layers in one call vs their ops one by one, alternating (default MODEL: pagedllm's default)",
    )
    args = p.parse_args(argv)
    if args.block_size is not None and args.block_size < 1:
        p.error(f"--block-size must be >= 1, got {args.block_size}")
    if not 1 <= args.min_context <= args.max_context:
        p.error(f"need 1 <= --min-context <= --max-context, got {args.min_context}, {args.max_context}")
    if args.contexts is not None and not args.kv_sweep:
        p.error("--contexts is for --kv-sweep (without it, contexts are drawn from --min/--max-context)")
    if args.kv_sweep:
        args.contexts = args.contexts or SWEEP_CONTEXTS
        if min(args.contexts) < 1:
            p.error(f"--contexts must be >= 1, got {args.contexts}")
        args.kv_dtype = args.kv_dtype or SWEEP_KV_DTYPES
        args.dtypes = args.dtypes or ["fp32"]
        args.backends = args.backends or ["triton" if args.device == "cuda" else "cpu"]
    args.dtypes = args.dtypes or ["fp32", "bf16"]
    if args.backends is None:
        if args.device == "cuda":
            args.backends = ["triton", "sdpa", "torch"]
        else:
            args.backends = ["cpu", "sdpa", "torch"]
    if "cpu" in args.backends and "bf16" in args.dtypes and "float32" in (args.kv_dtype or []):
        p.error("the cpu kernels read no float32 cache under bf16 queries: drop one of them")
    return args


def read_bandwidth_gb_s(device: torch.device, reps: int = 5) -> float:
    """GB/s of a sum over a 512 MiB float32 tensor (best of reps): what reading memory costs here."""
    x = torch.ones(128 * 2**20, device=device)
    best = min(_timed(x.sum, device) for _ in range(reps))
    return x.numel() * x.element_size() / best / 1e6


def _check_cpu_backend(args: argparse.Namespace) -> None:
    """Stop, naming why, where a backend asked for cannot be built here: never time a fallback."""
    if "cpu" in args.backends:
        from pagedllm.ops import native

        reason = native.unavailable_reason()
        if reason is not None:
            raise SystemExit(f"pagedllm bench kernel: error: --backends cpu cannot run here: {reason}")
    if "triton" in args.backends and importlib.util.find_spec("triton") is None:
        raise SystemExit("pagedllm bench kernel: error: --backends triton needs Triton (pip install triton)")


def kernel_build() -> str:
    """The cpu kernels' instruction-set build the rows measure, for their header."""
    from pagedllm.ops import native

    isa = native.built_isa()
    return f"cpu kernels built for {isa}" if isa else "no cpu kernels"


def iter_rows(args: argparse.Namespace) -> Iterator[Row]:
    """Run every (shape, backend, dtype, kv dtype) case on one set of context lengths."""
    rng = random.Random(args.seed)
    context_lens = [rng.randint(args.min_context, args.max_context) for _ in range(args.num_seqs)]
    _check_cpu_backend(args)
    args.read_gb_s = read_bandwidth_gb_s(torch.device(args.device))
    for shape in args.shapes:
        for backend in args.backends:
            for dtype in args.dtypes:
                for kv_dtype in args.kv_dtype or [SAME_AS_QUERIES[dtype]]:
                    yield run_case(shape, backend, dtype, kv_dtype, context_lens, args)


def iter_sweep(args: argparse.Namespace) -> Iterator[SweepRow]:
    """--kv-sweep: every (shape, backend, dtype, context) case, the KV dtypes side by side."""
    _check_cpu_backend(args)
    for shape in args.shapes:
        for backend in args.backends:
            for dtype in args.dtypes:
                for context in args.contexts:
                    yield sweep_case(shape, backend, dtype, context, args)


def print_sweep(args: argparse.Namespace) -> None:
    first, *others = args.kv_dtype
    ms_cols = [f"{kv} ms" for kv in args.kv_dtype]
    rate_cols = [f"{kv} GB/s" for kv in args.kv_dtype]
    speed_cols = [f"{first}/{kv}" for kv in others]
    cols = ms_cols + rate_cols + speed_cols
    formats = [".3f"] * len(ms_cols) + [".1f"] * len(rate_cols) + [".2f"] * len(speed_cols)
    if not args.json:
        print(
            f"paged decode, every sequence at the context shown, K/V in each dtype (scales included): "
            f"{args.num_seqs} seqs, {describe_blocks(args.kv_dtype, args)} tokens, "
            f"{torch.get_num_threads()} threads, {args.device} ({kernel_build()}), "
            f"median of {args.reps} reps interleaved across the dtypes"
        )
        print(f"{'shape':8} {'backend':8} {'q':5} {'context':>7} " + " ".join(cols))
    for row in iter_sweep(args):
        if args.json:
            print(json.dumps(dataclasses.asdict(row)), flush=True)
            continue
        cells = [row.paged_ms[kv] for kv in args.kv_dtype] + [row.kv_gb_s[kv] for kv in args.kv_dtype]
        cells += [row.paged_ms[first] / row.paged_ms[kv] for kv in others]
        line = " ".join(f"{v:>{len(c)}{f}}" for v, c, f in zip(cells, cols, formats, strict=True))
        print(f"{row.shape:8} {row.backend:8} {row.dtype:5} {row.context:>7} {line}", flush=True)
    if not args.json:
        print(f"{first}/X: how many times faster paged decode runs over X's cache than over {first}'s")


def print_decoder_layer(model_name: str) -> None:
    """--decoder-layer: the one-call decoder layer's step time against its ops one by one."""
    from pagedllm.models import load_model
    from pagedllm.models.fused_timing import time_fused_decode

    loaded = load_model(model_name, max_num_seqs=1)
    t = time_fused_decode(loaded.model)
    print(
        f"{model_name} ({loaded.linear_method} weights, {t.backend} backend, {torch.get_num_threads()} "
        f"threads): one request's decode step after a {t.context}-token prompt, median of {t.steps} steps "
        f"per round, {t.fused_layers} of {t.layers} layers in one call"
    )
    print(f"one call   ms/step: {' '.join(f'{ms:.2f}' for ms in t.fused_ms)}")
    print(f"op by op   ms/step: {' '.join(f'{ms:.2f}' for ms in t.by_ops_ms)}")
    print(f"one call is {t.speedup:.2f}x as fast (same tokens both ways)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    flags.apply_threads(args)
    if args.decoder_layer:
        print_decoder_layer(args.decoder_layer)
        return 0
    if args.kv_sweep:
        print_sweep(args)
        return 0
    if not args.json:
        kv_dtypes = args.kv_dtype or list(dict.fromkeys(SAME_AS_QUERIES[d] for d in args.dtypes))
        print(
            "paged decode (blocks scattered) vs the same backend on in-order blocks vs dense SDPA: "
            f"{args.num_seqs} seqs, context {args.min_context}-{args.max_context}, "
            f"{describe_blocks(kv_dtypes, args)} tokens, {torch.get_num_threads()} threads, {args.device} "
            f"({kernel_build()}), median of {args.reps} interleaved reps"
        )
        print(
            f"{'shape':8} {'backend':8} {'dtype':5} {'KV':8} {'paged ms':>9} {'in-order ms':>11} "
            f"{'contig ms':>9} {'paged/in-order':>14} {'paged/contig':>12} {'K/V GB/s':>9} "
            f"{'of read bw':>10} {'block read GB/s':>15} {'of block read':>13}"
        )
    for row in iter_rows(args):
        if args.json:
            print(json.dumps(dataclasses.asdict(row)), flush=True)
        else:
            cells = f"{row.paged_ms:9.3f} {row.in_order_ms:11.3f} {row.contiguous_ms:9.3f}"
            ratios = f"{row.paging_ratio:14.2f} {row.ratio:12.2f}"
            bandwidth = f"{row.kv_gb_s:9.1f} {row.bandwidth_fraction:10.0%} "
            bandwidth += f"{row.block_read_gb_s:15.1f} {row.block_read_fraction:13.0%}"
            what = f"{row.shape:8} {row.backend:8} {row.dtype:5} {row.kv_dtype:8}"
            print(f"{what} {cells} {ratios} {bandwidth}", flush=True)
    if not args.json:
        print("block read: the paged case's K/V blocks summed in block-table order by torch's embedding_bag")
        print(f"read bandwidth of this machine (sum over 512 MiB, same threads): {args.read_gb_s:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
