"""`pagedllm bench snapshot`: the dashboard's snapshot timed next to decode steps of a full batch."""

from __future__ import annotations

import json

import pytest

from pagedllm.bench import snapshot


def test_snapshot_bench_times_every_sequence_decoding(capsys):
    argv = ["--num-seqs", "6", "--steps", "2", "--input-len", "5-20", "--kv-cache-memory", "16MiB", "--json"]
    assert snapshot.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["running"] == 6 and result["steps"] == 2
    assert result["num_blocks"] == 16 * 2**20 // (46080 * 16)  # SmolLM2 fp32: 46,080 bytes of KV a token
    assert result["step_ms"] > 0 and result["snapshot_ms"] > 0 and result["json_bytes"] > 100
    assert result["snapshot_per_step"] == pytest.approx(result["snapshot_ms"] / result["step_ms"])


def test_snapshot_bench_says_when_the_batch_does_not_fit(capsys):
    """4 MiB = 5 blocks: one 40-token prompt (3 blocks) at a time."""
    with pytest.raises(
        SystemExit, match=r"at most 1 of 8 sequences ran at once \(0 preemptions\): raise --kv-cache-memory"
    ):
        snapshot.main(
            ["--num-seqs", "8", "--steps", "1", "--input-len", "40-40", "--kv-cache-memory", "4MiB"]
        )
