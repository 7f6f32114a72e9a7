"""One vocabulary in the Python API (bnlab._vocabulary): each old keyword or value works for one release with a
DeprecationWarning naming the new spelling, gives the same result as the new one, and the new one is silent."""
import warnings

import numpy as np
import pytest
import torch

from bnlab._vocabulary import INIT_ALIASES, KEYWORD_ALIASES, NORM_ALIASES


def _silent(fn):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return fn()


def _deprecated(fn, *needles):
    with pytest.warns(DeprecationWarning) as record:
        out = fn()
    text = " | ".join(str(w.message) for w in record)
    for needle in needles:
        assert needle in text, text
    assert all(w.filename == __file__ for w in record), [w.filename for w in record]  # points at the caller
    return out


def test_the_tables_map_to_canonical_names():
    from bnlab import nets, sim

    assert set(NORM_ALIASES.values()) <= set(nets.NORMALIZATIONS) and not set(NORM_ALIASES) & set(nets.NORMALIZATIONS)
    assert set(INIT_ALIASES.values()) <= set(nets.INITS) & set(sim.INITS)
    assert KEYWORD_ALIASES == {"activation": "phi", "normalization": "norm"}


def test_simulate_normalization_keyword_and_values():
    from bnlab.sim import simulate

    kw = dict(seed=1, dtype="float64", num_batches=2)
    new = _silent(lambda: simulate("relu", 4, 16, 3, 2, norm="bn", **kw))
    old = _deprecated(lambda: simulate("relu", 4, 16, 3, 2, normalization="batch", **kw),
                      "simulate(normalization=...) is deprecated; use norm=...", "norm='batch' is deprecated; use norm='bn'")
    np.testing.assert_array_equal(old.q, new.q)  # the same seeded networks: the same numbers
    assert old.config["norm"] == new.config["norm"] == "bn"
    nomean = _deprecated(lambda: simulate("relu", 4, 16, 3, 2, norm="batch_no_mean", **kw), "use norm='bn_nomean'")
    np.testing.assert_array_equal(nomean.q, simulate("relu", 4, 16, 3, 2, norm="bn_nomean", **kw).q)
    with pytest.raises(TypeError, match="both 'norm' and its deprecated spelling 'normalization'"):
        simulate("relu", 4, 16, 3, 2, norm="bn", normalization="bn")
    with pytest.raises(ValueError, match="norm='layer' is not allowed"):
        simulate("relu", 4, 16, 3, 2, norm="layer")


def test_compare_reads_configs_recorded_before_the_vocabulary():
    from bnlab.compare import compare_with_theory
    from bnlab.sim import simulate

    res = simulate("relu", 4, 32, 4, 2, seed=0, num_batches=2)
    res.config.pop("norm")
    res.config["normalization"] = "batch"  # as a result recorded by an earlier release
    comp = _silent(lambda: compare_with_theory(res, phi="relu"))
    assert comp["grad_explosion_rate"].theory is not None


def test_rank_activation_keyword_and_norm_values():
    from bnlab.rank import chain_step, run_chain

    new = _silent(lambda: run_chain(8, 8, 4, phi="relu", norm="bn_nomean", seed=2))
    old = _deprecated(lambda: run_chain(8, 8, 4, activation="relu", norm="bn-nomean", seed=2),
                      "run_chain(activation=...) is deprecated; use phi=...", "norm='bn-nomean'")
    assert old.to_dict() == new.to_dict() and new.config["phi"] == "relu"
    h, w = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 4, dtype=torch.float64)
    a = _deprecated(lambda: chain_step(h, w, activation="relu", norm="batch"), "chain_step(activation=...)",
                    "norm='batch'")
    torch.testing.assert_close(a, chain_step(h, w, phi="relu", norm="bn"), rtol=0, atol=0)


def test_nets_init_and_norm_values():
    from bnlab import nets

    def draw(scheme):
        lin = torch.nn.Linear(20, 30)
        nets.init_weights_(lin, scheme, generator=5)
        return lin.weight.detach().clone()

    new = _silent(lambda: draw("asymmetric_uniform"))
    old = _deprecated(lambda: draw("asym_uniform"), "scheme='asym_uniform' is deprecated; use scheme='asymmetric_uniform'")
    torch.testing.assert_close(old, new, rtol=0, atol=0)
    mlp_old = _deprecated(lambda: nets.MLP(4, [6], 2, init="asym_uniform", norm="none", seed=3), "init='asym_uniform'")
    mlp_new = _silent(lambda: nets.MLP(4, [6], 2, init="asymmetric_uniform", norm="none", seed=3))
    for a, b in zip(mlp_old.parameters(), mlp_new.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert type(_deprecated(lambda: nets.make_norm("batch", 5), "name='batch'")) is type(nets.make_norm("bn", 5))
    assert type(_deprecated(lambda: nets.make_norm("bn-nomean", 5), "name='bn-nomean'")) is type(
        nets.make_norm("bn_nomean", 5))


def test_sim_init_values():
    from bnlab.sim import init_weights

    g = lambda: torch.Generator().manual_seed(0)  # noqa: E731
    new = _silent(lambda: init_weights("asymmetric_uniform", 2, 5, 3, generator=g()))
    old = _deprecated(lambda: init_weights("asym_uniform", 2, 5, 3, generator=g()), "init='asym_uniform'")
    torch.testing.assert_close(old, new, rtol=0, atol=0)


def test_training_and_fisher_norm_values():
    from bnlab.fisher import fisher_order_parameters, parse_arch
    from bnlab.optim.training import default_learning_rate

    assert _deprecated(lambda: default_learning_rate("fc", "batch", 60), "norm='batch'") == default_learning_rate(
        "fc", "bn", 60)
    arch = parse_arch("fc:8-6-3")
    old = _deprecated(lambda: fisher_order_parameters(arch, norm="batch"), "norm='batch'")
    assert old.lambda_max_bound == fisher_order_parameters(arch, norm="bn").lambda_max_bound
