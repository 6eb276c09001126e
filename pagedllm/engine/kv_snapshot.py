"""The KV cache as the dashboard draws it: one JSON-ready dict, read between engine steps.

Built only from the allocator's and the scheduler's public views, in compact lists (no dict per
block or per slot), so taking one costs little next to a step. The parts that never change (layout,
sizes, model) are computed once per engine.
"""

from __future__ import annotations

import time
from dataclasses import asdict

from pagedllm.kv import ContiguousAllocator


class KVSnapshots:
    """Takes snapshots of one engine's KV cache; call `take()` on the engine thread, between steps."""

    def __init__(self, engine):  # an LLMEngine (not imported: it makes snapshots through this module)
        self.engine = engine
        allocator, config = engine.allocator, engine.config
        self.contiguous = isinstance(allocator, ContiguousAllocator)
        self.header = {
            "model": config.model,
            "layout": config.kv_layout,
            "reserve": config.contiguous_reserve if self.contiguous else None,
            "block_size": config.block_size,  # tokens per block (the contiguous cache is addressed by slot)
            "num_blocks": allocator.num_total_blocks // (config.block_size if self.contiguous else 1),
            "total_slots": allocator.usage().total_slots,
            "max_model_len": engine.max_model_len,
            "max_num_seqs": config.max_num_seqs,
            "prefix_caching": allocator.enable_prefix_caching,
            # Per KV group its sliding window (None: full attention); one group keeps every layer's tokens.
            "kv_groups": list(getattr(allocator, "windows", (None,))),
        }

    def take(self) -> dict:
        """Usage, queues, counters, the map (per-block lists, or contiguous runs) and each sequence holding
        KV memory with its block table (paged) or slab (contiguous)."""
        engine, scheduler, allocator = self.engine, self.engine.scheduler, self.engine.allocator
        usage = allocator.usage()
        snapshot = dict(self.header)
        snapshot.update(
            time=time.time(),
            step=engine.num_steps,
            usage=usage.parts() | {"shared_saved": usage.shared_saved_slots},
            queues={
                "running": len(scheduler.running),
                "waiting": len(scheduler.waiting),
                "swapped": len(scheduler.swapped),
            },
            counters={
                "preemptions": scheduler.num_preemptions,
                "prefix_cache_queries": scheduler.prefix_cache_queries,
                "prefix_cache_hits": scheduler.prefix_cache_hits,
            },
        )
        # The prefix cache's host and disk tiers (kv/tiers.py): sizes, use and counters, in blocks.
        snapshot["tiers"] = asdict(engine.tiers.usage()) if engine.tiers is not None else None
        if self.contiguous:
            runs = allocator.runs()
            snapshot["runs"] = [[r.start, r.size, r.num_tokens, r.seq_id, int(r.external)] for r in runs]
            slabs = {run[3]: run[:2] for run in snapshot["runs"] if run[3] is not None}
        else:
            blocks = allocator.block_states()
            snapshot["blocks"] = {
                "ref": blocks.ref_counts,
                "tokens": blocks.num_tokens,
                "cached": [int(cached) for cached in blocks.cached],
                "group": blocks.groups,  # KV group of a held or cached block (-1: plain free)
            }
        seqs = []
        for status, queue in (("running", scheduler.running), ("swapped", scheduler.swapped)):
            for seq in queue:
                entry = {
                    "id": seq.seq_id,
                    "request": seq.request_id,
                    "status": status,
                    "tokens": allocator.num_tokens(seq.seq_id),
                    "prompt": len(seq.prompt_token_ids),
                }
                if self.contiguous:
                    entry["slab"] = slabs[seq.seq_id]
                else:
                    # Every group's table (-1: a window group gave that block back); "table" is the first's.
                    tables = allocator.block_tables(seq.seq_id) if status == "running" else [[]]
                    entry["table"], entry["tables"] = tables[0], tables
                seqs.append(entry)
        snapshot["seqs"] = seqs
        return snapshot
