"""The offline build: specs -> libraries -> a bundle directory with ``manifest.json``.

A pipeline of plain steps:

    plan        spec -> its schedules (rule, knobs; one per M bucket when tuned), grouped into libraries
    lower       library -> CUDA C++ source        cached on the inputs' content and the archs
    compile     source -> .so + ptxas figures     cached on the source, toolchain and archs (one
                                                  nvcc call, SASS for every arch of the build)
    torch ops   torch_ops.cpp -> torch_ops.so     cached on the source, toolchain, torch and archs
    publish     stage a bundle, then switch ``CURRENT`` to it atomically

Every cache entry has a record of its size and sha256 (``<key>.json``): an entry that no
longer matches it is made again, never hashed into a manifest that would verify.

The bundle directory holds ``bundles/<digest>/`` (manifest, .so, .cu, the torch ops'
.so and .cpp) and a ``CURRENT``
file naming the live one. Readers follow ``CURRENT`` once, so a build that is killed,
fails, or races another never leaves them a half-written bundle. Builds publish one at a
time, under an flock of the bundle directory's ``.lock``.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import fcntl
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
from tvm_rmsquant.bundle_format import (CURRENT_FILE, LOCK_FILE, MANIFEST_FILE, SCHEMA_VERSION, bundle_dir, default_cache_dir, dynamic_symbols,
                                        installed_libtvm_ffi, manifest_digest, read_current, sha256_file, tvm_ffi_imports)
from tvm_rmsquant.loader import BundleError
from tvm_rmsquant.schedules import default_schedule
from tvm_rmsquant.spec import VariantSpec
from tvm_rmsquant.target import DEFAULT_ARCHS, scheduling_target, targets

from . import nvcc as nvcc_step

#: The allocating ops' C++ implementation, built against torch's stable ABI into every bundle.
TORCH_OPS_SOURCE = Path(__file__).with_name("torch_ops.cpp")
TORCH_OPS_LIBRARY = "torch_ops.so"
#: The packages whose code may decide a kernel (all of their files, never a hand-kept list):
#: their content keys only the memo of kernel digests. The lowering cache is keyed on the
#: kernels themselves (``lowering_key``).
_CODE_PACKAGES = ("tvm_rmsquant", "tvm_rmsquant.schedules", "tvm_rmsquant.codegen")


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
    """What a build did. ``variants`` counts specs, ``kernels`` what was lowered for them: a
    tuned spec has one kernel per M bucket that wants its own schedule, a candidate bundle one
    per candidate (the default build: 414 variants in 432 kernels)."""

    bundle: Path
    variants: int
    kernels: int
    libraries: int
    lowered: int
    compiled: int
    published: bool
    seconds: float

    def counts(self) -> str:
        def count(number: int, one: str, many: str) -> str:
            return f"{number} {one if number == 1 else many}"
        return (f"{count(self.variants, 'variant', 'variants')} ({count(self.kernels, 'kernel', 'kernels')}) "
                f"in {count(self.libraries, 'library', 'libraries')}")

    def summary(self) -> str:
        if not self.published:
            return f"up to date: {self.counts()}, nothing rebuilt ({self.seconds:.1f} s) -> {self.bundle}"
        return (
            f"built {self.counts()}: lowered {self.lowered}, "
            f"compiled {self.compiled}, the rest from cache ({self.seconds:.1f} s) -> {self.bundle}"
        )


# -- identity ---------------------------------------------------------------------------------


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def code_fingerprint() -> str:
    """Hash of every source file of the packages that may decide a kernel (content only,
    never times or paths): a change anywhere in them voids the remembered kernel digests."""
    import importlib

    digest = hashlib.sha256()
    for package in _CODE_PACKAGES:
        root = Path(importlib.import_module(package).__file__).parent
        for path in sorted(path for path in root.iterdir() if path.suffix in (".py", ".cuh", ".cpp")):
            digest.update(package.encode() + b"/" + path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


class KernelDigests:
    """``lower.kernel_digest``, remembered in the cache per code fingerprint and toolchain.

    Every build keys its lowering cache on each kernel's digest, and the tuning database
    checks each record's, and a digest schedules the kernel (about 0.075 s each here): 36
    records alone took 2.5 s of a 5.7 s no-change rebuild. The key is all the code that may
    decide a kernel and the toolchain (not PDL, which changes the launch, not the scheduled TIR
    a digest hashes); an unreadable or partial file is recomputed, and it is rewritten whole
    (atomically) when it grows. Calling it computes a digest it lacks; the build's lowering
    workers compute theirs beside the source and hand them over with ``learn``.
    """

    def __init__(self, cache_dir: Path, tools: Dict):
        deciding = {name: value for name, value in tools.items() if name != "pdl"}
        key = sha256_bytes(json.dumps({"code": code_fingerprint(), "tools": deciding}, sort_keys=True).encode())[:16]
        self._target = scheduling_target(tools["target_archs"])
        self._path = cache_dir / "digests" / f"{key}.json"
        try:
            known = json.loads(self._path.read_text())
        except (OSError, ValueError):
            known = {}
        if not isinstance(known, dict) or not all(isinstance(value, str) for value in known.values()):
            known = {}
        self._known: Dict[str, str] = known

    @staticmethod
    def name(spec: VariantSpec, rule: str, knobs: Dict[str, int]) -> str:
        return f"{spec.name}|{rule}|{json.dumps(knobs, sort_keys=True)}"

    def known(self, spec: VariantSpec, rule: str, knobs: Dict[str, int]) -> Optional[str]:
        return self._known.get(self.name(spec, rule, knobs))

    def learn(self, digests: Dict[str, str]) -> None:
        """Remember ``digests`` (``name`` -> digest), computed elsewhere by ``lower.kernel_digest``."""
        if any(self._known.get(name) != digest for name, digest in digests.items()):
            self._known.update(digests)
            _atomic_write(self._path, json.dumps(self._known, sort_keys=True).encode())

    def __call__(self, spec: VariantSpec, rule: str, knobs: Dict[str, int]) -> str:
        digest = self.known(spec, rule, knobs)
        if digest is None:
            from .lower import kernel_digest

            digest = kernel_digest(spec, rule, knobs, self._target)
            self.learn({self.name(spec, rule, knobs): digest})
        return digest


def toolchain(archs: Sequence[str] = DEFAULT_ARCHS, pdl: bool = True) -> Dict:
    """Versions that a library depends on, the archs it holds SASS for and whether its kernels
    launch with programmatic dependent launch; recorded in the manifest and in cache keys."""
    from importlib import metadata

    targets(archs)  # refuse an unknown arch before any work
    nvcc = nvcc_step.find_nvcc()
    return {
        "package": __version__,
        "apache-tvm": metadata.version("apache-tvm"),
        "apache-tvm-ffi": metadata.version("apache-tvm-ffi"),
        "nvcc": nvcc_step.nvcc_version(nvcc),
        "nvcc_path": nvcc,
        "target_archs": list(archs),
        "pdl": pdl,
    }


# -- plan -------------------------------------------------------------------------------------


def plan(specs: Sequence[VariantSpec], choose=None, tuned=None, archs: Sequence[str] = DEFAULT_ARCHS) -> Dict[str, List[PlannedVariant]]:
    """Each spec's schedules for a build for ``archs``, grouped into libraries by (dtype,
    residual, static/dynamic K).

    ``choose(spec)`` gives (rule, knobs), by default each rule's default for the archs'
    scheduling target; ``tuned(spec, (rule, knobs))``, where given (a
    tuning database's ``schedules``), replaces that by [(max_rows, rule, knobs), ...]
    ending with max_rows None.
    """
    target = scheduling_target(archs)
    choose = choose or (lambda spec: default_schedule(spec, target))
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


def lowering_key(variants: List[PlannedVariant], tools: Dict[str, str], kernel_digest) -> str:
    """The lowering cache's key of one library: what its source is made of. Each kernel's
    scheduled TIR and knobs (``kernel_digest``), its symbol, the generated entry points, the
    TVM pass configuration, target archs and PDL, the code that lowers (``lower.py``: it adds the
    occupancy hint and the PDL wait, so an edit there changes sources that no digest sees) and
    the toolchain versions."""
    from . import lower

    lowering = [variant.as_lowering_input() for variant in variants]
    payload = {
        "kernels": [[kernel_digest(spec, rule, knobs), symbol, max_rows] for spec, rule, knobs, symbol, max_rows in lowering],
        "entry_points": sha256_bytes(lower.entry_points(lowering).encode()),
        "pass_config": lower.PASS_CONFIG,
        "tvm": tools["apache-tvm"],
        "tvm_ffi": tools["apache-tvm-ffi"],
        "archs": tools["target_archs"],
        "pdl": tools["pdl"],
        "lowering_code": sha256_file(Path(lower.__file__)),
    }
    return sha256_bytes(json.dumps(payload, sort_keys=True).encode())


def compile_key(source_sha: str, tools: Dict, flags: Sequence[str], **more: str) -> str:
    """The compile cache's key of one source; ``flags`` are nvcc's (a kernel library's hold one
    ``-gencode`` per arch, so a one-arch entry is never reused for a two-arch library);
    ``more`` names what else the library depends on."""
    payload = {"source": source_sha, "nvcc": tools["nvcc"], "flags": flags, "tvm_ffi": tools["apache-tvm-ffi"], **more}
    return sha256_bytes(json.dumps(payload, sort_keys=True).encode())


# -- cache ------------------------------------------------------------------------------------


def _atomic_write(path: Path, data: bytes) -> None:
    """Write via a temporary file and rename, so that a reader never sees a partial file;
    mode 0644, not mkstemp's 0600, so that other users can read a published ``CURRENT``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(handle, 0o644)
        with os.fdopen(handle, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


@contextlib.contextmanager
def _locked(path: Path):
    """Hold an flock of ``path`` (created if missing). The kernel keeps it for a process of any
    PID namespace and drops it when its holder dies, so no pid has to be asked if it lives."""
    handle = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield
    finally:
        os.close(handle)


def _cached(artifact: Path) -> Optional[Dict]:
    """The record (``<key>.json``: sha256, size, and what ``_store`` was given) of a cache entry
    whose artifact still matches it; None for a missing, truncated or altered one. A truncated
    library reused blindly is hashed into a manifest that verifies, and SIGBUSes at first use."""
    try:
        record = json.loads(artifact.with_suffix(".json").read_bytes())
        if artifact.stat().st_size == record["size"] and sha256_file(artifact) == record["sha256"]:
            return record
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def _store(artifact: Path, make: Callable[[Path], Optional[Dict]]) -> Dict:
    """Make a cache entry in a scratch directory (``make(path)`` writes it and returns what else
    to record), then move it in under the cache folder's lock unless a racing build stored a good
    one first, which is then used: a good entry never changes, so what a build hashed is what it
    copies later, and the cache never holds a partial file. Returns the entry's record."""
    artifact.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=artifact.parent) as scratch:
        staged = Path(scratch) / artifact.name
        record = {**(make(staged) or {}), "sha256": sha256_file(staged), "size": staged.stat().st_size}
        with _locked(artifact.parent / LOCK_FILE):
            stored = _cached(artifact)
            if stored is not None:
                return stored
            os.replace(staged, artifact)
            _atomic_write(artifact.with_suffix(".json"), json.dumps(record, sort_keys=True).encode())
    return record


def _lower_library(variants: List[PlannedVariant], tools: Dict, cache_dir: Path, reuse: bool = True) -> Tuple[Dict[str, str], str, Optional[str]]:
    """Worker entry point (imports TVM in the worker): the library's kernel digests
    (``KernelDigests.name`` -> digest), its lowering key, and its CUDA source, or None when
    ``reuse`` and the lowering cache holds that key already.

    Each kernel is scheduled once, for its digest and its source alike. Before, the main
    process scheduled all 411 kernels of a cold default build for their digests on one core
    (38 s here) while the other idled, and then the workers scheduled them again.
    """
    from tvm_rmsquant.codegen import lower

    target = scheduling_target(tools["target_archs"])
    lowering = [variant.as_lowering_input() for variant in variants]
    digests = {KernelDigests.name(spec, rule, knobs): lower.kernel_digest(spec, rule, knobs, target) for spec, rule, knobs, _, _ in lowering}
    key = lowering_key(variants, tools, lambda spec, rule, knobs: digests[KernelDigests.name(spec, rule, knobs)])
    if reuse and _cached(_lowered(cache_dir, key)) is not None:
        return digests, key, None
    return digests, key, lower.cuda_source(lowering, tools["target_archs"], tools["pdl"])


def _lowered(cache_dir: Path, key: str) -> Path:
    """The lowering cache's entry of a library's key."""
    return cache_dir / "lowered" / f"{key}.cu"


# -- build ------------------------------------------------------------------------------------


def unwritable(path: Path) -> Optional[str]:
    """Why the build cannot write the directory ``path`` (made if missing), or None. Asked before
    any work, so that misuse is refused at once, not after minutes of lowering and nvcc."""
    existing = next(parent for parent in (path, *path.parents) if os.path.exists(parent))
    if not existing.is_dir():
        return f"{existing} is a file; give a directory (made if missing)"
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as error:
        return f"{existing} cannot be written ({error.strerror}); give a writable directory"
    return None


def build(
    specs: Sequence[VariantSpec],
    out_dir: Path,
    jobs: int = 2,
    cache_dir: Optional[Path] = None,
    choose=None,
    tuned=None,
    progress: Optional[Callable[[str, int], None]] = None,
    extra: Optional[Dict] = None,
    archs: Sequence[str] = DEFAULT_ARCHS,
    pdl: bool = True,
) -> BuildReport:
    """Build ``specs`` into the bundle directory ``out_dir`` with SASS for ``archs`` (and PDL
    launches unless ``pdl`` is False); see the module docstring."""
    return build_libraries(plan(specs, choose, tuned, archs), out_dir, jobs, cache_dir, progress, extra, archs, pdl)


def build_libraries(
    libraries: Dict[str, List[PlannedVariant]],
    out_dir: Path,
    jobs: int = 2,
    cache_dir: Optional[Path] = None,
    progress: Optional[Callable[[str, int], None]] = None,
    extra: Optional[Dict] = None,
    archs: Sequence[str] = DEFAULT_ARCHS,
    pdl: bool = True,
) -> BuildReport:
    """Lower, compile and publish planned libraries for ``archs``; ``extra`` goes into the manifest as is."""
    started = time.time()
    out_dir, cache_dir = Path(out_dir), Path(cache_dir or default_cache_dir())
    tick = progress or (lambda stage, count: None)
    tools = toolchain(archs, pdl)
    fingerprint = code_fingerprint()
    kernel_digest = KernelDigests(cache_dir, tools)

    sources: Dict[str, Tuple[Path, str]] = {}
    to_lower: Dict[str, List[PlannedVariant]] = {}  # by the workers, which schedule each kernel once for digest and source
    for name, variants in libraries.items():
        if all(kernel_digest.known(variant.spec, variant.rule, dict(variant.knobs)) for variant in variants):
            cached = _lowered(cache_dir, lowering_key(variants, tools, kernel_digest))
            record = _cached(cached)
            if record is not None:
                sources[name] = (cached, record["sha256"])
                tick("lower", len(variants))
                continue
        to_lower[name] = variants

    objects: Dict[str, Tuple[Path, Dict]] = {}
    lowered: List[str] = []
    compiled: List[str] = []

    def compile_one(name: str) -> None:
        source, source_sha = sources[name]
        library = cache_dir / "compiled" / f"{compile_key(source_sha, tools, nvcc_step.kernel_flags(archs))}.so"
        record = _cached(library)
        if record is None:
            record = _store(library, lambda staged: {"ptxas": nvcc_step.compile_library(tools["nvcc_path"], source, staged, archs)})
            compiled.append(name)
        objects[name] = (library, record)
        tick("compile", 1)

    # One pipeline, not two phases: a library goes to nvcc as soon as it is lowered, the
    # largest are lowered first (nvcc's time grows with the library), and torch_ops.so
    # compiles beside them, so no core idles through a phase's tail (4 min 30 s in two phases,
    # 4 min 20 s so, on one machine; docs/perf.md, build time).
    ffi_exports = dynamic_symbols(installed_libtvm_ffi())[0]  # the libtvm_ffi.so that nvcc links against
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as compile_pool:
        torch_ops_future = compile_pool.submit(build_torch_ops, cache_dir, tools, ffi_exports)
        compiles = [compile_pool.submit(compile_one, name) for name in sorted(sources)]
        if to_lower:
            context = multiprocessing.get_context("spawn")
            with concurrent.futures.ProcessPoolExecutor(max_workers=max(1, min(jobs, len(to_lower))), mp_context=context) as pool:
                largest_first = sorted(to_lower, key=lambda name: (-len(to_lower[name]), name))
                futures = {pool.submit(_lower_library, to_lower[name], tools, cache_dir): name for name in largest_first}
                while futures:
                    future = next(concurrent.futures.as_completed(futures))
                    name = futures.pop(future)
                    digests, key, source = future.result()
                    kernel_digest.learn(digests)
                    cached = _lowered(cache_dir, key)
                    if source is None:
                        record = _cached(cached)
                        if record is None:  # the entry the worker found is gone or damaged since: lower it after all
                            futures[pool.submit(_lower_library, to_lower[name], tools, cache_dir, False)] = name
                            continue
                    else:
                        record = _store(cached, lambda staged: staged.write_bytes(source.encode()) and None)
                        lowered.append(name)
                    sources[name] = (cached, record["sha256"])
                    tick("lower", len(to_lower[name]))
                    compiles.append(compile_pool.submit(compile_one, name))
        for future in compiles:
            future.result()
        torch_ops, torch_ops_entry = torch_ops_future.result()

    manifest = {**_manifest(libraries, sources, objects, tools, fingerprint, ffi_exports, kernel_digest), "torch_ops": torch_ops_entry, **(extra or {})}
    files = {TORCH_OPS_LIBRARY: (torch_ops, torch_ops_entry["sha256"]), TORCH_OPS_SOURCE.name: (TORCH_OPS_SOURCE, torch_ops_entry["source_sha256"])}
    for name in libraries:
        files[f"{name}.cu"], files[f"{name}.so"] = sources[name], (objects[name][0], objects[name][1]["sha256"])
    published = publish(out_dir, manifest, files)
    return BuildReport(
        bundle=out_dir,
        variants=len({planned.spec for planned_variants in libraries.values() for planned in planned_variants}),
        kernels=sum(len(v) for v in libraries.values()),
        libraries=len(libraries),
        lowered=len(lowered),
        compiled=len(compiled),
        published=published,
        seconds=time.time() - started,
    )


def build_torch_ops(cache_dir: Path, tools: Dict, ffi_exports) -> Tuple[Path, Dict]:
    """torch_ops.so from the compile cache or nvcc, and its manifest entry (``ffi_exports``: what
    the libtvm_ffi.so it links against exports, to record what it imports of it). Host code
    only (torch_ops.cpp has no ``__global__``: it calls the kernel libraries' entry points);
    linked for the bundle's archs (``nvcc.torch_ops_flags``), so its empty device module is theirs."""
    import torch

    archs = tools["target_archs"]
    source_sha = sha256_file(TORCH_OPS_SOURCE)
    library = cache_dir / "compiled" / f"{compile_key(source_sha, tools, nvcc_step.torch_ops_flags(archs), torch=torch.__version__)}.so"
    record = _cached(library) or _store(library, lambda staged: nvcc_step.compile_torch_ops(tools["nvcc_path"], TORCH_OPS_SOURCE, staged, archs))
    entry = {
        "library": TORCH_OPS_LIBRARY,
        "sha256": record["sha256"],
        "source": TORCH_OPS_SOURCE.name,
        "source_sha256": source_sha,
        "torch_stable_target": ".".join(map(str, nvcc_step.TORCH_STABLE_TARGET)),
        "built_with_torch": torch.__version__,
        "tvm_ffi_imports": tvm_ffi_imports(library, ffi_exports),
    }
    return library, entry


def _manifest(libraries, sources, objects, tools, fingerprint, ffi_exports, kernel_digest) -> Dict:
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "toolchain": {key: value for key, value in tools.items() if key != "nvcc_path"},
        "code_fingerprint": fingerprint,
        "libraries": {},
        "variants": {},
    }
    for name, variants in sorted(libraries.items()):
        record = objects[name][1]
        manifest["libraries"][f"{name}.so"] = {"sha256": record["sha256"], "source": f"{name}.cu", "source_sha256": sources[name][1],
                                               "tvm_ffi_imports": tvm_ffi_imports(objects[name][0], ffi_exports)}
        for variant in variants:
            entry = variant.manifest_entry(f"{name}.so", record["ptxas"])
            if variant.candidate:
                entry["kernel_digest"] = kernel_digest(variant.spec, variant.rule, dict(variant.knobs))
                manifest.setdefault("candidates", {})[variant.symbol] = entry
            elif variant.max_rows is None:
                manifest["variants"].setdefault(variant.spec.name, {}).update(entry)
            else:
                manifest["variants"].setdefault(variant.spec.name, {}).setdefault("by_rows", []).append(entry)
    for entry in manifest["variants"].values():
        entry.get("by_rows", []).sort(key=lambda bucket: bucket["max_rows"])
    return manifest


def publish(out_dir: Path, manifest: Dict, files: Dict[str, Tuple[Path, str]]) -> bool:
    """Stage the bundle (``files``: name in the bundle -> where it is now and its sha256), rename
    it into ``bundles/``, point ``CURRENT`` at it, and prune.

    All of it holds the directory's lock: two builds finishing together would otherwise each
    keep only its own bundle and the one before and delete the other's, which CURRENT may name.
    So a staging directory exists only while its build holds the lock, and one found under the
    lock is a dead build's. Files are 0644 and folders 0755, so that other users can load it.
    Returns False when the live bundle already has this exact content, hashed file by file: a
    live bundle with a corrupted or missing file gets the good one back, atomically.
    """
    body = json.dumps(manifest, indent=1, sort_keys=True).encode()
    digest = manifest_digest(body)
    hashes = {**{name: sha for name, (_, sha) in files.items()}, MANIFEST_FILE: sha256_bytes(body)}
    bundles, target = out_dir / "bundles", bundle_dir(out_dir, digest)
    _make_dirs(bundles)
    with _locked(out_dir / LOCK_FILE):
        previous = read_current(out_dir)
        if previous == digest and not _damaged(target, hashes):
            return False
        for abandoned in bundles.glob(".staging-*"):
            shutil.rmtree(abandoned, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(dir=bundles, prefix=".staging-"))
        try:
            for name, (path, _) in files.items():
                shutil.copyfile(path, staging / name)
            (staging / MANIFEST_FILE).write_bytes(body)
            changed = [str(files[name][0]) for name in _damaged(staging, hashes)]
            if changed:
                raise BundleError(f"{', '.join(changed)} changed while the build copied it into the bundle; nothing was published: build again")
            for path in staging.iterdir():
                path.chmod(0o644)
            staging.chmod(0o755)
            if target.exists():  # published before, maybe damaged since: os.replace swaps each bad file whole
                for name in _damaged(target, hashes):
                    os.replace(staging / name, target / name)
                shutil.rmtree(staging)
            else:
                os.rename(staging, target)
            if previous != digest:
                _atomic_write(out_dir / CURRENT_FILE, (digest + "\n").encode())
                _prune(bundles, keep={digest, previous})
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    return True


def _damaged(directory: Path, hashes: Dict[str, str]) -> List[str]:
    """The files of ``directory`` that are missing, unreadable or not the content ``hashes`` names."""
    damaged = []
    for name, expected in sorted(hashes.items()):
        try:
            if sha256_file(directory / name) == expected:
                continue
        except OSError:
            pass
        damaged.append(name)
    return damaged


def _make_dirs(path: Path) -> None:
    """``mkdir -p`` with the folders it makes 0755 whatever the umask, so other users can read the bundle."""
    if not path.is_dir():
        _make_dirs(path.parent)
        path.mkdir(exist_ok=True)
        path.chmod(0o755)


def _prune(bundles: Path, keep) -> None:
    """Keep the live bundle and the one before it (a reader may still be opening it)."""
    for old in bundles.iterdir():
        if not old.name.startswith(".") and old.name not in keep:
            shutil.rmtree(old, ignore_errors=True)
