"""The offline build step: codegen, nvcc, manifest, cache, atomic publish and loading checks.

Builds a small bundle with the real toolchain (nvcc compiles the default archs, sm_90a and
sm_100a, without a GPU).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import require_toolchain  # noqa: E402

require_toolchain()

from tvm_rmsquant.bundle_format import MANIFEST_FILE, manifest_digest, read_current, sha256_file  # noqa: E402
from tvm_rmsquant.codegen import bundle as builder  # noqa: E402
from tvm_rmsquant.codegen.nvcc import NvccError, cuda_major, find_nvcc, parse_ptxas  # noqa: E402
from tvm_rmsquant.loader import Bundle, BundleError  # noqa: E402
from tvm_rmsquant.spec import VariantSpec  # noqa: E402
from tvm_rmsquant.target import DEFAULT_ARCHS, scheduling_target  # noqa: E402

#: What the default build schedules for.
TARGET = scheduling_target(DEFAULT_ARCHS)

SPECS = [
    VariantSpec("bf16", 2048, 128, True, "col", "ue8m0_packed"),
    VariantSpec("bf16", 2048, 128, False, "row", "fp32"),
    VariantSpec("bf16", None, 128, False, "col", "fp32"),
]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("build")
    report = builder.build(SPECS, root / "bundle", jobs=2, cache_dir=root / "cache")
    return root, report


def _kernel_sources(bundle_root):
    bundle = Bundle(bundle_root)
    return [(bundle.path / library["source"]).read_text() for library in bundle.manifest["libraries"].values()]


def test_every_kernel_launches_with_pdl_and_waits_before_its_first_read(built, tmp_path):
    """Programmatic dependent launch (on by default): the launcher sets the stream-serialization
    attribute and the kernel's first statement waits on the grids it depends on. ``--no-pdl``
    (``pdl=False``) builds neither, from its own lowering cache entry."""
    import re

    from tvm_rmsquant.codegen.lower import GRID_DEPENDENCY

    for source in _kernel_sources(built[0] / "bundle"):
        kernels = re.findall(r"__global__ void __launch_bounds__\([\d, ]+\) (\w+)\([^;{]*\)\s*\{\n", source)
        assert kernels
        for kernel in kernels:
            body = source[source.index(f"{kernel}(", source.index("__launch_bounds__")) :]
            assert body[body.index("{\n") + 2 :].startswith(GRID_DEPENDENCY), kernel
        assert source.count("cudaLaunchAttributeProgrammaticStreamSerialization") == len(kernels)
    report = builder.build(SPECS[:1], tmp_path / "bundle", jobs=1, cache_dir=built[0] / "cache", pdl=False)
    assert report.lowered == 1 and Bundle(tmp_path / "bundle").manifest["toolchain"]["pdl"] is False
    # PDL changes the launch, not the scheduled TIR: both builds share one memo of kernel digests.
    assert len(list((built[0] / "cache" / "digests").glob("*.json"))) == 1
    for source in _kernel_sources(tmp_path / "bundle"):
        assert "griddepcontrol" not in source and "ProgrammaticStreamSerialization" not in source


def test_build_publishes_a_verified_bundle_with_a_full_manifest(built):
    root, report = built
    assert report.published and report.variants == report.kernels == 3 and report.lowered == report.compiled == report.libraries == 3
    bundle = Bundle(root / "bundle")
    manifest = bundle.manifest
    assert set(manifest["toolchain"]) == {"package", "apache-tvm", "apache-tvm-ffi", "nvcc", "target_archs", "pdl"}
    assert manifest["toolchain"]["pdl"] is True
    assert manifest["toolchain"]["apache-tvm"] == "0.27.0.post1" and manifest["toolchain"]["target_archs"] == ["sm_90a", "sm_100a"]
    assert bundle.names() == sorted(spec.name for spec in SPECS)
    for spec in SPECS:
        entry = bundle.entry(spec.name)
        assert VariantSpec.from_json(entry["spec"]) == spec
        # ptxas holds the residual variants at 80 registers with a 4-byte spill on sm_90a, the
        # configuration measured on the H200 (docs/perf.md, version 3); the rest spill nothing.
        hopper = entry["ptxas"]["sm_90a"]
        assert hopper["registers"] > 0 and hopper["spill_stores"] <= (4 if spec.residual else 0) and entry["ptxas"]["sm_100a"]["registers"] > 0
        source = (bundle.path / manifest["libraries"][entry["library"]]["source"]).read_text()
        assert entry["kernel"] == f"{spec.name}_grouped_kernel" and source.count(entry["kernel"]) >= 2
        assert f"__tvm_ffi_{spec.name}(" in source  # the public [M, K] entry point
    assert bundle.entry(SPECS[2].name)["rule"] == "dynamic_rows" and bundle.entry(SPECS[0].name)["rule"] == "row_resident"


SYSTEM_LIBRARIES = {"libstdc++.so.6", "libm.so.6", "libgcc_s.so.1", "libc.so.6"}


def _needed(library: Path) -> set:
    dynamic = subprocess.run(["readelf", "-d", str(library)], capture_output=True, text=True, check=True).stdout
    return {line.split("[")[1].split("]")[0] for line in dynamic.splitlines() if "(NEEDED)" in line}


def _cudart(bundle: Bundle) -> str:
    """The libcudart soname of the CUDA that built ``bundle`` (libcudart.so.13 with CUDA 13, .12 with 12)."""
    return f"libcudart.so.{cuda_major(bundle.manifest['toolchain']['nvcc'])}"


def test_cuda_major_is_read_from_nvccs_version_line():
    assert cuda_major("Build cuda_13.0.r13.0/compiler.36424714_0") == 13
    assert cuda_major("Build cuda_12.4.r12.4/compiler.34097967_0") == 12
    assert cuda_major("Cuda compilation tools, release 12.8, V12.8.93") == 12


def test_libraries_need_only_tvm_ffi_and_cudart(built):
    root, _ = built
    bundle = Bundle(root / "bundle")
    for library in bundle.manifest["libraries"]:
        names = _needed(bundle.path / library)
        assert names - {"libtvm_ffi.so", _cudart(bundle)} - SYSTEM_LIBRARIES == set(), names


def test_the_torch_ops_library_uses_only_torchs_stable_c_abi(built):
    """So one build runs on every torch from its target on (the build machine's torch 2.13
    CPU build made the library the H200's torch 2.11 runs): no C++ symbol of torch, c10 or ATen."""
    import torch

    bundle = Bundle(built[0] / "bundle")
    entry = bundle.torch_ops
    assert (entry["library"], entry["source"], entry["torch_stable_target"]) == ("torch_ops.so", "torch_ops.cpp", "2.10")
    assert entry["built_with_torch"] == torch.__version__
    library = bundle.path / entry["library"]
    assert _needed(library) - {"libtvm_ffi.so", "libtorch_cpu.so", _cudart(bundle)} - SYSTEM_LIBRARIES == set()
    symbols = subprocess.run(["nm", "-D", "--undefined-only", str(library)], capture_output=True, text=True, check=True).stdout.split()
    assert not [symbol for symbol in symbols if symbol.startswith(("_ZN3c10", "_ZN2at", "_ZN5torch", "_ZNK3c10", "_ZNK2at"))]
    assert "aoti_torch_empty_strided" in symbols and "torch_library_impl" in symbols


def test_the_torch_ops_library_takes_the_cuda_kernels_of_the_allocating_ops(built):
    """Loaded into this torch (a CPU build: ``native`` declines it, with the reason), the
    library registers the CUDA kernels and accepts the bundle's entry points."""
    script = (
        "import sys, torch; import tvm_rmsquant.ops; from tvm_rmsquant import native; from tvm_rmsquant.loader import Bundle;"
        "bundle = Bundle(sys.argv[1]); print(native.unavailable(bundle)); register = native._load(bundle);"
        "print(register(*native.registration(bundle, bundle.names()[0], '9.0,10.0')));"
        "ops = ('rms_norm_group_quant', 'fused_add_rms_norm_group_quant', 'add_rms_norm_group_quant', 'group_quant', 'rms_norm_per_block_quant');"
        "[print(op, [l for l in torch._C._dispatch_dump('tvm_rmsquant::' + op).splitlines() if l.startswith('CUDA')]) for op in ops]"
    )
    result = subprocess.run([sys.executable, "-c", script, str(built[0] / "bundle")], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    import torch

    assert lines[0] == f"torch {torch.__version__} is a CPU build"
    assert lines[1] == "1"  # variants registered
    for line in lines[2:6]:
        assert "torch_ops.cpp" in line, line
    assert "torch_ops.cpp" not in lines[6] and "ops.py" in lines[6]  # the out-variant stays Python


def test_entry_points_check_their_arguments_on_the_host(built):
    """The [M, K] entry point's checks run before any CUDA call, so they are testable without a GPU."""
    import torch

    bundle = Bundle(built[0] / "bundle")
    spec = SPECS[1]  # bf16_k2048_g128_row_fp32: x, weight, eps, q, scales
    function = bundle.function(spec.name)
    x, weight = torch.zeros(3, 2048, dtype=torch.bfloat16), torch.zeros(2048, dtype=torch.bfloat16)
    q, scales = torch.empty(3, 2048, dtype=torch.float8_e4m3fn), torch.empty(3, 16)
    refusals = [
        (TypeError, r"takes 5 arguments, got 4: \(x, weight, eps, q, scales\)", (x, weight, 1e-6, q)),
        (ValueError, r"eps=0 \(0 in fp32\) must be positive and finite in fp32", (x, weight, 0.0, q, scales)),
        (ValueError, r"eps=nan \(nan in fp32\) must be positive and finite in fp32", (x, weight, float("nan"), q, scales)),
        # eps is checked in fp32, the precision the kernel adds it in.
        (ValueError, r"eps=1e\+39 \(inf in fp32\) must be positive and finite in fp32", (x, weight, 1e39, q, scales)),
        (ValueError, r"eps=1e-50 \(0 in fp32\) must be positive and finite in fp32", (x, weight, 1e-50, q, scales)),
        (ValueError, r"x must be 2-D, got 3-D of shape \[3, 16, 128\]", (x.view(3, 16, 128), weight, 1e-6, q, scales)),
        (TypeError, "x.dtype is float32; this variant takes bfloat16", (x.float(), weight, 1e-6, q, scales)),
        (ValueError, r"x.shape\[-1\]=100 is not a multiple of the group size 128", (torch.zeros(3, 100, dtype=torch.bfloat16), weight, 1e-6, q, scales)),
        (ValueError, r"x.shape\[-1\]=4096; this variant is built for 2048", (torch.zeros(3, 4096, dtype=torch.bfloat16), weight, 1e-6, q, scales)),
        (ValueError, "x is on DLPack device type 1; this is a CUDA kernel", (x, weight, 1e-6, q, scales)),
        (ValueError, "x is on DLPack device type 1", (x[:0], weight, 1e-6, q[:0], scales[:0])),
    ]
    for error, message, args in refusals:
        with pytest.raises(error, match=message):
            function(*args)


def test_a_rerun_with_nothing_changed_rebuilds_nothing(built):
    root, _ = built
    before = read_current(root / "bundle")
    again = builder.build(SPECS, root / "bundle", jobs=2, cache_dir=root / "cache")
    assert not again.published and again.lowered == 0 and again.compiled == 0
    assert "up to date" in again.summary() and read_current(root / "bundle") == before


def test_cache_keys_depend_on_content_not_paths_or_times(built, tmp_path):
    root, _ = built
    shutil.copytree(root / "cache", tmp_path / "moved-cache")
    for path in (tmp_path / "moved-cache").rglob("*"):
        os.utime(path, (0, 0))
    report = builder.build(SPECS, tmp_path / "elsewhere", jobs=1, cache_dir=tmp_path / "moved-cache")
    assert report.lowered == 0 and report.compiled == 0 and report.published


def test_the_lowering_cache_is_keyed_on_the_kernels_not_on_the_code_that_made_them(built, monkeypatch, tmp_path):
    """A code change that changes no kernel and not ``lower.py`` (simulated: another code
    fingerprint, so every kernel digest is computed again, by the lowering workers, never by the
    main process) lowers nothing; a schedule change lowers its library again, and only that one."""
    from tvm_rmsquant.codegen import lower

    root, _ = built
    shutil.copytree(root / "cache", tmp_path / "cache")
    monkeypatch.setattr(builder, "code_fingerprint", lambda: "another revision of the code")
    with monkeypatch.context() as patch:
        patch.setattr(lower, "kernel_digest", lambda *args: pytest.fail("the main process scheduled a kernel for its digest"))
        report = builder.build(SPECS, tmp_path / "same", jobs=1, cache_dir=tmp_path / "cache")
    assert (report.lowered, report.compiled) == (0, 0)
    remembered = builder.KernelDigests(tmp_path / "cache", builder.toolchain())  # under the new fingerprint
    for spec in SPECS:
        rule, knobs = builder.default_schedule(spec, TARGET)
        assert remembered.known(spec, rule, knobs) == lower.kernel_digest(spec, rule, knobs, TARGET)

    def other_knobs(spec):
        rule, knobs = builder.default_schedule(spec, TARGET)
        return rule, {**knobs, "min_blocks_per_sm": 2} if spec == SPECS[1] else knobs

    report = builder.build(SPECS, tmp_path / "changed", jobs=1, cache_dir=tmp_path / "cache", choose=other_knobs)
    assert (report.lowered, report.compiled) == (1, 1)


def test_the_lowering_cache_is_keyed_on_the_code_that_lowers(monkeypatch, tmp_path):
    """``lower.py`` makes each library's source from its kernels' scheduled TIR (and puts the PDL
    wait into it): an edit there lowers again, whatever the digests."""
    from tvm_rmsquant.codegen import lower

    variants = next(iter(builder.plan(SPECS[:1]).values()))
    key = lambda: builder.lowering_key(variants, builder.toolchain(), lambda spec, rule, knobs: "a digest")
    before = key()
    edited = tmp_path / "lower.py"
    edited.write_text(Path(lower.__file__).read_text() + "\n# an edit\n")
    monkeypatch.setattr(lower, "__file__", str(edited))
    assert key() != before


def test_a_failed_build_leaves_the_previous_bundle_live(built, monkeypatch, tmp_path):
    root, _ = built
    before = read_current(root / "bundle")
    fake = tmp_path / "nvcc"
    fake.write_text("#!/bin/sh\necho 'Build cuda_99.9'; [ \"$1\" = --version ] && exit 0; echo boom >&2; exit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("NVCC", str(fake))
    with pytest.raises(NvccError, match="boom"):
        builder.build(SPECS, root / "bundle", jobs=1, cache_dir=root / "cache")
    assert read_current(root / "bundle") == before
    assert not list((root / "bundle" / "bundles").glob(".staging-*"))
    Bundle(root / "bundle")


def test_corrupted_libraries_and_manifests_are_refused(built, tmp_path):
    root, _ = built
    copy = tmp_path / "copy"
    shutil.copytree(root / "bundle", copy)
    bundle = Bundle(copy)
    library = next(iter(bundle.manifest["libraries"]))
    with open(bundle.path / library, "r+b") as handle:
        handle.seek(100)
        handle.write(b"\x00corrupt")
    with pytest.raises(BundleError, match="corrupted"):
        Bundle(copy)
    manifest = bundle.path / MANIFEST_FILE
    manifest.write_text(manifest.read_text().replace('"sm_90a"', '"sm_80"'))
    with pytest.raises(BundleError, match="digest"):
        Bundle(copy)
    with pytest.raises(BundleError, match="no bundle"):
        Bundle(tmp_path / "nowhere")


@pytest.mark.parametrize("stage", ["lowered", "compiled"])
def test_a_truncated_cache_entry_is_made_again_not_published(built, tmp_path, stage):
    """A truncated library in the compile cache was hashed into a manifest that verifies and
    SIGBUSed at first use; a truncated lowered source was compiled as it was. Each is made again."""
    root, _ = built
    cache = tmp_path / "cache"
    shutil.copytree(root / "cache", cache)
    bundle = Bundle(root / "bundle")
    name, entry = next(iter(sorted(bundle.manifest["libraries"].items())))
    suffix, sha = (".cu", entry["source_sha256"]) if stage == "lowered" else (".so", entry["sha256"])
    cached = next(path for path in (cache / stage).glob(f"*{suffix}") if sha256_file(path) == sha)
    os.truncate(cached, cached.stat().st_size // 2)
    report = builder.build(SPECS, tmp_path / "bundle", jobs=1, cache_dir=cache)
    assert (report.lowered, report.compiled) == ((1, 0) if stage == "lowered" else (0, 1))
    rebuilt = Bundle(tmp_path / "bundle")
    # The entry was made again: the same source (TVM's output is deterministic), the library the bundle holds (nvcc's need not be).
    assert sha256_file(cached) == (sha if stage == "lowered" else rebuilt.manifest["libraries"][name]["sha256"])
    assert (rebuilt.path / name).stat().st_size == (bundle.path / name).stat().st_size


def test_a_library_truncated_after_the_bundle_opened_is_refused_before_it_loads(built, tmp_path):
    """Libraries load lazily; loading one truncated since the bundle was opened killed the process (SIGBUS)."""
    copy = tmp_path / "copy"
    shutil.copytree(built[0] / "bundle", copy)
    script = (
        "import os, sys; from tvm_rmsquant.loader import Bundle, BundleError;"
        "bundle = Bundle(sys.argv[1]); name = bundle.names()[0]; library = bundle.path / bundle.entry(name)['library'];"
        "os.truncate(library, library.stat().st_size // 2)\n"
        "try: bundle.function(name)\nexcept BundleError as error: print('refused:', error)"
    )
    result = subprocess.run([sys.executable, "-c", script, str(copy)], capture_output=True, text=True)
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert result.stdout.startswith("refused:") and "lib_" in result.stdout and "the file is corrupted" in result.stdout, result.stdout


def test_a_rebuild_over_a_corrupted_live_bundle_repairs_it(built, tmp_path):
    """It said 'up to date … nothing rebuilt' and left the bundle refused."""
    root, _ = built
    live = tmp_path / "live"
    shutil.copytree(root / "bundle", live)
    before = read_current(live)
    bundle = Bundle(live)
    with open(bundle.path / next(iter(bundle.manifest["libraries"])), "r+b") as handle:
        handle.seek(100)
        handle.write(b"\x00corrupt")
    with pytest.raises(BundleError, match="corrupted"):
        Bundle(live)
    report = builder.build(SPECS, live, jobs=1, cache_dir=root / "cache")
    assert report.published and (report.lowered, report.compiled) == (0, 0)
    assert read_current(live) == before and Bundle(live).names() == sorted(spec.name for spec in SPECS)
    assert not builder.build(SPECS, live, jobs=1, cache_dir=root / "cache").published


def test_device_capability_is_checked(built):
    bundle = Bundle(built[0] / "bundle")
    bundle.check_device((9, 0))
    assert bundle.check_device((10, 0)).name == "sm_100a"
    with pytest.raises(BundleError, match=r"compute capability 8.0; the bundle has code for sm_90a \(compute capability 9.0\), sm_100a \(compute capability 10.0\)"):
        bundle.check_device((8, 0))


def test_ptxas_report_is_parsed_per_kernel():
    log = """ptxas info    : Compiling entry function 'a_kernel' for 'sm_90a'
ptxas info    : Function properties for a_kernel
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 80 registers, used 1 barriers, 96 bytes smem"""
    assert parse_ptxas(log) == {"a_kernel": {"sm_90a": {"stack": 8, "spill_stores": 4, "spill_loads": 4, "registers": 80, "smem": 96}}}


def test_bench_times_the_kernel_a_model_gets_and_names_the_points_no_kernel_runs(built):
    """``bench``'s ours is what ``serving.choose`` gives a model: the static-K kernel, else the
    dynamic-K one; a grid spec neither serves is named before any timing (the CLI exits 2 with
    them), never skipped in silence."""
    from tvm_rmsquant.bench import OursProvider, grid_specs, missing_kernels, pair_spec

    root, _ = built
    bundle = Bundle(root / "bundle")
    specs = grid_specs("bf16", [2048, 3072], [("row", "fp32", None), ("col", "fp32", None)])
    ours = OursProvider(bundle)
    served = {spec.name: ours.variant(spec).name for spec in specs if ours.supports(spec)}
    assert served == {
        "bf16_k2048_g128_row_fp32": "bf16_k2048_g128_row_fp32",  # static K
        "bf16_k2048_g128_col_fp32": "bf16_kdyn_g128_col_fp32",  # no static kernel: dynamic K
        "bf16_k3072_g128_col_fp32": "bf16_kdyn_g128_col_fp32",
    }
    assert missing_kernels(bundle, specs) == [
        "bf16_k2048_g128_res_row_fp32", "bf16_k2048_g128_res_col_fp32", "bf16_k3072_g128_row_fp32",
        "bf16_k3072_g128_res_row_fp32", "bf16_k3072_g128_res_col_fp32",
    ]
    packed = grid_specs("bf16", [2048], [("col", "ue8m0_packed", None)], group=32)
    assert [spec.name for spec in packed] == ["bf16_k2048_g32_col_ue8m0_packed", "bf16_k2048_g32_res_col_ue8m0_packed"]
    assert missing_kernels(bundle, packed) == [spec.name for spec in packed]  # the bundle has G = 128 only
    assert missing_kernels(bundle, [pair_spec(2048)]) == ["bf16_k2048_g128_res_col_fp32"]  # --pairs is checked too


def test_cli_lists_and_inspects_a_bundle(built):
    root, _ = built
    env = {**os.environ, "TVM_RMSQUANT_BUNDLE": str(root / "bundle")}
    listing = subprocess.run([sys.executable, "-m", "tvm_rmsquant", "list"], capture_output=True, text=True, env=env, check=True).stdout
    assert all(spec.name in listing for spec in SPECS)
    shown = json.loads(subprocess.run([sys.executable, "-m", "tvm_rmsquant", "inspect", SPECS[0].name], capture_output=True, text=True, env=env, check=True).stdout)
    assert shown["knobs"] and Path(shown["source_path"]).exists() and "registers" in shown["ptxas"]["sm_90a"]
    bad = subprocess.run([sys.executable, "-m", "tvm_rmsquant", "build", "--hidden", "4100", "--out", str(root / "x")], capture_output=True, text=True, env=env)
    assert bad.returncode == 2 and "hidden=4100 is not divisible by group=128" in bad.stderr


def test_two_builds_racing_on_one_directory_both_finish_with_a_valid_bundle(built, tmp_path):
    root, _ = built
    script = (
        "import sys; from pathlib import Path; from tvm_rmsquant.codegen import bundle; from tvm_rmsquant.spec import VariantSpec;"
        f"specs = [VariantSpec.parse(n) for n in {[spec.name for spec in SPECS]!r}];"
        "bundle.build(specs, Path(sys.argv[1]), jobs=1, cache_dir=Path(sys.argv[2]))"
    )
    racers = [subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "shared"), str(root / "cache")]) for _ in range(2)]
    assert [racer.wait(timeout=300) for racer in racers] == [0, 0]
    bundle = Bundle(tmp_path / "shared")
    assert bundle.names() == sorted(spec.name for spec in SPECS)
    assert not list((tmp_path / "shared" / "bundles").glob(".staging-*"))


def _copy_with_manifest(built, tmp_path, change):
    """A copy of the bundle whose manifest ``change`` edits, re-signed so that only the edit is wrong."""
    copy = tmp_path / "signed"
    shutil.copytree(built[0] / "bundle", copy)
    old = Bundle(copy).path
    manifest = json.loads((old / MANIFEST_FILE).read_text())
    change(manifest)
    raw = json.dumps(manifest, indent=1, sort_keys=True).encode()
    digest = manifest_digest(raw)
    new = old.parent / digest
    old.rename(new)
    (new / MANIFEST_FILE).write_bytes(raw)
    (copy / "CURRENT").write_text(digest + "\n")
    return copy


@pytest.mark.parametrize(
    "change, reason",
    [
        (lambda m: m.update(schema_version=99), r"schema_version=99, this package reads"),
        (lambda m: m["toolchain"].update(target_archs=["sm_80"]), r"target_archs \['sm_80'\]: arch='sm_80' is not a known target; the archs are sm_90a, sm_100a"),
        (lambda m: next(iter(m["libraries"].values())).update(sha256="0" * 64), r"has sha256 .*the manifest says 000000000000"),
        (lambda m: m["torch_ops"].update(sha256="0" * 64), r"torch_ops.so has sha256 .*the manifest says 000000000000"),
    ],
)
def test_manifest_mismatches_are_refused_with_the_reason(built, tmp_path, change, reason):
    with pytest.raises(BundleError, match=reason):
        Bundle(_copy_with_manifest(built, tmp_path, change))


def test_a_missing_library_is_refused(built, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(built[0] / "bundle", copy)
    bundle = Bundle(copy)
    library = next(iter(bundle.manifest["libraries"]))
    (bundle.path / library).unlink()
    with pytest.raises(BundleError, match=f"is missing {library}"):
        Bundle(copy)


def test_a_killed_build_leaves_the_previous_bundle_usable(built, tmp_path):
    """SIGKILL mid-compile (nvcc made slow): CURRENT still names the old, verified bundle."""
    import signal
    import time

    root, _ = built
    live = tmp_path / "live"
    shutil.copytree(root / "bundle", live)
    before = read_current(live)
    slow = tmp_path / "nvcc"
    real = find_nvcc()
    slow.write_text(f'#!/bin/sh\n[ "$1" = --version ] && exec {real} --version\ntouch {tmp_path}/compiling; sleep 60\n')
    slow.chmod(0o755)
    script = (
        "import sys; from pathlib import Path; from tvm_rmsquant.codegen import bundle; from tvm_rmsquant.spec import VariantSpec;"
        "bundle.build([VariantSpec.parse('bf16_k1024_g128_row_fp32')], Path(sys.argv[1]), jobs=1, cache_dir=Path(sys.argv[2]))"
    )
    builder_process = subprocess.Popen([sys.executable, "-c", script, str(live), str(tmp_path / "cache")], env={**os.environ, "NVCC": str(slow)},
                                       start_new_session=True)
    deadline = time.time() + 120
    while not (tmp_path / "compiling").exists():
        assert builder_process.poll() is None and time.time() < deadline, "the build never reached nvcc"
        time.sleep(0.2)
    os.killpg(builder_process.pid, signal.SIGKILL)
    builder_process.wait()
    assert read_current(live) == before
    assert Bundle(live).names() == sorted(spec.name for spec in SPECS)
    assert not list((tmp_path / "cache").rglob("*.so")), "no partial library may enter the cache"


def test_row_offsets_in_the_generated_cuda_are_64_bit(built):
    """M * K can pass 2^31 (M = 300000, K = 7168): every kernel takes M as int64 and offsets rows in int64."""
    import re

    bundle = Bundle(built[0] / "bundle")
    for spec in SPECS:
        entry = bundle.entry(spec.name)
        source = (bundle.path / bundle.manifest["libraries"][entry["library"]]["source"]).read_text()
        signature = re.search(rf"__global__ void __launch_bounds__\(\d+\) {entry['kernel']}\(([^)]*)\)", source).group(1)
        assert "int64_t m" in signature and "int m," not in signature and not signature.endswith("int m"), signature
        assert "((int64_t)blockIdx.x)" in source
