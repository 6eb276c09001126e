"""Backend choice: automatic per device, forced by PAGEDLLM_ATTN_BACKEND, and the sdpa fallback."""

import dataclasses
import importlib.util
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from oracles import dense_batch_attention

from pagedllm import ops
from pagedllm.ops import cpu, native, reference
from pagedllm.ops.synthetic import random_paged_batch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def fresh_choice(monkeypatch):
    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    ops.reset_backend_cache()
    yield
    ops.reset_backend_cache()


def _check_public_ops_match_dense_attention():
    b = random_paged_batch([19, 40], [3, 1], 6, 2, 16, 8)
    torch.testing.assert_close(ops.paged_attention(b.q, b.args(0.25)), dense_batch_attention(b, 0.25))
    d = random_paged_batch([19, 40], [1, 1], 6, 2, 16, 8)
    decode = d.args(0.25, window=8, decode=True)
    torch.testing.assert_close(ops.paged_attention(d.q, decode), dense_batch_attention(d, 0.25, window=8))


def test_cpu_tensors_use_the_cpp_kernel_by_default():
    assert native.unavailable_reason() is None, native.unavailable_reason()
    assert ops.get_backend_name("cpu") == ops.get_backend_name(torch.device("cpu")) == "cpu"
    _check_public_ops_match_dense_attention()


@pytest.mark.parametrize("name", ["torch", "sdpa", "cpu"])
def test_env_var_forces_backend(monkeypatch, name):
    monkeypatch.setenv(ops.ENV_VAR, name.upper())
    assert ops.get_backend_name("cpu") == name
    _check_public_ops_match_dense_attention()


def test_unknown_backend_is_rejected_by_name(monkeypatch):
    monkeypatch.setenv(ops.ENV_VAR, "flash")
    with pytest.raises(ValueError, match="'flash'"):
        ops.get_backend_name("cpu")


def test_cpu_backend_cannot_serve_cuda_tensors(monkeypatch):
    monkeypatch.setenv(ops.ENV_VAR, "cpu")
    with pytest.raises(ValueError, match="cuda"):
        ops.get_backend_name("cuda")


def test_unbuildable_kernel_falls_back_to_sdpa_with_one_warning(monkeypatch, caplog):
    monkeypatch.setenv(ops.ENV_VAR, "cpu")
    monkeypatch.setattr(native, "unavailable_reason", lambda: "no compiler")
    with caplog.at_level(logging.WARNING):
        assert ops.get_backend_name("cpu") == "sdpa"
        _check_public_ops_match_dense_attention()
        caches = torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)
        ops.write_kv(torch.ones(1, 2, 16), torch.ones(1, 2, 16), *caches, torch.tensor([5]))
        assert caches[0].view(8, 2, 16)[5].eq(1).all()
    assert [r.getMessage() for r in caplog.records] == [
        "pagedllm: C++ paged attention unavailable (no compiler); using the sdpa fallback"
    ]


def test_missing_compiler_falls_back_in_a_fresh_process(tmp_path):
    """A real failed build (CXX is not a compiler) in a clean extensions dir: one warning line, sdpa."""
    code = "from pagedllm import ops; print(ops.get_backend_name('cpu')); print(ops.get_backend_name('cpu'))"
    env = {**os.environ, "CXX": "/bin/false", "TORCH_EXTENSIONS_DIR": str(tmp_path), "PYTHONPATH": str(ROOT)}
    env.pop(ops.ENV_VAR, None)
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["sdpa", "sdpa"]
    warnings = [line for line in result.stderr.splitlines() if "C++ paged attention unavailable" in line]
    assert len(warnings) == 1, result.stderr


def test_cpu_kernel_rejects_bad_inputs_by_name():
    b = random_paged_batch([20], [1], 4, 2, 16, 4)
    with pytest.raises(RuntimeError, match="context length 99"):
        cpu.paged_attention(
            b.q, b.args(0.25, decode=True, context_lens=torch.tensor([99], dtype=torch.int32))
        )
    bad_table = b.block_tables.clone()
    bad_table[0, 0] = 1000
    with pytest.raises(RuntimeError, match="block id 1000 of sequence 0 is out of range"):
        cpu.paged_attention(b.q, b.args(0.25, decode=True, block_tables=bad_table))
    p = random_paged_batch([20, 9], [5, 9], 4, 2, 16, 4)
    bad_table = p.block_tables.clone()
    bad_table[1, 2] = -1  # the last block sequence 1 reads
    with pytest.raises(RuntimeError, match="block id -1 of sequence 1 is out of range"):
        cpu.paged_attention(p.q, p.args(0.25, block_tables=bad_table))
    with pytest.raises(RuntimeError, match="dtype"):
        cpu.paged_attention(b.q.bfloat16(), b.args(0.25, decode=True))
    with pytest.raises(RuntimeError, match="slot 80"):
        cpu.write_kv(b.q[:, :2], b.q[:, :2], b.k_cache, b.v_cache, torch.tensor([80]))


def test_fp16_on_cpu_uses_sdpa():
    """The C++ kernel covers fp32 and bf16; fp16 CPU tensors go to the pure PyTorch backend."""
    assert ops.get_backend_name("cpu", torch.float16) == "sdpa"
    assert ops.get_backend_name("cpu", torch.bfloat16) == ops.get_backend_name("cpu", torch.float32)


@pytest.mark.parametrize("touch", [True, False])
def test_cpu_kv_cache_is_head_major_behind_slot_major_views(touch):
    """Each layer's K/V view is [num_blocks, block_size, Hkv, D]; on the CPU one head's rows of a block
    are contiguous in memory, and the views start zero-filled and writable, touched at allocation or not."""
    (k, v), *_ = ops.allocate_kv_caches(2, 5, 16, 3, 64, torch.float32, "cpu", touch=touch)
    assert k.shape == v.shape == (5, 16, 3, 64)
    assert k.stride() == (3 * 16 * 64, 64, 16 * 64, 1)
    assert k.count_nonzero() == 0
    ops.write_kv(torch.ones(1, 3, 64), torch.ones(1, 3, 64), k, v, torch.tensor([17]))
    assert k[1, 1].eq(1).all() and k.count_nonzero() == 3 * 64


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux's /proc")
def test_an_untouched_cpu_kv_cache_commits_memory_only_where_written():
    """touch=True commits a cache's memory at allocation; touch=False commits the pages writes reach."""
    size = 256 * 2**20  # K and V x 2 layers x 16,384 blocks x 16 slots x 64 fp32 values
    before = _resident_bytes()
    caches = ops.allocate_kv_caches(2, 16384, 16, 1, 64, torch.float32, "cpu", touch=False)
    assert _resident_bytes() - before < size // 8
    ops.write_kv(torch.ones(1, 1, 64), torch.ones(1, 1, 64), *caches[0], torch.tensor([5]))
    assert _resident_bytes() - before < size // 8
    assert caches[0][0][0, 5].eq(1).all() and caches[1][1].count_nonzero() == 0
    del caches
    before = _resident_bytes()
    touched = ops.allocate_kv_caches(2, 16384, 16, 1, 64, torch.float32, "cpu")
    assert _resident_bytes() - before > size * 0.9
    del touched


def test_every_registered_backend_implements_the_interface():
    """The registry's backends (triton where Triton is installed) are each a Backend, named as registered."""
    names = [name for name in ops.BACKENDS if name != "triton" or importlib.util.find_spec("triton")]
    for name in names:
        backend = ops.backend(name)
        assert isinstance(backend, ops.Backend) and backend.name == name
    with pytest.raises(ValueError, match="'flash'"):
        ops.backend("flash")
    with pytest.raises(ValueError, match="'cpu' is already registered"):
        ops.register_backend("cpu", ops.BACKENDS["torch"])


def test_a_registered_backend_serves_the_public_ops(monkeypatch):
    """A new backend is one object and one registration: PAGEDLLM_ATTN_BACKEND then names it."""
    calls = []

    def counted(q, args):
        calls.append(q.shape[0])
        return reference.paged_attention(q, args)

    counting = dataclasses.replace(reference.BACKEND, name="counting", paged_attention=counted)
    ops.register_backend("counting", lambda: counting)
    monkeypatch.setenv(ops.ENV_VAR, "counting")
    try:
        _check_public_ops_match_dense_attention()
    finally:
        del ops.BACKENDS["counting"]
        ops.backend.cache_clear()
    assert calls == [4, 2]
