"""Weight-only quantization: GGUF blocks kept as the file stores them (values against the `gguf` package's
dequantizer),
int8 / int4 quantization error bounds, and every kernel-backed LinearMethod against the dense reference
on the weights it stores."""

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from helpers import skip_unless_onednn_packs
from models_helpers import GGUF_TYPES as TYPES
from models_helpers import random_blocks

from pagedllm.models.gguf_quants import KEPT_TYPES, GGUFBlocks
from pagedllm.models.linear import (
    DenseLinear,
    KernelLinear,
    Linear,
    OneDNNLinear,
    process_linear_layers,
    take_rows,
    weight_bytes,
)
from pagedllm.models.quantization import (
    GGUFLinear,
    Int4Linear,
    Int8Linear,
    blocks_storage,
    linear_method_for,
    quantize_int4,
    quantize_int8,
)
from pagedllm.ops import native

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None, reason="needs the CPU kernels")


def stored_rows(stored, cols: int) -> torch.Tensor:
    """Every row of a StoredWeight, dequantized by the kernel's row lookup (float32 panels: unpacked)."""
    if stored.data.dim() == 3:
        return native.panel_rows(stored.data, torch.arange(stored.group_size))
    if stored.format == "gguf":
        ids = torch.arange(int(stored.scales[:, 0].sum()))
        return native.dequantize_rows(stored.data, stored.scales, None, 0, ids, torch.float32, cols)
    ids = torch.arange(stored.data.shape[0])
    return native.dequantize_rows(
        stored.data, stored.scales, stored.mins, stored.group_size, ids, torch.float32
    )


@pytest.mark.parametrize("qtype", sorted(KEPT_TYPES, key=lambda t: t.name), ids=lambda t: t.name)
def test_each_kept_type_is_stored_as_the_files_bytes(qtype):
    blocks = random_blocks(qtype, 6, 512)
    assert blocks.shape == (6, 512)
    expected = torch.from_numpy(dequantize(blocks.raw, qtype))
    stored = blocks_storage([blocks])
    assert stored.format == "gguf" and stored.data.nbytes == blocks.raw.nbytes
    assert np.array_equal(stored.data.numpy(), blocks.raw.reshape(-1))
    assert stored.scales.tolist() == [[6, int(qtype)]]
    assert torch.equal(stored_rows(stored, 512), expected)
    assert torch.equal(blocks.dequantize(), expected)


def test_a_fused_projection_of_mixed_types_keeps_each_shards_blocks():
    """Gemma 3's Q4_K_M file mixes Q5_0 q/k with Q8_0 v, Qwen2.5's Q4_K with Q6_K: each shard keeps its
    own blocks, one after another, value for value."""
    parts = [random_blocks(GGMLQuantizationType[name], 4, 256, seed=i) for i, name in enumerate(TYPES)]
    stored = blocks_storage(parts)
    assert stored.data.nbytes == sum(p.raw.nbytes for p in parts)
    assert stored.scales.tolist() == [[4, int(p.qtype)] for p in parts]
    expected = torch.cat([torch.from_numpy(dequantize(p.raw, p.qtype)) for p in parts])
    assert torch.equal(stored_rows(stored, 256), expected)


def test_a_type_not_kept_is_named():
    blocks = GGUFBlocks(np.zeros((1, 84), dtype=np.uint8), GGMLQuantizationType.Q2_K)
    with pytest.raises(ValueError, match="Q2_K is not kept quantized"):
        blocks_storage([blocks])


def test_int8_error_is_at_most_half_a_step():
    w = torch.randn(64, 96) * torch.rand(64, 1)
    stored = quantize_int8(w)
    assert stored.group_size == 96 and stored.data.dtype == torch.int8
    err = (stored_rows(stored, w.shape[1]) - w).abs()
    assert (err <= stored.scales / 2 * (1 + 1e-5) + 1e-7).all()


def test_int4_error_is_about_half_a_step_per_group():
    w = torch.randn(32, 128)
    stored = quantize_int4(w)
    assert (stored.format, stored.group_size, stored.scales.dtype) == ("int4", 32, torch.float16)
    err = (stored_rows(stored, w.shape[1]) - w).abs().reshape(32, 4, 32)
    step = stored.scales.float()[..., None]
    assert (err <= step * 0.5 + 2e-3).all()  # + the float16 rounding of scale and min
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_int4(torch.randn(4, 48))


def _layer(method, in_features=64, out_features=40, bias=True, dtype=torch.float32, seed=0) -> Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(in_features, out_features, bias=bias).to(dtype)
    layer.method = method
    method.create_weights(layer)
    weight = torch.randn(out_features, in_features, generator=gen) * 0.1
    if isinstance(method, GGUFLinear):  # a fused projection: Q8_0 rows, then Q4_1 rows
        weight = None
        method.load_weight(layer, 0, random_blocks(GGMLQuantizationType.Q8_0, 16, in_features, seed))
        method.load_weight(
            layer, 16, random_blocks(GGMLQuantizationType.Q4_1, out_features - 16, in_features)
        )
    else:
        method.load_weight(layer, 0, weight)
    if bias:
        with torch.no_grad():
            layer.bias.copy_(torch.randn(out_features, generator=gen))
    return layer.requires_grad_(False)


METHODS = [KernelLinear, Int8Linear, Int4Linear, GGUFLinear]


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 4, 5, 16, 64])
@pytest.mark.parametrize("with_residual", [False, True])
def test_kernel_methods_compute_dense_linear_on_their_stored_weight(method, dtype, rows, with_residual):
    layer = _layer(method(), dtype=dtype)
    process_linear_layers(layer)
    assert not hasattr(layer, "weight")
    stored = stored_rows(layer.stored, 64)
    x = torch.randn(rows, 64).to(dtype)
    residual = torch.randn(rows, 40).to(dtype) if with_residual else None
    reference = Linear(64, 40, bias=True)  # float32 arithmetic on the same values, rounded once at the end
    reference.weight.data, reference.bias.data = stored, layer.bias.data.float()
    expected = DenseLinear().apply(reference, x.float(), None if residual is None else residual.float())
    tolerance = {"atol": 1e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    if method is GGUFLinear:
        # the 32-value types meet x as int16 with one scale per 256 values (here the row's 64) at any rows
        row_max = x.float().abs().amax(dim=-1, keepdim=True).expand(rows, 64)
        tolerance["atol"] += (row_max @ stored.abs().T).max().item() / 65534
    elif method is not KernelLinear and rows <= method.STREAM_ROWS:
        # few rows meet codes as int16 blocks: each value off by at most 1 / 65534 of its block's max
        block_max = x.float().abs().reshape(rows, 2, 32).amax(dim=-1).repeat_interleave(32, dim=1)
        tolerance["atol"] += (block_max @ stored.abs().T).max().item() / 65534
    if method is GGUFLinear and 0 < layer.stored.group_size <= rows:
        # the bf16 path (AVX512_BF16 CPUs): x, W and the output rounded to bf16, 2^-9 each
        tolerance["atol"] += 2**-7 * (x.float().abs() @ stored.abs().T).max().item()
        tolerance["rtol"] = max(tolerance["rtol"], 2**-8)
    torch.testing.assert_close(layer(x, residual), expected.to(dtype), **tolerance)
    ids = torch.tensor([39, 0, 5])  # the same storage serves a tied embedding's lookups
    torch.testing.assert_close(layer.method.embedding(layer, ids), stored[ids].to(dtype))


@pytest.mark.parametrize("method", [DenseLinear, OneDNNLinear, *METHODS], ids=lambda m: m.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_taken_from_a_layer_compute_its_outputs_at_those_rows(method, dtype):
    """A draft model's LM head over part of the vocabulary: the same storage's rows (GGUF: of both of the
    fused layer's shards, still in their blocks), so the outputs equal the whole layer's there."""
    if method is OneDNNLinear and not torch.backends.mkldnn.is_available():
        pytest.skip("torch without oneDNN")
    if method is OneDNNLinear:
        skip_unless_onednn_packs(dtype)
    layer = _layer(method(), dtype=dtype)
    process_linear_layers(layer)
    ids = torch.tensor([0, 3, 15, 16, 17, 30, 39])  # GGUF: Q8_0 rows 0-15, Q4_1 rows 16-39
    rows = take_rows(layer, ids)
    if method is not DenseLinear and method is not OneDNNLinear:
        held = sum(t.nbytes for t in rows.stored.tensors())
        assert held <= sum(t.nbytes for t in layer.stored.tensors())  # float32 panels: 48 rows at least
    tolerance = {"atol": 1e-2, "rtol": 1e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    for m in (1, 5):  # another row of W would be off by ~1 (outputs of W's 0.1-scaled random rows)
        x = torch.randn(m, 64).to(dtype)
        torch.testing.assert_close(rows(x), layer(x)[:, ids], **tolerance)
    with pytest.raises(ValueError, match="distinct ascending row ids"):
        take_rows(layer, torch.tensor([3, 3]))


def test_weight_bytes_counts_the_stored_formats():
    sizes = {}
    for method in (DenseLinear, KernelLinear, Int8Linear, Int4Linear):
        model = torch.nn.Sequential(
            _layer(method(), 256, 128, bias=False), _layer(method(), 128, 256, bias=False)
        )
        process_linear_layers(model)
        sizes[method.name] = weight_bytes(model)
    weights = 2 * 256 * 128
    assert sizes["dense"] == weights * 4
    assert sizes["kernel"] == (288 * 128 + 144 * 256) * 4  # float32 panels: rows padded to a multiple of 48
    assert sizes["int8"] == weights + (128 + 256) * 4  # codes + a float32 scale a row
    assert sizes["int4"] == weights // 2 + weights // 32 * 2 * 2  # nibbles + a half scale and min a group


def test_linear_method_for_each_setting():
    assert linear_method_for("auto", "cpu", torch.float32, gguf=True).name == "gguf"
    fp32 = "kernel" if native.unavailable_reason() is None and native.avx512_selected() else "onednn"
    assert linear_method_for("auto", "cpu", torch.float32, gguf=False).name == fp32
    assert linear_method_for("auto", "cpu", torch.float16, gguf=True).name == "dense"  # kernels: fp32/bf16
    assert linear_method_for(None, "cpu", torch.float32, gguf=True).name == fp32
    assert linear_method_for("int4", "cpu", torch.bfloat16, gguf=False).name == "int4"
    with pytest.raises(ValueError, match="must be a .gguf file"):
        linear_method_for("gguf", "cpu", torch.float32, gguf=False)
    with pytest.raises(ValueError, match="'int3'"):
        linear_method_for("int3", "cpu", torch.float32, gguf=False)
    with pytest.raises(ValueError, match="not on 'cuda'"):
        linear_method_for("int8", "cuda", torch.float32, gguf=False)


def test_gguf_blocks_from_the_kept_tensor_index_equal_the_readers():
    """The first load of a GGUF's blocks parses the file with GGUFReader and keeps its tensor index in
    the converted folder; later loads map the tensors from that index: the same names and values."""
    from pagedllm.models.gguf_loader import TENSOR_INDEX, gguf_blocks
    from pagedllm.models.loader import gguf_file, resolve_checkpoint

    path, folder = gguf_file("smollm2-135m"), resolve_checkpoint("smollm2-135m")
    (folder / TENSOR_INDEX).unlink(missing_ok=True)
    parsed = list(gguf_blocks(path, folder))
    assert (folder / TENSOR_INDEX).is_file()
    mapped = list(gguf_blocks(path, folder))
    assert [name for name, _ in mapped] == [name for name, _ in parsed]
    assert any(isinstance(t, GGUFBlocks) for _, t in parsed)
    for (name, a), (_, b) in zip(parsed, mapped, strict=True):
        assert type(a) is type(b), name
        if isinstance(a, GGUFBlocks):
            assert a.qtype == b.qtype and np.array_equal(a.raw, b.raw), name
        else:
            assert torch.equal(a, b), name
