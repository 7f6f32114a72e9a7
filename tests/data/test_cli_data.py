"""``bnlab data list|check|download`` through the real argument parser."""
from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

from bnlab.cli import main
from bnlab.data import _registry

from ._cifar_fixture import make_cifar
from .test_cifar import _serve
from .test_offline import HAVE_FASHION


def _run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_list_json(tmp_path, capsys):
    code, out, _ = _run(capsys, "data", "list", "--json", "--data-dir", str(tmp_path))
    doc = json.loads(out)
    assert code == 0 and doc["data_dir"] == str(tmp_path)
    assert set(doc["datasets"]) == set(_registry.DATASET_NAMES)
    assert doc["datasets"]["digits"]["available"] is True
    assert doc["datasets"]["cifar10"]["available"] is False
    assert f"bnlab data download cifar10 --data-dir {tmp_path}" in doc["datasets"]["cifar10"]["detail"]
    code, out, _ = _run(capsys, "data", "list", "--data-dir", str(tmp_path))
    assert code == 0 and "digits" in out and "missing" in out


def test_check_digits_json_matches_library(tmp_path, capsys):
    from bnlab.data import load_dataset

    code, out, _ = _run(capsys, "data", "check", "digits", "--json", "--data-dir", str(tmp_path))
    doc = json.loads(out)
    assert code == 0 and [r["split"] for r in doc] == ["train", "test"]
    for r in doc:
        d = load_dataset("digits", r["split"])
        assert r["n"] == len(d) and r["class_counts"] == np.bincount(d.y.numpy()).tolist()
        assert r["image_shape"] == [1, 8, 8] and r["x_dtype"] == "float32" and r["verified"] is True
    code, out, _ = _run(capsys, "data", "check", "digits", "--split", "test")
    assert code == 0 and "359 images 1x8x8" in out and "checksums OK" in out


@pytest.mark.skipif(not HAVE_FASHION, reason=f"offline Fashion-MNIST absent: {_registry.FASHION_INSTALL}")
def test_check_fashion_test_split(capsys):
    code, out, _ = _run(capsys, "data", "check", "fashion_mnist", "--split", "test", "--json")
    (r,) = json.loads(out)
    assert code == 0 and r["n"] == 10000 and r["class_counts"] == [1000] * 10 and r["x_max"] == 1.0


def test_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["data", "check", "imagenet"])
    assert exc.value.code == 2 and "name='imagenet'" in capsys.readouterr().err
    code, _, err = _run(capsys, "data", "check", "cifar100", "--data-dir", str(tmp_path))
    assert code == 1 and f"bnlab data download cifar100 --data-dir {tmp_path}" in err
    with pytest.raises(SystemExit) as exc:
        main(["data", "download", "mnist", "--data-dir", str(tmp_path)])
    assert exc.value.code == 2 and "name='mnist'" in capsys.readouterr().err


@pytest.mark.network
def test_download_command(tmp_path, capsys):
    fx = make_cifar("cifar100", seed=2)
    archive = fx.write_archive(tmp_path / "srv" / "cifar-100-python.tar.gz")
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    with _serve(archive.parent) as (base, _):
        code, out, _ = _run(capsys, "data", "download", "cifar100", "--data-dir", str(tmp_path / "d"),
                            "--url", f"{base}/{archive.name}", "--sha256", sha, "--no-progress", "--json")
        assert code == 0 and json.loads(out)["path"] == str(tmp_path / "d" / "cifar-100-python.tar.gz")
        with pytest.raises(SystemExit) as exc:
            main(["data", "download", "cifar100", "--data-dir", str(tmp_path / "e"),
                  "--url", f"{base}/{archive.name}", "--sha256", "1" * 64, "--no-progress"])
        assert exc.value.code == 2 and "SHA256 mismatch" in capsys.readouterr().err
    assert not (tmp_path / "e").exists() or not any((tmp_path / "e").iterdir())
