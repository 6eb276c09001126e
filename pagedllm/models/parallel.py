"""Tensor parallelism (Megatron-style): which part of each weight a rank holds, and the sharded layers.

A rank of an N-way group holds, per decoder layer, its attention heads (the rows of q/k/v for them, the
matching columns of o_proj) and its slice of the MLP's intermediate features (rows of gate/up, columns of
down); the embedding and the LM head hold its slice of the vocabulary. Column-parallel layers leave their
output split across ranks; row-parallel layers end with one all-reduce. With N = 1 every part is the
whole tensor and no collective runs, so the model families are written once, against these layers.

How a layer's slice is stored and multiplied stays the LinearMethod's business (models/linear.py): the
loader narrows each checkpoint tensor to the rank's part (`checkpoint_part`) before the method sees it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from pagedllm.models.gguf_quants import KEPT_TYPES, GGUFBlocks
from pagedllm.models.linear import Linear, MergedLinear
from pagedllm.ops import native


@dataclass(frozen=True)
class Part:
    """Indices [start, start + size) of a checkpoint tensor with `total` of them along `dim`."""

    start: int
    size: int
    total: int
    dim: int = 0

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.narrow(self.dim, self.start, self.size)

    def scaled(self, factor: int, dim: int = 0) -> Part:
        """The same part counted in units `factor` times finer (heads -> rows of head_dim each)."""
        return Part(self.start * factor, self.size * factor, self.total * factor, dim)


def split(total: int, parts: int, index: int) -> Part:
    """Part `index` of `total` split into `parts` contiguous ranges whose sizes differ by at most one."""
    base, extra = divmod(total, parts)
    start = index * base + min(index, extra)
    return Part(start, base + (index < extra), total)


class CollectiveError(RuntimeError):
    """A collective failed (its cause says why): a rank died, hung past the timeout, or the link broke."""


@dataclass
class CommStats:
    """Wall time rank 0 spends inside collectives (waiting for the other ranks included)."""

    seconds: float = 0.0
    calls: int = 0


@dataclass
class TensorParallel:
    """This process's rank in a tensor-parallel group and the collectives the sharded layers call.

    `group` carries the model's tensors (gloo on the CPU, NCCL on CUDA); `cpu_group` carries the step's
    metadata (the same gloo group on the CPU). Both are None while the group forms and for N = 1.
    """

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    comm: CommStats = field(default_factory=CommStats)

    def _timed(self, collective, *args, counted: bool = True, **kwargs) -> None:
        start = time.perf_counter()
        try:
            collective(*args, **kwargs)
        except RuntimeError as error:
            name = collective.__name__
            raise CollectiveError(f"{name} on tensor-parallel rank {self.rank} failed") from error
        if counted:
            self.comm.seconds += time.perf_counter() - start
            self.comm.calls += 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the ranks, in place (every rank gets the same bits)."""
        if self.size > 1:
            self._timed(dist.all_reduce, x, group=self.group)
        return x

    def gather(
        self, x: torch.Tensor, total: int, counted: bool = True, cpu: bool = False
    ) -> torch.Tensor | None:
        """Rank 0: every rank's slice of a last dimension split by `split(total, ...)`, side by side;
        the other ranks: None. `cpu`: x is a CPU tensor (over the CPU group, whatever the device)."""
        if self.size == 1:
            return x
        width = -(-total // self.size)  # the widest part; narrower ones are padded to it
        padded = F.pad(x, (0, width - x.shape[-1])).contiguous()
        chunks = [torch.empty_like(padded) for _ in range(self.size)] if self.rank == 0 else None
        group = self.cpu_group if cpu else self.group
        self._timed(dist.gather, padded, chunks, group=group, group_dst=0, counted=counted)
        if chunks is None:
            return None
        sizes = [split(total, self.size, r).size for r in range(self.size)]
        return torch.cat([chunk[..., :size] for chunk, size in zip(chunks, sizes, strict=True)], dim=-1)

    def broadcast(self, x: torch.Tensor, counted: bool = True) -> torch.Tensor:
        """Rank 0's x on every rank, over the CPU group (the step's metadata). Not `counted` in comm: a
        worker's wait for the next message (rank 0 is busy elsewhere), reading the counts themselves."""
        self._timed(dist.broadcast, x, group=self.cpu_group, group_src=0, counted=counted)
        return x

    def close(self) -> None:
        """Destroy the groups now: gloo's threads may still hold the last collective's tensors, and freeing
        them in the interpreter's teardown aborts the process ("terminate called without an active
        exception", pytorch/pytorch#190489). The destructor waits for them with the GIL released."""
        self.group = self.cpu_group = None


SINGLE = TensorParallel()


@dataclass(frozen=True)
class AttentionHeads:
    """The query heads and KV heads one rank computes (in heads, not rows)."""

    q: Part
    kv: Part


def attention_heads(num_heads: int, num_kv_heads: int, tp: TensorParallel) -> AttentionHeads:
    """Split the KV heads (each with its group of query heads) over the ranks; where there are more ranks
    than KV heads, each KV head is replicated on size / num_kv_heads ranks that split its query group.

    Groups are split as evenly as they go (SmolLM2's 3 KV heads over 2 ranks: 2 and 1), unlike vLLM, which
    requires equal shares; a split that leaves a rank without a head, or a KV head without whole ranks,
    is refused.
    """
    n = tp.size
    where = f"tensor_parallel_size={n} with {num_heads} attention heads and {num_kv_heads} KV heads"
    group = num_heads // num_kv_heads
    if n <= num_kv_heads:
        kv = split(num_kv_heads, n, tp.rank)
        return AttentionHeads(kv.scaled(group), kv)
    if n % num_kv_heads:
        raise ValueError(
            f"{where}: with more ranks than KV heads, each KV head is replicated on the same number of "
            f"ranks, so tensor_parallel_size must be a multiple of {num_kv_heads}"
        )
    replicas = n // num_kv_heads
    if group < replicas:
        raise ValueError(f"{where}: a KV head's {group} query heads cannot be split over {replicas} ranks")
    kv_head = tp.rank // replicas
    q = split(group, replicas, tp.rank % replicas)
    return AttentionHeads(Part(kv_head * group + q.start, q.size, num_heads), Part(kv_head, 1, num_kv_heads))


def check_split(config, size: int) -> None:
    """A clear ValueError, before any process starts, if `config` cannot be split over `size` ranks."""
    for rank in range(size):
        attention_heads(config.num_heads, config.num_kv_heads, TensorParallel(rank, size))
    for name in ("intermediate_size", "vocab_size"):
        if getattr(config, name) < size:
            raise ValueError(
                f"tensor_parallel_size={size} is more than the model's {name} of {getattr(config, name)}"
            )


class ColumnParallelLinear(MergedLinear):
    """Some output features of one or more projections of the same input (q/k/v, gate/up, the LM head):
    the rank holds `parts[name]` of each projection's rows; the output stays split across the ranks."""

    def __init__(self, in_features: int, parts: dict[str, Part], bias: bool = False):
        super().__init__(in_features, {name: part.size for name, part in parts.items()}, bias=bias)
        self.parts = parts

    def checkpoint_part(self, pname: str, shard: str) -> Part:
        return self.parts[shard]  # the weight's rows and the bias's entries alike


class RowParallelLinear(Linear):
    """Some input features of one projection whose input is split across the ranks (o_proj, down_proj):
    each rank multiplies its columns of W, and one all-reduce sums the partial outputs.

    The bias and a fused residual are added by rank 0 alone, inside its matmul, so they count once in
    the sum; the other ranks hold no bias.
    """

    def __init__(self, in_part: Part, out_features: int, tp: TensorParallel, bias: bool = False):
        super().__init__(in_part.size, out_features, bias=bias and tp.rank == 0)
        self.in_part = Part(in_part.start, in_part.size, in_part.total, dim=1)
        self.tp = tp
        self.skipped = ("bias",) if bias and tp.rank > 0 else ()  # checkpoint tensors this rank leaves out

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        first = self.tp.rank == 0
        return self.tp.all_reduce(self.matmul(x, residual if first else None))

    def checkpoint_part(self, pname: str, shard: str | None) -> Part | None:
        return self.in_part if pname == "weight" else None


def vocab_parallel_lookup(
    input_ids: torch.Tensor, part: Part, tp: TensorParallel, rows: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """Embedding rows of `input_ids` from a table split by vocabulary: `rows` looks up this rank's `part`;
    a token another rank holds looks up zeros here, and one all-reduce assembles every token's row."""
    if tp.size == 1:
        return rows(input_ids)
    local = input_ids - part.start
    outside = (local < 0) | (local >= part.size)
    found = rows(local.masked_fill(outside, 0))
    return tp.all_reduce(found.masked_fill_(outside[:, None], 0))


class VocabParallelEmbedding(nn.Module):
    """The rank's rows (`part` of the vocabulary) of the embedding table: a float parameter, or, where the
    loader hands it a still-quantized table (a GGUF file's blocks, which it does only where the model keeps
    the file's blocks), that table as it is, each looked-up row dequantized (as llama.cpp's and vLLM's GGUF
    embeddings do). A tied model has no such table: its LM head serves the lookups (LMHead.embed)."""

    def __init__(self, part: Part, hidden_size: int, tp: TensorParallel):
        super().__init__()
        self.part = part
        self.weight = nn.Parameter(torch.empty(part.size, hidden_size))
        self.tp = tp
        self.qtype = None  # a kept quantized table's GGUF type (its blocks then replace weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(input_ids, self.part, self.tp, self._rows)

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qtype is None:
            return F.embedding(ids, self.weight)
        if self.qtype in KEPT_TYPES and native.unavailable_reason() is None:  # the C++ kernel's row reader
            layout = torch.tensor([[self.blocks.shape[0], int(self.qtype)]])
            flat = self.blocks.view(-1)
            return native.dequantize_rows(flat, layout, None, 0, ids, self.dtype, cols=self.hidden)
        return GGUFBlocks(self.blocks[ids].numpy(), self.qtype).dequantize().to(self.dtype)

    def keep_quantized(self, table: GGUFBlocks) -> None:
        """Keep a GGUF table's blocks instead of the float weight, read into memory once (a lookup then
        never waits for the disk)."""
        self.dtype = self.weight.dtype
        del self.weight
        self.register_buffer("blocks", torch.from_numpy(np.array(table.raw)), persistent=False)
        self.qtype, self.hidden = table.qtype, table.shape[1]

    def checkpoint_part(self, pname: str, shard: str | None) -> Part:
        return self.part


class LMHead(ColumnParallelLinear):
    """Final hidden states -> the rank's `part` of the vocabulary logits. A tied head's weight, stored
    however its LinearMethod stores it, is the token embedding table too (`embed`). Quantizing methods may
    store it wider than the decoder layers (int4 keeps it int8: SmolLM2's perplexity on the quality text
    was +6.9% over float32 with a 4-bit head and tied embedding, +0.3% with an 8-bit one)."""

    def __init__(self, hidden_size: int, part: Part, tp: TensorParallel, serves_embedding: bool):
        super().__init__(hidden_size, {"lm_head": part})
        self.part, self.tp = part, tp
        self.serves_embedding = serves_embedding

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_lookup(
            input_ids, self.part, self.tp, lambda ids: self.method.embedding(self, ids)
        )
