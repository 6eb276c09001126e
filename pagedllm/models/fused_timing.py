"""What the one-call decoder layer is worth: one sequence's greedy decode steps through a loaded model, its
layers in one call each (where the backend offers it, DecoderLayer.fuse) and its layers' ops one by one,
in alternating rounds in one process. `pagedllm bench kernel --decoder-layer` prints it.

A step is the model's forward of one token and its LM head and argmax, as an engine's decode step of one
request, without the engine. Both ways must decode the same tokens (they are equal to the bit).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from pagedllm import ops
from pagedllm.models.attention import AttentionMetadata
from pagedllm.models.layers import CausalLM

BLOCK_SIZE = 16


@dataclass
class FusedTiming:
    """Median ms of one decode step in each round, the layers in one call and one by one."""

    fused_ms: list[float]
    by_ops_ms: list[float]
    fused_layers: int  # of `layers`: the others run their ops one by one either way
    layers: int
    backend: str
    context: int
    steps: int

    @property
    def speedup(self) -> float:
        """How many times as fast a step is with the layers in one call (medians over the rounds)."""
        return statistics.median(self.by_ops_ms) / statistics.median(self.fused_ms)


class _OneSequence:
    """One sequence's K/V in blocks 0, 1, ... of fresh caches, and the metadata of its steps."""

    def __init__(self, model: CausalLM, dtype: torch.dtype, tokens: int):
        config, device = model.config, model.layers[0].input_layernorm.weight.device
        num_blocks = -(-tokens // BLOCK_SIZE)
        self.kv_caches = ops.allocate_kv_caches(
            config.num_layers, num_blocks, BLOCK_SIZE, model.num_kv_heads, config.head_dim, dtype, device
        )
        self.block_tables = torch.arange(num_blocks, dtype=torch.int32, device=device)[None, None]
        self.device = device

    def meta(self, start: int, end: int) -> AttentionMetadata:
        """Positions start..end-1 of the sequence, its earlier tokens in the cache."""
        slots = torch.arange(start, end, dtype=torch.int64, device=self.device)
        return AttentionMetadata(
            slot_mapping=slots[None],
            block_tables=self.block_tables,
            context_lens=torch.tensor([end], dtype=torch.int32, device=self.device),
            query_start_loc=torch.tensor([0, end - start], dtype=torch.int32, device=self.device),
            max_query_len=end - start,
            kv_caches=self.kv_caches,
        )

    def forward(self, model: CausalLM, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """The greedy next token after `tokens` at positions start.., [1] int64."""
        end = start + tokens.shape[0]
        positions = torch.arange(start, end, dtype=torch.int64, device=self.device)
        hidden = model(tokens, positions, self.meta(start, end))
        return ops.argmax(model.compute_logits(hidden[-1:]))


@torch.inference_mode()
def time_fused_decode(
    model: CausalLM, context: int = 200, steps: int = 128, rounds: int = 4, seed: int = 0
) -> FusedTiming:
    """Decode `steps` tokens after a `context`-token random prompt, `rounds` times each way, alternating
    (the same steps each round, rewriting the same cache slots); raises if the two ways' tokens differ or
    if no layer runs as one call here."""
    layers = list(model.layers)
    fused = [layer.fused for layer in layers]
    if not any(fused):
        raise RuntimeError("no layer of this model runs as one call here (backend, weights' storage, ranks)")
    norm_weight = layers[0].input_layernorm.weight
    sequence = _OneSequence(model, norm_weight.dtype, context + steps)
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(model.config.vocab_size, (context,), generator=gen).to(sequence.device)
    first = sequence.forward(model, prompt, 0)

    def one_round() -> tuple[float, list[int]]:
        token, tokens, times = first, [], []
        for step in range(steps):
            begin = time.perf_counter()
            token = sequence.forward(model, token, context + step)
            times.append(time.perf_counter() - begin)
            tokens.append(int(token))
        return statistics.median(times) * 1e3, tokens

    timings: dict[bool, list[float]] = {True: [], False: []}
    decoded: dict[bool, list[int]] = {}
    try:
        for _ in range(rounds):
            for one_call in (True, False):
                for layer, kept in zip(layers, fused, strict=True):
                    layer.fused = kept if one_call else None
                ms, decoded[one_call] = one_round()
                timings[one_call].append(ms)
    finally:
        for layer, kept in zip(layers, fused, strict=True):
            layer.fused = kept
    if decoded[True] != decoded[False]:
        raise RuntimeError(f"the one-call layers decoded {decoded[True]}, their ops {decoded[False]}")
    return FusedTiming(
        fused_ms=timings[True],
        by_ops_ms=timings[False],
        fused_layers=sum(f is not None for f in fused),
        layers=len(layers),
        backend=ops.get_backend_name(norm_weight.device, norm_weight.dtype),
        context=context,
        steps=steps,
    )
