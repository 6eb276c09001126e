"""The engine's op profile (LLMEngine.profile_ops) and the `--profile` step breakdown built on it: matmul
time by weight kind, the bytes those kinds hold against the GGUF file's own tensors, and a printout whose
parts add up to the step."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch
from conftest import smollm2_gguf_path
from helpers import assert_all_blocks_free

from pagedllm.bench import latency
from pagedllm.bench.profile import MachineRates, profile_decode, step_breakdown
from pagedllm.engine.op_profile import linears_in_call_order, weight_kind
from pagedllm.models.linear import Linear, StoredWeight
from pagedllm.ops import native
from pagedllm.workload import make_prompts


@pytest.fixture(scope="module")
def gguf_llm():
    """SmolLM2 on its GGUF file's own blocks (Q4_1, the tied LM head Q8_0), as it ships."""
    from pagedllm import LLM

    return LLM("smollm2-135m", kv_cache_memory="16MiB", max_model_len=128)


def file_bytes_by_type() -> Counter:
    """Bytes of the GGUF file's 2-D tensors (every matrix a matmul reads) by block type, read with the
    gguf package: the independent oracle for what the matmuls of a forward pass read."""
    from gguf import GGUFReader

    totals: Counter = Counter()
    for tensor in GGUFReader(smollm2_gguf_path()).tensors:
        if len(tensor.shape) == 2:
            totals[tensor.tensor_type.name] += int(tensor.n_bytes)
    return totals


def test_matmuls_by_block_type_hold_the_files_bytes_and_every_call(gguf_llm):
    engine = gguf_llm.engine
    prompts = make_prompts([(4, 30)] * 3, engine.model.config.vocab_size, seed=2)
    ops = profile_decode(engine, prompts, decode_steps=3)
    assert [trace.decode_seqs for trace in ops.steps] == [3, 3, 3]
    assert all(trace.prefill_tokens == 0 for trace in ops.steps)
    kinds = {m.kind: m for m in ops.matmuls}
    assert {kind: m.weight_bytes for kind, m in kinds.items()} == dict(file_bytes_by_type())
    # 30 layers x (qkv, o, gate_up, down) in Q4_1, the LM head in Q8_0; each called once a step.
    assert (kinds["Q4_1"].layers, kinds["Q8_0"].layers) == (120, 1)
    assert all(m.calls == 3 * m.layers for m in ops.matmuls) and ops.unmatched_matmul_seconds == 0
    assert kinds["Q8_0"].flops_per_row == 2 * 576 * 49152
    assert ops.attention_calls == 3 * 30 and ops.attention_seconds > 0
    # The parts fit inside the steps that hold them.
    assert 0 < ops.matmul_seconds + ops.attention_seconds < ops.forward_seconds < ops.step_seconds
    assert_all_blocks_free(gguf_llm)


def test_weight_kinds_name_block_types_dtypes_and_multipliers():
    layer = Linear(8, 3)
    layer.stored = StoredWeight(torch.zeros(10, dtype=torch.uint8), torch.tensor([[2, 12], [1, 14]]))
    assert weight_kind(layer) == "Q4_K+Q6_K"  # a fused projection's shards of two types
    layer.stored = StoredWeight(torch.zeros(10, dtype=torch.uint8), torch.tensor([[2, 12], [1, 12]]))
    assert weight_kind(layer) == "Q4_K"
    dense = Linear(8, 3)
    assert weight_kind(dense) == "float32 (dense)"


@pytest.mark.skipif(
    not native.onednn_packs_bf16(), reason="oneDNN packs bf16 only on AVX-512 or AVX-NE-CONVERT CPUs"
)
def test_bfloat16_weights_through_onednn_are_one_kind_of_their_bytes():
    from pagedllm import LLM

    llm = LLM("smollm2-135m", dtype="bfloat16", quantization="none", kv_cache_memory="8MiB", max_model_len=64)
    engine = llm.engine
    layers = linears_in_call_order(engine.model)
    ops = profile_decode(engine, make_prompts([(4, 20)] * 2, 49152, seed=3), decode_steps=2)
    (kind,) = ops.matmuls
    assert kind.kind == "bfloat16 (oneDNN)" and kind.layers == len(layers) == 121
    # Each weight's bf16 values once (the tied head's plain copy for the embedding is not read by a matmul)
    assert kind.weight_bytes == sum(2 * m.in_features * m.out_features for m in layers)
    assert kind.calls == 2 * 121
    assert_all_blocks_free(llm)


def row(line: str) -> tuple[str, list[float]]:
    """A breakdown row: its name and numbers (ms/step, share %, then MiB/step, GB/s, GFLOP/s if any)."""
    name, *numbers = re.split(r"\s{2,}", line.strip())
    return name, [float(x.rstrip("%")) for x in numbers]


def test_breakdown_rows_add_up_to_the_step_and_the_read_ratio(gguf_llm):
    engine = gguf_llm.engine
    ops = profile_decode(engine, make_prompts([(4, 30)] * 2, 49152, seed=4), decode_steps=4)
    rates = MachineRates(read_gb_s=20.0, gemm_gflop_s={torch.float32: 100.0})
    lines = step_breakdown(ops, rates, torch.float32, unprofiled_step_s=0.05)
    assert lines[0].startswith("  4 decode steps profiled at batch 2: ") and "50.0 unprofiled" in lines[0]
    rows = dict(row(line) for line in lines[2:] if line.startswith("    "))
    step_ms = ops.step_seconds / 4 * 1e3
    parts = ["matmuls, all", "attention (30 calls a step)", "other ops of the forward pass"]
    parts.append("host: schedule, inputs, sample, rest")
    assert sum(rows[p][0] for p in parts) == pytest.approx(step_ms, abs=0.02)
    assert sum(rows[p][1] for p in parts) == pytest.approx(100, abs=0.3)
    kinds = [name for name in rows if name.startswith("matmul ")]
    assert sorted(kinds) == ["matmul Q4_1 (120 layers)", "matmul Q8_0 (1 layer)"]
    assert sum(rows[k][0] for k in kinds) == pytest.approx(rows["matmuls, all"][0], abs=0.02)
    mib = sum(file_bytes_by_type().values()) / 2**20
    assert sum(rows[k][2] for k in kinds) == pytest.approx(rows["matmuls, all"][2], abs=0.1)
    assert rows["matmuls, all"][2] == pytest.approx(mib, abs=0.05)
    # GB/s = the bytes read each step over the matmuls' time a step; the ratio is that over the read rate.
    gb_s = sum(file_bytes_by_type().values()) / (ops.matmul_seconds / 4) / 1e9
    assert rows["matmuls, all"][3] == pytest.approx(gb_s, abs=0.05)
    ratio = re.search(r"at ([\d.]+) GB/s = (\d+)% of the read rate", lines[-1])
    assert float(ratio[1]) == pytest.approx(gb_s, abs=0.05)
    assert int(ratio[2]) == round(100 * gb_s / 20.0)
    assert_all_blocks_free(gguf_llm)


def test_latency_profile_prints_the_decode_step_of_each_pagedllm_run(capsys):
    argv = ["--prompt-lens", "12", "--output-len", "4", "--quantization", "auto", "--profile"]
    assert latency.main(argv) == 0
    out = capsys.readouterr().out
    profile = out[out.index("profile (pagedllm gguf, after the 12-token prompt):") :].splitlines()
    assert profile[1].startswith(f"  {latency.PROFILED_STEPS} decode steps profiled at batch 1: ")
    assert any(line.startswith("    matmul Q4_1 (120 layers)") for line in profile)
    assert profile[-2].startswith("  this process measures: memory read ")
    assert " of the read rate, and compute " in profile[-1]
