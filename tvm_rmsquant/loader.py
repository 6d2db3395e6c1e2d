"""Load a prebuilt bundle with tvm-ffi alone, after checking that it is what it says.

The bundle location is, in order: the ``path`` argument, ``$TVM_RMSQUANT_BUNDLE``,
a bundle shipped inside the package (``tvm_rmsquant/_bundle``), then the build's
default output directory (``~/.cache/tvm_rmsquant/bundle``).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Dict, List, Optional

from .bundle_format import (CURRENT_FILE, MANIFEST_FILE, SCHEMA_VERSION, bundle_dir, default_bundle_dir, dynamic_symbols, installed_libtvm_ffi,
                            manifest_digest, read_current, sha256_file)
from .spec import VariantSpec
from .target import Target, for_capability, targets

ENV_VAR = "TVM_RMSQUANT_BUNDLE"
PACKAGE_BUNDLE = Path(__file__).parent / "_bundle"


class BundleError(RuntimeError):
    """A bundle is missing, corrupted, needs what the installed tvm-ffi lacks, or was built for another GPU."""


#: What a manifest must hold, and of which type, for this package to read it (a tuple: an object
#: of any keys whose values have the inner form; a list: an array whose items have it). Checked at
#: open, so that a bad manifest is a BundleError there, which select() falls back on, never a
#: KeyError or TypeError at first use.
_FILE = {"sha256": str, "source": str, "source_sha256": str, "tvm_ffi_imports": [str]}
_KERNEL = {"library": str, "symbol": str, "rule": str, "knobs": dict}
_MANIFEST = {
    "toolchain": {"apache-tvm-ffi": str, "target_archs": [str]},
    "libraries": (_FILE,),
    "torch_ops": {**_FILE, "library": str, "torch_stable_target": str},
    "variants": (_KERNEL,),
}
_CANDIDATES = ({**_KERNEL, "spec": dict, "kernel_digest": str, "ptxas": dict},)


def _check_form(value, form, where: str) -> None:
    if isinstance(form, (dict, tuple)) and not isinstance(value, dict):
        raise BundleError(f"{where} is a JSON {type(value).__name__}, expected an object; rebuild the bundle")
    if isinstance(form, list) and not isinstance(value, list):
        raise BundleError(f"{where} is a JSON {type(value).__name__}, expected an array; rebuild the bundle")
    if isinstance(form, list):
        for index, inner in enumerate(value):
            _check_form(inner, form[0], f"{where}[{index}]")
    elif isinstance(form, tuple):
        for key, inner in value.items():
            _check_form(inner, form[0], f"{where}[{key!r}]")
    elif isinstance(form, dict):
        for key, inner in form.items():
            if key not in value:
                raise BundleError(f"{where} has no {key!r}; the manifest is incomplete: rebuild the bundle")
            _check_form(value[key], inner, f"{where}[{key!r}]")
    elif not isinstance(value, form):
        raise BundleError(f"{where}={value!r} is a JSON {type(value).__name__}, expected {form.__name__}; rebuild the bundle")


def current_digest(root: Path) -> Optional[str]:
    """``read_current``, where CURRENT that is a folder, not UTF-8 or unreadable is a BundleError."""
    try:
        return read_current(root)
    except (OSError, ValueError) as error:
        raise BundleError(
            f"{Path(root) / CURRENT_FILE} cannot be read ({error}); rebuild with `python -m tvm_rmsquant build --out {root}`"
        ) from None


def resolve_path(path=None) -> Path:
    """Where to load the bundle from (see the module docstring)."""
    if path is not None:
        return Path(path)
    if os.environ.get(ENV_VAR):
        return Path(os.environ[ENV_VAR])
    if current_digest(PACKAGE_BUNDLE):
        return PACKAGE_BUNDLE
    return default_bundle_dir()


class Bundle:
    """A verified bundle: its manifest, and its kernels loaded on first use."""

    def __init__(self, root):
        self.root = Path(root)
        if os.path.exists(self.root) and not os.path.isdir(self.root):
            raise BundleError(
                f"bundle path {self.root} is a file, not a bundle directory: point bundle= or ${ENV_VAR} "
                f"at the --out directory of `python -m tvm_rmsquant build`"
            )
        digest = current_digest(self.root)
        if digest is None:
            raise BundleError(
                f"no bundle at {self.root} (no CURRENT file); build one with "
                f"`python -m tvm_rmsquant build --out {self.root}` or set ${ENV_VAR}"
            )
        self.path = bundle_dir(self.root, digest)
        manifest_path = self.path / MANIFEST_FILE
        try:
            raw = manifest_path.read_bytes()
        except FileNotFoundError:
            raise BundleError(f"bundle {self.path} has no {MANIFEST_FILE}; CURRENT names a bundle that is not there") from None
        except (OSError, ValueError) as error:
            raise BundleError(f"{manifest_path} cannot be read ({error}); rebuild with `python -m tvm_rmsquant build --out {self.root}`") from None
        if manifest_digest(raw) != digest:
            raise BundleError(f"{manifest_path} does not match its digest {digest}: the manifest was modified or corrupted")
        try:
            self.manifest = json.loads(raw)
        except ValueError as error:  # not JSON, or not UTF-8
            raise BundleError(f"{manifest_path} is not valid JSON: {error}") from None
        self._verify(f"{manifest_path}: manifest")
        self._modules: Dict[str, object] = {}
        self._lock = threading.Lock()

    def _verify(self, where: str) -> None:
        manifest = self.manifest
        _check_form(manifest, {}, where)
        if manifest.get("schema_version") != SCHEMA_VERSION:
            raise BundleError(
                f"bundle schema_version={manifest.get('schema_version')!r}, this package reads {SCHEMA_VERSION}; rebuild the bundle"
            )
        _check_form(manifest, _MANIFEST, where)
        _check_form(manifest.get("candidates", {}), _CANDIDATES, f"{where}['candidates']")
        try:
            targets(manifest["toolchain"]["target_archs"])
        except ValueError as error:
            raise BundleError(f"{where}: target_archs {manifest['toolchain']['target_archs']}: {error}; rebuild the bundle") from None
        self._hashes = {}
        for library, entry in [*manifest["libraries"].items(), (manifest["torch_ops"]["library"], manifest["torch_ops"])]:
            self._hashes.update({library: entry["sha256"], entry["source"]: entry["source_sha256"]})
        for name in self._hashes:
            if name in ("", ".", "..") or Path(name).name != name:
                raise BundleError(f"{where} names the file {name!r}, which is not a plain file name; rebuild the bundle")
        for entry in [*manifest["variants"].values(), *manifest.get("candidates", {}).values()]:
            if entry["library"] not in manifest["libraries"]:
                raise BundleError(f"{where}: kernel {entry['symbol']!r} is in library {entry['library']!r}, which the manifest does not list")
        for name in self._hashes:
            self.verified_path(name)
        self.check_tvm_ffi(installed_libtvm_ffi())

    def verified_path(self, name: str) -> Path:
        """The bundle's file ``name`` after hashing it again. Libraries load lazily, and one
        truncated since the bundle was opened would kill the process with SIGBUS at first use."""
        path, expected = self.path / name, self._hashes[name]
        try:
            actual = sha256_file(path)
        except FileNotFoundError:
            raise BundleError(f"bundle {self.path} is missing {name}") from None
        except OSError as error:
            raise BundleError(f"{path} cannot be read ({error}); rebuild with `python -m tvm_rmsquant build --out {self.root}`") from None
        if actual != expected:
            raise BundleError(f"{path} has sha256 {actual[:12]}…, the manifest says {expected[:12]}…: the file is corrupted")
        return path

    # -- queries ---------------------------------------------------------------------------------

    @property
    def target_archs(self) -> List[str]:
        """The archs every library of the bundle holds SASS for."""
        return self.manifest["toolchain"]["target_archs"]

    def names(self):
        return sorted(self.manifest["variants"])

    def __contains__(self, spec) -> bool:
        return (spec.name if isinstance(spec, VariantSpec) else spec) in self.manifest["variants"]

    def entry(self, name: str) -> Dict:
        try:
            return self.manifest["variants"][name]
        except KeyError:
            raise BundleError(f"bundle {self.path} has no variant {name!r}") from None

    def check_device(self, capability) -> Target:
        """The bundle's target whose machine code runs on a GPU of ``capability``; a BundleError
        naming the archs the bundle has when none does."""
        try:
            return for_capability(capability, self.target_archs)
        except ValueError as error:
            raise BundleError(f"bundle {self.path}: {error}; build one with `python -m tvm_rmsquant build --arch ...`") from None

    def check_tvm_ffi(self, libtvm_ffi) -> None:
        """Refuse the bundle unless the ``libtvm_ffi.so`` at ``libtvm_ffi`` (at open: the installed
        one) exports every function its libraries import. That, not the apache-tvm-ffi version
        the bundle was built with, is what breaks: tvm-ffi loads libraries lazily, and a missing
        one kills the process at its first call (the evidence: ``bundle_format``'s docstring)."""
        try:
            exported = dynamic_symbols(libtvm_ffi)[0]
        except (OSError, ValueError) as error:
            raise BundleError(f"cannot read the symbols of libtvm_ffi {libtvm_ffi} ({error}); reinstall apache-tvm-ffi") from None
        entries = {**self.manifest["libraries"], self.manifest["torch_ops"]["library"]: self.manifest["torch_ops"]}
        missing = {name: sorted(set(entry["tvm_ffi_imports"]) - exported) for name, entry in sorted(entries.items())}
        needs = "; ".join(f"{name} imports {', '.join(symbols)}" for name, symbols in missing.items() if symbols)
        if needs:
            built = self.manifest["toolchain"]["apache-tvm-ffi"]
            raise BundleError(
                f"bundle {self.path}: {needs}, which {libtvm_ffi} does not export; "
                f"install apache-tvm-ffi=={built}, the version the bundle was built with"
            )

    @property
    def torch_ops(self) -> Dict:
        """The manifest entry of the torch ops' C++ implementation (``tvm_rmsquant.native``)."""
        return self.manifest["torch_ops"]

    # -- kernels ---------------------------------------------------------------------------------

    def candidates(self) -> Dict[str, Dict]:
        """A tuning bundle's candidate kernels by symbol (empty for a shipped bundle)."""
        return self.manifest.get("candidates", {})

    def function(self, name: str):
        """The tvm-ffi function of variant ``name`` (outputs given). Where the tuning database
        gave M buckets their own kernels, it picks among them by M, in C++."""
        return self.kernel_function(self.entry(name))

    def kernel_function(self, entry: Dict):
        """The tvm-ffi function of one manifest kernel entry (its library is verified and loaded once)."""
        import tvm_ffi

        with self._lock:
            module = self._modules.get(entry["library"])
            if module is None:
                module = tvm_ffi.load_module(str(self.verified_path(entry["library"])))
                self._modules[entry["library"]] = module
        return module[entry["symbol"]]


_OPENED: Dict[Path, Bundle] = {}


def open_bundle(path=None) -> Bundle:
    """The bundle at ``path`` (resolved as in the module docstring), opened once per process."""
    root = resolve_path(path).resolve()
    bundle = _OPENED.get(root)
    if bundle is None or current_digest(root) != bundle.path.name:
        bundle = _OPENED[root] = Bundle(root)
    return bundle
