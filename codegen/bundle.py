"""The offline build: specs -> libraries -> a bundle directory with ``manifest.json``.

A pipeline of plain steps:

    plan        spec -> its schedules (rule, knobs; one per M bucket when tuned), grouped into libraries
    lower       library -> CUDA C++ source        cached on the inputs' content
    compile     source -> .so + ptxas figures     cached on the source and toolchain
    torch ops   torch_ops.cpp -> torch_ops.so     cached on the source, toolchain and torch
    publish     stage a bundle, then switch ``CURRENT`` to it atomically

The bundle directory holds ``bundles/<digest>/`` (manifest, .so, .cu, the torch ops'
.so and .cpp) and a ``CURRENT``
file naming the live one. Readers follow ``CURRENT`` once, so a build that is killed,
fails, or races another never leaves them a half-written bundle.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import hashlib
import json
import multiprocessing
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from tvm_rmsquant import __version__, launch
from tvm_rmsquant.bundle_format import CURRENT_FILE, MANIFEST_FILE, SCHEMA_VERSION, bundle_dir, default_cache_dir, read_current, sha256_file
from tvm_rmsquant.schedules import default_schedule
from tvm_rmsquant.spec import VariantSpec

from . import nvcc as nvcc_step

TARGET_ARCH = "sm_90a"
#: The allocating ops' C++ implementation, built against torch's stable ABI into every bundle.
TORCH_OPS_SOURCE = Path(__file__).with_name("torch_ops.cpp")
TORCH_OPS_LIBRARY = "torch_ops.so"
#: The files whose content decides the generated source; their hash keys the lowering cache.
_SOURCE_ROOTS = {
    "tvm_rmsquant": ("expr.py", "spec.py", "launch.py"),
    "tvm_rmsquant.schedules": None,
    "tvm_rmsquant.codegen": ("lower.py", "row_views.cuh"),
}


@dataclasses.dataclass(frozen=True)
class PlannedVariant:
    """One kernel: ``spec`` scheduled by ``rule`` with ``knobs``, exported as ``symbol``.

    ``max_rows`` makes it the spec's kernel for M <= max_rows only (None: every other M).
    A tuning ``candidate`` is listed for measurement and never dispatched to.
    """

    spec: VariantSpec
    rule: str
    knobs: Tuple[Tuple[str, int], ...]
    symbol: str
    max_rows: Optional[int] = None
    candidate: bool = False

    def as_lowering_input(self):
        return self.spec, self.rule, dict(self.knobs), self.symbol, self.max_rows

    def manifest_entry(self, library: str, figures: Dict) -> Dict:
        kernel = f"{launch.grouped_symbol(self.symbol)}_kernel"
        if kernel not in figures:
            raise nvcc_step.NvccError(f"ptxas reported no figures for kernel {kernel} of {library}; found {sorted(figures)[:4]}…")
        entry = {
            "spec": self.spec.to_json(),
            "rule": self.rule,
            "knobs": dict(self.knobs),
            "symbol": self.symbol,
            "library": library,
            "kernel": kernel,
            "ptxas": figures[kernel],
        }
        return entry if self.max_rows is None else {**entry, "max_rows": self.max_rows}


@dataclasses.dataclass
class BuildReport:
    bundle: Path
    variants: int
    libraries: int
    lowered: int
    compiled: int
    published: bool
    seconds: float

    def summary(self) -> str:
        if not self.published:
            return f"up to date: {self.variants} variants in {self.libraries} libraries, nothing rebuilt ({self.seconds:.1f} s) -> {self.bundle}"
        return (
            f"built {self.variants} variants in {self.libraries} libraries: lowered {self.lowered}, "
            f"compiled {self.compiled}, the rest from cache ({self.seconds:.1f} s) -> {self.bundle}"
        )


# -- identity ---------------------------------------------------------------------------------


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def code_fingerprint() -> str:
    """Hash of the source files that generate kernels (content only, never times or paths)."""
    import importlib

    digest = hashlib.sha256()
    for package, files in sorted(_SOURCE_ROOTS.items()):
        root = Path(importlib.import_module(package).__file__).parent
        for path in sorted(root.glob("*.py")) if files is None else [root / name for name in files]:
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def toolchain() -> Dict[str, str]:
    """Versions that a library depends on; recorded in the manifest and in cache keys."""
    from importlib import metadata

    nvcc = nvcc_step.find_nvcc()
    return {
        "package": __version__,
        "apache-tvm": metadata.version("apache-tvm"),
        "apache-tvm-ffi": metadata.version("apache-tvm-ffi"),
        "nvcc": nvcc_step.nvcc_version(nvcc),
        "nvcc_path": nvcc,
        "target_arch": TARGET_ARCH,
    }


# -- plan -------------------------------------------------------------------------------------


def plan(specs: Sequence[VariantSpec], choose=default_schedule, tuned=None) -> Dict[str, List[PlannedVariant]]:
    """Each spec's schedules, grouped into libraries by (dtype, residual, static/dynamic K).

    ``choose(spec)`` gives (rule, knobs); ``tuned(spec, (rule, knobs))``, where given (a
    tuning database's ``schedules``), replaces that by [(max_rows, rule, knobs), ...]
    ending with max_rows None.
    """
    libraries: Dict[str, List[PlannedVariant]] = {}
    for spec in sorted(set(specs), key=lambda spec: spec.name):
        chosen = choose(spec)
        schedules = tuned(spec, chosen) if tuned else [(None, *chosen)]
        name = f"lib_{spec.dtype}_{'res' if spec.residual else 'nores'}_{'dyn' if spec.is_dynamic else 'static'}"
        for max_rows, rule, knobs in schedules:
            symbol = spec.name if max_rows is None else f"{spec.name}__m{max_rows}"
            libraries.setdefault(name, []).append(PlannedVariant(spec, rule, tuple(sorted(knobs.items())), symbol, max_rows))
    return libraries


def plan_candidates(candidates: Dict[VariantSpec, List[Tuple[str, Dict[str, int]]]], per_library: int = 8) -> Dict[str, List[PlannedVariant]]:
    """Tuning candidates, ``per_library`` to a library so that lowering and nvcc run in parallel."""
    libraries: Dict[str, List[PlannedVariant]] = {}
    for spec in sorted(candidates, key=lambda spec: spec.name):
        for index, (rule, knobs) in enumerate(candidates[spec]):
            name = f"cand_{spec.name}_{index // per_library}"
            symbol = f"{spec.name}__t{index:03d}"
            libraries.setdefault(name, []).append(PlannedVariant(spec, rule, tuple(sorted(knobs.items())), symbol, candidate=True))
    return libraries


def lowering_key(variants: List[PlannedVariant], tools: Dict[str, str], fingerprint: str) -> str:
    payload = {
        "variants": [[v.spec.to_json(), v.rule, list(v.knobs), v.symbol] for v in variants],
        "code": fingerprint,
        "tvm": tools["apache-tvm"],
        "tvm_ffi": tools["apache-tvm-ffi"],
    }
    return sha256_bytes(json.dumps(payload, sort_keys=True).encode())


def compile_key(source_sha: str, tools: Dict[str, str], flags=nvcc_step.NVCC_FLAGS, **more: str) -> str:
    """The compile cache's key of one source; ``more`` names what else the library depends on."""
    payload = {"source": source_sha, "nvcc": tools["nvcc"], "flags": flags, "tvm_ffi": tools["apache-tvm-ffi"], **more}
    return sha256_bytes(json.dumps(payload, sort_keys=True).encode())


# -- cache ------------------------------------------------------------------------------------


def _atomic_write(path: Path, data: bytes) -> None:
    """Write via a temporary file and rename, so that a reader never sees a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(handle, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def _compile_atomically(library: Path, compile: Callable[[Path], object]):
    """Compile into a scratch file beside ``library``, then rename it there: the cache never
    holds a partial library. Returns what ``compile`` returns."""
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
        staged = Path(scratch) / library.name
        result = compile(staged)
        os.replace(staged, library)
    return result


def _lower_library(variants: List[PlannedVariant]) -> str:
    """Worker entry point: lower one library (imports TVM in the worker)."""
    from tvm_rmsquant.codegen import lower

    return lower.cuda_source([variant.as_lowering_input() for variant in variants])


# -- build ------------------------------------------------------------------------------------


def build(
    specs: Sequence[VariantSpec],
    out_dir: Path,
    jobs: int = 2,
    cache_dir: Optional[Path] = None,
    choose=default_schedule,
    tuned=None,
    progress: Optional[Callable[[str, int], None]] = None,
    extra: Optional[Dict] = None,
) -> BuildReport:
    """Build ``specs`` into the bundle directory ``out_dir``; see the module docstring."""
    return build_libraries(plan(specs, choose, tuned), out_dir, jobs, cache_dir, progress, extra)


def build_libraries(
    libraries: Dict[str, List[PlannedVariant]],
    out_dir: Path,
    jobs: int = 2,
    cache_dir: Optional[Path] = None,
    progress: Optional[Callable[[str, int], None]] = None,
    extra: Optional[Dict] = None,
) -> BuildReport:
    """Lower, compile and publish planned libraries; ``extra`` goes into the manifest as is."""
    started = time.time()
    out_dir, cache_dir = Path(out_dir), Path(cache_dir or default_cache_dir())
    tick = progress or (lambda stage, count: None)
    tools = toolchain()
    fingerprint = code_fingerprint()

    sources: Dict[str, Tuple[Path, str]] = {}
    to_lower = {}
    for name, variants in libraries.items():
        cached = cache_dir / "lowered" / f"{lowering_key(variants, tools, fingerprint)}.cu"
        if cached.exists():
            sources[name] = (cached, sha256_file(cached))
            tick("lower", len(variants))
        else:
            to_lower[name] = (cached, variants)
    if to_lower:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, min(jobs, len(to_lower))), mp_context=context) as pool:
            futures = {pool.submit(_lower_library, variants): name for name, (_, variants) in to_lower.items()}
            for future in concurrent.futures.as_completed(futures):
                name = futures[future]
                cached, variants = to_lower[name]
                source = future.result().encode()
                _atomic_write(cached, source)
                sources[name] = (cached, sha256_bytes(source))
                tick("lower", len(variants))

    objects: Dict[str, Tuple[Path, Dict]] = {}
    to_compile = {}
    for name, (source, source_sha) in sources.items():
        key = compile_key(source_sha, tools)
        library, report = cache_dir / "compiled" / f"{key}.so", cache_dir / "compiled" / f"{key}.json"
        if library.exists() and report.exists():
            objects[name] = (library, json.loads(report.read_text()))
            tick("compile", 1)
        else:
            to_compile[name] = (source, library, report)

    def compile_one(name: str):
        source, library, report = to_compile[name]
        figures = _compile_atomically(library, lambda staged: nvcc_step.compile_library(tools["nvcc_path"], source, staged))
        _atomic_write(report, json.dumps(figures, sort_keys=True).encode())
        return name, library, figures

    if to_compile:
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            for name, library, figures in pool.map(compile_one, sorted(to_compile)):
                objects[name] = (library, figures)
                tick("compile", 1)

    torch_ops, torch_ops_entry = build_torch_ops(cache_dir, tools)
    manifest = {**_manifest(libraries, sources, objects, tools, fingerprint), "torch_ops": torch_ops_entry, **(extra or {})}
    files = {TORCH_OPS_LIBRARY: torch_ops, TORCH_OPS_SOURCE.name: TORCH_OPS_SOURCE}
    for name in libraries:
        files[f"{name}.cu"], files[f"{name}.so"] = sources[name][0], objects[name][0]
    published = publish(out_dir, manifest, files)
    return BuildReport(
        bundle=out_dir,
        variants=sum(len(v) for v in libraries.values()),
        libraries=len(libraries),
        lowered=len(to_lower),
        compiled=len(to_compile),
        published=published,
        seconds=time.time() - started,
    )


def build_torch_ops(cache_dir: Path, tools: Dict[str, str]) -> Tuple[Path, Dict]:
    """torch_ops.so from the compile cache or nvcc, and its manifest entry."""
    import torch

    source_sha = sha256_file(TORCH_OPS_SOURCE)
    library = cache_dir / "compiled" / f"{compile_key(source_sha, tools, nvcc_step.TORCH_OPS_FLAGS, torch=torch.__version__)}.so"
    if not library.exists():
        _compile_atomically(library, lambda staged: nvcc_step.compile_torch_ops(tools["nvcc_path"], TORCH_OPS_SOURCE, staged))
    entry = {
        "library": TORCH_OPS_LIBRARY,
        "sha256": sha256_file(library),
        "source": TORCH_OPS_SOURCE.name,
        "source_sha256": source_sha,
        "torch_stable_target": ".".join(map(str, nvcc_step.TORCH_STABLE_TARGET)),
        "built_with_torch": torch.__version__,
    }
    return library, entry


def _manifest(libraries, sources, objects, tools, fingerprint) -> Dict:
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "toolchain": {key: value for key, value in tools.items() if key != "nvcc_path"},
        "code_fingerprint": fingerprint,
        "libraries": {},
        "variants": {},
    }
    for name, variants in sorted(libraries.items()):
        source_sha = sources[name][1]
        library, figures = objects[name]
        manifest["libraries"][f"{name}.so"] = {"sha256": sha256_file(library), "source": f"{name}.cu", "source_sha256": source_sha}
        for variant in variants:
            entry = variant.manifest_entry(f"{name}.so", figures)
            if variant.candidate:
                from . import lower  # imports TVM: only candidate bundles need it here

                entry["kernel_digest"] = lower.kernel_digest(variant.spec, variant.rule, dict(variant.knobs))
                manifest.setdefault("candidates", {})[variant.symbol] = entry
            elif variant.max_rows is None:
                manifest["variants"].setdefault(variant.spec.name, {}).update(entry)
            else:
                manifest["variants"].setdefault(variant.spec.name, {}).setdefault("by_rows", []).append(entry)
    for entry in manifest["variants"].values():
        entry.get("by_rows", []).sort(key=lambda bucket: bucket["max_rows"])
    return manifest


def publish(out_dir: Path, manifest: Dict, files: Dict[str, Path]) -> bool:
    """Stage the bundle (``files``: name in the bundle -> where it is now), rename it into
    ``bundles/``, then point ``CURRENT`` at it.

    Returns False when the live bundle already has this exact content.
    """
    body = json.dumps(manifest, indent=1, sort_keys=True).encode()
    digest = sha256_bytes(body)[:16]
    if read_current(out_dir) == digest and (bundle_dir(out_dir, digest) / MANIFEST_FILE).exists():
        return False
    (out_dir / "bundles").mkdir(parents=True, exist_ok=True)
    _remove_abandoned_staging(out_dir / "bundles")
    staging = Path(tempfile.mkdtemp(dir=out_dir / "bundles", prefix=f".staging-{os.getpid()}-"))
    try:
        for name, path in files.items():
            shutil.copyfile(path, staging / name)
        (staging / MANIFEST_FILE).write_bytes(body)
        try:
            os.rename(staging, bundle_dir(out_dir, digest))
        except OSError as error:
            # A racing build published the same content first: theirs is as good as ours.
            if error.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            shutil.rmtree(staging)
        previous = read_current(out_dir)
        _atomic_write(out_dir / CURRENT_FILE, (digest + "\n").encode())
        _prune(out_dir / "bundles", keep={digest, previous})
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return True


def _remove_abandoned_staging(bundles: Path) -> None:
    """Delete staging directories left by builds that were killed (their pid is gone)."""
    for staging in bundles.glob(".staging-*"):
        try:
            os.kill(int(staging.name.split("-")[1]), 0)
        except (ValueError, IndexError, ProcessLookupError):
            shutil.rmtree(staging, ignore_errors=True)
        except PermissionError:
            pass


def _prune(bundles: Path, keep) -> None:
    """Keep the live bundle and the one before it (a reader may still be opening it)."""
    for old in bundles.iterdir():
        if not old.name.startswith(".") and old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)
