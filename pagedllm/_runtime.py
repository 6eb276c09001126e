"""Process-wide runtime settings for fast CPU inference: OpenMP threads and the C allocator.

OpenMP settings for torch's CPU threads are applied when pagedllm is imported (before torch, if possible).

OpenMP threads that spin while waiting between parallel regions collapse as soon as anything else
shares the cores, so pagedllm makes them wait passively unless the user chose otherwise. Yet a thread
that sleeps at once must be woken for each of a decode step's parallel regions (the matmuls and
attention of every layer), so they first spin a short while (libgomp's GOMP_SPINCOUNT of 10,000 rounds,
tens of microseconds: the gap between two ops of a step) before sleeping; with the cores busy with other
work that short spin costs no more than sleeping at once, while libgomp's default spin is far longer.
The measurements behind each choice: docs/JOURNAL.md, "One user" (OpenMP wake-ups). The thread count
defaults to the CPUs this process may run on (its affinity mask, capped by a cgroup CPU quota), where
torch would count every CPU of the machine.
"""

from __future__ import annotations

import ctypes
import logging
import math
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

_DEFAULTED = "_PAGEDLLM_DEFAULTED_OMP_NUM_THREADS"  # marks a thread count pagedllm chose
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" in microseconds, or "max ..."


def usable_cpus() -> int:
    """CPUs this process may use: its affinity mask, capped by a cgroup v2 `cpu.max` quota."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = CGROUP_CPU_MAX.read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return cpus


SPIN_ROUNDS = 10_000  # GOMP_SPINCOUNT: how long an idle OpenMP thread spins before it sleeps


def set_openmp_defaults() -> None:
    """OMP_WAIT_POLICY=PASSIVE with a short spin (GOMP_SPINCOUNT=SPIN_ROUNDS) and
    OMP_NUM_THREADS=usable_cpus(), each only where the user set none."""
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        os.environ.setdefault("GOMP_SPINCOUNT", str(SPIN_ROUNDS))
    if "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = os.environ[_DEFAULTED] = str(usable_cpus())


_OMP_PAUSE_SOFT = 1  # omp_pause_resource_kind: free the threads, keep the settings


def release_openmp_threads() -> bool:
    """Free the OpenMP threads the calling thread has started (OpenMP 5's omp_pause_resource_all), before
    another thread takes over the parallel work, as the server's engine thread does from the thread that
    loaded the model. libgomp counts idle pools' threads against the CPUs, and with more of its threads
    than CPUs every thread spins at most 100 rounds, not GOMP_SPINCOUNT, before it sleeps, and a step run
    from the second thread pays a wake-up per parallel region (docs/JOURNAL.md, Serving). Returns whether
    a loaded libgomp did it (a runtime loaded later starts its threads afresh anyway)."""
    try:
        gomp = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        return gomp.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0
    except (OSError, AttributeError):  # no libgomp in this process, or one older than OpenMP 5
        return False


def threads_per_rank(local_ranks: int) -> int:
    """Torch threads for each of `local_ranks` processes sharing this machine (tensor-parallel ranks): the
    user's OMP_NUM_THREADS if they set one, else the usable CPUs split evenly."""
    if "OMP_NUM_THREADS" in os.environ and _DEFAULTED not in os.environ:
        return int(os.environ["OMP_NUM_THREADS"])
    return max(1, usable_cpus() // local_ranks)


def apply_thread_count() -> None:
    """If torch was imported before pagedllm, it missed the default thread count: where it runs more
    threads than the process has CPUs, lower it (a count the user lowered further stays)."""
    if _DEFAULTED in os.environ and "torch" in sys.modules:
        import torch

        usable = int(os.environ[_DEFAULTED])
        if torch.get_num_threads() > usable:
            torch.set_num_threads(usable)


# glibc's mallopt parameters.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD = 256 << 20
_TRIM_THRESHOLD = 512 << 20


def keep_large_allocations() -> bool:
    """Let glibc serve allocations up to 256 MiB from its heap and keep up to 512 MiB of freed heap.

    By default glibc hands every allocation above 32 MiB to mmap and unmaps it when freed, so each
    prefill step's large activations (a 100 MB MLP intermediate at 8192 tokens) are page-faulted in
    afresh in every layer instead of reused (commit 38f61b1 measured the cost).
    Called when an engine starts on the CPU; returns whether glibc accepted the settings.
    """
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD)
    )
    logger.debug(
        "glibc mallopt (mmap threshold %d, trim threshold %d): %s", _MMAP_THRESHOLD, _TRIM_THRESHOLD, ok
    )
    return ok
