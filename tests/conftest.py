"""Shared fixtures: the GPU marker's skip, the build toolchain's check, and the bundle the GPU tests run."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch


def gpu_available() -> bool:
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if gpu_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


#: Set to 1 where the tests run without the build toolchain on purpose: the GPU machine, which
#: tests a bundle built elsewhere (scripts/device_run.sh). Anywhere else a missing TVM or nvcc
#: fails the tests that need them, so that CI cannot turn green by skipping the build.
NO_TOOLCHAIN_ENV = "TVM_RMSQUANT_NO_TOOLCHAIN"


def require_toolchain(nvcc: bool = True) -> None:
    """Fail (or, with $TVM_RMSQUANT_NO_TOOLCHAIN=1, skip) unless TVM and, with ``nvcc``, nvcc are installed."""
    missing = []
    if importlib.util.find_spec("tvm") is None:
        missing.append("the TVM compiler (the [build] extra: pip install -e '.[build]')")
    if nvcc:
        from tvm_rmsquant.codegen.nvcc import NvccError, find_nvcc

        try:
            find_nvcc()
        except NvccError as error:
            missing.append(str(error))
    if not missing:
        return
    if os.environ.get(NO_TOOLCHAIN_ENV) == "1":
        pytest.skip(f"{NO_TOOLCHAIN_ENV}=1 and the build toolchain is missing: {'; '.join(missing)}", allow_module_level=True)
    pytest.fail(f"the build toolchain the README requires is missing: {'; '.join(missing)} (set {NO_TOOLCHAIN_ENV}=1 only "
                "on a machine that tests a carried bundle)", pytrace=False)


@pytest.fixture(scope="session")
def gpu_bundle():
    """The bundle named by $TVM_RMSQUANT_BUNDLE (or the default location), verified."""
    from tvm_rmsquant.loader import BundleError, open_bundle

    try:
        bundle = open_bundle()
    except BundleError as error:
        pytest.fail(f"GPU tests need a built bundle: {error} (TVM_RMSQUANT_BUNDLE={os.environ.get('TVM_RMSQUANT_BUNDLE')})")
    bundle.check_device(torch.cuda.get_device_capability())
    return bundle


#: Parametrize a test's ``device`` fixture over these (``indirect=True``): the CPU path, and
#: the bundle's CUDA kernels on a GPU.
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture
def device(request):
    """"cpu", or "cuda" with the bundle's kernels routed in."""
    if request.param == "cuda":
        from tvm_rmsquant import ops

        ops.use_bundle(request.getfixturevalue("gpu_bundle"))
    return request.param


def pytest_terminal_summary(terminalreporter):
    """State the measured CPU equivalence fractions (the issue's bar) in the output."""
    module = sys.modules.get("test_expr_cpu")
    AGREEMENTS = getattr(module, "AGREEMENTS", None)
    if not AGREEMENTS:
        return
    write = terminalreporter.write_line
    elements = sum(a.elements for *_, a in AGREEMENTS)
    worst_codes = min(AGREEMENTS, key=lambda row: row[3].codes_identical)
    worst_scales = max(AGREEMENTS, key=lambda row: row[3].scales_max_units)
    identical = sum(a.codes_identical * a.elements for *_, a in AGREEMENTS) / max(elements, 1)
    write(f"CPU equivalence: {len(AGREEMENTS)} (spec, K, M) cases, {elements} fp8 codes")
    write(f"  codes identical overall {identical:.7f}; worst case {worst_codes[3].codes_identical:.6f} ({worst_codes[0]} K={worst_codes[1]} M={worst_codes[2]})")
    write(f"  max code distance {max(a.codes_max_distance for *_, a in AGREEMENTS)}; scales exactly equal overall "
          f"{sum(a.scales_exact for *_, a in AGREEMENTS) / len(AGREEMENTS):.6f}")
    write(f"  largest scale difference {worst_scales[3].scales_max_units:.3g} units ({worst_scales[0]} K={worst_scales[1]} M={worst_scales[2]})")
    write(f"  residual outputs bit-identical in {sum(1 for *_, a in AGREEMENTS if a.residual_identical)} of "
          f"{sum(1 for *_, a in AGREEMENTS if a.residual_identical is not None)} residual cases")
