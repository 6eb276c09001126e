"""A tensor-parallel worker: one rank's shard of the model and KV cache, stepping when rank 0 says.

`python -m pagedllm.engine.parallel.worker INIT_METHOD --rank R --world-size N` is how rank 0 starts the
workers on its machine; `run_node` runs a whole other machine's ranks (`pagedllm serve --node-rank 1`),
and `run_worker` one rank under torchrun.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time

import torch

from pagedllm._runtime import threads_per_rank
from pagedllm.engine.config import DTYPES
from pagedllm.engine.lora_manager import RankLoRAs
from pagedllm.engine.model_runner import ModelRunner
from pagedllm.engine.parallel import protocol
from pagedllm.engine.parallel.group import WORKER_TIMEOUT, connect, form_group, reap, spawn_worker
from pagedllm.kv import KVGroups
from pagedllm.models.loader import load_model
from pagedllm.models.parallel import CollectiveError, TensorParallel

logger = logging.getLogger(__name__)


def run_worker(init_method: str, rank: int, world_size: int, local_rank: int) -> None:
    """Join the group, load this rank's shard, then run every step rank 0 broadcasts until it says stop."""
    store = connect(init_method, rank, world_size)
    spec = json.loads(store.get("model"))
    device = torch.device(spec["device"])
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    store.set(f"joined/{rank}", "")
    tp = form_group(store, rank, world_size, device, WORKER_TIMEOUT)
    try:
        dtype = DTYPES[spec["dtype"]]
        settings = {name: spec[name] for name in ("quantization", "max_num_seqs", "max_model_len")}
        model = load_model(spec["model"], dtype, device, tp=tp, **settings).model
        loras = None if spec["lora"] is None else RankLoRAs(model, *spec["lora"], dtype)
        cache = json.loads(store.get("cache"))
        kv_dtype = getattr(torch, cache["dtype"])  # torch's name of it (Executor.start)
        runner = ModelRunner(
            model,
            cache["num_blocks"],
            cache["block_size"],
            kv_dtype,
            device,
            cache["num_host_blocks"],
            cache["prefault"],
            KVGroups(**{name: tuple(value) for name, value in cache["groups"].items()}),
            loras=loras,
        )
    except Exception as error:
        store.set(f"ready/{rank}", f"{type(error).__name__}: {error}")
        raise
    store.set(f"ready/{rank}", "ok")
    try:
        serve_steps(runner, tp)
    finally:
        tp.close()


def serve_steps(runner: ModelRunner, tp: TensorParallel) -> None:
    header = torch.empty(protocol.HEADER_LEN, dtype=torch.int64)
    while True:
        tp.broadcast(header, counted=False)  # waiting for rank 0
        if header[0] == protocol.STOP:
            return
        if header[0] == protocol.STATS:
            protocol.gather_stats(tp)
            continue
        if header[0] == protocol.CALIBRATE:
            input_ids = torch.empty(int(header[1]), dtype=torch.int64)
            tp.broadcast(input_ids)
            runner.calibrate_key_smoothing(input_ids.numpy())
            continue
        if header[0] == protocol.LORA:
            named = tp.broadcast(torch.empty(int(header[1]), dtype=torch.uint8))
            runner.loras.follow(protocol.read_lora(named))
            continue
        payload = torch.empty(protocol.payload_len(header), dtype=torch.int64)
        tp.broadcast(payload)
        runner.execute_step(protocol.unpack(header, payload))


def run_node(init_method: str, world_size: int, nnodes: int, node_rank: int) -> int:
    """Run the ranks of machine `node_rank` (of `nnodes`, world_size / nnodes ranks each) until rank 0
    stops them: the first in this process, the others as workers it starts."""
    local = world_size // nnodes
    first = node_rank * local
    threads = threads_per_rank(local)
    others = range(first + 1, first + local)
    procs = [spawn_worker(init_method, r, world_size, r - first, threads) for r in others]
    torch.set_num_threads(threads)
    try:
        return _run(init_method, first, world_size, 0)
    finally:
        reap(procs, grace=10)


def run_torchrun_rank() -> int:
    """This process's rank (not 0) of a group torchrun started: RANK, WORLD_SIZE, LOCAL_RANK from it."""
    rank, world_size, local_rank = (int(os.environ[name]) for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    torch.set_num_threads(threads_per_rank(int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    return _run("env://", rank, world_size, local_rank)


def _run(init_method: str, rank: int, world_size: int, local_rank: int) -> int:
    try:
        run_worker(init_method, rank, world_size, local_rank)
    except CollectiveError as error:
        print(f"pagedllm worker rank {rank}: lost the group ({error.__cause__}); exiting", file=sys.stderr)
        return 1
    return 0


def _exit_with_parent(parent_pid: int) -> None:
    """Exit as soon as the process that started this worker is gone (even if it was killed)."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.engine.parallel.worker", description=__doc__)
    parser.add_argument("init_method")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--local-rank", type=int, required=True)
    parser.add_argument("--threads", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format=f"%(levelname)s rank {args.rank} %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which stops the workers
    threading.Thread(target=_exit_with_parent, args=(args.parent_pid,), daemon=True).start()
    torch.set_num_threads(args.threads)
    return _run(args.init_method, args.rank, args.world_size, args.local_rank)


if __name__ == "__main__":
    sys.exit(main())
