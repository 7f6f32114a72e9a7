"""The native kernel's build cache is never trusted blindly (issue #26, security holes 3 and 4).

Hole 3: a shared object modified in the extensions folder was imported by ``native=True``.
Hole 4: a ``lock`` file left in the build folder made ``native=True`` wait forever.

The fast tests replace ``torch.utils.cpp_extension.load_inline`` by a stand-in that behaves as
PyTorch's does where it matters — it computes the same build folder when none is given, waits on
the folder's ``lock`` file exactly as ``torch.utils.file_baton.FileBaton`` does (forever), and
"imports" the ``<name>.so`` it finds there or "builds" one — so the holes are reproduced without a
C++ build, and each test fails on the code before the fix (it loaded the planted file, or hung).
The test marked slow plants a real shared object whose initialisation writes a marker file,
beside a real build.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bnlab import _kernel_cache
from bnlab.optim import _native

ROOT = Path(__file__).resolve().parents[2]

# The stand-in for load_inline, also written into the subprocess scripts below.
FAKE_LOAD_INLINE = textwrap.dedent('''
    def fake_load_inline(name, cpp_sources, *args, build_directory=None, **kwargs):
        import os
        from pathlib import Path
        from types import SimpleNamespace
        from torch.utils.cpp_extension import _get_build_directory
        from torch.utils.file_baton import FileBaton

        folder = Path(build_directory or _get_build_directory(name, False))
        baton = FileBaton(os.path.join(folder, "lock"))
        so = folder / f"{name}.so"
        if baton.try_acquire():
            try:
                if not so.exists():  # "build": sources, ninja file, object, library
                    for part in ("main.cpp", "build.ninja", "main.o"):
                        (folder / part).write_text(part)
                    so.write_text("built")
            finally:
                baton.release()
        else:
            baton.wait()  # PyTorch waits for the lock's removal, without a bound
        return SimpleNamespace(name=name, folder=str(folder), loaded=so.read_text())
''')
_ns: dict = {}
exec(FAKE_LOAD_INLINE, _ns)
fake_load_inline = _ns["fake_load_inline"]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A private extensions root and private fallback, the stand-in compiler, a fresh kernel state."""
    import torch.utils.cpp_extension as ext

    root = tmp_path / "ext"
    root.mkdir(mode=0o700)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(ext, "load_inline", fake_load_inline)
    monkeypatch.setattr(_native, "_STATE", {})
    return root


def _load():
    _native._STATE.clear()
    return _native.kernels()


def test_first_build_records_a_manifest_that_the_next_load_checks(cache):
    first = _load()
    assert first.loaded == "built"
    folder = Path(first.folder)
    manifest = json.loads((folder / f"{first.name}.sha256").read_text())
    assert set(manifest) == {"main.cpp", "build.ninja", "main.o", f"{first.name}.so"}
    assert _kernel_cache.check_manifest(folder, first.name) is None
    assert not (folder / "bnlab.lock").exists() and not (folder / "lock").exists()
    with _warnings_as_list() as seen:
        assert _load().loaded == "built"  # unchanged folder: loaded without a rebuild or a warning
    assert not seen


def test_hole3_modified_library_is_not_loaded(cache):
    """A library changed in place after the build is detected by its SHA-256 and rebuilt."""
    name = _load().name
    so = cache / name / f"{name}.so"
    so.write_text("planted")
    with pytest.warns(RuntimeWarning, match=r"SHA-256 of .*\.so does not match"):
        again = _load()
    assert again.loaded == "built"  # before the fix: "planted"


@pytest.mark.parametrize("plant", ["extra_object", "no_manifest", "manifest_writable_by_others",
                                   "manifest_symlink", "library_symlink"])
def test_hole3_tampered_build_folder_is_rebuilt(cache, tmp_path, plant):
    name = _load().name
    folder = cache / name
    so = folder / f"{name}.so"
    manifest = folder / f"{name}.sha256"
    if plant == "extra_object":  # an object ninja would link into a rebuilt library
        (folder / "evil.o").write_text("planted")
        so.write_text("planted")
    elif plant == "no_manifest":
        manifest.unlink()
        so.write_text("planted")
    elif plant == "manifest_writable_by_others":
        so.write_text("planted")
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()),
                                        so.name: _kernel_cache._file_digest(so)}))
        manifest.chmod(0o666)
    elif plant == "manifest_symlink":
        target = tmp_path / "elsewhere.sha256"
        target.write_text(manifest.read_text())
        manifest.unlink()
        manifest.symlink_to(target)
        so.write_text("planted")
    elif plant == "library_symlink":
        target = tmp_path / "evil.so"
        target.write_text("planted")
        so.unlink()
        so.symlink_to(target)
    with pytest.warns(RuntimeWarning, match="not as it was built"):
        again = _load()
    assert again.loaded == "built"
    assert not (folder / "evil.o").exists()
    assert (tmp_path / "evil.so").exists() if plant == "library_symlink" else True  # a link is removed, not followed


@pytest.mark.parametrize("unsafe", ["world_writable_root", "group_writable_build_folder", "symlinked_build_folder"])
def test_untrusted_extensions_folder_is_not_used(cache, tmp_path, monkeypatch, unsafe):
    """A root or build folder others can write (or a link planted at its path) is not built in: a
    warning and a private folder instead."""
    name = _load().name  # learn the name; then start over in a fresh, unsafe root
    shared = tmp_path / "shared"
    shared.mkdir()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(shared))
    if unsafe == "world_writable_root":
        shared.chmod(0o777)
    elif unsafe == "group_writable_build_folder":
        (shared / name).mkdir(mode=0o700)
        (shared / name).chmod(0o770)
    else:
        (tmp_path / "victim").mkdir()
        (shared / name).symlink_to(tmp_path / "victim")
    with pytest.warns(RuntimeWarning, match="private folder"):
        got = _load()
    assert got.loaded == "built"
    assert not Path(got.folder).is_relative_to(shared)
    assert Path(got.folder).is_relative_to(tmp_path / "xdg")
    assert not any((tmp_path / "victim").iterdir()) if unsafe == "symlinked_build_folder" else True


@pytest.mark.skipif(not hasattr(os, "getuid") or os.getuid() != 0, reason="needs root to plant another user's folder")
def test_build_folder_owned_by_another_user_is_not_used(cache):
    name = _load().name
    folder = cache / name
    os.chown(folder, 65534, 65534)
    with pytest.warns(RuntimeWarning, match="owned by uid 65534"):
        got = _load()
    assert not Path(got.folder).is_relative_to(cache)


def _run_script(body: str, env: dict, timeout: float) -> subprocess.CompletedProcess:
    script = "\n".join(["import json, sys, warnings", "warnings.simplefilter('always')",
                        FAKE_LOAD_INLINE, textwrap.dedent(body)])
    full_env = {**os.environ, **env, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout,
                          env=full_env, cwd=ROOT)


def test_hole4_planted_torch_lock_does_not_hang(tmp_path):
    """A ``lock`` file in the build folder (planted, or left by a build killed with SIGKILL): before
    the fix ``native=True`` waited forever (here: past the subprocess's time limit)."""
    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    (tmp_path / "ext").mkdir(mode=0o700)
    body = '''
        import torch.utils.cpp_extension as ext
        from bnlab.optim import _native
        ext.load_inline = fake_load_inline
        first = _native.kernels()          # learn the build folder of this code's extension name
        _native._STATE.clear()
        open(first.folder + "/lock", "w").close()  # the planted lock
        with warnings.catch_warnings(record=True) as seen:
            again = _native.kernels()
        print(json.dumps({"loaded": again.loaded, "warnings": [str(w.message) for w in seen]}))
    '''
    try:
        proc = _run_script(body, env, timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("native=True hung on a planted lock file")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["loaded"] == "built"
    assert any("left by an interrupted build" in w for w in out["warnings"])


def test_stale_bnlab_lock_of_a_dead_process_is_removed(cache):
    name = _load().name
    folder = cache / name
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    import socket

    (folder / "bnlab.lock").write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "time": 0}))
    with pytest.warns(RuntimeWarning, match=f"owner, process {dead.pid}, is gone"):
        assert _load().loaded == "built"
    assert not (folder / "bnlab.lock").exists()


def test_unowned_old_lock_is_removed_and_an_old_lock_is_stale(cache):
    name = _load().name
    lock = cache / name / "bnlab.lock"
    lock.write_text("")
    old = time.time() - 60
    os.utime(lock, (old, old))
    with pytest.warns(RuntimeWarning, match="names no owner"):
        assert _load().loaded == "built"
    # A lock of a live process (this one) older than LOCK_STALE_S is stale as well.
    import socket

    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "time": 0}))
    older = time.time() - _kernel_cache.LOCK_STALE_S - 10
    os.utime(lock, (older, older))
    with pytest.warns(RuntimeWarning, match="older than"):
        assert _load().loaded == "built"


def test_wait_for_a_live_builder_is_bounded(cache, monkeypatch):
    """A fresh lock of a live process (this one, as if another thread were building): the wait ends
    after LOCK_WAIT_S with a warning, and native=True falls back to the eager route."""
    import socket

    name = _load().name
    lock = cache / name / "bnlab.lock"
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}))
    monkeypatch.setattr(_kernel_cache, "LOCK_WAIT_S", 0.5)
    start = time.monotonic()
    with pytest.warns(RuntimeWarning) as seen:
        assert _load() is None
    assert time.monotonic() - start < 30
    text = " ".join(str(w.message) for w in seen)
    assert "waiting up to" in text and "TimeoutError" in text and "eager route" in text
    assert lock.exists()  # a live owner's lock is left alone


@pytest.mark.slow  # two real builds of the kernel (~25 s each on an idle machine, minutes under load)
def test_hole3_planted_shared_object_never_runs(tmp_path):
    """The real thing: after a real build, the library is replaced by one whose initialisation writes
    a marker file.  Before the fix the next ``native=True`` imported it (the marker appeared and
    bnlab then failed on the missing ``dense_step``); now the manifest check rebuilds first."""
    import sysconfig

    env = {"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext"), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    (tmp_path / "ext").mkdir(mode=0o700)
    build = '''
        from bnlab.optim import _native
        k = _native.kernels()
        import torch.utils.cpp_extension as ext
        print(json.dumps({"name": k.__name__, "file": k.__file__}))
    '''
    proc = _run_script(build, env, timeout=1800)
    assert proc.returncode == 0, proc.stderr
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    if info["file"] is None:
        pytest.skip("no C++ toolchain here")
    marker = tmp_path / "planted-code-ran"
    source = tmp_path / "evil.c"
    source.write_text(textwrap.dedent(f'''
        #include <Python.h>
        #include <stdio.h>
        PyMODINIT_FUNC PyInit_{info["name"]}(void) {{
            FILE* f = fopen("{marker}", "w"); if (f) fclose(f);
            return NULL;
        }}
    '''))
    evil = tmp_path / "evil.so"
    subprocess.run(["gcc", "-shared", "-fPIC", f"-I{sysconfig.get_paths()['include']}", str(source), "-o", str(evil)],
                   check=True)
    os.replace(evil, info["file"])  # newer than its sources: ninja would call it up to date
    load = '''
        from bnlab.optim import _native
        with warnings.catch_warnings(record=True) as seen:
            k = _native.kernels()
        print(json.dumps({"ok": hasattr(k, "dense_step"), "warnings": [str(w.message) for w in seen]}))
    '''
    proc = _run_script(load, env, timeout=1800)
    assert not marker.exists(), "the planted library's code ran"
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["ok"] and any("does not match" in w for w in out["warnings"])


class _warnings_as_list:
    def __enter__(self):
        import warnings

        self._ctx = warnings.catch_warnings(record=True)
        seen = self._ctx.__enter__()
        warnings.simplefilter("always")
        return seen

    def __exit__(self, *exc):
        return self._ctx.__exit__(*exc)


def test_fake_matches_torch_build_folder(tmp_path, monkeypatch):
    """The stand-in's folder rule is PyTorch's, and bnlab's default root is the same folder."""
    from torch.utils.cpp_extension import _get_build_directory

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))  # (torch's default root; created below)
    assert str(_kernel_cache._torch_extensions_root() / "x") == os.path.dirname(
        _get_build_directory("x", False)) + "/x"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "env"))
    assert _kernel_cache._torch_extensions_root() == tmp_path / "env"
    assert SimpleNamespace and torch  # (imports used by the stand-in's namespace)
