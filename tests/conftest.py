"""Shared fixtures: the GPU marker's skip, and the bundle the GPU tests run."""

from __future__ import annotations

import os

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
