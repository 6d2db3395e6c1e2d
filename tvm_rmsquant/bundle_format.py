"""On-disk layout of a kernel bundle, and what its libraries need of tvm-ffi; shared by the builder and the loader.

    <dir>/CURRENT                    digest of the live bundle
    <dir>/bundles/<digest>/manifest.json, lib_*.so, lib_*.cu, torch_ops.so, torch_ops.cpp
    <dir>/.lock                      flock'ed by a build while it publishes (readers never take it)

What a bundle needs of apache-tvm-ffi is the C functions its libraries import from
``libtvm_ffi.so`` (the kernel libraries: TVMFFIBacktrace, TVMFFIEnvGetStream,
TVMFFIErrorSetRaised, TVMFFIErrorSetRaisedFromCStrParts; ``torch_ops.so`` also
TVMFFIEnvSetStream, TVMFFIErrorMoveFromRaised, TVMFFIFunctionCall, TVMFFIGetTypeInfo,
TVMFFIObjectDecRef), not the version string of the wheel. Compared over the wheels of 0.1.11
(vLLM 0.33.0's pin), 0.1.14.post1 (the build's) and 0.1.15.post2 (newest on PyPI):

- ``libtvm_ffi.so`` exports every one of those in all three; 0.1.14.post1 and 0.1.15.post2
  export the same 50 ``TVMFFI*`` functions, 0.1.11 four fewer (TVMFFIBigIntFromByteArray,
  TVMFFIBigIntGetContentByteArray, TVMFFIGetCustomAllocator, TVMFFISetCustomAllocator).
- ``c_api.h`` only adds between 0.1.11 and 0.1.14.post1 (type indices 13, 77, 78, field flag
  1 << 12, the allocator structs and the functions above; one flag renamed, its value kept)
  and is the same in 0.1.15.post2 but for its version macro;
  ``dlpack.h`` is identical; DLTensor, TVMFFIAny, TVMFFIObject, TVMFFIErrorCell and
  TVMFFITypeInfo have the same size and offsets, compiled against each version's headers.
- A bundle built against 0.1.14.post1 ran correctly on the H200 under 0.1.11 and
  0.1.15.post2 with the old version-string check bypassed.

What does break is a missing symbol: tvm-ffi loads a library lazily, so a library that
imports a function the installed ``libtvm_ffi.so`` lacks loads, and the process dies
("symbol lookup error", exit 127) at the first call that reaches it (measured: a library
calling TVMFFIGetCustomAllocator, under 0.1.11). So the build records each library's imports
(``tvm_ffi_imports``) and the loader refuses a bundle whose imports the installed library does
not all export, before anything loads. The versions the runtime accepts are pyproject.toml's.
"""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path
from typing import FrozenSet, List, Optional, Tuple

#: 2: a variant's entry point picks its M-bucket kernels in C++.
#: 3: the bundle ships the allocating torch ops' C++ implementation (torch_ops.so).
#: 4: each library lists the tvm-ffi functions it imports (``tvm_ffi_imports``), which the
#:    loader checks in place of the apache-tvm-ffi version the bundle was built with.
#: 5: libraries hold SASS for several archs: ``toolchain.target_archs`` lists them (was one
#:    ``target_arch``) and each kernel's ``ptxas`` figures are keyed by arch.
#: 6: the torch ops library serves the standalone quant (``group_quant``): its
#:    ``register_variant`` takes the variant's ``norm`` flag.
SCHEMA_VERSION = 6
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


# -- what a library needs of tvm-ffi --------------------------------------------------------------

_SHT_DYNSYM = 11
#: STB_GLOBAL, STB_WEAK, STB_GNU_UNIQUE: the bindings another library can link against.
_VISIBLE_BINDINGS = (1, 2, 10)


def dynamic_symbols(path) -> Tuple[FrozenSet[str], FrozenSet[str]]:
    """(exported, imported): the names an ELF64 little-endian shared library defines for others
    and the ones it needs from others, read from its dynamic symbol table (what the dynamic
    linker binds). Read from the file, not through dlopen, so that any version's library can be
    examined without running its initialisers next to the loaded one. ValueError for a file that
    is not such a library."""
    data = Path(path).read_bytes()
    if data[:4] != b"\x7fELF" or data[4:6] != b"\x02\x01":
        raise ValueError(f"{path} is not a 64-bit little-endian ELF library")
    try:
        (section_table,) = struct.unpack_from("<Q", data, 0x28)
        entry_size, count = struct.unpack_from("<HH", data, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", data, section_table + index * entry_size) for index in range(count)]
        table = next((section for section in sections if section[1] == _SHT_DYNSYM), None)
        if table is None:
            raise ValueError(f"{path} has no dynamic symbol table")
        _, _, _, _, offset, size, link, _, _, symbol_size = table
        strings = sections[link][4]
        exported, imported = set(), set()
        for at in range(offset + symbol_size, offset + size, symbol_size):  # entry 0 is the null symbol
            name_at, info, other, section = struct.unpack_from("<IBBH", data, at)
            if info >> 4 not in _VISIBLE_BINDINGS or other & 3 in (1, 2):  # local, internal or hidden
                continue
            start = strings + name_at
            name = data[start:data.index(b"\0", start)].decode()
            (imported if section == 0 else exported).add(name)  # section 0: SHN_UNDEF
    except (struct.error, IndexError) as error:  # a table that points outside the file
        raise ValueError(f"{path} is a damaged ELF library ({error})") from None
    return frozenset(exported), frozenset(imported)


def tvm_ffi_imports(library, libtvm_ffi_exports: FrozenSet[str]) -> List[str]:
    """What ``library`` needs of tvm-ffi: the symbols it imports that the ``libtvm_ffi.so`` it
    was linked against exports (``dynamic_symbols(libtvm_ffi)[0]``). All of them, not only the
    ``TVMFFI*`` C functions that the libraries import today: C++ ones break too (TVM 0.27's
    libtvm_runtime imports ``tvm::ffi::json::Stringify(const Any&, const Optional<int>&)``,
    which 0.1.11 does not export, so ``import tvm`` fails under 0.1.11)."""
    return sorted(dynamic_symbols(library)[1] & libtvm_ffi_exports)


def installed_libtvm_ffi() -> str:
    """The ``libtvm_ffi.so`` that tvm-ffi loads in this environment (and links the build against)."""
    from tvm_ffi import libinfo

    return libinfo.find_libtvm_ffi()
