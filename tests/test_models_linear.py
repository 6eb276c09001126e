"""Linear layers and their methods: every method computes what the dense reference computes."""

import pytest
import torch
from helpers import skip_unless_onednn_packs

from pagedllm.models.linear import (
    LINEAR_METHOD_ENV_VAR,
    DenseLinear,
    KernelLinear,
    Linear,
    OneDNNLinear,
    default_linear_method,
    process_linear_layers,
)
from pagedllm.ops import native

ONEDNN = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without mkldnn")


def _layer(in_features: int, out_features: int, bias: bool, dtype: torch.dtype, seed: int = 0) -> Linear:
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(in_features, out_features, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(out_features, in_features, generator=gen) * 0.1)
        if bias:
            layer.bias.copy_(torch.randn(out_features, generator=gen))
    return layer.to(dtype).requires_grad_(False)


@ONEDNN
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 5, 64])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
def test_onednn_matches_dense(dtype, rows, bias, with_residual):
    skip_unless_onednn_packs(dtype)
    layer = _layer(96, 80, bias, dtype)
    x = torch.randn(rows, 96).to(dtype)
    residual = torch.randn(rows, 80).to(dtype) if with_residual else None
    expected = DenseLinear().apply(layer, x, residual)
    process_linear_layers(layer, OneDNNLinear())
    assert not hasattr(layer, "weight")  # the packed copy replaces the parameter
    out = layer(x, residual)
    tolerance = {"atol": 5e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(out, expected, **tolerance)


@ONEDNN
def test_onednn_accepts_a_non_contiguous_input():
    layer = _layer(32, 16, False, torch.float32)
    x = torch.randn(4, 64)[:, ::2]
    expected = DenseLinear().apply(layer, x, None)
    process_linear_layers(layer, OneDNNLinear())
    torch.testing.assert_close(layer(x), expected, atol=1e-5, rtol=1e-5)


def test_dense_residual_equals_a_separate_add():
    layer = _layer(32, 16, True, torch.float32)
    x, residual = torch.randn(3, 32), torch.randn(3, 16)
    torch.testing.assert_close(layer(x, residual), layer(x) + residual)
    layer.bias = None
    torch.testing.assert_close(layer(x, residual), layer(x) + residual)


@ONEDNN
def test_onednn_keeps_the_plain_weight_of_a_tied_lm_head():
    """A tied LM head serves the embedding lookups, which need the plain rows the packed copy lacks."""
    layer = _layer(16, 50, False, torch.float32)
    layer.serves_embedding = True
    table = layer.weight.detach().clone()
    process_linear_layers(layer, OneDNNLinear())
    ids = torch.tensor([3, 49, 0])
    torch.testing.assert_close(layer.method.embedding(layer, ids), table[ids])
    hidden = torch.randn(2, 16)
    torch.testing.assert_close(layer(hidden), hidden @ table.T, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(native.unavailable_reason() is not None, reason="the CPU kernels are unavailable")
@pytest.mark.parametrize("tied", [False, True])
def test_kernel_packs_float32_in_panels_that_serve_the_lookups_too(tied):
    """float32 storage is the panels, nothing else: a tied LM head's lookups gather from them."""
    layer = _layer(16, 50, True, torch.float32)
    layer.serves_embedding = tied
    table, bias = layer.weight.detach().clone(), layer.bias.detach().clone()
    process_linear_layers(layer, KernelLinear())
    assert layer.stored.data.shape == (2, 16, 48) and layer.stored.group_size == 50
    assert [t.data_ptr() for t in layer.method.tensors(layer)] == [layer.stored.data.data_ptr()]
    ids = torch.tensor([3, 49, 0, 48])
    assert torch.equal(layer.method.embedding(layer, ids), table[ids])
    hidden, residual = torch.randn(9, 16), torch.randn(9, 50)
    expected = hidden @ table.T + bias + residual
    torch.testing.assert_close(layer(hidden, residual), expected, atol=1e-5, rtol=1e-5)


def test_default_method_per_device_and_dtype(monkeypatch):
    monkeypatch.delenv(LINEAR_METHOD_ENV_VAR, raising=False)
    # float32 goes to the kernel's panels where the AVX-512 build runs, else to oneDNN
    fp32 = "kernel" if native.unavailable_reason() is None and native.avx512_selected() else "onednn"
    assert default_linear_method("cpu", torch.float32).name == fp32
    assert default_linear_method("cpu", torch.float32, max_num_seqs=256).name == fp32
    # bfloat16 to oneDNN where it packs bf16, else to the kernel (its one-row stream, torch's matmul above)
    bf16 = "onednn" if native.onednn_packs_bf16() else "kernel"
    assert default_linear_method("cpu", torch.bfloat16, max_num_seqs=256).name == bf16
    assert default_linear_method("cpu", torch.float16).name == "dense"
    assert default_linear_method("cuda", torch.bfloat16).name == "dense"
    if "avx2" in native.supported_isas():
        monkeypatch.setattr(native, "selected_isa", lambda: "avx2")
        assert default_linear_method("cpu", torch.float32, max_num_seqs=256).name == "onednn"
        monkeypatch.undo()
        monkeypatch.delenv(LINEAR_METHOD_ENV_VAR, raising=False)
    # an engine whose decode steps hold at most 4 sequences streams the weight through the kernel
    if native.unavailable_reason() is None:
        assert default_linear_method("cpu", torch.float32, max_num_seqs=1).name == "kernel"
        assert default_linear_method("cpu", torch.bfloat16, max_num_seqs=4).name == "kernel"
    assert default_linear_method("cuda", torch.float32, max_num_seqs=1).name == "dense"
    monkeypatch.setenv(LINEAR_METHOD_ENV_VAR, "dense")
    assert default_linear_method("cpu", torch.float32).name == "dense"
    monkeypatch.setenv(LINEAR_METHOD_ENV_VAR, "kernel")
    assert default_linear_method("cpu", torch.float32).name == "kernel"
    monkeypatch.setenv(LINEAR_METHOD_ENV_VAR, "fastest")
    with pytest.raises(ValueError, match="'fastest'"):
        default_linear_method("cpu", torch.float32)
