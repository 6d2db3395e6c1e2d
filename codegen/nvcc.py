"""nvcc: find it, identify it, and compile one translation unit into a shared library."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List

GENCODE = "-gencode=arch=compute_90a,code=sm_90a"
#: No --use_fast_math: it makes y / s an approximate division and breaks the contract.
NVCC_FLAGS = ["-shared", "-O3", "-std=c++17", "-Xcompiler", "-fPIC", GENCODE, "-Xptxas", "-v"]


class NvccError(RuntimeError):
    pass


def find_nvcc() -> str:
    """$NVCC, then nvcc on PATH, then $CUDA_HOME/bin and /usr/local/cuda/bin."""
    candidates = [os.environ.get("NVCC"), shutil.which("nvcc")]
    for root in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if root:
            candidates.append(os.path.join(root, "bin", "nvcc"))
    for candidate in candidates:
        if candidate and os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise NvccError(
        "nvcc not found: set NVCC=/path/to/nvcc, put it on PATH, or set CUDA_HOME "
        "(the build needs CUDA 12.4+ for sm_90a)"
    )


def nvcc_version(nvcc: str) -> str:
    """The 'Build cuda_...' line of ``nvcc --version``, which names the exact release."""
    output = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    builds = [line.strip() for line in output.splitlines() if line.startswith("Build ")]
    return builds[-1] if builds else output.strip().splitlines()[-1]


def ffi_paths() -> Dict[str, str]:
    """Include and library directories of the installed apache-tvm-ffi."""
    from tvm_ffi import libinfo

    return {
        "include": libinfo.find_include_path(),
        "dlpack": libinfo.find_dlpack_include_path(),
        "libdir": str(Path(libinfo.find_libtvm_ffi()).parent),
    }


def compile_command(nvcc: str, source: Path, library: Path) -> List[str]:
    paths = ffi_paths()
    return [
        nvcc, *NVCC_FLAGS,
        f"-I{paths['include']}", f"-I{paths['dlpack']}",
        "-o", str(library), str(source),
        f"-L{paths['libdir']}", "-ltvm_ffi", "-lcudart",
    ]


_ENTRY = re.compile(r"Compiling entry function '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USAGE = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas(log: str) -> Dict[str, Dict[str, int]]:
    """Per kernel: registers, spill stores/loads, stack frame and shared memory bytes."""
    kernels: Dict[str, Dict[str, int]] = {}
    current = None
    for line in log.splitlines():
        if match := _ENTRY.search(line):
            current = kernels.setdefault(match.group(1), {})
        elif current is not None and (match := _FRAME.search(line)):
            current.update(stack=int(match.group(1)), spill_stores=int(match.group(2)), spill_loads=int(match.group(3)))
        elif current is not None and (match := _USAGE.search(line)):
            current.update(registers=int(match.group(1)), smem=int(match.group(2) or 0))
    return kernels


def compile_library(nvcc: str, source: Path, library: Path) -> Dict[str, Dict[str, int]]:
    """Compile ``source`` into ``library``; returns the ptxas figures per kernel."""
    result = subprocess.run(compile_command(nvcc, source, library), capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-20:])
        raise NvccError(f"nvcc failed on {source.name} (exit {result.returncode}):\n{tail}")
    return parse_ptxas(result.stderr + result.stdout)
