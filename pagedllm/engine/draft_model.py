"""The draft-model proposer: a smaller model of the target's vocabulary guesses k tokens, in its own paged KV.

Each round it proposes for every speculating sequence at once, in k forward passes of its own
ModelRunner. The first catches the draft's cache up on the tokens it has not seen (the whole prompt the
first time; after a verify pass, the target's new tokens past the drafts it accepted) and gives the first
draft token; each further pass computes one draft token per sequence and gives the next. Drafts' K/V go
into lookahead slots of the draft's own block pool (kv/paged.py), so the next round keeps the ones the
target accepted (`append` takes their slots) and `release_lookahead` gives back the rest, as the
scheduler does for the target. A greedy sequence's drafts are the draft model's argmax; a sampled one's
are drawn from the draft's distribution q, kept for the rejection-sampling rule (engine/sampler.py).

With `draft_vocab_size` N the draft's LM head is that of its vocabulary's most frequent tokens alone
(FR-Spec, Zhao et al., 2025: the head of a 0.5B model is a third of the bytes one of its steps reads):
the first N ids, which a byte-level BPE vocabulary numbers in merge order, most frequent pairs first (FR-
Spec counts a corpus instead), and every added (special) token and EOS. Its logits elsewhere are -inf:
a greedy draft is the argmax over the subset, a sampled one is drawn from q renormalised over it, and
the rejection rule with that q keeps the target's distribution, as it does for any q (the residual
(p - q)+ covers the tokens the draft cannot propose). The target verifies every draft, so the output
is the same; only the acceptance can drop.

The draft's pool has as many blocks of block_size tokens as the target's (its own blocks are smaller:
fewer layers and heads), so whatever the target holds the draft can hold too; its memory comes on top
of kv_cache_memory and is logged. A sequence the draft cannot hold at the moment just does not
speculate.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from pagedllm.engine.config import EngineConfig
from pagedllm.engine.kv_sizing import kv_block_bytes, model_kv_groups
from pagedllm.engine.model_cache import load_shared_model
from pagedllm.engine.model_runner import ModelRunner, calibration_ids
from pagedllm.engine.sampler import SampleRow, sample_drafts
from pagedllm.engine.scheduler import SchedulerOutput
from pagedllm.engine.sequence import Sequence
from pagedllm.engine.speculative import Draft, SpeculativeConfig
from pagedllm.kv import PagedAllocator
from pagedllm.models.linear import take_rows

logger = logging.getLogger(__name__)


@dataclass
class _DraftSeq:
    """A sequence as the draft's cache holds it, shaped as ModelRunner.prepare_inputs reads a Sequence."""

    seq_id: str
    token_ids: list[int]  # the target's tokens, then this round's drafts
    num_cached_tokens: int = 0  # leading tokens whose draft K/V is computed (or is by this pass's end)
    draft_token_ids: list[int] = field(default_factory=list)  # always empty: the draft verifies nothing
    prompt_logprobs: None = None
    lora_int_id: None = None  # the draft runs on its own base, whatever the target's adapter

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


class DraftModelProposer:
    """Draft tokens from a smaller model of the same vocabulary, batched over the speculating sequences."""

    def __init__(self, spec: SpeculativeConfig, config: EngineConfig, vocab_size: int, num_blocks: int):
        self.k = spec.num_speculative_tokens
        dtype, device, max_num_seqs = config.torch_dtype, config.device, config.max_num_seqs
        loaded = load_shared_model(spec.model, dtype, device, config.quantization, max_num_seqs=max_num_seqs)
        cfg = loaded.model.config
        if cfg.vocab_size != vocab_size:
            raise ValueError(
                f"speculative_config model {spec.model!r} has a vocabulary of {cfg.vocab_size} tokens, the "
                f"target model {config.model!r} {vocab_size}: a draft model shares the target's vocabulary"
            )
        self.max_model_len = cfg.max_position_embeddings
        groups = model_kv_groups(cfg, hybrid=False)  # no window groups: a draft's prefill is never chunked
        self.allocator = PagedAllocator(num_blocks, config.block_size, num_host_blocks=0)
        self.vocab_size, self.vocab_ids, head = vocab_size, None, None
        if spec.draft_vocab_size is not None and spec.draft_vocab_size < vocab_size:
            self.vocab_ids = frequent_token_ids(loaded, spec.draft_vocab_size)
            head = take_rows(loaded.model.lm_head, self.vocab_ids)  # the shared model's own head stays
        self.runner = ModelRunner(
            loaded.model,
            num_blocks,
            config.block_size,
            config.kv_torch_dtype,
            config.device,
            prefault_kv_cache=config.prefault_kv_cache,
            groups=groups,
            lm_head=head,
        )
        self.runner.calibrate_key_smoothing(calibration_ids(cfg.vocab_size, self.max_model_len))
        block_bytes = kv_block_bytes(cfg, loaded.model.num_kv_heads, config.kv_torch_dtype, config.block_size)
        logger.info(
            "draft model %s: weights %.1f MiB, KV cache %.1f MiB (%d blocks, as the target's)",
            spec.model,
            loaded.weight_bytes / 2**20,
            num_blocks * block_bytes / 2**20,
            num_blocks,
        )
        self.loaded_model = loaded  # the shared weights live while this proposer does
        self.seqs: dict[str, _DraftSeq] = {}

    def propose_batch(
        self, seqs: list[Sequence], rooms: list[int], generators: list[torch.Generator | None]
    ) -> list[Draft]:
        """Up to min(k, room) drafts for each sequence, with the q they were drawn from (sampled ones)."""
        drafts = [Draft([]) for _ in seqs]
        batch, copies = [], []  # (index, its _DraftSeq, how many drafts), block copies before pass 1
        for i, (seq, room) in enumerate(zip(seqs, rooms, strict=True)):
            k = min(self.k, room, self.max_model_len - seq.num_tokens)
            draft = self._catch_up(seq) if k > 0 else None
            if draft is None:
                continue
            if not self.allocator.can_reserve_lookahead(seq.seq_id, k - 1):
                k = 1  # the first draft's K/V is never computed: it needs no slot
            copies += self.allocator.reserve_lookahead(seq.seq_id, k - 1)
            batch.append((i, draft, k))
        probs: dict[int, list[torch.Tensor]] = {}
        for step in range(max((k for _, _, k in batch), default=0)):
            batch = [entry for entry in batch if entry[2] > step]
            out = SchedulerOutput(copies=copies if step == 0 else [])
            for _, draft, _ in batch:
                out.add(out.prefills, draft, draft.num_tokens - draft.num_cached_tokens)
                draft.num_cached_tokens = draft.num_tokens
            tables = [self.allocator.block_tables(draft.seq_id) for _, draft, _ in batch]
            logits = self.runner.execute_step(self.runner.prepare_inputs(out, tables))
            if self.vocab_ids is not None:  # the subset's logits in place, -inf elsewhere: q is 0 there
                full = logits.new_full((len(logits), self.vocab_size), float("-inf"))
                logits = full.index_copy_(1, self.vocab_ids, logits)
            rows = [SampleRow(seqs[i].params, generators[i]) for i, _, _ in batch]
            for (i, draft, _), token, q in zip(batch, *sample_drafts(logits, rows), strict=True):
                draft.token_ids.append(token)
                drafts[i].token_ids.append(token)
                if q is not None:
                    probs.setdefault(i, []).append(q)
        for i, rows_q in probs.items():
            drafts[i].probs = torch.stack(rows_q)
        return drafts

    def _catch_up(self, seq: Sequence) -> _DraftSeq | None:
        """The sequence in the draft's cache with slots for every token it has: its last round's drafts
        that the target accepted keep their K/V (and slots), the tokens after them are to be computed
        (at least the newest: its logits give the first draft). None if the draft's pool has no room."""
        draft = self.seqs.get(seq.seq_id)
        token_ids = seq.token_ids
        if draft is None:
            if not self.allocator.can_allocate(token_ids, 0):
                return None
            self.allocator.allocate(seq.seq_id, token_ids, 0)
            draft = self.seqs[seq.seq_id] = _DraftSeq(seq.seq_id, token_ids)
            return draft
        held = self.allocator.num_tokens(seq.seq_id)
        kept, end = held, min(draft.num_cached_tokens, len(token_ids) - 1)
        while kept < end and draft.token_ids[kept] == token_ids[kept]:
            self.allocator.append(seq.seq_id, token_ids[kept])  # its lookahead slot: never a copy
            kept += 1
        self.allocator.release_lookahead(seq.seq_id)
        for token in token_ids[kept:]:
            if not self.allocator.can_append(seq.seq_id):
                self.release(seq.seq_id)
                return None
            self.allocator.append(seq.seq_id, token)  # no block is shared: never a copy
        draft.token_ids, draft.num_cached_tokens = token_ids, kept
        return draft

    def release(self, seq_id: str) -> None:
        """The sequence left the target's cache (finished, aborted, preempted): free its draft blocks."""
        if self.seqs.pop(seq_id, None) is not None:
            self.allocator.free(seq_id)

    def all_free(self) -> bool:
        return self.allocator.all_free()


def frequent_token_ids(loaded, size: int) -> torch.Tensor:
    """The draft vocabulary: ids below `size` (a BPE vocabulary's earliest merges), the tokenizer's added
    tokens and EOS, ascending."""
    added = loaded.tokenizer.added_token_ids() if loaded.tokenizer is not None else []
    extra = {t for t in [*added, *loaded.eos_token_ids] if size <= t < loaded.model.config.vocab_size}
    return torch.tensor([*range(size), *sorted(extra)], dtype=torch.int64)
