"""`pagedllm bench kernel` runs end to end on tiny inputs and reports what it measured."""

import json

import pytest
import torch

from pagedllm.bench import kernel
from pagedllm.ops import reference
from pagedllm.ops.kv_cache import key_smoothing, kv_scales
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
    assert [(r["shape"], r["backend"], r["dtype"], r["kv_dtype"]) for r in rows] == [
        (shape, backend, dtype, kv_dtype)
        for shape in ("issue", "gemma3")
        for backend in ("cpu", "sdpa")
        for dtype, kv_dtype in (("fp32", "float32"), ("bf16", "bfloat16"))  # the cache in the queries' dtype
    ]
    for r in rows:
        assert r["block_size"] == {"float32": 16, "bfloat16": 32}[r["kv_dtype"]]  # each dtype's default
        assert r["num_seqs"] == 3 and 15 <= r["tokens"] <= 120
        assert r["paged_ms"] > 0 and r["in_order_ms"] > 0 and r["contiguous_ms"] > 0
        # the ratios are of the medians the row reports (both as measured, unrounded)
        assert r["ratio"] == pytest.approx(r["paged_ms"] / r["contiguous_ms"], rel=1e-12)
        assert r["paging_ratio"] == pytest.approx(r["paged_ms"] / r["in_order_ms"], rel=1e-12)
        _, kv_heads, head_dim = kernel.SHAPES[r["shape"]]
        kv_bytes = 2 * r["tokens"] * kv_heads * head_dim * (4 if r["dtype"] == "fp32" else 2)
        assert r["kv_gb_s"] == pytest.approx(kv_bytes / r["paged_ms"] / 1e6, rel=1e-12)
        assert r["bandwidth_fraction"] == pytest.approx(r["kv_gb_s"] / r["read_gb_s"], rel=1e-12)
        assert r["block_read_gb_s"] > 0
        assert r["block_read_fraction"] == pytest.approx(r["kv_gb_s"] / r["block_read_gb_s"], rel=1e-12)


def test_quantized_caches_count_their_codes_and_scales(capsys):
    """--kv-dtype int8 / fp8 under either query dtype: every backend agreed with the dense baseline (the
    bench checks it before timing), and K/V bytes are a byte per value plus a float32 scale per row."""
    argv = [*TINY, "--json", "--shapes", "smollm2", "--backends", "cpu", "sdpa", "torch"]
    assert kernel.main([*argv, "--dtypes", "fp32", "bf16", "--kv-dtype", "int8", "fp8", "bfloat16"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert {(r["backend"], r["dtype"], r["kv_dtype"]) for r in rows} == {
        (backend, dtype, kv_dtype)
        for backend in ("cpu", "sdpa", "torch")
        for dtype in ("fp32", "bf16")
        for kv_dtype in ("int8", "fp8", "bfloat16")
    }
    row_bytes = {"int8": 64 + 4, "fp8": 64 + 4, "bfloat16": 2 * 64}  # SmolLM2's head_dim 64
    for r in rows:
        kv_bytes = 2 * r["tokens"] * 3 * row_bytes[r["kv_dtype"]]  # K and V, 3 KV heads a token
        assert r["kv_gb_s"] == pytest.approx(kv_bytes / r["paged_ms"] / 1e6, rel=1e-12)


def test_a_bf16_query_over_a_float32_cache_is_refused_for_the_cpu_kernels(capsys):
    with pytest.raises(SystemExit):
        kernel.main([*TINY, "--dtypes", "bf16", "--kv-dtype", "float32", "--backends", "cpu"])
    assert "no float32 cache under bf16 queries" in capsys.readouterr().err


def test_kv_sweep_puts_each_cache_dtype_side_by_side(capsys):
    argv = ["--kv-sweep", "--contexts", "20", "33", "--num-seqs", "2", "--reps", "2", "--warmup", "0"]
    assert kernel.main([*argv, "--shapes", "gemma3", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["backend"], r["dtype"], r["context"]) for r in rows] == [
        ("cpu", "fp32", 20),
        ("cpu", "fp32", 33),
    ]
    for r in rows:
        assert list(r["paged_ms"]) == list(r["kv_gb_s"]) == ["float32", "bfloat16", "int8"]
        assert r["block_size"] == {"float32": 16, "bfloat16": 32, "int8": 64}  # the same bytes a block
        tokens = 2 * r["context"]
        for kv_dtype, row_bytes in (("float32", 4 * 256), ("bfloat16", 2 * 256), ("int8", 256 + 4)):
            expected = 2 * tokens * row_bytes / r["paged_ms"][kv_dtype] / 1e6  # gemma3: one KV head of 256
            assert r["kv_gb_s"][kv_dtype] == pytest.approx(expected, rel=1e-12)
    assert kernel.main([*argv, "--shapes", "smollm2", "--kv-dtype", "float32", "fp8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "2 seqs, blocks float32 16, fp8 64 tokens," in lines[0]
    assert lines[1].split() == [
        "shape", "backend", "q", "context", "float32", "ms", "fp8", "ms", "float32", "GB/s", "fp8", "GB/s",
        "float32/fp8",
    ]  # fmt: skip
    first = lines[2].split()
    assert first[:4] == ["smollm2", "cpu", "fp32", "20"]
    # the printed ratio is that of the medians, which lie within half a printed digit of their columns
    (f32, fp8), ratio, half = map(float, first[4:6]), float(first[-1]), 5e-4
    lowest, highest = (f32 - half) / (fp8 + half), (f32 + half) / max(fp8 - half, 1e-12)
    assert lowest - 0.005 <= ratio <= highest + 0.005


def test_a_block_size_given_is_every_cache_dtypes(capsys):
    argv = [
        "--kv-sweep",
        "--contexts",
        "40",
        "--num-seqs",
        "2",
        "--reps",
        "1",
        "--warmup",
        "0",
        "--block-size",
        "8",
    ]
    assert kernel.main([*argv, "--shapes", "smollm2", "--kv-dtype", "float32", "int8", "--json"]) == 0
    (row,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert row["block_size"] == {"float32": 8, "int8": 8}
    assert kernel.main([*argv, "--shapes", "smollm2", "--kv-dtype", "float32", "int8"]) == 0
    assert "2 seqs, block 8 tokens," in capsys.readouterr().out.splitlines()[0]
    with pytest.raises(SystemExit):
        kernel.main([*argv[:-1], "0"])
    assert "--block-size must be >= 1, got 0" in capsys.readouterr().err


def test_contexts_without_the_sweep_are_refused(capsys):
    with pytest.raises(SystemExit):
        kernel.main(["--contexts", "1024"])
    assert "--contexts is for --kv-sweep" in capsys.readouterr().err


def test_table_output(capsys):
    assert kernel.main([*TINY, "--shapes", "smollm2", "--backends", "torch", "--dtypes", "fp32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == [
        "shape", "backend", "dtype", "KV", "paged", "ms", "in-order", "ms", "contig", "ms", "paged/in-order",
        "paged/contig", "K/V", "GB/s", "of", "read", "bw", "block", "read", "GB/s", "of", "block", "read",
    ]  # fmt: skip
    assert lines[2].split()[:4] == ["smollm2", "torch", "fp32", "float32"]
    assert lines[-1].startswith("read bandwidth of this machine")


def test_bad_context_range_is_rejected():
    with pytest.raises(SystemExit):
        kernel.main(["--min-context", "50", "--max-context", "10"])


def test_contiguous_baselines_agree_with_the_reference():
    b = random_paged_batch([7, 30, 1], [1, 1, 1], 6, 2, 16, 4)
    expected = reference.paged_attention(b.q, b.args(0.3, decode=True))
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


def test_block_read_of_a_quantized_cache_reads_codes_and_scales():
    """A quantized block is read whole: its codes and its scales, block_size x Hkv x (head_dim + 4) bytes."""
    b = random_paged_batch([7, 30, 1], [1, 1, 1], 6, 2, 16, 4, seed=3, head_major=True, kv_dtype=torch.int8)
    run, num_bytes = kernel.block_read(b)
    run()
    blocks = sum(-(-n // 4) for n in (7, 30, 1))
    assert num_bytes == 2 * blocks * 4 * 2 * (16 + 4)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "bfloat16"])
def test_the_dense_baseline_attends_over_what_the_cache_holds(kv_dtype):
    """make_batch's contiguous keys and values are the cache's own values, dequantized: each sequence's
    blocks read through its table (a quantized row: its codes times its scale; a key's then times its
    channel's smoothing factor plus its mean)."""
    args = kernel.parse_args(["--block-size", "4"])
    b = kernel.make_batch("smollm2", "fp32", kv_dtype, [7, 30], args, scattered=True)
    assert b.q.dtype == torch.float32 and b.k_cache.dtype == kernel.KV_DTYPES[kv_dtype]
    for s, n in enumerate([7, 30]):
        ids = b.block_tables[s, : -(-n // 4)].long()
        for cache, held in ((b.k_cache, b.keys[s]), (b.v_cache, b.values[s])):
            values = cache[ids].float()
            scales = kv_scales(cache)
            if scales is not None:
                values = values * scales[ids][..., None]
                if cache is b.k_cache:
                    mean, factor = key_smoothing(cache)
                    values = values * factor + mean
            assert torch.equal(held, values.flatten(0, 1)[:n])
