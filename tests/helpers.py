"""Assertions and fixtures' building blocks shared by tests that run the engine or the server."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

# For tests that hold the engine to a float32 oracle (transformers, peft) to ~1e-4: the float32 KV cache.
# The CPU's default float16 cache rounds each K/V value to 11 significant bits, which moves log-probabilities
# by up to ~2e-3 and can flip a random model's near-ties (docs/kv-cache.md).
FLOAT32_KV = {"kv_cache_dtype": "float32"}


def assert_all_blocks_free(llm_or_engine) -> None:
    """Every engine test ends here: no request left, every KV block back in the free pool."""
    engine = getattr(llm_or_engine, "engine", llm_or_engine)
    assert not engine.has_unfinished_requests()
    stats = engine.stats()
    assert stats.kv_all_free, stats.kv_usage


def skip_unless_onednn_packs(dtype) -> None:
    """oneDNN packs bf16 weights only on CPUs with AVX-512 or AVX-NE-CONVERT (AVX2-only CPUs: it refuses,
    and the default linear method does not choose it there)."""
    import pytest
    import torch

    from pagedllm.ops import native

    if dtype == torch.bfloat16 and not native.onednn_packs_bf16():
        pytest.skip("oneDNN packs bf16 only on AVX-512 or AVX-NE-CONVERT CPUs")


def batch_invariant_llm(*args, **kwargs):
    """An LLM whose GGUF blocks never take their bf16 path (the default's at many rows where the CPU
    multiplies bf16), for tests that compare, token for token, runs whose steps hold other rows: a
    preempted request recomputed by a prefill, a prompt's tail after a prefix hit. That path rounds x and
    W to bf16 only in some of those steps, which flips random prompts' near-ties between the runs. Its model
    is loaded afresh and not shared (engine/model_cache.py): a live engine's model of the same settings has
    its layers' bf16 path, and a later engine must not get this one's."""
    import weakref

    import pytest

    from pagedllm import LLM
    from pagedllm.engine import model_cache
    from pagedllm.ops import native

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(native, "bf16_matmul_available", lambda: False)
        patch.setattr(model_cache, "_loaded_models", weakref.WeakValueDictionary())
        return LLM(*args, **kwargs)


def agreed_greedy_tokens(expected, outputs, tol: float) -> int:
    """Tokens of `outputs` equal to `expected`'s (both with logprobs) before each one's first divergence,
    which must be a near-tie in `expected` (both tokens within `tol` nats there); up to it, the chosen
    tokens' logprobs are within `tol` of expected's. For runs whose steps group rows differently (another
    kernel path, another rounding of the same arithmetic): corrupt or stale KV moves logprobs by more."""
    agreed = 0
    for want_out, got_out in zip(expected, outputs, strict=True):
        for want_seq, got_seq in zip(want_out.outputs, got_out.outputs, strict=True):
            for i, (want, got) in enumerate(zip(want_seq.token_ids, got_seq.token_ids, strict=True)):
                top = want_seq.logprobs[i]
                if want != got:
                    assert got in top and top[want] - top[got] < tol, (got_out.prompt, i)
                    break
                agreed += 1
                assert abs(got_seq.logprobs[i][got] - top[want]) < tol, (got_out.prompt, i)
    return agreed


@contextlib.contextmanager
def running_server(app) -> Iterator[str]:
    """Serve `app` with uvicorn on a free loopback port until the block ends; yields the base URL."""
    import uvicorn

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if urllib.request.urlopen(f"{base}/health").status == 200:
                break
        except OSError:
            pass
        assert time.monotonic() < deadline, "server did not come up"
        time.sleep(0.1)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextlib.contextmanager
def openai_client(base: str, engine) -> Iterator:
    """The official client on a running server; afterwards every request must be done, every block free."""
    import openai

    yield openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
    wait_until_idle(engine)


def wait_until_idle(engine, timeout: float = 10.0) -> None:
    """The engine thread finishes (or aborts) asynchronously: give it a moment, then nothing may be left."""
    deadline = time.monotonic() + timeout
    while (
        engine.has_unfinished_requests() or not engine.stats().kv_all_free
    ) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert_all_blocks_free(engine)


def write_tiny_chat_model(folder: Path, generation_config: dict | None = None) -> Path:
    """A tiny random Llama with SmolLM2's tokenizer and chat template (vocab 49,152): the whole server
    path (text prompts, chat, streaming) at a fraction of the real model's cost. Its text is noise."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from pagedllm.models.loader import resolve_checkpoint

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    smollm2 = resolve_checkpoint("smollm2-135m")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2 / name).is_file():
            shutil.copy(smollm2 / name, folder / name)
    (folder / "generation_config.json").unlink(missing_ok=True)
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder
