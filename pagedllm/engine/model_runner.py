"""Owns the model and its KV cache tensors; turns a scheduled step into one forward pass and logits."""

from __future__ import annotations

import contextlib
import itertools
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm import ops
from pagedllm.engine import prompt_logprobs
from pagedllm.engine.lora_manager import LoRAManager
from pagedllm.engine.scheduler import SchedulerOutput
from pagedllm.kv import KVGroups, kv_groups
from pagedllm.models.attention import AttentionMetadata
from pagedllm.models.quantization import bf16_gate, gates_many_rows, takes_bf16
from pagedllm.ops import reference
from pagedllm.ops.kv_cache import is_quantized, key_smoothing

CALIBRATION_TOKENS = 512  # of the forward pass that calibrates a quantized cache's key smoothing


def calibration_ids(vocab_size: int, max_model_len: int) -> np.ndarray:
    """The token ids the key smoothing is calibrated on: CALIBRATION_TOKENS of them (at most
    max_model_len), uniform over the vocabulary from a fixed seed, so the same in every run and on every
    rank, and no text to ship. Keys' large channels come from the model's weights, not the text."""
    rng = np.random.default_rng(0)
    return rng.integers(vocab_size, size=min(CALIBRATION_TOKENS, max_model_len), dtype=np.int64)


@dataclass
class StepInputs:
    """One step's work as plain arrays: the flattened batch's indices and the KV block moves before it.

    Built once by the engine's rank; under tensor parallelism every rank runs its shard on the same copy.
    """

    input_ids: np.ndarray  # [num_tokens] int64
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: np.ndarray  # [num_groups, num_tokens] int64
    block_tables: np.ndarray  # [num_groups, num_seqs, max_blocks] int32
    context_lens: np.ndarray  # [num_seqs] int32
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    max_query_len: int
    num_logits: np.ndarray  # [num_seqs] int32: each sequence's last rows whose logits are computed
    swap_out: np.ndarray  # [n, 2] int64 (device block, host block)
    swap_in: np.ndarray  # [n, 2] int64 (host block, device block)
    copies: np.ndarray  # [n, 2] int64 copy-on-write (src, dst)
    computes_prompt: bool  # some sequence computes prompt tokens (not only its newest and its drafts)
    lora_ids: list[int] = field(default_factory=list)  # the LoRA adapters the step runs (lora_int_id)
    token_loras: np.ndarray | None = None  # [num_tokens] int64: each token's index in lora_ids, -1: base


def logits_rows(query_start_loc: np.ndarray, num_logits: np.ndarray) -> np.ndarray:
    """Rows of the flattened batch whose logits are computed: the last num_logits[s] of sequence s's."""
    total = int(num_logits.sum())
    ends = query_start_loc[1:].astype(np.int64)
    firsts = np.repeat(ends - num_logits, num_logits)
    return firsts + np.arange(total) - np.repeat(np.cumsum(num_logits) - num_logits, num_logits)


def _token_loras(seqs: list, owner: np.ndarray) -> tuple[list[int], np.ndarray | None]:
    """The step's LoRA adapters (lora_int_id, ascending) and each token's index among them (-1: the base;
    None when every sequence runs the base). `owner[t]`: the sequence of token t."""
    lora_ids = sorted({seq.lora_int_id for seq in seqs if seq.lora_int_id is not None})
    if not lora_ids:
        return [], None
    index = {lora_int_id: i for i, lora_int_id in enumerate(lora_ids)}
    seq_loras = np.fromiter((index.get(seq.lora_int_id, -1) for seq in seqs), np.int64, len(seqs))
    return lora_ids, seq_loras[owner]


def _pairs(pairs: list[tuple[int, int]]) -> np.ndarray:
    return np.array(pairs, np.int64).reshape(-1, 2)


class ModelRunner:
    """Runs a flattened batch (prefill chunks and decode tokens together) through the paged KV cache.

    The cache is one K and one V view per layer, [num_blocks, block_size, num_kv_heads, head_dim]
    (ops.allocate_kv_caches picks the memory order for the device); the contiguous layout uses the same
    memory as [num_slots, 1, num_kv_heads, head_dim]. A host pool of the same shape holds swapped blocks.
    With KV groups (kv/groups.py) there is one buffer per layer of a group, each shared by one layer of
    every group: block b of a buffer belongs to whichever group holds block b.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        num_host_blocks: int = 0,
        prefault_kv_cache: bool = True,
        groups: KVGroups | None = None,
        lm_head: torch.nn.Module | None = None,
        loras: LoRAManager | None = None,
    ):
        self.model = model
        self.loras = loras  # the engine's LoRA adapters (enable_lora), None without
        # GGUF layers' bf16 path (with AVX2, their K types' float panels): per step (takes_bf16)
        self.gates_bf16 = gates_many_rows(model)
        self.lm_head = lm_head  # None: the model's own; a draft's may be over part of the vocabulary
        self.device = torch.device(device)
        self.num_blocks, self.block_size, self.num_host_blocks = num_blocks, block_size, num_host_blocks
        self.kv_dtype, self.prefault_kv_cache = dtype, prefault_kv_cache
        cfg = model.config
        self.groups = groups or kv_groups([None] * cfg.num_layers, hybrid=False)
        geometry = (block_size, model.num_kv_heads, cfg.head_dim, dtype)  # this rank's KV heads
        buffers = self.groups.layers_per_group
        self.kv_buffers = ops.allocate_kv_caches(
            buffers, num_blocks, *geometry, self.device, touch=prefault_kv_cache
        )
        self.host_kv_buffers = (
            ops.allocate_kv_caches(buffers, num_host_blocks, *geometry, "cpu", self.device.type == "cuda")
            if num_host_blocks
            else []
        )
        self.kv_caches = [self.kv_buffers[slot] for slot in self.groups.layer_slot]  # per layer

    @torch.inference_mode()
    def calibrate_key_smoothing(self, input_ids: np.ndarray) -> None:
        """Set each K buffer's key smoothing (ops/kv_cache.py) to the one fitted to the keys of a forward
        pass over input_ids (reference.fit_key_smoothing), held in a float32 scratch cache: a layer's own,
        or, where KV groups share a buffer between layers, fitted to those layers' keys together (the
        kernels read one smoothing a buffer). A no-op unless the cache is quantized."""
        if not is_quantized(self.kv_dtype):
            return
        cfg, count, block_size = self.model.config, len(input_ids), 16
        num_blocks = -(-count // block_size)
        scratch = ops.allocate_kv_caches(
            cfg.num_layers, num_blocks, block_size, self.model.num_kv_heads, cfg.head_dim, torch.float32,
            self.device,
        )  # fmt: skip
        meta = AttentionMetadata(  # one group: every layer its own scratch cache, all its tokens
            slot_mapping=torch.arange(count, device=self.device)[None],
            block_tables=torch.arange(num_blocks, dtype=torch.int32, device=self.device)[None, None],
            context_lens=torch.tensor([count], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, count], dtype=torch.int32, device=self.device),
            max_query_len=count,
            kv_caches=scratch,
        )
        self.model(self._tensor(input_ids), torch.arange(count, device=self.device), meta)
        for buffer, (k_cache, _) in enumerate(self.kv_buffers):
            layers = [layer for layer, slot in enumerate(self.groups.layer_slot) if slot == buffer]
            keys = torch.cat([scratch[layer][0].flatten(0, 1)[:count] for layer in layers])
            for held, value in zip(key_smoothing(k_cache), reference.fit_key_smoothing(keys), strict=True):
                held.copy_(value)

    def move_blocks(
        self, swap_out: list[list[int]], swap_in: list[list[int]], copies: list[list[int]]
    ) -> None:
        """Swap-outs first (their device blocks may be reused this step; evicted prefix blocks moving to
        the host tier among them), then copies (forks and copy on write, decided after the previous step:
        a source block freed since, by an abort, may be a swap-in's destination), then swap-ins (loads
        from the host tier among them)."""
        for buffer, (k, v) in enumerate(self.kv_buffers):
            if swap_out:
                ops.swap_blocks(k, v, *self.host_kv_buffers[buffer], swap_out)
            if copies:
                ops.copy_blocks(k, v, copies)
            if swap_in:
                ops.swap_blocks(*self.host_kv_buffers[buffer], k, v, swap_in)

    @torch.inference_mode()
    def execute_step(self, step: StepInputs) -> torch.Tensor | None:
        """Move blocks, run the forward pass; float32 logits of each sequence's last step.num_logits
        computed tokens, sequence after sequence: its newest, its 1 + k with k draft tokens, or a prompt's
        rows for its log-probabilities (None on a tensor-parallel rank other than 0)."""
        self.move_blocks(step.swap_out.tolist(), step.swap_in.tolist(), step.copies.tolist())
        meta = AttentionMetadata(
            slot_mapping=self._tensor(step.slot_mapping),
            block_tables=self._tensor(step.block_tables),
            context_lens=self._tensor(step.context_lens),
            query_start_loc=self._tensor(step.query_start_loc),
            max_query_len=step.max_query_len,
            kv_caches=self.kv_caches,
            layer_groups=self.groups.layer_group,
        )
        gate = (
            bf16_gate(takes_bf16(step.computes_prompt, step.max_query_len))
            if self.gates_bf16
            else contextlib.nullcontext()
        )
        with gate, self._step_adapters(step):
            hidden = self.model(self._tensor(step.input_ids), self._tensor(step.positions), meta)
            if int(step.num_logits.sum()) < len(hidden):  # some rows need no logits: keep the others
                hidden = hidden[self._tensor(logits_rows(step.query_start_loc, step.num_logits))]
            return self.model.compute_logits(hidden, self.lm_head)

    @contextlib.contextmanager
    def _step_adapters(self, step: StepInputs):
        """The step's LoRA adapters update their tokens' projections during the forward (none after). A
        runner without adapters (a draft model's) runs every sequence on its base."""
        if step.token_loras is None or self.loras is None:
            yield
            return
        state = self.loras.state
        state.set_step(self.loras.step_adapters(step.lora_ids), step.token_loras, self.device)
        try:
            yield
        finally:
            state.clear()

    def prepare_inputs(self, out: SchedulerOutput, block_tables: list[list[list[int]]]) -> StepInputs:
        """The step's arrays for the scheduled sequences, whose KV blocks are given by `block_tables` (per
        sequence, one table per KV group; a window group's NO_BLOCK entries become block 0, never read).

        Sequence s computes its last out.num_new_tokens[s] tokens up to its num_cached_tokens (which the
        scheduler already counts them in): the rest of its tokens, or one chunk of a long prompt, or its
        newest token and its draft tokens. Index arithmetic runs in numpy, one array operation per batch
        rather than one Python operation per token.
        """
        seqs = out.scheduled
        ends = np.fromiter((seq.num_cached_tokens for seq in seqs), np.int64, len(seqs))
        counts = np.fromiter((out.num_new_tokens[seq.seq_id] for seq in seqs), np.int64, len(seqs))
        starts = ends - counts
        query_start_loc = np.zeros(len(seqs) + 1, np.int32)
        np.cumsum(counts, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        tables = self._table_array(block_tables)
        if num_tokens == len(seqs) and all(
            seq.num_tokens == end for seq, end in zip(seqs, ends, strict=True)
        ):
            # decode: one token per sequence, its last
            input_ids = np.fromiter((seq.token_ids[-1] for seq in seqs), np.int64, len(seqs))
            positions, owner = starts, np.arange(len(seqs))
            num_logits = np.ones(len(seqs), np.int32)  # a prompt's log-probabilities all came before
            computes_prompt = False
        else:
            input_ids = np.fromiter(
                itertools.chain.from_iterable(
                    seq.token_ids[start:end] + seq.draft_token_ids
                    for seq, start, end in zip(seqs, starts, ends, strict=True)
                ),
                np.int64,
                num_tokens,
            )
            owner = np.repeat(np.arange(len(seqs)), counts)  # which sequence each token belongs to
            positions = np.arange(num_tokens) - np.repeat(query_start_loc[:-1], counts) + starts[owner]
            num_logits = np.fromiter((1 + len(seq.draft_token_ids) for seq in seqs), np.int32, len(seqs))
            computes_prompt = bool((counts > num_logits).any())  # before prompt_logprobs widens num_logits
            for s, seq in enumerate(seqs):  # a mixed step's decodes pass by at the cost of one test
                if seq.prompt_logprobs is not None:
                    num_logits[s] = prompt_logprobs.num_logits(seq, int(starts[s]), int(ends[s]))
        bs = self.block_size
        slots = tables[:, owner, positions // bs].astype(np.int64) * bs + positions % bs
        lora_ids, token_loras = _token_loras(seqs, owner)
        return StepInputs(
            input_ids=input_ids,
            positions=positions,
            slot_mapping=slots,
            block_tables=tables,
            context_lens=ends.astype(np.int32),
            query_start_loc=query_start_loc,
            max_query_len=int(counts.max()),
            num_logits=num_logits,
            swap_out=_pairs(out.swap_out),
            swap_in=_pairs(out.swap_in),
            copies=_pairs(out.copies),
            computes_prompt=computes_prompt,
            lora_ids=lora_ids,
            token_loras=token_loras,
        )

    def _table_array(self, block_tables: list[list[list[int]]]) -> np.ndarray:
        """[groups, sequences, widest table] block ids; a window group's NO_BLOCK entries become block 0."""
        width = max(len(table) for group_tables in block_tables for table in group_tables)
        tables = np.zeros((self.groups.num_groups, len(block_tables), width), np.int32)
        for s, group_tables in enumerate(block_tables):
            for g, table in enumerate(group_tables):
                tables[g, s, : len(table)] = table
        np.maximum(tables, 0, out=tables)  # the kernels never read below a sliding layer's window
        return tables

    # -- prefix cache tiers: the bytes of blocks, for the disk tier's files ---------------------------

    def read_device_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """The device blocks' K/V of every layer as rows of bytes ([n, block bytes] uint8, CPU)."""
        return ops.read_block_bytes(self.kv_buffers, block_ids)

    def write_host_blocks(self, slots: list[int], rows: torch.Tensor) -> None:
        """Store rows of read_device_blocks into host blocks (a disk tier's read, on its way up)."""
        ops.write_block_bytes(self.host_kv_buffers, slots, rows)

    def key_smoothing_bytes(self) -> bytes:
        """A quantized cache's calibrated key smoothing (b'' for a cache of values): it shapes the bytes."""
        if not is_quantized(self.kv_dtype):
            return b""
        parts = [t.cpu().numpy().tobytes() for k, _ in self.kv_buffers for t in key_smoothing(k)]
        return b"".join(parts)

    def time_host_load(self, num_blocks: int) -> float:
        """Seconds to copy `num_blocks` host blocks into the device cache (run at start-up, while every
        block is still zero: what a host tier's load costs)."""
        pairs = [[i, i] for i in range(num_blocks)]
        start = time.perf_counter()
        self.move_blocks([], pairs, [])
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def _tensor(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)
