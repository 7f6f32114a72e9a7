"""Hostile and careless input for the newer parts (issue #26): fisher, rank, nets, train, and every
output file that a planted symbolic link could redirect.

Three tables, one :class:`hostile_cases.Case`-like row each, all run as subprocesses by
:func:`main` (so a crash, a hang or a runaway allocation never takes the runner down):

* :data:`CLI_CASES` — ``bnlab fisher | rank | train | reproduce | report | sweep | simulate | theory``
  command lines (the newer commands and the leftovers of the older ones);
* :data:`API_CASES` — short Python scripts against the public functions of ``bnlab.fisher``,
  ``bnlab.rank``, ``bnlab.nets`` and ``bnlab.optim.train_network``.  A script either must raise a
  ``ValueError`` whose message contains ``names`` (``expect="error"``), or must finish and pass its own
  ``assert`` lines, which check that the result is finite and sane (``expect="ok"``); ``"either"``
  accepts both (a flagged result or a clean refusal);
* :data:`LINK_CASES` — outputs written where a symbolic link was planted (a figure, ``index.html``,
  ``report.json``, an export, a store's ``-wal``/``-shm``/``.lock``, a dangling link at the store
  path): the command must leave the link's target untouched (``victim.txt`` keeps its text).

Each case is one of :data:`OUTCOMES`: a clean error (non-zero exit, no traceback, a message naming
the argument), a sensible result, a traceback, a hang (past the time limit), nonsense (exit 0 with
a wrong or non-finite result, or a planted link followed), memory (past :data:`MEMORY_LIMIT_BYTES`
resident, or an allocation failure), or an unclear error.  Every subprocess runs under an address-
space limit (:data:`ADDRESS_SPACE_LIMIT`), so a case that would allocate terabytes fails fast.

Run::

    python tests/hostile_newer_cases.py --pythonpath /path/to/before   # counts before a change
    python tests/hostile_newer_cases.py                                # this tree
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hostile_cases as hc  # noqa: E402

#: Peak resident memory a case may use before it counts as a memory hog.
MEMORY_LIMIT_BYTES = 2 << 30
#: Virtual address space of every case (torch on CPU maps ~0.8 GiB): an allocation past it fails at once.
ADDRESS_SPACE_LIMIT = 6 << 30
CASE_TIMEOUT = 60.0
OUTCOMES = ("clean error", "sensible", "traceback", "hang", "nonsense", "memory", "unclear error")
VICTIM_TEXT = "precious\n"


@dataclass(frozen=True)
class Case:
    command: str  # what the per-command counts group it under ("fisher", "rank", "nets", "fisher-api", ...)
    argv: tuple[str, ...] = ()  # a CLI case: the bnlab arguments ("{root}" is the fixtures folder)
    code: str = ""  # an API case: a Python script
    expect: str = "error"  # "error", "ok" or "either"
    names: str = ""  # a fragment the error message must contain
    stdout: str = ""  # for expect="ok" CLI cases: a fragment stdout must contain
    setup: str = ""  # shell-free setup: a Python script run in the fixtures folder before the case
    fast: bool = True  # also run in-process by tests/test_hostile_newer.py (cheap and safe in-process)

    @property
    def id(self) -> str:
        text = " ".join(self.argv) if self.argv else self.code.strip().splitlines()[-1]
        return f"{self.command}: {text}"[:100]


def cli(command, *argv, expect="error", names="", stdout="", setup="", fast=True) -> Case:
    return Case(command, tuple(argv), "", expect, names, stdout, setup, fast)


def _d(text: str) -> str:
    return textwrap.dedent(text)


def api(command, code, expect="error", names="", fast=True) -> Case:
    return Case(command, (), textwrap.dedent(code).strip() + "\n", expect, names, "", "", fast)


#: "cuda" is an error only where there is no CUDA (the case list also runs on GPU machines: gpu_check.py)
def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


_CUDA_HERE = _cuda_here()


def _plain_cuda(d) -> str:
    return "ok" if d == "cuda" and _CUDA_HERE else "error"


_DIGITS = ("--dataset", "digits", "--train-size", "200", "--test-size", "100", "--epochs", "0.2")
_FISHER_MEASURE = ("fisher", "--measure", "--dataset", "digits", "--arch", "fc:64-32-10", "--batch-size", "32")
_RANK = ("rank", "--depth", "10", "--width", "8", "--batch-size", "8")

CLI_CASES: list[Case] = [
    # ---------------------------------------------------------------- fisher
    cli("fisher", "fisher", "--arch", "fc:784-256-256-10", "--phi", "tanh", "--json", expect="ok",
        stdout='"lambda_max_bound": 0.0'),
    cli("fisher", "fisher", "--arch", "fc:784-256-256-10", "--phi", "erf", "--bn-mode", "train", expect="ok",
        stdout="inf"),
    cli("fisher", "fisher", "--arch", "conv:1x100000000x100000000-c1k1-fc10", names="arch"),
    cli("fisher", "fisher", "--arch", "conv:1x30000x30000-c1k30000p30000-fc10", "--json", expect="ok",
        stdout="lambda_max_bound"),
    cli("fisher", "fisher", "--arch", "fc:784-" + "8-" * 20000 + "10", names="arch"),
    cli("fisher", "fisher", "--arch", "fc:784-" + "9" * 5000 + "-10", names="arch"),
    cli("fisher", *_FISHER_MEASURE, "--seed", "18446744073709551616", names="seed"),
    cli("fisher", *_FISHER_MEASURE, "--seed", "-1", names="seed"),
    cli("fisher", *_FISHER_MEASURE, "--batch-size", "1000000000", names="batch"),
    cli("fisher", *_FISHER_MEASURE, "--sigma-w2", "1e308", names="sigma_w2"),
    cli("fisher", *_FISHER_MEASURE, "--gamma", "1e308", names="gamma"),
    cli("fisher", *_FISHER_MEASURE, "--tol", "nan", names="tol"),
    cli("fisher", *_FISHER_MEASURE, "--max-memory-gb", "1e308", names="max_memory_gb"),
    cli("fisher", *_FISHER_MEASURE, "--max-memory-gb", "0", names="max_memory_gb"),
    cli("fisher", *_FISHER_MEASURE, "--tol", "2", names="tol"),
    cli("fisher", "fisher", "--measure", "--arch", "fc:64-32-10", "--dataset", "nosuch", names="--dataset="),  # was accepted: a λmax half the true one
    # the measurement's options without --measure were ignored without a word
    *[cli("fisher", "fisher", "--arch", "fc:64-32-10", *opt, names="without --measure")
      for opt in (("--tol", "nan"), ("--seed", "-5"), ("-B", "0"), ("--dataset", "nosuch"), ("--device", "tpu"),
                  ("--max-memory-gb", "-1"))],
    cli("fisher", "fisher", "--measure", "--dataset", "digits", "--arch", "fc:64-32-10", "--phi", "tanh",
        "--batch-size", "32", "--json", expect="ok", stdout="ratio_measured_to_bound", fast=False),
    cli("fisher", "fisher", "--measure", "--arch", "fc:784-20000-20000-10", names="max_memory", fast=False),
    cli("fisher", "fisher", "--measure", "--arch", "conv:1x28x28-c4096k3p1-c4096k3p1-fc10", names="max_memory",
        fast=False),
    cli("fisher", *_FISHER_MEASURE, "--json", expect="ok", stdout="lambda_max_measured", fast=False),
    # ------------------------------------------------------------------ rank
    cli("rank", "rank", "--depth", "1000000000", names="depth"),
    cli("rank", "rank", "--depth", "1000000000000000000", names="depth"),
    cli("rank", *_RANK, "--record-points", "100000000", names="record_points"),
    cli("rank", *_RANK, "--max-memory-gb", "1e308", names="max_memory_gb"),
    cli("rank", *_RANK, "--eps", "1e308", names="eps"),
    cli("rank", *_RANK, "--eps", "nan", names="eps"),
    cli("rank", *_RANK, "--seed", "18446744073709551616", names="seed"),
    cli("rank", *_RANK, "--seed", "-1", names="seed"),
    cli("rank", *_RANK, "--device", "cuda:99", names="device"),
    cli("rank", *_RANK, "--device", "foo", names="device"),
    cli("rank", *_RANK, "--device", "", names="device"),
    cli("rank", *_RANK, "--device", "mps", names="device"),
    cli("rank", *_RANK, "--chains", "1000000000", names="chains"),
    cli("rank", *_RANK, "--tau", "1e308", "--json", expect="ok", stdout='"final_soft_rank": 0.0'),
    cli("rank", "rank", "--depth", "1000000000", "--width", "8", "--batch-size", "8", names="depth"),
    cli("rank", *_RANK, "--residual-gamma", "abc", names="residual_gamma"),
    cli("rank", *_RANK, "--width", "-1", names="width"),
    cli("rank", "rank", "--depth", "10", "--width", "8", "--batch-size", "1", "--norm", "bn", names="batch_size"),
    cli("rank", *_RANK, "--json", expect="ok", stdout="mean_soft_rank"),
    # ----------------------------------------------------------------- train
    *[cli("train", "train", *_DIGITS, "--device", d, names="device", expect=_plain_cuda(d))
      for d in ("cuda", "cuda:99", "foo", "", "mps")],
    cli("train", "train", *_DIGITS[:-2], "--epochs", "1e9", names="epochs"),
    cli("train", "train", *_DIGITS, "--widths", "1000000000", names="widths"),
    cli("train", "train", *_DIGITS, "--widths", "1000000", "1000000", names="widths"),
    cli("train", "train", "--widths", "1000000", "--dataset", "mnist", "--epochs", "0.01", names="widths"),
    cli("train", "train", *_DIGITS, "--widths", "0", names="widths"),
    cli("train", "train", *_DIGITS, "--model", "cnn", "--widths", "50", names="widths"),
    cli("train", "train", *_DIGITS, "--seed", "18446744073709551616", names="seed"),
    cli("train", "train", *_DIGITS, "--batch-size", "1000000000", names="batch_size"),
    cli("train", "train", *_DIGITS, "--max-memory-gb", "0", names="max_memory_gb"),
    cli("train", "train", *_DIGITS, "--lr", "1e308", "--norm", "none", names="lr"),
    cli("train", "train", *_DIGITS, "--lr", "1e30", "--norm", "none", "--json", expect="ok",
        stdout='"diverged": true'),
    cli("train", "train", *_DIGITS, "--norm", "bn", "--json", expect="ok", stdout="test_accuracy"),
    cli("train", "train", *_DIGITS, "--checkpoint", "/dev/null", names="checkpoint"),
    cli("train", "train", *_DIGITS, "--checkpoint", ".", names="checkpoint"),
    cli("train", "train", *_DIGITS, "--checkpoint", "{root}/t1.pt", "--checkpoint-every", "-1",
        names="checkpoint_every"),
    cli("train", "train", *_DIGITS, "--checkpoint", "{root}/t2.pt", "--checkpoint-every", "nan",
        names="checkpoint_every"),
    cli("train", "train", *_DIGITS, "--checkpoint", "{root}/t3.pt", names="checkpoint",
        setup="open('t3.pt', 'wb').write(b'PK\\x03\\x04 planted')"),
    cli("train", "train", *_DIGITS, "--checkpoint", "{root}/t4.pt", names="checkpoint",
        setup="import os; os.path.lexists('t4.pt') or os.symlink('nowhere', 't4.pt')"),
    cli("train", "train", *_DIGITS, "--checkpoint", "{root}/t5.pt", "--json", expect="ok",
        stdout="test_accuracy"),
    # ------------------------------------------------------- reproduce, report
    cli("reproduce", "reproduce", "fisher-fig1", "--results-dir", "{root}/file.txt", "--serial", "--no-progress",
        "--out", "{root}/o1", names="results"),
    cli("reproduce", "reproduce", "fisher-fig1", "--results-dir", "{root}/dangling-dir", "--serial",
        "--no-progress", "--out", "{root}/o2", names="results",
        setup="import os; os.path.lexists('dangling-dir') or os.symlink('nowhere/at/all', 'dangling-dir')"),
    cli("report", "report", "--only", "fisher-fig1", "--results-dir", "{root}/file.txt", "--serial",
        "--no-progress", "--out", "{root}/r1", names="results"),
    # ----------------------------------------------------------------- sweep
    cli("sweep", "sweep", "run", "yang2019-fig1ab", "--scheduler", "tcp://127.0.0.1:9", "--store",
        "{root}/sched.sqlite", "--no-progress", names="scheduler", fast=False),
    cli("sweep", "sweep", "run", "yang2019-fig1ab", "--checkpoint-every", "-1", "--store", "{root}/ck1.sqlite",
        "--serial", "--no-progress", names="checkpoint_every"),
    cli("sweep", "sweep", "run", "yang2019-fig1ab", "--checkpoint-every", "nan", "--store", "{root}/ck2.sqlite",
        "--serial", "--no-progress", names="checkpoint_every"),
    cli("sweep", "sweep", "run", "yang2019-fig1ab", "--store", "{root}/ck3.sqlite", "--serial", "--no-progress",
        names="checkpoint folder",
        setup="import os; os.path.lexists('ck3.sqlite.checkpoints') or os.symlink('nowhere', 'ck3.sqlite.checkpoints')"),
    # accepted and then ignored, where reproduce and report refused the same combination
    cli("sweep", "sweep", "run", "yang2019-fig1ab", "--serial", "--workers", "3", "--store", "{root}/sw.sqlite",
        "--no-progress", names="--workers=3 is not allowed with --serial"),
    cli("reproduce", "reproduce", "--list", "yang2019-fig1ab", names="--list is not allowed with a name"),
    # a FIFO at the lock hung the open (run, status and reproduce alike)
    cli("sweep", "sweep", "run", "yang2019-fig1ab", "--store", "{root}/fifo.sqlite", "--serial", "--no-progress",
        names="lock file", setup="import os; os.path.lexists('fifo.sqlite.lock') or os.mkfifo('fifo.sqlite.lock')"),
    cli("reproduce", "reproduce", "fisher-fig1", "--results-dir", "{root}/fifo-res", "--serial", "--no-progress",
        "--out", "{root}/o3", names="lock file",
        setup="import os; os.makedirs('fifo-res', exist_ok=True); p = 'fifo-res/fisher-fig1-small.sqlite.lock'; "
              "os.path.lexists(p) or os.mkfifo(p)"),
    *[cli(c, c, *(("fisher-fig1",) if c == "reproduce" else ("--only", "fisher-fig1")), "--plan", "--plan-budget", b,
          "--out", "{root}/p1", names="--plan-budget") for c in ("reproduce", "report") for b in ("1e10", "nan")],
    # ---------------------------------------------------- simulate, theory (older commands' leftovers)
    cli("simulate", "simulate", *hc._SMALL_SIM, "--eps=1e308", names="eps"),
    # passed the memory check and peaked at 1.7 GB (autograd's per-layer records were not counted)
    cli("simulate", "simulate", "--width", "8", "--depth", "100000", "--networks", "1", "-B", "4", names="max_memory"),
    cli("theory", "theory", "--phi", "relu", "-B", "100000000000000000", names="batch"),
]

# ------------------------------------------------------------------------------------------ API
_FISHER_NET = """
import torch
from bnlab.fisher import build_model, curvature_spectrum
torch.manual_seed(0)
model = build_model("fc:8-16-3", dtype=torch.float64)
x = torch.randn(12, 8, dtype=torch.float64)
"""
_RANK_H = """
import torch
from bnlab import rank
g = torch.Generator().manual_seed(0)
H = torch.randn(6, 10, generator=g, dtype=torch.float64)
"""
_NETS = """
import torch
from bnlab import nets
"""
# one small training call of each trainer, with the arguments under test in place of {}
_ENSEMBLE_CALL = _NETS + ("nets.train_ensemble([nets.MLP(4, [4], 2)], (torch.randn(20, 4), torch.randint(0, 2, (20,))), "
                          "lr=0.1, batch_size=4, steps=2, {})")
_TRAIN_CALL = _NETS + ("nets.train(nets.MLP(4, [4], 2), (torch.randn(20, 4), torch.randint(0, 2, (20,))), "
                       "optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=4, steps=2, {})")
_DATA = """
import torch
from bnlab import nets
from bnlab.data import load_dataset
data = load_dataset("digits", "train").subset(120, seed=0)
model = nets.MLP(64, [16], 10, norm="bn", seed=0)
opt = lambda p: torch.optim.SGD(p, lr=0.1)
"""

API_CASES: list[Case] = [
    # ---------------------------------------------------------------- fisher
    api("fisher-api", "from bnlab.fisher import parse_arch\nparse_arch('conv:1x100000000x100000000-c1k1-fc10')",
        names="arch"),
    api("fisher-api", "from bnlab.fisher import parse_arch\nparse_arch('fc:5-' + '3-' * 100000 + '2')", names="arch"),
    api("fisher-api", "from bnlab.fisher import parse_arch\nparse_arch(b'fc:4-2')", names="arch"),
    api("fisher-api", """
        from bnlab.fisher import fisher_order_parameters
        import math
        r = fisher_order_parameters('fc:784-256-256-10', phi='tanh')
        assert r.lambda_max_bound == 0.0 and r.eta_star == math.inf and r.note
        """, expect="ok"),
    api("fisher-api", "from bnlab.fisher import fisher_order_parameters\n"
        "fisher_order_parameters('fc:10-10-2', sigma_w2=float('nan'))", names="sigma_w2"),
    api("fisher-api", "from bnlab.fisher import eta_star\neta_star(0.0)", names="lambda_max"),
    api("fisher-api", "from bnlab.fisher import build_model\nbuild_model('fc:10-10-2', seed=2**70)", names="seed"),
    api("fisher-api", "from bnlab.fisher import build_model\nbuild_model('fc:10-10-2', seed='abc')", names="seed"),
    api("fisher-api", "from bnlab.fisher import build_model\nbuild_model('fc:784-1000000000-10')", names="max_memory"),
    api("fisher-api", "from bnlab.fisher import build_model\nbuild_model('fc:10-10-2', dtype='float64')",
        names="dtype"),
    api("fisher-api", _FISHER_NET + "from bnlab.fisher import calibrate_batchnorm_\n"
        "x[0, 0] = float('nan')\ncalibrate_batchnorm_(model, x)", names="inputs"),
    api("fisher-api", _FISHER_NET + "from bnlab.fisher import calibrate_batchnorm_\n"
        "calibrate_batchnorm_(model, x, batch_size=0)", names="batch_size"),
    api("fisher-api", _FISHER_NET + "curvature_spectrum(model, x, seed='abc')", names="seed"),
    api("fisher-api", _FISHER_NET + "curvature_spectrum(model, x, seed=2**70)", names="seed"),
    api("fisher-api", _FISHER_NET + "curvature_spectrum(model, x, seed=-1)", names="seed"),
    api("fisher-api", _FISHER_NET + "curvature_spectrum(model, x, tol=2.0)", names="tol"),
    api("fisher-api", _FISHER_NET + "x[3, 2] = float('nan')\ncurvature_spectrum(model, x)", names="inputs"),
    api("fisher-api", _FISHER_NET + _d("""
        r = curvature_spectrum(model, x * 1e30)  # train-mode BN normalizes the scale away: a number, not an error
        assert math.isfinite(r.lambda_max) and r.lambda_max > 0
        """), expect="ok"),
    api("fisher-api", """
        import torch
        from bnlab.fisher import build_model, curvature_spectrum
        model = build_model("fc:8-16-3")  # float32: the batch variance of 1e30-scaled inputs overflows
        curvature_spectrum(model, torch.randn(12, 8) * 1e30)
        """, names="overflows"),
    api("fisher-api", _FISHER_NET + "with torch.no_grad(): model[0].weight[0, 0] = float('nan')\n"
        "curvature_spectrum(model, x)", names="param"),
    api("fisher-api", _FISHER_NET + "with torch.no_grad(): model[0].weight[0, 0] = float('inf')\n"
        "curvature_spectrum(model, x, bn_mode='eval')", names="param"),
    api("fisher-api", _FISHER_NET + "y = torch.randn(12, 3, dtype=torch.float64); y[0, 0] = float('nan')\n"
        "curvature_spectrum(model, x, y, curvature='hessian')", names="targets"),
    api("fisher-api", _FISHER_NET + "y = torch.full((12,), 2.55)\n"
        "curvature_spectrum(model, x, y, curvature='hessian', loss='cross_entropy')", names="targets"),
    api("fisher-api", _FISHER_NET + "class T(torch.nn.Module):\n"
        "    def __init__(s): super().__init__(); s.m = model\n"
        "    def forward(s, x): return (s.m(x), x)\n"
        "curvature_spectrum(T(), x)", names="output"),
    api("fisher-api", _FISHER_NET + "class T(torch.nn.Module):\n"
        "    def __init__(s): super().__init__(); s.m = model\n"
        "    def forward(s, x): return {'y': s.m(x)}\n"
        "curvature_spectrum(T(), x)", names="output"),
    api("fisher-api", _FISHER_NET + "class T(torch.nn.Module):\n"
        "    def __init__(s): super().__init__(); s.m = model\n"
        "    def forward(s, x): return s.m(x).sum()\n"
        "curvature_spectrum(T(), x)", names="output"),
    api("fisher-api", _FISHER_NET + "curvature_spectrum(model, x, tol=float('nan'))", names="tol"),
    api("fisher-api", _FISHER_NET + "curvature_spectrum(model, x, max_memory_bytes=1000)", names="max_memory"),
    api("fisher-api", """
        import torch
        from bnlab.fisher import curvature_spectrum
        model = torch.nn.Linear(20000, 20000)  # 4e8 parameters: a deep copy and Lanczos vectors do not fit 1 GiB
        curvature_spectrum(model, torch.randn(2, 20000))
        """, names="max_memory", fast=False),
    api("fisher-api", _FISHER_NET + _d("""
        r = curvature_spectrum(model, x)
        assert r.lambda_max > 0 and math.isfinite(r.lambda_max)
        """), expect="ok"),
    # ------------------------------------------------------------------ rank
    api("rank-api", _RANK_H + _d("""
        for f in (rank.rank_lower_bound, rank.stable_rank, rank.effective_rank, rank.numerical_rank):
            a, b = float(f(H)), float(f(1e200 * H))
            assert math.isfinite(b) and abs(a - b) <= 1e-9 * max(1.0, abs(a)), (f.__name__, a, b)
        """), expect="ok"),
    api("rank-api", _RANK_H + _d("""
        h = H.float()
        for f in (rank.rank_lower_bound, rank.stable_rank, rank.effective_rank, rank.numerical_rank):
            a, b = float(f(h)), float(f(1e25 * h))
            assert math.isfinite(b) and abs(a - b) <= 1e-4 * max(1.0, abs(a)), (f.__name__, a, b)
        """), expect="ok"),
    api("rank-api", _RANK_H + _d("""
        I = 1e-200 * torch.eye(4, dtype=torch.float64)
        for f in (rank.rank_lower_bound, rank.stable_rank, rank.effective_rank, rank.numerical_rank):
            assert abs(float(f(I)) - 4.0) < 1e-9, (f.__name__, float(f(I)))
        m = rank.rank_measures(torch.stack([H, 1e200 * H]))  # the soft rank depends on the scale, r(H) not
        assert float(m.rank_lower_bound[0]) == float(m.rank_lower_bound[1]) or abs(
            float(m.rank_lower_bound[0]) - float(m.rank_lower_bound[1])) < 1e-9
        """), expect="ok"),
    api("rank-api", _RANK_H + _d("""
        Z = torch.zeros(4, 6, dtype=torch.float64)
        for f in (rank.rank_lower_bound, rank.stable_rank, rank.soft_rank, rank.effective_rank, rank.numerical_rank):
            v = float(f(Z))
            assert v == 0.0, (f.__name__, v)
        """), expect="ok"),
    api("rank-api", _RANK_H + "H[0, 0] = float('nan')\nrank.rank_measures(H)", names="h"),
    api("rank-api", _RANK_H + "rank.soft_rank(H, tau=float('nan'))", names="tau"),
    api("rank-api", _RANK_H + "rank.numerical_rank(H, rtol=-1.0)", names="rtol"),
    api("rank-api", _RANK_H + "rank.chain_step(H, torch.randn(5, 5, dtype=torch.float64))", names="w"),
    api("rank-api", _RANK_H + "rank.chain_step(H, torch.randn(6, 6))", names="dtype"),
    api("rank-api", _RANK_H + "rank.chain_step(H, torch.randn(6, 6, dtype=torch.float64), eps=-1.0)", names="eps"),
    api("rank-api", _RANK_H + "rank.chain_step(H, torch.randn(6, 6, dtype=torch.float64), residual_gamma=-1.0)",
        names="residual_gamma"),
    api("rank-api", "from bnlab import rank\nrank.run_chain(4, 4, 3, seed=2**70)", names="seed"),
    api("rank-api", "from bnlab import rank\nrank.run_chain(4, 4, 3, seed=-1)", names="seed"),
    api("rank-api", "from bnlab import rank\nrank.run_chain(4, 4, 3, seed='abc')", names="seed"),
    api("rank-api", "from bnlab import rank\nrank.run_chain(4, 4, 10**10)", names="depth"),
    api("rank-api", "from bnlab import rank\nrank.run_chain(4, 4, 3, device='cuda:99')", names="device"),
    api("rank-api", "from bnlab import rank\nrank.run_chain(4, 4, 3, eps=1e308)", names="eps"),
    api("rank-api", "from bnlab import rank\nrank.run_chain(4, 4, 3, inputs=[[float('nan')] * 4] * 4)",
        names="inputs"),
    api("rank-api", "from bnlab import rank\nrank.default_record_layers(10**18, 10**9)", names="max_points"),
    api("rank-api", "from bnlab import rank\nrank.run_chain(4, 4, 3, eps=1e308, norm='bn')", names="eps"),
    api("rank-api", """
        from bnlab import rank
        r = rank.run_chain(8, 8, 20, seed=1)
        assert all(math.isfinite(float(v)) for v in r.soft_rank.ravel())
        """, expect="ok"),
    api("rank-api", """
        import torch
        from bnlab import rank
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
        x = torch.randn(9, 5); x[0, 0] = float('nan')
        rank.layer_rank_measures(model, x)
        """, names="x"),
    api("rank-api", """
        import torch
        from bnlab import rank
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
        rank.gradient_alignment(model, torch.randn(9, 5), torch.full((9,), 2.55))
        """, names="y"),
    api("rank-api", """
        import torch
        from bnlab import rank
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
        rank.rank_pretrain(model, torch.randn(40, 5), steps=-1)
        """, names="steps"),
    api("rank-api", _RANK_H + _d("""
        r = rank.rescale_to_unit_trace(1e200 * H)  # ‖1e200·H‖_F² overflowed: all zeros
        assert torch.allclose(r, rank.rescale_to_unit_trace(H), rtol=1e-12)
        """), expect="ok"),
    api("rank-api", _RANK_H + "rank.draw_weights((-2, 2), 'gaussian', torch.Generator(), torch.float64, 'cpu')",
        names="shape"),
    api("rank-api", """
        import torch
        from bnlab import rank
        rank.gradient_alignment(torch.nn.Linear(3, 2), torch.randn(4, 3), torch.tensor([0, 1, 0, 5]))
        """, names="y"),
    api("rank-api", """
        import torch
        from bnlab import rank
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
        x = torch.randn(40, 5); x[0, 0] = float('nan')
        rank.rank_pretrain(model, x, steps=2, batch_size=8)
        """, names="data"),
    api("rank-api", """
        import torch
        from bnlab import rank
        model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
        rank.rank_pretrain(model, torch.randn(40, 5), steps=10**12, batch_size=8)
        """, names="steps"),
    api("fisher-api", "from bnlab.fisher import fisher_order_parameters\n"
        "fisher_order_parameters('fc:10-10-2', gamma=1e300)", names="gamma"),
    api("fisher-api", "from bnlab.fisher import fisher_order_parameters\n"
        "fisher_order_parameters('fc:10-10-10-2', norm='none', sigma_w2=1e300)", names="sigma_w2"),
    api("fisher-api", "from bnlab.fisher import fisher_order_parameters\n"
        "fisher_order_parameters('fc:10-10-2', input_q=1e308)", names="input_q"),
    # ------------------------------------------------------------------ nets
    api("nets-api", _ENSEMBLE_CALL.format("seeds=2**70"), names="seeds"),
    api("nets-api", _ENSEMBLE_CALL.format("checkpoint='/dev/null'"), names="checkpoint"),
    api("nets-api", _ENSEMBLE_CALL.format("checkpoint='.'"), names="checkpoint"),
    api("nets-api", _ENSEMBLE_CALL.format("checkpoint='x.pt', checkpoint_every=float('nan')"), names="checkpoint_every"),
    api("nets-api", "import os, tempfile\npath = os.path.join(tempfile.mkdtemp(), 'ck.pt')\n"
        "open(path, 'wb').write(b'PK\\x03\\x04 planted')\n" + _ENSEMBLE_CALL.format("checkpoint=path"),
        names="checkpoint"),
    api("nets-api", _TRAIN_CALL.format("checkpoint='/dev/null'"), names="checkpoint"),
    api("nets-api", _TRAIN_CALL.format("checkpoint=123"), names="checkpoint"),
    api("nets-api", _TRAIN_CALL.format("checkpoint='x.pt', callbacks=[print]"), names="callbacks"),
    api("nets-api", _TRAIN_CALL.format("checkpoint='x.pt', checkpoint_every=-5"), names="checkpoint_every"),
    api("nets-api", _NETS + "nets.MLP(784, [10**9], 10)", names="max_memory"),
    api("nets-api", _NETS + "nets.BNMLP(784, 10, depth=4, width=10**9)", names="max_memory"),
    api("nets-api", _NETS + "nets.MLP(784, [10**6, 10**6], 10)", names="max_memory"),
    api("nets-api", _NETS + "nets.vgg(16, width_multiplier=1e6)", names="max_memory"),
    api("nets-api", _NETS + "nets.MLP(784, [0], 10)", names="widths"),
    api("nets-api", _NETS + "nets.MLP(784, 'abc', 10)", names="widths"),
    api("nets-api", _NETS + "nets.MLP(784, [10], 10, seed=2**70)", names="seed"),
    api("nets-api", _NETS + "nets.MLP(784, [10], 10, seed=-1)", names="seed"),
    api("nets-api", _NETS + "nets.BNMLP(8, 3, depth=3, width=16, gamma=1e308)", names="gamma"),
    api("nets-api", _NETS + "nets.MLP(8, [16], 3, gamma=float('nan'))", names="gamma"),
    api("nets-api", _NETS + "nets.MLP(8, [16], 3, sigma_w2=1e308)", names="sigma_w2"),
    api("nets-api", _NETS + _d("""
        m = nets.BNMLP(8, 3, depth=3, width=16, gamma=1e3, dtype=torch.float64)
        y = m(torch.randn(12, 8, dtype=torch.float64))
        assert torch.isfinite(y).all()
        """), expect="ok"),
    *[api("nets-api", _NETS + f"nets.resolve_device({d!r})", names="device", expect=_plain_cuda(d))
      for d in ("cuda", "cuda:99", "foo", "", "mps", 3.5, None)],
    api("nets-api", _NETS + "nets.make_norm('bn', 0)", names="num_features"),
    api("nets-api", _NETS + "nets.make_norm('bn', 8, eps=float('nan'))", names="eps"),
    api("nets-api", _NETS + "nets.ghost_batch_norm(torch.randn(8, 4), 0, 1e-5)", names="ghost_batch_size"),
    api("nets-api", _NETS + "nets.init_weights_(torch.nn.Linear(3, 3), 'gaussian', sigma_w2=float('nan'))",
        names="sigma_w2"),
    api("nets-api", _NETS + "nets.init_weights_(torch.nn.Linear(3, 3), 'gaussian', generator=2**70)",
        names="generator"),
    api("nets-api", _NETS + "nets.half_squared_error(torch.randn(4, 3), torch.randn(4, 2))", names="target"),
    api("nets-api", _DATA + "nets.train(model, data, optimizer=opt, batch_size=16, steps=3, device='cuda:99')",
        names="device"),
    api("nets-api", _DATA + "nets.train(model, data, optimizer=opt, batch_size=16, steps=3, seed=2**70)",
        names="seed"),
    api("nets-api", _DATA + "nets.train(model, data, optimizer=opt, batch_size=16, steps=10**13)", names="steps"),
    api("nets-api", _DATA + "nets.train(model, data, optimizer=opt, batch_size=16, epochs=1e12)", names="epochs"),
    api("nets-api", _DATA + _d("""
        import dataclasses
        bad = dataclasses.replace(data, y=data.y.float() + 0.55)
        nets.train(model, bad, optimizer=opt, batch_size=16, steps=3)
        """), names="target"),
    api("nets-api", _DATA + _d("""
        import dataclasses
        x = data.x.clone(); x[5] = float('nan')
        r = nets.train(model, dataclasses.replace(data, x=x), optimizer=opt, batch_size=16, steps=20)
        assert r.diverged  # a NaN batch is reported, never a silent NaN model
        """), expect="either", names="train_data"),
    api("nets-api", _DATA + "nets.train(model, data, optimizer=lambda p: torch.optim.SGD(p, lr=1e308), "
        "batch_size=16, steps=20)", names="lr"),
    api("nets-api", _DATA + _d("""
        r = nets.train(model, data, optimizer=lambda p: torch.optim.SGD(p, lr=1e30), batch_size=16, steps=20)
        assert r.diverged
        """), expect="ok"),
    api("nets-api", _DATA + _d("""
        r = nets.train(model, data, optimizer=opt, batch_size=16, steps=10)
        assert not r.diverged and math.isfinite(r.final_train_loss)
        """), expect="ok"),
    # ----------------------------------------------------------------- train (library)
    api("train-api", "from bnlab.optim import train_network\n"
        "train_network(dataset='digits', train_size=200, epochs=0.2, device='cuda:99')", names="device"),
    api("train-api", "from bnlab.optim import train_network\n"
        "train_network(dataset='digits', train_size=200, epochs=0.2, seed=2**70)", names="seed"),
    api("train-api", "from bnlab.optim import train_network\n"
        "train_network(dataset='digits', train_size=200, epochs=0.2, widths=[10**9])", names="widths"),
    api("train-api", "from bnlab.optim import train_network\n"
        "train_network(dataset='digits', train_size=200, epochs=0.2, widths='abc')", names="widths"),
    api("train-api", "from bnlab.optim import train_network\n"
        "train_network(dataset='digits', train_size=200, epochs=1e12)", names="epochs"),
    api("train-api", """
        from bnlab.optim import train_network
        r = train_network(dataset='digits', train_size=200, test_size=100, epochs=0.5, norm='none', lr=1e30)
        assert r.diverged
        """, expect="ok"),
    api("train-api", "from bnlab.optim import train_network\n"
        "train_network(dataset='digits', train_size=200, epochs=0.2, model='cnn', widths=[50])", names="widths"),
    api("train-api", "from bnlab.optim import train_network\n"
        "train_network(dataset='digits', train_size=200, epochs=0.2, max_memory_bytes=1000)", names="max_memory"),
]

# ------------------------------------------------------------------------------------------ links
_PLANT = """
import os
from pathlib import Path
def plant(link, target='victim.txt'):
    link = Path(link)
    link.parent.mkdir(parents=True, exist_ok=True)
    if not os.path.lexists(link):
        os.symlink(os.path.abspath(target), link)
Path('victim.txt').write_text('precious\\n')
"""

LINK_CASES: list[Case] = [
    cli("link", "sweep", "export", "{root}/good.sqlite", "-o", "{root}/linked-export.csv", expect="ok",
        setup=_PLANT + "plant('linked-export.csv')"),
    cli("link", "sweep", "run", "yang2019-fig1ab", "--serial", "--no-progress", "--store", "{root}/dangling.sqlite",
        names="symbolic link", setup=_PLANT + "plant('dangling.sqlite', 'elsewhere/made.sqlite')"),
    cli("link", "sweep", "run", "yang2019-fig1ab", "--serial", "--no-progress", "--store", "{root}/wal.sqlite",
        names="wal", setup=_PLANT + "plant('wal.sqlite-wal')"),
    cli("link", "sweep", "run", "yang2019-fig1ab", "--serial", "--no-progress", "--store", "{root}/shm.sqlite",
        names="shm", setup=_PLANT + "plant('shm.sqlite-shm')"),
    cli("link", "sweep", "status", "{root}/good2.sqlite", names="shm",
        setup=_PLANT + "import shutil; shutil.copy('good.sqlite', 'good2.sqlite'); plant('good2.sqlite-shm')"),
    cli("link", "reproduce", "fisher-fig1", "--serial", "--no-progress", "--out", "{root}/figs",
        "--results-dir", "{root}/res-fig", expect="ok",
        setup=_PLANT + "plant('figs/figures/fisher-fig1/fisher_fig1.png')", fast=False),
    cli("link", "reproduce", "fisher-fig1", "--serial", "--no-progress", "--out", "{root}/figs2",
        "--results-dir", "{root}/res-lock", names="symbolic link",
        setup=_PLANT + "plant('res-lock/fisher-fig1-small.sqlite.lock')"),
    cli("link", "reproduce", "fisher-fig1", "--serial", "--no-progress", "--out", "{root}/figs3",
        "--results-dir", "{root}/res-shm", names="shm",
        setup=_PLANT + "plant('res-shm/fisher-fig1-small.sqlite-shm')"),
    cli("link", "report", "--only", "fisher-fig1", "--serial", "--no-progress", "--out", "{root}/rep",
        "--results-dir", "{root}/res-rep", expect="ok",
        setup=_PLANT + "plant('rep/index.html'); plant('rep/report.json')", fast=False),
]

ALL_CASES = CLI_CASES + API_CASES + LINK_CASES

_API_HARNESS = """
import math, sys
import numpy as np
try:
    exec(compile(sys.stdin.read(), "<case>", "exec"), {"math": math, "np": np, "__name__": "__case__"})
except (ValueError, FloatingPointError) as exc:  # FloatingPointError: run_chain's documented underflow
    print(f"{type(exc).__name__}: {exc}", file=sys.stderr)
    sys.exit(3)
except AssertionError as exc:
    print(f"NONSENSE: assertion failed: {exc}", file=sys.stderr)
    sys.exit(4)
"""


def _limit_address_space():
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_LIMIT, ADDRESS_SPACE_LIMIT))
    os.setsid()


def classify(case: Case, rc, out: str, err: str, maxrss, victim_ok: bool) -> str:
    if not victim_ok:
        return "nonsense"  # a planted link was followed: the victim's text changed
    if rc is None:
        return "hang"
    if maxrss is not None and maxrss > MEMORY_LIMIT_BYTES:
        return "memory"
    text = out + err
    if any(s in text for s in ("MemoryError", "can't allocate memory", "DefaultCPUAllocator", "out of memory")):
        return "memory"
    if "Traceback (most recent call last)" in text:
        return "traceback"
    if rc == 4:
        return "nonsense"
    named = case.names.lower() in text.lower()
    if case.expect == "ok" or (case.expect == "either" and rc == 0):
        if rc != 0:
            return "unclear error"
        if "NaN" in out or (case.stdout and case.stdout not in out):
            return "nonsense"
        return "sensible"
    if rc == 0:
        return "nonsense"
    return "clean error" if named else "unclear error"


def run_case(case: Case, root: Path, pythonpath: str, timeout: float = CASE_TIMEOUT) -> tuple[str, str]:
    """Run one case in a subprocess (its setup first); return (outcome, last line of its output)."""
    env = dict(os.environ, PYTHONPATH=pythonpath, OMP_NUM_THREADS="1", BNLAB_RESULTS=str(root / "results"),
               BNLAB_DATA=os.environ.get("BNLAB_DATA", str(Path.home() / ".cache" / "bnlab")), MPLBACKEND="Agg")
    victim = root / "victim.txt"
    victim.write_text(VICTIM_TEXT)
    if case.setup:
        subprocess.run([sys.executable, "-c", case.setup], cwd=root, check=True, env=env)
    if case.argv:
        cmd = [sys.executable, "-m", "bnlab", *[a.replace("{root}", str(root)) for a in case.argv]]
        stdin = None
    else:
        cmd = [sys.executable, "-c", _API_HARNESS]
        stdin = case.code
    with tempfile.TemporaryFile("w+") as fo, tempfile.TemporaryFile("w+") as fe, \
            tempfile.TemporaryFile("w+") as fi:
        if stdin is not None:
            fi.write(stdin)
            fi.seek(0)
        p = subprocess.Popen(cmd, stdin=fi, stdout=fo, stderr=fe, env=env, cwd=root, preexec_fn=_limit_address_space)
        rc, rusage = hc.wait_for_case(p, timeout)
        fo.seek(0)
        fe.seek(0)
        out, err = fo.read(), fe.read()
    maxrss = rusage.ru_maxrss * 1024 if rusage is not None and rc is not None else None
    victim_ok = victim.read_bytes() == VICTIM_TEXT.encode()  # a followed link may have written binary data
    if case.command == "sweep" and "sched.sqlite" in " ".join(case.argv) and (root / "sched.sqlite").exists():
        victim_ok, err = False, err + "\nan empty store was left behind"
    lines = (err.strip() or out.strip()).splitlines() or [""]
    return classify(case, rc, out, err, maxrss, victim_ok), lines[-1][:200]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pythonpath", default=str(Path(__file__).resolve().parents[1]),
                    help="the bnlab tree to test (default: this checkout)")
    ap.add_argument("--timeout", type=float, default=CASE_TIMEOUT, help="seconds per case before it is a hang")
    ap.add_argument("--only", default=None, help="only cases whose id contains this text")
    ap.add_argument("--verbose", "-v", action="store_true", help="print every case's outcome")
    args = ap.parse_args(argv)
    counts: dict[str, dict[str, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = hc.make_fixtures(Path(tmp) / "fx")
        for case in ALL_CASES:
            if args.only and args.only not in case.id:
                continue
            t0 = time.monotonic()
            outcome, last = run_case(case, root, os.path.abspath(args.pythonpath), args.timeout)
            counts.setdefault(case.command, dict.fromkeys(OUTCOMES, 0))[outcome] += 1
            if args.verbose or outcome not in ("clean error", "sensible"):
                print(f"{outcome:13s} {time.monotonic() - t0:5.1f}s  {case.id}\n{'':20s}{last}", flush=True)
    total = dict.fromkeys(OUTCOMES, 0)
    print(f"\n{'command':12s} {'cases':>5s} " + " ".join(f"{o:>13s}" for o in OUTCOMES))
    for cmd, c in counts.items():
        for o in OUTCOMES:
            total[o] += c[o]
        print(f"{cmd:12s} {sum(c.values()):5d} " + " ".join(f"{c[o]:13d}" for o in OUTCOMES))
    print(f"{'all':12s} {sum(total.values()):5d} " + " ".join(f"{total[o]:13d}" for o in OUTCOMES))
    return 0


if __name__ == "__main__":
    sys.exit(main())
