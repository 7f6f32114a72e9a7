"""Where bnlab's native kernels (the BNP kernels of :mod:`bnlab.optim._native`, the BN-stack kernels of
:mod:`bnlab.nets._native_bn`) are built and loaded from, and what is checked before loading them.

``torch.utils.cpp_extension.load_inline`` builds an extension in a cache directory and imports
whatever shared object it finds there when its build files say it is up to date; it checks
neither the directory's owner and permissions nor the library's contents, and waits without end
on a ``lock`` file a killed build left behind.  Whoever can write that directory runs code in the
process that loads the kernel (issue #26, holes 3 and 4).  Here, before ``load_inline`` is called:

* **the directory**: the extensions root (``TORCH_EXTENSIONS_DIR``, else PyTorch's default
  ``~/.cache/torch_extensions/py<ver>_<accelerator>``) and the build folder must be owned by this
  user and not writable by group or others, and every existing folder above them owned by this
  user or root and not writable by others unless sticky (as OpenSSH checks a key's path).
  Otherwise a warning, and the build goes to a private folder (``$XDG_CACHE_HOME/bnlab/
  torch_extensions``, else a fresh temporary folder of mode 0700);
* **the contents**: after every successful build or load a manifest, ``<name>.sha256`` beside
  the library, records the SHA-256 of each file of the build folder (sources, ``build.ninja``,
  objects, the library; not ninja's logs).  Before the next load the manifest (itself a regular
  file of this user, not writable by others) must match the folder exactly: a file changed,
  added or removed, or no manifest beside an existing library, gives a warning and an empty
  folder, i.e. a rebuild from the sources in this module;
* **the locks**: a bnlab build holds ``bnlab.lock`` (its pid, host and start time, created with
  ``O_EXCL | O_NOFOLLOW``) around ``load_inline``.  A lock whose owner process is gone (same
  host), that names no owner, or that is older than :data:`LOCK_STALE_S` is removed with a
  warning; another live builder is waited for at most :data:`LOCK_WAIT_S` (a warning says whom
  it waits for), then the caller falls back to the eager route.  Holding that lock, PyTorch's own
  ``lock`` in the folder can only be left by an interrupted build and is removed.

What the checks cannot do: a process of this same user that rewrites the library between the
check and the import is not stopped (it could as well rewrite bnlab itself).
"""
from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import platform
import shutil
import socket
import stat
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Iterator

__all__ = ["LOCK_STALE_S", "LOCK_WAIT_S", "build_directory", "build_lock", "check_manifest",
           "clear_directory", "cpu_tag", "remove_torch_lock", "write_manifest"]

#: A bnlab build lock older than this is stale whatever its owner (a build takes ~25 s here).
LOCK_STALE_S = 900.0
#: How long to wait for another live process's build before giving up (eager route).
LOCK_WAIT_S = 600.0
#: A lock file that names no owner is stale after this long (its writer writes right after creating it).
_UNOWNED_GRACE_S = 5.0
_LOCK = "bnlab.lock"
_TORCH_LOCK = "lock"
#: Files of the build folder the manifest leaves out: ninja's logs (rewritten by every ninja run)
#: and the locks.
_VOLATILE = {".ninja_log", ".ninja_deps", _LOCK, _TORCH_LOCK}


def _torch_extensions_root() -> Path:
    """PyTorch's extensions root, as ``torch.utils.cpp_extension._get_build_directory`` computes it."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env is not None:
        return Path(env)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip is not None:
        accelerator = f"rocm{torch.version.hip.replace('.', '')}"
    elif torch.version.cuda is not None:
        accelerator = f"cu{torch.version.cuda.replace('.', '')}"
    else:
        accelerator = "cpu"
    version = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{version}_{accelerator}"


def cpu_tag() -> str:
    """A short hash of this CPU's model and feature flags (Linux ``/proc/cpuinfo``; elsewhere the
    platform's processor string): the kernels are built with ``-march=native``, so a build cache
    shared by machines with different CPUs must not hand one machine's binary to another."""
    text = f"{platform.machine()} {platform.processor()}"
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                key = line.split(":", 1)[0].strip()
                if key in ("model name", "flags", "Features", "CPU part"):
                    text += line
                if key == "flags" or key == "Features":
                    break  # the first processor's entry is enough
    except OSError:
        pass
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _private_root() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "bnlab" / "torch_extensions"


def _distrust(path: Path, *, own: bool) -> str | None:
    """Why ``path`` (an existing folder) is not trusted, or ``None``.  ``own``: it must be this user's
    and writable by nobody else; otherwise (a folder above) this user's or root's, and not writable by
    others unless sticky."""
    st = os.lstat(path)
    uid = os.getuid()
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "not a directory"
    if own:
        if st.st_uid != uid:
            return f"owned by uid {st.st_uid}, not by this user (uid {uid})"
        if st.st_mode & 0o022:
            return f"writable by group or others (mode {stat.S_IMODE(st.st_mode):o})"
        return None
    if st.st_uid not in (uid, 0):
        return f"owned by uid {st.st_uid}"
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        return f"writable by group or others without the sticky bit (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _check_chain(folder: Path, own_from: Path) -> str | None:
    """Why ``folder`` (existing or to be created) is not a trusted place, or ``None``.  Folders at or
    below ``own_from`` must be this user's (see :func:`_distrust`)."""
    folder = Path(os.path.abspath(folder))
    own_from = Path(os.path.abspath(own_from))
    for path in [*reversed(folder.parents), folder]:
        if not os.path.lexists(path):
            break  # created by us, mode 0700
        own = path == own_from or own_from in path.parents
        reason = _distrust(path, own=own)
        if reason is not None:
            return f"{path} is {reason}"
    return None


def _make_private(folder: Path) -> None:
    os.makedirs(folder, mode=0o700, exist_ok=True)


def build_directory(name: str, what: str = "the native BNP kernels") -> Path:
    """The folder to build extension ``name`` (``what``, for the warnings) in: PyTorch's usual one when
    it is trusted, else a private one (with a warning).  Created (mode 0700) if absent."""
    root = _torch_extensions_root()
    folder = root / name
    reason = _check_chain(folder, own_from=root)
    if reason is None:
        _make_private(folder)
        reason = _check_chain(folder, own_from=root)  # created in between by someone else?
        if reason is None:
            return folder
    private_root = _private_root()
    private = private_root / name
    alt_reason = _check_chain(private, own_from=private_root)
    if alt_reason is None:
        _make_private(private)
        alt_reason = _check_chain(private, own_from=private_root)
    if alt_reason is not None:
        private = Path(tempfile.mkdtemp(prefix="bnlab-native-"))  # mode 0700, this process only
        atexit.register(shutil.rmtree, private, ignore_errors=True)
    warnings.warn(
        f"bnlab: not building {what} in {folder}: {reason}; code loaded from a folder others "
        f"can write runs in this process.  Building them in the private folder {private} instead",
        RuntimeWarning,
        stacklevel=4,
    )
    return private


def _manifest_path(folder: Path, name: str) -> Path:
    return folder / f"{name}.sha256"


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _build_files(folder: Path, name: str) -> dict[str, os.DirEntry]:
    manifest = _manifest_path(folder, name).name
    return {e.name: e for e in os.scandir(folder) if e.name not in _VOLATILE and e.name != manifest}


def check_manifest(folder: Path, name: str) -> str | None:
    """``None`` if the build folder matches its manifest exactly, ``"empty"`` if it holds no build
    files, else why not (the caller empties the folder and rebuilds)."""
    files = _build_files(folder, name)
    if not files:
        return "empty"
    path = _manifest_path(folder, name)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return f"no manifest {path.name} beside the build files"
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        return f"the manifest {path.name} is not a regular file of this user writable only by it"
    try:
        recorded = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return f"the manifest {path.name} cannot be read ({exc})"
    if not isinstance(recorded, dict) or set(recorded) != set(files):
        extra = sorted(set(files) - set(recorded if isinstance(recorded, dict) else ()))
        missing = sorted(set(recorded if isinstance(recorded, dict) else ()) - set(files))
        return f"the files differ from the manifest (added {extra}, removed {missing})"
    for file_name, entry in files.items():
        if not entry.is_file(follow_symlinks=False):
            return f"{file_name} is not a regular file"
        if _file_digest(folder / file_name) != recorded[file_name]:
            return f"the SHA-256 of {file_name} does not match the one recorded when it was built"
    return None


def write_manifest(folder: Path, name: str) -> None:
    """Record the SHA-256 of every build file (written to a temporary file, then renamed)."""
    digests = {}
    for file_name, entry in sorted(_build_files(folder, name).items()):
        if entry.is_file(follow_symlinks=False):
            digests[file_name] = _file_digest(folder / file_name)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".manifest-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            json.dump(digests, fh, indent=1, sort_keys=True)
        os.replace(tmp, _manifest_path(folder, name))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def clear_directory(folder: Path) -> None:
    """Remove everything in ``folder`` but the bnlab lock (links are removed, never followed)."""
    for entry in os.scandir(folder):
        if entry.name == _LOCK:
            continue
        path = folder / entry.name
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(path)
        else:
            os.unlink(path)


def remove_torch_lock(folder: Path) -> None:
    """Remove PyTorch's ``lock`` in ``folder`` (call while holding :func:`build_lock`: then only an
    interrupted build can have left it, and ``load_inline`` would wait for it forever)."""
    path = folder / _TORCH_LOCK
    if os.path.lexists(path):
        warnings.warn(f"bnlab: removing the build lock {path} left by an interrupted build", RuntimeWarning,
                      stacklevel=4)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _owner(path: Path) -> dict | None:
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        with os.fdopen(fd, "r", encoding="utf-8") as fh:
            data = json.loads(fh.read(4096))
        return data if isinstance(data, dict) and isinstance(data.get("pid"), int) else None
    except (OSError, ValueError):
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return pid > 0
    return True


def _stale(path: Path, stale_s: float) -> str | None:
    """Why the lock at ``path`` is stale, or ``None`` if its owner may still be building."""
    try:
        age = time.time() - os.lstat(path).st_mtime
    except FileNotFoundError:
        return None  # released meanwhile
    owner = _owner(path)
    if owner is None:
        return f"it names no owner and is {age:.0f} s old" if age > _UNOWNED_GRACE_S else None
    if owner.get("host") == socket.gethostname() and not _alive(owner["pid"]):
        return f"its owner, process {owner['pid']}, is gone"
    if age > stale_s:
        return f"it is {age:.0f} s old, older than {stale_s:.0f} s"
    return None


@contextlib.contextmanager
def build_lock(folder: Path, *, wait_s: float | None = None, stale_s: float | None = None,
               poll_s: float = 0.2, what: str = "the native BNP kernels", quiet_s: float = 0.0) -> Iterator[None]:
    """Hold ``folder``'s bnlab build lock; ``TimeoutError`` after ``wait_s`` for a live owner.  A wait is
    announced (a warning) once it has lasted ``quiet_s`` seconds: a build of a few seconds that another
    process of the same run is doing is routine, not news."""
    wait_s = LOCK_WAIT_S if wait_s is None else wait_s
    stale_s = LOCK_STALE_S if stale_s is None else stale_s
    path = folder / _LOCK
    start = time.monotonic()
    announced = False
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
    while True:
        try:
            fd = os.open(path, flags, 0o600)
            break
        except FileExistsError:
            pass
        reason = _stale(path, stale_s)
        if reason is not None:
            warnings.warn(f"bnlab: removing the stale build lock {path} ({reason})", RuntimeWarning, stacklevel=4)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            continue
        waited = time.monotonic() - start
        if waited > wait_s:
            raise TimeoutError(f"another process holds the build lock {path} (owner {_owner(path)}); waited "
                               f"{waited:.0f} s")
        if not announced and waited >= quiet_s:
            warnings.warn(f"bnlab: waiting up to {wait_s:.0f} s for {what} that another process "
                          f"(owner {_owner(path)}) is building in {folder}", RuntimeWarning, stacklevel=4)
            announced = True
        time.sleep(poll_s)
    me = {"pid": os.getpid(), "host": socket.gethostname(), "time": time.time()}
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        json.dump(me, fh)
    try:
        yield
    finally:
        if (_owner(path) or {}).get("pid") == me["pid"]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
