"""Random allocate/append/fork/free/swap sequences on both KV layouts, with invariants after every step.

The machine keeps a model of what each sequence holds and a simulated cache: it writes (position,
token) into the slots the allocator hands out and performs every copy the allocator reports. After
each step every resident sequence must read back exactly its own tokens through its slot mapping,
which fails on a slot owned twice, a missed copy-on-write, a wrong swap copy or a wrong prefix hit.
Speculative decoding is a pair of rules: `speculate` reserves lookahead slots and writes draft tokens
there at once (the verify pass), `verify` accepts a prefix of them and releases the rest (forks and
swaps happen between the two, on other sequences, as the engine's steps interleave them); each
sequence's block hashes must then be the hash chain of its accepted tokens alone, as a run that never
speculated makes them. Steps end as the engine ends them: `commit` keeps the step, `rollback` is a failed
step (kv/journal.py): the simulated cache loses every write since the last commit, the allocator rolls
back, and the sequences the step touched are freed (before or after the rollback). A block the failed step
left findable would then serve a later prompt content never written: the read-back invariant catches it.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_helpers import free_order, slots

from pagedllm.kv import ContiguousAllocator, NoFreeBlocks, PagedAllocator
from pagedllm.kv.block_pool import hash_block
from pagedllm.kv.events import BlockRemoved, BlockStored
from pagedllm.kv.tiers import DiskTier, HostPool, PrefixTiers

STEP_OPS = (
    "allocate",
    "append",
    "cache_blocks",
    "reserve_lookahead",
    "release_lookahead",
    "swap_out",
    "swap_in",
)
MISSING = object()


class StepCache(dict):
    """The simulated cache (slot -> content), remembering each slot's content before the first write of the
    step: a failed step's writes never happened."""

    def __init__(self):
        super().__init__()
        self.before: dict = {}

    def __setitem__(self, slot, value):
        self.before.setdefault(slot, self.get(slot, MISSING))
        super().__setitem__(slot, value)

    def commit(self) -> None:
        self.before.clear()

    def rollback(self) -> None:
        for slot, value in self.before.items():
            if value is MISSING:
                super().pop(slot, None)
            else:
                super().__setitem__(slot, value)
        self.before.clear()


SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None)
MAX_MODEL_LEN = 24
prompts = st.lists(st.integers(0, 1), min_size=1, max_size=12)  # few symbols: prefixes repeat


class KVMachine(RuleBasedStateMachine):
    """Drives one allocator; subclasses say which."""

    def make_allocator(self):
        raise NotImplementedError

    def __init__(self):
        super().__init__()
        self.kv = self.make_allocator()
        self.bs = self.kv.block_size
        self.tokens: dict[int, list[int]] = {}  # every live sequence (resident or swapped)
        self.swapped: set[int] = set()
        self.unwritten: dict[int, int] = {}  # swapped sequence -> its first token appended while away
        self.host_blocks: dict[int, int] = {}  # swapped sequence -> host blocks it holds
        self.device = StepCache()  # slot -> (position, token) written there
        self.host = StepCache()
        self.drafts: dict[int, list[int]] = {}  # sequence -> draft tokens in its lookahead slots
        self.next_id = 0
        self.touched: set[int] = set()  # sequences the step since the last commit changed (failed with it)
        self.committed: dict = {}  # paged: the prefix cache (key -> block id) at the last commit
        for name in STEP_OPS + ("fork",):
            setattr(self.kv, name, self.tracked(getattr(self.kv, name), 2 if name == "fork" else 1))

    # -- helpers -----------------------------------------------------------------------------------

    def resident(self) -> list[int]:
        return sorted(set(self.tokens) - self.swapped)

    def settled(self) -> list[int]:
        """Resident sequences holding no lookahead slots: those the engine appends to, swaps or speculates."""
        return [s for s in self.resident() if s not in self.drafts]

    def speculable(self) -> list[int]:
        return self.settled()

    def tables(self, seq_id: int) -> list[list[int]]:
        """The sequence's block tables: one, or one per KV group."""
        return [self.kv.block_table(seq_id)]

    def tracked(self, op, num_ids: int):
        """The allocator's method `op`, noting the sequences it is called for as touched by the step."""

        def run(*args, **kwargs):
            self.touched.update(args[:num_ids])
            return op(*args, **kwargs)

        return run

    def drop(self, seq_id: int) -> None:
        """Free a sequence and forget it."""
        self.kv.free(seq_id)
        del self.tokens[seq_id]
        self.drafts.pop(seq_id, None)
        self.swapped.discard(seq_id)
        self.unwritten.pop(seq_id, None)
        self.host_blocks.pop(seq_id, None)

    def write(self, seq_id: int, start: int) -> None:
        for t, slot in enumerate(slots(self.kv, seq_id, start), start):
            self.device[slot] = (t, self.tokens[seq_id][t])

    def copy_blocks(self, copies, src: dict, dst: dict) -> None:
        for s, d in copies:
            for o in range(self.bs):
                dst[d * self.bs + o] = src.get(s * self.bs + o)

    def snapshot(self):
        """Everything observable, to check that a refused operation changed nothing."""
        kv = self.kv
        state = [kv.usage(), kv.num_free_blocks, {s: kv.block_table(s) for s in self.resident()}]
        if isinstance(kv, PagedAllocator):
            state += [
                free_order(kv.pool),
                {h: b.block_id for h, b in kv.pool.cached.items()},
                kv.num_free_host_blocks,
            ]
        else:
            state.append(list(kv.gaps))
        return state

    def refused(self, can: bool, before, op, *args):
        """Run op; if it raised NoFreeBlocks, `can` must have said so and nothing may have changed."""
        try:
            result = op(*args)
        except NoFreeBlocks:
            assert not can
            assert self.snapshot() == before
            return None
        assert can
        return result

    # -- rules -------------------------------------------------------------------------------------

    @rule(prompt=prompts, max_new=st.integers(0, 12))
    def allocate(self, prompt, max_new):
        true_out = max_new if getattr(self.kv, "reserve", None) == "oracle" else None
        kwargs = dict(true_output_len=true_out)
        can = self.kv.can_allocate(prompt, max_new, **kwargs)
        seq_id, before = self.next_id, self.snapshot()
        cached = self.refused(can, before, lambda: self.kv.allocate(seq_id, prompt, max_new, **kwargs))
        if cached is None:
            return
        self.next_id += 1
        assert 0 <= cached < len(prompt) and cached % self.bs == 0
        if not getattr(self.kv, "enable_prefix_caching", False):
            assert cached == 0
        self.tokens[seq_id] = list(prompt)
        self.write(seq_id, cached)  # the cached prefix must already be in the cache: checked below

    @precondition(lambda self: self.settled())
    @rule(data=st.data(), token=st.integers(0, 1))
    def append(self, data, token):
        seq_id = data.draw(st.sampled_from(self.settled()))
        can = self.kv.can_append(seq_id)
        copies = self.refused(can, self.snapshot(), self.kv.append, seq_id, token)
        if copies is None:
            return
        if self.bs > 1:  # a copy goes to a fresh block: it must not be anybody's block
            assert all(
                dst not in self.kv.block_table(s) for _, dst in copies for s in self.resident() if s != seq_id
            )
        self.copy_blocks(copies, self.device, self.device)
        self.tokens[seq_id].append(token)
        self.write(seq_id, len(self.tokens[seq_id]) - 1)

    @precondition(lambda self: self.settled())
    @rule(data=st.data())
    def fork(self, data):
        parent = data.draw(st.sampled_from(self.settled()))
        free_before = self.kv.num_free_blocks
        can = (
            isinstance(self.kv, PagedAllocator)
            or self.kv.slabs[parent].size <= self.kv.usage().largest_free_run
        )
        copies = self.refused(can, self.snapshot(), self.kv.fork, parent, self.next_id)
        if copies is None:
            return
        if isinstance(self.kv, PagedAllocator):
            assert copies == [] and self.kv.num_free_blocks == free_before  # shares, allocates nothing
        self.copy_blocks(copies, self.device, self.device)
        self.tokens[self.next_id] = list(self.tokens[parent])
        self.next_id += 1

    @precondition(lambda self: self.speculable())
    @rule(data=st.data(), drafts=st.lists(st.integers(0, 1), min_size=1, max_size=5))
    def speculate(self, data, drafts):
        """Lookahead slots for draft tokens (in every table), which the verify pass writes at once (after
        any copies)."""
        seq_id = data.draw(st.sampled_from(self.speculable()))
        can = self.kv.can_reserve_lookahead(seq_id, len(drafts))
        copies = self.refused(can, self.snapshot(), self.kv.reserve_lookahead, seq_id, len(drafts))
        if copies is None:
            return
        self.copy_blocks(copies, self.device, self.device)
        n = len(self.tokens[seq_id])
        for table in self.tables(seq_id):
            assert len(table) == -(-(n + len(drafts)) // self.bs)
            for t, token in enumerate(drafts, n):
                self.device[table[t // self.bs] * self.bs + t % self.bs] = (t, token)
        self.drafts[seq_id] = drafts

    @precondition(lambda self: self.drafts)
    @rule(data=st.data())
    def verify(self, data):
        """Accept a prefix of the drafts (their K/V is already written: no copy) and release the rest."""
        seq_id = data.draw(st.sampled_from(sorted(self.drafts)))
        drafts = self.drafts.pop(seq_id)
        for token in drafts[: data.draw(st.integers(0, len(drafts)))]:
            assert self.kv.can_append(seq_id) and self.kv.append(seq_id, token) == []
            self.tokens[seq_id].append(token)
        free_before, before = self.kv.num_free_blocks, self.tables(seq_id)
        self.kv.release_lookahead(seq_id)
        tables = self.tables(seq_id)
        for table, old in zip(tables, before, strict=True):
            assert table == old[: len(table)] and len(table) == -(-len(self.tokens[seq_id]) // self.bs)
        if isinstance(self.kv, PagedAllocator):  # the blocks the rejection emptied are free again
            emptied = sum(len(old) - len(table) for table, old in zip(tables, before, strict=True))
            assert self.kv.num_free_blocks == free_before + emptied

    @precondition(lambda self: self.resident())
    @rule(data=st.data())
    def cache_blocks(self, data):
        """The machine writes every token as it is appended: all of a sequence's full blocks are computed."""
        seq_id = data.draw(st.sampled_from(self.resident()))
        self.kv.cache_blocks(seq_id, len(self.tokens[seq_id]))

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        self.drop(data.draw(st.sampled_from(sorted(self.tokens))))

    @rule()
    def commit(self):
        """The step succeeded (its tier moves were taken after it was scheduled): its writes and what it
        cached stay."""
        self.kv.take_tier_moves()
        self.kv.commit()
        self.device.commit()
        self.host.commit()
        self.touched.clear()
        if isinstance(self.kv, PagedAllocator):
            self.committed = {key: block.block_id for key, block in self.kv.pool.cached.items()}

    @rule(free_first=st.booleans(), moves_taken=st.booleans())
    def rollback(self, free_first, moves_taken):
        """The step failed (in its forward, or before its tier moves were taken): none of its writes
        happened, and its sequences are freed."""
        failed = sorted(self.touched & set(self.tokens))
        self.touched.clear()
        self.device.rollback()
        self.host.rollback()
        if moves_taken:
            self.kv.take_tier_moves()
        for seq_id in failed if free_first else ():
            self.drop(seq_id)
        self.kv.rollback()
        for seq_id in () if free_first else failed:
            self.drop(seq_id)
        if isinstance(self.kv, PagedAllocator):  # only what earlier steps cached, where they cached it
            cached = {key: block.block_id for key, block in self.kv.pool.cached.items()}
            assert cached.items() <= self.committed.items()

    # -- invariants --------------------------------------------------------------------------------

    @invariant()
    def every_sequence_reads_back_its_tokens(self):
        for seq_id in self.resident():
            expected = list(enumerate(self.tokens[seq_id]))
            assert [self.device.get(slot) for slot in slots(self.kv, seq_id)] == expected
        for seq_id, toks in self.tokens.items():
            assert self.kv.num_tokens(seq_id) == len(toks) and seq_id in self.kv

    @invariant()
    def block_hashes_are_those_of_accepted_tokens(self):
        """What a run that never speculated holds: the hash chain of each sequence's full blocks."""
        if not getattr(self.kv, "enable_prefix_caching", False):
            return
        for seq_id, toks in self.tokens.items():
            chain: list[bytes] = []
            for i in range(len(toks) // self.bs):
                chain.append(hash_block(chain[-1] if chain else None, toks[i * self.bs : (i + 1) * self.bs]))
            assert self.kv._seqs[seq_id].block_hashes == chain

    @invariant()
    def usage_adds_up(self):
        u = self.kv.usage()
        assert u.live_slots + u.reserved_slots + u.tail_slots + u.free_slots == u.total_slots
        fractions = [u.live_slots, u.reserved_slots, u.tail_slots, u.free_slots]
        assert abs(sum(u.fraction(x) for x in fractions) - 1.0) < 1e-9
        assert min(fractions + [u.external_frag_slots, u.shared_saved_slots]) >= 0
        assert u.external_frag_slots <= u.free_slots and u.largest_free_run <= u.free_slots
        held = [slot for s in self.resident() for slot in slots(self.kv, s)]
        assert u.live_slots == len(set(held))  # a shared slot is counted once
        assert u.shared_saved_slots == len(held) - len(set(held))
        assert u.free_slots == self.kv.num_free_blocks * self.bs

    def teardown(self):
        for seq_id in list(self.tokens):
            self.kv.free(seq_id)
        self.kv.take_tier_moves()  # the step ends: the host blocks its tier copies used are free again
        self.kv.commit()
        assert self.kv.all_free()
        u = self.kv.usage()
        assert u.free_slots == u.total_slots and u.live_slots == 0


class PagedMachine(KVMachine):
    caching = False

    def make_allocator(self):
        return PagedAllocator(10, block_size=2, enable_prefix_caching=self.caching, num_host_blocks=6)

    @precondition(lambda self: self.settled())
    @rule(data=st.data())
    def swap_out(self, data):
        seq_id = data.draw(st.sampled_from(self.settled()))
        can = -(-len(self.tokens[seq_id]) // self.bs) <= self.kv.num_free_host_blocks
        copies = self.refused(can, self.snapshot(), self.kv.swap_out, seq_id)
        if copies is None:
            return
        assert len(copies) == -(-len(self.tokens[seq_id]) // self.bs)
        self.copy_blocks(copies, self.device, self.host)
        self.swapped.add(seq_id)
        self.host_blocks[seq_id] = len(copies)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data(), token=st.integers(0, 1))
    def append_swapped(self, data, token):
        """A swapped-out sequence may grow (it takes no memory until it is back, where its new tokens' K/V
        is written)."""
        seq_id = data.draw(st.sampled_from(sorted(self.swapped)))
        before = self.snapshot()
        assert self.kv.can_append(seq_id) and self.kv.append(seq_id, token) == []
        assert self.snapshot() == before
        self.unwritten.setdefault(seq_id, len(self.tokens[seq_id]))
        self.tokens[seq_id].append(token)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data())
    def swap_in(self, data):
        seq_id = data.draw(st.sampled_from(sorted(self.swapped)))
        can = self.kv.can_swap_in(seq_id)
        copies = self.refused(can, self.snapshot(), self.kv.swap_in, seq_id)
        if copies is None:
            return
        self.copy_blocks(copies, self.host, self.device)
        self.swapped.discard(seq_id)
        del self.host_blocks[seq_id]
        if seq_id in self.unwritten:  # the step after its return computes them
            self.write(seq_id, self.unwritten.pop(seq_id))

    @invariant()
    def ref_counts_match_block_tables(self):
        pool = self.kv.pool
        holders = [0] * len(pool.blocks)
        for seq_id in self.resident():
            table = self.kv.block_table(seq_id)
            held = len(self.tokens[seq_id]) + len(self.drafts.get(seq_id, ()))
            assert len(table) == -(-held // self.bs)  # demand allocation
            assert len(set(table)) == len(table)
            for block_id in table:
                holders[block_id] += 1
        assert [b.ref_cnt for b in pool.blocks] == holders
        free = free_order(pool)
        assert all(b.room == (b in pool.room_queue) for b in pool.blocks)  # room: free blocks set aside
        assert len(free) == len(set(free)) == self.kv.num_free_blocks
        assert set(free) == {i for i, n in enumerate(holders) if n == 0}
        assert all(b.block_hash == h for h, b in pool.cached.items())
        host = self.kv.host  # cached host blocks this step's tier copies use are not reclaimable yet
        pinned = sum(slot in host.pinned for slot in host.cached.values())
        assert (
            self.kv.num_free_host_blocks + pinned + sum(self.host_blocks.values()) == self.kv.num_host_blocks
        )


class CachingPagedMachine(PagedMachine):
    caching = True


class TieredMachine(CachingPagedMachine):
    """With a host and a disk tier under the prefix cache and the KV event log on. The machine makes each
    tier copy as it is planned (an evicted block's content into its host slot, a host hit's into its device
    block), so a failed step's copies are undone with its other writes: a host entry the rollback left
    would serve a later prompt content never copied. After each step's end the replayed events name
    exactly the first group's cached blocks, and after a rollback the tiers hold only what committed steps
    left there."""

    def make_allocator(self):
        self.tiers = PrefixTiers(HostPool(6), DiskTier(8), block_size=2)
        kv = PagedAllocator(10, block_size=2, enable_prefix_caching=True, tiers=self.tiers)
        self.log, self.held = kv.enable_events(), set()
        self.committed_tiers: tuple[dict, set] = ({}, set())
        evicted, load = self.tiers.evicted, self.tiers.load

        def evicted_now(key, block_id):
            offloaded = self.tiers.counters.offloaded_blocks
            evicted(key, block_id)
            if self.tiers.counters.offloaded_blocks > offloaded:
                self.copy_blocks([(block_id, self.tiers.host.cached[key])], self.device, self.host)

        def load_now(key, slot, block_id):
            load(key, slot, block_id)
            self.copy_blocks([(slot, block_id)], self.host, self.device)

        self.tiers.evicted, self.tiers.load = evicted_now, load_now
        return kv

    def replay_events(self) -> None:
        for event in self.log.drain():
            if isinstance(event, BlockStored):
                assert not self.held & set(event.block_hashes), "stored twice without a removal between"
                self.held.update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                assert self.held >= set(event.block_hashes), "removed a block never stored"
                self.held.difference_update(event.block_hashes)
        assert self.held == {h for g, h in self.kv.pool.cached if g == 0}

    @rule()
    def commit(self):
        super().commit()
        self.replay_events()
        self.committed_tiers = (dict(self.tiers.host.cached), set(self.tiers.disk.keys))

    @rule(free_first=st.booleans(), moves_taken=st.booleans())
    def rollback(self, free_first, moves_taken):
        super().rollback(free_first, moves_taken)
        self.replay_events()
        host, disk = self.committed_tiers
        assert dict(self.tiers.host.cached).items() <= host.items() and set(self.tiers.disk.keys) <= disk
        assert not self.tiers.host.pinned


class ContiguousMachine(KVMachine):
    reserve = "max"

    def make_allocator(self):
        return ContiguousAllocator(64, MAX_MODEL_LEN, reserve=self.reserve)

    @invariant()
    def slabs_and_gaps_tile_the_slots(self):
        kv = self.kv
        runs = sorted([(s.start, s.size) for s in kv.slabs.values()] + kv.gaps)
        assert sum(size for _, size in runs) == kv.num_slots
        assert all(a + n == b for (a, n), (b, _) in zip(runs, runs[1:], strict=False))
        assert all(a + n < b for (a, n), (b, _) in zip(kv.gaps, kv.gaps[1:], strict=False))  # merged
        for seq_id, slab in kv.slabs.items():
            assert slab.num_tokens <= slab.size
            lookahead = len(self.drafts.get(seq_id, ()))
            assert kv.block_table(seq_id) == list(range(slab.start, slab.start + slab.num_tokens + lookahead))
        u = kv.usage()
        assert u.reserved_slots == sum(s.size - s.num_tokens for s in kv.slabs.values())
        assert u.largest_free_run == max((n for _, n in kv.gaps), default=0)


class Pow2Machine(ContiguousMachine):
    reserve = "pow2"


class OracleMachine(ContiguousMachine):
    reserve = "oracle"


TestPaged = PagedMachine.TestCase
TestCachingPaged = CachingPagedMachine.TestCase
TestTiered = TieredMachine.TestCase
TestContiguousMax = ContiguousMachine.TestCase
TestContiguousPow2 = Pow2Machine.TestCase
TestContiguousOracle = OracleMachine.TestCase
for _case in (
    TestPaged,
    TestCachingPaged,
    TestTiered,
    TestContiguousMax,
    TestContiguousPow2,
    TestContiguousOracle,
):
    _case.settings = SETTINGS
del _case
