"""The paper's chains: one step against a dense NumPy reimplementation, the streamed
measurements against a stored-layers reference, the rank results (Thm 2 vs Lemma 3), bad input."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from bnlab.rank import chain_step, default_record_layers, draw_weights, rank_measures, run_chain


def _np_step(h, w, gamma, norm, act, placement):
    relu = lambda z: np.maximum(z, 0.0)  # noqa: E731
    branch = w @ h
    if placement == "post" and act == "relu":
        branch = relu(branch)
    pre = branch if math.isinf(gamma) else h + gamma * branch
    if norm == "bn_nomean":
        out = pre / np.sqrt((pre**2).mean(axis=1, keepdims=True))
    elif norm == "bn":
        c = pre - pre.mean(axis=1, keepdims=True)
        out = c / np.sqrt((c**2).mean(axis=1, keepdims=True))
    else:
        out = pre * np.sqrt(pre.shape[0] * pre.shape[1]) / np.linalg.norm(pre)
    if placement == "pre" and act == "relu":
        out = relu(out)
    return out


@pytest.mark.parametrize("norm", ["bn_nomean", "bn", "none"])
@pytest.mark.parametrize("act,placement", [("linear", "pre"), ("relu", "pre"), ("relu", "post")])
@pytest.mark.parametrize("gamma", [math.inf, 0.3])
def test_chain_step_matches_numpy(norm, act, placement, gamma):
    rng = np.random.default_rng(0)
    h = np.abs(rng.standard_normal((6, 9))) + 0.1 if placement == "post" else rng.standard_normal((6, 9))
    w = rng.standard_normal((6, 6))
    got = chain_step(torch.from_numpy(h), torch.from_numpy(w), residual_gamma=gamma, norm=norm,
                     phi=act, placement=placement).numpy()
    want = _np_step(h, w, gamma, norm, act, placement)
    if not np.all(np.isfinite(want)):
        pytest.skip("a zero ReLU row under BN: covered by test_zero_row_under_bn_raises")
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_bn_chain_keeps_unit_row_norms():
    res_h = chain_step(torch.randn(2, 8, 5, dtype=torch.float64), torch.randn(2, 8, 8, dtype=torch.float64))
    # App. A property (p.1): diag M = 1 after BN_{0,1}.
    torch.testing.assert_close(res_h.pow(2).mean(-1), torch.ones(2, 8, dtype=torch.float64))


def test_uniform_weights_have_unit_variance_and_support():
    gen = torch.Generator().manual_seed(0)
    w = draw_weights((200, 50, 50), "uniform", gen, torch.float64, torch.device("cpu"))
    assert float(w.abs().max()) <= math.sqrt(3)
    # 5e5 draws: the sample variance has standard error sqrt((9/5 − 1)/5e5) ≈ 1.3e-3 (E w⁴ = 9/5); 5σ.
    assert float(w.var()) == pytest.approx(1.0, abs=6.5e-3)


def _reference(width, n, depth, chains, seed, block, tau, **kw):
    """Store every layer (dense), draw the weights exactly as run_chain does, measure per layer."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn((chains, width, n), generator=gen, dtype=torch.float64)
    hs = [h]
    done = 0
    while done < depth:
        b = min(block, depth - done)
        w = draw_weights((b, chains, width, width), kw.get("init", "gaussian"), gen, torch.float64,
                         torch.device("cpu"))
        for j in range(b):
            h = chain_step(h, w[j], residual_gamma=kw.get("residual_gamma", math.inf), norm=kw.get("norm", "bn_nomean"),
                           phi=kw.get("phi", "linear"))
            hs.append(h)
        done += b
    stack = torch.stack(hs)  # (depth+1, chains, d, n)
    scaled = stack * torch.rsqrt(stack.pow(2).sum((-2, -1), keepdim=True) / (width * n))
    m = rank_measures(scaled, tau=tau)
    return m


@pytest.mark.parametrize("kw", [{}, {"norm": "none", "init": "uniform"}, {"norm": "bn", "phi": "relu",
                                                                          "residual_gamma": 0.5}])
def test_streamed_measurements_match_stored_layers(kw):
    depth, block = 37, 8  # blocks of 8 with a partial last block
    res = run_chain(6, 5, depth, chains=3, seed=11, block_size=block, tau=0.5, record_layers=range(depth + 1), **kw)
    ref = _reference(6, 5, depth, 3, 11, block, 0.5, **kw)
    np.testing.assert_array_equal(res.soft_rank, ref.soft_rank.T.numpy())
    np.testing.assert_allclose(res.rank_lower_bound, ref.rank_lower_bound.T.numpy(), rtol=1e-10)
    np.testing.assert_array_equal(res.numerical_rank, ref.numerical_rank.T.numpy())
    np.testing.assert_allclose(res.effective_rank, ref.effective_rank.T.numpy(), rtol=1e-10)
    np.testing.assert_allclose(res.singular_values, ref.singular_values.transpose(0, 1).numpy(), rtol=1e-10,
                               atol=1e-12)
    # running means over layers 1..L (the input excluded)
    np.testing.assert_allclose(res.mean_soft_rank, ref.soft_rank[1:].double().mean(0).numpy(), rtol=1e-12)
    np.testing.assert_allclose(res.mean_rank_lower_bound, ref.rank_lower_bound[1:].mean(0).numpy(), rtol=1e-10)
    np.testing.assert_allclose(res.std_soft_rank, ref.soft_rank[1:].double().std(0, unbiased=False).numpy(),
                               rtol=1e-9, atol=1e-12)
    np.testing.assert_array_equal(res.final_soft_rank, ref.soft_rank[-1].numpy())


def test_subsampled_recording_does_not_change_the_summaries():
    full = run_chain(8, 8, 300, chains=2, seed=3, record_layers=range(301))
    sub = run_chain(8, 8, 300, chains=2, seed=3, record_layers=[0, 7, 300])
    np.testing.assert_array_equal(sub.layers, [0, 7, 300])
    np.testing.assert_array_equal(sub.soft_rank, full.soft_rank[:, [0, 7, 300]])
    np.testing.assert_array_equal(sub.mean_soft_rank, full.mean_soft_rank)


def test_lemma1_holds_along_bn_chains():
    res = run_chain(16, 16, 400, chains=2, seed=5, tau=0.5, record_layers=range(401))
    assert np.all(res.soft_rank >= 0.25 * res.rank_lower_bound - 1e-9)
    assert np.all(res.numerical_rank >= res.rank_lower_bound - 1e-9)


def test_bn_keeps_rank_sqrt_width_while_vanilla_collapses():
    """Thm 2 vs Lemma 3 at d = N = 32, depth 10⁴, seed 0, 2 chains, linear, no skip (γ = ∞).

    Measured (this seed): BN mean rank_½ over layers 1..10⁴ ≈ 7.1 per chain (≥ √32 ≈ 5.66);
    vanilla: rank_½ = 1 at the last layer and a mean ≈ 1.03 (the first few layers are above 1).
    """
    depth = 10_000
    bn = run_chain(32, 32, depth, chains=2, norm="bn_nomean", seed=0)
    assert np.all(bn.mean_soft_rank >= math.sqrt(32))
    vanilla = run_chain(32, 32, depth, chains=2, norm="none", seed=0)
    np.testing.assert_array_equal(vanilla.final_soft_rank, [1.0, 1.0])
    np.testing.assert_array_equal(vanilla.final_numerical_rank, [1.0, 1.0])
    assert np.all(vanilla.mean_soft_rank < 1.1)


@pytest.mark.parametrize("init", ["gaussian", "uniform"])
def test_lemma3_residual_vanilla_products_collapse(init):
    # Eq. 6 with γ = 0.5 and unit-variance weights (Lemma 3 a, b): rank one at depth 2000.
    res = run_chain(16, 16, 2000, chains=2, norm="none", residual_gamma=0.5, init=init, seed=1)
    np.testing.assert_array_equal(res.final_soft_rank, [1.0, 1.0])
    assert np.all(res.final_rank_lower_bound < 1.0 + 1e-6)


@pytest.mark.slow
def test_bn_rank_at_depth_1e5_all_variants():
    # Slow (~1 min): mean rank_½ ≥ √32 for linear BN chains with and without mean subtraction,
    # with and without a residual branch, depth 10⁵, seed 0, 2 chains.
    for norm in ("bn_nomean", "bn"):
        for gamma in (math.inf, 0.1):
            res = run_chain(32, 32, 100_000, chains=2, norm=norm, residual_gamma=gamma, seed=0)
            assert np.all(res.mean_soft_rank >= math.sqrt(32)), (norm, gamma, res.mean_soft_rank)


def test_zero_row_under_bn_raises():
    # Rank-one positive inputs: row i of ReLU(W X) is zero iff w_i·u < 0 (probability 1/2 each);
    # P(no zero row among 32) = 2⁻³², so BN without eps has no scale for some row.
    x = torch.ones(32, 8, dtype=torch.float64)
    with pytest.raises(FloatingPointError, match="layer 1"):
        run_chain(32, 8, 5, inputs=x, phi="relu", placement="post", norm="bn_nomean", seed=0)
    res = run_chain(32, 8, 5, inputs=x, phi="relu", placement="post", norm="bn_nomean", seed=0, eps=1e-5)
    assert np.all(np.isfinite(res.rank_lower_bound))


def test_the_failures_of_a_chain_name_their_cause():
    """Each failure says which option helps: the zero row of BN without eps (eps), an overflow with eps > 0
    (residual_gamma; the message before blamed eps=0 and sent the user to --eps), and one sample under
    mean-subtracting BN, refused before the chain starts (no eps normalizes the zeros it leaves)."""
    x = torch.ones(32, 8, dtype=torch.float64)
    with pytest.raises(FloatingPointError, match="eps=0 a row of zeros has no scale; use eps > 0"):
        run_chain(32, 8, 5, inputs=x, phi="relu", placement="post", norm="bn_nomean", seed=0)
    with pytest.raises(FloatingPointError, match=r"overflow float64 \(residual_gamma=1e\+308.*smaller residual_gamma"):
        run_chain(8, 8, 10, residual_gamma=1e308, eps=1e-5, seed=0)
    with pytest.raises(ValueError, match="batch_size=1 is not allowed with norm='bn'"):
        run_chain(8, 1, 10, norm="bn", eps=1e-5, seed=0)
    res = run_chain(8, 1, 10, norm="bn_nomean", seed=0)  # one sample: BN_{0,1} only rescales it
    assert np.all(res.final_soft_rank == 1)


def test_default_record_layers():
    np.testing.assert_array_equal(default_record_layers(5), np.arange(6))
    big = default_record_layers(10**6)
    assert big[0] == 0 and big[1] == 1 and big[-1] == 10**6 and len(big) <= 202
    assert np.all(np.diff(big) > 0)


def test_float32_and_result_dict():
    res = run_chain(8, 8, 50, chains=2, dtype="float32", seed=0)
    d = res.to_dict()
    for key in ("mean_soft_rank", "mean_r_lower_bound", "final_soft_rank", "per_layer_soft_rank", "layers"):
        assert key in d
    assert len(d["per_layer_soft_rank"]) == len(d["layers"]) == 51
    assert d["config"]["dtype"] == "float32"


@pytest.mark.parametrize(
    "kw,match",
    [
        ({"width": 0}, "width"),
        ({"depth": 0}, "depth"),
        ({"batch_size": 0}, "batch_size"),
        ({"residual_gamma": -1.0}, "residual_gamma"),
        ({"residual_gamma": 0.0}, "residual_gamma"),
        ({"norm": "layer"}, "norm"),
        ({"phi": "tanh"}, "phi"),
        ({"init": "orthogonal"}, "init"),
        ({"tau": 0.0}, "tau"),
        ({"record_layers": [11]}, "record_layers"),
        ({"inputs": torch.ones(3, 3)}, "inputs"),
        ({"inputs": torch.full((4, 4), float("nan"))}, "inputs"),
        ({"dtype": "float16"}, "dtype"),
        ({"device": "tpu"}, "device"),
    ],
)
def test_bad_input(kw, match):
    args = {"width": 4, "batch_size": 4, "depth": 10}
    args.update(kw)
    width, n, depth = args.pop("width"), args.pop("batch_size"), args.pop("depth")
    with pytest.raises(ValueError, match=match):
        run_chain(width, n, depth, **args)


def test_gamma_accepts_inf_spellings():
    a = run_chain(4, 4, 10, residual_gamma="inf", seed=0)
    b = run_chain(4, 4, 10, residual_gamma=math.inf, seed=0)
    np.testing.assert_array_equal(a.soft_rank, b.soft_rank)
    assert a.config["residual_gamma"] == "inf"


def test_measure_every_averages_the_subsampled_layers():
    full = run_chain(8, 8, 103, chains=2, seed=9, record_layers=range(104), block_size=10)
    sub = run_chain(8, 8, 103, chains=2, seed=9, record_layers=[0], block_size=10, measure_every=5)
    # layers 5, 10, ..., 100 (20 layers); the final layer 103 is measured but not in the mean
    np.testing.assert_allclose(sub.mean_soft_rank, full.soft_rank[:, 5:101:5].mean(1), rtol=1e-12)
    np.testing.assert_allclose(sub.mean_rank_lower_bound, full.rank_lower_bound[:, 5:101:5].mean(1), rtol=1e-12)
    np.testing.assert_array_equal(sub.final_soft_rank, full.soft_rank[:, -1])
    with pytest.raises(ValueError, match="measure_every"):
        run_chain(8, 8, 10, measure_every=11)


def test_memory_bound_lowers_the_block_and_rejects_what_cannot_fit():
    # d = N = 8, float64: a layer's block share is (64 + 4·64)·8 = 2560 bytes; a bound of 20 kB
    # leaves blocks of (20000 − 2048)//2560 = 7 layers — same results as the default block size
    # (the weights are drawn per block, so compare a depth inside one block of each: 5 layers)
    a = run_chain(8, 8, 5, seed=2, record_layers=range(6))
    b = run_chain(8, 8, 5, seed=2, record_layers=range(6), max_memory_bytes=20_000)
    np.testing.assert_array_equal(a.soft_rank, b.soft_rank)
    with pytest.raises(ValueError, match="width=100000.*max_memory_bytes"):
        run_chain(100_000, 32, 10)
    with pytest.raises(ValueError, match="record_layers"):
        run_chain(8, 8, 100, record_layers=range(101), max_memory_bytes=10_000)
