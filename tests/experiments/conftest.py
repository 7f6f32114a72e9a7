import os
from pathlib import Path

import pytest

from . import _helpers


def helper_pythonpath() -> str:
    """The sys.path entry that makes ``_helpers`` importable under its current name (for subprocesses)."""
    depth = len(_helpers.__name__.split("."))
    root = Path(_helpers.__file__).resolve().parents[depth - 1]
    return os.pathsep.join([str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])


@pytest.fixture
def test_env(tmp_path, monkeypatch):
    """A marker directory and a small grid for the test experiments; workers inherit the environment."""
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv("BNLAB_TEST_MARKERS", str(markers))
    monkeypatch.setenv("BNLAB_TEST_CELLS", "6")
    monkeypatch.setenv("BNLAB_TEST_SLEEP", "0.01")
    monkeypatch.setenv("BNLAB_TEST_FAIL", "")
    monkeypatch.setenv("BNLAB_TEST_SLOW", "")
    monkeypatch.delenv("BNLAB_RESULTS", raising=False)
    return markers


@pytest.fixture
def helpers():
    return _helpers


@pytest.fixture
def subprocess_env(test_env):
    env = dict(os.environ)
    env["PYTHONPATH"] = helper_pythonpath()
    env["OMP_NUM_THREADS"] = "1"
    return env


@pytest.fixture
def helper_ref():
    """``module:NAME`` reference of the main test experiment, valid in subprocesses with ``subprocess_env``."""
    return f"{_helpers.__name__}:{_helpers.SWEEP.name}"

