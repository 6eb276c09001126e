"""The pieces of `--routing kv` that need no Ray cluster: vLLM's wire shape of the KV event batches, the
index they feed, and the ingress's prompt hashes against what a real engine's prefix cache holds after
serving the same completion and chat requests (the Ray side: tests/test_replicas.py)."""

from __future__ import annotations

import msgpack
import pytest

pytest.importorskip("ray.serve")

from helpers import assert_all_blocks_free  # noqa: E402

from pagedllm import LLM, SamplingParams  # noqa: E402
from pagedllm.entrypoints.openai import protocol as p  # noqa: E402
from pagedllm.entrypoints.openai.kv_routing import (  # noqa: E402
    KVCacheIndex,
    PromptBlocks,
    decode_batch,
    encode_batch,
)
from pagedllm.entrypoints.openai.serving_chat import chat_prompt  # noqa: E402
from pagedllm.entrypoints.openai.tools import template_messages  # noqa: E402
from pagedllm.kv.events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402


def test_a_batch_is_vllms_array_like_tagged_msgpack_and_decodes_back():
    events = [
        AllBlocksCleared(),
        BlockStored([b"\x01" * 32], None, list(range(16)), 16, None, "CPU"),
        BlockStored([b"\x02" * 32], b"\x01" * 32, list(range(16, 32)), 16, None, "CPU"),
        BlockRemoved([b"\x01" * 32], "CPU"),
    ]
    payload = encode_batch(events, 12.5)
    # what msgspec writes for vLLM's KVEventBatch (array_like=True, tag=True: the class name first)
    assert msgpack.unpackb(payload) == [
        12.5,
        [
            ["AllBlocksCleared"],
            ["BlockStored", [b"\x01" * 32], None, list(range(16)), 16, None, "CPU"],
            ["BlockStored", [b"\x02" * 32], b"\x01" * 32, list(range(16, 32)), 16, None, "CPU"],
            ["BlockRemoved", [b"\x01" * 32], "CPU"],
        ],
    ]
    assert decode_batch(payload) == (12.5, events)


@pytest.fixture(scope="module")
def llm(tiny_chat_model):
    return LLM(str(tiny_chat_model), max_model_len=256, num_kv_blocks=32, block_size=16)


def test_the_index_holds_what_the_engine_caches_and_matches_the_ingress_hashes(llm):
    engine = llm.engine
    log = engine.enable_kv_events()
    index = KVCacheIndex()
    blocks = PromptBlocks(engine.tokenizer, "tiny", engine.config.block_size)
    completion = p.CompletionRequest(model="tiny", prompt="alpha bravo charlie " * 12, max_tokens=2)
    messages = [{"role": "system", "content": "be brief " * 20}, {"role": "user", "content": "hi"}]
    chat = p.ChatCompletionRequest(model="tiny", messages=messages, max_tokens=2)
    chat_ids = chat_prompt(engine, template_messages(chat.messages), True)
    params = SamplingParams(max_tokens=2, temperature=0)
    llm.generate([completion.prompt, {"prompt_token_ids": chat_ids}], params)
    index.publish("r1", 0, encode_batch(log.drain(), 0.0))
    for request in (completion, chat):
        key = blocks.key("text", request)
        assert (
            key.num_tokens >= 2 * key.block_size and len(key.block_hashes) == key.num_tokens // key.block_size
        )
        # every full prompt block is cached, the first one's chain matching the ingress's hashes
        assert index.match(list(key.block_hashes), ["r1", "r2"]) == [
            (len(key.block_hashes), len(index.held["r1"])),
            (0, 0),
        ]
    # evictions: fill the small cache with other prompts until the first one's blocks are gone
    first = blocks.key("text", completion).block_hashes
    seq = 1
    for i in range(20):
        llm.generate([f"{i} other words to evict the cache " * 6], params)
        index.publish("r1", seq, encode_batch(log.drain(), 0.0))
        seq += 1
        if index.match(list(first), ["r1"])[0][0] < len(first):
            break
    else:
        pytest.fail("the first prompt's blocks were never evicted")
    assert index.held["r1"] == {h for g, h in engine.allocator.pool.cached if g == 0}
    assert_all_blocks_free(llm)


def test_a_request_the_replica_will_refuse_gets_no_hashes(llm):
    blocks = PromptBlocks(llm.engine.tokenizer, "tiny", 16)
    bad = p.ChatCompletionRequest(
        model="tiny", messages=[{"role": "user", "content": "x"}], tool_choice="required"
    )
    assert blocks.key("text", bad).block_hashes == ()
    assert blocks.key("models", None).prompt == "models"


def test_a_request_under_an_adapter_is_hashed_as_the_engine_keys_its_blocks(tiny_chat_model, tmp_path):
    """The same prompt under an adapter and under the base: the ingress's two chains are the engine's two
    (the replica that ran the adapter holds all of its chain and none of the base's, and the reverse)."""
    pytest.importorskip("peft")
    from test_lora import ATTENTION, make_adapter

    from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels

    adapter = make_adapter(tiny_chat_model, tmp_path / "first", ATTENTION, seed=5)
    # the ingress's names and ids, and a replica's: each numbers the same lora_modules alike
    models = OpenAIServingModels("tiny", 0, lora_modules={"other": str(adapter), "first": str(adapter)})
    settings = dict(max_model_len=256, num_kv_blocks=32, block_size=16, enable_lora=True, max_lora_rank=8)
    replicas = {name: LLM(str(tiny_chat_model), **settings) for name in ("r1", "r2")}
    engine = replicas["r1"].engine
    blocks = PromptBlocks(engine.tokenizer, "tiny", engine.config.block_size, models)
    prompt = "alpha bravo charlie " * 12
    under = {name: p.CompletionRequest(model=name, prompt=prompt, max_tokens=2) for name in ("first", "tiny")}
    keys = {name: blocks.key("text", request).block_hashes for name, request in under.items()}
    assert len(keys["first"]) >= 2 and not set(keys["first"]) & set(keys["tiny"])
    params = SamplingParams(max_tokens=2, temperature=0)
    index = KVCacheIndex()
    for (replica, llm), name in zip(replicas.items(), ("first", "tiny"), strict=True):
        log = llm.engine.enable_kv_events()
        llm.generate([prompt], params, lora_request=models.lora_request(name))
        index.publish(replica, 0, encode_batch(log.drain(), 0.0))
    n = len(keys["first"])
    assert [found for found, _ in index.match(list(keys["first"]), ["r1", "r2"])] == [n, 0]
    assert [found for found, _ in index.match(list(keys["tiny"]), ["r1", "r2"])] == [0, n]
    for llm in replicas.values():
        assert_all_blocks_free(llm)
