"""`pagedllm bench tiers` end to end on a tiny model: every tier's row, the same tokens, no leak."""

from __future__ import annotations

from pagedllm.bench import tiers


def test_bench_tiers_prints_each_length_with_the_same_tokens(tiny_chat_model, capsys, tmp_path):
    argv = ["--model", str(tiny_chat_model), "--prompt-lens", "40", "100", "--dir", str(tmp_path)]
    assert tiers.main([*argv, "--kv-offload-memory", "4MiB"]) == 0  # 0: every row's tokens agree
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.split() and line.split()[0].isdigit()]
    assert [row[0] for row in rows] == ["40", "100"]
    assert all(row[6] == "True" for row in rows)
    assert list(tmp_path.glob("*/*.kv"))  # the disk tier's files, in the folder asked for
