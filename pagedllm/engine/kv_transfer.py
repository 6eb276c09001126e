"""Moving K/V bytes between the prefix cache's tiers: disk reads landing in host blocks, the write-through
of newly cached blocks to the disk tier's files, and the disk tier's folder itself.

The kv/ tiers decide what moves (kv/tiers.py: pure bookkeeping); this module does the byte work that needs
the model runner's buffers and the disk. Host <-> device copies travel with the step's swap-outs and
swap-ins (the scheduler writes them into the step's plan), so they are not here.
"""

from __future__ import annotations

import logging

import torch

from pagedllm.engine.kv_store import DiskReader, DiskStore, kv_fingerprint
from pagedllm.kv.tiers import DISK, PrefixTiers, TierMoves

logger = logging.getLogger(__name__)

PREFETCH_SEQS = 8  # waiting prompts whose disk-tier blocks are read ahead, each step


class TierTransfers:
    """The byte moves of the host and disk tiers, for one engine."""

    def __init__(self, tiers: PrefixTiers, runner, store: DiskStore | None):
        self.tiers, self.runner, self.store = tiers, runner, store
        self.reader = DiskReader(store) if store is not None else None

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()

    def prefetch(self, scheduler, allocator) -> None:
        """Land the disk reads that finished into host blocks, then start reads of the disk-tier blocks of
        the next waiting prompts (on the reader's thread); a prompt whose blocks are still being read waits
        in the queue (`Sequence.loading_kv`) while the others step. With nothing else to run, wait for one."""
        if self.reader is None:
            return
        idle = not scheduler.running and not scheduler.swapped
        idle = idle and not any(seq.admissible for seq in scheduler.waiting)
        for done in self.reader.finished(block=idle):
            self._land(done)
        for i, seq in enumerate(scheduler.waiting):
            if i >= PREFETCH_SEQS or seq.awaiting or seq.needs_prompt_logprobs:
                seq.loading_kv = False
                continue
            plan = allocator.plan_prefetch(seq.token_ids, seq.lora_int_id)
            if plan.reads:
                self.reader.submit(plan.reads)
            seq.loading_kv = plan.pending

    def _land(self, done) -> None:
        """Write one finished batch of disk reads into their host blocks. A read that failed, or a host
        write that raises, leaves its blocks out of the host tier (a miss: recomputed), nothing else."""
        ok = [data is not None for data in done.payloads]
        good = [(slot, data) for (_, slot), data in zip(done.reads, done.payloads, strict=True) if data]
        try:
            if good:
                rows = torch.frombuffer(bytearray(b"".join(data for _, data in good)), dtype=torch.uint8)
                self.runner.write_host_blocks([slot for slot, _ in good], rows.view(len(good), -1))
        except Exception:
            logger.exception("disk tier: %d blocks read but not landed in host memory", len(good))
            ok = [False] * len(done.reads)
        self.tiers.observe_load(DISK, done.seconds, len(done.reads))
        self.tiers.prefetched(done.reads, ok)

    def persist(self, moves: TierMoves) -> None:
        """After the forward computed them: write the newly cached blocks to the disk tier's files, delete
        those it evicted (a disk that fails a write loses that block from the tier, nothing else)."""
        if self.store is None:
            return
        disk = self.tiers.disk
        keep = [(block, key) for block, key in moves.persist if key in disk]
        if keep:
            rows = self.runner.read_device_blocks([block for block, _ in keep]).numpy()
            for (_, key), row in zip(keep, rows, strict=True):
                try:
                    self.store.write(key, row.tobytes())
                except OSError as error:
                    logger.warning("disk tier: block not written (%s)", error)
                    disk.forget(key)
        for key in moves.drop:
            if key not in disk:
                self.store.delete(key)


def open_disk_store(engine, block_bytes: int) -> DiskStore:
    """The disk tier's folder for this model and these settings; the blocks already there (from an
    earlier process) join the tier, oldest first, as far as its size allows."""
    config, model_cfg = engine.config, engine.model.config
    settings = {
        "model": config.model,
        "dtype": str(config.torch_dtype),
        "kv_cache_dtype": str(config.kv_torch_dtype),
        "quantization": config.quantization,
        "linear_method": engine.loaded_model.linear_method,
        "block_size": config.block_size,
        "layers": model_cfg.num_layers,
        "kv_heads": engine.model.num_kv_heads,
        "head_dim": model_cfg.head_dim,
        "block_bytes": block_bytes,
        "layout": "per layer K then V, a block as [slot, kv_head, dim] (quantized: codes, then scales)",
    }
    fingerprint, described = kv_fingerprint(
        engine.loaded_model.path, settings, engine.runner.key_smoothing_bytes()
    )
    store = DiskStore(config.kv_offload_dir, fingerprint, described, block_bytes)
    for key in store.scan():
        for old in engine.tiers.disk.add(key):
            store.delete(old)
    logger.info("disk tier %s: %d blocks found", store.folder, len(engine.tiers.disk.keys))
    return store
