"""A minimal paged runner for model tests: block tables by hand, one forward per step, greedy decoding.

Deliberately independent of pagedllm.engine: it drives the model interface directly
(model(input_ids, positions, meta) -> hidden, model.compute_logits(hidden) -> logits). Also a writer of
tiny models as GGUF files the way llama.cpp names them.
"""

from __future__ import annotations

import math
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


def assert_qwen2_config_matches_hf(cfg, hf_cfg, shape: tuple[int, ...], head_dim: int) -> None:
    """A Qwen2.5 file's config as pagedllm reads it: the expected (layers, hidden, heads, KV heads, FFN)
    and head size, the same as transformers' load of the file, q/k/v biases, untied output, RoPE 1e6."""
    got = (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size)
    assert got == shape and cfg.head_dim == head_dim
    assert got == (
        hf_cfg.num_hidden_layers,
        hf_cfg.hidden_size,
        hf_cfg.num_attention_heads,
        hf_cfg.num_key_value_heads,
        hf_cfg.intermediate_size,
    )
    assert cfg.qkv_bias and not cfg.tie_word_embeddings and not hf_cfg.tie_word_embeddings
    assert cfg.rope_theta == hf_cfg.rope_parameters["rope_theta"] == 1e6


def hf_logits(hf_model, prompt: list[int], tail: int = 0) -> torch.Tensor:
    """Float32 logits of one prompt from a plain Hugging Face forward: every position, or the last `tail`."""
    with torch.inference_mode():
        return hf_model(torch.tensor([prompt]), logits_to_keep=tail).logits[0].float()


def _permute_like_llama_cpp(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Q/K rows (the forward direction)."""
    return w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    hf_model, path, arch: str = "llama", qtype=None, names_of: str | None = None, blocks=None
) -> None:
    """A GGUF of a tiny model, as llama.cpp's converter writes one (no tokenizer): tensor names from
    gguf-py's own map of Hugging Face names (TensorNameMap), Q/K rows permuted for `arch` "llama" (the
    NeoX-style RoPE of the others keeps them), Gemma's norms stored as (1 + w), each layer's experts
    stacked into one [experts, rows, columns] tensor per projection, matrices in ggml type `qtype`
    (default float32), norms and biases float32. `names_of`: another architecture's names (default arch's).
    `blocks`: a function of a matrix giving the [rows, bytes] blocks of `qtype` written in its place (default
    gguf-py's quantize of it; gguf-py quantizes no K type)."""
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
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    if getattr(cfg, "sliding_window", None):
        writer.add_sliding_window(cfg.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        writer.add_final_logit_softcapping(cfg.final_logit_softcapping)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "num_local_experts", None)
    if experts:
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        writer.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", cfg.intermediate_size))
    _write_rope_factors(writer, cfg, head_dim)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[(names_of or arch).upper()], cfg.num_hidden_layers)
    for name, tensor in _llama_cpp_tensors(hf_model):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # a tied model has no output tensor: llama.cpp reuses token_embd
        w = tensor.numpy()
        if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            w = _permute_like_llama_cpp(w, cfg.num_attention_heads)
        elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
            w = _permute_like_llama_cpp(w, cfg.num_key_value_heads)
        elif arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1.0
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"llama.cpp's {arch} has no tensor for {name}"
        w = np.ascontiguousarray(w)
        if qtype is not None and w.ndim >= 2:
            raw = gguf.quants.quantize(w, qtype) if blocks is None else blocks(w)
            writer.add_tensor(gguf_name, raw, raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_rope_factors(writer, cfg, head_dim: int) -> None:
    """RoPE scaling as llama.cpp's converter writes it: Llama 3's as a rope_freqs tensor of the factor
    each pair's frequency is divided by (computed pair by pair, as convert_hf_to_gguf.py does), Phi-3's
    longrope as its two factor tensors with the original context and the attention factor as keys."""
    rope = cfg.rope_parameters
    if rope["rope_type"] == "llama3":
        factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
        old_context = rope["original_max_position_embeddings"]
        factors = []
        for i in range(0, head_dim, 2):
            wavelen = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
            if wavelen < old_context / high:
                factors.append(1.0)
            elif wavelen > old_context / low:
                factors.append(factor)
            else:
                smooth = (old_context / wavelen - low) / (high - low)
                factors.append(1 / ((1 - smooth) / factor + smooth))
        writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    elif rope["rope_type"] == "longrope":
        original = rope["original_max_position_embeddings"]
        scale = cfg.max_position_embeddings / original
        writer.add_rope_scaling_orig_ctx_len(original)
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))


def _llama_cpp_tensors(hf_model):
    """The model's tensors under the Hugging Face names llama.cpp's converter maps: transformers' fused
    expert tensors (gate_up_proj [experts, 2 I, hidden]) split into the gate_proj and up_proj stacks."""
    for name, tensor in hf_model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            yield name.replace("gate_up_proj", "gate_proj.weight"), gate
            yield name.replace("gate_up_proj", "up_proj.weight"), up
        elif name.endswith("mlp.experts.down_proj"):
            yield name + ".weight", tensor
        else:
            yield name, tensor


# Byte offsets of each GGUF block type's float16 fields (d, m / dmin), which random bytes must not make NaN.
_HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2]}
_HALF_FIELDS |= {"Q5_K": [0, 2], "Q6_K": [208]}
GGUF_TYPES = list(_HALF_FIELDS)


def random_blocks(qtype, rows: int, cols: int, seed: int = 0, scale: float = 0.05):
    """Random GGUF blocks of `qtype` (every bit pattern of the codes and small scales is a valid block), the
    float16 scales uniform in [-scale, scale]."""
    from gguf import GGML_QUANT_SIZES

    from pagedllm.models.gguf_quants import GGUFBlocks

    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for offset in _HALF_FIELDS[qtype.name]:
        halves = rng.uniform(-scale, scale, raw.shape[0]).astype(np.float16)
        raw[:, offset : offset + 2] = halves.view(np.uint8).reshape(-1, 2)
    return GGUFBlocks(raw.reshape(rows, -1), qtype)
