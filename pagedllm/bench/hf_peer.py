"""Hugging Face transformers' side of `pagedllm bench throughput --hf`, run as a child process:
`python hf_peer.py`. A script run by path, so that it imports nothing of pagedllm (whose import sets
OpenMP's wait policy for its own threads): transformers runs with torch's own settings, in its own
environment (bench/peers.py), at the thread count the job names.

Reads one JSON job on stdin:
  {"model": folder, "dtype": "float32", "threads": n, "batch_size": n, "prompts": [[ids]], "output_len": n}
writes {"version": v, "torch": v, "seconds": s, "tokens": [[ids]]} to the job's "result_path": greedy
generate (exactly output_len tokens, EOS ignored) over left-padded batches of batch_size prompts.
"""

from __future__ import annotations

import json
import sys
import time


def run(job: dict) -> dict:
    import torch
    import transformers

    torch.set_num_threads(job["threads"])
    model = transformers.AutoModelForCausalLM.from_pretrained(
        job["model"], dtype=getattr(torch, job["dtype"])
    )
    model.eval()
    prompts, size, tokens = job["prompts"], job["batch_size"], []
    start = time.perf_counter()
    for lo in range(0, len(prompts), size):
        batch = prompts[lo : lo + size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=job["output_len"],
                min_new_tokens=job["output_len"],
                do_sample=False,
                pad_token_id=0,
            )
        tokens += out[:, width:].tolist()
    seconds = time.perf_counter() - start
    return {
        "version": transformers.__version__,
        "torch": torch.__version__,
        "seconds": seconds,
        "tokens": tokens,
    }


def main() -> int:
    job = json.load(sys.stdin)
    with open(job["result_path"], "w") as out:
        json.dump(run(job), out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
