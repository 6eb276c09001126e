"""OpenMP defaults applied by `import pagedllm`: passive waiting after a short spin, and a thread count
from the usable CPUs."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm._runtime import SPIN_ROUNDS, usable_cpus

ROOT = Path(__file__).resolve().parents[1]
PROBE = (
    "import os, pagedllm, torch; "
    "env = os.environ.get; "
    "print(env('OMP_WAIT_POLICY'), env('GOMP_SPINCOUNT'), env('OMP_NUM_THREADS'), torch.get_num_threads())"
)


def _run(code: str, **env: str) -> list[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_usable_cpus_follow_the_affinity_mask():
    assert usable_cpus() == len(os.sched_getaffinity(0))


def test_import_sets_passive_waiting_and_the_usable_cpu_count():
    assert _run(PROBE) == ["PASSIVE", str(SPIN_ROUNDS), str(usable_cpus()), str(usable_cpus())]


def test_the_users_settings_win():
    assert _run(PROBE, OMP_WAIT_POLICY="ACTIVE", OMP_NUM_THREADS="1") == ["ACTIVE", "None", "1", "1"]
    assert _run(PROBE, GOMP_SPINCOUNT="5") == ["PASSIVE", "5", str(usable_cpus()), str(usable_cpus())]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_affinity_limits_the_thread_count_when_torch_came_first():
    """torch imported before pagedllm, in a process pinned to one CPU: the engine lowers torch's count."""
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); import torch; "
        "torch.set_num_threads(2); import pagedllm; from pagedllm._runtime import apply_thread_count; "
        "apply_thread_count(); print(torch.get_num_threads())"
    )
    assert _run(code) == ["1"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_glibc_accepts_the_allocator_settings():
    from pagedllm._runtime import keep_large_allocations

    assert keep_large_allocations()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_release_frees_this_threads_openmp_workers():
    """After a parallel op the thread's OpenMP workers exist; release_openmp_threads ends them, and the
    next parallel op (from another thread, as the server's engine runs) starts its own and is correct."""
    code = (
        "import os, threading, time, torch, pagedllm; from pagedllm._runtime import release_openmp_threads; "
        "tasks = lambda: len(os.listdir('/proc/self/task')); x = torch.arange(1 << 22, dtype=torch.float64); "
        "total = (1 << 22) * ((1 << 22) - 1) / 2; assert x.sum() == total; busy = tasks(); "
        "workers = torch.get_num_threads() - 1; assert release_openmp_threads()\n"
        "deadline = time.time() + 10\n"
        "while tasks() > busy - workers and time.time() < deadline: time.sleep(0.01)\n"
        "freed = busy - tasks(); out = []; t = threading.Thread(target=lambda: out.append(float(x.sum()))); "
        "t.start(); t.join(); print(workers, freed, out[0] == total)"
    )
    workers, freed, correct = _run(code)
    assert int(workers) >= 1 and freed == workers and correct == "True"
