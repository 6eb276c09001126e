"""llama-cpp-python's side of `pagedllm bench latency` and `bench speculative`, run as a child process:
`python llama_cpp_peer.py`. What it times is llama-cpp-python (llama.cpp's library driven by its Python
generate loop, one token per call), named so in every row; `--llama-bench` times llama.cpp's own C++
benchmark instead (bench/llama_bench.py).

A script run by path, so that it imports neither pagedllm (which defaults OMP_WAIT_POLICY=PASSIVE) nor
torch: llama.cpp's ggml links the same libgomp.so.1 that torch ships, and one process has one libgomp,
configured once. llama.cpp runs best with libgomp's default wait policy (passive waits halved its float32
decode speed here), pagedllm with passive threads; as a child each gets its own (bench/peers.py: what its
environment leaves out).

Reads one JSON job on stdin, writes one JSON result to the job's "result_path":
  {"mode": "quantize", "source": path, "target": path, "ftype": "F32"}    -> {"ok": true}
  {"mode": "generate", "model": path, "threads": n, "n_ctx": n, "prompts": [[ids]], "output_len": n,
   "flash_attn": bool, "cache_type": "f16"}
      -> [{"ttft_s": s, "token_times_s": [...], "tokens": [...]}, ...]   (times from the prompt's start)
  {"mode": "log_probs", "model": path, "threads": n, "ids": [ids], "output_path": path}
      -> {"ok": true}, the float32 log-probabilities of each next token ([len(ids) - 1, vocab]) saved
      with numpy.save at output_path, from one evaluation of all of ids (logits_all)
  optional in a generate job: "stop_ids": [ids] (a generated one ends the run, kept as its last token),
  "prompt_lookup": {"max_ngram_size": n, "num_pred_tokens": n} (llama-cpp-python's
  LlamaPromptLookupDecoding as the draft model: its prompt-lookup speculative decoding). "cache_type" is
  llama.cpp's name of the K/V type (f16, bf16, f32, q8_0: its --cache-type-k/-v); "flash_attn" its
  flash attention (llama-cpp-python turns it off unless asked; llama.cpp's own tools resolve their default,
  auto, to on for the CPU). Both default as llama-cpp-python's do: f16, off.
"""

from __future__ import annotations

import json
import sys
import time


def quantize(source: str, target: str, ftype: str) -> dict:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    name = f"LLAMA_FTYPE_ALL_{ftype}" if ftype == "F32" else f"LLAMA_FTYPE_MOSTLY_{ftype}"
    params.ftype = getattr(llama_cpp, name)
    params.allow_requantize = True
    status = llama_cpp.llama_model_quantize(source.encode(), target.encode(), params)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({source} -> {ftype}) failed with status {status}")
    return {"ok": True}


def generate(job: dict) -> list[dict]:
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    threads = job["threads"]
    lookup = job.get("prompt_lookup")
    stop_ids = set(job.get("stop_ids", ()))
    cache_type = getattr(llama_cpp, f"GGML_TYPE_{job.get('cache_type', 'f16').upper()}")
    llm = Llama(
        job["model"],
        n_ctx=job["n_ctx"],
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=2048,  # llama-bench's defaults
        n_ubatch=512,
        flash_attn=job.get("flash_attn", False),
        type_k=cache_type,
        type_v=cache_type,
        draft_model=LlamaPromptLookupDecoding(**lookup) if lookup else None,
        verbose=False,
    )
    results = []
    for i, prompt in enumerate([job["warmup"], *job["prompts"]]):
        llm.reset()
        start = time.perf_counter()
        times, tokens = [], []
        for token in llm.generate(prompt, temp=0.0, reset=True):  # temperature 0: greedy
            times.append(time.perf_counter() - start)
            tokens.append(int(token))
            if len(tokens) == job["output_len"] or tokens[-1] in stop_ids:
                break
        if i > 0:
            results.append({"ttft_s": times[0], "token_times_s": times, "tokens": tokens})
    return results


def log_probs(job: dict) -> dict:
    import numpy as np
    from llama_cpp import Llama

    ids, threads = job["ids"], job["threads"]
    llm = Llama(
        job["model"],
        n_ctx=len(ids),
        n_threads=threads,
        n_threads_batch=threads,
        n_batch=2048,
        n_ubatch=512,
        logits_all=True,
        verbose=False,
    )
    llm.eval(ids)
    logp = np.empty((len(ids) - 1, llm.n_vocab()), dtype=np.float32)
    for start in range(0, len(logp), 256):  # float64 a few rows at a time (a 150k vocabulary: 1.2 MB a row)
        logits = np.asarray(llm.scores[start : min(start + 256, len(logp))], dtype=np.float64)
        shifted = logits - logits.max(axis=1, keepdims=True)
        logp[start : start + len(logits)] = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    np.save(job["output_path"], logp)
    return {"ok": True}


def main() -> int:
    job = json.load(sys.stdin)
    modes = {
        "quantize": lambda: quantize(job["source"], job["target"], job["ftype"]),
        "log_probs": lambda: log_probs(job),
    }
    result = modes.get(job["mode"], lambda: generate(job))()
    with open(job["result_path"], "w") as out:
        json.dump(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
