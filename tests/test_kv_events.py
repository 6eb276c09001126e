"""The allocator's KV cache events (kv/events.py): replayed, they give exactly the set of first-group block
hashes its prefix cache holds, at every point of a random run that evicts; each stored block's hash is
its parent's and its tokens' (so a reader can rebuild the chain); AllBlocksCleared starts the log. A block
is reported stored only when the step that cached it commits (tests/test_kv_journal.py: rollbacks)."""

from __future__ import annotations

import random

import pytest

from pagedllm.kv import NoFreeBlocks, PagedAllocator
from pagedllm.kv.block_pool import block_hash_chain, hash_block
from pagedllm.kv.events import AllBlocksCleared, BlockRemoved, BlockStored

BS = 4


def replay(events, held: set[bytes]) -> None:
    for event in events:
        if isinstance(event, AllBlocksCleared):
            held.clear()
        elif isinstance(event, BlockStored):
            assert event.block_size == BS and len(event.block_hashes) == 1
            assert hash_block(event.parent_block_hash, event.token_ids) == event.block_hashes[0]
            assert event.block_hashes[0] not in held, "stored twice without a removal between"
            held.update(event.block_hashes)
        else:
            assert isinstance(event, BlockRemoved)
            assert held >= set(event.block_hashes), "removed a block never stored"
            held.difference_update(event.block_hashes)


def cached_first_group(kv: PagedAllocator) -> set[bytes]:
    return {h for g, h in kv.pool.cached if g == 0}


def test_replayed_events_equal_the_cached_blocks_through_a_run_that_evicts():
    rng = random.Random(5)
    kv = PagedAllocator(num_blocks=24, block_size=BS, enable_prefix_caching=True)
    log = kv.enable_events()
    first = log.drain()
    assert first == [AllBlocksCleared()]
    held: set[bytes] = set()
    prefixes = [[rng.randrange(50) for _ in range(3 * BS)] for _ in range(4)]
    live: list[int] = []
    removed = 0
    for step in range(400):
        if live and (rng.random() < 0.4 or len(live) > 4):
            seq = live.pop(rng.randrange(len(live)))
            kv.free(seq)
        elif live and rng.random() < 0.5:
            seq = rng.choice(live)
            if kv.can_append(seq):
                kv.append(seq, rng.randrange(50))
                kv.cache_blocks(seq, kv.num_tokens(seq) - 1)
        else:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(1, 2 * BS))]
            if kv.can_allocate(prompt, 8):
                try:
                    kv.allocate(step, prompt, 8)
                    live.append(step)
                except NoFreeBlocks:
                    pass
        kv.commit()  # each operation is a step of its own
        events = log.drain()
        removed += sum(isinstance(e, BlockRemoved) for e in events)
        replay(events, held)
        assert held == cached_first_group(kv), step
    assert removed > 10, "the run should have evicted cached blocks"


def test_the_chain_matches_the_prompt_hashes_a_router_computes():
    kv = PagedAllocator(num_blocks=16, block_size=BS, enable_prefix_caching=True)
    log = kv.enable_events()
    prompt = list(range(3 * BS + 1))
    kv.allocate("a", prompt, 4)
    assert log.drain() == [AllBlocksCleared()]  # nothing stored before its step commits
    kv.commit()
    stored = [e for e in log.drain() if isinstance(e, BlockStored)]
    assert [e.block_hashes[0] for e in stored] == block_hash_chain(prompt, BS)
    assert [e.parent_block_hash for e in stored] == [None, *block_hash_chain(prompt, BS)[:-1]]


def test_events_need_prefix_caching():
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        PagedAllocator(num_blocks=4, block_size=BS).enable_events()
