"""Prefix cache tiers in the engine: host memory under a device cache too small to keep the prompts, a
disk tier found again by a restarted engine (and by no other model or dtype), files damaged by hand or
by a process killed while writing them. Tokens always equal a run without any cache."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.engine.config import EngineConfig
from pagedllm.entrypoints.openai.metrics import EngineMetrics
from tests.helpers import assert_all_blocks_free

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
SYSTEM = "You are a careful assistant. Answer in one short sentence, and never make anything up. " * 4
PROMPTS = [SYSTEM + f"Question {i}: what is {i} plus {i + 1}? " * 3 for i in range(5)]
SMALL = {"num_kv_blocks": 6, "max_model_len": 512}  # blocks of 32: one prompt and a half, the rest evicted


@pytest.fixture(scope="module")
def model(tiny_chat_model) -> str:
    """A tiny random Llama with SmolLM2's tokenizer: the tiers' paths at a fraction of a real model's cost."""
    return str(tiny_chat_model)


@pytest.fixture(scope="module")
def reference(model) -> list[list[int]]:
    llm = LLM(model, num_kv_blocks=256, max_model_len=512, enable_prefix_caching=False)
    tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    assert_all_blocks_free(llm)
    return tokens


def one_by_one(llm: LLM) -> tuple[list[list[int]], list[int]]:
    """Each prompt in a request of its own: the tokens, and each prompt's cached tokens."""
    outs = [llm.generate([p], GREEDY)[0] for p in PROMPTS]
    return [o.outputs[0].token_ids for o in outs], [o.num_cached_tokens for o in outs]


def on_disk(model: str, tmp_path: Path) -> dict:
    """Run the prompts once on a disk-tiered engine, which then goes away: its blocks stay in tmp_path. The
    settings to restart it with."""
    tiered = {**SMALL, "kv_offload_memory": "4MiB", "kv_offload_dir": str(tmp_path)}
    writer = LLM(model, **tiered)
    one_by_one(writer)
    assert_all_blocks_free(writer)
    del writer
    return tiered


def full_blocks(llm: LLM) -> list[int]:
    """The most a prefix hit can be for each prompt: its full blocks before its last token."""
    block = llm.engine.config.block_size
    return [(len(llm.engine.tokenizer.encode(p)) - 1) // block * block for p in PROMPTS]


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_host_tier_serves_what_the_device_cache_evicted(model, reference, preemption_mode):
    llm = LLM(model, **SMALL, kv_offload_memory="8MiB", preemption_mode=preemption_mode)
    first, _ = one_by_one(llm)
    before = llm.engine.stats().kv_tiers
    second, cached = one_by_one(llm)
    tiers = llm.engine.stats().kv_tiers
    assert first == reference and second == reference
    assert before.counters.offloaded_blocks > 0
    assert tiers.counters.host_hit_blocks > before.counters.host_hit_blocks
    assert cached == full_blocks(llm)  # every prompt whole, from the device cache or the host tier
    assert tiers.host_cached_blocks <= tiers.host_blocks
    # Several prompts at once: loads, evictions and swaps in the same steps.
    both = llm.generate(PROMPTS * 2, GREEDY)
    assert [o.outputs[0].token_ids for o in both] == reference * 2
    metrics = EngineMetrics()
    metrics.observe(llm.engine)
    counters = llm.engine.stats().kv_tiers.counters
    get = metrics.registry.get_sample_value
    assert get("pagedllm:kv_offload_hit_blocks_total", {"tier": "host"}) == counters.host_hit_blocks
    assert get("pagedllm:kv_offload_stored_blocks_total", {"tier": "host"}) == counters.offloaded_blocks
    cfg, config = llm.engine.model.config, llm.engine.config  # a block's bytes from the model's shape: K and
    # V of every layer, float16 (the CPU's default)
    block_bytes = cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * config.block_size * 2
    assert config.kv_torch_dtype == torch.float16
    for transfer, blocks in (
        ("GPU_to_CPU", counters.offloaded_blocks),
        ("CPU_to_GPU", counters.host_hit_blocks),
    ):
        assert (
            get("pagedllm:kv_offload_total_bytes_total", {"transfer_type": transfer}) == blocks * block_bytes
        )
    block = llm.engine.config.block_size
    assert get("pagedllm:external_prefix_cache_hits_total") == counters.host_hit_blocks * block
    assert get("pagedllm:external_prefix_cache_queries_total") == llm.engine.stats().prefix_cache_queries
    assert get("pagedllm:kv_offload_size_blocks", {"tier": "host"}) == tiers.host_blocks
    assert_all_blocks_free(llm)


def test_disk_tier_survives_a_restart_and_is_never_read_by_another_dtype(model, reference, tmp_path):
    tiered = {**SMALL, "kv_offload_memory": "4MiB", "kv_offload_dir": str(tmp_path)}
    llm = LLM(model, **tiered)
    assert one_by_one(llm)[0] == reference
    written = llm.engine.stats().kv_tiers.counters.persisted_blocks
    assert written > 0 and len(list(tmp_path.glob("*/*.kv"))) == written
    assert_all_blocks_free(llm)
    del llm
    restarted = LLM(model, **tiered)
    tokens, cached = one_by_one(restarted)
    counters = restarted.engine.stats().kv_tiers.counters
    assert tokens == reference
    assert counters.disk_hit_blocks > 0 and cached[0] > 0  # the very first prompt after the restart
    assert counters.persisted_blocks == 0  # everything was on disk already
    assert_all_blocks_free(restarted)
    del restarted
    other = LLM(model, **tiered, kv_cache_dtype="bfloat16")
    _, cached = one_by_one(other)
    assert cached[0] == 0 and other.engine.stats().kv_tiers.counters.disk_hit_blocks == 0
    assert len([p for p in tmp_path.iterdir() if p.is_dir()]) == 2  # a folder per fingerprint
    assert_all_blocks_free(other)


def test_a_disk_load_in_flight_does_not_hold_up_other_requests(model, reference, tmp_path):
    tiered = on_disk(model, tmp_path)
    short = "Count with me: one, two"  # under one block: nothing of it is on disk
    decode = SamplingParams(max_tokens=12, temperature=0.0)
    clean = LLM(model, num_kv_blocks=64, max_model_len=512, enable_prefix_caching=False)
    want_short = clean.generate([short], decode)[0].outputs[0].token_ids
    assert_all_blocks_free(clean)
    engine = LLM(model, **tiered).engine  # restarted: the prompts' blocks are on disk only
    gate, read = threading.Event(), engine.transfers.store.read
    engine.transfers.store.read = lambda key: (
        gate.wait(60) and read(key)
    )  # the disk is slow until the gate opens
    engine.add_request("decoder", short, decode)
    engine.step()  # its prefill
    engine.add_request("loader", PROMPTS[0], GREEDY)
    tokens: dict[str, list[int]] = {}
    for _ in range(4):  # the loader's blocks are being read: the decoder steps on meanwhile
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
        assert engine.transfers.reader.num_pending == 1 and engine.stats().kv_tiers.reading_blocks > 0
    assert len(tokens["decoder"]) == 5 and "loader" not in tokens
    (loader,) = engine.requests["loader"].seqs
    assert loader.loading_kv and engine.stats().num_waiting == 1
    gate.set()
    num_cached = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = out.outputs[0].token_ids
            num_cached = out.num_cached_tokens if out.request_id == "loader" else num_cached
    assert tokens["decoder"] == want_short and tokens["loader"] == reference[0]
    block = engine.config.block_size
    assert num_cached == (len(engine.tokenizer.encode(PROMPTS[0])) - 1) // block * block  # all from disk
    assert engine.stats().kv_tiers.counters.disk_hit_blocks == num_cached // block
    assert engine.stats().kv_tiers.reading_blocks == 0 and engine.stats().kv_all_free
    engine.shutdown()


def test_a_flipped_byte_and_a_truncated_file_are_detected_and_recomputed(model, reference, tmp_path):
    tiered = on_disk(model, tmp_path)
    files = sorted(tmp_path.glob("*/*.kv"), key=lambda p: p.stat().st_mtime_ns)
    flipped, truncated = files[0], files[1]  # the first prompt's first two blocks
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0x01
    flipped.write_bytes(bytes(data))
    truncated.write_bytes(truncated.read_bytes()[:1000])
    restarted = LLM(model, **tiered)
    tokens, cached = one_by_one(restarted)
    counters = restarted.engine.stats().kv_tiers.counters
    assert tokens == reference
    assert counters.disk_corrupt_blocks >= 1  # the first block's file: the prefix stops there
    assert cached[0] == 0  # nothing before the bad block could be served
    assert counters.persisted_blocks >= 1  # the recomputed blocks were written again, whole
    for path in (flipped, truncated):
        assert not path.exists() or _whole(path)
    assert_all_blocks_free(restarted)


def _whole(path: Path) -> bool:
    import hashlib

    from pagedllm.engine.kv_store import DIGEST_BYTES, MAGIC

    data = path.read_bytes()
    payload = data[len(MAGIC) + DIGEST_BYTES :]
    return hashlib.blake2b(payload, digest_size=DIGEST_BYTES).digest() == data[len(MAGIC) : len(MAGIC) + 32]


WRITER = """
import sys
from pagedllm import LLM, SamplingParams
settings = dict(num_kv_blocks=24, max_model_len=512, kv_offload_memory="4MiB")
llm = LLM(sys.argv[2], **settings, kv_offload_dir=sys.argv[1])
prompts = [f"Write {i}. " * 60 for i in range(10_000)]
print("ready", flush=True)
while True:
    for p in prompts:
        llm.generate([p], SamplingParams(max_tokens=1, temperature=0.0))
"""


def test_a_process_killed_while_writing_leaves_nothing_that_is_served(model, reference, tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(WRITER), str(tmp_path), model],
        stdout=subprocess.PIPE,
        cwd=Path(__file__).parents[1],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])},
    )
    try:
        assert proc.stdout.readline().strip() == b"ready"
        deadline = time.monotonic() + 120
        while len(list(tmp_path.glob("*/*.kv"))) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert len(list(tmp_path.glob("*/*.kv"))) >= 40
    # Also what a write without the rename would leave: a final name holding half a block.
    folder = next(p for p in tmp_path.iterdir() if p.is_dir())
    victim = sorted(folder.glob("*.kv"))[0]
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    llm = LLM(
        model, num_kv_blocks=24, max_model_len=512, kv_offload_memory="4MiB", kv_offload_dir=str(tmp_path)
    )
    assert not list(folder.glob("*.tmp.*"))  # a write the kill interrupted is cleared at start-up
    assert one_by_one(llm)[0] == reference
    killed = [f"Write {i}. " * 60 for i in range(3)]  # the prompts the killed process wrote
    clean = LLM(model, num_kv_blocks=256, max_model_len=512, enable_prefix_caching=False)
    want = [o.outputs[0].token_ids for o in clean.generate(killed, GREEDY)]
    assert [o.outputs[0].token_ids for o in llm.generate(killed, GREEDY)] == want
    assert llm.engine.stats().kv_tiers.counters.disk_hit_blocks > 0
    assert_all_blocks_free(llm)
    assert_all_blocks_free(clean)


def test_bad_tier_settings_are_refused_naming_them():
    with pytest.raises(ValueError, match="kv_offload_memory"):
        EngineConfig(kv_offload_memory="lots")
    with pytest.raises(ValueError, match="kv_offload_disk"):
        EngineConfig(kv_offload_dir="/tmp/x", kv_offload_disk="-1GiB")
    with pytest.raises(ValueError, match="kv_layout='paged'"):
        EngineConfig(kv_offload_memory="1GiB", kv_layout="contiguous")
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(kv_offload_memory="1GiB", enable_prefix_caching=False)
