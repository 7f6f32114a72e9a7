"""``bnlab._validation.check_path``: the one validator of the paths bnlab reads and writes (results
stores, exports, output folders), and its three users agreeing with it."""
from __future__ import annotations

import os

import pytest

from bnlab._validation import check_path


def _bad(match, *args, **kw):
    with pytest.raises(ValueError, match=match):
        check_path(*args, **kw)


def test_a_writable_new_file_and_folder_pass_and_come_back_as_paths(tmp_path):
    assert check_path("out", str(tmp_path / "a" / "b.csv")) == tmp_path / "a" / "b.csv"
    assert check_path("out", tmp_path / "new" / "dir", kind="directory") == tmp_path / "new" / "dir"
    assert check_path("out", tmp_path, kind="directory") == tmp_path


@pytest.mark.parametrize("value", ["", "   ", None])
def test_empty_paths_are_refused_naming_the_argument(value):
    _bad(r"out=.* expected a file path", "out", value)
    _bad(r"dir=.* expected a directory path", "dir", value, kind="directory")


@pytest.mark.parametrize("value", [123, 1.5, ["a.pt"], object()])
def test_anything_but_a_path_is_refused_not_made_one(value):
    # str() would make a path of anything: 123 -> "123", b"x" -> "b'x'"
    _bad(r"out=.* expected a file path \(a str or a path-like object\), got", "out", value)


def test_bytes_and_path_like_values_are_paths(tmp_path):
    assert check_path("out", os.fsencode(tmp_path / "b.pt")) == tmp_path / "b.pt"

    class Like:
        def __fspath__(self):
            return str(tmp_path / "c.pt")

    assert check_path("out", Like()) == tmp_path / "c.pt"


def test_malformed_paths_are_refused(tmp_path):
    _bad("white space", "out", " x.csv")
    _bad("NUL", "out", "a\x00b")
    _bad("expected a file path", "out", "..")
    _bad("at most 4000", "out", "a/" * 2100)
    _bad("255 per part", "out", "x" * 256)
    _bad("kind", "out", "x", kind="socket")


def test_the_wrong_kind_of_existing_path_is_refused(tmp_path):
    f = tmp_path / "f.txt"
    f.write_text("x")
    _bad("is a directory", "out", tmp_path)
    _bad("not a regular file", "out", "/dev/null")
    _bad("exists and is not a directory", "dir", f, kind="directory")
    _bad("(?i)not a directory", "out", f / "below.csv")  # a file where a folder must be


def test_links_to_nothing_are_refused_unless_the_file_is_replaced(tmp_path):
    os.symlink(tmp_path / "nowhere" / "x", tmp_path / "dangling")
    _bad("symbolic link", "store", tmp_path / "dangling")
    _bad("symbolic link", "dir", tmp_path / "dangling", kind="directory")
    assert check_path("out", tmp_path / "dangling", replaced=True) == tmp_path / "dangling"
    # a dangling link on the way up: nothing below it can be created
    _bad("symbolic link", "out", tmp_path / "dangling" / "sub" / "x.csv")


def test_readonly_paths_must_exist(tmp_path):
    _bad("does not exist", "store", tmp_path / "missing.sqlite", readonly=True)
    f = tmp_path / "s.sqlite"
    f.write_bytes(b"")
    assert check_path("store", f, readonly=True) == f


@pytest.mark.parametrize("where", ["/sys", "/proc"])
def test_a_folder_that_refuses_new_files_is_refused_also_where_the_permission_bits_allow(where, tmp_path):
    """os.access lets root write to /sys and /proc (and to read-only mounts), whose file systems refuse every new
    file: the output failed after the work that produced it.  The probe (a folder created and removed) refuses
    it up front, for any user; a writable folder is left as it was."""
    if not os.path.isdir(where):
        pytest.skip(f"no {where} here")
    _bad("not writable", "out", f"{where}/x.csv")
    _bad("not writable", "out", f"{where}/no/such/folder/x.csv")
    assert check_path("out", tmp_path / "x.csv") == tmp_path / "x.csv" and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_files_and_folders_are_refused(tmp_path):
    f = tmp_path / "ro.csv"
    f.write_text("x")
    f.chmod(0o444)
    _bad("permission denied", "store", f)
    assert check_path("out", f, replaced=True) == f  # renamed over: the folder's permission counts
    d = tmp_path / "locked"
    d.mkdir()
    d.chmod(0o555)
    try:
        _bad("not writable", "out", d / "x.csv")
        _bad("not writable", "dir", d / "sub", kind="directory")
    finally:
        d.chmod(0o755)


def test_the_three_users_refuse_alike(tmp_path):
    from bnlab.cli._common import check_output_dir
    from bnlab.experiments import export_sweep
    from bnlab.experiments.store import ResultsStore

    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    with pytest.raises(ValueError, match="store=.*symbolic link"):
        ResultsStore(tmp_path / "dangling")
    with pytest.raises(ValueError, match="results_dir=.*symbolic link"):
        check_output_dir("results_dir", tmp_path / "dangling")
    with pytest.raises(ValueError, match="output=.*is a directory"):
        export_sweep(tmp_path / "s.sqlite", tmp_path)
    with pytest.raises(ValueError, match="store=.*is a directory"):
        ResultsStore(tmp_path)
    with pytest.raises(ValueError, match="out=.*exists and is not a directory"):
        (tmp_path / "f").write_text("x")
        check_output_dir("out", tmp_path / "f")
