"""Packaging contract: generic names stay inside the namespace; the runtime needs no TVM."""

import subprocess
import sys


def test_schedules_and_codegen_are_not_top_level_imports(tmp_path):
    # From outside the checkout, so that only what is installed can be found.
    code = (
        "import importlib.util as u, sys;"
        "sys.exit(0 if u.find_spec('schedules') is None and u.find_spec('codegen') is None"
        " and u.find_spec('tvm_rmsquant.schedules') and u.find_spec('tvm_rmsquant.codegen') else 1)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=tmp_path).returncode == 0


def test_the_runtime_import_path_does_not_import_the_tvm_compiler(tmp_path):
    code = (
        "import sys, tvm_rmsquant, tvm_rmsquant.loader, tvm_rmsquant.reference, tvm_rmsquant.ops, tvm_rmsquant.dispatch;"
        "import tvm_rmsquant.schedules, tvm_rmsquant.tune, tvm_rmsquant.schedules.database, tvm_rmsquant.schedules.search;"
        "bad = sorted(m for m in sys.modules if m == 'tvm' or m.startswith('tvm.'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_tuning_database_ships_with_the_package(tmp_path):
    """The build reads it by default, from wherever the package is installed."""
    code = "from tvm_rmsquant.schedules.database import DEFAULT_DATABASE as d; assert d.is_file(), d"
    assert subprocess.run([sys.executable, "-c", code], cwd=tmp_path).returncode == 0
