"""The rate fit recovers known rates and its bootstrap CI has roughly its nominal coverage."""
import numpy as np
import pytest

from bnlab.sim import fit_geometric_rate


def test_exact_geometric_data_gives_exact_rate():
    layers = np.arange(1, 21)
    values = np.outer(np.linspace(1, 2, 5), 1.3 ** (-layers))
    fit = fit_geometric_rate(values, 3, 18, invert=True)
    assert fit.rate == pytest.approx(1.3, rel=1e-12)
    assert fit.ci_low == pytest.approx(1.3, rel=1e-12) and fit.ci_high == pytest.approx(1.3, rel=1e-12)


def test_bootstrap_ci_coverage():
    # 200 synthetic ensembles of 40 networks with lognormal noise (sd 0.3) around 1.5^-l.
    # A 90 % interval covers the truth in ~90 % of them; the binomial sd of the coverage over
    # 200 trials is 2.1 %, and the percentile bootstrap undercovers slightly at n = 40:
    # accept [0.80, 0.97] (≈ 4.5 sd below, 3.3 above).
    rng = np.random.default_rng(0)
    layers = np.arange(1, 16)
    hits = 0
    for t in range(200):
        noise = np.exp(0.3 * rng.standard_normal((40, layers.size)) - 0.045)  # E[noise] = 1
        fit = fit_geometric_rate(1.5 ** (-layers) * noise, 1, 15, invert=True, confidence=0.9, n_boot=400, seed=t)
        hits += fit.ci_low <= 1.5 <= fit.ci_high
    assert 0.80 <= hits / 200 <= 0.97


@pytest.mark.parametrize(
    "kw,name",
    [(dict(first_layer=0), "first_layer"), (dict(last_layer=3), "last_layer"), (dict(confidence=1.0), "confidence"),
     (dict(n_boot=0), "n_boot")],
)
def test_bad_arguments(kw, name):
    args = dict(first_layer=3, last_layer=8)
    args.update(kw)
    with pytest.raises(ValueError, match=name):
        fit_geometric_rate(np.ones((4, 10)), **args)


def test_nonpositive_mean_is_rejected():
    v = np.ones((4, 10))
    v[:, 5] = -1
    with pytest.raises(ValueError, match="not positive"):
        fit_geometric_rate(v, 2, 8)
