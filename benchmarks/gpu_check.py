"""One command for a GPU machine: the CUDA tests, the GPU benchmarks and the paper-scale plan, in one table.

    PYTHONPATH=. python benchmarks/gpu_check.py                 # on a GPU: --device cuda, about 8 minutes
    PYTHONPATH=. python benchmarks/gpu_check.py --json          # the same, machine-readable
    PYTHONPATH=. python benchmarks/gpu_check.py --device cpu --quick   # the smoke test of the default suite

Runs from a plain checkout with the package on ``PYTHONPATH`` (no installation; nothing is downloaded),
each part under its own time budget so that the whole stays within ``--budget`` seconds (default 480):

1. **CUDA tests**: the test files that mention CUDA, filtered with ``-k cuda`` (the tests that skip
   without a GPU), run by pytest in a subprocess;
2. **benchmarks**: ``bench_sim.py``, ``bench_ensemble.py`` and ``bench_bnp.py``, each a subprocess with
   ``--device <d> --quick --json``; their JSON is read defensively (a key a benchmark does not provide,
   or a benchmark that fails, shows as ``n/a`` with the reason);
3. **plan**: the ``--plan`` pilot of every reproduction at ``paper`` scale on the device
   (:func:`bnlab.experiments.plan.plan_experiments`), the estimated hours per reproduction.

Then ONE table of ratios against the goals of issue 27: the simulator against bare ``bmm``, the ensemble
trainer's step time, launches and GPU busy fraction, BNP/SGD and BNP/BN, and the paper-scale hours.
Exit status 0 when every part ran (goals missed are results, not errors), 1 when a part failed.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

#: the reproductions planned first (issue 27's goal, then its list of the cells slowest at paper scale)
PLAN_FIRST = ("yang2019-fig3a", "fisher-fig2", "daneshmand2020-fig1", "daneshmand2020-fig6", "lange-fc",
              "lange-fig5", "lange-fig8", "fisher-lambda-measured", "yang2019-fig3b", "yang2019-fig5a")

#: seconds of each part, as fractions of the whole budget (the plan gets what the others leave)
#: Sized by the first run on a GPU (one H200, 2026-11-27, 480 s): the CUDA tests ran past 48 s; bench_sim
#: took 32 s; bench_ensemble's set-up of the captured compiled step alone took 104 s (20 networks of
#: depths 5…100) and with the compile route beside it the benchmark ran past 134 s; bench_bnp with its
#: compiled variant ran past 58 s and without it took ~45 s.  So on a GPU the benchmarks run the routes
#: the goals name (BENCH_ARGS) and the ensemble gets the largest share; the plan gets what is left.
SHARES = {"tests": 0.12, "bench_sim": 0.09, "bench_ensemble": 0.32, "bench_bnp": 0.14}


def shares(skip=()) -> dict[str, float]:
    """Each part's fraction of the budget when the parts in ``skip`` are left out: what a skipped
    part would have had goes to the others in proportion to their shares (the plan's is what
    :data:`SHARES` leaves), so ``--skip`` gives the parts that run more time, not less."""
    kept = {k: v for k, v in SHARES.items() if k not in skip}
    plan = 0.0 if "plan" in skip else 1.0 - sum(SHARES.values())
    total = sum(kept.values()) + plan
    return {k: v / total for k, v in kept.items()} if total > 0 else {}

#: extra arguments of each benchmark on a GPU: the ensemble's eager reference and its captured compiled
#: step (the "compile" route without capture is a minute more of compilation and not a goal), BNP without
#: its "bnp_compiled" row (on CUDA the default "bnp" row is already the compiled route; the explicit row
#: compiles it again per batch size); three timing rounds each
BENCH_ARGS = {"bench_ensemble": ["--routes", "eager,cuda_graph", "--rounds", "3"],
              "bench_bnp": ["--no-native", "--no-compiled", "--rounds", "3"], "bench_sim": []}


def _env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.setdefault("MPLBACKEND", "Agg")
    return env


def _run(cmd: list[str], timeout: float) -> dict:
    """Run ``cmd``; its return code, output and seconds, or ``timed_out``."""
    t0 = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=max(timeout, 1.0))
        return {"rc": p.returncode, "stdout": p.stdout, "stderr": p.stderr, "seconds": time.perf_counter() - t0,
                "timed_out": False}
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        return {"rc": None, "stdout": out, "stderr": err, "seconds": time.perf_counter() - t0, "timed_out": True}


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").strip().splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


# --------------------------------------------------------------------------- 1. the CUDA tests
def cuda_test_files() -> list[str]:
    """The test files that mention CUDA (where the tests that skip without a GPU live)."""
    files = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except OSError:
            continue
        if re.search(r"cuda", text, re.IGNORECASE):
            files.append(str(path.relative_to(ROOT)))
    return files


def run_cuda_tests(timeout: float) -> dict:
    files = cuda_test_files()
    if not files:
        return {"ok": True, "summary": "no CUDA tests found", "passed": 0, "failed": 0, "skipped": 0}
    # -v: one line per test, so a run stopped at its share still says what passed; a per-test limit (where
    # pytest-timeout is installed) fails one slow test instead of the whole part
    cmd = [sys.executable, "-m", "pytest", *files, "-k", "cuda", "-m", "not slow", "-v", "-p", "no:cacheprovider",
           "-o", "addopts=", "-rfs", "--durations=5"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += ["--timeout", str(max(int(timeout / 3), 10))]
    r = _run(cmd, timeout)
    text = r["stdout"] + r["stderr"]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors|deselected)", text)}
    if r["timed_out"] or not counts:
        # no summary line: count the per-test lines that came before the stop
        for k, word in (("passed", "PASSED"), ("failed", "FAILED"), ("skipped", "SKIPPED"), ("error", "ERROR")):
            counts[k] = len(re.findall(rf"::\S+ {word}\b", text))
    # pytest exits 5 when every collected test was deselected: no CUDA test in these files, not a failure
    ok = not r["timed_out"] and r["rc"] in (0, 5)
    failures = [ln for ln in text.splitlines() if ln.startswith(("FAILED", "ERROR"))]
    summary = (f"timed out after {r['seconds']:.0f} s" if r["timed_out"] else _last_line(r["stdout"])) or f"exit {r['rc']}"
    return {"ok": ok, "summary": summary, "passed": counts.get("passed", 0), "failed": counts.get("failed", 0)
            + counts.get("error", 0) + counts.get("errors", 0), "skipped": counts.get("skipped", 0),
            "failures": failures[:20], "files": files, "seconds": r["seconds"], "timed_out": r["timed_out"],
            "slowest": [ln.strip() for ln in text.splitlines() if re.match(r"^\s*\d+\.\d+s (call|setup|teardown)", ln)][:5]}


# --------------------------------------------------------------------------- 2. the benchmarks
def _parse_json(stdout: str):
    """The benchmark's JSON: the whole output, else its last line or block that parses."""
    text = (stdout or "").strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except ValueError:
        pass
    starts = [m.start() for m in re.finditer(r"^[\[{]", text, re.MULTILINE)]
    for s in reversed(starts):
        try:
            return json.loads(text[s:])
        except ValueError:
            continue
    return None


def run_benchmark(script: str, device: str, quick: bool, timeout: float) -> dict:
    extra = [] if quick or not device.startswith("cuda") else BENCH_ARGS.get(Path(script).stem, [])
    cmd = [sys.executable, str(HERE / script), "--device", device, "--json"] + (["--quick"] if quick else []) + extra
    r = _run(cmd, timeout)
    data = _parse_json(r["stdout"])
    if r["timed_out"]:
        return {"ok": False, "error": f"timed out after {timeout:.0f} s", "data": data, "seconds": r["seconds"],
                "stderr_tail": (r["stderr"] or "")[-2000:]}
    if r["rc"] != 0 or data is None:
        why = _last_line(r["stderr"]) or _last_line(r["stdout"]) or f"exit {r['rc']}"
        if "unrecognized arguments" in why or "invalid choice" in why:
            # a benchmark of this checkout that does not take the flags yet: not available, not a failure
            return {"ok": None, "error": f"{script} does not take these flags: {why}", "data": None,
                    "seconds": r["seconds"]}
        return {"ok": False, "error": why, "data": data, "seconds": r["seconds"], "stderr_tail": (r["stderr"] or "")[-2000:]}
    return {"ok": True, "error": None, "data": data, "seconds": r["seconds"]}


def find_key(data, key: str):
    """The value of the first ``key`` anywhere in nested dicts/lists (benchmarks nest their results)."""
    if isinstance(data, dict):
        if key in data:
            return data[key]
        for v in data.values():
            found = find_key(v, key)
            if found is not None:
                return found
    elif isinstance(data, list):
        for v in data:
            found = find_key(v, key)
            if found is not None:
                return found
    return None


# --------------------------------------------------------------------------- 3. the plan
def run_plan(device: str, budget: float, quick: bool, only=None) -> dict:
    from bnlab.experiments.plan import Plan, plan_experiments
    from bnlab.experiments.registry import list_experiments

    names = list(only) if only else list(list_experiments())
    # the reproductions the goals name, and the grids that cost most at paper scale, first, with
    # half the budget among them: on a GPU the plan gets what the tests and benchmarks leave of 8 minutes,
    # and a pilot there starts with the CUDA context and compilation (seconds); what is left no time is
    # listed as not planned, and that should be the cheap reproductions
    first = [n for n in PLAN_FIRST if n in names]
    rest = [n for n in names if n not in first]
    scale = "paper"
    t0 = time.perf_counter()
    dev = device if device != "cpu" else None
    steps = (1, 3) if quick else (2, 12)
    plans = []
    try:
        for group, share in ((first, 0.5 if rest else 1.0), (rest, 1.0)):
            if not group:
                continue
            left = budget - (time.perf_counter() - t0)
            mine = max(share * left, 1.0)
            # per reproduction: its share (a soft budget), stopped at 2x that + 20 s
            per = max(mine / len(group), 1.0)
            plans.append(plan_experiments(group, scale, device=dev, budget=per, hard_limit=2 * per + 20,
                                          total_budget=mine, pilot_steps=steps))
    except Exception as exc:  # the plan part failed: the table says so
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}", "seconds": time.perf_counter() - t0}
    plan = Plan(plans[0].scale, plans[0].device, [e for p in plans for e in p.experiments],
                sum(p.plan_seconds for p in plans))
    return {"ok": True, "error": None, "plan": plan.to_dict(), "seconds": time.perf_counter() - t0}


# --------------------------------------------------------------------------- the table
def _fmt(v) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) or "n/a"
    return str(v)


def _hours(s) -> str:
    return "n/a" if s is None else f"{s / 3600:.3g} h"


def table_rows(results: dict) -> list[tuple[str, str, str]]:
    """(quantity, value, goal) rows of the one table."""
    rows = []
    t = results.get("tests", {})
    rows.append(("CUDA tests (passed / failed / skipped)",
                 (f"{t.get('passed', 0)} / {t.get('failed', 0)} / {t.get('skipped', 0)}"
                  + (f" (stopped: {t['summary']})" if t.get("timed_out") else "")) if t.get("ok") is not None
                 else "n/a", "0 failed"))
    sim = results.get("bench_sim", {})
    ratio = find_key(sim.get("data"), "sim_over_bmm") if sim.get("ok") else None
    if isinstance(ratio, dict):
        # bench_sim's summary: one ratio per route, the route "auto" chose, and the configuration timed
        config = ratio.get("config") or {}
        where = ", ".join(f"{k} {config[k]}" for k in ("width", "depth", "networks", "dtype") if k in config)
        routes = {k: v for k, v in ratio.items() if k != "config"}
        rows.append((f"simulator vs bmm ({where})" if where else "simulator vs bmm", _fmt(routes),
                     "≥ 0.5 at width ≥ 1000, ≥ 64 networks"))
    elif ratio is not None:
        rows.append(("simulator vs bmm", _fmt(ratio), "≥ 0.5 at width ≥ 1000, ≥ 64 networks"))
    else:
        rows.append(("simulator vs bmm", "n/a" + ("" if sim.get("ok") else f" ({sim.get('error')})"), "≥ 0.5"))
    ens = results.get("bench_ensemble", {})
    why = "" if ens.get("ok") else f" ({ens.get('error')})"
    for key, label, goal in (("step_ms", "ensemble step, ms (route)", "≤ 17.6 ms (5x faster than 88 ms, H200)"),
                             ("ops_per_step", "ensemble launches per step (route)", "fewer than eager"),
                             ("gpu_busy_fraction", "ensemble GPU busy fraction", "≥ 0.6"),
                             ("route_check_worst", "ensemble step vs eager, first calls (route)",
                              "≤ 1 (compiled code checked; > 1: it ran eager)")):
        v = find_key(ens.get("data"), key)
        rows.append((label, _fmt(v) if v is not None else "n/a" + why, goal))
    bnp = results.get("bench_bnp", {})
    why = "" if bnp.get("ok") else f" ({bnp.get('error')})"
    for key, label, goal in (("bnp_over_sgd", "BNP / SGD step time (B)", "≤ 1.10 at B ≥ 256"),
                             ("bnp_over_bn", "BNP / BN step time (B)", "≤ 1 at every B"),
                             ("bnp_over_sgd_pipelined", "BNP / SGD, pipelined steps (B)", "≤ 1.10 at B ≥ 256"),
                             ("bnp_over_bn_pipelined", "BNP / BN, pipelined steps (B)", "≤ 1 at every B"),
                             ("ops_per_step", "BNP launches per step (optimizer)", ""),
                             ("compiled_check_worst", "BNP compiled step vs core, first calls",
                              "≤ 1 (compiled code checked; > 1: it ran uncompiled)")):
        v = find_key(bnp.get("data"), key)
        rows.append((label, _fmt(v) if v is not None else "n/a" + why, goal))
    plan = results.get("plan", {})
    if plan.get("ok"):
        p = plan["plan"]
        for e in p["experiments"]:
            note = (f" (skipped: {e['skipped'][:60]})" if e.get("skipped") else f" ({e['error'][:60]})" if e.get("error")
                    else "")
            val = ("≥ " if e.get("lower_bound") else "") + _hours(e.get("wall_seconds")) + note
            goal = "≤ 1 h on one H100/H200" if e["experiment"] == "yang2019-fig3a" else ""
            rows.append((f"paper-scale {e['experiment']} ({e['cells']} cells, {e['device']})", val, goal))
        rows.append(("paper-scale total (every reproduction)", ("≥ " if p.get("lower_bound") else "") + _hours(p.get("seconds")),
                     ""))
    else:
        rows.append(("paper-scale plan", f"n/a ({plan.get('error')})", ""))
    return rows


def print_table(rows, file=sys.stdout) -> None:
    widths = [max(len(r[i]) for r in rows + [("quantity", "value", "goal")]) for i in range(3)]
    head = ("quantity", "value", "goal")
    print("  ".join(h.ljust(w) for h, w in zip(head, widths)), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip(), file=file)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="cuda (default when CUDA is present) or cpu")
    ap.add_argument("--quick", action="store_true", help="small benchmarks and pilots (a smoke test, ~minutes)")
    ap.add_argument("--budget", type=float, default=None, help="seconds for everything (default 480; --quick 240)")
    ap.add_argument("--skip", nargs="*", default=[], choices=["tests", "bench_sim", "bench_ensemble", "bench_bnp", "plan"],
                    help="parts to leave out")
    ap.add_argument("--plan-only", nargs="+", default=None, metavar="NAME",
                    help="plan only these reproductions (default: every one)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    ap.add_argument("--out", default=None, metavar="FILE",
                    help="also write the results as JSON to FILE, rewritten after each part (what a run stopped "
                         "from outside leaves)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        ap.error(f"--device {device} is not allowed: CUDA is not available here")
    if args.out is not None:
        # checked before anything runs: a run on a lent GPU must not lose its first part to a bad path
        folder = Path(args.out).resolve().parent
        if Path(args.out).is_dir() or not folder.is_dir() or not os.access(folder, os.W_OK):
            ap.error(f"--out {args.out!r} is not allowed: expected a file in an existing, writable folder")
    budget = args.budget if args.budget is not None else (240.0 if args.quick else 480.0)
    t0 = time.perf_counter()
    import bnlab

    results: dict = {"device": device, "torch": torch.__version__, "bnlab": str(Path(bnlab.__file__).resolve().parent),
                     "gpu": torch.cuda.get_device_name(0) if device.startswith("cuda") else None, "quick": args.quick}

    def left() -> float:
        return budget - (time.perf_counter() - t0)

    say = (lambda *a: print(*a, file=sys.stderr, flush=True))

    def save() -> None:
        if args.out:
            tmp = Path(args.out).with_suffix(".tmp")
            tmp.write_text(json.dumps(results, indent=1, default=str))
            os.replace(tmp, args.out)
    parts = {}
    share = shares(args.skip)
    if "tests" not in args.skip:
        parts["tests"] = lambda: run_cuda_tests(min(share["tests"] * budget, left()))
    for name in ("bench_sim", "bench_ensemble", "bench_bnp"):
        if name not in args.skip:
            parts[name] = (lambda name=name: run_benchmark(f"{name}.py", device, args.quick,
                                                           min(share[name] * budget, left())))
    if args.quick and device == "cpu":
        # the smoke test: nothing it times is read as a result, so its subprocesses run side by side (each
        # is mostly Python and torch start-up); on a GPU they run one at a time, each timing alone
        from concurrent.futures import ThreadPoolExecutor

        say(f"gpu_check: {', '.join(parts)} side by side …")
        with ThreadPoolExecutor(max_workers=max(len(parts), 1)) as pool:
            futures = {name: pool.submit(run) for name, run in parts.items()}
            results.update({name: f.result() for name, f in futures.items()})
    else:
        for name, run in parts.items():
            say(f"gpu_check: {name} …")
            results[name] = run()
            say(f"gpu_check: {name}: {'ok' if results[name].get('ok') else results[name].get('error') or 'failed'}, "
                f"{results[name].get('seconds', 0.0):.0f} s")
            save()
    if "plan" not in args.skip:
        say("gpu_check: paper-scale plan of every reproduction …")
        results["plan"] = run_plan(device, max(left() - 5.0, 5.0), args.quick, args.plan_only)
    results["seconds"] = time.perf_counter() - t0
    rows = table_rows(results)
    results["table"] = [list(r) for r in rows]
    save()
    if args.json:
        print(json.dumps(results, indent=1, default=str))
    else:
        print(f"device: {device}" + (f" ({results['gpu']})" if results["gpu"] else "") + f", torch {results['torch']}, "
              f"{results['seconds']:.0f} s")
        print_table(rows)
    parts = [results[k] for k in ("tests", "bench_sim", "bench_ensemble", "bench_bnp", "plan") if k in results]
    # ok None: a benchmark that does not take the flags yet (shown as n/a), not a failure
    return 0 if all(p.get("ok") is not False for p in parts) else 1


if __name__ == "__main__":
    sys.exit(main())
