"""The C++ linear kernel on GGUF blocks as the file stores them (ops/csrc/quants.h), every block type on
every instruction-set build this CPU runs, against the `gguf` package's dequantizer and float64 matmuls.

x is rounded to int16 blocks (scale max |x| / 32767) and meets the codes in integer arithmetic: in blocks of
256 for Q4_K and Q6_K (their integer sub-scales) at any number of rows (with the AVX2 builds, below 64), at
up to 16 rows in blocks of 32 for the other types (more rows multiply their dequantized values in float32);
the reference rounds x the same way, written here independently. From group_size rows on (where set) x and
W are rounded to bf16: through a whole-weight scratch and oneDNN's GEMM, or on a CPU with AMX through panels
and brgemm.
"""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from models_helpers import GGUF_TYPES, random_blocks
from ops_helpers import int16_blocks

from pagedllm.ops import cpu

ISAS = cpu.supported_isas()
pytestmark = pytest.mark.skipif(not ISAS, reason="the CPU kernels need AVX2")


def storage(parts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(bytes, layout, the float64 W they stand for) of row-stacked GGUFBlocks."""
    data = torch.from_numpy(np.concatenate([p.raw.reshape(-1) for p in parts]))
    layout = torch.tensor([[p.raw.shape[0], int(p.qtype)] for p in parts])
    w = torch.cat([torch.from_numpy(dequantize(p.raw, p.qtype)).double() for p in parts])
    return data, layout, w


STREAMED_ROWS = 16  # linear.cpp's kBlockStreamRows
INTEGER_SCALES = {"Q4_K", "Q6_K"}  # quants.h's kIntegerScales
NARROW_INTEGER_ROWS = 64  # linear.cpp's kNarrowIntegerRows: from here AVX2 builds' K types take float panels


def k_panels(isa: str, rows: int) -> bool:
    """Whether Q4_K / Q6_K take the float panels at `rows` rows, the many-row paths' gate on."""
    return isa.startswith("avx2") and rows >= NARROW_INTEGER_ROWS


def expected(x: torch.Tensor, w: torch.Tensor, name: str, isa: str) -> torch.Tensor:
    """What the kernels compute, with the many-row paths' gate on (set_blocks_bf16's default)."""
    rows = x.shape[0]
    if name in INTEGER_SCALES and not k_panels(isa, rows):
        return int16_blocks(x, 256).double() @ w.T
    return (int16_blocks(x) if rows <= STREAMED_ROWS else x).double() @ w.T


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


@pytest.mark.parametrize("name", sorted(INTEGER_SCALES))
def test_integer_scales_give_a_row_the_same_bits_in_any_batch(kernels, name):
    """With the many-row paths' gate off, as the model runner sets it for a step of decode rows; on, the
    AVX2 builds' K types take the float panels from NARROW_INTEGER_ROWS rows (the reference test)."""
    data, layout, _ = storage([random_blocks(GGMLQuantizationType[name], 40, 2304)])
    x = torch.randn(300, 2304)
    previous = kernels.set_blocks_bf16(False)
    try:
        alone = kernels.linear(x[:1], data, layout)
        for rows in (5, 300):
            assert torch.equal(kernels.linear(x[:rows], data, layout)[:1], alone)
    finally:
        kernels.set_blocks_bf16(previous)
    gated = kernels.linear(x, data, layout)[:1]
    assert torch.equal(gated, alone) == (not k_panels(kernels.selected_isa(), len(x)))


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
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: frozenset(flags))
    assert cpu.supported_isas() == isas


def test_a_build_that_fails_falls_back_with_one_warning(monkeypatch):
    monkeypatch.setattr(cpu, "supported_isas", lambda: ["avx512_vnni", "avx512", "avx2"])
    monkeypatch.delenv(cpu.ISA_ENV_VAR, raising=False)
    failing = {"avx512_vnni": "no VNNI in this compiler"}
    monkeypatch.setattr(cpu, "build_error", failing.get)
    cpu.selected_isa.cache_clear()
    try:
        with pytest.warns(UserWarning, match="using the avx512 kernels: no VNNI in this compiler") as record:
            assert cpu.selected_isa() == "avx512"
            assert cpu.selected_isa() == "avx512"
        assert len(record) == 1
    finally:
        cpu.selected_isa.cache_clear()
