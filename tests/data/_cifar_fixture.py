"""Small CIFAR-10/100 fixtures in the real "python version" layout.

Each batch is a pickled dict with bytes keys, ``b'data'`` a uint8 (N, 3072) array (1024
red, 1024 green, 1024 blue values, each plane row-major 32x32), ``b'labels'`` (CIFAR-10)
or ``b'fine_labels'`` + ``b'coarse_labels'`` (CIFAR-100) lists of ints, plus
``b'batch_label'`` and ``b'filenames'``; ``batches.meta`` / ``meta`` hold the class names.
The real files were written by Python 2 (pickle protocol 2); ``protocol`` lets a test
produce both that and a modern protocol.
"""
from __future__ import annotations

import hashlib
import io
import pickle
import tarfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

CIFAR10_NAMES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


@dataclass
class Fixture:
    name: str
    folder: str  # top-level folder name
    files: dict[str, bytes]  # file name -> pickled bytes
    x_train: np.ndarray  # uint8 (N, 3072) exactly as stored
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    classes: list[str]

    def md5s(self) -> dict[str, str]:
        return {k: hashlib.md5(v).hexdigest() for k, v in self.files.items()}

    def write_dir(self, root: Path) -> Path:
        folder = root / self.folder
        folder.mkdir(parents=True, exist_ok=True)
        for k, v in self.files.items():
            (folder / k).write_bytes(v)
        return folder

    def write_archive(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tarfile.open(path, "w:gz") as tar:
            for k, v in self.files.items():
                info = tarfile.TarInfo(f"{self.folder}/{k}")
                info.size = len(v)
                tar.addfile(info, io.BytesIO(v))
        return path


def make_cifar(name: str, per_batch: int = 6, seed: int = 0, protocol: int = 2) -> Fixture:
    rng = np.random.default_rng(seed)
    files: dict[str, bytes] = {}
    if name == "cifar10":
        classes = CIFAR10_NAMES
        batches = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
        xs, ys = {}, {}
        for b in batches:
            x = rng.integers(0, 256, size=(per_batch, 3072), dtype=np.uint8)
            y = rng.integers(0, 10, size=per_batch).tolist()
            xs[b], ys[b] = x, y
            files[b] = pickle.dumps(
                {b"batch_label": f"{b} of 5".encode(), b"labels": y, b"data": x,
                 b"filenames": [f"img_{i}.png".encode() for i in range(per_batch)]},
                protocol=protocol,
            )
        files["batches.meta"] = pickle.dumps(
            {b"label_names": [c.encode() for c in classes], b"num_cases_per_batch": per_batch, b"num_vis": 3072},
            protocol=protocol,
        )
        train = batches[:5]
        return Fixture(name, "cifar-10-batches-py", files,
                       np.concatenate([xs[b] for b in train]), np.concatenate([ys[b] for b in train]),
                       xs["test_batch"], np.array(ys["test_batch"]), classes)
    if name == "cifar100":
        classes = [f"fine_{i:03d}" for i in range(100)]
        out = {}
        for split, n in (("train", 5 * per_batch), ("test", per_batch)):
            x = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
            fine = rng.integers(0, 100, size=n).tolist()
            coarse = [f // 5 for f in fine]
            out[split] = (x, np.array(fine))
            files[split] = pickle.dumps(
                {b"filenames": [f"{split}_{i}.png".encode() for i in range(n)], b"batch_label": split.encode(),
                 b"fine_labels": fine, b"coarse_labels": coarse, b"data": x},
                protocol=protocol,
            )
        files["meta"] = pickle.dumps(
            {b"fine_label_names": [c.encode() for c in classes],
             b"coarse_label_names": [f"coarse_{i}".encode() for i in range(20)]},
            protocol=protocol,
        )
        return Fixture(name, "cifar-100-python", files, *out["train"], *out["test"], classes)
    raise ValueError(name)
