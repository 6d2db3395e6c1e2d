"""apache-tvm-ffi as a range at runtime: a bundle is checked for the tvm-ffi functions its
libraries import, against a ``libtvm_ffi.so``, never for the version it was built with.

Other versions' ``libtvm_ffi.so`` come from the apache-tvm-ffi wheels in ``.whl/`` (those that
scripts/device_run.sh carries to the GPU machine; the library in a wheel is the same file for
every Python tag); a missing one is fetched there once, and a failed fetch fails the test.
Builds a small bundle with the real toolchain, as tests/test_build.py does.
"""

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import require_toolchain

require_toolchain()

from tvm_rmsquant.bundle_format import MANIFEST_FILE, installed_libtvm_ffi, manifest_digest  # noqa: E402
from tvm_rmsquant.codegen import bundle as builder  # noqa: E402
from tvm_rmsquant.loader import Bundle, BundleError  # noqa: E402
from tvm_rmsquant.spec import VariantSpec  # noqa: E402

WHEELS = Path(__file__).resolve().parents[1] / ".whl"
#: The runtime range's ends as checked here: vLLM 0.33.0's pin, and the newest 0.1.x on PyPI when written.
OTHER_VERSIONS = ("0.1.11", "0.1.15.post2")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A one-library bundle built against the installed apache-tvm-ffi (the build extra's pin)."""
    root = tmp_path_factory.mktemp("build")
    builder.build([VariantSpec("bf16", 2048, 128, False, "row", "fp32")], root / "bundle", jobs=2, cache_dir=root / "cache")
    return root / "bundle"


def libtvm_ffi_of(version: str, folder: Path) -> Path:
    """``libtvm_ffi.so`` of apache-tvm-ffi ``version``, taken out of its wheel in ``.whl/``,
    which is fetched there once where missing (the GPU machine's cp312 wheel, which
    scripts/device_run.sh carries)."""
    wheels = sorted(WHEELS.glob(f"apache_tvm_ffi-{version}-*.whl"))
    if not wheels:
        fetch = [sys.executable, "-m", "pip", "download", "-q", f"apache-tvm-ffi=={version}", "--no-deps", "--only-binary=:all:",
                 "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64", "-d", str(WHEELS)]
        result = subprocess.run(fetch, capture_output=True, text=True)
        wheels = sorted(WHEELS.glob(f"apache_tvm_ffi-{version}-*.whl"))
        if not wheels:
            pytest.fail(f"no apache-tvm-ffi {version} wheel in {WHEELS}, and `{' '.join(fetch)}` failed: {result.stderr.strip()}", pytrace=False)
    library = folder / version / "libtvm_ffi.so"
    library.parent.mkdir(parents=True)
    with zipfile.ZipFile(wheels[0]) as wheel:
        library.write_bytes(wheel.read("tvm_ffi/lib/libtvm_ffi.so"))
    return library


def _copy_with_manifest(built: Path, tmp_path: Path, change) -> Path:
    """A copy of the bundle whose manifest ``change`` edited, renamed to its new digest."""
    copy = tmp_path / "copy"
    shutil.copytree(built, copy)
    old = Bundle(copy).path
    manifest = json.loads((old / MANIFEST_FILE).read_text())
    change(manifest)
    raw = json.dumps(manifest, indent=1, sort_keys=True).encode()
    new = old.parent / manifest_digest(raw)
    old.rename(new)
    (new / MANIFEST_FILE).write_bytes(raw)
    (copy / "CURRENT").write_text(new.name + "\n")
    return copy


def _nm(path, *flags) -> set:
    output = subprocess.run(["nm", "-D", *flags, str(path)], capture_output=True, text=True, check=True).stdout
    return {line.split()[-1] for line in output.splitlines() if line.strip()}


def test_the_manifest_records_what_each_library_imports_from_libtvm_ffi_as_nm_reads_it(built):
    bundle = Bundle(built)
    exported = _nm(installed_libtvm_ffi(), "--defined-only")
    entries = {**bundle.manifest["libraries"], "torch_ops.so": bundle.torch_ops}
    for name, entry in entries.items():
        assert entry["tvm_ffi_imports"] == sorted(_nm(bundle.path / name, "--undefined-only") & exported), name
    # The kernels take torch's stream from tvm-ffi; torch_ops.so sets it and calls the kernels through it.
    assert {"TVMFFIEnvGetStream", "TVMFFIErrorSetRaisedFromCStrParts"} <= set(entries[next(iter(bundle.manifest["libraries"]))]["tvm_ffi_imports"])
    assert {"TVMFFIEnvSetStream", "TVMFFIFunctionCall"} <= set(bundle.torch_ops["tvm_ffi_imports"])


@pytest.mark.parametrize("version", OTHER_VERSIONS)
def test_a_bundle_built_here_passes_the_gate_of_another_tvm_ffi_version(built, tmp_path, version):
    """vLLM 0.33.0 pins 0.1.11; a bundle built with 0.1.14.post1 ran correctly on the H200 under
    0.1.11 and 0.1.15.post2, and the old gate (the version string) refused it under both."""
    bundle = Bundle(built)
    assert bundle.manifest["toolchain"]["apache-tvm-ffi"] != version
    assert all(entry["tvm_ffi_imports"] for entry in [*bundle.manifest["libraries"].values(), bundle.torch_ops])
    bundle.check_tvm_ffi(libtvm_ffi_of(version, tmp_path))  # raises BundleError if refused


def test_a_bundle_built_with_another_tvm_ffi_version_opens(built, tmp_path):
    """The version a bundle was built with is a record, not a gate (the old loader refused this)."""
    copy = _copy_with_manifest(built, tmp_path, lambda manifest: manifest["toolchain"].update({"apache-tvm-ffi": "0.1.11"}))
    assert Bundle(copy).manifest["toolchain"]["apache-tvm-ffi"] == "0.1.11"


def test_a_library_importing_a_function_the_installed_libtvm_ffi_lacks_is_refused_naming_it(built, tmp_path):
    manifest = Bundle(built).manifest
    library, built_with = next(iter(manifest["libraries"])), manifest["toolchain"]["apache-tvm-ffi"]
    copy = _copy_with_manifest(built, tmp_path, lambda manifest: manifest["libraries"][library]["tvm_ffi_imports"].append("TVMFFINoSuchFunction"))
    with pytest.raises(BundleError) as refused:
        Bundle(copy)
    message = str(refused.value)
    assert "\n" not in message
    assert f"{library} imports TVMFFINoSuchFunction, which {installed_libtvm_ffi()} does not export" in message
    assert message.endswith(f"install apache-tvm-ffi=={built_with}, the version the bundle was built with")


def test_the_gate_of_0_1_11_refuses_a_library_that_needs_a_function_added_in_0_1_14(built, tmp_path):
    """TVMFFIGetCustomAllocator is exported from 0.1.14 on; a library that calls it loads under
    0.1.11 (lazily) and dies with a symbol lookup error at the call, so the gate must refuse it."""
    copy = _copy_with_manifest(built, tmp_path, lambda manifest: manifest["torch_ops"]["tvm_ffi_imports"].append("TVMFFIGetCustomAllocator"))
    bundle = Bundle(copy)  # the installed 0.1.14.post1 exports it
    old = libtvm_ffi_of("0.1.11", tmp_path)
    with pytest.raises(BundleError, match=rf"torch_ops.so imports TVMFFIGetCustomAllocator, which {old} does not export"):
        bundle.check_tvm_ffi(old)
