"""Hostile and careless input for fisher, rank, nets and train, and outputs that never follow a planted link
(issue #26).

The tables live in ``tests/hostile_newer_cases.py`` (also a driver that prints the counts per command).
Here:

* one test per security hole of the issue that this part fixes (each fails on the code before it):
  a figure, ``index.html``/``report.json`` and an export written through a planted symbolic link, and
  a dangling link at a store's path making SQLite create the store and its side files where it points;
  a planted ``-wal``/``-shm`` link is refused with a message saying so;
* the tables' cheap cases in-process (API cases exec'd, CLI cases through ``bnlab.cli.main``, each under a
  time limit); every case as a subprocess under an address-space limit and a resident-memory bound is
  marked slow;
* hypothesis strategies for the numeric arguments of the new checks: seeds, rank-measure scales,
  architecture sizes, model scales (σ_w², γ) and the chain's ε.
"""
from __future__ import annotations

import math
import os
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hostile_cases as hc
import hostile_newer_cases as hn
from bnlab.cli import main


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return hc.make_fixtures(tmp_path_factory.mktemp("hostile-newer") / "fx")


def _plant(link: Path, target: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(target, link)


def _victim(tmp_path: Path) -> Path:
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    return victim


# ---------------------------------------------------------------------------------- security holes
def test_a_figure_is_never_written_through_a_planted_link(tmp_path):
    """Hole 1a: ``save_figure`` (every reproduction's figures) replaces a link at a figure's name."""
    from bnlab.reproductions.plotting import pyplot, save_figure

    victim = _victim(tmp_path)
    out = tmp_path / "figs"
    for suffix in ("png", "svg"):
        _plant(out / f"fig.{suffix}", victim)
    fig, ax = pyplot().subplots()
    ax.plot([0, 1], [1, 0])
    paths = save_figure(fig, out, "fig")
    assert victim.read_bytes() == b"precious\n"  # the old code wrote the PNG into the victim
    for p in paths:
        assert not p.is_symlink() and p.stat().st_size > 100
    assert sorted(x.name for x in out.iterdir()) == ["fig.png", "fig.svg"]  # no temporary file left


@pytest.mark.slow  # the fisher-fig1 small grid and its plot (~30 s here); save_figure itself is tested above
def test_the_fisher_figures_are_never_written_through_a_planted_link(tmp_path):
    """Hole 1a for the figures the fisher reproductions wrote with ``fig.savefig`` directly."""
    from bnlab.reproductions import fisher_fig1
    from bnlab.experiments.spec import Record

    victim = _victim(tmp_path)
    _plant(tmp_path / "out" / "fisher_fig1.png", victim)
    exp = fisher_fig1.EXPERIMENTS[0]
    records = [Record(params=dict(p), metrics=exp.run_cell(dict(p))) for p in exp.grid("small")]
    paths = exp.plot(records, tmp_path / "out")
    assert victim.read_bytes() == b"precious\n"
    assert paths and not Path(paths[0]).is_symlink()


def test_the_report_page_and_json_are_never_written_through_planted_links(tmp_path, monkeypatch):
    """Hole 1b: ``index.html`` and ``report.json`` planted as links to a victim."""
    from bnlab.experiments import build_report
    from bnlab.experiments.spec import Comparison, Experiment
    from bnlab.reproductions.plotting import pyplot, save_figure

    def plot(records, outdir):
        fig, ax = pyplot().subplots()
        ax.plot([r.metrics["y"] for r in records])
        return save_figure(fig, outdir, "squares")

    exp = Experiment(name="bnlab-test-links", paper="Test 2024", figure="Fig. 1", title="t", claim="c",
                     grid=lambda scale: [{"i": i} for i in range(2)], run_cell=lambda p: {"y": p["i"] ** 2},
                     plot=plot, compare=lambda records: [Comparison("n", paper="2", bnlab=str(len(records)),
                                                                   agrees=True)])
    victim = _victim(tmp_path)
    out = tmp_path / "out"
    _plant(out / "index.html", victim)
    _plant(out / "report.json", victim)
    _plant(out / "figures" / "bnlab-test-links" / "squares.png", victim)
    rep = build_report(out, results_dir=tmp_path / "res", experiments=[exp], serial=True, progress=False)
    assert victim.read_bytes() == b"precious\n"  # the old code wrote the page (then the JSON) into the victim
    assert not (out / "index.html").is_symlink() and "<html" in (out / "index.html").read_text().lower()
    assert not (out / "report.json").is_symlink() and rep.sections[0].done == 2


def test_an_export_is_never_written_through_a_planted_link(tmp_path):
    """Hole 1c: ``bnlab sweep export`` to a path where a link to a victim was planted."""
    from bnlab.experiments import export_sweep

    hc._store(tmp_path / "good.sqlite")
    victim = _victim(tmp_path)
    _plant(tmp_path / "out.csv", victim)
    export_sweep(tmp_path / "good.sqlite", tmp_path / "out.csv")
    assert victim.read_bytes() == b"precious\n"
    assert not (tmp_path / "out.csv").is_symlink() and "experiment" in (tmp_path / "out.csv").read_text()


def test_a_dangling_link_at_a_store_path_is_refused(tmp_path):
    """Hole 2: the old code created the store, ``-wal``, ``-shm`` and ``.lock`` where the link pointed."""
    from bnlab.experiments.store import ResultsStore

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _plant(tmp_path / "s.sqlite", elsewhere / "made.sqlite")
    with pytest.raises(ValueError, match="symbolic link"):
        ResultsStore(tmp_path / "s.sqlite")
    assert list(elsewhere.iterdir()) == [] and not (tmp_path / "s.sqlite.lock").exists()


@pytest.mark.parametrize("side", ["-wal", "-shm", "-journal"])
@pytest.mark.parametrize("readonly", [False, True])
def test_a_planted_side_file_link_is_refused_with_a_message_saying_so(tmp_path, side, readonly):
    # SQLite itself refuses a linked -wal/-shm, but the old message called the store "corrupted" and
    # sent the user to salvage it; now the link is named, and nothing is written
    from bnlab.experiments.store import ResultsStore

    hc._store(tmp_path / "s.sqlite")
    victim = _victim(tmp_path)
    _plant(tmp_path / f"s.sqlite{side}", victim)
    with pytest.raises(ValueError, match="is a symbolic link"):
        ResultsStore(tmp_path / "s.sqlite", readonly=readonly)
    assert victim.read_bytes() == b"precious\n"


def test_atomic_output_path_leaves_the_old_file_on_error(tmp_path):
    from bnlab._validation import atomic_output_path

    target = tmp_path / "a.txt"
    target.write_text("old\n")
    with pytest.raises(RuntimeError):
        with atomic_output_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("writer failed")
    assert target.read_text() == "old\n" and [p.name for p in tmp_path.iterdir()] == ["a.txt"]
    with pytest.raises(ValueError, match="directory"):
        with atomic_output_path(tmp_path):
            pass


def test_an_unreachable_scheduler_leaves_no_store(tmp_path, monkeypatch):
    """The store was created (and "0 cells done are saved …" printed) before the connection failed."""
    import bnlab.experiments.sweep as sweep

    class Refused(sweep.contextlib.AbstractContextManager):
        def __init__(self, scheduler, workers):
            raise ValueError(f"cannot connect to the Dask scheduler at {scheduler!r}: refused")

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(sweep, "open_client", Refused)
    with pytest.raises(ValueError, match="scheduler"):
        sweep.run_sweep("yang2019-fig1ab", store=tmp_path / "s.sqlite", scheduler="tcp://127.0.0.1:9",
                        progress=False)
    assert list(tmp_path.iterdir()) == []


def test_an_absent_cuda_index_is_refused_on_a_machine_with_cuda(monkeypatch):
    # on a CUDA machine device="cuda:99" reached x.to(device) and raised torch.AcceleratorError; here CUDA
    # is faked (one device) so that the check runs on any machine, and it must refuse before any use
    import torch

    from bnlab._validation import check_device
    from bnlab.nets import resolve_device
    from bnlab.rank import run_chain

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert check_device("device", "cuda:0") == torch.device("cuda:0")
    assert check_device("device", "cuda") == torch.device("cuda")
    for bad in ("cuda:99", "cuda:1", torch.device("cuda", 7)):
        with pytest.raises(ValueError, match=r"device=.* this machine has 1 CUDA device"):
            resolve_device(bad)
    with pytest.raises(ValueError, match="device"):
        run_chain(4, 4, 3, device="cuda:99")


# ------------------------------------------------------------------------------------- case tables
def _in_process(case, fixtures, capsys, limit_s: float = 60.0):
    """Run a case in this process under a time limit: (exit code, stdout+stderr text)."""
    timer = threading.Timer(limit_s, lambda: os.kill(os.getpid(), signal.SIGALRM))

    def hang(signum, frame):
        raise TimeoutError(f"the case ran past {limit_s} s (a hang)")

    previous = signal.signal(signal.SIGALRM, hang)
    timer.start()
    try:
        if case.argv:
            try:
                code = main([a.replace("{root}", str(fixtures)) for a in case.argv])
            except SystemExit as exc:
                code = exc.code
            out, err = capsys.readouterr()
            return code, out, err
        try:
            exec(compile(case.code, "<case>", "exec"), {"math": math, "np": np, "__name__": "__case__"})
        except (ValueError, FloatingPointError) as exc:
            return 3, "", f"{type(exc).__name__}: {exc}"
        return 0, "", ""
    finally:
        timer.cancel()
        signal.signal(signal.SIGALRM, previous)


_FAST = [c for c in hn.CLI_CASES + hn.API_CASES if c.fast and not c.setup]


@pytest.mark.parametrize("case", _FAST, ids=[c.id for c in _FAST])
def test_case_in_process(case, fixtures, capsys, monkeypatch):
    monkeypatch.setenv("BNLAB_RESULTS", str(fixtures / "results"))
    monkeypatch.chdir(fixtures)
    code, out, err = _in_process(case, fixtures, capsys)
    assert "Traceback" not in err
    if case.expect == "ok" or (case.expect == "either" and code == 0):
        assert code == 0, err
        assert "NaN" not in out and (not case.stdout or case.stdout in out), out[-500:]
        return
    assert code not in (0, None), f"exit {code} (expected an error naming {case.names!r}); stdout: {out[-300:]}"
    assert case.names.lower() in (out + err).lower(), err


@pytest.mark.slow
@pytest.mark.parametrize("case", hn.ALL_CASES, ids=[c.id for c in hn.ALL_CASES])
def test_case_as_subprocess_with_memory_bound(case, fixtures):
    outcome, last = hn.run_case(case, fixtures, os.environ.get("PYTHONPATH", ""), timeout=hn.CASE_TIMEOUT * 2)
    wanted = {"ok": ("sensible",), "error": ("clean error",), "either": ("sensible", "clean error")}[case.expect]
    assert outcome in wanted, last


# --------------------------------------------------------------------------------------- hypothesis
@settings(max_examples=30, deadline=None)
@given(value=st.one_of(st.integers(min_value=-(2**80), max_value=2**80), st.floats(allow_nan=True),
                       st.text(max_size=5), st.booleans(), st.none()))
def test_a_seed_is_an_int_in_range_or_a_named_error(value):
    from bnlab._validation import MAX_SEED, check_seed

    try:
        seed = check_seed("seed", value)
    except ValueError as exc:
        assert "seed" in str(exc)
        return
    assert isinstance(seed, int) and 0 <= seed <= MAX_SEED and seed == value


@settings(max_examples=20, deadline=None)
@given(exponent=st.integers(min_value=-290, max_value=290), seed=st.integers(0, 2**31))
def test_scale_invariant_rank_measures_do_not_depend_on_the_scale(exponent, seed):
    # H and 10^k·H have the same singular values up to the factor 10^k, which r(H), the stable, effective and
    # numerical rank divide out; computed on H / max|H| they agree to rounding (1e-9 relative)
    import torch

    from bnlab import rank

    h = torch.randn(5, 9, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    scaled = h * 10.0**exponent
    for f in (rank.rank_lower_bound, rank.stable_rank, rank.effective_rank, rank.numerical_rank):
        a, b = float(f(h)), float(f(scaled))
        assert math.isfinite(b) and b == pytest.approx(a, rel=1e-9), (f.__name__, exponent)
    m = rank.rank_measures(scaled)
    assert float(m.rank_lower_bound) == pytest.approx(float(rank.rank_lower_bound(h)), rel=1e-9)
    sv = rank.rank_measures(h).singular_values * 10.0**exponent
    assert torch.allclose(m.singular_values, sv, rtol=1e-9, atol=0.0)


# the deadline is a hang guard, not a benchmark: milliseconds unloaded; the old geometry loop ran for hours
@settings(max_examples=15, deadline=30_000, suppress_health_check=[HealthCheck.too_slow])
@given(side=st.integers(1, 10**15), kernel=st.integers(1, 10**15), channels=st.integers(1, 10**15),
       depth=st.integers(1, 5000))
def test_any_architecture_size_parses_fast_or_is_refused_naming_arch(side, kernel, channels, depth):
    from bnlab.fisher import parse_arch

    for spec in (f"conv:3x{side}x{side}-c{channels}k{kernel}-fc10", "fc:" + "-".join([str(channels)] * depth)):
        try:
            parse_arch(spec)
        except ValueError as exc:
            assert "arch" in str(exc)


_scales = st.one_of(st.floats(allow_nan=True, allow_infinity=True),
                    st.sampled_from([1e308, -1e308, 1e200, 1e40, 1e20, 0.0, -1.0, 1e-300]))


@settings(max_examples=20, deadline=None)
@given(which=st.sampled_from(["sigma_w2", "sigma_b2", "gamma", "beta"]), value=_scales,
       double=st.booleans())
def test_model_scales_give_a_finite_forward_pass_or_a_named_error(which, value, double):
    import torch

    from bnlab.fisher import build_model

    dtype = torch.float64 if double else torch.float32
    try:
        model = build_model("fc:6-8-8-3", dtype=dtype, **{which: value})
    except ValueError as exc:
        assert which in str(exc)
        return
    x = torch.randn(16, 6, dtype=dtype, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(model(x)).all()


@settings(max_examples=15, deadline=None)
@given(eps=st.one_of(st.floats(min_value=0.0, allow_nan=False, allow_infinity=False),
                     st.sampled_from([1e308, 1e200, 1e100, 1e30, 1.0, 1e-300])),
       norm=st.sampled_from(["bn", "bn_nomean", "none"]))
def test_chain_eps_gives_finite_ranks_or_a_named_error(eps, norm):
    from bnlab.rank import run_chain

    try:
        res = run_chain(6, 6, 8, eps=eps, norm=norm, seed=1)
    except (ValueError, FloatingPointError) as exc:
        assert "eps" in str(exc)
        return
    assert np.all(np.isfinite(res.rank_lower_bound)) and np.all(res.rank_lower_bound[:, 1:] >= 1.0)


def test_chain_rank_measures_do_not_underflow_when_eps_dominates():
    """With eps ≫ the variance BN only rescales (by ~1/sqrt(eps) a layer), so the scale-invariant r(H) and
    stable rank must not move with eps.  float64: eps = 1e30 (layers down to ~1e-90, where σ⁴ underflowed
    and r read 0 from layer 6 on; hypothesis found eps = 1.3e21 doing the same at layer 8) against
    eps = 1e12, equal up to the variance/eps terms (≤ 1e-9 relative).  float32 (other draws, so no
    cross-dtype comparison): eps = 1e4 takes layer 8 to ~1e-16, where σ⁴ underflowed (r read 0);
    r(H) ≥ 1 and the stable rank ≥ 1 hold for every non-zero H ((Σλ)² ≥ Σλ², Σλ ≥ λ_max)."""
    from bnlab.rank import run_chain

    a = run_chain(6, 6, 8, eps=1e30, norm="bn", seed=1)
    b = run_chain(6, 6, 8, eps=1e12, norm="bn", seed=1)
    np.testing.assert_allclose(a.rank_lower_bound, b.rank_lower_bound, rtol=1e-9)
    np.testing.assert_allclose(a.stable_rank, b.stable_rank, rtol=1e-9)
    c = run_chain(6, 6, 8, eps=1e4, norm="bn", seed=1, dtype="float32")
    for res in (a, c):
        assert np.all(res.rank_lower_bound >= 1.0 - 1e-6) and np.all(res.stable_rank >= 1.0 - 1e-6)


# deadline: a hang guard (a chain that started would run for its estimated hours), not a timing assert
@settings(max_examples=30, deadline=30_000)
@given(depth=st.integers(1, 10**18), width=st.integers(1, 4096), chains=st.integers(1, 64))
def test_chain_time_estimate_refuses_before_starting(depth, width, chains):
    from bnlab.rank import MAX_CHAIN_SECONDS, chain_seconds, run_chain

    secs = chain_seconds(width, 8, depth, chains)
    assert secs > 0 and math.isfinite(secs)
    if secs <= MAX_CHAIN_SECONDS:
        return
    with pytest.raises(ValueError, match="depth") as info:
        run_chain(width, 8, depth, chains=chains, max_memory_bytes=1 << 40)
    assert "would take about" in str(info.value)
