"""The hostile- and careless-input case table of every ``bnlab`` command, and a driver that runs it.

Each :class:`Case` is one command line and what a careful program does with it: refuse it
(``expect="error"``: a non-zero exit, no traceback, a message naming the argument — the
``names`` fragment) or run it (``expect="ok"``: exit 0, no NaN/null where a number is due).
The files the cases point at (corrupted stores, a gzip bomb, a planted checksum file, a
symlinked lock, ...) are built by :func:`make_fixtures` in a scratch folder.

Used two ways:

* ``tests/test_hostile.py`` runs the table in-process (``bnlab.cli.main``, fast) and, marked
  slow, as subprocesses under a memory measurement;
* as a script, it runs every case as a subprocess against a given ``PYTHONPATH`` and prints
  the counts of clean errors / sensible results / tracebacks / hangs / nonsense / memory
  hogs — so the numbers before and after a change are reproducible::

      python tests/hostile_cases.py --pythonpath /work/wt/before
      python tests/hostile_cases.py --pythonpath .          # this tree
"""
from __future__ import annotations

import argparse
import gzip
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

#: Peak resident memory a case may use (the interpreter with torch loaded is ~0.3 GiB).
MEMORY_LIMIT_BYTES = 2 << 30
#: Seconds a case may run before it counts as a hang.
CASE_TIMEOUT = 60.0
_SMALL_SIM = ["--width", "32", "--depth", "6", "--networks", "4", "--batch-size", "8"]


@dataclass(frozen=True)
class Case:
    command: str  # the bnlab command it exercises (for the per-command counts)
    argv: tuple[str, ...]  # "{root}" is replaced by the fixtures folder
    expect: str = "error"  # "error" or "ok"
    names: str = ""  # a fragment the error message must contain (the argument, or the file)
    slow: bool = False  # only in the subprocess run (too heavy or too risky in-process)

    def args(self, root: Path) -> list[str]:
        return [a.replace("{root}", str(root)) for a in self.argv]

    @property
    def id(self) -> str:
        return " ".join(self.argv)[:90]


def _c(command, *argv, expect="error", names="", slow=False) -> Case:
    return Case(command, tuple(argv), expect, names, slow)


_EXPRESSIONS_HOSTILE = [
    ("x + 9**9**9**9", "overflows"), ("x*0 + 10**10**10", "overflows"), ("x + 2**2**40", "overflows"),
    ("x + (-8)**0.5", "complex"), ("log(x)", "finite"), ("1/x", "finite"), ("x**0.5", "finite"),
    ("exp(exp(exp(x)))", "finite"), ("x + 1/0", "by zero"), ("__import__('os')", "not allowed"),
    ("x." + "__class__", "Attribute"), ("x" + "+x" * 400, "characters"),
]

CASES: list[Case] = [
    # ---------------------------------------------------------------- theory
    *[_c("theory", "theory", "-B", "8", "--phi", e, names=n) for e, n in _EXPRESSIONS_HOSTILE],
    _c("theory", "theory", "-B", "0", names="batch"),
    _c("theory", "theory", "-B", "-5", names="batch"),
    _c("theory", "theory", "-B", "8", "--eps", "-1", names="eps"),
    _c("theory", "theory", "-B", "8", "--eps", "nan", names="eps"),
    _c("theory", "theory", "-B", "8", "--sigma-w2", "0", names="sigma_w2"),
    _c("theory", "theory", "-B", "8", "--phi", "tahn", names="tahn"),
    _c("theory", "theory", "-B", "8", "--gamma", "0", names="gamma"),
    _c("theory", "theory", "-B", "8", "--phi", "alpha_relu", "--alpha", "-1", names="alpha"),
    _c("theory", "theory", "-B", "8", "--phi", "relu", "--json", expect="ok"),
    _c("theory", "theory", "-B", "2048", "--phi", "tanh", "--method", "montecarlo", names="batch_size"),
    # -------------------------------------------------------------- simulate
    *[_c("simulate", "simulate", *_SMALL_SIM, "--phi", e, names=n) for e, n in _EXPRESSIONS_HOSTILE[:5]],
    _c("simulate", "simulate", "--networks", "1000000", names="networks"),
    _c("simulate", "simulate", "--depth", "1000000", "--width", "8", names="depth"),
    _c("simulate", "simulate", "--batch-size", "1000000", names="batch_size"),
    _c("simulate", "simulate", "--width", "100000000", names="width"),
    _c("simulate", "simulate", "--num-batches", "100000000", names="num_batches"),
    _c("simulate", "simulate", "--networks", "0", names="networks"),
    _c("simulate", "simulate", "--batch-size", "1", names="batch_size"),
    _c("simulate", "simulate", *_SMALL_SIM, "--residual-scale", "1e308", names="residual_scale"),
    _c("simulate", "simulate", *_SMALL_SIM, "--max-memory-gb", "1e308", names="max_memory_gb"),
    _c("simulate", "simulate", *_SMALL_SIM, "--max-memory-gb", "0", names="max_memory_gb"),
    _c("simulate", "simulate", *_SMALL_SIM, "--max-memory-gb", "1e-9", names="max_memory"),
    _c("simulate", "simulate", *_SMALL_SIM, "--sigma-w2", "1e308", names="sigma_w2"),
    _c("simulate", "simulate", *_SMALL_SIM, "--gamma", "1e308", names="gamma"),
    _c("simulate", "simulate", *_SMALL_SIM, "--phi", "alpha_relu", "--alpha", "100", "--dtype", "float32",
       names="overflow"),
    _c("simulate", "simulate", *_SMALL_SIM, "--phi", "0*x", names="phi"),
    _c("simulate", "simulate", *_SMALL_SIM, "--eps", "-1", names="eps"),
    _c("simulate", "simulate", *_SMALL_SIM, "--input-correlation", "2", names="input_correlation"),
    _c("simulate", "simulate", *_SMALL_SIM, "--dtype", "float16", names="dtype"),
    _c("simulate", "simulate", *_SMALL_SIM, "--device", "tpu", names="device"),
    _c("simulate", "simulate", *_SMALL_SIM, "--init", "zeros", names="init"),
    _c("simulate", "simulate", *_SMALL_SIM, "--seed", "-1", names="seed"),
    _c("simulate", "simulate", *_SMALL_SIM, "--phi", "tanh", "--json", expect="ok"),
    # ----------------------------------------------------------------- sweep
    _c("sweep", "sweep", "run", "yang2019-fig1ab", "--serial", "--store", "{root}/file.txt", names="not a bnlab results store"),
    _c("sweep", "sweep", "run", "yang2019-fig1ab", "--serial", "--store", "/dev/null", names="not a regular file"),
    _c("sweep", "sweep", "run", "yang2019-fig1ab", "--serial", "--store", "{root}", names="directory"),
    _c("sweep", "sweep", "run", "yang2019-fig1ab", "--serial", "--store", "{root}/" + "a" * 5000 + ".sqlite",
       names="characters"),
    _c("sweep", "sweep", "run", "yang2019-fig1ab", "--serial", "--results-dir", "{root}/file.txt", names="file.txt"),
    _c("sweep", "sweep", "run", "yang2019-fig1ab", "--serial", "--results-dir", "/dev/null", names="/dev/null"),
    _c("sweep", "sweep", "run", "yang2019-fig1ab", "--serial", "--store", "{root}/foreign.sqlite", names="other tables"),
    _c("sweep", "sweep", "run", "yang2019-fig1ab", "--serial", "--store", "{root}/text.sqlite", names="not an SQLite"),
    _c("sweep", "sweep", "run", "yang2019-fig1ab", "--serial", "--store", "{root}/truncated.sqlite", names="truncated"),
    _c("sweep", "sweep", "run", "yang2019-fig1ab", "--workers", "0", "--store", "{root}/new.sqlite", names="workers"),
    _c("sweep", "sweep", "run", "yang2019-fig1ab", "--scheduler", "garbage", "--store", "{root}/new2.sqlite",
       names="scheduler"),
    _c("sweep", "sweep", "run", "no_such_experiment", "--serial", "--store", "{root}/new3.sqlite", names="no_such"),
    *[_c("sweep", "sweep", sub, "{root}/" + store, *extra, names=store)
      for store in ("garbage.sqlite", "dropped.sqlite", "params.sqlite", "truncated.sqlite", "text.sqlite",
                    "foreign.sqlite")
      for sub, extra in (("status", ()), ("export", ("-o", "{root}/out.csv")), ("resume", ("--serial",)))],
    *[_c("sweep", "sweep", "run", "yang2019-fig1ab", "--serial", "--store", "{root}/" + store, names=store)
      for store in ("garbage.sqlite", "dropped.sqlite", "params.sqlite")],
    _c("sweep", "sweep", "status", "{root}/missing.sqlite", names="does not exist"),
    _c("sweep", "sweep", "status", "{root}/good.sqlite", "--json", expect="ok"),
    _c("sweep", "sweep", "export", "{root}/good.sqlite", "-o", "{root}/out.csv", "--format", "parquet",
       names="format"),
    _c("sweep", "sweep", "export", "{root}/good.sqlite", "-o", "{root}", names="output"),
    _c("sweep", "sweep", "export", "{root}/good.sqlite", "-o", "{root}/file.txt/x.csv", names="output"),
    _c("sweep", "sweep", "resume", "{root}/evil.sqlite", "--serial", names="not a registered experiment"),
    _c("sweep", "sweep", "run", "yang2019-fig1ab", "--serial", "--store", "{root}/alias.sqlite",
       names="being written"),
    _c("sweep", "sweep", "run", "yang2019-fig1ab", "--serial", "--store", "{root}/planted.sqlite",
       names="symbolic link"),
    # ------------------------------------------------------ reproduce, report
    _c("reproduce", "reproduce", "yang2019-fig1ab", "--out", "{root}/file.txt", "--serial", names="out"),
    _c("reproduce", "reproduce", "yang2019-fig1ab", "--out", "", "--serial", names="out"),
    _c("reproduce", "reproduce", "yang2019-fig1ab", "--workers", "0", "--out", "{root}/o", names="workers"),
    _c("reproduce", "reproduce", "yang2019-fig1ab", "--workers", "-1", "--out", "{root}/o", names="workers"),
    _c("reproduce", "reproduce", "yang2019-fig1ab", "--scheduler", "garbage", "--out", "{root}/o", names="scheduler"),
    _c("reproduce", "reproduce", "no_such_experiment", "--out", "{root}/o", "--serial", names="no_such"),
    _c("reproduce", "reproduce", "--list", expect="ok"),
    _c("report", "report", "--out", "{root}/file.txt", "--serial", names="out"),
    _c("report", "report", "--out", "/dev/null", "--serial", names="out"),
    _c("report", "report", "--workers", "0", "--out", "{root}/r", names="workers"),
    _c("report", "report", "--scheduler", "garbage", "--out", "{root}/r", names="scheduler"),
    # ------------------------------------------------------------------ data
    _c("data", "data", "check", "imagenet", "--data-dir", "{root}", names="imagenet"),
    _c("data", "data", "list", "--data-dir", "{root}/file.txt", names="data_dir"),
    _c("data", "data", "check", "cifar10", "--data-dir", "{root}/planted", names="SHA256 mismatch"),
    _c("data", "data", "check", "fashion_mnist", "--split", "train", "--data-dir", "{root}/bomb", names="MiB"),
    _c("data", "data", "download", "cifar10", "--url", "file:///dev/zero", "--data-dir", "{root}/dl",
       "--no-progress", names="bytes", slow=True),
    _c("data", "data", "download", "cifar10", "--url", "ftp://example.invalid/x", "--data-dir", "{root}/dl2",
       names="url"),
    _c("data", "data", "download", "cifar10", "--sha256", "abc", "--data-dir", "{root}/dl3", names="sha256"),
    _c("data", "data", "check", "digits", "--data-dir", "{root}/d", "--json", expect="ok"),
    # ----------------------------------------------------------- activations
    _c("activations", "activations", "--json", expect="ok"),
    # ------------------------------------------------------------------ rank
    _c("rank", "rank", "--width", "0", names="width"),
    _c("rank", "rank", "--width", "1000000", names="width"),
    _c("rank", "rank", "--batch-size", "100000000", names="batch_size"),
    _c("rank", "rank", "--depth", "-3", names="depth"),
    _c("rank", "rank", "--tau", "nan", names="tau"),
    _c("rank", "rank", "--tau", "0", names="tau"),
    _c("rank", "rank", "--residual-gamma", "nan", names="residual_gamma"),
    _c("rank", "rank", "--residual-gamma", "-inf", names="residual_gamma"),
    _c("rank", "rank", "--norm", "bnorm", names="norm"),  # ("batch" is a deprecated spelling of bn)
    _c("rank", "rank", "--chains", "0", names="chains"),
    _c("rank", "rank", "--record-points", "0", names="record_points"),
    _c("rank", "rank", "--dtype", "float16", names="dtype"),
    _c("rank", "rank", "--max-memory-gb", "-1", names="max_memory_gb"),
    _c("rank", "rank", "--depth", "50", "--width", "8", "--batch-size", "8", "--json", expect="ok"),
    _c("rank", "rank", "--depth", "20", "--width", "8", "--batch-size", "8", "--activation", "relu",
       "--placement", "post", "--json", names="eps"),
]


# ---------------------------------------------------------------------------------------- fixtures
def _store(path: Path, n: int = 6, done: int = 3, module: str | None = None, experiment: str = "yang2019-fig1ab"):
    """A well-formed store, written with plain SQL in the schema bnlab 1 uses (no bnlab import needed)."""
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        CREATE TABLE sweep (id INTEGER PRIMARY KEY CHECK (id = 1), experiment TEXT NOT NULL, scale TEXT NOT NULL,
            module TEXT, grid_hash TEXT NOT NULL, n_cells INTEGER NOT NULL, created TEXT NOT NULL,
            updated TEXT NOT NULL, versions TEXT NOT NULL);
        CREATE TABLE cells (key TEXT PRIMARY KEY, idx INTEGER NOT NULL, params TEXT NOT NULL,
            status TEXT NOT NULL CHECK (status IN ('pending', 'running', 'done', 'failed')), metrics TEXT,
            error TEXT, attempts INTEGER NOT NULL DEFAULT 0, submitted TEXT, started TEXT, finished TEXT,
            duration REAL, worker TEXT, host TEXT, versions TEXT);
        PRAGMA user_version = 1;
        """
    )
    conn.execute("INSERT INTO sweep VALUES (1, ?, 'small', ?, 'h', ?, 't', 't', '{}')", (experiment, module, n))
    for i in range(n):
        status = "done" if i < done else "pending"
        conn.execute(
            "INSERT INTO cells (key, idx, params, status, metrics, attempts) VALUES (?, ?, ?, ?, ?, 1)",
            (f"k{i:031d}", i, json.dumps({"i": i, "pad": "p" * 3000}), status,
             json.dumps({"v": i}) if status == "done" else None),
        )
    conn.commit()
    conn.close()


def make_fixtures(root: Path) -> Path:
    """Build every file the cases point at under ``root``; return ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "file.txt").write_text("not a store\n")
    (root / "text.sqlite").write_text("this is a text file, not a database\n" * 100)
    conn = sqlite3.connect(root / "foreign.sqlite")
    conn.execute("CREATE TABLE users (name TEXT)")
    conn.execute("INSERT INTO users VALUES ('alice')")
    conn.commit()
    conn.close()
    _store(root / "good.sqlite")
    _store(root / "garbage.sqlite", n=40)
    size = (root / "garbage.sqlite").stat().st_size
    with open(root / "garbage.sqlite", "r+b") as f:  # garbage over pages in the middle
        f.seek(size // 3)
        f.write(os.urandom(size // 3))
    _store(root / "dropped.sqlite")
    conn = sqlite3.connect(root / "dropped.sqlite")
    conn.execute("DROP TABLE cells")
    conn.commit()
    conn.close()
    _store(root / "params.sqlite")
    conn = sqlite3.connect(root / "params.sqlite")
    conn.execute("UPDATE cells SET params = '[]'")
    conn.commit()
    conn.close()
    _store(root / "truncated.sqlite", n=40)
    data = (root / "truncated.sqlite").read_bytes()
    (root / "truncated.sqlite").write_bytes(data[: len(data) // 2])
    # a store naming a module that must never be imported
    _store(root / "evil.sqlite", experiment="evil-experiment", module="bnlab_hostile_marker_module")
    # ... which, if imported (the cases run in ``root``, which ``python -m`` puts on sys.path), leaves a mark
    (root / "bnlab_hostile_marker_module.py").write_text(
        "from pathlib import Path\nPath(__file__).with_name('imported.txt').write_text('imported')\nEXPERIMENTS = []\n"
    )
    # a symlinked alias of a store another process drives is made by the test itself (needs a live lock);
    # for the table, the alias points at a store whose lock is held by a sleeping child (see _hold_lock)
    _store(root / "real.sqlite")
    if not (root / "alias.sqlite").exists():
        (root / "alias.sqlite").symlink_to(root / "real.sqlite")
    # a planted symlink at <store>.lock pointing at a file bnlab must not overwrite
    (root / "victim.txt").write_text("precious\n")
    if not (root / "planted.sqlite.lock").exists():
        (root / "planted.sqlite.lock").symlink_to(root / "victim.txt")
    # a fake CIFAR-10 with a planted .sha256 sidecar naming its own hash
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from data._cifar_fixture import make_cifar

    import hashlib

    planted = root / "planted"
    planted.mkdir(exist_ok=True)
    archive = make_cifar("cifar10", seed=3).write_archive(planted / "cifar-10-python.tar.gz")
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    (planted / "cifar-10-python.tar.gz.sha256").write_text(f"{digest}  cifar-10-python.tar.gz\n")
    # Fashion-MNIST folder whose train images are a gzip bomb (100 MiB of zeros, ~100 kB compressed)
    bomb = root / "bomb" / "fashion-mnist"
    bomb.mkdir(parents=True, exist_ok=True)
    with gzip.open(bomb / "train-images-idx3-ubyte.gz", "wb", compresslevel=1) as f:
        block = b"\0" * (1 << 20)
        for _ in range(100):
            f.write(block)
    for stem in ("train-labels-idx1-ubyte", "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"):
        (bomb / stem).write_bytes(b"\0\0\x08\x01\0\0\0\0")
    return root


def hold_lock(store: Path) -> subprocess.Popen:
    """A child process holding ``<store>.lock`` (as a running driver would), until killed."""
    code = (
        "import fcntl, os, sys, time\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('locked', flush=True)\n"
        "time.sleep(3600)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code, str(store) + ".lock"], stdout=subprocess.PIPE, text=True)
    p.stdout.readline()
    return p


# ------------------------------------------------------------------------------------ classification
OUTCOMES = ("clean error", "sensible", "traceback", "hang", "nonsense", "memory", "unclear error")


def classify(case: Case, rc: int | None, out: str, err: str, maxrss: int | None) -> str:
    """One of :data:`OUTCOMES` for a finished (or timed-out: ``rc is None``) run."""
    if rc is None:
        return "hang"
    if maxrss is not None and maxrss > MEMORY_LIMIT_BYTES:
        return "memory"
    if "Traceback (most recent call last)" in err:
        return "traceback"
    if case.expect == "ok":
        if rc != 0:
            return "unclear error"
        if "NaN" in out:
            return "nonsense"
        if case.command == "simulate":  # the measured q and c must be numbers (rates may be null with a note)
            try:
                d = json.loads(out)
            except ValueError:
                return "nonsense"
            if d.get("q") is None or d.get("c") is None:
                return "nonsense"
        return "sensible"
    if rc == 0:
        return "nonsense"
    return "clean error" if case.names.lower() in (err + out).lower() else "unclear error"


def wait_for_case(p: subprocess.Popen, timeout: float):
    """Wait for a case's process (the leader of its own session) for at most ``timeout`` seconds.

    Returns (exit code, resource usage), or (None, None) for a hang; a hang, or the driver itself
    interrupted, ends the case's whole session.  ``os.wait4`` gives the peak resident memory."""
    deadline = time.monotonic() + timeout
    rc = rusage = None
    try:
        while True:
            pid, status, rusage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                rc = p.returncode = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                rusage = None
                break
            time.sleep(0.05)
    finally:
        if p.returncode is None:
            os.killpg(p.pid, 9)
            p.wait()
    return rc, rusage


def run_case(case: Case, root: Path, pythonpath: str, timeout: float = CASE_TIMEOUT) -> tuple[str, str]:
    """Run one case as ``python -m bnlab ...``; return (outcome, last line of stderr)."""
    env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1", BNLAB_RESULTS=str(root / "results"),
               BNLAB_DATA=str(root / "data"))
    # stdout/stderr go to files: a runaway writer cannot fill a pipe and block
    with tempfile.TemporaryFile("w+") as fo, tempfile.TemporaryFile("w+") as fe:
        p = subprocess.Popen([sys.executable, "-m", "bnlab", *case.args(root)], stdout=fo, stderr=fe, env=env,
                             cwd=root, start_new_session=True)
        rc, rusage = wait_for_case(p, timeout)
        fo.seek(0)
        fe.seek(0)
        out, err = fo.read(), fe.read()
    maxrss = rusage.ru_maxrss * 1024 if rusage is not None and rc is not None else None
    last = (err.strip().splitlines() or [""])[-1][:160]
    return classify(case, rc, out, err, maxrss), last


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pythonpath", default=str(Path(__file__).resolve().parents[1]),
                    help="the bnlab tree to test (default: this checkout)")
    ap.add_argument("--timeout", type=float, default=CASE_TIMEOUT, help="seconds per case before it is a hang")
    ap.add_argument("--only", default=None, help="only cases whose command line contains this text")
    ap.add_argument("--verbose", "-v", action="store_true", help="print every case's outcome")
    args = ap.parse_args(argv)
    counts: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = make_fixtures(Path(tmp) / "fx")
        holder = hold_lock(root / "real.sqlite")
        try:
            for case in CASES:
                if args.only and args.only not in " ".join(case.argv):
                    continue
                t0 = time.monotonic()
                outcome, last = run_case(case, root, os.path.abspath(args.pythonpath), args.timeout)
                if (root / "imported.txt").exists():  # the store made bnlab import a module it named
                    (root / "imported.txt").unlink()
                    outcome, last = "nonsense", "SECURITY: the store made bnlab import the module it names"
                counts.setdefault(case.command, dict.fromkeys(OUTCOMES, 0))[outcome] += 1
                if args.verbose or outcome not in ("clean error", "sensible"):
                    print(f"{outcome:13s} {time.monotonic() - t0:5.1f}s  bnlab {case.id}\n{'':20s}{last}", flush=True)
        finally:
            holder.kill()
            holder.wait()
            intact = (root / "victim.txt").read_text() == "precious\n"
    total = dict.fromkeys(OUTCOMES, 0)
    print(f"\n{'command':12s} {'cases':>5s} " + " ".join(f"{o:>13s}" for o in OUTCOMES))
    for cmd, c in counts.items():
        for o in OUTCOMES:
            total[o] += c[o]
        print(f"{cmd:12s} {sum(c.values()):5d} " + " ".join(f"{c[o]:13d}" for o in OUTCOMES))
    print(f"{'all':12s} {sum(total.values()):5d} " + " ".join(f"{total[o]:13d}" for o in OUTCOMES))
    print(f"planted lock symlink: victim file {'intact' if intact else 'OVERWRITTEN'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
