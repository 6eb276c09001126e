"""One prepared GPU run: check the Triton kernels against the reference on CUDA, then time paged decode
against dense attention. `python -m pagedllm.bench.gpu_check [--out results.json]`; needs a CUDA GPU and
Triton; a few minutes on an H200. Exits 1 if any check fails (timings are still printed)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict

import torch

from pagedllm.bench import kernel
from pagedllm.ops import reference, triton_ops
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


def check_case(case: tuple, dtype: torch.dtype, device: str = "cuda") -> dict:
    name, heads, kv_heads, head_dim, block_size, context_lens, query_lens, window = case
    decode = query_lens is None
    b = random_paged_batch(
        context_lens, query_lens or [1] * len(context_lens), heads, kv_heads, head_dim, block_size, dtype,
        device=device, seed=len(name),
    )  # fmt: skip
    scale = 1 / math.sqrt(head_dim)
    if decode:
        args = (b.q, b.k_cache, b.v_cache, b.block_tables, b.context_lens, scale, window)
        out, expected = triton_ops.paged_decode_attention(*args), reference.paged_decode_attention(*args)
    else:
        args = (b.q, b.k_cache, b.v_cache, b.block_tables, b.query_start_loc, b.context_lens, scale, window)
        out, expected = triton_ops.paged_prefill_attention(*args), reference.paged_prefill_attention(*args)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
    err = (out.float() - expected.float()).abs().max().item()
    ok = torch.allclose(out.float(), expected.float(), atol=tol, rtol=tol)
    return {"check": name, "dtype": str(dtype).removeprefix("torch."), "max_abs_err": err, "ok": ok}


def check_write_kv(dtype: torch.dtype, device: str = "cuda") -> dict:
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(40, 16, 4, 64, generator=gen).to(device, dtype) for _ in range(2)]
    expected = [c.clone() for c in caches]
    key, value = (torch.randn(100, 4, 64, generator=gen).to(device, dtype) for _ in range(2))
    slots = torch.randperm(640, generator=gen)[:100].to(device)
    slots[::7] = -1
    triton_ops.write_kv(key, value, *caches, slots)
    reference.write_kv(key, value, *expected, slots)
    ok = all(torch.equal(a, b) for a, b in zip(caches, expected, strict=True))
    return {"check": "write_kv", "dtype": str(dtype).removeprefix("torch."), "ok": ok}


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
        checks.append(check_write_kv(dtype))
        checks.extend(check_case(case, dtype) for case in CASES)
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
    failed = [c["check"] + "/" + c["dtype"] for c in checks if not c["ok"]]
    print(
        f"{len(checks) - len(failed)}/{len(checks)} checks passed" + (f"; FAILED: {failed}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
