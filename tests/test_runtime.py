"""The process-wide settings of pagedllm/_runtime.py, each checked by its effect in a fresh process with
a clean environment: the OpenMP defaults `import pagedllm` sets (passive waiting after a short spin, a
thread count from the usable CPUs) where the user set none, torch's thread count, the threads of
tensor-parallel ranks, glibc's allocator thresholds, and freeing a thread's OpenMP workers."""

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagedllm import _runtime
from pagedllm._runtime import SPIN_ROUNDS, usable_cpus

ROOT = Path(__file__).resolve().parents[1]
PROBE = (
    "import os, pagedllm, torch; "
    "env = os.environ.get; "
    "print(env('OMP_WAIT_POLICY'), env('GOMP_SPINCOUNT'), env('OMP_NUM_THREADS'), torch.get_num_threads())"
)
TWO_CPUS = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")


def _run(code: str, **env: str) -> list[str]:
    """stdout's words of `code` run in a fresh Python without the caller's OpenMP / allocator settings."""
    inherited = ("OMP_", "GOMP_", "_PAGEDLLM_", "MALLOC_", "GLIBC_TUNABLES")
    clean = {k: v for k, v in os.environ.items() if not k.startswith(inherited)}
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**clean, "PYTHONPATH": str(ROOT), **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


@pytest.mark.parametrize(
    "cpu_max, cap",
    [
        (None, None),  # no cgroup v2 file: the affinity mask alone
        ("max 100000", None),
        ("800000 100000", 8),
        ("150000 100000", 2),  # a part-used CPU counts
        ("50000 100000", 1),
        ("1 100000", 1),
        ("garbled", None),
    ],
)
def test_a_cgroup_quota_caps_the_usable_cpus(tmp_path, monkeypatch, cpu_max, cap):
    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max + "\n")
    monkeypatch.setattr(_runtime, "CGROUP_CPU_MAX", path)
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus() == (affinity if cap is None else min(affinity, cap))


def test_import_sets_passive_waiting_and_the_usable_cpu_count():
    assert _run(PROBE) == ["PASSIVE", str(SPIN_ROUNDS), str(usable_cpus()), str(usable_cpus())]


@TWO_CPUS
def test_a_process_pinned_to_one_cpu_gets_one_thread():
    """The count follows the affinity mask, not the machine's CPUs, which torch would count."""
    pin = "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
    assert _run(pin + PROBE) == ["PASSIVE", str(SPIN_ROUNDS), "1", "1"]


def test_the_users_settings_win():
    assert _run(PROBE, OMP_WAIT_POLICY="ACTIVE", OMP_NUM_THREADS="1") == ["ACTIVE", "None", "1", "1"]
    assert _run(PROBE, GOMP_SPINCOUNT="5") == ["PASSIVE", "5", str(usable_cpus()), str(usable_cpus())]


@TWO_CPUS
def test_thread_count_when_torch_came_first():
    """torch imported before pagedllm: in a process pinned to one CPU the engine lowers torch's count;
    a count the user set below the usable CPUs stays."""
    code = (
        "import os; {pin}import torch; torch.set_num_threads({threads}); import pagedllm; "
        "from pagedllm._runtime import apply_thread_count; apply_thread_count(); "
        "print(torch.get_num_threads())"
    )
    pin = "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
    assert _run(code.format(pin=pin, threads=2)) == ["1"]
    assert _run(code.format(pin="", threads=1)) == ["1"]


def test_ranks_split_the_usable_cpus_unless_the_user_set_a_count():
    code = (
        "import pagedllm; from pagedllm._runtime import threads_per_rank; "
        "print(threads_per_rank(1), threads_per_rank(2), threads_per_rank(64))"
    )
    cpus = usable_cpus()
    assert _run(code) == [str(cpus), str(max(1, cpus // 2)), "1"]
    assert _run(code, OMP_NUM_THREADS="3") == ["3", "3", "3"]


def _has_mallinfo2() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "mallinfo2")
    except OSError:
        return False


# Per allocation size: whether glibc served it by mmap, and whether the heap still holds it once freed.
MALLOC_PROBE = """
import ctypes
from pagedllm._runtime import keep_large_allocations

fields = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
MallInfo2 = type("MallInfo2", (ctypes.Structure,), {"_fields_": [(f, ctypes.c_size_t) for f in fields]})
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
if SET:
    assert keep_large_allocations()
for mib in (100, 300):
    before = libc.mallinfo2()
    block = libc.malloc(mib << 20)
    during = libc.mallinfo2()
    libc.free(block)
    after = libc.mallinfo2()
    # The heap grows by a little less than the block where it had some free space already.
    print(during.hblkhd - before.hblkhd >= mib << 20, after.arena - before.arena >= (mib << 20) // 2)
"""


@pytest.mark.skipif(not _has_mallinfo2(), reason="glibc's mallopt and mallinfo2")
def test_large_allocations_stay_on_the_heap_up_to_the_threshold():
    """glibc's default maps 100 MiB and unmaps it on free; after keep_large_allocations it comes from
    the heap, which keeps it once freed. 300 MiB is past the mmap threshold either way."""
    assert _run("SET = False\n" + MALLOC_PROBE) == ["True", "False", "True", "False"]
    assert _run("SET = True\n" + MALLOC_PROBE) == ["False", "True", "True", "False"]


@TWO_CPUS
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
