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
        assert r["paged_ms"] > 0 and r["contiguous_ms"] > 0
        assert r["ratio"] == pytest.approx(r["paged_ms"] / r["contiguous_ms"], rel=0.01, abs=1e-3)


def test_table_output(capsys):
    assert kernel.main([*TINY, "--shapes", "smollm2", "--backends", "torch", "--dtypes", "fp32"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split() == ["shape", "backend", "dtype", "paged", "ms", "contig", "ms", "ratio"]
    assert lines[2].split()[:3] == ["smollm2", "torch", "fp32"]


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
