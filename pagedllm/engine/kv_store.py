"""The disk tier's files: one per KV block, content-addressed, checksummed, written crash-safe.

A block's file lives in a folder named by the engine's fingerprint (`kv_fingerprint`: the model's files,
the settings that change K/V's bytes, the cache's geometry), under the name of the block's hash chain,
so a restarted process on the same files finds its blocks and a process of another model, dtype or
block size never opens them. A file is MAGIC, the blake2b digest of the payload, then the payload (the
block's bytes in logical order, ops.read_block_bytes); it is written to a temporary name and renamed,
so a reader sees a whole file or none, and a file that is short, long or fails its digest (a torn
write, a full disk, a flipped bit) is deleted and reported missing: its block is recomputed.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MAGIC = b"PAGEDKV1"
DIGEST_BYTES = 32
SUFFIX = ".kv"


def _file_stats(path: Path) -> list[tuple[str, int, int]]:
    """(name, size, mtime_ns) of the model file, or of every file in the model folder."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    return [(str(p.relative_to(path) if path.is_dir() else p.name), *_stat(p)) for p in files]


def _stat(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def kv_fingerprint(model_path: Path, settings: dict, smoothing: bytes = b"") -> tuple[str, dict]:
    """The hex digest naming a fingerprint's folder, and what it was made of (written beside the files).

    The model is identified by its files' names, sizes and modification times (hashing gigabytes of
    weights at every start-up costs seconds); `settings` are those that change the K/V bytes a prompt
    gives (dtypes, weight storage, matmul method, the cache's geometry); `smoothing` a quantized cache's
    calibrated key smoothing."""
    described = {
        "format": MAGIC.decode(),
        "model_files": _file_stats(model_path),
        "settings": settings,
        "key_smoothing": hashlib.blake2b(smoothing, digest_size=16).hexdigest(),
    }
    text = json.dumps(described, sort_keys=True)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest(), described


class DiskStore:
    """The files of one fingerprint's blocks: write, read back verified, delete, list."""

    def __init__(self, root: str | os.PathLike, fingerprint: str, described: dict, block_bytes: int):
        self.folder = Path(root) / fingerprint
        self.folder.mkdir(parents=True, exist_ok=True)
        self.block_bytes = block_bytes
        (self.folder / "fingerprint.json").write_text(json.dumps(described, indent=1, sort_keys=True))
        self.bytes_written = 0
        self.bytes_read = 0

    def path(self, key: bytes) -> Path:
        return self.folder / (key.hex() + SUFFIX)

    def scan(self) -> list[bytes]:
        """Keys of the files here, oldest first; leftover temporary files (a write killed midway) go."""
        found = []
        for entry in os.scandir(self.folder):
            if entry.name.endswith(SUFFIX):
                try:
                    found.append((entry.stat().st_mtime_ns, bytes.fromhex(entry.name[: -len(SUFFIX)])))
                except ValueError:
                    continue  # not a name this store writes
            elif ".tmp." in entry.name:
                Path(entry.path).unlink(missing_ok=True)
        return [key for _, key in sorted(found)]

    def write(self, key: bytes, payload: bytes) -> None:
        """Write a block's file crash-safe: a temporary file in the same folder, then an atomic rename."""
        if len(payload) != self.block_bytes:
            raise ValueError(f"a block of {len(payload)} bytes for a store of {self.block_bytes}-byte blocks")
        final = self.path(key)
        temporary = final.with_name(f"{final.name}.tmp.{os.getpid()}")
        try:
            with open(temporary, "wb") as file:
                file.write(MAGIC + hashlib.blake2b(payload, digest_size=DIGEST_BYTES).digest() + payload)
            os.replace(temporary, final)
        except OSError:
            temporary.unlink(missing_ok=True)
            raise
        self.bytes_written += len(payload)

    def read(self, key: bytes) -> bytes | None:
        """The block's payload if its file is whole and its digest matches; else None (and it is deleted)."""
        path = self.path(key)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            return None
        header = len(MAGIC) + DIGEST_BYTES
        payload = data[header:]
        if (
            len(data) != header + self.block_bytes
            or not data.startswith(MAGIC)
            or hashlib.blake2b(payload, digest_size=DIGEST_BYTES).digest() != data[len(MAGIC) : header]
        ):
            path.unlink(missing_ok=True)
            return None
        self.bytes_read += len(payload)
        return payload

    def delete(self, key: bytes) -> None:
        self.path(key).unlink(missing_ok=True)
