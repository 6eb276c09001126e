"""A minimal paged runner for model tests: block tables by hand, one forward per step, greedy decoding.

Deliberately independent of pagedllm.engine: it drives the model interface directly
(model(input_ids, positions, meta) -> hidden, model.compute_logits(hidden) -> logits). Also a writer of
tiny models as GGUF files the way llama.cpp names them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np
import torch

from pagedllm.models.attention import AttentionMetadata

# A tiny Llama-shaped config (transformers keyword arguments) for loader tests.
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


@dataclass
class PagedCache:
    """Per-layer K/V block pools and a free list handed out in shuffled order."""

    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    block_size: int
    free: list[int]
    num_blocks: int = 0
    tables: dict[int, list[int]] = field(default_factory=dict)  # seq id -> block ids

    @classmethod
    def create(
        cls, config, num_blocks: int, block_size: int, dtype=torch.float32, seed: int = 0, num_kv_heads=None
    ):
        """num_kv_heads: the KV heads the model's cache holds (a tensor-parallel rank's share)."""
        shape = (num_blocks, block_size, num_kv_heads or config.num_kv_heads, config.head_dim)
        # NaN-filled: a read of a slot nobody wrote poisons the output instead of passing silently.
        caches = [
            (torch.full(shape, float("nan"), dtype=dtype), torch.full(shape, float("nan"), dtype=dtype))
            for _ in range(config.num_layers)
        ]
        free = list(range(num_blocks))
        random.Random(seed).shuffle(free)
        return cls(caches, block_size, free, num_blocks)

    def slots(self, seq: int, start: int, end: int) -> list[int]:
        """Cache slots for positions start..end-1 of a sequence, allocating blocks as needed."""
        table = self.tables.setdefault(seq, [])
        while len(table) * self.block_size < end:
            table.append(self.free.pop())
        size = self.block_size
        return [table[p // size] * size + p % size for p in range(start, end)]

    def release(self, seq: int) -> None:
        self.free.extend(self.tables.pop(seq))


def forward_chunks(
    model, cache: PagedCache, chunks: list[tuple[int, list[int], int]], tail: int | None = None
) -> torch.Tensor:
    """One forward over several sequences' chunks; chunk = (seq id, token ids, position of first token).

    Returns float32 logits for every token of the flattened batch, [sum of chunk lengths, vocab], or
    only for the last `tail` tokens of each chunk.
    """
    input_ids, positions, slot_mapping, context_lens, starts = [], [], [], [], [0]
    for seq, tokens, start in chunks:
        end = start + len(tokens)
        input_ids += tokens
        positions += range(start, end)
        slot_mapping += cache.slots(seq, start, end)
        context_lens.append(end)
        starts.append(starts[-1] + len(tokens))
    tables = [cache.tables[seq] for seq, _, _ in chunks]
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([slot_mapping], dtype=torch.int64),  # one KV group
        block_tables=torch.tensor([[t + [0] * (width - len(t)) for t in tables]], dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        max_query_len=max(len(tokens) for _, tokens, _ in chunks),
        kv_caches=cache.kv_caches,
    )
    with torch.inference_mode():
        hidden = model(torch.tensor(input_ids), torch.tensor(positions), meta)
        if tail is not None:
            hidden = torch.cat(
                [hidden[max(lo, hi - tail) : hi] for lo, hi in zip(starts, starts[1:], strict=False)]
            )
        return model.compute_logits(hidden)


def greedy_generate(
    model, prompts: list[list[int]], max_new_tokens: int, block_size: int = 16, seed: int = 0
) -> list[list[int]]:
    """Prefill all prompts in one forward, then decode one token per sequence per forward (no EOS stop)."""
    total = sum(len(p) + max_new_tokens for p in prompts)
    cache = PagedCache.create(model.config, total // block_size + 2 * len(prompts), block_size, seed=seed)
    logits = forward_chunks(model, cache, [(i, p, 0) for i, p in enumerate(prompts)])
    last_rows = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    outputs = [[t] for t in logits[last_rows].argmax(-1).tolist()]
    for _ in range(max_new_tokens - 1):
        chunks = [
            (i, [out[-1]], len(p) + len(out) - 1)
            for i, (p, out) in enumerate(zip(prompts, outputs, strict=True))
        ]
        next_tokens = forward_chunks(model, cache, chunks).argmax(-1).tolist()
        for out, token in zip(outputs, next_tokens, strict=True):
            out.append(token)
    for i in range(len(prompts)):
        cache.release(i)
    assert sorted(cache.free) == list(range(cache.num_blocks)), "KV blocks leaked"
    return outputs


def hf_greedy(hf_model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """The oracle: one batched Hugging Face generate, left-padded, greedy, EOS disabled."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = hf_model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[:, width:].tolist()


def hf_logits(hf_model, prompt: list[int], tail: int = 0) -> torch.Tensor:
    """Float32 logits of one prompt from a plain Hugging Face forward: every position, or the last `tail`."""
    with torch.inference_mode():
        return hf_model(torch.tensor([prompt]), logits_to_keep=tail).logits[0].float()


def _permute_like_llama_cpp(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (the forward direction)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(hf_model, path, arch: str = "llama", qtype=None) -> None:
    """A GGUF of a tiny Llama-family model, named the way llama.cpp writes one (no tokenizer): Q/K rows
    permuted for `arch` "llama" (Qwen2's NeoX-style RoPE keeps them), matrices in ggml type `qtype`
    (default float32), norms and biases float32."""
    import gguf

    cfg = hf_model.config
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_rope_dimension_count(
        getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    )
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    names |= {f"self_attn.{p}_proj": f"attn_{p}" for p in "qkv"} | {"self_attn.o_proj": "attn_output"}
    names |= {f"mlp.{p}_proj": f"ffn_{p}" for p in ("gate", "up", "down")}
    for name, tensor in hf_model.state_dict().items():
        w = tensor.numpy()
        if name.startswith("model.layers."):
            layer, rest = name[len("model.layers.") :].split(".", 1)
            module, kind = rest.rsplit(".", 1)
            if arch == "llama" and module == "self_attn.q_proj":
                w = _permute_like_llama_cpp(w, cfg.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                w = _permute_like_llama_cpp(w, cfg.num_key_value_heads)
            gguf_name = f"blk.{layer}.{names[module]}.{kind}"
        else:
            gguf_name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
            }
            gguf_name = gguf_name.get(name, "output.weight")
        w = np.ascontiguousarray(w)
        if qtype is not None and w.ndim == 2:
            writer.add_tensor(gguf_name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
