"""benchmarks/gpu_check.py: the smoke test on CPU (--device cpu --quick), and its table from the benchmarks' JSON."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmark_loader import load_benchmark

ROOT = Path(__file__).resolve().parents[1]


def _env() -> dict:
    env = dict(os.environ)
    # a plain checkout on PYTHONPATH, as on a GPU machine without pip (the test experiments importable too)
    env["PYTHONPATH"] = str(ROOT)
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("MPLBACKEND", "Agg")
    return env


def _run(*args: str, timeout: float = 1500) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=timeout)


def _check_parts(d: dict) -> None:
    assert d["device"] == "cpu" and d["quick"] is True
    assert d["tests"]["ok"] and d["tests"]["failed"] == 0 and d["tests"]["files"]  # the CUDA tests, skipped here
    for name in ("bench_sim", "bench_ensemble", "bench_bnp"):
        part = d[name]
        # ran, or — in a checkout whose benchmark does not take --device/--quick/--json yet — said so
        assert part["ok"] is True or (part["ok"] is None and "does not take these flags" in part["error"]), part
    assert d["plan"]["ok"], d["plan"]
    quantities = [row[0] for row in d["table"]]
    assert quantities[0].startswith("CUDA tests")
    assert any("BNP / SGD" in q for q in quantities) and any("ensemble step" in q for q in quantities)
    assert quantities[-1] == "paper-scale total (every reproduction)"


def test_gpu_check_cpu_quick_smoke():
    # every part, with the plan of one small test sweep (the plan of every reproduction: the slow test below);
    # a generous budget, so that a loaded machine slows it down without timing a part out.  The parts run side
    # by side on a CPU with --quick: 74 s wall, 29 s of CPU on this 2-core machine at load average 7
    out = _run("--device", "cpu", "--quick", "--json", "--budget", "1200", "--plan-only",
               "tests.experiments._helpers:bnlab-test-sweep")
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads(out.stdout)
    _check_parts(d)
    assert d["bnlab"] == str(ROOT / "bnlab")  # this checkout's package, not an installed one
    (e,) = d["plan"]["plan"]["experiments"]
    assert e["experiment"] == "bnlab-test-sweep" and e["cells"] == 12 and e["seconds"] > 0


@pytest.mark.slow
def test_gpu_check_cpu_quick_plans_every_reproduction():
    out = _run("--device", "cpu", "--quick", "--json", "--budget", "1800", timeout=2400)
    assert out.returncode == 0, out.stderr[-3000:]
    d = json.loads(out.stdout)
    _check_parts(d)
    from bnlab.experiments import list_experiments

    planned = [e["experiment"] for e in d["plan"]["plan"]["experiments"]]
    assert sorted(planned) == sorted(list_experiments()) and planned[0] == "yang2019-fig3a"


def test_table_reads_the_benchmarks_keys_and_says_na_for_missing_ones():
    gc = load_benchmark("gpu_check")
    results = {
        "tests": {"ok": True, "passed": 5, "failed": 0, "skipped": 1},
        "bench_sim": {"ok": True, "data": {"rows": [{"ratio_explicit": 0.62, "t_bmm": 1e-3}], "sim_over_bmm": {
            "explicit": 0.62, "conditional": 0.31, "auto": 0.62, "auto_route": "explicit",
            "config": {"width": 1024, "depth": 8, "networks": 64, "dtype": "float32"}}}},
        "bench_ensemble": {"ok": True, "data": {"step_ms": {"eager": 88.0, "captured": 12.5},
                                                "ops_per_step": {"eager": 3326, "captured": 1},
                                                "route_check_worst": {"eager": None, "captured": 0.0014}}},  # no busy fraction
        "bench_bnp": {"ok": False, "error": "Traceback: boom", "data": None},
        "plan": {"ok": True, "plan": {"seconds": 7200.0, "lower_bound": False, "experiments": [
            {"experiment": "yang2019-fig3a", "cells": 136, "device": "cuda:0", "wall_seconds": 3000.0,
             "lower_bound": False, "skipped": None, "error": None},
            {"experiment": "yang2019-fig3d", "cells": 136, "device": "cuda:0", "wall_seconds": 0.0,
             "lower_bound": False, "skipped": "CIFAR-10 not present", "error": None}]}},
    }
    rows = {q: (v, g) for q, v, g in gc.table_rows(results)}
    assert rows["CUDA tests (passed / failed / skipped)"][0] == "5 / 0 / 1"
    # one row, the summary's: not every key that mentions bmm (t_bmm is a time, not a ratio)
    assert [q for q in rows if q.startswith("simulator")] == ["simulator vs bmm (width 1024, depth 8, networks 64, dtype float32)"]
    assert rows["simulator vs bmm (width 1024, depth 8, networks 64, dtype float32)"][0] == \
        "explicit: 0.62, conditional: 0.31, auto: 0.62, auto_route: explicit"
    assert rows["ensemble step, ms (route)"][0] == "eager: 88, captured: 12.5"
    assert rows["ensemble launches per step (route)"][0] == "eager: 3326, captured: 1"
    assert rows["ensemble GPU busy fraction"][0] == "n/a"
    assert rows["ensemble step vs eager, first calls (route)"][0] == "eager: n/a, captured: 0.0014"
    assert rows["BNP / SGD step time (B)"][0] == "n/a (Traceback: boom)"
    assert rows["BNP compiled step vs core, first calls"][0] == "n/a (Traceback: boom)"
    assert rows["paper-scale yang2019-fig3a (136 cells, cuda:0)"] == ("0.833 h", "≤ 1 h on one H100/H200")
    assert "skipped: CIFAR-10" in rows["paper-scale yang2019-fig3d (136 cells, cuda:0)"][0]
    assert rows["paper-scale total (every reproduction)"][0] == "2 h"


def test_cuda_test_files_are_found():
    gc = load_benchmark("gpu_check")
    files = gc.cuda_test_files()
    assert "tests/nets/test_train.py" in files and "tests/sim/test_networks.py" in files
    assert all(f.startswith("tests/") and f.endswith(".py") for f in files)


def test_cuda_tests_stopped_at_their_share_still_count_what_ran(monkeypatch):
    # the first GPU run (H200, 2026-11-27) stopped the CUDA tests at their 48 s share and the table said
    # "0 / 0 / 0": with -v each test's line is counted, and the row says the part was stopped
    gc = load_benchmark("gpu_check")
    out = ("tests/nets/test_train.py::test_a_cuda PASSED [ 10%]\n"
           "tests/nets/test_train.py::test_b_cuda[x-1] PASSED [ 20%]\n"
           "tests/sim/test_networks.py::test_c_cuda FAILED [ 30%]\n"
           "tests/sim/test_networks.py::test_d_cuda SKIPPED (no GPU) [ 40%]\n")
    monkeypatch.setattr(gc, "_run", lambda cmd, timeout: {"rc": None, "stdout": out, "stderr": "", "seconds": 48.2,
                                                          "timed_out": True})
    r = gc.run_cuda_tests(48)
    assert (r["passed"], r["failed"], r["skipped"], r["ok"]) == (2, 1, 1, False)
    rows = {q: v for q, v, g in gc.table_rows({"tests": r})}
    assert rows["CUDA tests (passed / failed / skipped)"] == "2 / 1 / 1 (stopped: timed out after 48 s)"


def test_a_bad_out_path_is_refused_before_anything_runs(tmp_path, capsys):
    gc = load_benchmark("gpu_check")
    for bad in (str(tmp_path / "missing" / "gc.json"), str(tmp_path)):
        with pytest.raises(SystemExit) as exc:
            gc.main(["--device", "cpu", "--quick", "--out", bad])
        assert exc.value.code == 2
        assert f"--out {bad!r} is not allowed" in capsys.readouterr().err


def test_skipped_parts_leave_their_share_to_the_others():
    # a GPU session that re-runs only the tests and the plan must give them more time, not the 12 % the
    # tests get beside the benchmarks
    gc = load_benchmark("gpu_check")
    full = gc.shares()
    assert full == pytest.approx(gc.SHARES) and sum(full.values()) < 1.0  # the plan gets the rest
    some = gc.shares(["bench_sim", "bench_ensemble", "bench_bnp"])
    plan = 1.0 - sum(gc.SHARES.values())
    assert set(some) == {"tests"}
    assert some["tests"] == pytest.approx(gc.SHARES["tests"] / (gc.SHARES["tests"] + plan))
    no_plan = gc.shares(["plan", "bench_sim"])
    assert sum(no_plan.values()) == pytest.approx(1.0)
    ratio = gc.SHARES["bench_ensemble"] / gc.SHARES["tests"]
    assert no_plan["bench_ensemble"] / no_plan["tests"] == pytest.approx(ratio)
