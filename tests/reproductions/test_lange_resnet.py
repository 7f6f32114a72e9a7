"""Lange et al. Figs. 6-7 (lange-fig6, lange-fig7): the paper-scale grid holds the paper's settings, the
small scale records why it is not run, the paper cells' code path runs end to end on synthetic 32×32×3
images, and every comparison row can agree, disagree or stay unjudged."""
from __future__ import annotations

import inspect
import json
import math

import pytest
import torch

pytest.importorskip("bnlab.nets")

from bnlab.experiments.registry import list_experiments  # noqa: E402
from bnlab.experiments.spec import Record  # noqa: E402
from bnlab.optim.resnets import train_resnet  # noqa: E402
from bnlab.reproductions import lange_resnet  # noqa: E402
from tests.optim.test_bnp_resnet import synthetic_images  # noqa: E402

EXPS = {e.name: e for e in lange_resnet.EXPERIMENTS}

# The paper's settings, typed from §5 and Appendix B (Table 3 for the learning rates), to check the grid
# against: (panel, method) -> (lr, weight decay, init scale or None when the paper does not state it).
PAPER = {
    ("fig6-cifar10", "bn"): (0.1, 1e-4, None), ("fig6-cifar10", "gn"): (0.1, 1e-4, None),
    ("fig6-cifar10", "bnp"): (0.1, None, None), ("fig6-cifar10", "bnp_gn"): (0.1, 1.5e-4, 0.1),
    ("fig6-cifar100", "bn"): (0.1, 1e-4, None), ("fig6-cifar100", "gn"): (0.1, 1e-4, None),
    ("fig6-cifar100", "bnp"): (0.01, None, None), ("fig6-cifar100", "bnp_gn"): (0.1, 2e-4, 0.4),
    ("fig7", "bn"): (0.1, 1e-4, None), ("fig7", "gn"): (0.1, 1e-4, None), ("fig7", "bnp_gn"): (0.1, 8.5e-4, None),
}


def test_registered():
    names = set(list_experiments())
    assert {"lange-fig6", "lange-fig7"} <= names


@pytest.mark.parametrize("name", sorted(EXPS))
@pytest.mark.parametrize("scale", ["small", "paper"])
def test_grids_are_well_formed(name, scale):
    cells = EXPS[name].grid(scale)
    json.dumps(cells)
    assert len({json.dumps(c, sort_keys=True) for c in cells}) == len(cells)
    params = set(inspect.signature(train_resnet).parameters)
    for c in cells:
        extra = set(c) - params - {"panel", "scale"}
        assert not extra, extra  # every other key is a train_resnet argument
        inspect.signature(train_resnet).bind(**{k: v for k, v in c.items() if k in params})
        lr, wd, init = PAPER[(c["panel"], c["method"])]
        assert c["lr"] == lr and (wd is None or c["weight_decay"] == wd) and (init is None or c["init_scale"] == init)
        assert c["momentum"] == 0.9 and c["augment"] is True
    panels = {c["panel"] for c in cells}
    assert panels == ({"fig7"} if name == "lange-fig7" else {"fig6-cifar10", "fig6-cifar100"})
    methods = {(c["panel"], c["method"]) for c in cells}
    assert methods == {k for k in PAPER if k[0] in panels}
    by_panel = {c["panel"]: c for c in cells}
    if "fig6-cifar10" in by_panel:
        c10, c100 = by_panel["fig6-cifar10"], by_panel["fig6-cifar100"]
        assert (c10["depth"], c10["preact"], c10["dataset"], c10["batch_size"], c10["milestones"]) == (
            110, False, "cifar10", 128, [80, 120])
        assert (c100["depth"], c100["preact"], c100["dataset"], c100["batch_size"], c100["milestones"]) == (
            110, True, "cifar100", 128, [150, 220])
    else:
        c = by_panel["fig7"]
        assert (c["depth"], c["batch_size"], c["milestones"]) == (18, 256, [30, 60, 90])
    seeds = {c["seed"] for c in cells}
    if scale == "small":
        assert all(c["scale"] == "small" for c in cells) and seeds == {0}
    else:
        assert all("scale" not in c for c in cells)
        assert seeds == ({0, 1, 2} if name == "lange-fig7" else {0, 1, 2, 3, 4})  # the paper: 5 runs (Fig. 6)
        for c in cells:
            assert c["epochs"] > c["milestones"][-1]


def test_gn_groups_divide_every_width():
    for name, exp in EXPS.items():
        for c in exp.grid("paper"):
            if "num_groups" in c:
                widths = (16, 32, 64) if c["depth"] == 110 else (64, 128, 256, 512)
                assert all(w % c["num_groups"] == 0 for w in widths)


@pytest.mark.parametrize("name", sorted(EXPS))
def test_settings_checks_limitations_are_declared_and_read_off_the_grid(name):
    exp = EXPS[name]
    assert exp.settings and exp.checks and exp.limitations and exp.uses_gpu
    for s in exp.settings:
        assert s.what and s.paper and s.small and s.paper_scale
    rows = {s.what: s for s in exp.settings}
    for c in exp.grid("paper"):
        p = lange_resnet.PANELS[c["panel"]]
        row = rows[f"[{p['title']}] epochs, decay at"].at("paper")
        assert row.startswith(f"{c['epochs']};") and ", ".join(map(str, c["milestones"])) in row
        assert f"{lange_resnet._LABELS[c['method']]} {c['lr']}" in rows[f"[{p['title']}] learning rate"].at("paper")
        assert rows[f"[{p['title']}] runs"].at("paper") == str(len(p["seeds"]))
    # every comparison row's quantity starts with a declared check's name
    names = [ch.name for ch in exp.checks]
    for row in exp.compare(_stand_in(name)):
        assert any(row.quantity.startswith(n) for n in names), row.quantity


@pytest.mark.parametrize("name", sorted(EXPS))
def test_small_scale_is_skipped_with_the_reason(name):
    exp = EXPS[name]
    for c in exp.grid("small"):
        m = exp.run_cell(c)
        assert m["skipped"] is True
        assert "--scale paper" in m["skip_reason"] and name in m["skip_reason"] and "GPU" in m["skip_reason"]
    assert exp.compare([Record(c, exp.run_cell(c)) for c in exp.grid("small")]) == []


def test_flop_constants_are_measured_ones():
    from torch.utils.flop_counter import FlopCounterMode

    from bnlab.nets import resnet

    for (depth, preact), gflop in lange_resnet.GFLOP_PER_IMAGE.items():
        m = resnet(depth, 10, preact=preact).to("meta")  # shapes only: the count needs no arithmetic
        with FlopCounterMode(display=False) as fc:
            m(torch.randn(1, 3, 32, 32, device="meta")).sum().backward()
        assert fc.get_total_flops() / 1e9 == pytest.approx(gflop, rel=2e-3)  # rounded to 4 digits
    assert lange_resnet.training_flop("fig6-cifar10") == pytest.approx(1.516e9 * 50_000 * 164)


def _shrunk(cell, data, depth=None):
    """A paper cell on synthetic data: 2 epochs of 16 images at mini-batch 8, decay after epoch 1."""
    c = dict(cell, dataset=data, batch_size=8, epochs=2, milestones=[1])
    if depth is not None:
        c["depth"] = depth
    if "warmup_steps" in c:
        c["warmup_steps"] = 1
    return c


def _run_all(depth, keep=lambda cell: True):
    data = (synthetic_images(16, "train", classes=100), synthetic_images(8, "test", seed=1, classes=100))
    out = []
    for name, exp in EXPS.items():
        for cell in exp.grid("paper"):
            if cell["seed"] != 0 or not keep(cell):
                continue
            m = exp.run_cell(_shrunk(cell, data, depth if cell["depth"] == 110 else None))
            assert m["trainable"] and m["steps"] == 4 and [r["epoch"] for r in m["epochs"]] == [1, 2], (cell, m)
            assert all(math.isfinite(r["train_loss"]) for r in m["epochs"]) and not m["diverged"]
            json.dumps(m)
            out.append((name, cell, m))
    return out


@pytest.mark.parametrize("panel", sorted(lange_resnet.PANELS))
def test_paper_cells_run_end_to_end_on_synthetic_images(panel, tmp_path):
    """A panel's paper cells (seed 0) through run_cell, then its plot and table: Fig. 6's every method with
    ResNet-110 cut to 20 layers (same blocks, pre-activation kept); Fig. 7's BNP+GN with ResNet-18 as is
    (its BN and GN cells take Fig. 6's code path with another network, ~3 s each: in the slow test)."""
    results = _run_all(depth=20, keep=lambda c: c["panel"] == panel and (panel != "fig7" or c["method"] == "bnp_gn"))
    (name,) = {n for n, _, _ in results}
    recs = [Record(dict(c, dataset="synthetic"), m) for _, c, m in results]
    paths = EXPS[name].plot(recs, tmp_path)
    assert paths and all(p.stat().st_size > 1000 for p in paths)
    rows = EXPS[name].compare(recs)
    assert len(rows) == len(recs) + (5 if panel != "fig7" else 0)  # Fig. 7's other rows need BN beside BNP+GN
    trains = [r for r in rows if r.quantity.startswith("trains")]
    assert len(trains) == len(recs) and all(r.agrees is True for r in trains)
    assert all(r.agrees is None and "not judged" in r.bnlab for r in rows if r not in trains)  # 2 epochs only


@pytest.mark.slow
def test_paper_cells_run_end_to_end_at_full_depth():
    _run_all(depth=None)


# ----------------------------------------------------------------------------------- comparisons
def _curve(final, pre_level, jump, milestones, epochs):
    """Stand-in accuracy per epoch: pre_level until the first decay, +jump after it, final at the end."""
    m1 = milestones[0]
    acc = {e: pre_level for e in range(1, m1 + 1)}
    acc.update({e: pre_level + jump for e in range(m1 + 1, epochs)})
    acc[epochs] = final
    return [{"epoch": e, "train_loss": 1.0, "test_accuracy": a} for e, a in sorted(acc.items())]


def _stand_in(name, override=None):
    """Records in which every claim holds (override (panel, method) -> (final, pre, jump) to break one)."""
    good = {"bn": (0.93, 0.70, 0.15), "gn": (0.88, 0.60, 0.10), "bnp": (0.85, 0.75, 0.02),
            "bnp_gn": (0.93, 0.75, 0.12)}
    override = override or {}
    recs = []
    for cell in EXPS[name].grid("paper"):
        if cell["seed"] != 0:
            continue
        p = lange_resnet.PANELS[cell["panel"]]
        final, pre, jump = override.get((cell["panel"], cell["method"]), good[cell["method"]])
        key = (cell["panel"], cell["method"])
        if p["final_claim"] == "slightly lower" and cell["method"] == "bnp_gn" and key not in override:
            final = good["bn"][0] - 0.01
        recs.append(Record(cell, {"trainable": True, "diverged": False, "test_accuracy": final,
                                  "epochs": _curve(final, pre, jump, p["milestones"], p["epochs"])}))
    return recs


def test_compare_agrees_on_stand_ins_where_every_claim_holds():
    rows6 = EXPS["lange-fig6"].compare(_stand_in("lange-fig6"))
    rows7 = EXPS["lange-fig7"].compare(_stand_in("lange-fig7"))
    assert len(rows6) == 2 * (4 + 5) and len(rows7) == 3 + 3
    assert all(r.agrees is True for r in rows6 + rows7), [(r.quantity, r.bnlab) for r in rows6 + rows7 if not r.agrees]


@pytest.mark.parametrize("override, broken", [
    ({("fig6-cifar10", "bnp_gn"): (0.93, 0.65, 0.20)}, "pre-decay speed: BNP+GN vs BN (ResNet-110, CIFAR-10"),
    ({("fig6-cifar10", "bnp_gn"): (0.90, 0.75, 0.12)}, "final accuracy: BNP+GN vs BN (ResNet-110, CIFAR-10"),
    ({("fig6-cifar100", "bnp_gn"): (0.95, 0.75, 0.12)}, "final accuracy: BNP+GN vs BN (pre-activation"),
    ({("fig6-cifar10", "gn"): (0.925, 0.60, 0.10)}, "GN behind: BN and BNP+GN vs GN (ResNet-110, CIFAR-10"),
    ({("fig6-cifar100", "bnp"): (0.85, 0.75, 0.20)}, "decay gain: BNP alone vs BN and BNP+GN (pre-activation"),
    ({("fig6-cifar10", "bnp"): (0.85, 0.65, 0.02)}, "pre-decay speed: BNP alone vs BN (ResNet-110, CIFAR-10"),
])
def test_each_check_can_fail(override, broken):
    rows = EXPS["lange-fig6"].compare(_stand_in("lange-fig6", override))
    failed = [r.quantity for r in rows if r.agrees is False]
    assert len(failed) == 1 and failed[0].startswith(broken), failed


def test_a_diverged_run_fails_its_trains_row_and_leaves_the_curves():
    recs = _stand_in("lange-fig6")
    i = next(k for k, r in enumerate(recs) if (r.params["panel"], r.params["method"]) == ("fig6-cifar10", "bnp"))
    recs[i] = Record(recs[i].params, dict(recs[i].metrics, diverged=True))
    rows = EXPS["lange-fig6"].compare(recs)
    failed = [r for r in rows if r.agrees is False]
    assert [r.quantity for r in failed] == ["trains: BNP alone (ResNet-110, CIFAR-10; paper: CIFAR-10)"]
    assert "0 of 1 runs finished, 1 diverged" in failed[0].bnlab
    # with its only run diverged, BNP alone has no curve: its CIFAR-10 comparison rows are not made
    assert not any(r.quantity.startswith(("decay gain", "pre-decay speed: BNP alone")) and "CIFAR-10;" in r.quantity
                   for r in rows)


def test_fig7_final_check_can_fail_and_missing_methods_give_no_row():
    rows = EXPS["lange-fig7"].compare(_stand_in("lange-fig7", {("fig7", "bnp_gn"): (0.80, 0.75, 0.12)}))
    assert [r.quantity.split(":")[0] for r in rows if r.agrees is False] == ["final accuracy", "GN behind"]
    only_bn = [r for r in _stand_in("lange-fig7") if r.params["method"] == "bn"]
    assert [r.quantity.split(":")[0] for r in EXPS["lange-fig7"].compare(only_bn)] == ["trains"]


@pytest.mark.parametrize("panel, method", [("fig6-cifar10", "bnp_gn"), ("fig6-cifar100", "bnp")])
def test_a_paper_cell_loads_cifar_by_name(panel, method, tmp_path, monkeypatch):
    """The paper cells name their data set ("cifar10", "cifar100"): with a small CIFAR fixture in the real
    layout in $BNLAB_DATA (checksums pinned to it), the cell loads it through bnlab.data and trains."""
    import dataclasses

    from bnlab.data import _registry as reg
    from tests.data._cifar_fixture import make_cifar

    cell = next(c for c in EXPS["lange-fig6"].grid("paper")
                if c["panel"] == panel and c["method"] == method and c["seed"] == 0)
    fx = make_cifar(cell["dataset"], per_batch=4)  # 20 training, 4 test images
    fx.write_dir(tmp_path)
    monkeypatch.setitem(reg.CIFAR, fx.name, dataclasses.replace(reg.CIFAR[fx.name], file_md5=fx.md5s()))
    monkeypatch.setenv("BNLAB_DATA", str(tmp_path))
    m = EXPS["lange-fig6"].run_cell(dict(cell, depth=20, batch_size=8, epochs=2, milestones=[1]))
    assert m["trainable"] and m["steps"] == 4 and not m["diverged"], m
    monkeypatch.setenv("BNLAB_DATA", str(tmp_path / "empty"))
    skipped = EXPS["lange-fig6"].run_cell(dict(cell, depth=20, batch_size=8, epochs=2, milestones=[1]))
    assert skipped["skipped"] and "bnlab data download" in skipped["skip_reason"]
