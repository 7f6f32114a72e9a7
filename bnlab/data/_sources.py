"""Finding each dataset on disk, verifying it and decoding it to uint8 arrays.

Each ``_load_<name>(root, split, download)`` returns ``(images_uint8 (N,C,H,W), labels_uint8,
classes, source_description)``.  Missing data raises :class:`DatasetNotFoundError` whose
message is the exact command or call that provides it.
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import stat
import tempfile
import time
from pathlib import Path

import numpy as np

from bnlab.data import _registry as reg
from bnlab.data._formats import (
    decode_mnist_pickle,
    idx_bytes,
    read_cifar_archive,
    read_cifar_dir,
    read_idx_file,
)
from bnlab.data._integrity import ChecksumError, file_digest, verify_digest

__all__ = ["DatasetNotFoundError", "locate", "load_uint8", "cifar_archive_trusted_sha256"]

_IDX_STEMS = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


class DatasetNotFoundError(FileNotFoundError):
    """A dataset is not on this machine; the message says how to get it."""


# ------------------------------------------------------------------------------ cache
def _cache_file(root: Path, name: str, split: str, source_sha: str) -> Path:
    return root / "cache" / f"{name}-{split}-{source_sha[:16]}.npz"


def _private(path: Path) -> bool:
    """Owned by this user and writable by nobody else (a file another user could plant is not trusted)."""
    st = os.stat(path, follow_symlinks=False)
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and not st.st_mode & 0o022


def _cache_read(path: Path):
    """Return (x, y, classes) from a cache file whose recorded SHA-256 still matches, else None.

    The stamp guards against corruption only; against planting, the cache and its stamp
    are used only when this user owns them and no one else can write them (else the
    data is decoded again from the verified source).
    """
    stamp = path.with_suffix(".sha256")
    try:
        if not (_private(path) and _private(stamp)):
            return None
        expected = stamp.read_text().strip()
        if file_digest(path) != expected:
            return None
        with np.load(path, allow_pickle=False) as z:
            return z["x"], z["y"], tuple(str(c) for c in z["classes"])
    except (OSError, ValueError, KeyError):
        return None


def _cache_write(path: Path, x: np.ndarray, y: np.ndarray, classes: tuple[str, ...]) -> None:
    """Write atomically (temp file + rename) so concurrent readers never see half a file."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide a shared cache from other users
        with os.fdopen(fd, "wb") as f:
            np.savez(f, x=x, y=y, classes=np.array(classes, dtype=str))
        digest = file_digest(tmp)
        fd2, tmp2 = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        os.chmod(tmp2, 0o644)
        with os.fdopen(fd2, "w") as f:
            f.write(digest + "\n")
        os.replace(tmp, path)
        os.replace(tmp2, path.with_suffix(".sha256"))
    except OSError:
        # A read-only data directory only costs the decoding time on the next load.
        for t in (locals().get("tmp"), locals().get("tmp2")):
            if t and os.path.exists(t):
                os.unlink(t)


# ------------------------------------------------------------------------------ MNIST
def _mnist_installed_pickle() -> Path | None:
    try:
        dist = importlib.metadata.distribution(reg.MNIST_PIP_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(dist.locate_file(reg.MNIST_PICKLE_IN_PACKAGE))
    return path if path.is_file() else None


def _mnist_pickle(root: Path) -> Path | None:
    user = root / "mnist" / "mnist.pkl.gz"
    if user.is_file():
        return user
    return _mnist_installed_pickle()


def _mnist_missing(root: Path) -> DatasetNotFoundError:
    return DatasetNotFoundError(
        f"MNIST is not installed. Install the offline copy with:  {reg.MNIST_INSTALL}  "
        f"(or copy that package's {reg.MNIST_PICKLE_IN_PACKAGE} to {root / 'mnist' / 'mnist.pkl.gz'})"
    )


def _mnist_matches_lecun(split: str, x: np.ndarray, y: np.ndarray) -> bool:
    """Whether (x, y), re-encoded as IDX, hash to LeCun's original files (~0.15 s for train).

    Checked on every load, cache hit or not, so the returned data is always verified
    against the published SHA-256 of the original dataset, not only against our own cache.
    """
    img_stem, lab_stem = _IDX_STEMS[split]
    return (x.ndim == 4 and x.shape[1] == 1
            and hashlib.sha256(idx_bytes(x[:, 0])).hexdigest() == reg.MNIST_IDX_SHA256[img_stem]
            and hashlib.sha256(idx_bytes(y)).hexdigest() == reg.MNIST_IDX_SHA256[lab_stem])


def _load_mnist(root: Path, split: str, download: bool):
    pkl = _mnist_pickle(root)
    if pkl is None:
        raise _mnist_missing(root)
    hint = f"Reinstall it with:  {reg.MNIST_INSTALL} --force-reinstall"
    # The source hash is checked on every load (17 MB, ~40 ms): a cache never outlives its source.
    verify_digest(f"MNIST pickle ({pkl})", file_digest(pkl), reg.MNIST_PICKLE_SHA256, hint=hint)
    hit = _cache_read(_cache_file(root, "mnist", split, reg.MNIST_PICKLE_SHA256))
    if hit is not None and not _mnist_matches_lecun(split, hit[0], hit[1]):
        hit = None  # a cache that no longer matches the original data is rebuilt
    if hit is None:
        splits = decode_mnist_pickle(pkl, reg.MNIST_PICKLE_SHA256, hint=hint)
        for s, (x, y) in splits.items():
            if not _mnist_matches_lecun(s, x, y):
                raise ChecksumError(f"MNIST {s} decoded from {pkl} differs from LeCun's original IDX files. {hint}")
            _cache_write(_cache_file(root, "mnist", s, reg.MNIST_PICKLE_SHA256), x, y, reg.MNIST_CLASSES)
        hit = (*splits[split], reg.MNIST_CLASSES)
    return hit[0], hit[1], reg.MNIST_CLASSES, f"pip package {reg.MNIST_PIP_PACKAGE} ({pkl})"


# ---------------------------------------------------------------------- Fashion-MNIST
def _fashion_dir(root: Path) -> Path | None:
    for folder in (root / "fashion-mnist", Path(reg.FASHION_SYSTEM_DIR)):
        if all(_idx_path(folder, stem) is not None for pair in _IDX_STEMS.values() for stem in pair):
            return folder
    return None


def _idx_path(folder: Path, stem: str) -> Path | None:
    for candidate in (folder / f"{stem}.gz", folder / stem):
        if candidate.is_file():
            return candidate
    return None


def _load_fashion(root: Path, split: str, download: bool):
    folder = _fashion_dir(root)
    if folder is None:
        raise DatasetNotFoundError(
            f"Fashion-MNIST is not installed. Install the offline copy with:  {reg.FASHION_INSTALL}  "
            f"(it provides {reg.FASHION_SYSTEM_DIR}/; or put the four IDX files, gzipped or not, in "
            f"{root / 'fashion-mnist'})"
        )
    hint = f"Reinstall with:  sudo apt-get install --reinstall {reg.FASHION_APT_PACKAGE}"
    img_stem, lab_stem = _IDX_STEMS[split]
    x = read_idx_file(_idx_path(folder, img_stem), reg.FASHION_IDX_SHA256[img_stem], "Fashion-MNIST images", hint)
    y = read_idx_file(_idx_path(folder, lab_stem), reg.FASHION_IDX_SHA256[lab_stem], "Fashion-MNIST labels", hint)
    return x[:, None], y, reg.FASHION_CLASSES, f"IDX files in {folder}"


# ---------------------------------------------------------------------------- digits
def digits_split_indices(labels: np.ndarray) -> dict[str, np.ndarray]:
    """The fixed, seeded, stratified train/test split of the 1797 sklearn digits.

    Within each class the images are shuffled by ``numpy.random.default_rng(20191201)``
    (one permutation of all indices, then a stable sort by label) and the first
    ``round(0.2 * n_class)`` go to the test split; both splits keep the original order.
    """
    rng = np.random.default_rng(reg.DIGITS_SPLIT_SEED)
    perm = rng.permutation(labels.size)
    grouped = perm[np.argsort(labels[perm], kind="stable")]
    counts = np.bincount(labels, minlength=10)
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    rank = np.arange(labels.size) - np.repeat(starts, counts)
    n_test = np.rint(reg.DIGITS_TEST_FRACTION * counts).astype(int)
    is_test = rank < np.repeat(n_test, counts)
    return {"test": np.sort(grouped[is_test]), "train": np.sort(grouped[~is_test])}


def _load_digits(root: Path, split: str, download: bool):
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = bunch.images
    if not np.array_equal(images, np.rint(images)) or images.min() < 0 or images.max() > 16:
        raise ChecksumError("sklearn digits: pixel values are not integers in 0..16")
    x = images.astype(np.uint8)
    y = bunch.target.astype(np.uint8)
    verify_digest("sklearn digits images", hashlib.sha256(x.tobytes()).hexdigest(), reg.DIGITS_IMAGES_SHA256)
    verify_digest("sklearn digits labels", hashlib.sha256(y.tobytes()).hexdigest(), reg.DIGITS_LABELS_SHA256)
    idx = digits_split_indices(y)[split]
    return x[idx, None], y[idx], reg.DIGITS_CLASSES, "scikit-learn's bundled digits (sklearn.datasets.load_digits)"


# ----------------------------------------------------------------------------- CIFAR
def cifar_archive_trusted_sha256(archive: Path, source, sha256: str | None = None) -> set[str]:
    """Hashes accepted for an archive: the pinned one, plus ``sha256`` when the caller gives it explicitly.

    Nothing found next to the data is trusted: a ``<archive>.sha256`` file (which older
    versions wrote and read) could be planted by anyone who can write the data folder.
    """
    trusted = {source.archive_sha256}
    if sha256 is not None:
        trusted.add(sha256.lower())
    return trusted


def _cifar_locations(root: Path, source) -> tuple[Path | None, Path | None]:
    folder = None
    for candidate in (root / source.folder, root):
        if (candidate / source.meta_file).is_file():
            folder = candidate
            break
    archive = root / source.archive
    return folder, (archive if archive.is_file() else None)


def cifar_missing_message(root: Path, source) -> str:
    return (
        f"{source.name.upper()} is not in {root}. Download it (170 MB, checksum-verified) with:  "
        f"bnlab data download {source.name} --data-dir {root}   or in Python:  "
        f"bnlab.data.download_cifar({source.name!r}, data_dir={str(root)!r})   "
        f"(or load_dataset({source.name!r}, download=True)); or place {source.archive} or the extracted "
        f"{source.folder}/ folder in {root}"
    )


def _load_cifar(name: str, root: Path, split: str, download: bool, sha256: str | None = None):
    source = reg.CIFAR[name]
    folder, archive = _cifar_locations(root, source)
    if folder is None and archive is None:
        if not download:
            raise DatasetNotFoundError(cifar_missing_message(root, source))
        from bnlab.data.datasets import download_cifar

        archive = download_cifar(name, root, sha256=sha256)
    hint = (f"Delete it and run:  bnlab data download {name} --data-dir {root}  (or, for an archive that "
            "differs from the official one on purpose, give its SHA-256 with --sha256)")
    if folder is not None:
        try:
            x, y, classes = read_cifar_dir(folder, source, split, hint)
        except FileNotFoundError as exc:
            raise DatasetNotFoundError(f"{name} folder {folder} is incomplete ({exc}). "
                                       + cifar_missing_message(root, source)) from None
        return x, y, classes, f"extracted folder {folder}"
    digest = file_digest(archive)
    trusted = cifar_archive_trusted_sha256(archive, source, sha256)
    if digest not in trusted:
        verify_digest(f"{name} archive ({archive})", digest, source.archive_sha256, hint=hint)
    cache = _cache_file(root, name, split, digest)
    hit = _cache_read(cache)
    if hit is None:
        hit = read_cifar_archive(archive, source, split)
        _cache_write(cache, *hit)
    return (*hit, f"archive {archive}")


# --------------------------------------------------------------------------- dispatch
def load_uint8(name: str, root: Path, split: str, download: bool, sha256: str | None = None):
    if name in ("mnist", "fashion_mnist"):
        return _memoized(name, root, split, download)
    if name == "digits":
        return _load_digits(root, split, download)
    return _load_cifar(name, root, split, download, sha256)


# ------------------------------------------------------------------- verified in this process
#: Splits this process verified and decoded, with the identity of every file they were read from.
#: Verifying MNIST costs ~0.3–0.7 s per load (the pickle's hash, the cache's stamp, the re-encoding
#: to LeCun's IDX hashes), paid by every cell of a sweep that loads it — ~100 cells of a small
#: ``bnlab report`` per worker process.  A file is read again, and verified again, as soon as its
#: identity (device, inode, size, modification and change time in ns) differs from the one verified: a replaced
#: or rewritten file is never served from here.  Callers get fresh arrays (``load_dataset`` converts
#: to float32; the labels are copied), never the kept ones.  At most ``_MEMO_SPLITS`` splits are
#: kept (MNIST and Fashion-MNIST, train and test: ~110 MB of uint8).  The identity includes the
#: change time, which ``os.utime`` cannot set back; and a split is kept only when every file is older
#: than ``_SETTLED_NS``: file times tick in jiffies (a few ms), so a file written in the same tick as
#: its verification could be rewritten unseen (git's "racy" entries, the same remedy).
_MEMO: dict[tuple, tuple] = {}
_MEMO_SPLITS = 4
_SETTLED_NS = 2_000_000_000


def _identity(paths) -> tuple | None:
    """(path, device, inode, size, mtime, ctime) of each file; None if one is missing or not settled."""
    out = []
    now = time.time_ns()
    for path in paths:
        try:
            st = os.stat(path)
        except OSError:
            return None
        if max(st.st_mtime_ns, st.st_ctime_ns) > now - _SETTLED_NS:
            return None
        out.append((str(path), st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(out)


def _source_files(name: str, root: Path, split: str) -> list[Path] | None:
    """The files a load of ``name``/``split`` reads (None: not found; the loader then says how to get it)."""
    if name == "mnist":
        pkl = _mnist_pickle(root)
        if pkl is None:
            return None
        cache = _cache_file(root, "mnist", split, reg.MNIST_PICKLE_SHA256)
        return [Path(pkl), cache, cache.with_suffix(".sha256")]
    folder = _fashion_dir(root)
    if folder is None:
        return None
    return [_idx_path(folder, stem) for stem in _IDX_STEMS[split]]


def _memoized(name: str, root: Path, split: str, download: bool):
    loader = _load_mnist if name == "mnist" else _load_fashion
    files = _source_files(name, root, split)
    key = (name, str(root), split)
    before = None if files is None else _identity(files)
    hit = _MEMO.get(key)
    if hit is not None and before is not None and hit[0] == before:
        return hit[1]
    result = loader(root, split, download)
    # kept only when no file changed while it was read and verified (a first load writes the decoded
    # cache: not settled, so not kept until a later load)
    after = None if files is None else _identity(files)
    _MEMO.pop(key, None)
    if after is not None and after == before:
        while len(_MEMO) >= _MEMO_SPLITS:
            _MEMO.pop(next(iter(_MEMO)))
        x, y = result[0], result[1]
        x.setflags(write=False)  # kept: nobody writes into it (load_dataset hands out converted copies)
        y.setflags(write=False)
        _MEMO[key] = (after, result)
    return result


def locate(name: str, root: Path) -> tuple[bool, str]:
    """(available here?, where it is or how to get it) — existence checks only, no hashing."""
    if name == "mnist":
        pkl = _mnist_pickle(root)
        return (True, f"pip package {reg.MNIST_PIP_PACKAGE}: {pkl}") if pkl else (False, str(_mnist_missing(root)))
    if name == "fashion_mnist":
        folder = _fashion_dir(root)
        if folder:
            return True, f"IDX files in {folder}"
        return False, f"not installed: {reg.FASHION_INSTALL}"
    if name == "digits":
        return True, "scikit-learn's bundled 8x8 digits (1797 images)"
    source = reg.CIFAR[name]
    folder, archive = _cifar_locations(root, source)
    if folder is not None:
        return True, f"extracted folder {folder}"
    if archive is not None:
        return True, f"archive {archive}"
    return False, (f"bnlab data download {source.name} --data-dir {root}  (or place {source.archive} "
                   f"or {source.folder}/ there)")
