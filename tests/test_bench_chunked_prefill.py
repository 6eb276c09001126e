"""`pagedllm bench chunked-prefill` on a tiny model: what it counts (timings are not asserted)."""

from __future__ import annotations

import json

from pagedllm.bench import chunked_prefill


def test_the_long_prompt_is_prefilled_in_chunks_beside_the_decodes(tiny_llama_dir, capsys):
    argv = ["--model", str(tiny_llama_dir), "--num-running", "4", "--long-prompt-len", "300"]
    assert (
        chunked_prefill.main([*argv, "--max-num-batched-tokens", "32", "--kv-cache-memory", "4MiB", "--json"])
        == 0
    )
    unchunked, chunked = json.loads(capsys.readouterr().out)["rows"]
    assert (unchunked["engine"], unchunked["long_prefill_steps"]) == ("unchunked", 1)
    # Each step decodes the 4 running requests and spends the other 28 tokens on the prompt.
    assert (chunked["engine"], chunked["long_prefill_steps"]) == ("chunked", -(-300 // 28))
    assert chunked["max_num_batched_tokens"] == 32 and unchunked["max_num_batched_tokens"] >= 304
    for row in (unchunked, chunked):
        assert 0 < row["median_gap_before_s"] and 0 < row["max_gap_after_s"] and 0 < row["long_ttft_s"]
