"""The C++ linear kernel on GGUF blocks as the file stores them (ops/csrc/quants.h), every block type on
every instruction-set build this CPU runs, against the `gguf` package's dequantizer and float64 matmuls.

x is rounded to integer blocks and meets the codes in integer arithmetic: for Q4_K and Q6_K (their integer
sub-scales) in int8 blocks of 256 (scale max |x| / 127, llama.cpp's q8_K; int16 where set_blocks_int8 is off)
at any number of rows (with the AVX2 builds and int16, below 64); for the 32-value types in int16 blocks of
256 (scale max |x| / 32767) at any number of rows (pair_rows: test_batch_invariance.py); for Q5_K, and the
32-value types where set_blocks_int8 is off (the exact path), in int16 blocks of 32 at up to 16 rows (more
rows multiply their dequantized values in float32); the reference rounds x the same way, written here
independently. From group_size rows on (where set) x and W are
rounded to bf16: through a whole-weight scratch and oneDNN's GEMM, or on a CPU with AMX through panels and
brgemm.

Then each block type on Qwen2.5-Coder-1.5B's projection shapes (the model of every llama.cpp comparison),
against gguf's dequantize and a float64 matmul within a bound of each path's rounding, in CI on random
blocks and, as a manual test, on the file's own tensors (its LM head among them).
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from models_helpers import GGUF_TYPES, random_blocks
from ops_helpers import INT8, INT16, int_blocks

from pagedllm.models.gguf_quants import GGUFBlocks
from pagedllm.ops import native

ISAS = native.supported_isas()
pytestmark = pytest.mark.skipif(not ISAS, reason="the CPU kernels need AVX2")


def storage(parts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bytes, layout, the float64 W they stand for) of row-stacked GGUFBlocks."""
    data = torch.from_numpy(np.concatenate([p.raw.reshape(-1) for p in parts]))
    layout = torch.tensor([[p.raw.shape[0], int(p.qtype)] for p in parts])
    w = torch.cat([torch.from_numpy(dequantize(p.raw, p.qtype)).double() for p in parts])
    return data, layout, w


STREAMED_ROWS = 16  # linear.cpp's kBlockStreamRows
INTEGER_SCALES = {"Q4_K", "Q6_K"}  # quants.h's kIntegerScales
PAIR_TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}  # linear.cpp's pair_rows, with the default x
NARROW_INTEGER_ROWS = 64  # linear.cpp's kNarrowIntegerRows: AVX2's K types on int16 x take float panels


def k_panels(isa: str, rows: int, largest: int = INT8) -> bool:
    """Whether Q4_K / Q6_K take the float panels at `rows` rows, the many-row paths' gate on: with AVX2 and
    int16 x only (int8 x takes the integer path at any row count on every build)."""
    return largest == INT16 and isa.startswith("avx2") and rows >= NARROW_INTEGER_ROWS


def expected(x: torch.Tensor, w: torch.Tensor, name: str, isa: str, k_largest: int = INT8) -> torch.Tensor:
    """What the kernels compute, with the many-row paths' gate on (set_blocks_bf16's default) and x as
    set_blocks_int8's default rounds it (k_largest INT8: the K types' to int8, the 32-value types' to int16
    per 256) or as the exact path does (INT16: the K types' to int16, the others' per 32)."""
    rows = x.shape[0]
    if name in INTEGER_SCALES and not k_panels(isa, rows, k_largest):
        return int_blocks(x, 256, k_largest).double() @ w.T
    if name in PAIR_TYPES and k_largest == INT8:
        return int_blocks(x, 256, INT16).double() @ w.T
    return (int_blocks(x) if rows <= STREAMED_ROWS else x).double() @ w.T


def tolerance(x: torch.Tensor, w: torch.Tensor) -> float:
    """float32 rounding of sums of |x| |w| products."""
    return 2e-6 * (x.abs().double() @ w.abs().T).max().item() + 1e-6


# columns: K types a multiple of 256 (768: three super-blocks); 32-value types also 896 (a last chunk of
# 4 blocks, Qwen2.5-0.5B's width) and 96 (3 blocks: an AVX-512 unit with one block)
SHAPES = {"K": [768], "small": [896, 96]}


def _cases():
    for name in GGUF_TYPES:
        for cols in SHAPES["K" if name.endswith("_K") else "small"]:
            yield name, cols


@pytest.mark.parametrize("name,cols", list(_cases()))
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 11, 16, 17, 64, 300])
def test_each_block_type_matches_the_reference(kernels, name, cols, rows):
    data, layout, w = storage([random_blocks(GGMLQuantizationType[name], 37, cols, seed=rows)])
    x = torch.randn(rows, cols) * torch.logspace(-2, 2, cols)[torch.randperm(cols)]  # blocks of mixed size
    out = kernels.linear(x, data, layout)
    assert out.shape == (rows, 37) and out.dtype == torch.float32
    torch.testing.assert_close(
        out.double(), expected(x, w, name, kernels.selected_isa()), atol=tolerance(x, w), rtol=0
    )


EXACT_CASES = [(n, 768) for n in sorted(INTEGER_SCALES)] + [(n, 896) for n in sorted(PAIR_TYPES)]


@pytest.mark.parametrize("name,cols", EXACT_CASES)
@pytest.mark.parametrize("rows", [1, 16, 300])
def test_the_exact_path_rounds_x_finer_where_int8_is_off(kernels, name, cols, rows):
    """set_blocks_int8(False) (PAGEDLLM_GGUF_ACTIVATIONS=int16): the K types' x in int16 blocks of 256, the
    32-value types' in int16 blocks of 32 at up to 16 rows and unrounded in float32 above."""
    data, layout, w = storage([random_blocks(GGMLQuantizationType[name], 37, cols, seed=rows)])
    x = torch.randn(rows, cols) * torch.logspace(-2, 2, cols)[torch.randperm(cols)]
    assert kernels.set_blocks_int8(False) is True
    try:
        out = kernels.linear(x, data, layout)
    finally:
        assert kernels.set_blocks_int8(True) is False
    want = expected(x, w, name, kernels.selected_isa(), INT16)
    torch.testing.assert_close(out.double(), want, atol=tolerance(x, w), rtol=0)
    # the default's rounding (int8 per 256; int16 per 256 at any row count) is not within that bound
    assert not torch.allclose(kernels.linear(x, data, layout).double(), want, atol=tolerance(x, w), rtol=0)


@pytest.mark.parametrize("name", sorted(INTEGER_SCALES))
def test_integer_scales_give_a_row_the_same_bits_in_any_batch(kernels, name):
    """With the many-row paths' gate off, as the model runner sets it for a step of decode rows, and on
    with int8 x (the default: the integer path at any row count on every build; with int16 x the AVX2
    builds' K types take the float panels from NARROW_INTEGER_ROWS rows, the reference test)."""
    data, layout, _ = storage([random_blocks(GGMLQuantizationType[name], 40, 2304)])
    x = torch.randn(300, 2304)
    previous = kernels.set_blocks_bf16(False)
    try:
        alone = torch.cat([kernels.linear(x[m : m + 1], data, layout) for m in range(len(x))])
        # every row of each call: 300 rows cross the AVX2 tiles' blocks of rows and a work item's run of x
        for rows in (5, 16, 300):
            assert torch.equal(kernels.linear(x[:rows], data, layout), alone[:rows])
    finally:
        kernels.set_blocks_bf16(previous)
    gated = kernels.linear(x, data, layout)[:1]
    assert torch.equal(gated, alone[:1]) == (not k_panels(kernels.selected_isa(), len(x)))


@pytest.mark.parametrize("types,cols", [(("Q4_K", "Q6_K"), 2304), (("Q5_0", "Q8_0", "Q4_1"), 896)], ids=str)
def test_integer_paths_give_the_same_bits_on_every_build(monkeypatch, types, cols):
    """int8 x on the K types: each chunk's two exact integers and their float sums in one order on every
    build; int16 x on the 32-value types: each block's exact integer and one float product, summed in one
    tree (their contract runs where the invariant gate asks, set here). So an AVX-512 CPU gives a row the
    bits an AVX2 one gives, at few rows (the walks of whole rows) and at many (the tiles); the wider code
    vectors change which lanes hold the integers' parts, not them."""
    if len(ISAS) < 2:
        pytest.skip("this CPU runs one instruction-set build")
    data, layout, _ = storage(
        [random_blocks(GGMLQuantizationType[t], 40, cols, seed=i) for i, t in enumerate(types)]
    )
    x = torch.randn(300, cols) * torch.logspace(-2, 2, cols)[torch.randperm(cols)]
    outs = {}
    for isa in ISAS:
        monkeypatch.setattr(native, "selected_isa", lambda isa=isa: isa)
        previous = native.set_blocks_invariant(True)
        try:
            outs[isa] = [native.linear(x[:rows], data, layout) for rows in (1, 3, 5, 16, 300)]
        finally:
            native.set_blocks_invariant(previous)
    for isa in ISAS[1:]:
        for rows, a, b in zip((1, 3, 5, 16, 300), outs[ISAS[0]], outs[isa], strict=True):
            assert torch.equal(a, b), f"{isa} differs from {ISAS[0]} at {rows} rows"


@pytest.mark.parametrize("types", [("Q5_0", "Q5_0", "Q8_0"), ("Q4_K", "Q4_K", "Q6_K")], ids="-".join)
@pytest.mark.parametrize("rows", [1, 17])
def test_mixed_shards_of_a_fused_projection_with_bias_and_residual(kernels, types, rows):
    """Qwen2.5-Coder's q/k/v: 0.5B Q5_0 / Q5_0 / Q8_0 (896 wide), 1.5B Q4_K / Q4_K / Q6_K."""
    cols = 896 if types[0] == "Q5_0" else 512
    rows_each = (40, 8, 8)
    parts = [random_blocks(GGMLQuantizationType[t], rows_each[i], cols, seed=i) for i, t in enumerate(types)]
    data, layout, w = storage(parts)
    x, bias, residual = torch.randn(rows, cols), torch.randn(56), torch.randn(rows, 56)
    out = kernels.linear(x, data, layout, None, 0, bias, residual)
    want = expected(x, w, types[0], kernels.selected_isa()) + bias.double() + residual.double()
    torch.testing.assert_close(out.double(), want, atol=tolerance(x, w), rtol=0)


@pytest.mark.parametrize("rows", [1, 5, 17])
def test_bf16_activations_in_and_out(kernels, rows):
    data, layout, w = storage([random_blocks(GGMLQuantizationType.Q4_K, 24, 256)])
    x = torch.randn(rows, 256).bfloat16()
    out = kernels.linear(x, data, layout)
    assert out.dtype == torch.bfloat16
    scale = (x.double().abs() @ w.abs().T).max().item()
    torch.testing.assert_close(
        out.double(), expected(x, w, "Q4_K", kernels.selected_isa()), atol=1e-2 * scale, rtol=1e-2
    )


def bf16_tolerance(x: torch.Tensor, w: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Elementwise bound of the bf16 path: x and W rounded to bf16 (a relative 2^-9 each) and the
    product's output rounded to bf16 (2^-9 of it), with a factor 2 of margin."""
    return 2**-7 * (x.abs().double() @ w.abs().T) + 2**-8 * want.abs()


@pytest.mark.parametrize("name,cols", list(_cases()))
@pytest.mark.parametrize("rows,bf16_rows", [(17, 17), (64, 1), (300, 64)])
def test_each_block_type_in_bf16_from_its_row_count(kernels, name, cols, rows, bf16_rows):
    """group_size = the rows from which the weight is dequantized to bf16 and multiplied by oneDNN."""
    data, layout, w = storage([random_blocks(GGMLQuantizationType[name], 37, cols, seed=rows)])
    x = torch.randn(rows, cols) * torch.logspace(-2, 2, cols)[torch.randperm(cols)]
    out = kernels.linear(x, data, layout, None, bf16_rows, None, None)
    assert out.shape == (rows, 37) and out.dtype == torch.float32
    want = x.double() @ w.T
    assert ((out.double() - want).abs() <= bf16_tolerance(x, w, want)).all()
    assert not torch.equal(out, kernels.linear(x, data, layout))  # the bf16 path did run


@pytest.mark.parametrize("types", [("Q5_0", "Q5_0", "Q8_0"), ("Q4_K", "Q4_K", "Q6_K")], ids="-".join)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_path_on_mixed_shards_with_bias_and_residual(kernels, types, dtype):
    cols = 896 if types[0] == "Q5_0" else 512
    sizes = (40, 8, 8)
    parts = [random_blocks(GGMLQuantizationType[t], sizes[i], cols, seed=i) for i, t in enumerate(types)]
    data, layout, w = storage(parts)
    x, bias, residual = torch.randn(80, cols), torch.randn(56), torch.randn(80, 56)
    out = kernels.linear(x.to(dtype), data, layout, None, 20, bias.to(dtype), residual.to(dtype))
    assert out.dtype == dtype
    want = x.to(dtype).double() @ w.T + bias.to(dtype).double() + residual.to(dtype).double()
    assert ((out.double() - want).abs() <= bf16_tolerance(x, w, want) + 2**-7 * want.abs()).all()
    # below its row count a call keeps the integer / float32 path, bit for bit
    few = kernels.linear(x[:19], data, layout, None, 20, bias, residual[:19])
    assert torch.equal(few, kernels.linear(x[:19], data, layout, None, 0, bias, residual[:19]))


def needs_amx(kernels) -> None:
    if not kernels.kernels().blocks_amx():
        pytest.skip("the fused AMX path needs an AVX-512 build and cpublas::could_pack(bf16) (AMX tiles)")


def bf16_product(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x and W rounded to bf16, multiplied exactly: what the AMX path's float32 sums approximate."""
    return x.bfloat16().double() @ w.bfloat16().double().T


def sum_tolerance(x: torch.Tensor, w: torch.Tensor) -> float:
    """float32 sums of bf16 products in brgemm's order: 2^-24 a rounding, a few dozen roundings deep."""
    return 2**-18 * (x.abs().double() @ w.abs().T).max().item() + 1e-6


@pytest.mark.parametrize("name,cols", [*_cases(), ("Q6_K", 4608), ("Q5_0", 4608)])
@pytest.mark.parametrize("rows", [1, 17, 64, 100])
def test_each_block_type_on_amx_panels(kernels, name, cols, rows):
    """Many rows where the CPU has AMX: panels of 64 weight rows dequantized to bf16 in cache and multiplied
    by brgemm into float32 sums; up to 64 rows of x the panel is brgemm's A (row-major), above it B (VNNI
    pairs; linear.cpp's kVnniRowPanelRows). 77 rows: a panel of 13 rows; 896 and 96 columns: a last chunk
    of 4 and of 3 blocks; 4,608 columns: panels of 32 rows (linear.cpp's vnni_panel_rows)."""
    needs_amx(kernels)
    data, layout, w = storage([random_blocks(GGMLQuantizationType[name], 77, cols, seed=rows)])
    x = torch.randn(rows, cols) * torch.logspace(-2, 2, cols)[torch.randperm(cols)]
    out = kernels.linear(x, data, layout, None, 1, None, None)
    assert out.shape == (rows, 77) and out.dtype == torch.float32
    want = x.double() @ w.T
    assert ((out.double() - want).abs() <= 2**-7 * (x.abs().double() @ w.abs().T)).all()
    # the file's values and x each rounded to bf16 once, summed in float32 (no bf16 output)
    torch.testing.assert_close(out.double(), bf16_product(x, w), atol=sum_tolerance(x, w), rtol=0)


@pytest.mark.parametrize("types", [("Q5_0", "Q5_0", "Q8_0"), ("Q4_K", "Q4_K", "Q6_K")], ids="-".join)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [40, 100])
def test_amx_panels_on_mixed_shards_with_bias_and_residual(kernels, types, dtype, rows):
    """A fused projection's shards, each in its own panels (100 rows: a whole panel and one of 36), 40 rows
    of x (the panel as brgemm's A) and 100 (as B)."""
    needs_amx(kernels)
    cols = 896 if types[0] == "Q5_0" else 512
    sizes = (100, 8, 8)
    parts = [random_blocks(GGMLQuantizationType[t], sizes[i], cols, seed=i) for i, t in enumerate(types)]
    data, layout, w = storage(parts)
    x, bias, residual = (
        t.to(dtype) for t in (torch.randn(rows, cols), torch.randn(116), torch.randn(rows, 116))
    )
    out = kernels.linear(x, data, layout, None, 20, bias, residual)
    assert out.dtype == dtype
    want = bf16_product(x, w) + bias.double() + residual.double()
    atol = sum_tolerance(x, w) + (2**-8 * want.abs() if dtype == torch.bfloat16 else 2**-22 * want.abs())
    assert ((out.double() - want).abs() <= atol).all()


def test_a_thread_that_switches_the_bf16_path_off_keeps_the_blocks_path_at_any_rows(kernels):
    """set_blocks_bf16(False) (the model runner's, for a step of decode rows only): a call past its bf16 row
    count computes what group_size 0 does, bit for bit, until the setting is restored."""
    data, layout, _ = storage([random_blocks(GGMLQuantizationType.Q4_0, 40, 512, seed=5)])
    x = torch.randn(64, 512)
    blocks = kernels.linear(x, data, layout, None, 0, None, None)
    assert kernels.set_blocks_bf16(False) is True
    try:
        assert torch.equal(kernels.linear(x, data, layout, None, 17, None, None), blocks)
    finally:
        assert kernels.set_blocks_bf16(True) is False
    assert not torch.equal(kernels.linear(x, data, layout, None, 17, None, None), blocks)


def test_bf16_path_tiles_a_weight_larger_than_its_scratch(kernels):
    """More than linear.cpp's kScratchValues (32 Mi values, an LM head's size): dequantized and multiplied
    in tiles of output rows, each written to its columns of out."""
    rows_w, cols = (32 << 20) // 256 + 77, 256
    blocks = random_blocks(GGMLQuantizationType.Q4_0, rows_w, cols)
    data, layout = torch.from_numpy(blocks.raw.reshape(-1)), torch.tensor([[rows_w, int(blocks.qtype)]])
    x = torch.randn(17, cols)
    out = kernels.linear(x, data, layout, None, 17, None, None)
    exact = kernels.linear(x, data, layout)  # the float32 path (the file's values exactly)
    scale = (x.abs().sum(dim=1, keepdim=True) * 0.4).expand_as(exact)  # |W| <= 8 |d|, |d| < 0.05 here
    assert ((out - exact).abs() <= 2**-7 * scale + 2**-8 * exact.abs()).all()
    assert not torch.equal(out[:, -77:], exact[:, -77:])


@pytest.mark.parametrize("name", GGUF_TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantize_rows_gives_the_files_values(kernels, name, dtype):
    parts = [random_blocks(GGMLQuantizationType[name], 5, 512, seed=1)]
    parts.append(random_blocks(GGMLQuantizationType.Q8_0, 3, 512))
    data, layout, w = storage(parts)
    ids = torch.tensor([7, 0, 4, 5, 4])
    rows = kernels.dequantize_rows(data, layout, None, 0, ids, dtype, cols=512)
    assert torch.equal(rows, w[ids].to(dtype))


def test_bad_blocks_are_named(kernels):
    data, layout, _ = storage([random_blocks(GGMLQuantizationType.Q4_0, 4, 64)])
    x = torch.randn(1, 64)
    with pytest.raises(RuntimeError, match="ggml type 10 .* is not one the kernel reads"):
        kernels.linear(x, data, torch.tensor([[4, 10]]))
    with pytest.raises(RuntimeError, match="take 108 bytes, the weight has 144"):
        kernels.linear(x, data, torch.tensor([[3, int(GGMLQuantizationType.Q4_0)]]))
    with pytest.raises(RuntimeError, match="needs columns in multiples of 256"):
        kernels.linear(torch.randn(1, 64), data, torch.tensor([[1, int(GGMLQuantizationType.Q4_K)]]))


@pytest.mark.parametrize(
    ("capability", "flags", "isas"),
    [
        ("AVX512", {"avx512_vnni", "avx_vnni"}, ["avx512_vnni", "avx512", "avx2_vnni", "avx2"]),
        ("AVX512", set(), ["avx512", "avx2"]),
        ("AVX2", {"avx_vnni"}, ["avx2_vnni", "avx2"]),
        ("AVX2", set(), ["avx2"]),  # an AVX2-only CPU never gets a VNNI build
        ("DEFAULT", {"avx512_vnni"}, []),
    ],
)
def test_the_vnni_builds_follow_the_cpus_flags(monkeypatch, capability, flags, isas):
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    monkeypatch.setattr(native, "_cpu_flags", lambda: frozenset(flags))
    assert native.supported_isas() == isas


def test_a_build_that_fails_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(native, "supported_isas", lambda: ["avx512_vnni", "avx512", "avx2"])
    monkeypatch.delenv(native.ISA_ENV_VAR, raising=False)
    failing = {"avx512_vnni": "no VNNI in this compiler"}
    monkeypatch.setattr(native, "build_error", failing.get)
    native.selected_isa.cache_clear()
    try:
        with pytest.warns(UserWarning, match="using the avx512 kernels: no VNNI in this compiler") as record:
            assert native.selected_isa() == "avx512"
            assert native.selected_isa() == "avx512"
        assert len(record) == 1
    finally:
        native.selected_isa.cache_clear()


# Qwen2.5-Coder-1.5B's projections as (out_features, in_features): q and o, k and v, gate and up, down. On
# them the kernels run many panels of weight rows, and at 8,960 columns a row's 35 chunks of 256 in spans
# of linear.cpp's kSpanChunks (8), which the small shapes above never reach. The LM head (151,936 rows) is
# left to the manual test on the file's own tensors, below.
QWEN15B_SHAPES = {"q": (1536, 1536), "k": (256, 1536), "gate": (8960, 1536), "down": (1536, 8960)}
# rows of x: one (decode), a streamed register tile and a part one, the float panels / K types' second
# integer run (kIntegerChunkRows 128); 64 and 200 also take the bf16 path at BF16_FROM rows
QWEN15B_ROWS = (1, 7, 64, 200)
BF16_FROM = 17
UNIT = 2.0**-24  # float32's unit roundoff
WEIGHT_CHUNK = 16384  # weight rows a reference matmul takes at a time (an LM head's float64 is 1.9 GB)


def rounding_step(x: torch.Tensor, block: int, largest: int) -> torch.Tensor:
    """Half an integer step of each value's block of `block` columns (max |x| / largest / 2): the most that
    rounding x to integer blocks moves it."""
    half = x.abs().reshape(len(x), -1, block).amax(dim=-1, keepdim=True) / largest / 2
    return half.expand(-1, -1, block).reshape(x.shape)


def kernel_path(name: str, isa: str, rows: int, group_size: int) -> str:
    """Which path the kernels take (the reference test's `expected`, with bf16 from group_size rows)."""
    if group_size and rows >= group_size:
        return "bf16"
    if name in INTEGER_SCALES:
        return "float32" if k_panels(isa, rows) else "int8 x 256"
    return "int16 x 32" if rows <= STREAMED_ROWS else "float32"


class Reference:
    """One weight in the kernels' storage, gguf's dequantization of it, and for each row count a seeded x
    and the float64 products it is checked against, computed once for every instruction-set build."""

    def __init__(self, blocks: GGUFBlocks, label: str):
        self.name, self.label = blocks.qtype.name, f"{blocks.qtype.name} {label} {blocks.shape}"
        self.data = torch.from_numpy(blocks.raw.reshape(-1))
        self.layout = torch.tensor([[blocks.raw.shape[0], int(blocks.qtype)]])
        self.w = torch.from_numpy(dequantize(blocks.raw, blocks.qtype))  # float32: the file's values exactly
        self._cache: dict[tuple, torch.Tensor] = {}

    def x(self, rows: int) -> torch.Tensor:
        cols = self.w.shape[1]
        gen = torch.Generator().manual_seed(rows)
        scale = torch.logspace(-2, 2, cols)[torch.randperm(cols, generator=gen)]  # blocks of mixed size
        return torch.randn(rows, cols, generator=gen) * scale

    def _times_w(self, left: torch.Tensor, absolute: bool) -> torch.Tensor:
        """left [rows, cols] float64 times W^T (or |W|^T) in float64, WEIGHT_CHUNK weight rows at a time."""
        parts = [left @ (c.double().abs() if absolute else c.double()).T for c in self.w.split(WEIGHT_CHUNK)]
        return torch.cat(parts, dim=1)

    def exact(self, rows: int) -> torch.Tensor:
        if (rows, "exact") not in self._cache:
            self._cache[rows, "exact"] = self._times_w(self.x(rows).double(), absolute=False)
        return self._cache[rows, "exact"]

    def bound(self, rows: int, path: str) -> torch.Tensor:
        """|kernel - x W^T| at most, elementwise, on `path` (no model of the kernels' own rounding):
        bf16: x and W rounded to bf16 (bf16_tolerance);
        intN x B: x rounded to intN blocks of B columns (rounding_step) through |W|, then float32 sums of
          one term per 16-value group (cols / 16 deep, + 32 for scales and lane sums), each within
          8 |x||w| of its group (a group's split s sum(u q) + c sum(q) exceeds |x||w| where a min
          cancels the codes: 15 |d| and |m| are each at most 2 max |w|);
        float32 (the file's values times x): float32 sums cols deep (one accumulator a row through all
          columns), each term |x||w|."""
        if (rows, path) not in self._cache:
            x, cols = self.x(rows).double(), self.w.shape[1]
            if path == "bf16":
                bound = 2**-7 * self._times_w(x.abs(), True) + 2**-8 * self.exact(rows).abs()
            elif path == "float32":
                bound = (cols + 32) * UNIT * self._times_w(x.abs(), True)
            else:
                kind, block = path.split(" x ")
                step = rounding_step(x, int(block), INT8 if kind == "int8" else INT16)
                bound = self._times_w(step + 8 * (cols // 16 + 32) * UNIT * x.abs(), True)
            self._cache[rows, path] = bound
        return self._cache[rows, path]


def check_against_gguf(kernels, ref: Reference, group_size: int) -> None:
    """The kernels' product at each of QWEN15B_ROWS rows of x within its path's bound of x W^T."""
    isa = kernels.selected_isa()
    for rows in QWEN15B_ROWS:
        out = kernels.linear(ref.x(rows), ref.data, ref.layout, None, group_size, None, None)
        assert out.shape == (rows, ref.w.shape[0]) and out.dtype == torch.float32
        path = kernel_path(ref.name, isa, rows, group_size)
        worst = ((out.double() - ref.exact(rows)).abs() / ref.bound(rows, path)).max().item()
        assert worst <= 1, f"{ref.label}, {rows} rows ({path}): an error {worst:.2f}x its bound"


@pytest.fixture(scope="module", params=GGUF_TYPES)
def qwen15b_shaped(request) -> dict[str, Reference]:
    """Random blocks of one type at each of QWEN15B_SHAPES; module-scoped, so that pytest runs each type's
    tests together and builds its weights once."""
    qtype = GGMLQuantizationType[request.param]
    return {
        shape: Reference(random_blocks(qtype, rows, cols, seed=i), shape)
        for i, (shape, (rows, cols)) in enumerate(QWEN15B_SHAPES.items())
    }


@pytest.mark.parametrize("shape", QWEN15B_SHAPES)
@pytest.mark.parametrize("group_size", [0, BF16_FROM])
def test_each_block_type_on_the_15b_shapes(kernels, qwen15b_shaped, shape, group_size):
    """Every block type at each projection shape of the 1.5B, 1 to 200 rows of x, against gguf's dequantize
    and a float64 matmul: group_size 0, the integer and float32 paths; BF16_FROM, the bf16 one (oneDNN, or
    AMX's panels) from that many rows, as GGUFLinear sets it where the CPU multiplies bf16."""
    check_against_gguf(kernels, qwen15b_shaped[shape], group_size)


# The 1.5B's own tensors, one of each (type, shape) the file holds; the LM head's float64 reference takes
# seconds a row count and GBs: a manual test (PAGEDLLM_MANUAL_TESTS=1), with the model's part packages.
QWEN15B_TENSORS = {
    "blk.0.attn_q.weight": ("Q4_K", (1536, 1536)),
    "blk.0.attn_k.weight": ("Q4_K", (256, 1536)),
    "blk.0.attn_v.weight": ("Q6_K", (256, 1536)),
    "blk.0.ffn_gate.weight": ("Q4_K", (8960, 1536)),
    "blk.0.ffn_down.weight": ("Q6_K", (1536, 8960)),
    "blk.2.ffn_down.weight": ("Q4_K", (1536, 8960)),
    "output.weight": ("Q6_K", (151936, 1536)),
}


@pytest.fixture(scope="module")
def qwen15b_reader():
    from gguf import GGUFReader

    from pagedllm.models.builtin import QWEN_CODER_15B

    return GGUFReader(QWEN_CODER_15B.path())


@pytest.fixture(scope="module", params=QWEN15B_TENSORS)
def qwen15b_tensor(request, qwen15b_reader) -> Reference:
    (tensor,) = [t for t in qwen15b_reader.tensors if t.name == request.param]
    blocks = GGUFBlocks(np.array(tensor.data), tensor.tensor_type)  # a copy: the reader's map is read-only
    assert (blocks.qtype.name, blocks.shape) == QWEN15B_TENSORS[request.param]
    return Reference(blocks, request.param)


@pytest.mark.manual
@pytest.mark.parametrize("group_size", [0, BF16_FROM])
def test_the_15b_files_own_tensors(kernels, qwen15b_tensor, group_size):
    """The Q4_K and Q6_K tensors of the file the model runs, as the CI test's random blocks."""
    check_against_gguf(kernels, qwen15b_tensor, group_size)
