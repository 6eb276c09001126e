"""One prepared GPU run: check the Triton kernels against the reference on CUDA (float, int8 and fp8 caches),
then time paged decode against dense attention, and over bf16 / int8 / fp8 KV caches side by side.
`python -m pagedllm.bench.gpu_check [--out results.json]`; needs a CUDA GPU and Triton; a few minutes on an
H200. Exits 1 if any check fails (timings are still printed)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict

import torch

from pagedllm.bench import kernel
from pagedllm.ops import allocate_kv_caches, reference, triton_ops
from pagedllm.ops.kv_cache import key_smoothing, kv_blocks
from pagedllm.ops.synthetic import random_paged_batch

# (name, heads, kv_heads, head_dim, block_size, context_lens, query_lens or None for decode, window)
CASES = [
    ("decode-gqa3-partial", 9, 3, 64, 16, [1, 17, 300, 1023], None, None),
    ("decode-mqa-d256-window", 4, 1, 256, 16, [5, 600, 1024], None, 512),
    ("decode-block1", 12, 4, 64, 1, [3, 70, 400], None, None),
    ("prefill-prompts", 9, 3, 64, 16, [200, 37], [200, 37], None),
    ("prefill-prefix-chunk-mixed", 12, 4, 64, 16, [700, 90, 33, 5], [256, 1, 33, 1], None),
    ("prefill-mqa-d256-window", 4, 1, 256, 16, [900, 64], [300, 64], 512),
    ("prefill-block1", 9, 3, 64, 1, [150, 20], [50, 1], None),
]


KV_DTYPES = (None, torch.int8, torch.float8_e4m3fn)  # the caches' (None: the queries' dtype)


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def check_case(
    case: tuple, dtype: torch.dtype, kv_dtype: torch.dtype | None = None, device: str = "cuda"
) -> dict:
    """One case's Triton attention against the reference on the same blocks (of a quantized cache: the
    same codes and scales, which the reference dequantizes)."""
    name, heads, kv_heads, head_dim, block_size, context_lens, query_lens, window = case
    decode = query_lens is None
    b = random_paged_batch(
        context_lens, query_lens or [1] * len(context_lens), heads, kv_heads, head_dim, block_size, dtype,
        device=device, seed=len(name), kv_dtype=kv_dtype,
    )  # fmt: skip
    scale = 1 / math.sqrt(head_dim)
    args = b.args(scale, window, decode=decode)
    out, expected = triton_ops.paged_attention(b.q, args), reference.paged_attention(b.q, args)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    err = (out.float() - expected.float()).abs().max().item()
    ok = torch.allclose(out.float(), expected.float(), atol=tol, rtol=tol)
    return {
        "check": name,
        "dtype": _name(dtype),
        "kv_dtype": _name(b.k_cache.dtype),
        "max_abs_err": err,
        "ok": ok,
    }


def check_write_kv(dtype: torch.dtype, kv_dtype: torch.dtype | None = None, device: str = "cuda") -> dict:
    """Triton's K/V store against the reference's, bit for bit, slot -1 skipped. Into a quantized cache
    (random bytes everywhere first, scales included; a random key smoothing): each row's codes and scale,
    keys smoothed first, over magnitudes from 1e-6 to 1e3, an all-zero row, rows with a NaN or an
    infinity, a -0.0; nothing else changes."""
    gen = torch.Generator().manual_seed(0)
    key, value = (torch.randn(100, 4, 64, generator=gen) for _ in range(2))
    if kv_dtype is None:
        caches = [torch.randn(40, 16, 4, 64, generator=gen).to(device, dtype) for _ in range(2)]
        expected = [c.clone() for c in caches]
        memory = list
    else:
        caches, expected = (allocate_kv_caches(1, 40, 16, 4, 64, kv_dtype, device)[0] for _ in "ab")
        for cache, twin in zip(caches, expected, strict=True):
            noise = torch.randint(0, 256, kv_blocks(cache).shape, generator=gen, dtype=torch.uint8)
            kv_blocks(cache).copy_(noise)
            kv_blocks(twin).copy_(noise)
        mean, factor = torch.randn(4, 64, generator=gen), 4.0 ** torch.randn(4, 64, generator=gen)
        for smoothing in (key_smoothing(caches[0]), key_smoothing(expected[0])):
            smoothing[0].copy_(mean), smoothing[1].copy_(factor)
        key *= torch.logspace(-6, 3, 100)[:, None, None]
        key[2, 1], key[3, 0, 5], key[4, 2, 7], key[5, 0, 0] = 0.0, float("nan"), float("inf"), -0.0

        def memory(pair):
            return [kv_blocks(c) for c in pair]

    key, value = key.to(device, dtype), value.to(device, dtype)
    slots = torch.randperm(640, generator=gen)[:100].to(device)
    slots[7::7] = -1  # tokens 0-6 (the zero, NaN, infinity and -0.0 rows among them) are written
    triton_ops.write_kv(key, value, *caches, slots)
    reference.write_kv(key, value, *expected, slots)
    ok = all(torch.equal(a, b) for a, b in zip(memory(caches), memory(expected), strict=True))
    return {"check": "write_kv", "dtype": _name(dtype), "kv_dtype": _name(caches[0].dtype), "ok": ok}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write the results here as JSON")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    start = time.time()
    checks = []
    for dtype in (torch.float32, torch.bfloat16):
        for kv_dtype in KV_DTYPES:
            checks.append(check_write_kv(dtype, kv_dtype))
            checks.extend(check_case(case, dtype, kv_dtype) for case in CASES)
    for c in checks:
        print(json.dumps(c), flush=True)
    # Decode timing: Triton paged vs dense (padded batch SDPA), plus the pure PyTorch sdpa backend.
    timing_argv = [
        "--device",
        "cuda",
        "--backends",
        "triton",
        "sdpa",
        "--reps",
        "50",
        "--warmup",
        "5",
        "--json",
    ]
    timings = []
    for num_seqs, max_context in ((32, 1024), (256, 4096)):
        argv = [*timing_argv, "--num-seqs", str(num_seqs), "--max-context", str(max_context)]
        timings.extend(asdict(row) for row in kernel.iter_rows(kernel.parse_args(argv)))
    # The KV cache dtypes side by side at 1k / 4k / 16k context, under the GPU engine's bf16 activations.
    sweep = ["--device", "cuda", "--kv-sweep", "--dtypes", "bf16", "--kv-dtype", "bfloat16", "int8", "fp8"]
    timings.extend(asdict(row) for row in kernel.iter_sweep(kernel.parse_args([*sweep, "--reps", "50"])))
    for row in timings:
        print(json.dumps(row), flush=True)
    result = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton_ops.triton.__version__,
        "checks": checks,
        "timings": timings,
        "seconds": round(time.time() - start, 1),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    failed = [f"{c['check']}/{c['dtype']}/{c['kv_dtype']}" for c in checks if not c["ok"]]
    print(
        f"{len(checks) - len(failed)}/{len(checks)} checks passed" + (f"; FAILED: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
