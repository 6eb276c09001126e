"""Tensor parallelism: N ranks give one rank's logits and greedy tokens; failures are clear and bounded;
no worker process outlives its engine.

Tiny random checkpoints shaped like the built-in models (SmolLM2: 9 heads over 3 KV heads, tied
embeddings, split unevenly over 2 ranks; Gemma 3: 1 KV head, replicated) keep the multi-process tests
to a few seconds each; the real Gemma 3 270M runs once.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from datetime import timedelta

import openai
import pytest
import torch
import torch.distributed as dist
from helpers import assert_all_blocks_free, openai_client, running_server
from models_helpers import PagedCache, forward_chunks
from test_models_families import randomize
from transformers import AutoModelForCausalLM, Gemma3TextConfig, LlamaConfig

from pagedllm import LLM, SamplingParams
from pagedllm.engine.parallel.executor import WorkerFailure
from pagedllm.engine.parallel.group import form_group
from pagedllm.entrypoints.openai.server import build_app
from pagedllm.models import load_model
from pagedllm.models.loader import resolve_checkpoint
from pagedllm.models.parallel import TensorParallel, attention_heads

SMALL = dict(vocab_size=385, hidden_size=64, intermediate_size=96, max_position_embeddings=512)
CONFIGS = {
    # SmolLM2's shape, small: 9 heads / 3 KV heads (2 + 1 over two ranks), tied, its tokenizer and vocab;
    # an intermediate size that does not split evenly either.
    "smollm2": lambda: LlamaConfig(
        **{**SMALL, "vocab_size": 49152, "hidden_size": 72, "intermediate_size": 97},
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e5},
    ),
    # Gemma 3's: 1 KV head (replicated), QK-norm, sliding and global layers, soft-capped logits, and an
    # odd vocabulary (the last rank's slice is narrower).
    "gemma3": lambda: Gemma3TextConfig(
        **SMALL,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=9,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=24,
        final_logit_softcapping=5.0,
    ),
    # What the other two lack: biases on every projection (row-parallel ones added once) and an untied head.
    "llama-bias": lambda: LlamaConfig(
        **SMALL,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_bias=True,
        mlp_bias=True,
    ),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """A tiny random checkpoint per shape; SmolLM2's carries the real tokenizer (for text prompts)."""
    torch.manual_seed(0)
    out = {}
    for name, make in CONFIGS.items():
        model = AutoModelForCausalLM.from_config(make(), dtype=torch.float32)
        randomize(model)
        folder = tmp_path_factory.mktemp(name)
        model.save_pretrained(folder)
        out[name] = str(folder)
    smollm2 = resolve_checkpoint("smollm2-135m")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2 / file, out["smollm2"])
    return out


def prompts(vocab: int, lens=(3, 17, 40, 9), seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lens]


# -- the sharded model, ranks as threads of this process ------------------------------------------------


def run_ranks(size: int, fn) -> list:
    """fn(tp) on `size` threads, the ranks of one gloo group; each rank's result."""
    store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False)
    results, errors = [None] * size, []

    def rank_main(rank: int) -> None:
        try:  # a store client per rank: one client's blocking waits would hold up the others'
            own = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, size, is_master=False)
            tp = form_group(own, rank, size, torch.device("cpu"), timedelta(seconds=60))
            results[rank] = fn(tp)
        except BaseException as error:
            errors.append(error)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def prefill_then_decode(model, batch: list[list[int]]) -> torch.Tensor | None:
    """Logits of a prefill of `batch`, then of one decode step of each sequence (rank 0; None elsewhere)."""
    cache = PagedCache.create(model.config, 32, 16, num_kv_heads=model.num_kv_heads)
    first = forward_chunks(model, cache, [(i, p, 0) for i, p in enumerate(batch)])
    second = forward_chunks(model, cache, [(i, [7], len(p)) for i, p in enumerate(batch)])
    return None if first is None else torch.cat([first, second])


@pytest.mark.parametrize(
    ("name", "size"), [("smollm2", 2), ("smollm2", 3), ("gemma3", 2), ("gemma3", 4), ("llama-bias", 2)]
)
def test_sharded_logits_equal_one_rank(folders, name, size):
    whole = load_model(folders[name]).model
    batch = prompts(whole.config.vocab_size)
    expected = prefill_then_decode(whole, batch)
    got = run_ranks(size, lambda tp: prefill_then_decode(load_model(folders[name], tp=tp).model, batch))
    assert all(logits is None for logits in got[1:])
    torch.testing.assert_close(got[0], expected, atol=1e-4, rtol=1e-4)


def test_head_split_rules():
    def heads(h, kv, n):
        return [
            (a.q.start, a.q.size, a.kv.start, a.kv.size)
            for a in (attention_heads(h, kv, TensorParallel(r, n)) for r in range(n))
        ]

    assert heads(9, 3, 2) == [(0, 6, 0, 2), (6, 3, 2, 1)]  # SmolLM2: KV groups 2 + 1
    assert heads(4, 1, 2) == [(0, 2, 0, 1), (2, 2, 0, 1)]  # Gemma 3: its KV head on both ranks
    assert heads(8, 2, 4) == [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]
    with pytest.raises(
        ValueError, match="tensor_parallel_size=4 with 9 attention heads and 3 KV heads.*multiple of 3"
    ):
        attention_heads(9, 3, TensorParallel(0, 4))
    with pytest.raises(ValueError, match="4 query heads cannot be split over 8 ranks"):
        attention_heads(4, 1, TensorParallel(0, 8))


def test_an_impossible_split_fails_before_any_worker_starts(folders):
    with pytest.raises(ValueError, match="tensor_parallel_size=4 .*multiple of 3"):
        LLM(folders["smollm2"], tensor_parallel_size=4, num_kv_blocks=8)


# -- the engine with worker processes ----------------------------------------------------------------


def workers_gone(llm) -> bool:
    return all(proc.poll() is not None for proc in llm.engine.executor.procs.values())


@pytest.mark.parametrize(
    ("name", "layout", "kv_cache_dtype"),
    [
        ("smollm2", "paged", "auto"),
        ("smollm2", "contiguous", "auto"),
        ("gemma3", "paged", "bfloat16"),
        ("gemma3", "contiguous", "auto"),
    ],
)
def test_two_ranks_generate_the_tokens_of_one(folders, name, layout, kv_cache_dtype):
    """Paged: few blocks (swap preemption), prefix caching and n = 2 (copy-on-write): every block move is
    broadcast to the worker too. Contiguous: one slab per sequence. A bfloat16 KV cache on every rank
    (a worker's float32 cache would move the logprobs by ~1e-2 here)."""
    if layout == "paged":
        settings = dict(num_kv_blocks=12, preemption_mode="swap", enable_prefix_caching=True)
    else:
        settings = dict(num_kv_blocks=128, kv_layout="contiguous")
    settings.update(block_size=8, max_model_len=128, kv_cache_dtype=kv_cache_dtype)
    vocab = CONFIGS[name]().vocab_size
    shared = prompts(vocab, lens=(16,), seed=1)[0]
    batch = [shared + p for p in prompts(vocab, lens=(3, 17, 30, 9))]
    params = [SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)] * 3
    params.append(SamplingParams(n=2, max_tokens=16, temperature=0, ignore_eos=True, logprobs=1))

    one = LLM(folders[name], **settings)
    expected = one.generate(batch, params)
    two = LLM(folders[name], tensor_parallel_size=2, **settings)
    try:
        got = two.generate(batch, params)
        assert two.engine.stats().num_preemptions == one.engine.stats().num_preemptions
        if layout == "paged":
            assert two.engine.stats().num_preemptions > 0
        assert_all_blocks_free(two)
    finally:
        two.engine.shutdown()
    assert workers_gone(two)
    for want, have in zip(expected, got, strict=True):
        for a, b in zip(want.outputs, have.outputs, strict=True):
            assert b.token_ids == a.token_ids
            assert b.cumulative_logprob == pytest.approx(a.cumulative_logprob, abs=1e-3)


def test_two_ranks_verify_draft_tokens_as_one_does(folders):
    """Speculative decoding: every rank computes the verify pass's 1 + k logits rows (num_logits travels
    in the step's payload), so two ranks accept and reject the drafts one rank does."""
    settings = dict(num_kv_blocks=64, block_size=8, max_model_len=128, kv_cache_dtype="bfloat16")
    settings["speculative_config"] = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    batch = [p * 3 for p in prompts(CONFIGS["smollm2"]().vocab_size, lens=(5, 7))]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    one = LLM(folders["smollm2"], **settings)
    expected = [o.outputs[0].token_ids for o in one.generate(batch, params)]
    two = LLM(folders["smollm2"], tensor_parallel_size=2, **settings)
    try:
        assert [o.outputs[0].token_ids for o in two.generate(batch, params)] == expected
        one_stats, two_stats = one.engine.stats(), two.engine.stats()
        assert two_stats.spec_verifies == one_stats.spec_verifies > 0  # (a random model rarely repeats)
        assert two_stats.spec_accepted_tokens == one_stats.spec_accepted_tokens
        assert_all_blocks_free(two)
    finally:
        two.engine.shutdown()
    assert workers_gone(two)


def test_real_gemma3_270m_on_two_ranks_generates_one_rank_s_tokens(int16_activations):
    """The real model, its single KV head replicated on both ranks (each rank holds 2 of its 4 heads). On
    int16 x: two ranks sum a row-parallel projection in another order than one, and int8 x (the default)
    turns that last bit into another code wherever a value sits on a rounding boundary, which 18 layers
    carry to the logits; on the AVX2 build the second prompt's fifth token, 0.087 ahead of the next on one
    rank, was passed on two (session 19). int16's step is 256 times finer, so a real difference between the
    ranks' arithmetic and one process's shows here, not rounding's."""
    batch = ["The capital of France is", "def fib(n):", "Once upon a time, there was"]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    settings = dict(kv_cache_memory="16MiB", max_model_len=256)
    expected = [o.outputs[0].token_ids for o in LLM("gemma3-270m", **settings).generate(batch, params)]
    two = LLM("gemma3-270m", tensor_parallel_size=2, **settings)
    try:
        assert two.engine.model.num_kv_heads == 1 and two.engine.model.layers[0].self_attn.num_heads == 2
        assert [o.outputs[0].token_ids for o in two.generate(batch, params)] == expected
        assert_all_blocks_free(two)
    finally:
        two.engine.shutdown()
    assert workers_gone(two)


# -- failures and shutdown -------------------------------------------------------------------------------


def test_a_killed_worker_fails_the_next_step_with_its_exit(folders):
    llm = LLM(folders["gemma3"], tensor_parallel_size=2, num_kv_blocks=16)
    (worker,) = llm.engine.executor.procs.values()
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    start = time.monotonic()
    with pytest.raises(WorkerFailure, match=rf"rank 1 \(pid {worker.pid}\) was killed by SIGKILL"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert time.monotonic() - start < 10
    with pytest.raises(WorkerFailure, match="SIGKILL"):  # and every later step, at once
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert_all_blocks_free(llm)  # the failed requests were aborted: their blocks are back


def test_the_server_answers_503_once_a_worker_died(folders):
    app = build_app(folders["gemma3"], tensor_parallel_size=2, num_kv_blocks=16)
    engine = app.state.engine.engine
    with running_server(app) as base, openai_client(base, engine) as client:
        assert client.completions.create(prompt=[1, 2, 3], max_tokens=2, model=folders["gemma3"]).choices
        (worker,) = engine.executor.procs.values()
        worker.kill()
        with pytest.raises(openai.InternalServerError, match="rank 1 .* was killed by SIGKILL") as error:
            client.completions.create(prompt=[1, 2, 3], max_tokens=2, model=folders["gemma3"])
        assert error.value.status_code == 503
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"{base}/health")
        assert health.value.code == 503 and "SIGKILL" in json.load(health.value)["error"]["message"]
    assert workers_gone(app.state.engine)


def test_a_hung_worker_fails_the_step_within_the_timeout(folders):
    llm = LLM(folders["gemma3"], tensor_parallel_size=2, num_kv_blocks=16, distributed_timeout=2)
    (worker,) = llm.engine.executor.procs.values()
    worker.send_signal(signal.SIGSTOP)  # alive, silent
    start = time.monotonic()
    try:
        with pytest.raises(WorkerFailure, match="did not answer within 2 s"):
            llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
        assert time.monotonic() - start < 2 + 10
    finally:
        llm.engine.shutdown()
    assert workers_gone(llm)  # the stopped worker was killed, not left behind


def test_workers_exit_when_the_engine_process_is_killed(folders, tmp_path):
    """No orphans even if rank 0 cannot stop them: a SIGKILLed engine's workers exit by themselves."""
    script = tmp_path / "engine.py"
    script.write_text(
        "import sys, time\n"
        "from pagedllm import LLM\n"
        f"llm = LLM({folders['gemma3']!r}, tensor_parallel_size=2, num_kv_blocks=16)\n"
        "print(*(p.pid for p in llm.engine.executor.procs.values()), flush=True)\n"
        "time.sleep(600)\n"
    )
    engine = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in engine.stdout.readline().split()]
    finally:
        engine.kill()
        engine.wait()
    assert pids
    deadline = time.monotonic() + 15
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


def _alive(pid: int) -> bool:
    """Whether pid is a live process (a zombie awaiting its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


# -- several machines: two "nodes" on the loopback address, each its own process tree ---------------------

PROMPT = "The capital of France is"


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _expected_text(folder: str) -> str:
    llm = LLM(folder, num_kv_blocks=16, max_model_len=64)
    return PROMPT + llm.generate(PROMPT, SamplingParams(max_tokens=6, temperature=0))[0].outputs[0].text


def _generate(folder: str) -> list[str]:
    """`python -m` arguments of `pagedllm generate PROMPT` on 2 ranks."""
    cli = ["-m", "pagedllm.entrypoints.cli", "generate", PROMPT, "--model", folder, "--max-tokens", "6"]
    return cli + ["--max-model-len", "64", "--kv-cache-memory", "1MiB", "--tensor-parallel-size", "2"]


def _run_trees(commands: list[list[str]], timeout: float = 180) -> list[subprocess.CompletedProcess]:
    """Run each command as its own process tree (session) at once; kill any tree still up at the end."""
    procs = [
        subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for c in commands
    ]
    try:
        outs = [p.communicate(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [
        subprocess.CompletedProcess(p.args, p.returncode, *out) for p, out in zip(procs, outs, strict=True)
    ]


def test_two_nodes_on_loopback_generate_one_process_s_text(folders):
    """`pagedllm generate` on "node 0" (rank 0: the engine) and "node 1" (rank 1: a worker only)."""
    cli = [sys.executable, *_generate(folders["smollm2"])]
    cli += ["--nnodes", "2", "--distributed-init-method", f"tcp://127.0.0.1:{_free_port()}"]
    node1, node0 = _run_trees([cli + ["--node-rank", "1"], cli + ["--node-rank", "0"]])
    assert node0.returncode == 0, node0.stderr
    assert node1.returncode == 0, node1.stderr
    assert node0.stdout.strip() == _expected_text(folders["smollm2"])
    assert node1.stdout == ""


def test_torchrun_starts_every_rank(folders):
    """torchrun's environment variables instead of pagedllm's flags: it starts both ranks, rank 0 runs
    the engine, rank 1 the worker."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    torchrun += ["--master-port", str(_free_port())]
    (run,) = _run_trees([torchrun + _generate(folders["smollm2"])])
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == _expected_text(folders["smollm2"])
