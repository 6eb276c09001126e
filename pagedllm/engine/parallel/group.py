"""Forming a tensor-parallel group: where the ranks meet, their process groups, starting local workers.

Ranks meet at a torch.distributed store: `tcp://HOST:PORT` (rank 0 hosts it), `env://` (torchrun's
MASTER_ADDR / MASTER_PORT), or, for one machine with no address given, a free loopback port. Over the
store they exchange what to load and report when they are ready; then a gloo process group carries the
step metadata (and, on the CPU, the model's collectives; NCCL carries those on CUDA).

Each rank waits in a collective for at most its own timeout: rank 0 for `distributed_timeout` (a hung
worker fails the engine within that bound), workers for as long as the engine idles between steps. A
dead peer fails a collective at once ("Connection closed by peer").
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import urllib.parse
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from pagedllm._runtime import _DEFAULTED
from pagedllm.models.parallel import TensorParallel

STARTUP_TIMEOUT = timedelta(minutes=10)  # to join (another node may start later) and to load the weights
WORKER_TIMEOUT = timedelta(days=365)  # a worker waits for the next step however long the engine idles


def connect(init_method: str, rank: int, world_size: int) -> dist.Store:
    """The rendezvous store: rank 0 hosts a tcp:// one, the others connect (retrying until it is up)."""
    if init_method == "env://":
        store, _, _ = next(dist.rendezvous("env://", rank, world_size, timeout=STARTUP_TIMEOUT))
        return store
    url = urllib.parse.urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"distributed_init_method must be tcp://HOST:PORT or env://, got {init_method!r}")
    return dist.TCPStore(
        url.hostname,
        url.port,
        world_size,
        is_master=rank == 0,
        timeout=STARTUP_TIMEOUT,
        wait_for_workers=False,
    )


def loopback_store(world_size: int) -> tuple[dist.Store, str]:
    """Rank 0's store on a free loopback port, and the init method the other ranks reach it by."""
    store = dist.TCPStore(
        "127.0.0.1", 0, world_size, is_master=True, timeout=STARTUP_TIMEOUT, wait_for_workers=False
    )
    return store, f"tcp://127.0.0.1:{store.port}"


def form_group(
    store: dist.Store, rank: int, world_size: int, device: torch.device, timeout: timedelta
) -> TensorParallel:
    """Every rank calls this once all have joined; it returns when the group's connections are up."""
    cpu_group = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, world_size, timeout)
    group = cpu_group
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, world_size, options)
    return TensorParallel(rank, world_size, group, cpu_group)


def spawn_worker(
    init_method: str, rank: int, world_size: int, local_rank: int, threads: int
) -> subprocess.Popen:
    """Start one worker rank in a fresh interpreter (as multiprocessing's spawn would, without importing
    the caller's __main__); it exits when rank 0 says stop, or when this process is gone."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop(_DEFAULTED, None)
    package_root = str(
        Path(__file__).resolve().parents[3]
    )  # the same pagedllm as this one (pagedllm/engine/parallel/)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (package_root, env.get("PYTHONPATH"))))
    command = [sys.executable, "-m", "pagedllm.engine.parallel.worker", init_method]
    command += ["--rank", str(rank), "--world-size", str(world_size), "--local-rank", str(local_rank)]
    command += ["--threads", str(threads), "--parent-pid", str(os.getpid())]
    return subprocess.Popen(command, env=env)


def reap(procs: list[subprocess.Popen], grace: float) -> None:
    """Wait up to `grace` seconds for each process to exit, then kill it; none is left running."""
    for proc in procs:
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def describe_exit(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"
