"""`pagedllm bench sharing`: block counts by hand, the shape of the savings, the real-model run."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedllm.bench import sharing
from pagedllm.bench.trace import Request


def test_two_samples_of_a_two_block_prompt_by_hand():
    """32-token prompt (2 blocks of 16), 2 samples of 16 tokens: the samples share the prompt's two
    blocks and hold one block each, 4 blocks in use against 3 + 3 = 6 unshared at every step."""
    replay = sharing._Replay("parallel", 2, block_size=16, seed=0)
    shared, unshared, steps = replay.run([Request(0, 0, 32, 16)], [[16, 16]])
    assert (shared, unshared, steps) == (4, 6, 16)


@pytest.mark.parametrize("mode", sharing.MODES)
def test_one_sequence_per_request_shares_nothing(mode):
    trace = [Request(0, 0, 20, 30), Request(1, 3, 40, 9)]
    shared, unshared, _ = sharing._Replay(mode, 1, block_size=16, seed=0).run(trace, [[30], [9]])
    assert shared == unshared > 0


def test_small_run_has_the_papers_shape(capsys):
    assert sharing.main(["--num-requests", "30", "--json"]) == 0
    rows = {(r["workload"], r["mode"], r["width"]): r for r in json.loads(capsys.readouterr().out)["rows"]}
    assert len(rows) == 12
    for (workload, mode, width), r in rows.items():
        assert 0 < r["saving"] < 1 - 1 / width and r["blocks_shared"] < r["blocks_unshared"]
        if width > 2:  # more sequences per request share more
            assert r["saving"] > rows[(workload, mode, width - 2)]["saving"]
    for width in (2, 4, 6):
        for workload in ("sharegpt", "alpaca"):  # beams share their common output, samples only the prompt
            assert rows[(workload, "beam", width)]["saving"] > rows[(workload, "parallel", width)]["saving"]
        # longer prompts: more to share between samples
        assert rows[("sharegpt", "parallel", width)]["saving"] > rows[("alpaca", "parallel", width)]["saving"]


def test_synthetic_lm_has_the_measured_shape():
    import random
    import statistics

    lm = sharing.SyntheticLM(random.Random(0))
    tops = [lm.top(4) for _ in range(4000)]
    assert all(ids == sorted(ids, key=lambda t: -lps[ids.index(t)]) for lps, ids in tops[:50])
    top1 = [max(lps) for lps, _ in tops]
    assert statistics.fmean(2.718281828**p for p in top1) == pytest.approx(0.63, abs=0.05)


def test_real_model_run_reads_the_allocator(smollm2_llm):
    args = argparse.Namespace(model="smollm2-135m", real_tokens=6, seed=0)
    rows = sharing.run_real(args)
    assert [(r.mode, r.width) for r in rows] == [("parallel", 4), ("beam", 4)]
    for r in rows:
        assert 0 < r.saving < 0.75 and r.steps >= 6


def test_plot_writes_a_png(tmp_path):
    rows = [
        sharing.Row(w, m, n, 50.0, 100.0 + n, 10)
        for w in ("sharegpt", "alpaca")
        for m in sharing.MODES
        for n in (2, 4)
    ]
    sharing.plot(rows, tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
