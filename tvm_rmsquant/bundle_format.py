"""On-disk layout of a kernel bundle, shared by the builder and the loader.

    <dir>/CURRENT                    digest of the live bundle
    <dir>/bundles/<digest>/manifest.json, lib_*.so, lib_*.cu, torch_ops.so, torch_ops.cpp
    <dir>/.lock                      flock'ed by a build while it publishes (readers never take it)
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

#: 2: a variant's entry point picks its M-bucket kernels in C++.
#: 3: the bundle ships the allocating torch ops' C++ implementation (torch_ops.so).
SCHEMA_VERSION = 3
MANIFEST_FILE = "manifest.json"
CURRENT_FILE = "CURRENT"
LOCK_FILE = ".lock"


def sha256_file(path: Path) -> str:
    """Content hash of one file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_digest(body: bytes) -> str:
    """A bundle's name: the start of its manifest's sha256 (the manifest holds every file's hash)."""
    return hashlib.sha256(body).hexdigest()[:16]


def bundle_dir(root: Path, digest: str) -> Path:
    return Path(root) / "bundles" / digest


def read_current(root: Path) -> Optional[str]:
    """The live bundle's digest, or None when ``root`` has none (OSError or UnicodeDecodeError
    when CURRENT cannot be read: the loader turns those into BundleError)."""
    try:
        digest = (Path(root) / CURRENT_FILE).read_text().strip()
    except FileNotFoundError:
        return None
    return digest or None


def default_cache_dir() -> Path:
    """$TVM_RMSQUANT_CACHE, else $XDG_CACHE_HOME/tvm_rmsquant, else ~/.cache/tvm_rmsquant."""
    root = os.environ.get("TVM_RMSQUANT_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tvm_rmsquant"
    )
    return Path(root)


def default_bundle_dir() -> Path:
    return default_cache_dir() / "bundle"
