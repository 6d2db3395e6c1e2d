"""Packaging contract: generic names stay inside the namespace; the runtime needs no TVM."""

import subprocess
import sys
from pathlib import Path


def test_schedules_and_codegen_are_not_top_level_imports(tmp_path):
    # From outside the checkout, so that only what is installed can be found.
    code = (
        "import importlib.util as u, sys;"
        "sys.exit(0 if u.find_spec('schedules') is None and u.find_spec('codegen') is None"
        " and u.find_spec('tvm_rmsquant.schedules') and u.find_spec('tvm_rmsquant.codegen') else 1)"
    )
    assert subprocess.run([sys.executable, "-c", code], cwd=tmp_path).returncode == 0


def test_the_runtime_import_path_does_not_import_the_tvm_compiler(tmp_path):
    """Nor vLLM: the plugin module looks vLLM's ops up in the graph by name."""
    code = (
        "import sys, tvm_rmsquant, tvm_rmsquant.loader, tvm_rmsquant.reference, tvm_rmsquant.ops, tvm_rmsquant.dispatch;"
        "import tvm_rmsquant.schedules, tvm_rmsquant.tune, tvm_rmsquant.schedules.database, tvm_rmsquant.schedules.search;"
        "import tvm_rmsquant.vllm;"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('tvm', 'vllm'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_build_modules_import_without_torch_and_register_no_ops(tmp_path):
    """The build's lowering workers import codegen and schedules: with torch unimportable
    (tvm-ffi's own optional ``import torch`` then passes), they still import, and nothing
    of the runtime (the ops, the dispatcher) comes with them."""
    code = (
        "import sys; sys.modules['torch'] = None;"
        "import tvm_rmsquant.schedules, tvm_rmsquant.schedules.search, tvm_rmsquant.schedules.database;"
        "import tvm_rmsquant.codegen.bundle, tvm_rmsquant.codegen.lower, tvm_rmsquant.codegen.nvcc;"
        "bad = sorted(m for m in sys.modules if m in ('tvm_rmsquant.ops', 'tvm_rmsquant.dispatch', 'tvm_rmsquant.native'));"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_any_public_name_registers_the_ops(tmp_path):
    code = (
        "import sys, torch, tvm_rmsquant; assert 'tvm_rmsquant.ops' not in sys.modules;"
        "tvm_rmsquant.VariantSpec; assert hasattr(torch.ops.tvm_rmsquant, 'rms_norm_per_block_quant')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_tuning_database_ships_with_the_package(tmp_path):
    """The build reads it by default, from wherever the package is installed."""
    code = "from tvm_rmsquant.schedules.database import DEFAULT_DATABASE as d; assert d.is_file(), d"
    assert subprocess.run([sys.executable, "-c", code], cwd=tmp_path).returncode == 0


def test_ci_runs_the_readmes_test_command_verbatim():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    command = (root / ".ci" / "run").read_text().strip().splitlines()[-1]
    readme = (root / "README.md").read_text()
    assert "2. Install the test dependencies" in readme and f"   {command}\n" in readme


#: Each fact's one home (issue 23): the arch names live in the target module, the packed UE8M0
#: test in the scale-layout module. Everything else asks them.
OWNED_LITERALS = {'"sm_90a"': "tvm_rmsquant/target.py", '== "ue8m0_packed"': "tvm_rmsquant/scale_layout.py"}


def test_arch_and_packed_layout_literals_live_only_in_their_owning_modules():
    root = Path(__file__).resolve().parents[1]
    sources = [path for folder in ("tvm_rmsquant", "schedules", "codegen", "scripts")
               for path in (root / folder).rglob("*") if path.suffix in (".py", ".cpp", ".cu", ".cuh", ".sh")]
    assert len(sources) > 20, sources
    for literal, owner in OWNED_LITERALS.items():
        strays = [str(path.relative_to(root)) for path in sources
                  if literal in path.read_text() and path.relative_to(root).as_posix() != owner]
        assert strays == [], f"{literal} outside {owner}: {strays}"
