"""Build FlashInfer's fused add + RMSNorm + FP8 block-quant kernel as a benchmark peer (issue 24).

Downloads the pinned ``flashinfer-python`` wheel into a temporary folder, takes its kernel
headers (``data/include``, ``data/cutlass/include``, ``data/spdlog/include``), and compiles this
project's one-function tvm-ffi binding (``scripts/flashinfer_peer.cu``) against them with nvcc
for sm_90a. The wheel (62 MB, and it wants many CUDA packages) cannot travel to the GPU machine;
the library (a few MB) can. Nothing of FlashInfer's is kept beside the library.

    python3 scripts/build_flashinfer_peer.py [--out artifacts/flashinfer_peer]

The benchmark's ``flashinfer`` provider loads ``<out>/flashinfer_peer.so`` (or
$TVM_RMSQUANT_FLASHINFER_PEER).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tvm_rmsquant.codegen.nvcc import NvccError, ffi_paths, find_nvcc
from tvm_rmsquant.target import SM_90A

#: The FlashInfer the issue measured against.
WHEEL = "flashinfer-python==0.7.2.post1"
BINDING = Path(__file__).with_name("flashinfer_peer.cu")
LIBRARY = "flashinfer_peer.so"
#: Its kernel is Hopper code (the target module's record); FlashInfer's own AOT flags for it.
ARCH = SM_90A
FLAGS = ["-O3", "-std=c++17", "--expt-relaxed-constexpr", "-shared", "-Xcompiler", "-fPIC",
         "-DENABLE_BF16", "-DENABLE_FP8", "-DFLASHINFER_ENABLE_BF16", "-DFLASHINFER_ENABLE_F16", "-DFLASHINFER_ENABLE_FP8_E4M3"]
#: Headers the kernel's includes name but never use for this kernel: empty stand-ins.
STUBS = ("cublasLt.h", "cublas_v2.h", "curand_kernel.h")
HEADER_ROOTS = ("flashinfer/data/include/", "flashinfer/data/cutlass/include/", "flashinfer/data/spdlog/include/")


def download(folder: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(folder), WHEEL], check=True)
    wheels = sorted(folder.glob("flashinfer_python-*.whl"))
    if not wheels:
        raise SystemExit(f"pip download {WHEEL} gave no wheel in {folder}")
    return wheels[0]


def extract_headers(wheel: Path, folder: Path) -> list:
    with zipfile.ZipFile(wheel) as archive:
        members = [name for name in archive.namelist() if name.startswith(HEADER_ROOTS)]
        archive.extractall(folder, members)
    stubs = folder / "stubs"
    stubs.mkdir()
    for name in STUBS:
        (stubs / name).write_text("// empty: not used by the fused norm kernel\n")
    return [folder / root for root in HEADER_ROOTS] + [stubs]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("artifacts/flashinfer_peer"))
    args = parser.parse_args(argv)
    nvcc = find_nvcc()
    args.out.mkdir(parents=True, exist_ok=True)
    library = args.out / LIBRARY
    with tempfile.TemporaryDirectory() as scratch:
        scratch = Path(scratch)
        includes = extract_headers(download(scratch), scratch)
        paths = ffi_paths()
        partial = scratch / LIBRARY
        command = [nvcc, *FLAGS, ARCH.gencode, *(f"-I{path}" for path in includes),
                   f"-I{paths['include']}", f"-I{paths['dlpack']}", "-o", str(partial), str(BINDING),
                   f"-L{paths['libdir']}", "-ltvm_ffi", "-lcudart"]
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            raise NvccError("nvcc failed on the FlashInfer peer:\n" + "\n".join(result.stderr.strip().splitlines()[-20:]))
        partial.replace(library) if partial.stat().st_dev == args.out.stat().st_dev else library.write_bytes(partial.read_bytes())
    print(f"built {library} ({library.stat().st_size // 1024} KiB) from {WHEEL} for {ARCH.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
