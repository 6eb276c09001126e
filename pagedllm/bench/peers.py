"""How a peer (vLLM, llama.cpp) is run beside pagedllm: in its own process, with its own environment and
its own defaults, as its users run it, never inside the pagedllm process.

`import pagedllm` sets OpenMP's wait policy for its own threads (pagedllm/_runtime.py: OMP_WAIT_POLICY=
PASSIVE with GOMP_SPINCOUNT, and OMP_NUM_THREADS where the user set none, marked by
_PAGEDLLM_DEFAULTED_OMP_NUM_THREADS). A child inherits the environment, so `peer_env` takes those out again
(OMP_NUM_THREADS only where pagedllm chose it), with pagedllm's own PAGEDLLM_* switches, and says what it
removed and what it set: each peer's row prints that line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

PAGEDLLM_OPENMP = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
DEFAULTED_THREADS = "_PAGEDLLM_DEFAULTED_OMP_NUM_THREADS"  # _runtime._DEFAULTED: the count pagedllm chose


@dataclass(frozen=True)
class PeerEnv:
    env: dict[str, str]
    removed: list[str]
    added: dict[str, str]

    def describe(self) -> str:
        """What the row prints: the variables taken out of pagedllm's environment, and those set."""
        parts = [f"own process; removed {', '.join(self.removed) or 'nothing'}"]
        if self.added:
            parts.append("set " + " ".join(f"{k}={v}" for k, v in self.added.items()))
        return "; ".join(parts)


def peer_env(base: dict[str, str] | None = None, **added: str) -> PeerEnv:
    """`base` (default: this process's environment) without what pagedllm set for itself, plus `added`."""
    env = dict(os.environ if base is None else base)
    drop = [name for name in env if name in PAGEDLLM_OPENMP or name.startswith("PAGEDLLM_")]
    if DEFAULTED_THREADS in env:
        drop += [DEFAULTED_THREADS, *(["OMP_NUM_THREADS"] if "OMP_NUM_THREADS" in env else [])]
    for name in drop:
        del env[name]
    env.update(added)
    return PeerEnv(env, sorted(set(drop)), dict(added))


def run_script(script: Path, job: dict, env: PeerEnv, what: str) -> object:
    """Run a peer's runner script by path (so that it imports neither pagedllm nor its settings) on one
    JSON job on stdin; its JSON answer, which it writes to the job's "result_path" (a peer's own logging
    may take stdout)."""
    with tempfile.TemporaryDirectory(prefix="pagedllm-peer-") as folder:
        result = Path(folder) / "result.json"
        done = subprocess.run(
            # -P: the script's folder (bench/, whose profile.py and trace.py would shadow the standard
            # library's for the peer's own imports) is not put on sys.path
            [sys.executable, "-P", str(script)],
            input=json.dumps({**job, "result_path": str(result)}),
            capture_output=True,
            text=True,
            env=env.env,
        )
        if done.returncode != 0:
            raise RuntimeError(f"{what} child failed (exit {done.returncode}):\n{done.stderr[-2000:]}")
        return json.loads(result.read_text())
