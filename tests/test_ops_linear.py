"""The C++ linear kernel (ops/csrc/linear.cpp) on every weight format and instruction-set build, against
x @ dequantize(W)^T computed by torch in float64; and its row lookups (the tied embedding).

Up to 4 rows of x meet int8 / int4 codes in groups of whole 32-column blocks as int16 blocks (scale
max |x| / 32767 a block): there the reference rounds x the same way, written here independently."""

import pytest
import torch
from ops_helpers import int_blocks

from pagedllm.ops import native

ISAS = native.supported_isas()
pytestmark = pytest.mark.skipif(not ISAS, reason="the CPU kernels need AVX2")


def _codes(n: int, k: int, low: int, high: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randint(low, high + 1, (n, k), generator=gen)


def _pack_int4(q: torch.Tensor) -> torch.Tensor:
    """The documented layout, written independently: byte i of each 32-column run = col i | col i+16 << 4."""
    n, k = q.shape
    out = torch.empty(n, k // 2, dtype=torch.uint8)
    for run in range(k // 32):
        for i in range(16):
            out[:, run * 16 + i] = q[:, run * 32 + i] | (q[:, run * 32 + 16 + i] << 4)
    return out


def make_weight(fmt: str, n: int, k: int, seed: int = 0):
    """(stored tensors for the kernel, the float64 W they stand for)."""
    stored, w, _ = make_weight_and_mins(fmt, n, k, seed)
    return stored, w


def make_weight_and_mins(fmt: str, n: int, k: int, seed: int = 0):
    """make_weight's pair and the part of W that is the group mins (zero without mins)."""
    gen = torch.Generator().manual_seed(seed)
    if fmt in ("float32", "bfloat16"):
        w = torch.randn(n, k, generator=gen).to(getattr(torch, fmt))
        return (w, None, None, 0), w.double(), torch.zeros(n, k, dtype=torch.float64)
    if fmt == "float32-panels":  # group_size carries N
        w = torch.randn(n, k, generator=gen)
        return (native.pack_panels(w), None, None, n), w.double(), torch.zeros(n, k, dtype=torch.float64)
    group, scale_dtype = {"int8": (k, torch.float32), "int8-g16-min": (16, torch.float16)}.get(
        fmt, (32 if fmt == "int4" else 64, torch.float32 if fmt == "int4" else torch.float16)
    )
    scales = (torch.rand(n, k // group, generator=gen) * 0.1 + 0.01).to(scale_dtype)
    mins = None if fmt == "int8" else (torch.randn(n, k // group, generator=gen) * 0.1).to(scale_dtype)
    if fmt.startswith("int8"):
        q = _codes(n, k, -128, 127, gen)
        data = q.to(torch.int8)
    else:
        q = _codes(n, k, 0, 15, gen)
        data = _pack_int4(q)
    w = q.double().reshape(n, -1, group) * scales.double()[..., None]
    m = torch.zeros_like(w) if mins is None else mins.double()[..., None].expand_as(w)
    return (data, scales, mins, group), (w + m).reshape(n, k), m.reshape(n, k)


def reference(x: torch.Tensor, fmt: str, stored, w: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """What the kernel computes in exact arithmetic: x @ W^T, with x as int16 blocks against the codes
    (not the mins) where the integer path runs."""
    group = stored[3]
    if fmt.startswith("int") and x.shape[0] <= 4 and group % 32 == 0:
        return int_blocks(x).double() @ (w - mins).T + x.double() @ mins.T
    return x.double() @ w.T


FORMATS = ["float32", "bfloat16", "int8", "int8-g16-min", "int4", "int4-g64-half"]


@pytest.mark.parametrize("fmt", [*FORMATS, "float32-panels"])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 37, 300])  # decode rows (streamed), tiles with tails
@pytest.mark.parametrize("shape", [(80, 128), (13, 576)], ids=["80x128", "13x576"])
def test_linear_matches_dequantized_reference(kernels, fmt, rows, shape):
    n, k = shape
    stored, w, mins = make_weight_and_mins(fmt, n, k)
    x = torch.randn(rows, k)
    out = kernels.linear(x, *stored)
    assert out.dtype == torch.float32 and out.shape == (rows, n)
    expected = reference(x, fmt, stored, w, mins)
    torch.testing.assert_close(out.double(), expected, atol=1e-3 * k**0.5, rtol=1e-4)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("k", [576, 544])  # 18 blocks; 17 (an odd one out of a 2-block AVX-512 unit)
def test_few_rows_meet_codes_as_int16_blocks(kernels, fmt, k):
    """1-4 rows: x-as-int16's result to float32 rounding; among more rows, float x's."""
    stored, w, mins = make_weight_and_mins(fmt, 64, k, seed=1)
    x = torch.randn(2, k) * torch.logspace(-3, 3, k)  # blocks of very different magnitudes
    out = kernels.linear(x, *stored).double()
    expected = reference(x, fmt, stored, w, mins)
    torch.testing.assert_close(out, expected, atol=1e-6 * expected.abs().max().item(), rtol=1e-5)
    batch = kernels.linear(torch.cat((x, torch.randn(3, k))), *stored)[:2].double()
    torch.testing.assert_close(batch, x.double() @ w.T, atol=1e-6 * expected.abs().max().item(), rtol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 7, 8, 9, 16, 17])
@pytest.mark.parametrize("shape", [(96, 50), (49, 7), (145, 1536)], ids=["96x50", "49x7", "145x1536"])
def test_panels_at_any_shape(kernels, rows, shape):
    """Whole and partial panels, K of any length, every register tile height (and its tail)."""
    n, k = shape
    w = torch.randn(n, k)
    x = torch.randn(rows, k)
    out = kernels.linear(x, native.pack_panels(w), None, None, n)
    torch.testing.assert_close(out.double(), x.double() @ w.double().T, atol=1e-4 * k**0.5, rtol=1e-5)


def test_panels_hold_the_weight_rows_side_by_side():
    """pack_panels' layout as csrc/linear.cpp documents it: panel p, row k, lane j = W[48 p + j, k]; zeros
    past N."""
    w = torch.randn(50, 7)
    packed = native.pack_panels(w)
    assert packed.shape == (2, 7, 48) and packed.is_contiguous()
    for n in (0, 1, 47, 48, 49):
        assert torch.equal(packed[n // 48, :, n % 48], w[n])
    assert not packed[1, :, 2:].any()


@pytest.mark.parametrize("fmt", ["float32", "int4", "float32-panels"])
@pytest.mark.parametrize("rows", [2, 9, 20])
def test_bias_and_residual_are_added(kernels, fmt, rows):
    stored, w, mins = make_weight_and_mins(fmt, 48, 64)
    x, bias, residual = torch.randn(rows, 64), torch.randn(48), torch.randn(rows, 48)
    out = kernels.linear(x, *stored, bias=bias, residual=residual)
    expected = reference(x, fmt, stored, w, mins) + bias + residual
    torch.testing.assert_close(out.double(), expected, atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 9])
def test_bf16_activations_in_and_out(kernels, rows):
    stored, w = make_weight("int8-g16-min", 40, 96)
    x, residual = torch.randn(rows, 96).bfloat16(), torch.randn(rows, 40).bfloat16()
    out = kernels.linear(x, *stored, residual=residual)
    assert out.dtype == torch.bfloat16
    expected = (x.double() @ w.T + residual.double()).bfloat16()
    torch.testing.assert_close(out, expected, atol=0.1, rtol=2e-2)


def test_float_rows_of_any_length(kernels):
    """K not a multiple of the SIMD width: the last chunk of each row is read masked."""
    stored, w = make_weight("float32", 7, 50)
    x = torch.randn(6, 100)[:, ::2]  # a strided input is taken too
    torch.testing.assert_close(kernels.linear(x, *stored).double(), x.double() @ w.T, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS)
def test_dequantize_rows_is_an_embedding_lookup(kernels, fmt):
    stored, w = make_weight(fmt, 30, 64, seed=3)
    ids = torch.tensor([29, 0, 7, 7])
    rows = kernels.dequantize_rows(*stored, ids, torch.float32)
    torch.testing.assert_close(rows.double(), w[ids], atol=1e-6, rtol=1e-6)
    assert kernels.dequantize_rows(*stored, ids, torch.bfloat16).dtype == torch.bfloat16


def test_bad_arguments_are_named(kernels):
    (data, scales, mins, _), _ = make_weight("int4", 8, 64)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="group size 48"):
        kernels.linear(x, data, scales, mins, 48)
    with pytest.raises(RuntimeError, match="needs scales"):
        kernels.linear(x, data, None, None, 32)
    with pytest.raises(RuntimeError, match="needs mins"):
        kernels.linear(x, data, scales, None, 32)
    with pytest.raises(RuntimeError, match="x has 63 columns"):
        kernels.linear(torch.randn(2, 63), data, scales, mins, 32)
    panels = native.pack_panels(torch.randn(50, 64))
    with pytest.raises(RuntimeError, match=r"N = group_size \(100\)"):
        kernels.linear(x, panels, None, None, 100)
    with pytest.raises(RuntimeError, match="x float32"):
        kernels.linear(x.bfloat16(), panels, None, None, 50)
    with pytest.raises(RuntimeError, match="row id 8 is out of range"):
        kernels.dequantize_rows(data, scales, mins, 32, torch.tensor([8]), torch.float32)
