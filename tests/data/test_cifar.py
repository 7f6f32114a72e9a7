"""CIFAR-10/100 from generated fixtures in the real layout, and the download on loopback.

The fixtures (tests/data/_cifar_fixture.py) are written exactly as the authors' python
version (pickled dicts with bytes keys, uint8 (N, 3072) planes).  The independent route
for the pixel layout is direct indexing of the stored row: pixel (channel c, row i,
column j) of image n is ``data[n, 1024*c + 32*i + j]`` (the CIFAR page's definition);
the loader's reshape must agree exactly.  Checksums are computed here for the generated
bytes and substituted for the pinned ones (the real pins are first shown to reject the
fixture).
"""
from __future__ import annotations

import dataclasses
import hashlib
import http.server
import os
import pickle
import threading
from contextlib import contextmanager
from functools import partial

import numpy as np
import pytest
import torch

import bnlab.data as bd
from bnlab.data import _registry as reg
from bnlab.data._integrity import ChecksumError, UnsafePickleError

from ._cifar_fixture import make_cifar


def _pin(monkeypatch, fx, archive=None, **extra):
    fields = dict(file_md5=fx.md5s())
    if archive is not None:
        data = archive.read_bytes()
        fields.update(archive_sha256=hashlib.sha256(data).hexdigest(), archive_md5=hashlib.md5(data).hexdigest(),
                      archive_size=len(data))
    fields.update(extra)  # explicit overrides win (e.g. a wrong MD5 to test its check)
    monkeypatch.setitem(reg.CIFAR, fx.name, dataclasses.replace(reg.CIFAR[fx.name], **fields))


def _check_against_fixture(d, fx, split):
    raw = fx.x_train if split == "train" else fx.x_test
    labels = fx.y_train if split == "train" else fx.y_test
    n = raw.shape[0]
    assert tuple(d.x.shape) == (n, 3, 32, 32) and d.x.dtype == torch.float32
    assert d.y.dtype == torch.int64 and d.y.tolist() == list(labels)
    assert list(d.classes) == fx.classes and d.num_classes == len(fx.classes)
    rng = np.random.default_rng(1)
    for _ in range(200):  # direct indexing, not a reshape
        k, c, i, j = rng.integers(n), rng.integers(3), rng.integers(32), rng.integers(32)
        assert d.x[k, c, i, j].item() == np.float32(raw[k, 1024 * c + 32 * i + j]) / np.float32(255)
    assert torch.equal(torch.round(d.x * 255).to(torch.uint8).reshape(n, -1), torch.from_numpy(raw))


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
@pytest.mark.parametrize("protocol", [2, pickle.HIGHEST_PROTOCOL])
def test_cifar_extracted_folder(tmp_path, monkeypatch, name, protocol):
    fx = make_cifar(name, protocol=protocol)
    folder = fx.write_dir(tmp_path)
    # The real pins reject generated files, naming the file and the fix.
    with pytest.raises(ChecksumError, match=rf"MD5 mismatch.*bnlab data download {name}"):
        bd.load_dataset(name, data_dir=tmp_path)
    _pin(monkeypatch, fx)
    for split in ("train", "test"):
        d = bd.load_dataset(name, split, data_dir=tmp_path)
        _check_against_fixture(d, fx, split)
        assert str(folder) in d.source
    # data_dir may also point at the extracted folder itself.
    _check_against_fixture(bd.load_dataset(name, "test", data_dir=folder), fx, "test")


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
def test_cifar_archive(tmp_path, monkeypatch, name):
    fx = make_cifar(name, seed=5)
    archive = fx.write_archive(tmp_path / reg.CIFAR[name].archive)
    with pytest.raises(ChecksumError, match="SHA256 mismatch"):
        bd.load_dataset(name, data_dir=tmp_path)
    _pin(monkeypatch, fx, archive)
    for split in ("train", "test"):
        d = bd.load_dataset(name, split, data_dir=tmp_path)
        _check_against_fixture(d, fx, split)
        assert "archive" in d.source
        again = bd.load_dataset(name, split, data_dir=tmp_path)  # from the verified cache
        assert torch.equal(again.x, d.x) and again.classes == d.classes
    assert any((tmp_path / "cache").glob(f"{name}-train-*.npz"))


def test_cifar_malicious_member_is_refused(tmp_path, monkeypatch):
    # Even with a matching checksum (a weak MD5 could be forged), a batch that asks for
    # os.system is refused by the restricted unpickler and nothing runs.
    class Boom:
        def __reduce__(self):
            return (os.system, ("echo pwned > " + str(tmp_path / "pwned"),))

    fx = make_cifar("cifar10")
    fx.files["test_batch"] = pickle.dumps({b"data": Boom(), b"labels": []}, protocol=2)
    fx.write_dir(tmp_path)
    _pin(monkeypatch, fx)
    with pytest.raises(UnsafePickleError, match="test_batch.*refusing to load global"):
        bd.load_dataset("cifar10", "test", data_dir=tmp_path)
    assert not (tmp_path / "pwned").exists()
    fx.files["test_batch"] = pickle.dumps({b"data": np.zeros((2, 100), np.uint8), b"labels": [0, 1]})
    fx.write_dir(tmp_path)
    _pin(monkeypatch, fx)
    with pytest.raises(ValueError, match=r"expected data uint8 \(N, 3072\)"):
        bd.load_dataset("cifar10", "test", data_dir=tmp_path)


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """Serves files; honours a single ``Range: bytes=K-`` header (for the resume test)."""

    seen: list = []
    supports_range = True

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_GET(self):
        type(self).seen.append(self.headers.get("Range"))
        rng = self.headers.get("Range")
        if not (rng and self.supports_range):
            return super().do_GET()
        path = self.translate_path(self.path)
        data = open(path, "rb").read()
        start = int(rng.removeprefix("bytes=").rstrip("-"))
        self.send_response(206)
        self.send_header("Content-Length", str(len(data) - start))
        self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        self.end_headers()
        self.wfile.write(data[start:])


@contextmanager
def _serve(directory, supports_range=True):
    handler = type("H", (_RangeHandler,), {"seen": [], "supports_range": supports_range})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), partial(handler, directory=str(directory)))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler.seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def served_cifar10(tmp_path):
    fx = make_cifar("cifar10", seed=9)
    archive = fx.write_archive(tmp_path / "srv" / "cifar-10-python.tar.gz")
    return fx, archive, hashlib.sha256(archive.read_bytes()).hexdigest()


@pytest.mark.network
def test_download_good_checksum_then_load(tmp_path, served_cifar10, capsys, monkeypatch):
    fx, archive, sha = served_cifar10
    dest = tmp_path / "dest"
    with _serve(archive.parent) as (base, seen):
        path = bd.download_cifar("cifar10", dest, url=f"{base}/{archive.name}", sha256=sha, progress=True)
        assert path == dest / "cifar-10-python.tar.gz" and path.read_bytes() == archive.read_bytes()
        assert "cifar-10-python.tar.gz" in capsys.readouterr().err  # the progress bar
        # Already there and verified: not fetched again.
        bd.download_cifar("cifar10", dest, url=f"{base}/{archive.name}", sha256=sha, progress=False)
        assert len(seen) == 1
    assert not list(dest.glob("*.part"))
    # The user-supplied hash is not recorded next to the data (a planted file there must not
    # widen the pin): load_dataset accepts the archive only when given the hash explicitly.
    assert not list(dest.glob("*.sha256"))
    # Only the per-file pins are substituted (they do not apply to archives): the archive is
    # accepted because of the given hash, not because its pin was replaced.
    _pin(monkeypatch, fx)
    _check_against_fixture(bd.load_dataset("cifar10", "test", data_dir=dest, sha256=sha), fx, "test")
    with pytest.raises(ChecksumError, match="SHA256 mismatch"):
        bd.load_dataset("cifar10", "train", data_dir=dest)


@pytest.mark.network
def test_download_bad_checksum_leaves_nothing(tmp_path, served_cifar10):
    fx, archive, sha = served_cifar10
    dest = tmp_path / "dest"
    with _serve(archive.parent) as (base, _):
        with pytest.raises(ChecksumError, match="SHA256 mismatch"):
            bd.download_cifar("cifar10", dest, url=f"{base}/{archive.name}", sha256="0" * 64, progress=False)
        # Default pins (the real archive's SHA-256 and MD5) reject the fixture too.
        with pytest.raises(ChecksumError):
            bd.download_cifar("cifar10", dest, url=f"{base}/{archive.name}", progress=False)
    assert sorted(os.listdir(dest)) == []
    with pytest.raises(bd.DatasetNotFoundError):
        bd.load_dataset("cifar10", data_dir=dest)


@pytest.mark.network
def test_download_pinned_md5_is_checked(tmp_path, served_cifar10, monkeypatch):
    fx, archive, sha = served_cifar10
    # Pinned mode (sha256=None) checks the SHA-256 *and* the published MD5.
    _pin(monkeypatch, fx, archive, archive_md5="0" * 32)
    with _serve(archive.parent) as (base, _):
        with pytest.raises(ChecksumError, match="MD5 mismatch"):
            bd.download_cifar("cifar10", tmp_path, url=f"{base}/{archive.name}", progress=False)
        assert not list(tmp_path.glob("cifar-10*"))
        _pin(monkeypatch, fx, archive)
        bd.download_cifar("cifar10", tmp_path, url=f"{base}/{archive.name}", progress=False)
    assert not (tmp_path / "cifar-10-python.tar.gz.sha256").exists()  # pinned: no stamp needed


@pytest.mark.network
def test_load_dataset_download_true(tmp_path, served_cifar10, monkeypatch):
    fx, archive, sha = served_cifar10
    with _serve(archive.parent) as (base, _):
        _pin(monkeypatch, fx, archive, url=f"{base}/{archive.name}")
        d = bd.load_dataset("cifar10", "train", data_dir=tmp_path / "d", download=True)
    _check_against_fixture(d, fx, "train")


@pytest.mark.network
@pytest.mark.parametrize("supports_range", [True, False])
def test_download_resumes_from_part_file(tmp_path, served_cifar10, supports_range):
    fx, archive, sha = served_cifar10
    data = archive.read_bytes()
    dest = tmp_path / "dest"
    dest.mkdir()
    half = len(data) // 2
    # An interrupted earlier download left the first half (range server) or garbage
    # (server without Range support: the client must notice the 200 and start over).
    part = dest / "cifar-10-python.tar.gz.part"
    part.write_bytes(data[:half] if supports_range else b"\0" * half)
    with _serve(archive.parent, supports_range) as (base, seen):
        bd.download_cifar("cifar10", dest, url=f"{base}/{archive.name}", sha256=sha, progress=False)
    assert seen == [f"bytes={half}-"]
    assert (dest / "cifar-10-python.tar.gz").read_bytes() == data and not part.exists()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("planted", ["fifo", "link", "folder"])
def test_a_planted_part_file_is_refused_unread(tmp_path, served_cifar10, planted):
    """A ``.part`` that is not a regular file is neither read nor written: a FIFO hung the download (its
    read blocks; the timeout fails the test), a link would have had the download appended to its target."""
    _, archive, sha = served_cifar10
    dest = tmp_path / "dest"
    dest.mkdir()
    part = dest / "cifar-10-python.tar.gz.part"
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    {"fifo": lambda: os.mkfifo(part), "link": lambda: part.symlink_to(victim), "folder": part.mkdir}[planted]()
    with pytest.raises(OSError, match="partial download .* is not a regular file"):
        bd.download_cifar("cifar10", dest, url=archive.as_uri(), sha256=sha, progress=False)
    assert victim.read_text() == "precious" and not (dest / "cifar-10-python.tar.gz").exists()


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        (dict(name="mnist"), "name='mnist'"),
        (dict(name="cifar10", url="ftp://x/y.tgz"), "url='ftp://x/y.tgz'"),
        (dict(name="cifar10", sha256="abc"), "sha256='abc'"),
    ],
)
def test_download_bad_arguments(tmp_path, kwargs, arg):
    with pytest.raises(ValueError) as err:
        bd.download_cifar(data_dir=tmp_path, **kwargs)
    assert arg in str(err.value) and "expected" in str(err.value)
    assert not list(tmp_path.iterdir())


@pytest.mark.network
def test_download_unreachable_server_is_an_oserror(tmp_path):
    with _serve(tmp_path) as (base, _):
        pass  # the server is closed again: the port refuses connections
    with pytest.raises(OSError, match="download of"):
        bd.download_cifar("cifar10", tmp_path / "d", url=f"{base}/nothing.tar.gz", sha256="0" * 64, progress=False)


def test_cifar_incomplete_folder_says_how_to_get_it(tmp_path, monkeypatch):
    fx = make_cifar("cifar10")
    folder = fx.write_dir(tmp_path)
    _pin(monkeypatch, fx)
    (folder / "data_batch_3").unlink()
    bd.load_dataset("cifar10", "test", data_dir=tmp_path)  # the test split does not need it
    with pytest.raises(bd.DatasetNotFoundError, match=r"data_batch_3 is missing.*bnlab data download cifar10"):
        bd.load_dataset("cifar10", "train", data_dir=tmp_path)
