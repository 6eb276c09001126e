"""A step that fails leaves nothing behind: faults injected at each place a step can fail.

Each case runs a workload on an engine with the prefix cache on, makes one step raise at a chosen place
(a prefill, a chunk of a chunked prefill, a decode that fills a block, a speculative verify pass, the
sampler, a swap-in, a host-tier load), and then checks what the issue demands: the offline API raised the
fault, every KV block is back in the pool, and the same prompts run again on the same engine give exactly
the tokens (and, to float rounding, the logprobs) of a fresh engine without a prefix cache, while the
prefix cache counts no hit on a block that no successful forward pass wrote. Faults are injected by
wrapping the engine's own methods: the real engine runs around them.
"""

from __future__ import annotations

import pytest
from helpers import assert_all_blocks_free

from pagedllm import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0)
RULES = "You are a careful assistant who answers in one short sentence and never makes anything up. " * 8
# ~150 tokens each (10 blocks of 16), no two sharing a first block: a 12-block cache holds one of them.
PROMPTS = [f"Question {i}: what is {i} times {i + 2}? " + RULES for i in range(3)]
REPEATING = ["one two three four five one two three four five one two three four five one two three"]


class InjectedFault(RuntimeError):
    """The fault a test injects (a kernel error, an out-of-memory, a bug: the engine cannot tell)."""


def fail_once(monkeypatch, obj, name: str, when=lambda *args: True) -> list[int]:
    """Make obj.name raise InjectedFault on the first call whose arguments satisfy `when`; returns a list
    that holds the failing call's number once it fired."""
    real, calls, fired = getattr(obj, name), [0], []

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if not fired and when(*args, **kwargs):
            fired.append(calls[0])
            raise InjectedFault(f"injected into {name}")
        return real(*args, **kwargs)

    monkeypatch.setattr(obj, name, wrapper)
    return fired


@pytest.fixture(scope="module")
def model(tiny_chat_model) -> str:
    return str(tiny_chat_model)


def run(llm: LLM, prompts: list[str], params: SamplingParams = GREEDY):
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [([*o.outputs[0].token_ids], chosen_logprobs(o.outputs[0])) for o in outs]


def chosen_logprobs(completion) -> list[float]:
    return [lp[t] for lp, t in zip(completion.logprobs, completion.token_ids, strict=True)]


def fresh(model: str, prompts: list[str], params: SamplingParams = GREEDY, **kwargs):
    llm = LLM(model, enable_prefix_caching=False, **kwargs)
    result = run(llm, prompts, params)
    assert_all_blocks_free(llm)
    return result


def assert_same(got, want) -> None:
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got, want, strict=True):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs, strict=True)) < 1e-4


def check_recovery(llm: LLM, model: str, prompts, params=GREEDY, fresh_kwargs=None, fired=None):
    """After the injected failure: the fault reached the caller, every block is free, and the prompts
    again give a fresh engine's tokens."""
    assert fired, "the fault was never injected: the workload did not reach the place under test"
    assert_all_blocks_free(llm)
    again = run(llm, prompts, params)
    assert_same(again, fresh(model, prompts, params, **(fresh_kwargs or {})))
    assert_all_blocks_free(llm)


def prefilling(out, clock) -> bool:
    return bool(out.prefills)


def test_a_failed_prefill_leaves_no_findable_block(model, monkeypatch):
    """The issue's case: a forward pass raises during a long prompt's prefill; the same prompt again
    counts no prefix-cache hit on the blocks that pass was to write, and gets a fresh engine's tokens."""
    llm = LLM(model, max_model_len=1024)
    fired = fail_once(monkeypatch, llm.engine, "_run", prefilling)
    with pytest.raises(InjectedFault):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_all_blocks_free(llm)
    hits_before = llm.engine.stats().prefix_cache_hits
    outs = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert outs[0].num_cached_tokens == 0  # nothing the failed step computed is findable
    assert llm.engine.stats().prefix_cache_hits == hits_before
    check_recovery(llm, model, PROMPTS, fired=fired)


def test_a_failed_chunk_keeps_the_chunks_before_it(model, monkeypatch):
    """A chunked prefill fails at its third chunk: the two chunks computed before stay findable (their
    forward passes ran), the failed chunk's blocks do not."""
    kwargs = {"max_model_len": 1024, "max_num_batched_tokens": 32, "enable_chunked_prefill": True}
    llm = LLM(model, **kwargs)
    steps = []
    fired = fail_once(monkeypatch, llm.engine, "_run", lambda out, clock: steps.append(1) or len(steps) == 3)
    with pytest.raises(InjectedFault):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    out = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]
    block_size = llm.engine.config.block_size
    assert out.num_cached_tokens == (2 * 32 // block_size) * block_size  # the committed chunks only
    check_recovery(llm, model, PROMPTS[:1], fired=fired)


def failing_block_prefix(bs: int, seqs: list, filled: list) -> bool:
    """Whether a scheduled sequence's block fills this step; if so keep its tokens through that block (a
    prompt that would hit it, were it findable)."""
    for seq in seqs:
        if seq.num_cached_tokens % bs == 0:
            filled.append(seq.token_ids[: seq.num_cached_tokens] + [0])
            return True
    return False


def test_a_failed_decode_that_fills_a_block(model, monkeypatch):
    """The decode step whose token fills a block fails: a prompt through that block (the conversation's
    next turn) finds it not cached."""
    llm = LLM(model, max_model_len=1024)
    bs, filled = llm.engine.config.block_size, []
    fired = fail_once(
        monkeypatch, llm.engine, "_run", lambda out, clock: failing_block_prefix(bs, out.decodes, filled)
    )
    with pytest.raises(InjectedFault):
        llm.generate(PROMPTS, SamplingParams(max_tokens=40, temperature=0.0, logprobs=0), use_tqdm=False)
    monkeypatch.undo()
    check_recovery(llm, model, [{"prompt_token_ids": filled[0]}], fired=fired)


def test_a_failed_speculative_verify_pass(model, monkeypatch):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    llm = LLM(model, max_model_len=1024, speculative_config=spec)
    bs, filled = llm.engine.config.block_size, []

    def verifying_a_full_block(out, clock) -> bool:
        verifying = [seq for seq in out.decodes if seq.draft_token_ids]
        return bool(verifying) and failing_block_prefix(bs, verifying, filled)

    fired = fail_once(monkeypatch, llm.engine, "_run", verifying_a_full_block)
    params = SamplingParams(max_tokens=48, temperature=0.0, logprobs=0)
    with pytest.raises(InjectedFault):
        llm.generate(REPEATING, params, use_tqdm=False)
    monkeypatch.undo()
    check_recovery(llm, model, [*REPEATING, {"prompt_token_ids": filled[0]}], params, fired=fired)


def test_a_failed_sampler_after_the_forward(model, monkeypatch):
    """The forward pass wrote the K/V, then sampling raised: the step still fails as a whole."""
    llm = LLM(model, max_model_len=1024)
    fired = fail_once(monkeypatch, llm.engine.postprocessor, "_sample")
    with pytest.raises(InjectedFault):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    check_recovery(llm, model, PROMPTS, fired=fired)


def test_a_failed_swap_in(model, monkeypatch):
    """Swap preemption in a cache too small for the batch (12 blocks of 32 tokens): the step that swaps a
    sequence back in fails."""
    kwargs = {"max_model_len": 512, "num_kv_blocks": 12, "preemption_mode": "swap"}
    llm = LLM(model, **kwargs)
    fired = fail_once(monkeypatch, llm.engine, "_run", lambda out, clock: bool(out.swap_in))
    params = SamplingParams(max_tokens=80, temperature=0.0, logprobs=0)
    with pytest.raises(InjectedFault):
        llm.generate(PROMPTS, params, use_tqdm=False)
    monkeypatch.undo()
    check_recovery(llm, model, PROMPTS, params, fired=fired)


def test_a_failed_host_tier_load(model, monkeypatch):
    """A device cache too small to keep the prompts, a host tier under it: a prompt whose blocks come back
    from host memory fails in the step that loads them."""
    llm = LLM(model, max_model_len=512, num_kv_blocks=12, kv_offload_memory="4MiB")
    for prompt in PROMPTS:  # each evicts the one before to host memory
        llm.generate([prompt], GREEDY, use_tqdm=False)
    fired = fail_once(monkeypatch, llm.engine, "_run", lambda out, clock: bool(out.tier_moves.load))
    with pytest.raises(InjectedFault):
        for prompt in PROMPTS:
            llm.generate([prompt], GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert fired
    assert_all_blocks_free(llm)
    for prompt in PROMPTS:  # one at a time: the device cache holds one prompt
        assert_same(run(llm, [prompt]), fresh(model, [prompt], max_model_len=512))
    assert_all_blocks_free(llm)


def test_a_disk_read_that_cannot_land_is_a_miss(model, tmp_path, monkeypatch):
    """Blocks read from the disk tier whose copy into host memory raises: no request fails, the blocks
    are recomputed, the tokens are a fresh engine's."""
    tiered = {
        "max_model_len": 512,
        "num_kv_blocks": 12,
        "kv_offload_memory": "4MiB",
        "kv_offload_dir": str(tmp_path),
    }
    writer = LLM(model, **tiered)
    for prompt in PROMPTS:
        writer.generate([prompt], GREEDY, use_tqdm=False)
    assert_all_blocks_free(writer)
    del writer
    llm = LLM(model, **tiered)
    fired = fail_once(monkeypatch, llm.engine.runner, "write_host_blocks")
    got = run(llm, PROMPTS[:1])
    assert fired
    assert_same(got, fresh(model, PROMPTS[:1], max_model_len=512))
    assert_all_blocks_free(llm)


def test_no_kv_event_for_a_block_of_a_failed_step(model, monkeypatch):
    """Replicas' routers learn of cached blocks through KV events: a failed step's blocks never appear."""
    from pagedllm.kv.events import BlockStored

    llm = LLM(model, max_model_len=1024)
    log = llm.engine.enable_kv_events()
    fired = fail_once(monkeypatch, llm.engine, "_run", prefilling)
    with pytest.raises(InjectedFault):
        llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert fired and not [e for e in log.drain() if isinstance(e, BlockStored)]
    monkeypatch.undo()
    llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    assert [e for e in log.drain() if isinstance(e, BlockStored)]  # a successful step's blocks do
    assert_all_blocks_free(llm)


def test_waiting_requests_survive_a_failed_step(model, monkeypatch):
    """Requests that held no KV when the step failed are not ended: they run on and give fresh tokens."""
    llm = LLM(model, max_model_len=1024, max_num_seqs=1)
    engine = llm.engine
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, GREEDY)
    fired = fail_once(monkeypatch, engine, "_run", prefilling)
    with pytest.raises(InjectedFault):
        engine.step()
    assert fired and engine.unfinished_request_ids() == ["1", "2"]  # "0" was running: it was ended
    monkeypatch.undo()
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done["1"], done["2"]] == [t for t, _ in fresh(model, PROMPTS[1:], max_model_len=1024)]
    assert_all_blocks_free(llm)
