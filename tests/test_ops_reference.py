"""The torch reference against an independent oracle (dense SDPA on contiguous K/V), and the block ops."""

import math

import pytest
import torch
from oracles import dense_batch_attention

from pagedllm.ops import copy_blocks, reference, swap_blocks
from pagedllm.ops.synthetic import random_paged_batch


@pytest.mark.parametrize(
    ("heads", "kv_heads", "block_size", "context_lens", "query_lens", "window"),
    [
        (6, 2, 4, [1, 9, 30], [1, 1, 1], None),
        (4, 1, 8, [33, 17], [33, 4], None),
        (6, 3, 1, [20, 12], [7, 12], 5),
        (8, 2, 16, [50, 3, 21], [1, 3, 10], 16),
    ],
)
def test_reference_matches_dense_attention(heads, kv_heads, block_size, context_lens, query_lens, window):
    head_dim = 16
    b = random_paged_batch(context_lens, query_lens, heads, kv_heads, head_dim, block_size, seed=3)
    scale = 1 / math.sqrt(head_dim)
    out = reference.paged_attention(b.q, b.args(scale, window))
    expected = dense_batch_attention(b, scale, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if all(n == 1 for n in query_lens):
        decode = reference.paged_attention(b.q, b.args(scale, window, decode=True))
        torch.testing.assert_close(decode, expected, atol=1e-5, rtol=1e-5)


def test_write_kv_skips_padding_slots():
    k_cache, v_cache = torch.zeros(3, 2, 1, 4), torch.zeros(3, 2, 1, 4)
    key = torch.arange(12.0).view(3, 1, 4)
    reference.write_kv(key, -key, k_cache, v_cache, torch.tensor([5, -1, 0]))
    flat_k, flat_v = k_cache.view(6, 4), v_cache.view(6, 4)
    assert torch.equal(flat_k[5], key[0, 0]) and torch.equal(flat_k[0], key[2, 0])
    assert torch.equal(flat_v[5], -key[0, 0])
    assert flat_k[1:5].abs().sum() == 0  # token 1 (slot -1) went nowhere


def test_copy_blocks_copies_whole_blocks_and_nothing_else():
    k_cache = torch.randn(5, 4, 2, 8)
    v_cache = torch.randn(5, 4, 2, 8)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    copy_blocks(k_cache, v_cache, [(0, 3), (2, 4)])
    assert torch.equal(k_cache[3], before_k[0]) and torch.equal(v_cache[4], before_v[2])
    assert torch.equal(k_cache[:3], before_k[:3]) and torch.equal(v_cache[:3], before_v[:3])
    copy_blocks(k_cache, v_cache, [])
    assert torch.equal(k_cache[3], before_k[0])


def test_swap_out_and_back_in_round_trips():
    device_k, device_v = torch.randn(4, 2, 1, 8), torch.randn(4, 2, 1, 8)
    host_k, host_v = torch.zeros(6, 2, 1, 8), torch.zeros(6, 2, 1, 8)
    original_k, original_v = device_k.clone(), device_v.clone()
    swap_blocks(device_k, device_v, host_k, host_v, [(1, 5), (3, 0)])
    assert torch.equal(host_k[5], original_k[1]) and torch.equal(host_v[0], original_v[3])
    device_k.zero_()
    device_v.zero_()
    swap_blocks(host_k, host_v, device_k, device_v, [(5, 2), (0, 1)])
    assert torch.equal(device_k[2], original_k[1]) and torch.equal(device_v[1], original_v[3])
    assert device_k[0].abs().sum() == 0 and device_k[3].abs().sum() == 0
