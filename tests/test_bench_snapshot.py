"""`pagedllm bench snapshot`: the dashboard's snapshot timed next to decode steps of a full batch."""

from __future__ import annotations

import json

import pytest
from helpers import assert_all_blocks_free

from pagedllm.bench import snapshot


def test_snapshot_bench_json(capsys):
    argv = ["--num-seqs", "6", "--steps", "2", "--input-len", "5-20", "--kv-cache-memory", "16MiB", "--json"]
    assert snapshot.main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["running"] == 6 and result["steps"] == 2
    assert result["num_blocks"] == 16 * 2**20 // (46080 * 16)  # SmolLM2 fp32: 46,080 bytes of KV a token
    assert result["step_ms"] > 0 and result["snapshot_ms"] > 0 and result["encode_ms"] > 0


def test_the_timed_steps_decode_the_whole_batch_and_the_payload_is_the_engine_after_the_last():
    """Read by a step observer, the engine's own trace and stats: every timed step decodes all six
    sequences and prefills nothing; the payload timed last is the engine as the last step left it, and
    its size is this test's own encoding of it (starlette's JSONResponse: compact, UTF-8)."""
    args = snapshot.build_parser().parse_args(
        ["--num-seqs", "6", "--steps", "3", "--kv-cache-memory", "16MiB"]
    )
    args.input_len = (5, 20)
    engine = snapshot.make_llm(args).engine
    seen = []
    engine.add_step_observer(lambda trace: seen.append((trace, engine.stats())))
    result, payload = snapshot.measure(engine, args)
    timed = seen[-args.steps :]
    assert [(trace.decode_seqs, trace.prefill_tokens) for trace, _ in timed] == [(6, 0)] * 3
    trace, stats = seen[-1]
    assert payload["step"] == trace.step == stats.num_steps
    assert payload["queues"] == {"running": 6, "waiting": 0, "swapped": 0} and stats.num_running == 6
    usage = stats.kv_usage
    assert payload["usage"] == usage.parts() | {"shared_saved": usage.shared_saved_slots}
    assert sorted(seq["request"] for seq in payload["seqs"]) == [f"snap-{i}" for i in range(6)]
    # Random prompts share no block: every token of every sequence is a live slot of its own.
    assert sum(seq["tokens"] for seq in payload["seqs"]) == usage.live_slots
    encoded = json.dumps(payload, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    assert result["json_bytes"] == len(encoded)
    assert result["running"] == 6
    assert_all_blocks_free(engine)


def test_snapshot_bench_says_when_the_batch_does_not_fit(capsys):
    """2 MiB = 2 blocks of 32 float16 tokens: one 40-token prompt (2 blocks) at a time."""
    with pytest.raises(
        SystemExit, match=r"at most 1 of 8 sequences ran at once \(0 preemptions\): raise --kv-cache-memory"
    ):
        snapshot.main(
            ["--num-seqs", "8", "--steps", "1", "--input-len", "40-40", "--kv-cache-memory", "2MiB"]
        )
