"""Every attention backend against the torch reference on random paged inputs.

Runs the sdpa backend and the cpu backend built for every instruction set this CPU runs; under
TRITON_INTERPRET=1 (test_ops_triton.py starts that run in a subprocess) it runs the triton backend
instead, on the same cases.
"""

import math
import os
from dataclasses import dataclass

import pytest
import torch
from oracles import dense_batch_attention

from pagedllm import ops
from pagedllm.ops import AttentionArgs, native, reference
from pagedllm.ops.kv_cache import allocate_kv_caches, is_quantized, key_smoothing, kv_blocks, kv_scales
from pagedllm.ops.synthetic import random_paged_batch

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CPU_BUILDS = [f"cpu-{isa}" for isa in native.supported_isas()]  # each instruction set this machine runs
BACKEND_NAMES = ["triton"] if INTERPRETED else ["sdpa", *CPU_BUILDS]


@dataclass(frozen=True)
class Case:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    context_lens: tuple[int, ...]
    query_lens: tuple[int, ...] | None = None  # None: decode, one query per sequence
    window: int | None = None
    dtype: torch.dtype = torch.float32
    head_major: bool = False  # cache memory order as pagedllm allocates it on the CPU
    kv_dtype: torch.dtype | None = None  # the caches' dtype when it is not q's (kv_cache_dtype)
    softcap: float | None = None  # Gemma 2's soft-capped scores (small enough to bend these random ones)


INT8, FP8 = torch.int8, torch.float8_e4m3fn  # the quantized caches: codes, a scale per token and kv head


DECODE = {
    "gqa1-partial-blocks": Case(4, 4, 16, 4, (1, 7, 33)),
    "gqa3-shuffled": Case(6, 2, 32, 8, (9, 40, 17, 64)),
    "gqa4": Case(8, 2, 16, 16, (15, 16, 17, 50)),
    "mqa-d64": Case(4, 1, 64, 4, (70, 3)),
    "window": Case(6, 2, 16, 4, (5, 30, 61), window=8),
    "block-size-1": Case(6, 2, 16, 1, (1, 13, 40)),
    "bf16-gqa3": Case(6, 2, 32, 8, (9, 40, 17, 64), dtype=torch.bfloat16),
    "bf16-mqa-window": Case(4, 1, 64, 4, (70, 3, 22), window=16, dtype=torch.bfloat16),
    "head-major-gqa3": Case(6, 2, 32, 8, (9, 40, 17, 64), head_major=True),
    # Qwen2.5-Coder-1.5B's heads (12 x 128, 2 kv heads): the cpu kernel scores four keys at a time, the
    # query rows in pairs with AVX2; key counts that leave one to three keys after the fours
    "gqa6-d128": Case(12, 2, 128, 16, (9, 42, 17, 203), head_major=True),
    "gqa6-d128-bf16-cache": Case(12, 2, 128, 16, (9, 42, 17, 203), kv_dtype=torch.bfloat16, head_major=True),
    "gqa4-d256": Case(4, 1, 256, 16, (9, 42, 203)),  # Gemma 3's heads: 16 vectors with AVX-512, 32 with AVX2
    "fp32-q-bf16-cache": Case(6, 2, 64, 16, (9, 40, 17, 64), kv_dtype=torch.bfloat16, head_major=True),
    # float16 K/V (llama.cpp's default cache) under float32 queries, widened in registers as bf16 is
    "fp32-q-fp16-cache": Case(6, 2, 64, 16, (9, 40, 17, 64), kv_dtype=torch.float16, head_major=True),
    "gqa6-d128-fp16-cache-window": Case(12, 2, 128, 16, (9, 42, 203), window=32, kv_dtype=torch.float16),
    "head-major-bf16-window": Case(
        4, 2, 64, 16, (70, 3, 33), window=16, dtype=torch.bfloat16, head_major=True
    ),
    # a row with much more than its share of the keys: the cpu kernel splits its keys into parts and
    # combines them (with 2+ threads, as on the test machines)
    "one-long-row": Case(9, 3, 64, 16, (3000,), head_major=True),
    "one-long-row-window": Case(4, 1, 64, 16, (2500,), window=1100),
    "one-long-row-bf16": Case(6, 2, 64, 16, (2100,), dtype=torch.bfloat16, head_major=True),
    "one-long-row-fp16-cache": Case(6, 2, 64, 16, (2100,), kv_dtype=torch.float16, head_major=True),
    "short-row-then-split-row": Case(4, 1, 64, 16, (100, 2000)),  # only the second row is split
    "long-row-among-short": Case(12, 4, 64, 16, (40, 90, 25, 60, 70, 1800), head_major=True),
    # quantized caches, read in place: the same blocks the reference dequantizes
    "int8-gqa3-d64": Case(6, 2, 64, 16, (9, 40, 17, 64), kv_dtype=INT8, head_major=True),
    "int8-slot-major-window": Case(6, 2, 16, 4, (5, 30, 61), window=8, kv_dtype=INT8),
    "int8-block-size-1": Case(6, 2, 16, 1, (1, 13, 40), kv_dtype=INT8),
    "int8-d72": Case(14, 2, 72, 16, (41, 18, 70), kv_dtype=INT8, head_major=True),
    "int8-one-long-row": Case(9, 3, 64, 16, (3000,), kv_dtype=INT8, head_major=True),
    "fp8-gqa3-d64": Case(9, 3, 64, 16, (9, 40, 17, 64), kv_dtype=FP8, head_major=True),
    "fp8-mqa-d72-window": Case(4, 1, 72, 8, (70, 3, 22), window=16, kv_dtype=FP8),
    "bf16-q-int8-cache": Case(6, 2, 32, 8, (9, 40, 17, 64), dtype=torch.bfloat16, kv_dtype=INT8),
    "bf16-q-fp8-cache-split": Case(
        6, 2, 64, 16, (2100,), dtype=torch.bfloat16, kv_dtype=FP8, head_major=True
    ),
    "softcap-gqa3": Case(6, 2, 32, 8, (9, 40, 17, 64), softcap=0.5),
    "softcap-bf16-window": Case(4, 1, 64, 4, (70, 3, 22), window=16, dtype=torch.bfloat16, softcap=0.5),
    "softcap-int8": Case(6, 2, 64, 16, (9, 40, 17, 64), kv_dtype=INT8, head_major=True, softcap=0.5),
    "softcap-one-long-row": Case(9, 3, 64, 16, (3000,), head_major=True, softcap=0.5),
}
PREFILL = {
    "prompt": Case(6, 2, 16, 8, (20, 5), (20, 5)),
    "cached-prefix-and-chunk": Case(6, 2, 32, 4, (37, 50), (12, 9)),
    "mixed-decode-and-chunks": Case(9, 3, 16, 8, (30, 40, 9, 4, 21), (1, 19, 1, 4, 0)),
    "window": Case(4, 2, 16, 4, (40, 10, 33), (20, 3, 1), window=8),
    "block-size-1": Case(6, 2, 16, 1, (17, 30), (17, 6)),
    "mqa": Case(4, 1, 32, 8, (26, 18), (26, 5)),
    "bf16-mixed": Case(6, 2, 32, 8, (30, 40, 9), (1, 19, 9), dtype=torch.bfloat16),
    "bf16-window": Case(8, 2, 16, 4, (40, 24), (17, 24), window=8, dtype=torch.bfloat16),
    "head-major-mixed": Case(9, 3, 16, 8, (30, 40, 9, 4, 21), (1, 19, 1, 4, 0), head_major=True),
    "fp32-q-bf16-cache": Case(6, 2, 32, 8, (30, 40, 9), (1, 19, 9), kv_dtype=torch.bfloat16),
    "fp32-q-fp16-cache": Case(6, 2, 32, 8, (30, 40, 9), (1, 19, 9), kv_dtype=torch.float16),
    # the cpu kernel's prefill tiles (16 query rows x the GQA group, scores kept transposed): whole and
    # partial tiles and blocks, groups whose rows fill no whole vector, head sizes with a partial vector
    "tiles-gqa3-d64": Case(9, 3, 64, 16, (70, 37, 300), (70, 21, 300), head_major=True),
    "tiles-gqa4-chunk": Case(8, 2, 64, 16, (100, 45), (33, 45)),
    "tiles-gqa7-d72": Case(14, 2, 72, 16, (41, 18), (41, 18), head_major=True),
    "tiles-d256-window": Case(4, 1, 256, 16, (90, 60), (50, 60), window=24),
    "tiles-bf16-d64": Case(9, 3, 64, 16, (70, 130), (70, 100), dtype=torch.bfloat16, head_major=True),
    "tiles-fp32-q-bf16-cache": Case(
        9, 3, 64, 16, (70, 37), (70, 20), kv_dtype=torch.bfloat16, head_major=True
    ),
    "tiles-fp32-q-fp16-cache": Case(
        9, 3, 64, 16, (70, 37, 300), (70, 20, 300), kv_dtype=torch.float16, head_major=True
    ),
    "int8-tiles-gqa3-d64": Case(9, 3, 64, 16, (70, 37, 300), (70, 21, 300), kv_dtype=INT8, head_major=True),
    "int8-mixed-window": Case(4, 2, 16, 4, (40, 10, 33), (20, 3, 1), window=8, kv_dtype=INT8),
    "int8-block-size-1": Case(6, 2, 16, 1, (17, 30), (17, 6), kv_dtype=INT8),
    "fp8-tiles-gqa7-d72": Case(14, 2, 72, 16, (41, 18), (41, 18), kv_dtype=FP8, head_major=True),
    "fp8-mixed": Case(9, 3, 16, 8, (30, 40, 9, 4, 21), (1, 19, 1, 4, 0), kv_dtype=FP8),
    "bf16-q-int8-cache-tiles": Case(
        9, 3, 64, 16, (70, 130), (70, 100), dtype=torch.bfloat16, kv_dtype=INT8, head_major=True
    ),
    "bf16-q-fp8-cache-window": Case(
        8, 2, 16, 4, (40, 24), (17, 24), window=8, dtype=torch.bfloat16, kv_dtype=FP8
    ),
    "softcap-tiles-gqa3-d64": Case(9, 3, 64, 16, (70, 37, 300), (70, 21, 300), head_major=True, softcap=0.5),
    "softcap-bf16-window": Case(8, 2, 16, 4, (40, 24), (17, 24), window=8, dtype=torch.bfloat16, softcap=0.5),
    "softcap-fp8-mixed": Case(9, 3, 16, 8, (30, 40, 9, 4, 21), (1, 19, 1, 4, 0), kv_dtype=FP8, softcap=0.5),
}


def _tolerance(dtype: torch.dtype) -> dict:
    return {"atol": 1e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}


def _batch(case: Case):
    query_lens = case.query_lens or (1,) * len(case.context_lens)
    quantized = case.kv_dtype is not None and is_quantized(case.kv_dtype)
    batch = random_paged_batch(
        list(case.context_lens), list(query_lens), case.num_heads, case.num_kv_heads, case.head_dim,
        case.block_size, case.dtype, seed=len(case.context_lens) + sum(case.context_lens),
        head_major=case.head_major, kv_dtype=case.kv_dtype if quantized else None,
    )  # fmt: skip
    if case.kv_dtype is not None and not quantized:  # the same strides, another dtype
        batch.k_cache, batch.v_cache = (
            torch.empty_like(c, dtype=case.kv_dtype).copy_(c) for c in (batch.k_cache, batch.v_cache)
        )
    return batch


class _CountedLaunches:
    """Wraps a Triton kernel: kernel[grid](...) launches are recorded, then run as usual."""

    def __init__(self, kernel, launches: list):
        self.kernel, self.launches = kernel, launches

    def __getitem__(self, grid):
        self.launches.append(grid)
        return self.kernel[grid]


@pytest.fixture(params=BACKEND_NAMES)
def backend(request, monkeypatch):
    name, _, isa = request.param.partition("-")
    if isa:  # the cpu backend, on the build for this instruction set
        monkeypatch.setattr(native, "selected_isa", lambda: isa)
    chosen = ops.backend(name)
    if request.param != "triton":
        yield chosen
        return
    from pagedllm.ops import triton_ops

    launches: list = []
    for kernel in ("_paged_attention_kernel", "_write_kv_kernel"):
        monkeypatch.setattr(triton_ops, kernel, _CountedLaunches(getattr(triton_ops, kernel), launches))
    yield chosen
    assert launches, "the test passed without launching a Triton kernel"


def _int8_query_codes(backend, k_cache: torch.Tensor) -> bool:
    """Whether the backend's decode meets this cache's key codes with int16 query codes and sums its
    values under int16 weight codes (the cpu kernels on an int8 cache): it then equals the reference on
    reference.int8_decode_query's query up to WEIGHT_ROUNDING."""
    return backend.name == "cpu" and k_cache.dtype == INT8


# The cpu kernels' decode over an int8 cache rounds each tile's weights (up to 16 keys of a block, each
# softmax weight times its value's scale) to int16 codes on the tile's largest weight w: each moves by at
# most w / (2 * 32767), so a tile's share of the output by at most 16 w / (2 * 32767) times the largest
# |value|, and 16 w is at most 16 times the tile's share of the softmax sum: the output moves by at most
# WEIGHT_ROUNDING times the largest |value|.
WEIGHT_ROUNDING = 16 / (2 * 32767)


def _largest_value(v_cache: torch.Tensor) -> float:
    """The largest |value| an int8 cache holds (its spare blocks' NaN scales left out)."""
    return float(torch.nan_to_num(kv_scales(v_cache)).amax()) * 127


def _tolerance_of(backend, case: Case, b) -> dict:
    """_tolerance, plus for the cpu kernels' int8 decode its weight rounding's bound."""
    tolerance = _tolerance(case.dtype)
    if _int8_query_codes(backend, b.k_cache):
        tolerance["atol"] += WEIGHT_ROUNDING * _largest_value(b.v_cache)
    return tolerance


def _attended_query(backend, b, scale: float) -> torch.Tensor:
    """The query the backend attends with: b.q, but for the cpu kernels over an int8 cache each decode
    row's (a sequence's only query row, in any batch) is reference.int8_decode_query's."""
    if not _int8_query_codes(backend, b.k_cache):
        return b.q
    q = b.q.float().clone()
    starts = b.query_start_loc.tolist()
    rows = [lo for lo, hi in zip(starts, starts[1:], strict=False) if hi - lo == 1]
    q[rows] = reference.int8_decode_query(b.q[rows], b.k_cache, scale)
    return q


@pytest.mark.parametrize("case", DECODE.values(), ids=DECODE.keys())
def test_decode_matches_reference(backend, case):
    b = _batch(case)
    scale = 1 / math.sqrt(case.head_dim)
    args = b.args(scale, case.window, case.softcap, decode=True)
    out = backend.paged_attention(b.q, args)
    expected = reference.paged_attention(_attended_query(backend, b, scale), args).to(case.dtype)
    assert out.dtype == case.dtype and out.shape == b.q.shape
    torch.testing.assert_close(out, expected, **_tolerance_of(backend, case, b))


INT8_DECODE = {name: case for name, case in DECODE.items() if case.kv_dtype == INT8}


# Triton reads the query as it is: the test exists outside the interpreter run only (that run allows no
# skips, and its fixture fails a test that launches none of its kernels)
if not INTERPRETED:

    @pytest.mark.parametrize("case", INT8_DECODE.values(), ids=INT8_DECODE.keys())
    def test_int8_query_codes_move_the_output_within_their_bound(backend, case):
        """The cpu kernels' int8 decode rounds each query head (q * scale * key factor, the vector that meets
        the smoothed key codes times their scales, k_t) to int16 codes of scale s = max |q| /
        reference.DECODE_QUERY_LARGEST: each element moves by at most s / 2, so each score by at most
        delta = s / 2 * max_t |k_t|_1, each softmax weight by a factor within exp(+-2 delta), and the output
        by at most (exp(2 delta) - 1) max_t |v_t| per head against attention on the float query; the
        weights' own rounding adds at most WEIGHT_ROUNDING times the largest |value|. The bound holds, and
        the codes do move the output."""
        if not _int8_query_codes(backend, torch.empty(0, dtype=INT8)):
            pytest.skip("only the cpu kernels quantize the query")
        b = _batch(case)
        scale = 1 / math.sqrt(case.head_dim)
        args = b.args(scale, case.window, decode=True)
        out = backend.paged_attention(b.q, args).float()
        exact = reference.paged_attention(b.q.float(), args)
        group = case.num_heads // case.num_kv_heads
        factor = key_smoothing(b.k_cache)[1].repeat_interleave(group, dim=0)
        q_scale = (b.q.float() * scale * factor).abs().amax(dim=-1) / reference.DECODE_QUERY_LARGEST  # [S, H]
        block_size = case.block_size
        for s, n in enumerate(b.context_lens.tolist()):
            ids = b.block_tables[s, : -(-n // block_size)].long()
            k, v = (
                reference.dequantize(c[ids], kv_scales(c)[ids]).flatten(0, 1)[:n]
                for c in (b.k_cache, b.v_cache)
            )  # [n, Hkv, D]: the smoothed keys the query meets, and the values
            if case.window is not None:
                k, v = k[-case.window :], v[-case.window :]
            delta = q_scale[s] / 2 * k.abs().sum(-1).amax(0).repeat_interleave(group)  # [H]
            largest = v.abs().amax(dim=(0, 2)).repeat_interleave(group)
            bound = (torch.exp(2 * delta) - 1) * largest + WEIGHT_ROUNDING * largest.amax()
            if case.dtype == torch.bfloat16:  # the output rounded to bf16: half a unit in its last place
                bound = bound + exact[s].abs().amax(-1) * 2**-9
            error = (out[s] - exact[s]).abs().amax(-1)
            assert (error <= bound + 1e-5).all(), (s, error, bound)
        assert not torch.equal(out, exact)


@pytest.mark.parametrize("case", PREFILL.values(), ids=PREFILL.keys())
def test_prefill_matches_reference(backend, case):
    b = _batch(case)
    scale = 1 / math.sqrt(case.head_dim)
    args = b.args(scale, case.window, case.softcap)
    out = backend.paged_attention(b.q, args)
    expected = reference.paged_attention(_attended_query(backend, b, scale), args).to(case.dtype)
    assert out.dtype == case.dtype and out.shape == b.q.shape
    torch.testing.assert_close(out, expected, **_tolerance_of(backend, case, b))


def _release_before_windows(b, window: int) -> None:
    """Point every table entry wholly before the window of a sequence's first query row at a spare,
    NaN-filled block, as a sliding-window KV group's given-back entries are: a read of one shows as NaN."""
    block_size = b.k_cache.shape[1]
    spare = sorted(set(range(b.k_cache.shape[0])) - set(b.block_tables.flatten().tolist()))[0]
    starts, lens = b.query_start_loc.tolist(), b.context_lens.tolist()
    for s, context_len in enumerate(lens):
        first_pos = context_len - (starts[s + 1] - starts[s])
        b.block_tables[s, : max(0, first_pos + 1 - window) // block_size] = spare


@pytest.mark.parametrize(
    ("block_size", "context_lens", "query_lens", "window"),
    [
        (4, (40, 70, 9), (1, 1, 1), 8),
        (16, (300, 97), (1, 1), 64),
        (4, (40, 33), (20, 1), 8),
        (16, (600,), (200,), 128),
    ],
)
def test_a_sliding_window_never_reads_table_entries_before_its_window(
    backend, block_size, context_lens, query_lens, window
):
    """The hybrid KV cache gives back a sliding layer's blocks once they leave its window: every backend
    (and the reference) must match dense attention on a table whose early entries are such blocks."""
    b = random_paged_batch(list(context_lens), list(query_lens), 4, 1, 64, block_size, seed=7)
    _release_before_windows(b, window)
    scale = 0.125
    expected = dense_batch_attention(b, scale, window)
    for attend in (backend.paged_attention, reference.paged_attention):
        out = attend(b.q, b.args(scale, window))
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    if all(n == 1 for n in query_lens):
        out = backend.paged_attention(b.q, b.args(scale, window, decode=True))
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_contiguous_layout_is_block_size_one(backend):
    """The engine's contiguous baseline views one cache as [num_slots, 1, H, D] with slot ids as blocks."""
    b = _batch(Case(6, 2, 16, 8, (25, 11), (5, 1)))
    flat_k = b.k_cache.view(-1, 1, *b.k_cache.shape[2:])
    flat_v = b.v_cache.view(-1, 1, *b.v_cache.shape[2:])
    blocks = b.block_tables.long()
    slots = (blocks[:, :, None] * 8 + torch.arange(8)).flatten(1).to(torch.int32)  # [S, max_blocks * 8]
    scale = 0.25
    out = backend.paged_attention(b.q, b.args(scale, k_cache=flat_k, v_cache=flat_v, block_tables=slots))
    expected = reference.paged_attention(b.q, b.args(scale))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "dtype, cache_dtype",
    [
        (torch.float32, None),
        (torch.bfloat16, None),
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
    ],
    ids=["fp32", "bf16", "fp32-to-bf16", "fp32-to-fp16"],
)
@pytest.mark.parametrize("head_major", [False, True], ids=["slot-major", "head-major"])
def test_write_kv_matches_reference(backend, dtype, cache_dtype, head_major):
    """Each new token's K/V lands in its slot, rounded to the cache's dtype (nearest even) as torch
    rounds it; -1 slots are skipped."""
    gen = torch.Generator().manual_seed(1)
    shape = (5, 4, 2, 16)  # 20 slots
    caches = [torch.randn(shape, generator=gen).to(cache_dtype or dtype) for _ in range(2)]
    if head_major:
        caches = [c.transpose(1, 2).contiguous().transpose(1, 2) for c in caches]
    expected = [c.clone() for c in caches]
    key, value = (torch.randn(6, 2, 16, generator=gen).to(dtype) * 300 for _ in range(2))
    slots = torch.tensor([3, -1, 19, 0, -1, 8])
    backend.write_kv(key, value, *caches, slots)
    reference.write_kv(key, value, *expected, slots)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])
    assert torch.equal(caches[0][4, 3], key[2].to(caches[0].dtype))  # slot 19 = block 4, row 3


def test_write_kv_of_one_token_split_from_a_fused_projection(backend):
    """A one-token K view of a fused [1, H + 2 Hkv, D] tensor counts as contiguous but keeps the
    fused row stride: only its own Hkv * D values may land in the slot."""
    fused = torch.randn(1, 8, 16)
    key, value = fused[:, 4:6], fused[:, 6:8]
    caches = [torch.zeros(3, 4, 2, 16) for _ in range(2)]
    backend.write_kv(key, value, *caches, torch.tensor([5]))
    flat_k, flat_v = (c.view(12, 2, 16) for c in caches)
    assert torch.equal(flat_k[5], key[0]) and torch.equal(flat_v[5], value[0])
    assert flat_k.count_nonzero() == key.numel() and flat_v.count_nonzero() == value.numel()


def test_query_may_be_a_strided_view(backend):
    """Models split q out of a fused projection: q rows are then further apart than H * D."""
    b = _batch(Case(6, 2, 16, 4, (12, 30), (12, 1)))
    fused = torch.cat([b.q, torch.randn(b.q.shape[0], 4, 16)], dim=1)  # [T, H + 2 Hkv, D]
    q_view = fused[:, :6]
    assert not q_view.is_contiguous()
    out = backend.paged_attention(q_view, b.args(0.25))
    torch.testing.assert_close(out, reference.paged_attention(b.q, b.args(0.25)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", [INT8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("head_major", [False, True], ids=["slot-major", "head-major"])
def test_write_kv_quantizes_as_the_reference(backend, source, kv_dtype, head_major):
    """Into a quantized cache, the store writes each (token, kv head) row's codes and scale, to the bit
    the reference's, keys through the layer's key smoothing (here a random one): magnitudes from 1e-6 to
    1e3 (fp8's subnormal codes too), an all-zero row, rows with a NaN or an infinity, a -0.0; nothing else
    in any block changes."""
    gen = torch.Generator().manual_seed(2)
    caches, expected = (
        allocate_kv_caches(1, 7, 4, 3, 72, kv_dtype, "cpu", head_major=head_major)[0] for _ in "ab"
    )
    for cache, twin in zip(caches, expected, strict=True):  # random bytes everywhere, scales included
        kv_blocks(cache).copy_(
            torch.randint(0, 256, kv_blocks(cache).shape, generator=gen, dtype=torch.uint8)
        )
        kv_blocks(twin).copy_(kv_blocks(cache))
    mean, factor = torch.randn(3, 72, generator=gen), 4.0 ** torch.randn(3, 72, generator=gen)
    for smoothing in (key_smoothing(caches[0]), key_smoothing(expected[0])):
        smoothing[0].copy_(mean), smoothing[1].copy_(factor)
    key = torch.randn(9, 3, 72, generator=gen) * torch.logspace(-6, 3, 9)[:, None, None]
    key[3, 0, 5], key[4, 2, 7], key[5, 0, 0] = float("nan"), float("inf"), -0.0
    value = torch.randn(9, 3, 72, generator=gen) * torch.logspace(-6, 3, 9)[:, None, None]
    value[2, 1], value[6, 2, 3] = 0.0, -0.0
    key, value = key.to(source), value.to(source)
    slots = torch.tensor([3, -1, 19, 0, 27, 8, 9, 10, 11])
    backend.write_kv(key, value, *caches, slots)
    reference.write_kv(key, value, *expected, slots)
    for cache, twin in zip(caches, expected, strict=True):
        assert torch.equal(kv_blocks(cache), kv_blocks(twin))
    read = reference.read_blocks(caches[0], torch.arange(7), keys=True).flatten(0, 1)  # [slots, Hkv, D]
    assert read[0, 0].isnan().all() and not read[0, 1:].isnan().any()  # token 3's NaN: slot 0, head 0
    assert read[27, 2].isnan().all() and not read[27, :2].isnan().any()  # token 4's infinity
    values = reference.read_blocks(caches[1], torch.arange(7), keys=False).flatten(0, 1)
    assert (
        torch.equal(values[19, 1], torch.zeros(72)) and kv_scales(caches[1])[4, 3, 1] == 0
    )  # token 2's zeros


def test_every_fp8_code_reads_as_torch_converts_it(backend):
    """Each of e4m3's 254 finite codes, as the values of a one-token context (whose attention output is its
    V row itself), reads back exactly as torch converts it, times its scale: the kernels decode fp8
    themselves, by integer arithmetic."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(FP8)  # 0x7f and 0xff are NaN, never written
    head_dim, num_seqs = 16, codes.numel() // 16 + 1
    k_cache, v_cache = allocate_kv_caches(1, num_seqs, 1, 1, head_dim, FP8, "cpu", head_major=True)[0]
    rows = torch.cat([codes, codes[: num_seqs * head_dim - codes.numel()]]).view(num_seqs, 1, 1, head_dim)
    v_cache.copy_(rows)
    kv_scales(k_cache).fill_(1.0)
    scale = 2.0**-3  # exact: value * scale needs no rounding
    kv_scales(v_cache).fill_(scale)
    q = torch.randn(num_seqs, 1, head_dim)
    tables = torch.arange(num_seqs, dtype=torch.int32)[:, None]
    lens = torch.ones(num_seqs, dtype=torch.int32)
    out = backend.paged_attention(q, AttentionArgs(k_cache, v_cache, tables, lens, 1.0))
    assert torch.equal(out, rows.view(num_seqs, 1, head_dim).float() * scale)
    starts = torch.arange(num_seqs + 1, dtype=torch.int32)
    out = backend.paged_attention(
        q, AttentionArgs(k_cache, v_cache, tables, lens, 1.0, query_start_loc=starts)
    )
    assert torch.equal(out, rows.view(num_seqs, 1, head_dim).float() * scale)
