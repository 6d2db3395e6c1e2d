"""Packaging contract: generic names stay inside the namespace; the runtime needs no TVM."""

import importlib.util
import subprocess
import sys


def test_schedules_and_codegen_are_not_top_level_imports():
    assert importlib.util.find_spec("schedules") is None
    assert importlib.util.find_spec("codegen") is None
    assert importlib.util.find_spec("tvm_rmsquant.schedules") is not None
    assert importlib.util.find_spec("tvm_rmsquant.codegen") is not None


def test_the_runtime_import_path_does_not_import_the_tvm_compiler():
    code = (
        "import sys, tvm_rmsquant, tvm_rmsquant.loader, tvm_rmsquant.reference, tvm_rmsquant.ops, tvm_rmsquant.dispatch;"
        "import tvm_rmsquant.schedules;"
        "bad = sorted(m for m in sys.modules if m == 'tvm' or m.startswith('tvm.'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
