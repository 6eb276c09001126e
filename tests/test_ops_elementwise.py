"""The fused elementwise kernels (rms_norm, act_and_mul, rotary_embedding_) against the torch reference,
on the C++ build for every instruction set this CPU runs; and the public ops' dispatch."""

import pytest
import torch

from pagedllm import ops
from pagedllm.ops import cpu, native, reference

ISAS = native.supported_isas()
DTYPES = [torch.float32, torch.bfloat16]
# 8 and 24 leave a partial SIMD chunk for both builds; 576 and 640 are SmolLM2's and Gemma 3's hidden sizes.
DIMS = [8, 24, 64, 576, 640]


def _tolerance(dtype: torch.dtype) -> dict:
    return {"atol": 2e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("unit_offset", [False, True], ids=["llama", "gemma"])
def test_rms_norm_matches_reference(kernels, dtype, dim, unit_offset):
    gen = torch.Generator().manual_seed(dim)
    x = (torch.randn(7, dim, generator=gen) * 3).to(dtype)
    weight = torch.randn(dim, generator=gen).to(dtype)
    out = cpu.rms_norm(x, weight, 1e-6, unit_offset)
    torch.testing.assert_close(out, reference.rms_norm(x, weight, 1e-6, unit_offset), **_tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_of_strided_heads(kernels, dtype):
    """Gemma's QK-norm normalises the q heads of a fused projection: a [T, H, D] view with a row gap."""
    fused = torch.randn(5, 7, 24).to(dtype)
    heads = fused[:, 1:4]
    assert not heads.is_contiguous()
    weight = torch.randn(24).to(dtype)
    out = cpu.rms_norm(heads, weight, 1e-6, True)
    torch.testing.assert_close(
        out, reference.rms_norm(heads.contiguous(), weight, 1e-6, True), **_tolerance(dtype)
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", DIMS)
@pytest.mark.parametrize("activation", ["silu", "gelu_pytorch_tanh"])
def test_act_and_mul_matches_reference(kernels, dtype, dim, activation):
    gen = torch.Generator().manual_seed(dim)
    x = (torch.randn(6, 2 * dim, generator=gen) * 4).to(dtype)  # wide enough to reach both tails
    out = cpu.act_and_mul(x, activation)
    torch.testing.assert_close(out, reference.act_and_mul(x, activation), **_tolerance(dtype))


def _cos_sin(head_dim: int, positions: int) -> torch.Tensor:
    inv_freq = 1.0 / (1e4 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    angles = torch.arange(positions).float()[:, None] * inv_freq[None]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [16, 40, 64, 256])
def test_rotary_embedding_rotates_q_and_k_heads_in_place(kernels, dtype, head_dim):
    gen = torch.Generator().manual_seed(head_dim)
    qkv = torch.randn(9, 6 * head_dim, generator=gen).to(dtype)  # [T, (H + 2 Hkv) D], H = 3, Hkv = 1.5
    positions = torch.randint(0, 100, (9,), generator=gen)
    cos_sin = _cos_sin(head_dim, 100)
    ours, theirs = qkv.clone(), qkv.clone()
    cpu.rotary_embedding_(ours[:, : 4 * head_dim].view(9, 4, head_dim), positions, cos_sin)
    reference.rotary_embedding_(theirs[:, : 4 * head_dim].view(9, 4, head_dim), positions, cos_sin)
    if dtype == torch.float32:
        assert torch.equal(ours, theirs)  # same products, same roundings
    torch.testing.assert_close(ours, theirs, **_tolerance(dtype))
    assert torch.equal(ours[:, 4 * head_dim :], qkv[:, 4 * head_dim :])  # v untouched


def test_rotary_embedding_rejects_a_position_past_its_table(kernels):
    x = torch.randn(2, 1, 16)
    with pytest.raises(RuntimeError, match="position 100 of token 1"):
        cpu.rotary_embedding_(x, torch.tensor([3, 100]), _cos_sin(16, 100))


@pytest.mark.parametrize("backend", ["torch", "sdpa", "cpu"])
def test_public_ops_dispatch_by_backend(monkeypatch, backend):
    """The cpu backend runs the C++ kernels; backends without elementwise kernels use the reference."""
    if backend == "cpu" and native.unavailable_reason() is not None:
        pytest.skip(native.unavailable_reason())
    monkeypatch.setenv(ops.ENV_VAR, backend)
    ops.reset_backend_cache()
    try:
        x = torch.randn(3, 16)
        expected = cpu if backend == "cpu" else reference
        for name in ("rms_norm", "act_and_mul", "rotary_embedding_"):
            assert getattr(ops.get_backend(x.device, x.dtype), name) is getattr(expected, name)
        torch.testing.assert_close(ops.rms_norm(x, x[0], 1e-6), reference.rms_norm(x, x[0], 1e-6))
    finally:
        ops.reset_backend_cache()


@pytest.mark.parametrize("cols", [1, 7, 16, 100, 49152])
def test_argmax_is_torchs_on_every_row(kernels, cols):
    """Random rows, ties (the first index wins), -inf, +inf and NaN (the first NaN wins, as in torch), rows
    of a strided view; every row's answer equals torch.argmax's."""
    gen = torch.Generator().manual_seed(cols)
    x = torch.randn(12, cols + 3, generator=gen)[:, 1 : cols + 1]  # rows ld = cols + 3 apart
    last = cols - 1
    x[1] = x[1].max()  # every value tied
    x[2, last] = x[2].max() + 1  # the max in the tail (past the last whole vector)
    x[3, :] = float("-inf")
    x[4, last] = float("inf")
    x[5, last // 2] = float("nan")
    x[6, last] = float("nan")
    x[7, 0] = float("inf")
    x[7, last] = float("nan")
    x[8, cols // 3] = x[8, last] = x[8].max() + 1  # two equal maxima: the first
    x[9] = float("nan")
    assert torch.equal(cpu.argmax(x), x.argmax(dim=-1))
    assert torch.equal(ops.argmax(x), x.argmax(dim=-1))


def test_argmax_of_other_dtypes_and_shapes_is_torchs(kernels):
    x = torch.randn(3, 50)
    for y in (x.to(torch.bfloat16), x[:, ::2], x[0]):
        assert torch.equal(cpu.argmax(y), y.argmax(dim=-1))
