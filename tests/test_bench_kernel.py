"""`pagedllm bench kernel` runs end to end on tiny inputs and reports what it measured."""

import json

import pytest
import torch

from pagedllm.bench import kernel
from pagedllm.ops import reference
from pagedllm.ops.synthetic import random_paged_batch

TINY = ["--num-seqs", "3", "--min-context", "5", "--max-context", "40", "--reps", "2", "--warmup", "0"]


def test_json_rows_per_backend_and_dtype(capsys):
    argv = [
        *TINY,
        "--json",
        "--shapes",
        "issue",
        "gemma3",
        "--backends",
        "cpu",
        "sdpa",
        "--dtypes",
        "fp32",
        "bf16",
    ]
    assert kernel.main(argv) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["shape"], r["backend"], r["dtype"]) for r in rows] == [
        (shape, backend, dtype)
        for shape in ("issue", "gemma3")
        for backend in ("cpu", "sdpa")
        for dtype in ("fp32", "bf16")
    ]
    for r in rows:
        assert r["num_seqs"] == 3 and 15 <= r["tokens"] <= 120
        assert r["paged_ms"] > 0 and r["in_order_ms"] > 0 and r["contiguous_ms"] > 0
        assert r["ratio"] == pytest.approx(r["paged_ms"] / r["contiguous_ms"], rel=0.01, abs=1e-3)
        assert r["paging_ratio"] == pytest.approx(r["paged_ms"] / r["in_order_ms"], rel=0.01, abs=1e-3)
        _, kv_heads, head_dim = kernel.SHAPES[r["shape"]]
        kv_bytes = 2 * r["tokens"] * kv_heads * head_dim * (4 if r["dtype"] == "fp32" else 2)
        assert r["kv_gb_s"] == pytest.approx(kv_bytes / r["paged_ms"] / 1e6, rel=0.02)
        assert r["bandwidth_fraction"] == pytest.approx(r["kv_gb_s"] / r["read_gb_s"], rel=0.02)
        assert r["block_read_gb_s"] > 0
        assert r["block_read_fraction"] == pytest.approx(r["kv_gb_s"] / r["block_read_gb_s"], rel=0.02)


def test_table_output(capsys):
    assert kernel.main([*TINY, "--shapes", "smollm2", "--backends", "torch", "--dtypes", "fp32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == [
        "shape", "backend", "dtype", "paged", "ms", "in-order", "ms", "contig", "ms", "paged/in-order",
        "paged/contig", "K/V", "GB/s", "of", "read", "bw", "block", "read", "GB/s", "of", "block", "read",
    ]  # fmt: skip
    assert lines[2].split()[:3] == ["smollm2", "torch", "fp32"]
    assert lines[-1].startswith("read bandwidth of this machine")


def test_bad_context_range_is_rejected():
    with pytest.raises(SystemExit):
        kernel.main(["--min-context", "50", "--max-context", "10"])


def test_contiguous_baselines_agree_with_the_reference():
    b = random_paged_batch([7, 30, 1], [1, 1, 1], 6, 2, 16, 4)
    expected = reference.paged_decode_attention(
        b.q, b.k_cache, b.v_cache, b.block_tables, b.context_lens, 0.3
    )
    torch.testing.assert_close(kernel.per_sequence_attention(b, 0.3)(), expected)
    torch.testing.assert_close(kernel.padded_batch_attention(b, 0.3)(), expected)


def test_in_order_batch_holds_the_same_values_contiguously():
    """The in-order layout the bench times against: each sequence's K/V one run of consecutive slots."""
    scattered = random_paged_batch([7, 30, 1], [1, 1, 1], 6, 2, 16, 4, seed=5)
    in_order = random_paged_batch([7, 30, 1], [1, 1, 1], 6, 2, 16, 4, seed=5, scattered=False)
    assert torch.equal(scattered.q, in_order.q)
    assert all(torch.equal(a, b) for a, b in zip(scattered.keys, in_order.keys, strict=True))
    assert in_order.block_tables.tolist() == [
        [0, 1, 0, 0, 0, 0, 0, 0],
        [2, 3, 4, 5, 6, 7, 8, 9],
        [10, 0, 0, 0, 0, 0, 0, 0],
    ]
    assert scattered.block_tables.tolist() != in_order.block_tables.tolist()
    flat_k, flat_v = in_order.k_cache.flatten(0, 1), in_order.v_cache.flatten(0, 1)
    for start, k, v in zip([0, 8, 40], in_order.keys, in_order.values, strict=True):
        assert torch.equal(flat_k[start : start + len(k)], k)
        assert torch.equal(flat_v[start : start + len(v)], v)


def test_block_read_sums_exactly_the_blocks_of_each_table():
    """The reference read visits each sequence's own blocks, every slot of them, in either cache layout."""
    for head_major in (False, True):
        b = random_paged_batch([7, 30, 1], [1, 1, 1], 6, 2, 16, 4, seed=3, head_major=head_major)
        for cache in (b.k_cache, b.v_cache):
            cache.nan_to_num_(0.0)  # slots no sequence owns
        run, num_bytes = kernel.block_read(b)
        blocks = [b.block_tables[s, : -(-n // 4)] for s, n in enumerate([7, 30, 1])]
        expected = sum(float(c[ids].sum()) for c in (b.k_cache, b.v_cache) for ids in blocks)
        assert float(run()) == pytest.approx(expected, rel=1e-5)
        assert num_bytes == 2 * sum(len(ids) for ids in blocks) * 4 * 2 * 16 * 4
