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
    report = json.loads(capsys.readouterr().out)
    prompts = throughput.make_prompts(4, 5, 40, 49152, seed=0)  # the default seed, SmolLM2's vocabulary
    assert report["workload"] == {
        "num_prompts": 4,
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": 4 * 6,
    }
    rows = {r["system"]: r for r in report["rows"]}
    assert set(rows) == {"paged", "contiguous-max"}
    for row in rows.values():
        assert row["output_tokens"] == 4 * 6
        assert 0 < row["live_fraction"] <= 1
        assert row["same_tokens_as_paged"] == 1.0  # same greedy tokens whatever the KV layout
        assert row["preemptions"] == 0
    # 8 MiB of SmolLM2 KV holds ~180 tokens: two 64-slot slabs, but all four short paged requests.
    assert rows["contiguous-max"]["max_batch"] == 2
    assert rows["paged"]["max_batch"] == 4


def test_throughput_table_prints_the_workload_and_dashes_for_unreported_values(capsys):
    assert throughput.main(["--num-prompts", "2", "--input-len", "4-9", "--output-len", "3",
                            "--kv-cache-memory", "4MiB", "--max-model-len", "32", "--layouts", "paged",
                            "--watermark", "0", "0.2"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    prompt_tokens = sum(len(p) for p in throughput.make_prompts(2, 4, 9, 49152, seed=0))
    assert lines[0].startswith(f"workload: 2 prompts of 4-9 random tokens, {prompt_tokens} prompt tokens")
    assert "3 output tokens each = 6;" in lines[0] and "watermark 0 / 0.2" in lines[0]
    sweep = [line.split() for line in lines[2:4]]
    assert [cells[:2] for cells in sweep] == [["paged", "w=0"], ["paged", "w=0.2"]]
    assert all(cells[3] == "6" for cells in sweep)  # output tokens
    assert all(cells[-1] == "100%" for cells in sweep)  # both watermarks, the same greedy tokens
    assert lines[4].startswith("paged w=0 / paged w=0.2: ")
    row = throughput.Row("hf batch 2", 1.0, 6, 6.0, None, None, None, None, None)
    assert throughput.format_row(row).split()[-5:] == ["-"] * 5
