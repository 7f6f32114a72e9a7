"""Test experiments for the sweep engine (importable by Dask workers and by ``bnlab`` subprocesses).

Every execution of a cell leaves marker files in ``$BNLAB_TEST_MARKERS`` (when
set): ``start-<i>-<pid>-<uuid>`` when it begins, ``done-<i>-<pid>-<uuid>``
when its work finished.  Counting them tells the tests how often each cell
really ran, independently of what the store says.  The grid is configured by
environment variables (read at call time, so the driver and a resume see the
same grid when given the same environment):

* ``BNLAB_TEST_CELLS`` — number of cells (default 6)
* ``BNLAB_TEST_SLEEP`` — seconds each cell sleeps (default 0.02)
* ``BNLAB_TEST_FAIL`` — comma-separated indices of cells that raise (read when the cell runs, so it is
  not part of the parameters: "fixing" a failure keeps the cell's key, as fixing a bug in code would)
* ``BNLAB_TEST_EXIT`` — comma-separated indices of cells that end their process (``os._exit``), as a
  worker killed by the system would
* ``BNLAB_TEST_SLOW`` — ``index:seconds`` pairs overriding the sleep of some cells
* ``BNLAB_TEST_BLOCK_AFTER`` — ``k``: a cell that starts when ``k`` or more cells have finished
  (counted from the ``done`` markers) blocks until the file ``$BNLAB_TEST_MARKERS/release`` exists
  (or 300 s pass), so a test can interrupt a sweep at a known point however loaded the machine is
"""
from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import numpy as np

from bnlab.experiments.spec import Comparison, Experiment


def _ints(var: str) -> set[int]:
    text = os.environ.get(var, "").strip()
    return {int(t) for t in text.split(",") if t.strip()}


def _slow() -> dict[int, float]:
    text = os.environ.get("BNLAB_TEST_SLOW", "").strip()
    return {int(a): float(b) for a, b in (t.split(":") for t in text.split(",") if t.strip())}


def grid(scale: str) -> list[dict]:
    n = int(os.environ.get("BNLAB_TEST_CELLS", "6")) * (2 if scale == "paper" else 1)
    sleep = float(os.environ.get("BNLAB_TEST_SLEEP", "0.02"))
    slow = _slow()
    return [{"i": i, "seed": 1000 + i, "sleep": slow.get(i, sleep)} for i in range(n)]


def _mark(kind: str, i: int) -> None:
    d = os.environ.get("BNLAB_TEST_MARKERS")
    if d:
        Path(d, f"{kind}-{i}-{os.getpid()}-{uuid.uuid4().hex}").touch()


def _block_if_asked() -> None:
    k, d = os.environ.get("BNLAB_TEST_BLOCK_AFTER", "").strip(), os.environ.get("BNLAB_TEST_MARKERS")
    if not k or not d or len(list(Path(d).glob("done-*"))) < int(k):
        return
    deadline = time.monotonic() + 300
    while not Path(d, "release").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def run_cell(params: dict) -> dict:
    i = params["i"]
    _mark("start", i)
    _block_if_asked()
    time.sleep(params["sleep"])
    if i in _ints("BNLAB_TEST_EXIT"):
        os._exit(3)
    if i in _ints("BNLAB_TEST_FAIL"):
        raise ValueError(f"cell {i} fails on purpose")
    rng = np.random.default_rng(params["seed"])
    _mark("done", i)
    # NumPy types on purpose: the engine must turn them into JSON.
    return {"i": i, "square": np.int64(i * i), "noise": rng.standard_normal(), "vector": np.arange(3) * i}


def plot(records, outdir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = sorted(r.metrics["i"] for r in records)
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot(xs, [x * x for x in xs], "o-")
    ax.set_xlabel("i")
    ax.set_ylabel("i²")
    paths = [Path(outdir) / "squares.png", Path(outdir) / "squares.svg"]
    for p in paths:
        fig.savefig(p, bbox_inches="tight")
    plt.close(fig)
    return paths


def compare(records) -> list[Comparison]:
    measured = sum(r.metrics["square"] for r in records)
    expected = sum(r.params["i"] ** 2 for r in records)
    return [
        Comparison("sum of squares", paper=str(expected), bnlab=str(measured), agrees=measured == expected),
        Comparison("cells finished", paper="all", bnlab=str(len(records)), agrees=None),
    ]


def plot_raises(records, outdir: Path) -> list[Path]:
    raise RuntimeError("this plot is broken on purpose")


def _experiment(name: str, **kw) -> Experiment:
    base = dict(
        name=name,
        paper="Test et al. 2024",
        figure="Fig. 1",
        title="squares of integers",
        claim="The square of i is i·i <b>(escaped)</b>.",
        grid=grid,
        run_cell=run_cell,
        plot=plot,
        compare=compare,
    )
    base.update(kw)
    return Experiment(**base)


def group_of(params: dict, scale: str) -> str | None:
    """At ``paper`` scale cells i ≡ r (mod 3) train together; at ``small`` every cell runs alone."""
    return f"r{params['i'] % 3}" if scale == "paper" else None


def run_group(cells: list[dict]) -> list[dict]:
    """Every member through ``run_cell`` (so a group's metrics are its cells'), with a ``group-<first i>``
    marker per execution of the group and the group's size in each cell's metrics."""
    _mark("group", min(c["i"] for c in cells))
    return [{**run_cell(c), "group_size": len(cells), "device": c.get("device")} for c in cells]


SWEEP = _experiment("bnlab-test-sweep")
PLOT_FAILS = _experiment("bnlab-test-plotfail", figure="Fig. 2", plot=plot_raises)
GROUPED = _experiment("bnlab-test-grouped", group=group_of, run_group=run_group)
GROUPED_GPU = _experiment("bnlab-test-grouped-gpu", group=group_of, run_group=run_group, uses_gpu=True)
EXPERIMENTS = [SWEEP, PLOT_FAILS]  # GROUPED is used by name only (tests/experiments/test_groups.py)


def markers(directory: Path, kind: str) -> dict[int, list[str]]:
    """``{cell index: [pid, ...]}`` of the executions that left a ``kind`` marker."""
    out: dict[int, list[str]] = {}
    for p in Path(directory).glob(f"{kind}-*"):
        _, i, pid, _ = p.name.split("-")
        out.setdefault(int(i), []).append(pid)
    return out


# --------------------------------------------------------------------------- an ensemble task that checkpoints
def ensemble_grid(scale: str) -> list[dict]:
    """Four cells (BN-MLP seeds) trained as one ensemble at every scale; ``BNLAB_TEST_STEPS`` steps (default 40)."""
    steps = int(os.environ.get("BNLAB_TEST_STEPS", "40"))
    return [{"i": i, "seed": i, "depth": 2 + i, "steps": steps} for i in range(4)]


def ensemble_group(params: dict, scale: str) -> str:
    return "all"


def _exit_after_first_save() -> None:
    """With ``BNLAB_TEST_EXIT_AFTER_SAVE`` set: the first checkpoint write of the test ends its process right
    after the file is on disk (``os._exit``, as a worker killed by the system), once (an ``exited`` marker)."""
    d = os.environ.get("BNLAB_TEST_MARKERS")
    if not os.environ.get("BNLAB_TEST_EXIT_AFTER_SAVE") or not d or Path(d, "exited").exists():
        return
    import bnlab.nets._checkpoint as ck

    real = ck.write

    def write(path, payload, *kind):
        real(path, payload, *kind)
        Path(d, "exited").touch()
        os._exit(3)

    ck.write = write


def run_ensemble_group(cells: list[dict]) -> list[dict]:
    """The cells' BN-MLPs (depth 2 + i, seed i, width 8) trained together on a fixed synthetic 4-class task;
    each cell's metrics: its final weights' sum of squares, last loss, and how many steps this execution ran."""
    import torch

    import bnlab.nets.ensemble as ens
    from bnlab.nets import BNMLP, train_ensemble

    _exit_after_first_save()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 6, generator=g, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    models = [BNMLP(6, 4, depth=c["depth"], width=8, seed=c["seed"], phi="tanh", dtype=torch.float64) for c in cells]
    ran = []
    real_step = ens._EnsembleRun.step

    def counted(self):
        ran.append(self.done)
        real_step(self)

    ens._EnsembleRun.step = counted
    try:
        results = train_ensemble(models, (x, y), lr=0.05, batch_size=16, steps=cells[0]["steps"],
                                 seeds=[c["seed"] for c in cells])
    finally:
        ens._EnsembleRun.step = real_step
    _mark("group", min(c["i"] for c in cells))
    return [{"i": c["i"], "weights": float(sum(float((p.detach().double() ** 2).sum()) for p in m.parameters())),
             "last_loss": r.history[-1], "steps_run": len(ran), "first_step": ran[0] if ran else None}
            for c, m, r in zip(cells, models, results)]


ENSEMBLE = _experiment("bnlab-test-ensemble", grid=ensemble_grid, group=ensemble_group, run_group=run_ensemble_group,
                       compare=lambda records: [])


def run_single_group(cells: list[dict]) -> list[dict]:
    """The cells' BN-MLPs (as :func:`run_ensemble_group`'s) trained one after another by ``bnlab.nets.train``
    (SGD with momentum): one trainer call per cell in one task; each cell's metrics as there."""
    import functools

    import torch

    from bnlab.nets import BNMLP, train

    _exit_after_first_save()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 6, generator=g, dtype=torch.float64)
    y = (x[:, 0] > 0).long() + 2 * (x[:, 1] > 0).long()
    out = []
    for c in cells:
        model = BNMLP(6, 4, depth=c["depth"], width=8, seed=c["seed"], phi="tanh", dtype=torch.float64)
        ran = []
        model.register_forward_pre_hook(lambda m, a, ran=ran: ran.append(1) if m.training else None)
        res = train(model, (x, y), optimizer=functools.partial(torch.optim.SGD, lr=0.05, momentum=0.9),
                    batch_size=16, steps=c["steps"], seed=c["seed"])
        out.append({"i": c["i"], "weights": float(sum(float((p.detach() ** 2).sum()) for p in model.parameters())),
                    "last_loss": res.history[-1], "steps_run": len(ran)})
    _mark("group", min(c["i"] for c in cells))
    return out


SINGLE = _experiment("bnlab-test-single", grid=ensemble_grid, group=ensemble_group, run_group=run_single_group,
                     compare=lambda records: [])
