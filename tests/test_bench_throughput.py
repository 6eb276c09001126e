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


def test_shared_prefix_workload_compares_prefix_caching_on_and_off(capsys):
    argv = ["--num-prompts", "8", "--input-len", "5-20", "--output-len", "4", "--shared-prefix-len", "64"]
    assert throughput.main([*argv, "--kv-cache-memory", "16MiB", "--max-model-len", "128", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["system"]: r for r in out["rows"]}
    assert list(rows) == ["paged", "paged-no-prefix-cache"]
    prompts = throughput.make_prompts(8, 5, 20, 49152, 0, shared_prefix_len=64)
    assert all(p[:64] == prompts[0][:64] for p in prompts)
    # Admitted in one step, the first prompt computes the four prefix blocks the seven others reuse.
    assert rows["paged"]["prefix_hit_rate"] == 7 * 64 / sum(len(p) for p in prompts)
    assert rows["paged-no-prefix-cache"]["prefix_hit_rate"] is None
    assert rows["paged-no-prefix-cache"]["same_tokens_as_paged"] == 1.0
    assert all(r["mean_ttft_s"] > 0 for r in rows.values())
