"""nvcc: find it, identify it, and compile one translation unit into a shared library.

Two kinds of library: the kernels (CUDA C++ from TVM, needing only libtvm_ffi and
libcudart), and the torch ops' C++ implementation (``torch_ops.cpp``, host code against
torch's stable ABI, so that it runs on any torch from ``TORCH_STABLE_TARGET`` on).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Sequence

from tvm_rmsquant.bundle_format import installed_libtvm_ffi
from tvm_rmsquant.target import targets

#: No --use_fast_math: it makes y / s an approximate division and breaks the contract.
NVCC_FLAGS = ["-shared", "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-Xptxas", "-v"]


#: The oldest torch whose stable ABI has what torch_ops.cpp uses (str arguments, torch_call_dispatcher).
TORCH_STABLE_TARGET = (2, 10)
TORCH_OPS_FLAGS = [
    "-shared", "-O2", "-std=c++17", "-Xcompiler", "-fPIC",
    f"-DTORCH_TARGET_VERSION=0x{TORCH_STABLE_TARGET[0]:02x}{TORCH_STABLE_TARGET[1]:02x}000000000000",
]


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
        "(the build is tested with CUDA 13.0; its default archs need CUDA 12.8 or later)"
    )


def nvcc_version(nvcc: str) -> str:
    """The 'Build cuda_...' line of ``nvcc --version``, which names the exact release."""
    output = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    builds = [line.strip() for line in output.splitlines() if line.startswith("Build ")]
    return builds[-1] if builds else output.strip().splitlines()[-1]


def cuda_major(version: str) -> int:
    """The CUDA major version in ``nvcc_version``'s line ('Build cuda_13.0.r13.0/...' -> 13),
    which names the libcudart soname (libcudart.so.13) that the libraries need."""
    match = re.search(r"(?:cuda_|release )(\d+)\.", version)
    if match is None:
        raise NvccError(f"no CUDA version in nvcc's version line {version!r}")
    return int(match.group(1))


def ffi_paths() -> Dict[str, str]:
    """Include and library directories of the installed apache-tvm-ffi (the library the loader checks bundles against)."""
    from tvm_ffi import libinfo

    return {
        "include": libinfo.find_include_path(),
        "dlpack": libinfo.find_dlpack_include_path(),
        "libdir": str(Path(installed_libtvm_ffi()).parent),
    }


def gencodes(archs: Sequence[str]) -> List[str]:
    """One ``-gencode`` per arch, from the target module."""
    return [target.gencode for target in targets(archs)]


def kernel_flags(archs: Sequence[str]) -> List[str]:
    """NVCC_FLAGS and one ``-gencode`` per arch: one call embeds every arch's SASS in the library."""
    return [*NVCC_FLAGS, *gencodes(archs)]


def compile_command(nvcc: str, source: Path, library: Path, archs: Sequence[str]) -> List[str]:
    paths = ffi_paths()
    return [
        nvcc, *kernel_flags(archs),
        f"-I{paths['include']}", f"-I{paths['dlpack']}",
        "-o", str(library), str(source),
        f"-L{paths['libdir']}", "-ltvm_ffi", "-lcudart",
    ]


def torch_paths() -> Dict[str, str]:
    """Include and library directories of the installed torch (its headers carry the stable ABI)."""
    import torch

    root = Path(torch.__file__).parent
    return {"include": str(root / "include"), "libdir": str(root / "lib")}


def torch_ops_flags(archs: Sequence[str]) -> List[str]:
    """TORCH_OPS_FLAGS and the archs' ``-gencode``s. torch_ops.cpp has no device code, but nvcc's
    link step still embeds a device module (empty): for its default arch, sm_75, unless told the
    bundle's, which is what ``cuobjdump --list-elf`` then shows beside the kernel libraries'."""
    return [*TORCH_OPS_FLAGS, *gencodes(archs)]


def torch_ops_command(nvcc: str, source: Path, library: Path, archs: Sequence[str]) -> List[str]:
    """libtorch_cpu for the C shim; libtorch_cuda's stream getter is looked up at run time."""
    paths, torch_dirs = ffi_paths(), torch_paths()
    return [
        nvcc, *torch_ops_flags(archs),
        f"-I{torch_dirs['include']}", f"-I{paths['include']}", f"-I{paths['dlpack']}",
        "-o", str(library), str(source),
        f"-L{paths['libdir']}", "-ltvm_ffi", f"-L{torch_dirs['libdir']}", "-ltorch_cpu", "-lcudart",
    ]


def compile_torch_ops(nvcc: str, source: Path, library: Path, archs: Sequence[str]) -> None:
    _run(torch_ops_command(nvcc, source, library, archs), source)


_ENTRY = re.compile(r"Compiling entry function '(\w+)' for '(\w+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USAGE = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas(log: str) -> Dict[str, Dict[str, Dict[str, int]]]:
    """Per kernel, per arch: registers, spill stores/loads, stack frame and shared memory bytes."""
    kernels: Dict[str, Dict[str, Dict[str, int]]] = {}
    current = None
    for line in log.splitlines():
        if match := _ENTRY.search(line):
            current = kernels.setdefault(match.group(1), {}).setdefault(match.group(2), {})
        elif current is not None and (match := _FRAME.search(line)):
            current.update(stack=int(match.group(1)), spill_stores=int(match.group(2)), spill_loads=int(match.group(3)))
        elif current is not None and (match := _USAGE.search(line)):
            current.update(registers=int(match.group(1)), smem=int(match.group(2) or 0))
    return kernels


def compile_library(nvcc: str, source: Path, library: Path, archs: Sequence[str]) -> Dict[str, Dict[str, Dict[str, int]]]:
    """Compile ``source`` into ``library`` with SASS for each of ``archs``; returns the ptxas figures per kernel and arch."""
    return parse_ptxas(_run(compile_command(nvcc, source, library, archs), source))


def _run(command: List[str], source: Path) -> str:
    """Run nvcc; its output, or NvccError with the tail of what it said."""
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        tail = "\n".join((result.stderr or result.stdout).strip().splitlines()[-20:])
        raise NvccError(f"nvcc failed on {source.name} (exit {result.returncode}):\n{tail}")
    return result.stderr + result.stdout
