"""``--threads`` of the long-running commands: offered by each, checked (exit 2 naming it), applied."""
import pytest
import torch

from bnlab import _threads
from bnlab.cli import build_parser, main

LONG_RUNNING = [["report"], ["reproduce", "x"], ["sweep", "run", "x"], ["sweep", "resume", "x"], ["simulate"],
                ["train"], ["fisher", "--arch", "fc:8-8-2"], ["rank"]]


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    _threads.pin_threads(None)
    torch.set_num_threads(before)


@pytest.mark.parametrize("argv", LONG_RUNNING, ids=lambda a: " ".join(a[:2]))
def test_every_long_running_command_takes_threads(argv):
    assert build_parser().parse_args([*argv, "--threads", "1"]).threads == 1
    assert build_parser().parse_args(argv).threads is None  # default: the chooser


@pytest.mark.parametrize("value,needle", [("0", "threads=0 is not allowed"), ("-3", "threads=-3 is not allowed"),
                                          ("100000", "threads=100000 is not allowed"),
                                          ("two", "argument --threads: invalid int value"),
                                          ("1e9", "argument --threads: invalid int value: '1e9'"),
                                          ("True", "argument --threads: invalid int value: 'True'"),
                                          ("2.5", "argument --threads: invalid int value: '2.5'"),
                                          ("", "argument --threads: invalid int value: ''")])
def test_bad_thread_counts_are_usage_errors(capsys, value, needle, restore_threads):
    before = torch.get_num_threads()
    with pytest.raises(SystemExit) as exc:
        main(["rank", "--depth", "3", "--threads", value])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and needle in err and "Traceback" not in err
    assert torch.get_num_threads() == before and _threads.pinned_threads() is None  # nothing applied


@pytest.mark.parametrize("argv", LONG_RUNNING, ids=lambda a: " ".join(a[:2]))
def test_every_long_running_command_refuses_a_bad_count_before_its_work(capsys, argv, restore_threads):
    # the check runs before the command (no experiment looked up, no data read): a usage error
    for value, needle in (("0", "threads=0 is not allowed"), ("abc", "argument --threads: invalid int value")):
        with pytest.raises(SystemExit) as exc:
            main([*argv, "--threads", value])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and needle in err and "Traceback" not in err, err


def test_a_bad_count_exits_2_from_the_shell(tmp_path):
    # the real entry point (python -m bnlab), not main() in this process: exit status 2, one line
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "bnlab", "rank", "--threads", "0"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == ("bnlab rank: error: threads=0 is not allowed: expected an "
                                                    "integer >= 1")


def test_more_threads_than_cores_is_refused_for_local_work(capsys, restore_threads):
    cores = _threads.available_cores()
    with pytest.raises(SystemExit):
        main(["rank", "--depth", "3", "--threads", str(cores + 1)])
    assert f"this process may use {cores} cores" in capsys.readouterr().err


def test_threads_fixes_the_count_of_the_command(capsys, restore_threads):
    seen = []
    from bnlab.rank import chains

    step = chains._step

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return step(*args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(chains, "_step", spy)
        torch.set_num_threads(1)
        assert main(["rank", "--depth", "3", "--width", "8", "--batch-size", "8", "--json"]) == 0
        assert set(seen) == {1} and _threads.pinned_threads() is None
        if _threads.available_cores() >= 2:
            seen.clear()
            # d = 8 is small work (the chooser alone would take one thread): --threads 2 is kept
            assert main(["rank", "--depth", "3", "--width", "8", "--batch-size", "8", "--threads", "2",
                         "--json"]) == 0
            assert set(seen) == {2} and _threads.pinned_threads() == 2
    capsys.readouterr()


def test_cluster_commands_pass_threads_to_the_engine(monkeypatch, tmp_path, restore_threads):
    import bnlab.experiments.report as report
    import bnlab.experiments.sweep as sweep

    seen = {}

    def fake_run_sweep(*args, **kwargs):
        seen["sweep"] = kwargs.get("threads")
        raise ValueError("stop here")

    def fake_build_report(out, **kwargs):
        seen["report"] = kwargs.get("threads")
        raise ValueError("stop here")

    monkeypatch.setattr(sweep, "run_sweep", fake_run_sweep)
    monkeypatch.setattr(report, "build_report", fake_build_report)
    with pytest.raises(SystemExit):
        main(["sweep", "run", "yang2019-theory", "--threads", "1", "--results-dir", str(tmp_path)])
    with pytest.raises(SystemExit):
        main(["report", "--out", str(tmp_path / "r"), "--threads", "1", "--results-dir", str(tmp_path)])
    assert seen == {"sweep": 1, "report": 1}
    # with --scheduler the cores are another machine's: up to 4096, not this machine's count
    from bnlab.cli._common import apply_threads

    more = _threads.available_cores() + 1
    apply_threads(build_parser().parse_args(["sweep", "run", "x", "--scheduler", "tcp://127.0.0.1:1",
                                             "--threads", str(more)]))
    assert _threads.pinned_threads() == more
