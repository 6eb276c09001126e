"""`pagedllm bench throughput` runs every layout on the real model and reports comparable rows."""

from __future__ import annotations

import json

from pagedllm.bench import throughput


def test_throughput_bench_json(capsys):
    argv = [
        "--num-prompts",
        "4",
        "--input-len",
        "5-40",
        "--output-len",
        "6",
        "--kv-cache-memory",
        "8MiB",
        "--max-model-len",
        "64",
        "--layouts",
        "paged",
        "contiguous-max",
        "--json",
    ]
    assert throughput.main(argv) == 0
    rows = {r["system"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert set(rows) == {"paged", "contiguous-max"}
    for row in rows.values():
        assert row["output_tokens"] == 4 * 6
        assert 0 < row["live_fraction"] <= 1
    # 8 MiB of SmolLM2 KV holds ~180 tokens: two 64-slot slabs, but all four short paged requests.
    assert rows["contiguous-max"]["max_batch"] == 2
    assert rows["paged"]["max_batch"] == 4
