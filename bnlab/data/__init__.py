"""Datasets from offline sources, verified by checksums: MNIST, Fashion-MNIST, CIFAR-10/100, digits.

See :mod:`bnlab.data.datasets` and ``docs/data.md``.
"""
from bnlab.data.datasets import (
    DATASET_NAMES,
    ChecksumError,
    Dataset,
    DatasetNotFoundError,
    data_dir,
    download_cifar,
    list_datasets,
    load_dataset,
    standardize,
)
from bnlab.data._download import DownloadTooLargeError
from bnlab.data.augment import RandomCropFlip, random_crop_flip

__all__ = [
    "Dataset",
    "load_dataset",
    "list_datasets",
    "data_dir",
    "download_cifar",
    "standardize",
    "DatasetNotFoundError",
    "ChecksumError",
    "DownloadTooLargeError",
    "DATASET_NAMES",
    "random_crop_flip",
    "RandomCropFlip",
]
