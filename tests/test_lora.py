"""LoRA adapters (issue 49): PEFT adapters made here on tiny random bases, against transformers + peft.

Every adapter has random A and non-zero random B (peft starts B at zero: an adapter that changes nothing
would pass any test), so its tokens differ from the base's, which each test checks where it matters.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import FLOAT32_KV, assert_all_blocks_free
from models_helpers import hf_greedy
from test_models_families import FAMILIES, randomize

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.bench.lora import make_random_adapter as make_adapter

pytest.importorskip("peft")

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 17, 99, 3, 250], list(range(30, 63)), [7] * 3 + list(range(100, 140)), [300, 1, 2]]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = ATTENTION + ["gate_proj", "up_proj", "down_proj"]


def peft_greedy(base: Path, adapter: Path | None, prompts: list[list[int]], gguf_file: str | None = None):
    """The oracle: transformers on the base (a GGUF file dequantized by transformers), peft's adapter."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, gguf_file=gguf_file)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return hf_greedy(model.eval(), prompts, GREEDY.max_tokens)


def tokens(outputs) -> list[list[int]]:
    return [out.outputs[0].token_ids for out in outputs]


@pytest.fixture(scope="module")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    """A tiny random Qwen2 (q/k/v biases, untied head)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
        vocab_size=384, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(model, seed=1)
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory) -> dict[str, Path]:
    """Adapters of the tiny Llama: attention only; every projection with rsLoRA; the MLP only, rank 4."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "attn": make_adapter(tiny_llama_dir, root / "attn", ATTENTION, seed=1),
        "all": make_adapter(tiny_llama_dir, root / "all", ALL, seed=2, use_rslora=True),
        "mlp": make_adapter(tiny_llama_dir, root / "mlp", ["gate_proj", "down_proj"], r=4, seed=3),
    }


def lora_llm(base: Path, **kwargs) -> LLM:
    settings = dict(
        enable_lora=True, max_loras=2, max_lora_rank=8, num_kv_blocks=64, block_size=16, **FLOAT32_KV
    )
    return LLM(str(base), **{**settings, **kwargs})


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_adapters_give_peft_tokens(family, tiny_llama_dir, tiny_qwen2_dir, adapters, tmp_path):
    base = tiny_llama_dir if family == "llama" else tiny_qwen2_dir
    folders = adapters if family == "llama" else {"all": make_adapter(base, tmp_path / "all", ALL, seed=4)}
    llm = lora_llm(base)
    base_tokens = tokens(llm.generate(PROMPTS, GREEDY))
    assert base_tokens == peft_greedy(base, None, PROMPTS)
    for i, (name, folder) in enumerate(folders.items(), 1):
        got = tokens(llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest(name, i, str(folder))))
        assert got == peft_greedy(base, folder, PROMPTS), name
        assert got != base_tokens, f"adapter {name} changed no token: the test would not see it"
    assert_all_blocks_free(llm)


def test_a_mixed_batch_equals_each_request_alone(tiny_llama_dir, adapters):
    """Two adapters and the base in the same steps (prefill chunks and decodes), each row its own update."""
    llm = lora_llm(tiny_llama_dir, enable_prefix_caching=False)
    attn, mlp = LoRARequest("attn", 1, str(adapters["attn"])), LoRARequest("mlp", 2, str(adapters["mlp"]))
    loras = [attn, None, mlp, attn]
    mixed = tokens(llm.generate(PROMPTS, GREEDY, lora_request=loras))
    pairs = zip(PROMPTS, loras, strict=True)
    alone = [tokens(llm.generate([p], GREEDY, lora_request=lora))[0] for p, lora in pairs]
    assert mixed == alone
    assert len({tuple(t) for t in mixed[:3]}) == 3
    assert_all_blocks_free(llm)


def test_two_ranks_with_adapters_generate_one_rank_s_tokens(tiny_llama_dir, adapters):
    """Tensor parallelism: each rank holds its rows of B for q / k / v / gate / up and its columns of A for
    o / down (whose partial updates the all-reduce sums with the base's); a mixed batch of two adapters
    and the base gets one process's tokens, and the workers learn each adapter from rank 0."""
    everything, mlp = LoRARequest("all", 1, str(adapters["all"])), LoRARequest("mlp", 2, str(adapters["mlp"]))
    loras = [everything, None, mlp, everything]
    settings = dict(enable_prefix_caching=False, max_num_batched_tokens=32)  # prefill chunks beside decodes
    one = lora_llm(tiny_llama_dir, **settings)
    expected = tokens(one.generate(PROMPTS, GREEDY, lora_request=loras))
    two = lora_llm(tiny_llama_dir, tensor_parallel_size=2, **settings)
    assert tokens(two.generate(PROMPTS, GREEDY, lora_request=loras)) == expected
    assert tokens(two.generate(PROMPTS[2:3], GREEDY, lora_request=mlp)) == expected[2:3]
    base = tokens(one.generate([PROMPTS[0], PROMPTS[2]], GREEDY))
    assert base[0] != expected[0] and base[1] != expected[2]  # both adapters change tokens
    assert_all_blocks_free(one)
    assert_all_blocks_free(two)


def test_an_adapter_of_fused_projections_beside_one_of_a_single_projection(tmp_path):
    """Phi-3 stores q/k/v as one qkv_proj and gate/up as one gate_up_proj: an adapter of those spans every
    shard of the fused Linear (each slot's block of rows getting its rows of B); in the same steps as an
    adapter of o_proj alone and the base, each request gets peft's tokens."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(2)
    model = AutoModelForCausalLM.from_config(FAMILIES["phi3"](), dtype=torch.float32)
    randomize(model, seed=2)
    base = tmp_path / "phi3"
    model.save_pretrained(base)
    fused = make_adapter(base, tmp_path / "fused", ["qkv_proj", "gate_up_proj"], seed=5)
    single = make_adapter(base, tmp_path / "o", ["o_proj"], r=4, seed=6)
    llm = lora_llm(base, enable_prefix_caching=False)
    loras = [LoRARequest("fused", 1, str(fused)), None, LoRARequest("o", 2, str(single))]
    got = tokens(llm.generate(PROMPTS[:3], GREEDY, lora_request=loras))
    expected = [
        peft_greedy(base, folder, [prompt])[0]
        for prompt, folder in zip(PROMPTS[:3], [fused, None, single], strict=True)
    ]
    assert got == expected
    assert got[0] != peft_greedy(base, None, PROMPTS[:1])[0]
    assert_all_blocks_free(llm)


def test_the_prefix_cache_never_shares_blocks_between_adapters(tiny_llama_dir, adapters):
    llm = lora_llm(tiny_llama_dir, max_loras=1)
    prompt = list(range(40, 90))  # three full blocks
    attn, other = LoRARequest("attn", 1, str(adapters["attn"])), LoRARequest("all", 2, str(adapters["all"]))
    base = llm.generate([prompt], GREEDY)[0]
    first = llm.generate([prompt], GREEDY, lora_request=attn)[0]
    assert first.num_cached_tokens == 0  # the base's blocks hold the base's K/V
    assert first.outputs[0].token_ids == peft_greedy(tiny_llama_dir, adapters["attn"], [prompt])[0]
    assert first.outputs[0].token_ids != base.outputs[0].token_ids
    assert llm.generate([prompt], GREEDY, lora_request=other)[0].num_cached_tokens == 0
    again = llm.generate([prompt], GREEDY, lora_request=attn)[0]
    assert again.num_cached_tokens == 48 and again.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.generate([prompt], GREEDY)[0].num_cached_tokens == 48  # the base's blocks are still its own
    stats = llm.engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (5 * len(prompt), 2 * 48)
    assert_all_blocks_free(llm)


def test_the_allocator_keys_blocks_by_adapter_through_decodes_and_forks():
    """kv alone: a prompt's blocks, and the blocks its decodes fill, are found again under its own adapter
    only (a fork's too); the base's keys are those of a cache without adapters."""
    from pagedllm.kv import PagedAllocator
    from pagedllm.kv.block_pool import block_hash_chain, hash_block

    kv = PagedAllocator(num_blocks=32, block_size=4, enable_prefix_caching=True)
    prompt = list(range(9))  # two full blocks and one token
    assert block_hash_chain(prompt, 4) == [
        hash_block(None, prompt[:4]),
        hash_block(block_hash_chain(prompt, 4)[0], prompt[4:8]),
    ]
    assert kv.allocate("a", prompt, 8, lora_int_id=1) == 0
    assert kv.allocate("base", prompt, 8) == 0 and kv.allocate("b", prompt, 8, lora_int_id=2) == 0
    assert kv.allocate("a2", prompt, 8, lora_int_id=1) == 8
    kv.fork("a", "a-child")
    for token in (9, 10, 11):  # fills block 3 of a (and, copied on write, of its child)
        kv.append("a", token)
        kv.append("a-child", token)
    kv.cache_blocks("a", 12)
    longer = prompt + [9, 10, 11, 12]
    assert kv.can_allocate(longer, 4, lora_int_id=1) and kv.allocate("c", longer, 4, lora_int_id=1) == 12
    assert kv.allocate("d", longer, 4, lora_int_id=3) == 0 and kv.allocate("e", longer, 4) == 8
    for seq_id in ("a", "base", "b", "a2", "a-child", "c", "d", "e"):
        kv.free(seq_id)
    assert kv.all_free()


def test_kv_events_name_the_adapter(tiny_llama_dir, adapters):
    llm = lora_llm(tiny_llama_dir)
    events = llm.engine.enable_kv_events()
    prompt = list(range(40, 90))
    llm.generate([prompt], GREEDY, lora_request=LoRARequest("attn", 7, str(adapters["attn"])))
    llm.generate([prompt], GREEDY)
    stored = [e for e in events.drain() if type(e).__name__ == "BlockStored"]
    assert [e.lora_id for e in stored[:3]] == [7, 7, 7] and [e.lora_id for e in stored[-3:]] == [None] * 3
    adapter_blocks = {h for e in stored[:3] for h in e.block_hashes}
    assert not adapter_blocks & {h for e in stored[-3:] for h in e.block_hashes}
    assert_all_blocks_free(llm)


def test_a_gguf_block_base_with_an_adapter(tiny_llama_dir, adapters, tmp_path, monkeypatch):
    """The base's matmul on its Q8_0 blocks, the adapter's update added to it. The oracle is peft on
    transformers' dequantization of the same file: pagedllm multiplies the blocks with x rounded to int8
    blocks (llama.cpp's way), transformers the dequantized floats, so logits differ by ~1e-3 and tokens
    are compared (the tiny base's logits are peaked: no near-tie on these prompts)."""
    from gguf import GGMLQuantizationType
    from models_helpers import write_gguf
    from transformers import AutoModelForCausalLM

    from pagedllm.ops import native

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "bf16_matmul_available", lambda: False)  # float32 arithmetic on every path
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    path = tmp_path / "tiny.gguf"
    write_gguf(hf, path, qtype=GGMLQuantizationType.Q8_0)
    llm = lora_llm(path)
    assert llm.engine.loaded_model.linear_method == "gguf"
    got = tokens(llm.generate(PROMPTS, GREEDY, lora_request=LoRARequest("all", 1, str(adapters["all"]))))
    assert got == peft_greedy(tmp_path, adapters["all"], PROMPTS, gguf_file=path.name)
    assert_all_blocks_free(llm)


def test_bad_adapters_are_refused_before_anything_loads(tiny_llama_dir, tiny_qwen2_dir, adapters, tmp_path):
    llm = lora_llm(tiny_llama_dir, max_lora_rank=4)
    run = lambda folder: llm.generate([PROMPTS[0]], GREEDY, lora_request=LoRARequest("x", 1, str(folder)))  # noqa: E731
    with pytest.raises(ValueError, match=r"rank r=8, above max_lora_rank=4"):
        run(adapters["attn"])
    with pytest.raises(ValueError, match=r"has no adapter_config.json"):
        run(tmp_path)
    broken = tmp_path / "no-weights"
    broken.mkdir()
    shutil.copy(adapters["mlp"] / "adapter_config.json", broken)
    with pytest.raises(ValueError, match=r"has no adapter_model.safetensors"):
        run(broken)
    wide = tmp_path / "wide"  # rank 4, made for a base of another MLP width
    from transformers import AutoConfig, AutoModelForCausalLM

    other_config = AutoConfig.from_pretrained(tiny_llama_dir, intermediate_size=128)
    other = AutoModelForCausalLM.from_config(other_config)
    other.save_pretrained(tmp_path / "other-base")
    make_adapter(tmp_path / "other-base", wide, ["down_proj"], r=4)
    with pytest.raises(ValueError, match=r"down_proj.lora_A.weight' has shape \(4, 128\).*needs \(4, 96\)"):
        run(wide)
    embed = tmp_path / "embed"
    shutil.copytree(adapters["mlp"], embed)
    config = json.loads((embed / "adapter_config.json").read_text())
    (embed / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["lm_head"]}))
    with pytest.raises(ValueError, match=r"targets 'lm_head'"):
        run(embed)
    assert llm.engine.loras.loaded == {} and llm.generate([PROMPTS[0]], GREEDY)
    with pytest.raises(ValueError, match=r"lora_request 'x' needs an engine with enable_lora=True"):
        LLM(str(tiny_llama_dir), num_kv_blocks=16).generate(
            [PROMPTS[0]], GREEDY, lora_request=LoRARequest("x", 1, str(adapters["mlp"]))
        )
    with pytest.raises(ValueError, match=r"lora_int_id must be a positive integer, got 0"):
        LoRARequest("x", 0, str(adapters["mlp"]))
    assert_all_blocks_free(llm)


def test_the_lru_keeps_max_cpu_loras_and_never_drops_a_held_adapter(tiny_llama_dir, adapters):
    llm = lora_llm(tiny_llama_dir, max_loras=1, max_cpu_loras=2)
    engine, loras = llm.engine, llm.engine.loras
    requests = [LoRARequest(name, i, str(folder)) for i, (name, folder) in enumerate(adapters.items(), 1)]
    alone = [tokens(llm.generate([PROMPTS[1]], GREEDY, lora_request=r))[0] for r in requests]
    assert list(loras.loaded) == [2, 3] and loras.num_loads == 3  # the first one was evicted
    # All three held by unfinished requests at once: none is dropped, and no step runs two of them.
    for i, request in enumerate(requests):
        engine.add_request(f"held-{i}", PROMPTS[1], GREEDY, lora_request=request)
    # Cycling three adapters through an LRU of two reloads each (1 evicts 2, 2 evicts 3), but once every
    # one is held the third stays beside them: the LRU goes over its bound rather than drop a held one.
    assert sorted(loras.loaded) == [1, 2, 3] and loras.num_loads == 6
    done, steps_adapters = {}, set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        running = {seq.lora_int_id for seq in engine.scheduler.running}
        assert len(running) <= 1, running
        steps_adapters |= running
    assert [done[f"held-{i}"] for i in range(3)] == alone and steps_adapters == {1, 2, 3}
    assert len(loras.loaded) == 2 and not loras.users
    assert_all_blocks_free(llm)


def _post(url: str, body: dict, key: str | None) -> tuple[int, str]:
    import urllib.error
    import urllib.request

    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    request = urllib.request.Request(url, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def test_the_server_serves_adapters_by_model_name_and_loads_them_at_run_time(tiny_chat_model, tmp_path):
    import openai
    from helpers import running_server, wait_until_idle

    from pagedllm.entrypoints.openai.limits import ServerLimits
    from pagedllm.entrypoints.openai.server import build_app

    first = make_adapter(tiny_chat_model, tmp_path / "first", ATTENTION, seed=5)
    second = make_adapter(tiny_chat_model, tmp_path / "second", ALL, seed=6)
    prompt = [1, 50, 60, 70, 80]
    offline = lora_llm(tiny_chat_model)
    expected = {
        name: offline.generate([prompt], GREEDY, lora_request=lora)[0].outputs[0].text
        for name, lora in [("tiny", None), ("first", LoRARequest("first", 1, str(first)))]
        + [("second", LoRARequest("second", 2, str(second)))]
    }
    assert len(set(expected.values())) == 3
    key = "sk-lora"
    app = build_app(
        str(tiny_chat_model), served_model_name="tiny", limits=ServerLimits(api_key=key), max_model_len=256,
        enable_lora=True, max_loras=2, max_lora_rank=8, lora_modules={"first": str(first)},
    )  # fmt: skip
    with running_server(app) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)

        def complete(model: str) -> str:
            return (
                client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0)
                .choices[0]
                .text
            )

        cards = {card.id: card for card in client.models.list().data}
        assert sorted(cards) == ["first", "tiny"] and cards["first"].parent == "tiny"
        assert complete("first") == expected["first"] and complete("tiny") == expected["tiny"]
        with pytest.raises(openai.NotFoundError):
            complete("second")
        load = {"lora_name": "second", "lora_path": str(second)}
        assert _post(f"{base}/v1/load_lora_adapter", load, None)[0] == 401
        assert _post(f"{base}/v1/load_lora_adapter", load, key) == (
            200,
            "Success: LoRA adapter 'second' added successfully.",
        )
        assert complete("second") == expected["second"]
        status, body = _post(
            f"{base}/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": str(tmp_path)}, key
        )
        assert status == 400 and "has no adapter_config.json" in body
        assert sorted(card.id for card in client.models.list().data) == ["first", "second", "tiny"]
        assert _post(f"{base}/v1/unload_lora_adapter", {"lora_name": "second"}, key)[0] == 200
        assert _post(f"{base}/v1/unload_lora_adapter", {"lora_name": "second"}, key)[0] == 404
        with pytest.raises(openai.NotFoundError):
            complete("second")
        wait_until_idle(app.state.engine.engine)
        assert 2 not in app.state.engine.engine.loras.loaded
    assert_all_blocks_free(offline)
