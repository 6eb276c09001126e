"""Rank 0's hold on a tensor-parallel group: it starts the local workers, forms the group, tells every
rank what to load, turns a failed collective into a clear error, and stops every worker at the end."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import time
import weakref
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch

from pagedllm._runtime import threads_per_rank
from pagedllm.engine.config import EngineConfig
from pagedllm.engine.parallel import protocol
from pagedllm.engine.parallel.group import (
    STARTUP_TIMEOUT,
    connect,
    describe_exit,
    form_group,
    loopback_store,
    reap,
    spawn_worker,
)
from pagedllm.kv import KVGroups
from pagedllm.models.loader import ResolvedModel
from pagedllm.models.parallel import CollectiveError, CommStats, TensorParallel, check_split

logger = logging.getLogger(__name__)


class WorkerFailure(RuntimeError):
    """A tensor-parallel rank died, hung, or could not start: the engine cannot run another step."""


@dataclass(frozen=True)
class Topology:
    """Where the ranks of one engine run, and which of them this process starts."""

    init_method: str | None  # None: a free loopback port, every rank on this machine
    world_size: int
    local_ranks: int  # ranks on this machine (threads are split between them)
    spawned: range  # the ranks this process starts (none under torchrun, which starts them all)

    @classmethod
    def of(cls, config: EngineConfig) -> Topology:
        n, init_method = config.tensor_parallel_size, config.distributed_init_method
        if init_method is None and "TORCHELASTIC_RUN_ID" in os.environ:
            init_method = "env://"  # started by torchrun
        if init_method == "env://":
            world, rank = int(os.environ.get("WORLD_SIZE", 1)), int(os.environ.get("RANK", 0))
            if (world, rank) != (n, 0):
                raise ValueError(
                    f"under torchrun the engine runs on rank 0 of tensor_parallel_size={n} ranks; this "
                    f"process is rank {rank} of WORLD_SIZE={world} (`pagedllm serve` and `generate` run "
                    "the worker on the other ranks)"
                )
            return cls(init_method, n, int(os.environ.get("LOCAL_WORLD_SIZE", 1)), range(0))
        local = n // config.nnodes
        return cls(init_method, n, local, range(1, local))


@dataclass
class _Group:
    """What stopping the group takes, held apart from the Executor so that a finalizer can do it."""

    procs: dict[int, subprocess.Popen]  # the workers this process started, by rank
    threads_before: int
    tp: TensorParallel | None = None
    serving: bool = False  # every rank loaded its shard and waits for steps
    failed: bool = False


def _stop(group: _Group) -> None:
    """Tell every rank to exit if they all wait for a step, then make sure no local worker is left."""
    graceful = group.serving and not group.failed
    if graceful:
        try:
            group.tp.broadcast(protocol.op_header(protocol.STOP))
        except CollectiveError:
            graceful = False
    reap(list(group.procs.values()), grace=10 if graceful else 0)
    if group.tp is not None:
        group.tp.close()
    torch.set_num_threads(group.threads_before)


class Executor:
    """Rank 0 of a tensor-parallel group. `tp` is the handle its model's sharded layers collect through."""

    def __init__(self, config: EngineConfig, model: ResolvedModel):
        self.topology = topo = Topology.of(config)
        check_split(
            model.config, topo.world_size
        )  # a GGUF was converted once, at resolving: not by every rank
        self.device = torch.device(config.device)
        self.timeout = timedelta(seconds=config.distributed_timeout)
        self.failure: str | None = None
        if topo.init_method is None:
            self.store, init_method = loopback_store(topo.world_size)
        else:
            self.store, init_method = connect(topo.init_method, 0, topo.world_size), topo.init_method
        dtype = str(config.torch_dtype).removeprefix("torch.")
        spec = {
            "model": config.model,
            "dtype": dtype,
            "device": config.device,
            "quantization": config.quantization,
            "max_num_seqs": config.max_num_seqs,
            "max_model_len": config.max_model_len,
            "lora": [config.max_lora_rank, config.max_cpu_loras] if config.enable_lora else None,
        }
        self.store.set("model", json.dumps(spec))
        threads = threads_per_rank(topo.local_ranks)
        self.procs = {r: spawn_worker(init_method, r, topo.world_size, r, threads) for r in topo.spawned}
        self._group = _Group(self.procs, torch.get_num_threads())
        self._finalizer = weakref.finalize(self, _stop, self._group)  # runs once: stop(), garbage or exit
        torch.set_num_threads(threads)
        logger.info(
            "tensor parallel: %d ranks (%s), %d threads per rank on this machine",
            topo.world_size,
            init_method,
            threads,
        )
        try:
            self._wait_for("joined", f"join {init_method}")
            self.tp = self._group.tp = form_group(self.store, 0, topo.world_size, self.device, self.timeout)
        except BaseException:
            self.stop()
            raise

    def start(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        num_host_blocks: int,
        prefault: bool,
        groups: KVGroups,
    ) -> None:
        """Tell every rank its KV cache's size and KV groups; return once all have loaded their shard and
        allocated it."""
        cache = {"num_blocks": num_blocks, "block_size": block_size, "num_host_blocks": num_host_blocks}
        cache.update(dtype=str(dtype).removeprefix("torch."), prefault=prefault, groups=asdict(groups))
        self.store.set("cache", json.dumps(cache))
        self._wait_for("ready", "load the model")
        errors = {r: self.store.get(f"ready/{r}").decode() for r in self._workers()}
        errors = {r: e for r, e in errors.items() if e != "ok"}
        if errors:
            raise WorkerFailure(
                "; ".join(f"tensor-parallel rank {r} failed to start: {e}" for r, e in errors.items())
            )
        self._group.serving = True

    def _workers(self) -> range:
        return range(1, self.topology.world_size)

    def _wait_for(self, stage: str, what: str) -> None:
        """Poll the store until every worker has set `stage/<rank>`, failing early if a local one exits."""
        deadline = time.monotonic() + STARTUP_TIMEOUT.total_seconds()
        pending = list(self._workers())
        while pending:
            pending = [r for r in pending if not self.store.check([f"{stage}/{r}"])]
            for rank, proc in self.procs.items():
                if proc.poll() is not None and rank in pending:
                    raise WorkerFailure(
                        f"tensor-parallel rank {rank} (pid {proc.pid}) {describe_exit(proc.returncode)} "
                        f"before it could {what}"
                    )
            if pending and time.monotonic() > deadline:
                seconds = STARTUP_TIMEOUT.total_seconds()
                hint = "" if self.procs else ": start them (the other nodes' `--node-rank`, or torchrun)"
                raise WorkerFailure(f"tensor-parallel ranks {pending} did not {what} in {seconds:g} s{hint}")
            time.sleep(0.02)

    def comm_stats(self) -> list[CommStats]:
        """Each rank's time in collectives so far (a worker's wait for the next step not counted)."""
        try:
            self.tp.broadcast(protocol.op_header(protocol.STATS), counted=False)
            return protocol.gather_stats(self.tp)
        except CollectiveError as error:
            raise self.fail(error) from error

    def fail(self, error: CollectiveError) -> WorkerFailure:
        """Diagnose a failed collective, stop the local workers, and return the error the engine raises."""
        dead: dict[int, int] = {}
        deadline = time.monotonic() + 1.0  # a crashed peer closes its sockets a moment before it is reaped
        while not dead and time.monotonic() < deadline:
            dead = {r: p.returncode for r, p in self.procs.items() if p.poll() is not None}
            time.sleep(0.02)
        if dead:
            self.failure = "; ".join(
                f"tensor-parallel rank {r} (pid {self.procs[r].pid}) {describe_exit(code)}"
                for r, code in dead.items()
            )
        elif "Timed out" in str(error.__cause__):
            self.failure = (
                f"a tensor-parallel rank did not answer within {self.timeout.total_seconds():g} s "
                "(distributed_timeout): it hangs, or runs far slower than rank 0"
            )
        else:
            self.failure = f"a collective between the tensor-parallel ranks failed: {error.__cause__}"
        self.failure += "; every worker is stopped and the engine cannot run"
        self._group.failed = True
        self.stop()
        return WorkerFailure(self.failure)

    def stop(self) -> None:
        """Stop every rank (a no-op the second time); at exit or when garbage, this happens by itself."""
        self._finalizer()
