"""Matrix-free curvature spectra (bnlab.fisher.spectrum) against explicit dense matrices.

The independent route: torch.autograd.functional.jacobian / hessian of a flat-parameter function
(reverse mode, assembled densely), with the BN module handled by hand (train: batch statistics
without running-statistics tracking; eval: running statistics), then numpy eigh.
Tolerance: products in float64 and Lanczos with tol = 1e-12 give eigenvalues accurate to
≈ 1e-12·λmax + O(ε·P·λmax) rounding (P ≤ 300 here): 1e-9 relative leaves a wide margin.
"""
import copy

import numpy as np
import pytest
import torch
from torch.func import functional_call

from bnlab.fisher import build_model, calibrate_batchnorm_, curvature_operator, curvature_spectrum

CURVS = ["fisher", "ggn", "hessian", "empirical_fisher"]


def _small_models():
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Tanh(), torch.nn.Linear(6, 3)
    ).double()
    cnn = torch.nn.Sequential(
        torch.nn.Conv2d(2, 3, 3, stride=2, padding=1),
        torch.nn.BatchNorm2d(3),
        torch.nn.ReLU(),
        torch.nn.Flatten(),
        torch.nn.Linear(3 * 3 * 3, 3),
    ).double()
    for m in (mlp, cnn):
        for mod in m.modules():
            if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm):
                with torch.no_grad():
                    mod.running_mean.normal_()
                    mod.running_var.uniform_(0.5, 2.0)
                    mod.weight.uniform_(0.5, 1.5)
                    mod.bias.normal_()
    return {"mlp": (mlp, torch.randn(8, 4, dtype=torch.float64)), "cnn": (cnn, torch.randn(6, 2, 5, 5, dtype=torch.float64))}


def _dense(model, x, y, mode):
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    ref = copy.deepcopy(model).eval()
    if mode == "train":
        for m in ref.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm):
                m.train()
                m.track_running_stats = False
                m.running_mean = m.running_var = None

    def f(t):
        params = {n: c.reshape(s) for n, c, s in zip(names, t.split(sizes), shapes)}
        return functional_call(ref, params, (x,)).reshape(x.shape[0], -1)

    B = x.shape[0]
    J = torch.autograd.functional.jacobian(lambda t: f(t).reshape(-1), theta)
    C = J.shape[0] // B
    Jb = J.reshape(B, C, -1)
    out = f(theta).detach()
    p = torch.softmax(out, 1)
    grad_out = p - torch.nn.functional.one_hot(y, C).double()
    g = torch.einsum("bo,bop->bp", grad_out, Jb)
    mats = {
        "fisher": J.T @ J / B,
        "ggn": sum(Jb[b].T @ (torch.diag(p[b]) - torch.outer(p[b], p[b])) @ Jb[b] for b in range(B)) / B,
        "hessian": torch.autograd.functional.hessian(lambda t: torch.nn.functional.cross_entropy(f(t), y), theta),
        "empirical_fisher": g.T @ g / B,
    }
    return {k: v.numpy() for k, v in mats.items()}, names, sizes


@pytest.mark.parametrize("which", ["mlp", "cnn"])
@pytest.mark.parametrize("mode", ["train", "eval"])
def test_top_eigenvalues_match_dense_matrices(which, mode):
    model, x = _small_models()[which]
    y = torch.arange(x.shape[0]) % 3
    dense, _, _ = _dense(model, x, y, mode)
    for curv in CURVS:
        ref = np.sort(np.linalg.eigvalsh(dense[curv]))[::-1][:3]
        r = curvature_spectrum(
            model, x, y, curvature=curv, loss="cross_entropy", bn_mode=mode, k=3, tol=1e-12, dtype=torch.float64
        )
        np.testing.assert_allclose(r.eigenvalues, ref, rtol=1e-9, atol=1e-12 * abs(ref[0]), err_msg=curv)
        assert r.curvature == curv and r.bn_mode == mode and r.num_params == dense[curv].shape[0]


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_operator_products_match_dense_matrix_vector_products(mode):
    model, x = _small_models()["mlp"]
    y = torch.arange(x.shape[0]) % 3
    dense, _, _ = _dense(model, x, y, mode)
    v = np.random.default_rng(1).standard_normal(dense["fisher"].shape[0])
    for curv in CURVS:
        op = curvature_operator(model, x, y, curvature=curv, loss="cross_entropy", bn_mode=mode, dtype=torch.float64)
        np.testing.assert_allclose(op.matvec(v), dense[curv] @ v, rtol=1e-10, atol=1e-12)


def test_train_and_eval_mode_differ_and_mse_ggn_is_the_fisher():
    model, x = _small_models()["mlp"]
    t = curvature_spectrum(model, x, bn_mode="train", dtype=torch.float64, tol=1e-12)
    e = curvature_spectrum(model, x, bn_mode="eval", dtype=torch.float64, tol=1e-12)
    assert abs(t.lambda_max - e.lambda_max) > 1e-3 * e.lambda_max  # the running stats are not the batch's
    g = curvature_spectrum(model, x, torch.zeros(8, 3, dtype=torch.float64), curvature="ggn", loss="mse",
                           bn_mode="train", dtype=torch.float64, tol=1e-12)
    assert g.lambda_max == pytest.approx(t.lambda_max, rel=1e-10)


def test_per_module_blocks_match_dense_diagonal_blocks():
    model, x = _small_models()["mlp"]
    y = torch.arange(8) % 3
    dense, names, sizes = _dense(model, x, y, "train")
    r = curvature_spectrum(model, x, bn_mode="train", k=2, tol=1e-12, dtype=torch.float64, blocks="module")
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    groups = {}
    for i, n in enumerate(names):
        groups.setdefault(n.rsplit(".", 1)[0], []).extend(range(offsets[i], offsets[i + 1]))
    assert set(r.blocks) == set(groups)
    for key, idx in groups.items():
        block = dense["fisher"][np.ix_(idx, idx)]
        ref = np.sort(np.linalg.eigvalsh(block))[::-1][:2]
        np.testing.assert_allclose(r.blocks[key], ref, rtol=1e-9, atol=1e-12 * ref[0], err_msg=key)


@pytest.mark.parametrize("mode", ["train", "eval"])
@pytest.mark.parametrize("curv", CURVS)
def test_measuring_never_changes_the_module(mode, curv):
    model = build_model("conv:1x6x6-c4k3s2p1-fc5-fc3", seed=3)  # float32, BN1d and BN2d
    x = torch.randn(10, 1, 6, 6)
    calibrate_batchnorm_(model, x)
    model.train()
    model[0].eval()  # mixed flags must survive too
    before = {k: v.clone() for k, v in model.state_dict().items()}
    flags = [m.training for m in model.modules()]
    grads = [p.grad for p in model.parameters()]
    curvature_spectrum(model, x, torch.arange(10) % 3, curvature=curv, loss="cross_entropy", bn_mode=mode, tol=1e-3)
    after = model.state_dict()
    assert before.keys() == after.keys()
    for k in before:
        assert before[k].dtype == after[k].dtype and torch.equal(before[k], after[k]), k  # bit for bit
    assert [m.training for m in model.modules()] == flags
    assert [p.grad for p in model.parameters()] == grads


def test_bad_input_is_rejected():
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="no parameters"):
        curvature_spectrum(torch.nn.ReLU(), x)
    frozen = torch.nn.Linear(3, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no parameters"):
        curvature_spectrum(frozen, x)
    bn = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 2))
    with pytest.raises(ValueError, match="batch of 1"):
        curvature_spectrum(bn, x[:1], bn_mode="train")
    curvature_spectrum(bn, x[:1], bn_mode="eval")  # eval mode with one sample is fine
    with pytest.raises(ValueError, match="bn_mode"):
        curvature_spectrum(bn, x, bn_mode="test")
    with pytest.raises(ValueError, match="curvature"):
        curvature_spectrum(bn, x, curvature="kfac")
    with pytest.raises(ValueError, match="targets"):
        curvature_spectrum(bn, x, curvature="hessian")
    with pytest.raises(ValueError, match="k="):
        curvature_spectrum(torch.nn.Linear(3, 1), x, k=4)
    with pytest.raises(ValueError, match="targets"):
        curvature_spectrum(bn, x, torch.tensor([0, 1, 2, 5]), curvature="hessian", loss="cross_entropy")
    with pytest.raises(ValueError, match="model"):
        curvature_spectrum("not a module", x)


@pytest.mark.parametrize("curvature,method", [("hessian", "lanczos"), ("hessian", "arpack"), ("fisher", "lanczos"),
                                              ("fisher", "arpack")])
def test_an_overflowing_product_is_a_value_error(curvature, method):
    """float32 inputs of 2e30: the forward pass is finite (the output is within float32's range) but the
    products square it and overflow; a ValueError naming the dtype, not LAPACK's "Eigenvalues did not
    converge" (what advise() passed on before; found by fuzzing advise).  The same data in float64 are
    measured (the check refuses only what is not finite)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 33, bias=False), torch.nn.GELU(), torch.nn.Linear(33, 10))
    x = torch.randn(10, 4) * 2e30
    y = torch.arange(10) % 10
    assert bool(torch.isfinite(model(x)).all())
    kw = dict(curvature=curvature, loss="cross_entropy", method=method, k=1)
    from bnlab.fisher import CurvatureOverflowError  # a ValueError, typed so callers (advise) can retry in float64

    with pytest.raises(CurvatureOverflowError,
                       match=f"{curvature} matrix-vector product is not finite in torch.float32"):
        curvature_spectrum(model, x, y, **kw)
    r = curvature_spectrum(model.double(), x.double(), y, dtype=torch.float64, **kw)
    assert np.isfinite(r.lambda_max) and r.lambda_max > 0


@pytest.mark.parametrize("method", ["lanczos", "arpack"])
def test_a_zero_curvature_has_top_eigenvalue_zero(method):
    """Logits of ~1e30 make the softmax exactly one-hot, so the cross-entropy GGN J^T (diag p − p p^T) J is
    the zero matrix: λ_max = 0 (its dense matrix, the independent route, is exactly zero).  ARPACK
    stopped with "starting vector is zero" there."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 33, bias=False), torch.nn.GELU(), torch.nn.Linear(33, 10)).double()
    x = torch.randn(10, 4, dtype=torch.float64) * 2e30
    y = torch.arange(10) % 10
    op = curvature_operator(model, x, y, curvature="ggn", loss="cross_entropy", dtype=torch.float64)
    assert not np.any(np.column_stack([op.matvec(e) for e in np.eye(op.shape[0])[:20]]))
    r = curvature_spectrum(model, x, y, curvature="ggn", loss="cross_entropy", method=method, k=2,
                           dtype=torch.float64, return_eigenvectors=True)
    assert list(r.eigenvalues) == [0.0, 0.0] and r.eigenvectors.shape == (op.shape[0], 2)


def test_lanczos_goes_on_past_an_invariant_subspace_of_a_low_rank_curvature():
    """The Fisher of Linear(20, 1) on one sample is rank one, (x̃ x̃ᵀ) with x̃ = (x, 1): its top three
    eigenvalues are ‖x̃‖², 0, 0 (closed form).  Lanczos' Krylov space is invariant after one step; it
    went on to a converged answer only for k = 1 (k = 3 raised "did not reach tol")."""
    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1).double()
    x = torch.randn(1, 20, dtype=torch.float64)
    want = float((x * x).sum()) + 1.0
    for method in ("lanczos", "arpack"):
        r = curvature_spectrum(model, x, k=3, method=method, tol=1e-10, dtype=torch.float64)
        np.testing.assert_allclose(r.eigenvalues, [want, 0.0, 0.0], rtol=0, atol=1e-10 * want)


def test_result_to_dict():
    import json

    r = curvature_spectrum(torch.nn.Linear(3, 2), torch.randn(5, 3), k=2)
    d = r.to_dict()
    json.dumps(d)
    assert d["lambda_max"] == d["eigenvalues"][0] >= d["eigenvalues"][1]


@pytest.mark.parametrize("method", ["lanczos", "arpack"])
def test_lanczos_and_arpack_agree_with_dense_and_return_eigenvectors(method):
    model, x = _small_models()["cnn"]
    y = torch.arange(x.shape[0]) % 3
    dense, _, _ = _dense(model, x, y, "train")
    w, v = np.linalg.eigh(dense["hessian"])
    for k in (1, 2):
        r = curvature_spectrum(model, x, y, curvature="hessian", loss="cross_entropy", bn_mode="train", k=k,
                               tol=1e-12, dtype=torch.float64, method=method, return_eigenvectors=True)
        np.testing.assert_allclose(r.eigenvalues, w[::-1][:k], rtol=1e-9)
        # eigenvector of the (simple) top eigenvalue, up to sign: |cos| = 1 within 1e-6
        assert abs(float(r.eigenvectors[:, 0] @ v[:, -1])) == pytest.approx(1.0, abs=1e-6)
        assert r.method == method


def test_lanczos_reports_non_convergence():
    model, x = _small_models()["mlp"]
    from bnlab.fisher import LanczosNotConvergedError  # a RuntimeError, typed so callers can tell it from others

    with pytest.raises(LanczosNotConvergedError, match="did not reach"):
        curvature_spectrum(model, x, bn_mode="train", tol=1e-14, maxiter=3, method="lanczos", dtype=torch.float64)


def test_change_stopping_rule_is_accepted_and_close():
    model, x = _small_models()["mlp"]
    ref = curvature_spectrum(model, x, bn_mode="train", tol=1e-12, dtype=torch.float64)
    r = curvature_spectrum(model, x, bn_mode="train", tol=1e-6, dtype=torch.float64, stop="change", method="lanczos")
    # a Ritz value that moved by < 1e-6·λ in one step is, for this well-separated top eigenvalue, within 1e-4
    assert r.lambda_max == pytest.approx(ref.lambda_max, rel=1e-4)
    with pytest.raises(ValueError, match="stop"):
        curvature_spectrum(model, x, stop="never")


def test_gap_stopping_rule_is_accurate_and_never_slower_than_the_residual_rule():
    model, x = _small_models()["mlp"]
    ref = curvature_spectrum(model, x, bn_mode="train", tol=1e-12, dtype=torch.float64)
    res = curvature_spectrum(model, x, bn_mode="train", tol=1e-6, dtype=torch.float64)
    gap = curvature_spectrum(model, x, bn_mode="train", tol=1e-6, dtype=torch.float64, stop="gap")
    # the gap estimate min(r, r²/δ) ≤ r, so it stops no later than the residual rule
    assert gap.matvecs <= res.matvecs
    # Kato–Temple: error ≤ r²/δ_true; δ is estimated from Ritz values (≥ the true gap only once the
    # second eigenvalue is resolved), so allow a factor 10 over the target 1e-6 relative
    assert abs(gap.lambda_max - ref.lambda_max) <= 1e-5 * ref.lambda_max


def test_maxiter_stop_runs_exactly_that_many_products_with_monotone_ritz_values():
    model, x = _small_models()["mlp"]
    ref = curvature_spectrum(model, x, bn_mode="train", tol=1e-12, dtype=torch.float64).lambda_max
    vals = []
    for n in (1, 2, 4, 8):
        r = curvature_spectrum(model, x, bn_mode="train", dtype=torch.float64, stop="maxiter", maxiter=n)
        assert r.matvecs == n
        vals.append(r.lambda_max)
    # the top Ritz value of a growing Krylov space never decreases and never exceeds λmax (Cauchy
    # interlacing; 1e-12 for float64 rounding)
    assert all(b >= a - 1e-12 * ref for a, b in zip(vals, vals[1:]))
    # the run of 8 records its Ritz value after every product: the 1-, 2- and 4-step runs' values
    # (same start vector; float64, so equal to rounding)
    hist = r.ritz_history
    assert len(hist) == 8 and hist[-1] == vals[-1]
    assert [hist[0], hist[1], hist[3]] == pytest.approx(vals[:3], rel=1e-12)
    assert vals[-1] <= ref * (1 + 1e-12)
    assert vals[0] < vals[-1]
    with pytest.raises(ValueError, match="maxiter"):
        curvature_spectrum(model, x, stop="maxiter")


def test_float32_three_term_recurrence_matches_float64():
    # k = 1 keeps the Lanczos vectors in the products' dtype (float32 here; inner products by BLAS
    # dot in float32). Both errors are of float32 rounding: ≈ 1e-7 per operation, amplified
    # by the ~10 steps and the product's own ≈ 1e-6 relative error — 1e-4 relative is a wide margin,
    # while a wrong recurrence in float32 (e.g. a lost β term) is off by O(1).
    torch.manual_seed(1)
    model = build_model("fc:30-64-64-5", seed=3)
    x = torch.randn(64, 30)
    r32 = curvature_spectrum(model, x, bn_mode="train", tol=1e-5)
    r64 = curvature_spectrum(model, x, bn_mode="train", tol=1e-10, dtype=torch.float64)
    assert r32.dtype == "float32"
    assert r32.lambda_max == pytest.approx(r64.lambda_max, rel=1e-4)


@pytest.mark.parametrize("start", ["random", "gradient"])
def test_hessian_start_vectors_agree_with_dense(start):
    # both starts (random is the default) against the dense Hessian's eigh:
    # float64 products and residual ≤ 1e-12·λ bound the error by 1e-12·λ plus rounding; 1e-9 leaves margin
    model, x = _small_models()["cnn"]
    y = torch.arange(x.shape[0]) % 3
    dense, _, _ = _dense(model, x, y, "train")
    lam = np.linalg.eigvalsh(dense["hessian"])[-1]
    r = curvature_spectrum(model, x, y, curvature="hessian", loss="cross_entropy", bn_mode="train",
                           tol=1e-12, dtype=torch.float64, start=start, method="lanczos")
    assert r.lambda_max == pytest.approx(lam, rel=1e-9)
    # the seed still matters with the gradient start (its random part): two seeds, two Ritz histories
    a = curvature_spectrum(model, x, y, curvature="hessian", loss="cross_entropy", bn_mode="train",
                           dtype=torch.float64, start=start, stop="maxiter", maxiter=3, seed=0)
    b = curvature_spectrum(model, x, y, curvature="hessian", loss="cross_entropy", bn_mode="train",
                           dtype=torch.float64, start=start, stop="maxiter", maxiter=3, seed=1)
    assert a.ritz_history[0] != b.ritz_history[0]


def test_gradient_start_is_rejected_for_other_curvatures():
    model, x = _small_models()["mlp"]
    with pytest.raises(ValueError, match="start='gradient'"):
        curvature_spectrum(model, x, start="gradient")
    with pytest.raises(ValueError, match="start"):
        curvature_spectrum(model, x, start="ones")


def _bnlab_batch_stat_models():
    """bnlab's own batch-statistics layers (not nn.BatchNorm): the BN-MLP and the MLP with ghost BN, BN without
    mean and Batch Renorm, float64, running statistics away from the batch's (so eval mode would differ)."""
    from bnlab.nets import BNMLP, MLP

    out = {"bnmlp": BNMLP(4, 3, depth=2, width=5, eps=1e-3, dtype=torch.float64, seed=1)}
    for norm, kw in (("ghost_bn", {"ghost_batch_size": 4}), ("bn_nomean", {}), ("brn", {"r_max": 1.5, "d_max": 0.5})):
        out[norm] = MLP(4, [5, 5], 3, norm=norm, norm_kwargs=kw, phi="tanh", dtype=torch.float64, seed=2)
    for model in out.values():
        for name, buf in model.named_buffers():
            if "running" in name:
                with torch.no_grad():
                    buf.uniform_(0.5, 2.0)
    return out


@pytest.mark.parametrize("which", ["bnmlp", "ghost_bn", "bn_nomean", "brn"])
def test_bnlab_batch_statistics_layers_are_measured_in_train_mode(which):
    # bnlab's layers update their running statistics in place in train mode; the operator must still measure
    # them with the batch's statistics (before this fix BNMLP was silently measured in eval mode).  Dense route:
    # torch.autograd.functional.hessian of a fresh train-mode copy per call (its in-place buffer updates then
    # touch only that copy); tolerance as in the module docstring.
    model = _bnlab_batch_stat_models()[which]
    x = torch.randn(8, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    y = torch.arange(8) % 3
    names = [n for n, _ in model.named_parameters()]
    shapes = [p.shape for p in model.parameters()]
    sizes = [p.numel() for p in model.parameters()]
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    def loss(t):
        ref = copy.deepcopy(model).train()
        params = {n: c.reshape(s) for n, c, s in zip(names, t.split(sizes), shapes)}
        return torch.nn.functional.cross_entropy(functional_call(ref, params, (x,)), y)

    dense = torch.autograd.functional.hessian(loss, theta).numpy()
    ref_top = np.sort(np.linalg.eigvalsh(dense))[::-1][:2]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    r = curvature_spectrum(model, x, y, curvature="hessian", loss="cross_entropy", bn_mode="train", k=2, tol=1e-12)
    np.testing.assert_allclose(r.eigenvalues, ref_top, rtol=1e-9, atol=1e-12 * abs(ref_top[0]))
    e = curvature_spectrum(model, x, y, curvature="hessian", loss="cross_entropy", bn_mode="eval", tol=1e-12)
    assert abs(e.lambda_max - ref_top[0]) > 1e-3 * abs(ref_top[0])  # eval mode (running statistics) differs
    v = np.random.default_rng(0).standard_normal(theta.numel())
    op = curvature_operator(model, x, y, curvature="ggn", loss="cross_entropy", bn_mode="train")
    op.matvec(v)
    op.matvec(v)  # repeated products see the same buffers (fresh copies per call)
    assert all(torch.equal(before[k], model.state_dict()[k]) for k in before)  # the module is untouched
