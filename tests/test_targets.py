"""GPU targets: bundles that hold SASS for several archs, and the device check that picks by capability.

Builds two small bundles with the real toolchain (nvcc compiles sm_90a and sm_100a without a
GPU); a device of another capability is simulated by patching torch's CUDA queries.
"""

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from unittest import mock

import pytest
import torch

from conftest import require_toolchain

from tvm_rmsquant.target import DEFAULT_ARCHS, SM_100A, TARGETS, for_capability, parse_archs

#: What ``select(4096, torch.bfloat16, consumer="deepgemm_sm100")`` asks for.
SM100_SPEC_NAME = "bf16_k4096_g128_col_ue8m0_packed"


def test_targets_are_one_record_each_and_the_default_holds_hopper_and_blackwell():
    assert DEFAULT_ARCHS == ("sm_90a", "sm_100a")
    assert [TARGETS[arch].capability for arch in DEFAULT_ARCHS] == [(9, 0), (10, 0)]
    assert TARGETS["sm_100a"].gencode == "-gencode=arch=compute_100a,code=sm_100a"
    assert parse_archs("sm_100a, sm_90a,sm_100a") == ("sm_100a", "sm_90a")
    assert for_capability((10, 0), DEFAULT_ARCHS) is SM_100A
    with pytest.raises(ValueError, match=r"compute capability 8.0; the bundle has code for sm_90a \(compute capability 9.0\)$"):
        for_capability((8, 0), ["sm_90a"])


@pytest.mark.parametrize("value", ["sm_80", "sm_90a,sm_89", ""])
def test_cli_arch_misuse_exits_2_with_one_line_naming_the_value_and_the_archs(value, tmp_path):
    result = subprocess.run([sys.executable, "-m", "tvm_rmsquant", "build", "--arch", value, "--out", str(tmp_path / "out")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --arch={value!r}: ") and lines[0].endswith("the archs are sm_90a, sm_100a"), lines


# -- built bundles ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundles(tmp_path_factory):
    """(two-arch bundle, sm_90a-only bundle), each holding the deepgemm_sm100 consumer's 4096 kernel."""
    require_toolchain()
    from tvm_rmsquant.codegen import bundle as builder
    from tvm_rmsquant.spec import VariantSpec

    root = tmp_path_factory.mktemp("targets")
    spec = VariantSpec.parse(SM100_SPEC_NAME)
    builder.build([spec], root / "both", jobs=2, cache_dir=root / "cache")
    builder.build([spec], root / "hopper", jobs=2, cache_dir=root / "cache", archs=("sm_90a",))
    return root / "both", root / "hopper"


def _cuobjdump() -> str:
    """cuobjdump next to nvcc, on PATH, or from the nvidia-cuda-cuobjdump wheel (the [test] extra)."""
    from tvm_rmsquant.codegen.nvcc import find_nvcc

    wheel = importlib.util.find_spec("nvidia")
    candidates = [Path(find_nvcc()).resolve().parent / "cuobjdump", shutil.which("cuobjdump")]
    candidates += [Path(path) / "cu13" / "bin" / "cuobjdump" for path in (wheel.submodule_search_locations if wheel else [])]
    found = next((str(path) for path in candidates if path and os.access(path, os.X_OK)), None)
    if found is None:
        pytest.fail("cuobjdump not found: pip install -e '.[test]' installs it (nvidia-cuda-cuobjdump)", pytrace=False)
    return found


def _elf_archs(library: Path) -> set:
    """The archs of the device modules ``cuobjdump --list-elf`` lists in ``library``."""
    listing = subprocess.run([_cuobjdump(), "--list-elf", str(library)], capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"\.(sm_\w+)\.cubin", listing))


def test_every_library_of_a_default_build_holds_sass_for_each_arch(bundles):
    from tvm_rmsquant.loader import Bundle

    bundle = Bundle(bundles[0])
    assert bundle.target_archs == list(DEFAULT_ARCHS)
    # torch_ops.so has no kernels, but nvcc links a device module into it: the bundle's archs, not nvcc's default sm_75
    for library in [*bundle.manifest["libraries"], bundle.manifest["torch_ops"]["library"]]:
        assert _elf_archs(bundle.path / library) == set(DEFAULT_ARCHS), library
    for entry in bundle.manifest["variants"].values():
        assert sorted(entry["ptxas"]) == sorted(DEFAULT_ARCHS) and all(figures["registers"] > 0 for figures in entry["ptxas"].values())
    hopper = Bundle(bundles[1])
    for library in (next(iter(hopper.manifest["libraries"])), hopper.manifest["torch_ops"]["library"]):
        assert _elf_archs(hopper.path / library) == {"sm_90a"}, library


@pytest.fixture
def device_capability(monkeypatch):
    """Make this process's torch report one CUDA device of the given capability (select's queries only)."""

    def simulate(capability):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    return simulate


def _select_sm100(bundle):
    from tvm_rmsquant import select

    with mock.patch("tvm_rmsquant.dispatch.logger"):  # the fallback's warning is asserted through why
        return select(4096, torch.bfloat16, consumer="deepgemm_sm100", bundle=bundle)


def test_a_blackwell_device_gets_the_two_arch_bundles_kernel(bundles, device_capability):
    device_capability((10, 0))
    kernel = _select_sm100(bundles[0])
    assert kernel.variant == SM100_SPEC_NAME, kernel.why


@pytest.mark.parametrize("capability, which", [((10, 0), 1), ((8, 0), 0), ((8, 0), 1)])
def test_a_device_the_bundle_has_no_code_for_is_refused_with_the_archs_it_has(bundles, device_capability, capability, which):
    device_capability(capability)
    kernel = _select_sm100(bundles[which])
    archs = list(DEFAULT_ARCHS) if which == 0 else ["sm_90a"]
    reason = next(candidate.reason for candidate in kernel.why if candidate.name == "bundle")
    assert kernel.variant is None and f"the device has compute capability {capability[0]}.{capability[1]}" in reason
    assert all(f"{arch} (compute capability" in reason for arch in archs) and ("sm_100a" in reason) == (which == 0), reason


@pytest.mark.gpu
def test_on_a_gpu_a_blackwell_capability_is_served_by_the_two_arch_bundle(bundles, monkeypatch):
    """On a real GPU (any), the select() path for a (10, 0) device picks the two-arch bundle's kernel."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    kernel = _select_sm100(bundles[0])
    assert kernel.variant == SM100_SPEC_NAME, kernel.why
