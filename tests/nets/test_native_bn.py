"""The native BN-stack kernel of the ensemble's eager float32 step (bnlab.nets._native_bn).

Checked against two routes: the float64 value of the same float32 inputs (exact to ~2⁻⁵³, so it shows the
kernel's own error, with a bound derived from its float32 operations) and the ATen route it replaces
(``_BatchNormEager``).  Plus the routing (who gets the kernel), the training step it runs in, and the
build: no compiler, a planted or modified library.
"""
from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
import torch

from bnlab.nets import BNMLP, train_ensemble
from bnlab.nets import _native_bn

from ._data import digits

U = 2.0**-24  # float32 unit roundoff

needs_kernel = pytest.mark.skipif(_native_bn.kernel() is None, reason="no C compiler: the kernel cannot be built here")


def _stack(gen, k, groups, b, width=128):
    # columns with a mean of several standard deviations: the centring's cancellation is exercised
    return torch.randn(k, groups, b, width, generator=gen) + 3 * torch.randn(k, groups, 1, width, generator=gen)


def _float64_truth(h, eps, g):
    """out, mean, var, ∂⟨g, out⟩/∂h of the float32 inputs, computed in float64 (autograd)."""
    h64 = h.detach().double().requires_grad_()
    mean = h64.mean(2, keepdim=True)
    var = h64.var(2, unbiased=False, keepdim=True)
    out = (h64 - mean) / torch.sqrt(var + eps.double().view(-1, 1, 1, 1))
    (grad,) = torch.autograd.grad(out, h64, g.double())
    return out.detach(), mean.detach(), var.detach(), grad


@needs_kernel
@pytest.mark.parametrize("groups, b", [(1, 8), (1, 128), (32, 4), (3, 1)])
def test_forward_and_backward_against_float64_and_aten(groups, b, one_thread):
    # Bounds (u = 2⁻²⁴), from the kernel's float32 operations:
    # mean: a float32 sum of b terms in order, then × 1/b: |error| ≤ (b + 1)·u·mean|h| (Higham §4.2);
    # var: the float64 two-pass value rounded once: ≤ u·var;  r = 1/√(var + ε): ≤ 3u relative more;
    # out = (h − mean)·r: ≤ r·err(mean) + 6u·|out| (the subtraction's and product's roundings with r's).
    # backward r·((g − mean g) − x̂·mean(g·x̂)): sums of b terms, ≤ 2(b + 6)·u·T with
    # T = r·(|g| + |mean g| + |x̂|·|mean(g·x̂)|), plus the forward's error in x̂ carried through (same order).
    # Each asserted with a factor 4 of margin; a wrong formula (1/(b−1), a missing centring) is off by O(T/b).
    gen = torch.Generator().manual_seed(groups * 1000 + b)
    k = 5
    h = _stack(gen, k, groups, b).requires_grad_()
    eps = torch.tensor([1e-3, 1e-3, 0.1, 0.0, 1e-2]).view(k, 1, 1)  # per network, as the stack holds it
    g = torch.randn(h.shape, generator=gen)
    assert _native_bn.can_use(h)
    out, mean, var = _native_bn.batch_norm_stack(h, eps)
    (grad,) = torch.autograd.grad(out, h, g)
    assert not mean.requires_grad and not var.requires_grad
    t_out, t_mean, t_var, t_grad = _float64_truth(h, eps, g)
    with torch.no_grad():
        abs_mean = h.abs().mean(2, keepdim=True).double()
        err_mean = (b + 1) * U * abs_mean
        r = 1 / torch.sqrt(t_var + eps.double().view(-1, 1, 1, 1))
        if b > 1:  # with b = 1 the column is its own mean: out = 0 exactly, var = 0
            assert ((mean.double() - t_mean).abs() <= 4 * err_mean).all()
            assert ((var.double() - t_var).abs() <= 4 * U * t_var).all()
            assert ((out.double() - t_out).abs() <= 4 * (r * err_mean + 6 * U * t_out.abs())).all()
            T = r * (g.abs() + g.mean(2, keepdim=True).abs() + t_out.abs() * (g * t_out).mean(2, keepdim=True).abs())
            assert ((grad.double() - t_grad).abs() <= 4 * (2 * (b + 6) * U * T + r * err_mean * T)).all()
        else:  # the column is its own mean: var = 0, and out = 0 where ε > 0 (0·∞ = NaN where ε = 0, as ATen's)
            pos = eps.view(-1) > 0
            assert (var == 0).all() and torch.equal(mean, h.detach())
            assert (out[pos] == 0).all() and (grad[pos] == 0).all() and out[~pos].isnan().all()

    # the ATen route (the same float64 variance, ATen's float32 mean): within the sum of both bounds
    from bnlab.nets.ensemble import _BatchNormEager

    a_out, a_mean, a_var = _BatchNormEager.apply(h, eps.view(k, 1, 1, 1))
    (a_grad,) = torch.autograd.grad(a_out, h, g)
    assert torch.equal(out.isnan(), a_out.isnan()) and torch.equal(grad.isnan(), a_grad.isnan())
    with torch.no_grad():
        assert ((mean - a_mean).abs().double() <= 8 * err_mean).all()
        assert ((var - a_var).abs().double() <= 8 * U * t_var).all()
        fin = ~out.isnan()
        assert ((out - a_out).abs().double() <= 8 * (r * err_mean + 6 * U * t_out.abs()))[fin].all()


@needs_kernel
@pytest.mark.parametrize("affine, phi", [(True, "relu"), (True, None), (False, "relu")])
def test_the_fused_affine_map_and_relu_are_the_operators_after_it(affine, phi):
    # y = φ(γ·x̂ + β) is elementwise: one float32 product and one sum (no contraction: -ffp-contract=off),
    # then max(·, 0) — the same roundings as ATen's γ * x̂ + β and relu after the kernel, so equal floats
    # (no reduction whose order could differ).  The backward masks by y > 0 and scales by γ before the BN
    # backward: the ATen composite's gradient within the BN backward's bound (test above), here with γ in T.
    gen = torch.Generator().manual_seed(7)
    k, b = 4, 8
    h = _stack(gen, k, 2, b).requires_grad_()
    eps = torch.tensor([1e-3, 0.1, 1e-3, 1e-2]).view(k, 1, 1)
    gamma = torch.tensor([0.5, 1.0, 2.0, 1.5]).view(k, 1, 1) if affine else None
    beta = torch.tensor([0.2, 0.0, -0.3, 1.0]).view(k, 1, 1) if affine else None
    g = torch.randn(h.shape, generator=gen)
    y, _, _ = _native_bn.batch_norm_stack(h, eps, gamma, beta, phi=phi)
    (grad,) = torch.autograd.grad(y, h, g)
    xhat, _, _ = _native_bn.batch_norm_stack(h, eps)
    xhat.retain_grad()
    z = xhat * gamma.view(k, 1, 1, 1) + beta.view(k, 1, 1, 1) if affine else xhat
    ref = torch.relu(z) if phi == "relu" else z
    assert torch.equal(y, ref)
    (ref_grad,) = torch.autograd.grad(ref, h, g)
    with torch.no_grad():
        gz = torch.where(ref > 0, g, 0.0) if phi == "relu" else g
        gx = gz * gamma.view(k, 1, 1, 1) if affine else gz
        var = h.double().var(2, unbiased=False, keepdim=True)
        r = 1 / torch.sqrt(var + eps.double().view(-1, 1, 1, 1))
        xd = xhat.double()
        T = r * (gx.abs() + gx.mean(2, keepdim=True).abs() + xd.abs() * (gx * xd).mean(2, keepdim=True).abs())
        assert ((grad - ref_grad).abs().double() <= 4 * 2 * (b + 6) * U * T).all()
        # a wrong mask (y ≥ 0, or the pre-activation's sign without β) or a missing γ is off by O(T)
        assert (grad - ref_grad).abs().max() < 1e-3 * T.max()
    with pytest.raises(ValueError, match="gamma and beta"):
        _native_bn.batch_norm_stack(h, eps, gamma=torch.ones(k), beta=None)


@needs_kernel
def test_bad_input_is_refused_before_the_kernel_reads_it():
    # the kernel reads raw pointers: a wrong length or dtype must be an error naming the argument, never a
    # read past a buffer
    h = torch.zeros(3, 1, 8, 16)
    eps = torch.full((3,), 1e-3)
    cases = [
        (dict(h=h, eps=torch.full((2,), 1e-3)), "eps"),
        (dict(h=h, eps=eps.double()), "eps"),
        (dict(h=h, eps=eps, gamma=torch.ones(4), beta=torch.zeros(4)), "gamma"),
        (dict(h=h, eps=eps, gamma=torch.ones(3), beta=torch.zeros(3, dtype=torch.float64)), "beta"),
        (dict(h=h.double(), eps=eps), "h of"),
        (dict(h=h[:, 0], eps=eps), "h of"),
        (dict(h=torch.zeros(3, 1, 0, 16), eps=eps), "h of"),
        (dict(h=h, eps=eps, phi="tanh"), "phi='tanh'"),
        (dict(h=h, eps=eps, gamma=torch.ones(3, requires_grad=True), beta=torch.zeros(3)), "gamma .*constants"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ValueError, match=match):
            _native_bn.batch_norm_stack(**kwargs)


@needs_kernel
def test_a_non_finite_entry_spoils_its_own_column_only():
    # as the ATen route: a NaN or inf reaches that column's statistics and outputs, and nothing else
    gen = torch.Generator().manual_seed(3)
    h = _stack(gen, 3, 1, 8)
    h[1, 0, 2, 5] = float("nan")
    h[2, 0, 0, 7] = float("inf")
    eps = torch.full((3, 1, 1), 1e-3)
    out, mean, var = _native_bn.batch_norm_stack(h, eps)
    bad = torch.zeros(3, 1, 1, 128, dtype=torch.bool)
    bad[1, 0, 0, 5] = bad[2, 0, 0, 7] = True
    assert torch.equal(~torch.isfinite(out).all(2, keepdim=True), bad)
    assert torch.equal(~torch.isfinite(var), bad)


@needs_kernel
def test_who_gets_the_kernel(monkeypatch):
    h = torch.zeros(2, 1, 8, 16)
    assert _native_bn.can_use(h)
    assert not _native_bn.can_use(h.double())  # float64: the composite (the reference routes)
    assert not _native_bn.can_use(h[:, 0])  # not a (k, groups, b, width) stack
    # under torch.func transforms (the compiled step's differentiation) the composite, which they can see into
    seen = []
    torch.func.grad(lambda t: seen.append(_native_bn.can_use(t)) or t.sum())(h)
    assert seen == [False]
    # large stacks on several threads: ATen's parallel kernels; the serial kernel only on one thread
    big = torch.zeros(1, 1, 8, _native_bn.SERIAL_MAX_ELEMENTS // 8 + 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert not _native_bn.can_use(big) and _native_bn.can_use(h)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert _native_bn.can_use(big)


def _train(models, data):
    train_ensemble(models, data, lr=0.05, batch_size=16, steps=20, seeds=[0, 1, 2], step_mode="eager")
    return [torch.cat([p.detach().flatten() for p in m.parameters()]) for m in models]


@needs_kernel
@pytest.mark.parametrize("phi", ["relu", "tanh"])  # ReLU inside the kernel; tanh after it
def test_the_eager_step_with_the_kernel_matches_the_aten_route(monkeypatch, phi):
    # 20 SGD steps of three float32 BN-MLPs (depths 3, 5, 2; γ, β, ε differ), once with the kernel and once
    # with ATen's operators.  Their gradients differ by float32 rounding (the bound above, ~1e-6 relative);
    # 20 steps through ≤ 5 BN layers amplify that by < 10³ (the float64 tests' Lipschitz bound), so 1e-4
    # relative is a wide margin that a wrong gradient (O(1/b) = 6e-2 here) still fails.
    x, y = digits(np.float32)[0]
    data = (torch.as_tensor(x), y)

    def models():
        return [BNMLP(64, 10, depth=d, width=24, eps=e, gamma=gm, beta=bt, seed=s, phi=phi)
                for d, e, gm, bt, s in [(3, 1e-3, 1.0, 0.0, 0), (5, 0.1, 0.5, 0.2, 1), (2, 1e-3, 1.0, 0.0, 2)]]

    calls = []
    real = _native_bn.batch_norm_stack
    monkeypatch.setattr(_native_bn, "batch_norm_stack", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    native = _train(models(), data)
    assert len(calls) == 20 * 5  # one call per stacked layer and step
    monkeypatch.setattr(_native_bn, "_STATE", {"kernel": None})
    aten = _train(models(), data)
    for a, b in zip(native, aten):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def _fresh_build(monkeypatch, tmp_path, cc=None):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    if cc is not None:
        monkeypatch.setenv("CC", cc)
    monkeypatch.setattr(_native_bn, "_STATE", {})
    return _native_bn.kernel()


def test_without_a_compiler_the_aten_route_runs(monkeypatch, tmp_path):
    with pytest.warns(RuntimeWarning, match="could not build the native BN-stack kernel .*no C compiler"):
        assert _fresh_build(monkeypatch, tmp_path, cc=str(tmp_path / "no-such-cc")) is None
    assert not _native_bn.can_use(torch.zeros(2, 1, 8, 16))
    x, y = digits(np.float32)[0]
    train_ensemble([BNMLP(64, 10, depth=2, width=8, seed=0)], (torch.as_tensor(x), y), lr=0.05, batch_size=16,
                   steps=3, step_mode="eager")


@needs_kernel
def test_a_modified_library_is_rebuilt_not_loaded(monkeypatch, tmp_path):
    lib = _fresh_build(monkeypatch, tmp_path)
    assert lib is not None
    (folder,) = (tmp_path / "ext").iterdir()
    (so,) = folder.glob("*.so")
    with open(so, "ab") as fh:  # a planted change: the manifest's SHA-256 no longer matches
        fh.write(b"\0planted")
    monkeypatch.setattr(_native_bn, "_STATE", {})
    with pytest.warns(RuntimeWarning, match="not as it was built .*SHA-256"):
        again = _native_bn.kernel()
    assert again is not None and b"planted" not in so.read_bytes()
    # a second load of the intact build is silent
    monkeypatch.setattr(_native_bn, "_STATE", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _native_bn.kernel() is not None
    assert oct(os.stat(folder).st_mode & 0o777) == "0o700"


@needs_kernel
def test_two_processes_building_at_once_both_load_it_quietly(tmp_path):
    # a report's two workers reach their first ensemble cell together: one builds under the lock, the other
    # waits (silently: a build of seconds is routine), then loads the checked build
    import subprocess
    import sys

    code = ("import warnings; warnings.simplefilter('error')\n"
            "from bnlab.nets import _native_bn\n"
            "print(_native_bn.kernel() is not None)\n")
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [o[0].strip() for o in outs] == ["True", "True"]
    (folder,) = (tmp_path / "ext").iterdir()
    assert len(list(folder.glob("*.so"))) == 1 and not (folder / "bnlab.lock").exists()
