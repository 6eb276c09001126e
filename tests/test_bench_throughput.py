"""`pagedllm bench throughput` runs every layout on the real model and reports comparable rows."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import assert_all_blocks_free

from pagedllm.bench import throughput
from pagedllm.engine.op_profile import weight_kind
from pagedllm.models.linear import Linear
from pagedllm.workload import make_prompts


def test_throughput_bench_json(capsys):
    argv = [
        "--num-prompts",
        "4",
        "--input-len",
        "5-40",
        "--output-len",
        "6",
        "--kv-cache-memory",
        "4MiB",
        "--block-size",
        "16",
        "--max-model-len",
        "64",
        "--layouts",
        "paged",
        "contiguous-max",
        "--json",
    ]
    assert throughput.main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    prompts = make_prompts([(5, 40)] * 4, 49152, seed=0)  # the default seed, SmolLM2's vocabulary
    assert report["workload"] == {
        "num_prompts": 4,
        "prompt_tokens": sum(len(p) for p in prompts),
        "output_tokens": 4 * 6,
    }
    rows = {r["system"]: r for r in report["rows"]}
    assert set(rows) == {"paged", "contiguous-max"}
    for row in rows.values():
        assert row["output_tokens"] == 4 * 6
        assert 0 < row["live_fraction"] <= 1
        assert row["same_tokens_as_paged"] == 1.0  # same greedy tokens whatever the KV layout
        assert row["preemptions"] == 0
    # 4 MiB of SmolLM2's float16 KV holds ~180 tokens: two 64-slot slabs, but all four short paged requests
    # (in blocks of 16 tokens: of 32, the 5 blocks hold two).
    assert rows["contiguous-max"]["max_batch"] == 2
    assert rows["paged"]["max_batch"] == 4


def test_throughput_table_prints_the_workload_and_dashes_for_unreported_values(capsys):
    assert throughput.main(["--num-prompts", "2", "--input-len", "4-9", "--output-len", "3",
                            "--kv-cache-memory", "4MiB", "--max-model-len", "32", "--layouts", "paged",
                            "--watermark", "0", "0.2"]) == 0  # fmt: skip
    lines = capsys.readouterr().out.splitlines()
    prompt_tokens = sum(len(p) for p in make_prompts([(4, 9)] * 2, 49152, seed=0))
    assert lines[0].startswith(f"workload: 2 prompts of 4-9 random tokens, {prompt_tokens} prompt tokens")
    assert "3 output tokens each = 6;" in lines[0] and "watermark 0 / 0.2" in lines[0]
    sweep = [line.split() for line in lines[2:6:2]]  # each row, then what ran
    assert [cells[:2] for cells in sweep] == [["paged", "w=0"], ["paged", "w=0.2"]]
    assert all(cells[3] == "6" for cells in sweep)  # output tokens
    assert all(cells[-4] == "100%" for cells in sweep)  # both watermarks, the same greedy tokens
    assert all(cells[-1] == "-" for cells in sweep)  # one process: no collectives
    for ran in lines[3:7:2]:
        assert ran.startswith("  ran: attention ") and ran.endswith(" threads") and "; linear " in ran
    assert lines[6].startswith("paged w=0 / paged w=0.2: ")
    row = throughput.Row("hf batch 2", 1.0, 6, 6.0, None, None, None, None, None)
    assert throughput.format_row(row).split()[-6:] == ["-"] * 6


def test_tensor_parallel_rows_report_each_rank_s_collectives(capsys):
    argv = ["--num-prompts", "3", "--input-len", "4-20", "--output-len", "4", "--kv-cache-memory",
            "4MiB", "--max-model-len", "32", "--layouts", "paged", "--tensor-parallel-size", "1", "2",
            "--json"]  # fmt: skip
    assert throughput.main(argv) == 0
    one, two = json.loads(capsys.readouterr().out)["rows"]
    assert (one["system"], two["system"]) == ("paged tp=1", "paged tp=2")
    assert two["same_tokens_as_paged"] == 1.0
    assert (one["max_batch"], one["preemptions"]) == (two["max_batch"], two["preemptions"])  # same KV blocks
    assert one["comm_ms_per_step"] is None and len(two["comm_ms_per_step"]) == 2
    assert all(ms > 0 for ms in two["comm_ms_per_step"])
    # Rank 0 per step: the step's header and payload, the embedding's all-reduce, two per layer (o_proj,
    # down_proj) over SmolLM2's 30 layers, and the logits' gather.
    assert two["collectives_per_step"] == 2 + 1 + 2 * 30 + 1


def linear_op(engine) -> str:
    """The operator the engine's linear layers run with their method, found by profiling one layer
    alone: the op with the most self CPU time."""
    from torch.profiler import ProfilerActivity, profile

    layer = next(m for m in engine.model.modules() if isinstance(m, Linear))
    with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU]) as prof:
        layer(torch.randn(3, layer.in_features))
    return max(prof.key_averages(), key=lambda e: e.self_cpu_time_total).key


def test_profile_reports_phases_gemm_floor_and_top_ops(capsys, smollm2_llm):
    assert throughput.main(["--num-prompts", "3", "--input-len", "4-20", "--output-len", "6",
                            "--kv-cache-memory", "8MiB", "--max-model-len", "64", "--layouts", "paged",
                            "--profile"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    profile = out[out.index("profile (paged):") :].splitlines()
    assert profile[1].startswith("  steps with a prefill: 1 steps")
    assert profile[2].startswith("  decode-only steps: 5 steps")
    for line in profile[1:3]:  # every phase's share of the steps, and host work = all but the forward
        shares = {name: float(value) for name, value in re.findall(r"(\w+) ([\d.]+)%", line)}
        assert list(shares)[:5] == ["schedule", "inputs", "forward", "sample", "rest"]
        assert sum(list(shares.values())[:5]) == pytest.approx(100, abs=0.5)
        assert shares["work"] == pytest.approx(100 - shares["forward"], abs=0.2)
    assert profile[3].startswith("  decode step at batch ~3: median") and "step / GEMMs = " in profile[3]
    assert "prefill: " in profile[4] and "whole run: " in profile[5]
    assert profile[6] == "  top ops over the profiled decode steps (self CPU time):"
    ops = [line.split() for line in profile[7:15]]
    assert len(ops) == 8 and all(cells[-1] == "ms/step" for cells in ops)
    # The bench's float weights, as the fixture loads them: the op its linear method runs is a top op.
    assert linear_op(smollm2_llm.engine) in [cells[0] for cells in ops]
    rate, share, read = re.search(
        r"read ([\d.]+) GB/s of K/V, (\d+)% of the ([\d.]+) GB/s", profile[15]
    ).groups()
    rate, read = float(rate), float(read)
    assert rate > 0 and read > 0
    # The share comes from the unrounded rates: within what the printed (0.1-rounded) ones allow.
    assert (
        100 * (rate - 0.05) / (read + 0.05) - 0.5 <= int(share) <= 100 * (rate + 0.05) / (read - 0.05) + 0.5
    )
    # Then the profiled decode steps op by op, at the workload's batch (tests/test_op_profile.py checks
    # the numbers), against the rates this process measured: the same read rate as the K/V line's.
    assert profile[16].startswith("  3 decode steps profiled at batch 3: ")
    layer = next(m for m in smollm2_llm.engine.model.modules() if isinstance(m, Linear))
    assert profile[18].startswith(f"    matmul {weight_kind(layer)} (121 layers)")  # (oneDNN) on AVX2
    assert profile[-2].startswith(f"  this process measures: memory read {read:.1f} GB/s")
    assert " of the float32 GEMM rate" in profile[-1]


def test_profiled_attention_bytes_are_every_layers_context_of_each_step():
    """K/V bytes the profiled decode steps' attention reads: per step, each sequence's prompt plus the
    tokens generated so far (the prefill's token and the step that finishes it: 2 before the first), for K
    and V of every layer (SmolLM2: 30 layers, 3 KV heads of 64, float16: the CPU's default)."""
    from pagedllm import LLM
    from pagedllm.bench.profile import kv_bytes_read, profile_decode

    llm = LLM("smollm2-135m", kv_cache_memory="8MiB", max_model_len=64)
    prompts = make_prompts([(4, 20)] * 3, 49152, seed=1)
    profiled = profile_decode(llm.engine, prompts, decode_steps=3)
    contexts = sum(len(p) + step for p in prompts for step in (2, 3, 4))
    assert kv_bytes_read(llm.engine, profiled) == contexts * 2 * 30 * 3 * 64 * 2
    assert profiled.attention_seconds > 0
    assert_all_blocks_free(llm)


def test_gemm_floor_counts_every_linear_layer_once():
    from pagedllm.bench.profile import gemm_floor, linear_layers
    from pagedllm.engine.model_cache import load_shared_model
    from pagedllm.models import DEFAULT_MODEL

    model = load_shared_model(DEFAULT_MODEL, torch.float32, "cpu").model
    layers = linear_layers(model)
    assert len(layers) == 4 * model.config.num_layers + 1 and layers[-1] is model.lm_head
    floor = gemm_floor(model, rows=2, head_rows=1, dtype=torch.float32, reps=1)
    params = sum(m.in_features * m.out_features for m in layers[:-1])
    assert floor.flops == 2 * 2 * params + 2 * 1 * 576 * 49152
    assert floor.seconds > 0 and floor.hot_seconds > 0


def test_shared_prefix_workload_compares_prefix_caching_on_and_off(capsys):
    argv = ["--num-prompts", "8", "--input-len", "5-20", "--output-len", "4", "--shared-prefix-len", "64"]
    assert throughput.main([*argv, "--kv-cache-memory", "16MiB", "--max-model-len", "128", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["system"]: r for r in out["rows"]}
    assert list(rows) == ["paged", "paged-no-prefix-cache"]
    prompts = make_prompts([(5, 20)] * 8, 49152, 0, shared_prefix_len=64)
    assert all(p[:64] == prompts[0][:64] for p in prompts)
    # Admitted in one step, the first prompt computes the four prefix blocks the seven others reuse.
    assert rows["paged"]["prefix_hit_rate"] == 7 * 64 / sum(len(p) for p in prompts)
    assert rows["paged-no-prefix-cache"]["prefix_hit_rate"] is None
    assert rows["paged-no-prefix-cache"]["same_tokens_as_paged"] == 1.0
    assert all(r["mean_ttft_s"] > 0 for r in rows.values())


def test_differences_from_a_peer_report_the_top2_margin_at_the_first_differing_token(
    hf_smollm2, int16_activations
):
    """A peer whose tokens differ at step 3 of one request: the reported margin is the gap between the
    two best next-token logits there, which HF transformers' forward gives independently (of the blocks'
    exact path: the default's x per 256 moves this margin by ~0.004)."""
    from argparse import Namespace

    prompts = make_prompts([(5, 12)] * 2, 49152, seed=3)
    args = Namespace(model="smollm2-135m", dtype="auto", kv_cache_memory="16MiB", max_model_len=64)
    from pagedllm import LLM, SamplingParams

    llm = LLM("smollm2-135m", kv_cache_memory="16MiB", max_model_len=64)
    ours = [
        o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    ]
    theirs = [list(ours[0]), list(ours[1])]
    theirs[1][3] = (theirs[1][3] + 1) % 49152
    line = throughput.explain_differences(args, "peer", prompts, ours, theirs)
    assert line.startswith("peer: 1 of 2 requests differ from paged; at the first differing token")
    with torch.inference_mode():
        logits = hf_smollm2(torch.tensor([prompts[1] + ours[1][:3]])).logits[0, -1]
    best, second = logits.topk(2).values.tolist()
    reported = float(line.rsplit("largest margin ", 1)[1])
    assert reported == pytest.approx(best - second, abs=2e-3)
    assert (" 0 are fp32 near-ties" in line) == (best - second >= throughput.NEAR_TIE)


def test_a_bfloat16_comparison_reports_each_systems_agreement_with_float32_tokens():
    """Tokens before the first difference from pagedllm's float32 greedy tokens, per system: a system
    identical to a float32 run made here scores every token, a peer changed at step 2 of one request two."""
    from argparse import Namespace

    from pagedllm import LLM, SamplingParams

    prompts = make_prompts([(5, 12)] * 2, 49152, seed=3)
    args = Namespace(
        model="smollm2-135m",
        dtype="bfloat16",
        kv_cache_memory="16MiB",
        max_model_len=64,
        output_len=6,
    )
    llm = LLM("smollm2-135m", dtype="float32", kv_cache_memory="16MiB", max_model_len=64)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    float32 = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)]
    assert_all_blocks_free(llm)
    peer = [list(float32[0]), list(float32[1])]
    peer[1][2] = (peer[1][2] + 1) % 49152
    line = throughput.agreement_with_float32(args, prompts, {"paged": float32, "peer": peer}, "auto")
    assert line == (
        "against pagedllm's float32 greedy tokens (bfloat16): paged 2 of 2 requests identical, 6.0 tokens "
        "before any difference; peer 1 of 2 requests identical, 4.0 tokens before any difference"
    )
    args.dtype = "auto"  # float32 weights over a bfloat16 cache
    line = throughput.agreement_with_float32(args, prompts, {"paged": float32}, "bfloat16")
    assert line.startswith(
        "against pagedllm's float32 greedy tokens (float32 weights, bfloat16 KV): paged 2 of 2"
    )


def test_the_precision_label_names_the_stored_dtypes():
    """Names resolved to what the engine stores: aliases of one dtype are one dtype, fp8 is e4m3 codes."""
    assert throughput.precision("auto", "auto") == "float32 weights, float16 KV"  # the CPU's default cache
    assert throughput.precision("float32", "float32") == "float32"
    assert throughput.precision("bf16", "bfloat16") == "bfloat16"
    assert throughput.precision("auto", "bfloat16") == "float32 weights, bfloat16 KV"
    assert throughput.precision("auto", "int8") == "float32 weights, int8 KV"
    assert throughput.precision("bfloat16", "fp8") == "bfloat16 weights, fp8 e4m3 KV"
    assert throughput.precision("auto", "fp8_e4m3") == "float32 weights, fp8 e4m3 KV"


def test_kv_cache_dtypes_run_side_by_side_at_the_same_kv_memory(capsys):
    """3 MiB of SmolLM2 KV (30 layers, 3 KV heads of 64, each dtype's default block): 4 float32 blocks of
    16 tokens, 4 int8 ones of 64 (codes and a float32 scale per token and head): 256 tokens against 64. A
    request (at most 46 tokens) takes one int8 block, and the watermark (1% of the blocks) keeps the last
    one from a new admission: 3 requests at once, float32 fewer."""
    argv = ["--num-prompts", "4", "--input-len", "20-40", "--output-len", "6", "--kv-cache-memory", "3MiB",
            "--max-model-len", "64", "--layouts", "paged", "--kv-cache-dtype", "float32", "int8"]  # fmt: skip
    assert throughput.main([*argv, "--json"]) == 0
    rows = {r["system"]: r for r in json.loads(capsys.readouterr().out)["rows"]}
    float32, int8 = rows["paged float32 KV"], rows["paged int8 KV"]
    assert float32["kv_blocks"] == 3 * 2**20 // (2 * 30 * 16 * 3 * 64 * 4) == 4
    assert int8["kv_blocks"] == 3 * 2**20 // (2 * 30 * 64 * 3 * (64 + 4)) == 4
    assert float32["max_batch"] < int8["max_batch"] == 3
    assert float32["same_tokens_as_paged"] == 1.0 and int8["output_tokens"] == 4 * 6
    assert throughput.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "KV cache dtype float32 / int8" in lines[0]
    share = int8["same_tokens_as_paged"] * 4
    assert (
        f"against paged float32 KV's greedy tokens: paged int8 KV {share:.0f} of 4 requests identical"
        in lines[-1]
    )


def test_hf_rows_read_a_gguf_models_float_copy(tmp_path, monkeypatch):
    """`--hf` on a GGUF model: transformers gets the converted folder with its float32 copy of the weights
    (the folder alone holds none) and generates what the checkpoint written to the GGUF generates."""
    from argparse import Namespace

    from models_helpers import TINY, hf_greedy, write_gguf
    from transformers import AutoModelForCausalLM, LlamaConfig

    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32).eval()
    write_gguf(hf, tmp_path / "tiny.gguf")
    prompts = make_prompts([(3, 9)] * 3, TINY["vocab_size"], seed=1)
    args = Namespace(model=str(tmp_path / "tiny.gguf"), dtype="auto", hf_batch_size=2, output_len=5)
    row, tokens = throughput.run_hf(args, prompts)
    assert row.output_tokens == 15
    assert row.ran.startswith("transformers ") and "own process; removed" in row.ran
    assert tokens == hf_greedy(hf, prompts[:2], 5) + hf_greedy(hf, prompts[2:], 5)
