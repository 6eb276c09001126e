"""vLLM's side of `pagedllm bench throughput --vllm`, run as a child process: `python vllm_peer.py`.

A script run by path, so that it imports nothing of pagedllm (whose import sets OpenMP's wait policy for
its own threads): vLLM runs with its own environment (bench/peers.py says what is removed) and its own
defaults: only the model, its dtype and max_model_len are set (CUDA graphs / torch.compile as vLLM
chooses: no enforce_eager). vLLM-CPU sizes its KV cache from VLLM_CPU_KVCACHE_SPACE (GiB) and binds its
threads per VLLM_CPU_OMP_THREADS_BIND; set them in the environment to change them.

Reads one JSON job on stdin:
  {"model": folder, "dtype": "float32", "max_model_len": n, "prompts": [[ids]], "output_len": n}
writes {"version": v, "seconds": s, "tokens": [[ids]], "settings": {...}} to the job's "result_path"
(vLLM logs to stdout): the timed
generate of every prompt at once (greedy, EOS ignored), after a warm-up of two prompts.
"""

from __future__ import annotations

import json
import sys
import time


def run(job: dict) -> dict:
    import vllm

    settings = {"dtype": job["dtype"], "max_model_len": job["max_model_len"]}
    llm = vllm.LLM(job["model"], **settings)
    inputs = [{"prompt_token_ids": ids} for ids in job["prompts"]]
    llm.generate(inputs[:2], vllm.SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm-up
    params = vllm.SamplingParams(max_tokens=job["output_len"], temperature=0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return {"version": vllm.__version__, "seconds": seconds, "tokens": tokens, "settings": settings}


def main() -> int:
    job = json.load(sys.stdin)
    with open(job["result_path"], "w") as out:
        json.dump(run(job), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
