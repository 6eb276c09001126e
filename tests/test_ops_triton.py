"""Triton kernels: the backend tests rerun under Triton's CPU interpreter, and an sm_90 (H200) compile."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"  # kernels are then interpreted, not compilable


@pytest.mark.skipif(INTERPRETING, reason="already inside the interpreter run")
def test_triton_backend_matches_reference_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
           "-W", "ignore::DeprecationWarning", str(ROOT / "tests" / "test_ops_backends.py")]  # fmt: skip
    result = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    # Every test that passed ran on the triton backend (whose fixture also checks that a kernel launched).
    passed = re.findall(r"^PASSED (\S+)", result.stdout, flags=re.MULTILINE)
    assert len(passed) >= 21 and all("[triton" in test_id for test_id in passed), result.stdout[-3000:]
    assert not re.search(r"\d+ (skipped|deselected|error)", result.stdout), result.stdout[-2000:]


def _compile_sm90(fn, pointer_types: dict[str, str], constexprs: dict):
    """Compile fn for an H200 (sm_90) without a GPU; ints are i32 unless named as i64."""
    signature = {}
    for name in fn.arg_names:
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = pointer_types[name]
        else:
            signature[name] = pointer_types.get(name, "i32")
    return triton.compile(ASTSource(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))


@pytest.mark.skipif(INTERPRETING, reason="TRITON_INTERPRET=1 replaces kernels with interpreted functions")
@pytest.mark.parametrize(
    ("dtype", "group", "head_dim", "block_size", "block_q", "form"),
    [
        ("fp32", 3, 64, 16, 1, 0),  # SmolLM2 decode
        ("bf16", 3, 64, 16, 16, 0),  # SmolLM2 prefill
        ("bf16", 4, 256, 16, 1, 0),  # Gemma3 decode, MQA d256
        ("bf16", 4, 256, 1, 16, 0),  # Gemma3 prefill, contiguous layout (block size 1)
        ("bf16", 3, 64, 16, 1, 1),  # an int8 cache: decode ...
        ("bf16", 3, 64, 16, 16, 1),  # ... and prefill
        ("fp32", 3, 64, 16, 1, 2),  # an fp8 e4m3 cache
        ("bf16", 4, 256, 16, 16, 2),
    ],
)
def test_attention_kernel_compiles_for_sm90(dtype, group, head_dim, block_size, block_q, form):
    from pagedllm.ops import triton_ops

    data = {name: f"*{dtype}" for name in ("out_ptr", "q_ptr", "k_cache_ptr", "v_cache_ptr")}
    stand_ins = ("k_scale_ptr", "v_scale_ptr", "k_mean_ptr", "k_factor_ptr")
    data.update({name: f"*{dtype}" for name in stand_ins})
    if form:  # a quantized cache: its bytes, its float32 scales and key smoothing factor
        data.update(
            k_cache_ptr="*u8",
            v_cache_ptr="*u8",
            k_scale_ptr="*fp32",
            v_scale_ptr="*fp32",
            k_mean_ptr="*fp32",
            k_factor_ptr="*fp32",
        )
    index = {
        name: "*i32"
        for name in ("block_tables_ptr", "query_start_loc_ptr", "tile_starts_ptr", "context_lens_ptr")
    }
    constexprs = dict(
        GROUP=group, BLOCK_SIZE=block_size, HEAD_DIM=head_dim, BLOCK_Q=block_q,
        GROUP_PAD=max(triton.next_power_of_2(group), 16 // block_q), BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=triton_ops._BLOCK_N, PRECISION="ieee" if dtype == "fp32" else "tf32", WIDEN=False, FORM=form,
    )  # fmt: skip
    types = {**data, **index, "scale": "fp32", "softcap": "fp32", "stride_kb": "i64"}  # the rest: i32
    compiled = _compile_sm90(triton_ops._paged_attention_kernel, types, constexprs)
    assert len(compiled.asm["cubin"]) > 0
    assert ".target sm_90" in compiled.asm["ptx"]


@pytest.mark.skipif(INTERPRETING, reason="TRITON_INTERPRET=1 replaces kernels with interpreted functions")
@pytest.mark.parametrize(("dtype", "form"), [("fp32", 0), ("bf16", 0), ("fp32", 1), ("fp32", 2)])
def test_write_kv_kernel_compiles_for_sm90(dtype, form):
    from pagedllm.ops import triton_ops

    # quantized: bytes, scales and the key smoothing (float32); else stand-ins of the cache's type
    cache, scales = ("*u8", "*fp32") if form else (f"*{dtype}", f"*{dtype}")
    types = {"key_ptr": f"*{dtype}", "value_ptr": f"*{dtype}", "k_cache_ptr": cache, "v_cache_ptr": cache,
             "k_scale_ptr": scales, "v_scale_ptr": scales, "k_mean_ptr": scales, "k_factor_ptr": scales,
             "slot_ptr": "*i64", "largest": "fp32"}  # fmt: skip
    constexprs = {"BLOCK_SIZE": 16, "HEADS": 3, "HEAD_DIM": 64, "BLOCK_H": 4, "BLOCK_D": 64, "FORM": form}
    compiled = _compile_sm90(triton_ops._write_kv_kernel, types, constexprs)
    assert len(compiled.asm["cubin"]) > 0
