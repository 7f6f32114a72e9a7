"""1/width convergence reproduction: cells, the log–log slope fit, plot, comparisons."""
from __future__ import annotations

import json

import numpy as np
import pytest

from bnlab.reproductions import yang2019_width as ww
from bnlab.experiments.spec import Record

EXP = ww.EXPERIMENTS[0]


def test_loglog_slope_recovers_power_law():
    w = np.array([64, 128, 256, 512])
    slope, se = ww.fit_loglog_slope(w, 3.0 / w)
    assert slope == pytest.approx(-1.0, abs=1e-12) and se < 1e-12
    slope, se = ww.fit_loglog_slope(w, 3.0 / w * np.array([1.1, 0.9, 1.05, 0.95]))
    assert abs(slope + 1) < 3 * se + 0.1
    with pytest.raises(ValueError):
        ww.fit_loglog_slope([1, 2], [1, 2])


@pytest.mark.parametrize("scale", ["small", "paper"])
def test_grid(scale):
    cells = EXP.grid(scale)
    json.dumps(cells)
    widths = [c["width"] for c in cells]
    assert widths == sorted(widths) and len(widths) >= 4


def test_cells_bias_shrinks_with_width(tmp_path):
    # Two widths a factor 4 apart: a 1/N bias shrinks 4x.  Measured (400 networks, both weight
    # samplings): the off-diagonal bias of Σ^L is −0.0081 ± 0.0006 at N = 32 and −0.0020 ± 0.0003
    # at N = 128; with 4N networks per width its Monte Carlo error is ≈ 10–15 % of the bias at
    # both widths.  λ_G (tanh, 256 networks): bias 0.021–0.042 at N = 32, 0.0066–0.0096 at
    # N = 128 (CI half-width there ≈ 0.0035).  Over six seeds (this one included) the shrink
    # factors were 2.7–3.4 (Σ^L) and 3.1–4.5 (λ_G), so a factor > 2 holds unless the 1/N law
    # fails.  (With 8 or 64 tanh networks λ_G's factor fell to 0.45 and 1.1 for some seeds.)
    recs = []
    for w in (32, 128):
        p = dict(batch_size=16, width=w, depth=14, relu_networks=4 * w, tanh_networks=256, seed=w)
        m = ww.run_cell(p)
        json.dumps(m)
        recs.append(Record(p, m))
    a, b = recs[0].metrics, recs[1].metrics
    assert a["sigma_bias"] > 2 * b["sigma_bias"]
    if a["grad_rate_bias"] is not None:
        assert abs(a["grad_rate_bias"]) > 2 * abs(b["grad_rate_bias"])
    # the mean field limit the cells compare to: Thm 3.5 for relu
    assert a["q_star"] == pytest.approx(0.5) and a["c_star"] == pytest.approx(0.2866, abs=1e-3)
    paths = EXP.plot(recs + [Record(dict(recs[1].params, width=256), b)], tmp_path)
    assert all(p.exists() for p in paths)


@pytest.mark.slow
def test_small_scale_all_rows_agree(tmp_path):
    from tests.reproductions._small import small_scale_rows

    rows = small_scale_rows(EXP, tmp_path)
    assert rows and all(r.agrees is not False for r in rows), rows
