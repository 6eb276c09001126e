"""`pagedllm bench lora` on a tiny model and inputs (no timing claim: the run's shape and its checks);
its llama-server side where the binary is built, skipped otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.bench import lora

pytest.importorskip("peft")

LLAMA_CPP = Path("/work/peers/D/llama_cpp_python-0.3.36/vendor/llama.cpp")
TINY = ["--num-requests", "6", "--num-adapters", "2", "--input-len", "12", "--output-len", "4"]


def test_requests_spread_over_the_adapters_and_the_base():
    assert lora.request_loras(7, 2) == [0, 1, None, 0, 1, None, 0]


def test_a_tiny_run_prints_both_systems_and_each_adapters_bytes_once(tiny_llama_dir, capsys):
    argv = ["--model", str(tiny_llama_dir), "--kv-cache-memory", "8MiB", *TINY, "--rank", "4"]
    assert lora.main([*argv, "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    runs = {r["system"]: r for r in found["runs"]}
    assert list(runs) == ["pagedllm, 2 adapters + base", "pagedllm, base"]
    assert all(r["output_tokens"] == 6 * 4 and r["output_tok_s"] > 0 for r in runs.values())
    # tiny Llama: hidden 64, q/o 64 -> 64, k/v 64 -> 32 over 2 layers; rank 4, A [4, in] and B [out, 4]
    per_layer = 4 * 64 * 4 + 4 * (64 + 32 + 32 + 64)
    assert found["adapter_bytes"] == {"adapter-0": 2 * per_layer * 4, "adapter-1": 2 * per_layer * 4}
    assert lora.main(argv) == 0
    table = capsys.readouterr().out
    assert "pagedllm, 2 adapters + base / base: output tok/s" in table and "adapter memory" in table


def test_bad_flags_are_refused_naming_the_value(tiny_llama_dir, tmp_path):
    with pytest.raises(SystemExit):
        lora.main(["--model", str(tiny_llama_dir), "--num-adapters", "0"])
    with pytest.raises(SystemExit):
        lora.main(["--llama-server", str(tmp_path / "missing")])


def test_the_llama_server_body_names_each_adapters_scale():
    body = lora.llama_server_body([1, 2], 4, 1, 3)
    assert body["lora"] == [{"id": 0, "scale": 0.0}, {"id": 1, "scale": 1.0}, {"id": 2, "scale": 0.0}]
    assert all(a["scale"] == 0.0 for a in lora.llama_server_body([1], 4, None, 2)["lora"])


@pytest.mark.skipif(not (LLAMA_CPP / "build/bin/llama-server").is_file(), reason="llama-server is not built")
def test_the_llama_server_peer_on_the_built_in_model(capsys):
    argv = ["--llama-server", str(LLAMA_CPP / "build/bin/llama-server"), *TINY, "--json"]
    assert lora.main(["--model", "smollm2-135m", "--kv-cache-memory", "16MiB", *argv]) == 0
    runs = {r["system"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    assert runs["llama-server, adapters"]["output_tokens"] == 6 * 4
    assert runs["llama-server, base"]["output_tokens"] == 6 * 4
