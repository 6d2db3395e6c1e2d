"""Publishing and loading bundles under races, damage and misuse, with small dummy files (no nvcc).

A dummy bundle has the manifest's required form and real hashes, so the loader verifies it
exactly as a built one; it holds no loadable code.
"""

import json
import multiprocessing
import os
import shutil
import subprocess
import sys
import threading
import time
from importlib import metadata
from pathlib import Path

import pytest
from conftest import require_toolchain

from tvm_rmsquant.bundle_format import CURRENT_FILE, MANIFEST_FILE, SCHEMA_VERSION, bundle_dir, manifest_digest, read_current, sha256_file
from tvm_rmsquant.codegen.bundle import publish
from tvm_rmsquant.loader import ENV_VAR, Bundle, BundleError, open_bundle
from tvm_rmsquant.target import DEFAULT_ARCHS

ROUNDS = 200


def _dummy(folder: Path, tag: str):
    """A manifest and its files (name -> (path, sha256)) whose content depends on ``tag``."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for name in ("lib_a.so", "lib_a.cu", "torch_ops.so", "torch_ops.cpp"):
        path = folder / name
        path.write_text(f"{name} {tag}\n")
        files[name] = (path, sha256_file(path))
    entry = lambda library, source: {"library": library, "sha256": files[library][1], "source": source, "source_sha256": files[source][1],  # noqa: E731
                                     "tvm_ffi_imports": []}
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "toolchain": {"apache-tvm-ffi": metadata.version("apache-tvm-ffi"), "target_archs": list(DEFAULT_ARCHS)},
        "libraries": {"lib_a.so": {key: value for key, value in entry("lib_a.so", "lib_a.cu").items() if key != "library"}},
        "torch_ops": {**entry("torch_ops.so", "torch_ops.cpp"), "torch_stable_target": "2.10"},
        "variants": {"v": {"library": "lib_a.so", "symbol": "v", "rule": "row_resident", "knobs": {}}},
    }
    return manifest, files


@pytest.fixture
def live(tmp_path):
    """A published dummy bundle directory."""
    publish(tmp_path / "bundle", *_dummy(tmp_path / "src", "live"))
    return tmp_path / "bundle"


def _racer(root: Path, side: int, barrier, rounds: int) -> None:
    for index in range(rounds):
        # Every third round both publish the same content: a rebuild racing a rebuild.
        manifest, files = _dummy(root / f"src{side}" / str(index), str(index) if index % 3 == 0 else f"{index}-{side}")
        barrier.wait()
        publish(root / "bundle", manifest, files)
        barrier.wait()


def test_two_publishes_released_together_always_leave_a_loadable_bundle(tmp_path):
    """Each build kept only its own bundle and the previous one, so two finishing together
    deleted each other's and CURRENT named a deleted bundle (41 of 60 rounds)."""
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(3, timeout=60)
    racers = [context.Process(target=_racer, args=(tmp_path, side, barrier, ROUNDS)) for side in (0, 1)]
    for racer in racers:
        racer.start()
    try:
        for index in range(ROUNDS):
            barrier.wait()
            barrier.wait()
            bundle = Bundle(tmp_path / "bundle")
            assert bundle.path.name in {manifest_digest(json.dumps(_dummy(tmp_path / "check", tag)[0], indent=1, sort_keys=True).encode())
                                        for tag in (str(index), f"{index}-0", f"{index}-1")}, index
    finally:
        barrier.abort()
        for racer in racers:
            racer.join(timeout=60)
    assert [racer.exitcode for racer in racers] == [0, 0]
    assert len(list((tmp_path / "bundle" / "bundles").iterdir())) <= 2  # the live bundle and the one before it


# The builder, in a new PID namespace: it forks until its pid names no process of ours (so that
# a pid test from outside would call it dead), then publishes, paused while it copies files.
_IN_NAMESPACE = """
import json, os, shutil, sys, time
from pathlib import Path
root = Path(sys.argv[1])
while True:
    child = os.fork()
    if child == 0:
        break
    code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    if code != 99:
        sys.exit(code)
if os.path.exists(f"/proc/{os.getpid()}"):  # this /proc is our parent namespace's
    os._exit(99)
from tvm_rmsquant.codegen.bundle import publish
copy = shutil.copyfile
def paused(source, target, **kwargs):
    (root / "staging").write_text(f"{target}\\n{os.getpid()}")
    while not (root / "go").exists():
        time.sleep(0.05)
    return copy(source, target, **kwargs)
shutil.copyfile = paused
manifest, files = json.loads((root / "inner.json").read_text())
publish(root / "bundle", manifest, {name: (Path(path), sha) for name, (path, sha) in files.items()})
"""


def test_a_live_build_in_another_pid_namespace_keeps_its_staging_directory(live, tmp_path):
    """Staging directories were judged abandoned by os.kill(pid, 0), which is meaningless across
    PID namespaces: a build sharing the folder from a container deleted a live build's."""
    if subprocess.run(["unshare", "--pid", "--fork", "--map-root-user", "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot create a PID namespace here (unshare --pid --fork --map-root-user)")
    inner, inner_files = _dummy(tmp_path / "inner", "inner")
    (tmp_path / "inner.json").write_text(json.dumps([inner, {name: [str(path), sha] for name, (path, sha) in inner_files.items()}]))
    builder = subprocess.Popen(["unshare", "--pid", "--fork", "--map-root-user", sys.executable, "-c", _IN_NAMESPACE, str(tmp_path)])
    try:
        deadline = time.time() + 120
        while not (tmp_path / "staging").exists():
            assert builder.poll() is None and time.time() < deadline, "the namespaced build never reached its staging directory"
            time.sleep(0.05)
        target, pid = (tmp_path / "staging").read_text().split("\n")
        staging = Path(target).parent
        assert staging.is_dir() and not Path(f"/proc/{pid}").exists()  # its pid names no process of ours
        outcome = []
        ours = threading.Thread(target=lambda: outcome.append(publish(live, *_dummy(tmp_path / "ours", "ours"))))
        ours.start()
        ours.join(timeout=3)
        assert staging.is_dir(), "a live build's staging directory was deleted"
        assert ours.is_alive(), "our publish did not wait for the namespaced build's lock"
    finally:
        (tmp_path / "go").touch()
        assert builder.wait(timeout=120) == 0
    ours.join(timeout=60)
    assert outcome == [True]
    assert Bundle(live).path.name == manifest_digest(json.dumps(_dummy(tmp_path / "check", "ours")[0], indent=1, sort_keys=True).encode())
    assert not list((live / "bundles").glob(".staging-*"))


def test_a_published_bundle_is_readable_by_other_users(tmp_path):
    """CURRENT was 0600 (mkstemp) and the bundle folder 0700 (mkdtemp): only the builder could load it."""
    umask = os.umask(0o077)
    try:
        publish(tmp_path / "out" / "bundle", *_dummy(tmp_path / "src", "modes"))
    finally:
        os.umask(umask)
    root = tmp_path / "out" / "bundle"
    bundle = Bundle(root)
    mode = lambda path: path.stat().st_mode & 0o777  # noqa: E731
    assert mode(root / CURRENT_FILE) == 0o644
    assert [mode(folder) for folder in (root, root / "bundles", bundle.path)] == [0o755] * 3
    assert {path.name: mode(path) for path in bundle.path.iterdir()} == {path.name: 0o644 for path in bundle.path.iterdir()}


# -- everything bad about a bundle is a BundleError ---------------------------------------------------


def _resign(root: Path, body: bytes) -> None:
    """Make ``body`` the live manifest, with the live bundle's files, under its own digest."""
    old = bundle_dir(root, read_current(root))
    new = bundle_dir(root, manifest_digest(body))
    shutil.copytree(old, new)
    (new / MANIFEST_FILE).write_bytes(body)
    (root / CURRENT_FILE).write_text(new.name + "\n")


def _edited(root: Path, change) -> bytes:
    manifest = json.loads((bundle_dir(root, read_current(root)) / MANIFEST_FILE).read_bytes())
    change(manifest)
    return json.dumps(manifest, indent=1, sort_keys=True).encode()


def _drop(*keys):
    def change(manifest):
        for key in keys[:-1]:
            manifest = manifest[key]
        del manifest[keys[-1]]
    return change


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda root: (root / CURRENT_FILE).unlink() or (root / CURRENT_FILE).mkdir(), r"CURRENT cannot be read \(\[Errno 21\] Is a directory"),
        (lambda root: (root / CURRENT_FILE).write_bytes(b"\xff\xfe\n"), r"CURRENT cannot be read \('utf-8' codec can't decode"),
        (lambda root: (root / CURRENT_FILE).write_bytes(b"ab\x00cd\n"), r"manifest.json cannot be read \(embedded null byte\)"),
        (lambda root: _resign(root, b"\xc3\x28{}"), r"is not valid JSON"),
        (lambda root: _resign(root, b"[1, 2]"), r"manifest is a JSON list, expected an object"),
        (lambda root: _resign(root, _edited(root, _drop("toolchain"))), r"manifest has no 'toolchain'"),
        (lambda root: _resign(root, _edited(root, lambda m: m.update(toolchain=[]))), r"manifest\['toolchain'\] is a JSON list"),
        (lambda root: _resign(root, _edited(root, lambda m: m["libraries"].update(lib_b=3))), r"\['libraries'\]\['lib_b'\] is a JSON int"),
        (lambda root: _resign(root, _edited(root, lambda m: m["variants"]["v"].update(library="lib_z.so"))), r"'lib_z.so', which the manifest does not list"),
        (lambda root: shutil.copy(bundle_dir(root, read_current(root)) / "lib_a.so", root / "bundles") and  # a file outside the bundle
         _resign(root, _edited(root, lambda m: m["libraries"].update({"../lib_a.so": m["libraries"]["lib_a.so"]}))), r"'../lib_a.so', which is not a plain file name"),
        (lambda root: _resign(root, _edited(root, lambda m: m.update(candidates={"c": {}}))), r"\['candidates'\]\['c'\] has no 'library'"),
        (lambda root: _resign(root, _edited(root, lambda m: m["torch_ops"].update(tvm_ffi_imports="TVMFFIBacktrace"))),
         r"\['torch_ops'\]\['tvm_ffi_imports'\] is a JSON str, expected an array"),
        (lambda root: _resign(root, _edited(root, lambda m: m["libraries"]["lib_a.so"].update(tvm_ffi_imports=[7]))),
         r"\['lib_a.so'\]\['tvm_ffi_imports'\]\[0\]=7 is a JSON int, expected str"),
    ],
)
def test_a_damaged_bundle_is_a_bundle_error(live, damage, reason):
    damage(live)
    with pytest.raises(BundleError, match=reason):
        Bundle(live)


@pytest.mark.parametrize(
    "keys",
    [("toolchain",), ("libraries",), ("torch_ops",), ("variants",), ("toolchain", "apache-tvm-ffi"), ("toolchain", "target_archs"),
     *[("libraries", "lib_a.so", key) for key in ("sha256", "source", "source_sha256", "tvm_ffi_imports")],
     *[("torch_ops", key) for key in ("library", "sha256", "source", "source_sha256", "torch_stable_target", "tvm_ffi_imports")],
     *[("variants", "v", key) for key in ("library", "symbol", "rule", "knobs")]],
)
def test_every_missing_manifest_key_is_a_bundle_error(live, keys):
    _resign(live, _edited(live, _drop(*keys)))
    with pytest.raises(BundleError, match=rf"has no '{keys[-1]}'; the manifest is incomplete: rebuild the bundle"):
        Bundle(live)


def test_a_manifest_that_is_a_folder_is_a_bundle_error(live):
    path = bundle_dir(live, read_current(live)) / MANIFEST_FILE
    path.unlink()
    path.mkdir()
    with pytest.raises(BundleError, match=r"manifest.json cannot be read \(\[Errno 21\] Is a directory"):
        Bundle(live)


def test_the_bundle_variable_naming_a_file_is_a_bundle_error(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a bundle")
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "file"))
    with pytest.raises(BundleError, match=rf"bundle path {tmp_path / 'file'} is a file, not a bundle directory: point bundle= or \${ENV_VAR}"):
        open_bundle()


def _cli(*args, env=None, cwd=None, wrap=()):
    result = subprocess.run([*wrap, sys.executable, "-m", "tvm_rmsquant", *args], capture_output=True, text=True,
                            env={**os.environ, **(env or {})}, cwd=cwd, timeout=300)
    return result.returncode, result.stderr.strip().splitlines()


#: Without the capabilities that let root read anything, root is refused as any other user.
UNPRIVILEGED = ("setpriv", "--bounding-set=-dac_override,-dac_read_search", "--inh-caps=-dac_override,-dac_read_search")


def test_an_unreadable_bundle_is_a_bundle_error(live):
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    library = bundle_dir(live, read_current(live)) / "lib_a.so"
    library.chmod(0)
    script = "import sys; from tvm_rmsquant.loader import Bundle, BundleError\ntry: Bundle(sys.argv[1])\nexcept BundleError as error: print(error)"
    result = subprocess.run([*UNPRIVILEGED, sys.executable, "-c", script, str(live)], capture_output=True, text=True)
    assert result.returncode == 0 and "lib_a.so cannot be read ([Errno 13] Permission denied" in result.stdout, (result.stdout, result.stderr[-2000:])
    assert _cli("list", "--bundle", str(live), wrap=UNPRIVILEGED) == (1, [f"error: {result.stdout.strip()}"])


def test_cli_list_refuses_a_bad_bundle_in_one_line(live, tmp_path):
    (tmp_path / "file").write_text("not a bundle")
    code, stderr = _cli("list", env={ENV_VAR: str(tmp_path / "file")})
    assert code == 1 and len(stderr) == 1 and stderr[0].startswith("error: bundle path") and "is a file" in stderr[0], stderr
    (live / CURRENT_FILE).unlink()
    (live / CURRENT_FILE).mkdir()
    code, stderr = _cli("inspect", "v", "--bundle", str(live))
    assert code == 1 and len(stderr) == 1 and "CURRENT cannot be read" in stderr[0], stderr


# -- build misuse: exit 2, one line, before any work --------------------------------------------------

@pytest.fixture
def toolchain():
    """The build command checks for its toolchain first: without it these cases test nothing."""
    require_toolchain()


#: A small build (test_build's specs are among it), in case the command goes on where it should refuse.
SMALL = ("build", "--no-tuning", "--hidden", "2048", "--dtype", "bf16", "-j", "2")


@pytest.mark.parametrize(
    "flag, make, reason",
    [
        ("--out", lambda tmp: (tmp / "file").write_text("x") and tmp / "file", "is a file; give a directory"),
        ("--cache", lambda tmp: (tmp / "file").write_text("x") and tmp / "file", "is a file; give a directory"),
        ("--out", lambda tmp: (tmp / "file").write_text("x") and tmp / "file" / "bundle", "is a file; give a directory"),
        ("--out", lambda tmp: "", "an empty path; give a directory"),
        ("--cache", lambda tmp: "", "an empty path; give a directory"),
    ],
)
def test_build_refuses_an_unusable_directory_in_one_line(tmp_path, flag, make, reason, toolchain):
    value = str(make(tmp_path))
    others = {"--out": str(tmp_path / "out"), "--cache": str(tmp_path / "cache")}
    code, stderr = _cli(*SMALL, *[arg for other, path in others.items() if other != flag for arg in (other, path)], flag, value, cwd=tmp_path)
    assert (code, len(stderr)) == (2, 1) and stderr[0].startswith(f"error: {flag}={value!r}: ") and reason in stderr[0], stderr
    assert not (tmp_path / "bundles").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("flag", ["--out", "--cache"])
def test_build_refuses_a_read_only_directory_in_one_line(tmp_path, flag, toolchain):
    """Root writes through chmod, so the folder is a read-only mount in a mount namespace of its own."""
    readonly = tmp_path / "readonly"
    readonly.mkdir()
    others = {"--out": str(tmp_path / "out"), "--cache": str(tmp_path / "cache")}
    command = [sys.executable, "-m", "tvm_rmsquant", *SMALL, *[a for other, path in others.items() if other != flag for a in (other, path)],
               flag, str(readonly / "cold")]
    script = f'mount -t tmpfs -o ro none "{readonly}" && exec "$0" "$@"'
    if subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c", script, "true"], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a read-only tmpfs in a mount namespace here")
    result = subprocess.run(["unshare", "--mount", "--map-root-user", "sh", "-c", script, *command], capture_output=True, text=True, timeout=300)
    stderr = result.stderr.strip().splitlines()
    assert (result.returncode, len(stderr)) == (2, 1), stderr
    assert stderr[0] == f"error: {flag}={str(readonly / 'cold')!r}: {readonly} cannot be written (Read-only file system); give a writable directory"
