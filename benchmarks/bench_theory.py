"""Theory engine benchmark: ``analyze`` against direct Monte Carlo of the same quantities, and scaling in B.

Run:  python benchmarks/bench_theory.py [--quick] [--case LABEL ...]
      (``--case tanh``: only that case, both sides, and its ratio; no scaling record)

1. ``analyze(φ, 32)`` (method="auto": BSB1/BSB2 verdict, fixed point q*, c*, forward λ_L↑, λ_M↑,
   backward λ_G↓, λ_L↓, λ_M↓, cross-batch c_CB*, λ_M̃) for a smooth φ (tanh) and kinked ones:
   relu(x + 1) (kink at −1), selu (non-homogeneous, kink at 0), relu^0.6 (positive-homogeneous,
   φ' singular at its kink) and the expression relu(x − 0.3) + 0.1x (traced kink; BSB2 at B = 32,
   so also shown at B = 8).  Timed cold: every quadrature cache is cleared before each call (no
   credit for nodes or moments kept from an earlier call); median CPU time of repeated calls (both
   sides are single-threaded; the machine is shared, so wall time is printed beside it).
2. The same quantities by direct Monte Carlo of the batchnorm network's map, to 1e-3
   (:func:`direct_montecarlo`): batches h ~ N(0, Σ*) at the theory's fixed point, B_φ(h) =
   φ(√B Gh/‖Gh‖) and its Jacobian J (float64, one thread) — by torch autograd (``vmap(jacrev)``, what
   one writes for a network) and, as the strongest baseline we have, by its closed form — and per
   sample exact traces giving unbiased statistics of every quantity (below; tested against analyze
   in tests/theory/test_bench_theory.py).  The standard error of each mean over a pilot run
   of n₀ samples gives the samples for a standard error of 1e-3 relative (1e-3 absolute for the
   correlations c* and c_CB*, which can be 0), N = n₀ (se/target)²; the cost is the measured
   per-sample time (warm: one untimed chunk first, so compilation and allocation are not counted)
   times the N of the worst quantity — one run that gets every quantity to 1e-3.  Per-sample time: the
   median over chunks of 1000 samples of the CPU time (see ``cpu_time``).
3. For the record, the reduced Monte Carlo of bnlab's own routes (samples of the sphere, the brackets
   of the reduced integrals; not the network) to 1e-3, and the scaling in B.

Prints timings and ratios; asserts nothing (performance claims live here, not in tests).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time
from pathlib import Path

# Both sides single-threaded, before NumPy loads its BLAS: a multi-threaded BLAS on a shared machine spins its
# idle threads, and process CPU time charges that spinning to whichever side happened to call it (it made
# analyze(tanh) read 14 ms of CPU instead of 4 on a loaded 2-core machine).  torch gets set_num_threads(1) below.
for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import cpu_time, median_time  # noqa: E402

#: (label, get_activation arguments, B)
CASES = [
    ("tanh", dict(phi="tanh"), 32),
    ("relu(x+1)", dict(phi="relu", beta=1.0), 32),
    ("selu", dict(phi="selu"), 32),
    ("relu^0.6", dict(phi="alpha_relu", alpha=0.6), 32),
    ("relu(x-0.3)+0.1x", dict(phi="relu(x - 0.3) + 0.1*x"), 32),
    ("relu(x-0.3)+0.1x", dict(phi="relu(x - 0.3) + 0.1*x"), 8),
]
TARGET = 1e-3


def _clear_caches():
    # no credit for cached quadrature nodes or moments: every call pays for its rules (what stays cached is
    # only the rules on (0, 1) themselves, tanh-sinh and Gauss–Legendre: tables of constants, no φ and no B in them)
    from bnlab.theory._quadrature.sphere import cartesian_sphere_grid, sphere_grid
    from bnlab.theory._sphere_route import _forward_moments_sphere

    sphere_grid.cache_clear()
    cartesian_sphere_grid.cache_clear()
    _forward_moments_sphere.cache_clear()


def time_analyze(act, b, repeat):
    from bnlab.theory import analyze

    def cold():
        _clear_caches()
        return analyze(act, b)

    # warm-up: imports (the caches are cleared in every call)
    return cpu_time(cold, repeat), median_time(cold, repeat, warmup=True), analyze(act, b)


def direct_montecarlo(act, b, res, n0, seed=0, chunk=2000, jacobian="autograd"):
    """Direct Monte Carlo of every quantity of ``res`` (a BSB1 :class:`~bnlab.theory.TheoryResult`).

    h ~ N(0, Σ*), Σ* = q*((1 − c*)I + c*11ᵀ) from ``res``; y = B_φ(h), J = ∂y/∂h — by torch autograd
    (``jacobian="autograd"``: ``vmap(jacrev)``, what one writes for a network) or by its closed form
    (``"analytic"``: J = √B/‖Gh‖ · diag φ'(√B u) (G − uuᵀ), u = Gh/‖Gh‖, φ' by autograd; the fastest direct
    route we know, checked against autograd to 1e-15).  Gv = v − mean(v), μ* = q*(1 − c*).  Per-sample
    statistics whose means are (Yang et al. 2019), all exact traces (no random directions):

    * q* = E‖y‖²/B and ν* = q*c* = E(Σ_{i≠j} y_i y_j)/(B(B−1)) (the fixed point, V(Σ*) = Σ*): c* = ν*/q*;
    * backward (Thm 3.9, App. G): Π ↦ E[Jᵀ Π J] on H^G; with A = G Jᵀ G, the traces of X ↦ A X Aᵀ over RG, L,
      M (‖A‖²_F/(B−1); (Σ A_ii² − ‖A‖²_F/B)/(1 − 2/B); ½(tr²A + tr A²) minus the two), divided by the
      dimensions 1, B − 1, B(B − 3)/2: λ_G↓, λ_L↓, λ_M↓;
    * forward (§3.1.1): the derivative of V at Σ* in a direction Δ ∈ H^G is E[dy yᵀ + y dyᵀ] with
      dy = J Δ Gh/(2μ*) (pathwise derivative of h = Σ^{1/2}z; Σ*^{1/2} = √μ* on the sum-zero plane), so
      ⟨Δ, G dV[Δ] G⟩ = bᵀ Δ K Δ h_W with b = Gy, K = GJ/μ*, h_W = Gh; summed over orthonormal bases
      (Σ_k Δ_k K Δ_k = ½(GKᵀG + tr(GKG) G) on H^G, GKG/(B−1) on RG, G((GKG)∘G)G/(1 − 2/B) on L):
      tr_H = ½(bᵀKᵀh_W + tr(K) bᵀh_W), tr_G = bᵀKh_W/(B−1), tr_L = bᵀ((GKG)∘G)h_W/(1 − 2/B),
      tr_M = tr_H − tr_G − tr_L; λ_L↑ = E tr_L/(B−1), λ_M↑ = E tr_M/(B(B−3)/2);
    * cross-batch (Thm 3.11, App. H): two independent batches at the CBSB1 point decorrelate as A = E J =
      p G, p = E tr(G J G)/(B − 1), λ_M̃ = p²; c_CB* = (E ȳ)² with ȳ the batch mean of y.

    Returns (rows, seconds per sample): rows = [(name, estimate, standard error, theory, target se)].
    """
    import numpy as np
    import torch
    from torch.func import jacrev, vmap

    torch.set_num_threads(1)
    q, c = res.q_star, res.c_star
    mu = q * (1.0 - c)
    sigma = q * ((1.0 - c) * np.eye(b) + c * np.ones((b, b)))
    chol = torch.tensor(np.linalg.cholesky(sigma))
    sb = math.sqrt(b)
    gen = torch.Generator().manual_seed(seed)
    dim_l, dim_m = b - 1.0, b * (b - 3) / 2.0
    g_mat = torch.eye(b, dtype=torch.float64) - 1.0 / b

    def bphi(h):
        gh = h - h.mean()
        return act.torch(sb * gh / torch.linalg.norm(gh))

    autograd_jac = vmap(jacrev(bphi))

    def analytic_jac(h):
        gh = h - h.mean(dim=1, keepdim=True)
        r = torch.linalg.norm(gh, dim=1, keepdim=True)
        u = gh / r
        x = (sb * u).detach().requires_grad_(True)
        (dphi,) = torch.autograd.grad(act.torch(x).sum(), x)
        p = g_mat - u[:, :, None] * u[:, None, :]
        return (sb / r)[:, :, None] * dphi[:, :, None] * p

    jac = autograd_jac if jacobian == "autograd" else analytic_jac

    def center2(a):  # G a G for a batch of matrices
        a = a - a.mean(dim=1, keepdim=True)
        return a - a.mean(dim=2, keepdim=True)

    def stats(n):
        h = torch.randn(n, b, generator=gen, dtype=torch.float64) @ chol.T
        gh = h - h.mean(dim=1, keepdim=True)
        y = act.torch(sb * gh / torch.linalg.norm(gh, dim=1, keepdim=True))
        J = jac(h)
        gy = y - y.mean(dim=1, keepdim=True)
        yy = (y * y).sum(dim=1)
        gjg = center2(J)  # G J G
        # backward traces of X ↦ A X Aᵀ, A = G Jᵀ G
        fro = (gjg * gjg).sum(dim=(1, 2))
        dg = torch.diagonal(gjg, dim1=1, dim2=2)
        tr = dg.sum(dim=1)
        tr2 = torch.einsum("nij,nji->n", gjg, gjg)
        t_g = fro / (b - 1.0)
        t_l = ((dg * dg).sum(dim=1) - fro / b) / (1.0 - 2.0 / b)
        t_m = 0.5 * (tr * tr + tr2) - t_g - t_l
        # forward traces over RG, L, M of Δ ↦ ⟨Δ, G dV[Δ] G⟩ (K = G J/μ*: gjg/μ* on the sum-zero plane)
        kh = torch.einsum("nij,nj->ni", gjg, gh) / mu
        kth = torch.einsum("nji,nj->ni", gjg, gh) / mu
        bh = (gy * gh).sum(dim=1)
        f_h = 0.5 * ((gy * kth).sum(dim=1) + tr / mu * bh)
        f_g = (gy * kh).sum(dim=1) / (b - 1.0)
        f_l = torch.einsum("ni,nij,nj->n", gy, gjg * g_mat, gh) / mu / (1.0 - 2.0 / b)
        f_m = f_h - f_g - f_l
        return dict(q=yy / b, nu=(y.sum(dim=1) ** 2 - yy) / (b * (b - 1.0)), bg=t_g, bl=t_l / dim_l,
                    bm=t_m / dim_m, fl=f_l / dim_l, fm=f_m / dim_m, p=tr / (b - 1.0), m=y.mean(dim=1))

    stats(min(chunk, 200))  # warm-up (not timed): first-call overheads of vmap/jacrev and allocation
    parts, per_chunk, done = [], [], 0
    while done < n0:
        k = min(chunk, n0 - done)
        t0 = time.process_time()  # CPU time, as for analyze (see cpu_time)
        parts.append(stats(k))
        per_chunk.append((time.process_time() - t0) / k)
        done += k
    per_sample = statistics.median(per_chunk)  # median over the chunks, like analyze's median over calls
    s = {key: torch.cat([p[key] for p in parts]).detach().numpy() for key in parts[0]}

    def mean_se(v):
        return float(v.mean()), float(v.std(ddof=1) / math.sqrt(v.size))

    qm, qse = mean_se(s["q"])
    num = float(s["nu"].mean())
    cm = num / qm
    cse = float((s["nu"] - cm * s["q"]).std(ddof=1) / (abs(qm) * math.sqrt(n0)))
    pm, pse = mean_se(s["p"])
    mm, mse = mean_se(s["m"])
    rows = [("q*", qm, qse, res.q_star, TARGET * abs(res.q_star)),
            ("c*", cm, cse, res.c_star, TARGET)]
    for key, name, want in (("fl", "λ_L↑", res.forward_lambda_L), ("fm", "λ_M↑", res.forward_lambda_M),
                            ("bg", "λ_G↓", res.grad_explosion_rate), ("bl", "λ_L↓", res.backward_lambda_L),
                            ("bm", "λ_M↓", res.backward_lambda_M)):
        v, se = mean_se(s[key])
        rows.append((name, v, se, want, TARGET * abs(want)))
    rows.append(("c_CB*", mm * mm, 2 * abs(mm) * mse + mse * mse, res.cross_batch_c_star, TARGET))
    rows.append(("λ_M̃", pm * pm, 2 * abs(pm) * pse, res.cross_batch_rate, TARGET * abs(res.cross_batch_rate)))
    return rows, per_sample


def bench_case(label, spec, b, n0, repeat, chunk=1000):
    from bnlab.activations import get_activation

    d = dict(spec)
    act = get_activation(d.pop("phi"), **d)
    t_auto, t_wall, res = time_analyze(act, b, repeat)
    print(f"\n{label} at B={b}: analyze(auto) {t_auto * 1e3:.2f} ms CPU ({t_wall * 1e3:.2f} ms wall), "
          f"{res.fixed_point_kind}, routes {res.methods_used}")
    out = dict(label=label, b=b, t_auto=t_auto, t_mc={})
    if res.fixed_point_kind != "BSB1":
        print("  BSB2: analyze returns no BSB1 quantities (the verdict is the result); no Monte Carlo comparison")
        return out
    for jacobian in ("autograd", "analytic"):
        rows, per_sample = direct_montecarlo(act, b, res, n0, chunk=chunk, jacobian=jacobian)
        n_need = 0.0
        print(f"  direct Monte Carlo ({jacobian} Jacobians), {n0} samples in {per_sample * n0:.2f} s "
              f"({per_sample * 1e6:.1f} µs/sample, warm):")
        for name, v, se, want, target in rows:
            need = n0 * (se / target) ** 2
            n_need = max(n_need, need)
            z = (v - want) / se if se > 0 else 0.0
            if jacobian == "autograd":  # the estimates are the same for both (same samples, same J to 1e-15)
                print(f"    {name:6s} MC {v: .6f} ± {se:.1e}  theory {want: .6f}  (z = {z:+.1f})  "
                      f"se ≤ {target:.1e} needs {need:,.0f} samples")
        t_mc = per_sample * n_need
        out["t_mc"][jacobian] = t_mc
        if getattr(act, "homogeneity", None) is not None and act.homogeneity < 1.0:
            # φ'² ~ |x|^{2α−2} near the kink: the per-sample λ_G↓, λ_L↓ statistics have E φ'⁴ ~ ∫|x|^{4α−4} dx,
            # infinite for α ≤ 3/4, so their variance is infinite and the pilot's standard error understates it
            out["infinite_variance"] = act.homogeneity <= 0.75
            if out["infinite_variance"]:
                print(f"    (α = {act.homogeneity:g} ≤ 3/4: φ'⁴ is not integrable at the kink, the backward statistics "
                      "have infinite variance — Monte Carlo converges slower than 1/√N and the sample count above "
                      "is a lower bound)")
        print(f"    every quantity to {TARGET:g}: {n_need:,.0f} samples → {t_mc:.2f} s;  "
              f"RATIO direct Monte Carlo / analyze(auto) = {t_mc / t_auto:,.0f}x  (target >= 1000x)")
    return out


def bench_reduced_montecarlo(label, spec, b, n0):
    """bnlab's own Monte Carlo routes (the reduced sphere integrals, not the network), for the record."""
    from bnlab.activations import get_activation
    from bnlab.theory import backward_eigenvalues, forward_eigenvalues
    from bnlab.theory.cross_batch import cross_batch_analysis

    d = dict(spec)
    act = get_activation(d.pop("phi"), **d)
    total = 0.0
    for fn, fields in ((forward_eigenvalues, (0, 1)), (backward_eigenvalues, (0, 1, 2)), (cross_batch_analysis, (1,))):
        t0 = time.process_time()
        r = fn(act, b, method="montecarlo", n_samples=n0, seed=1)
        dt = time.process_time() - t0
        if fn is forward_eigenvalues:
            vals = (r.lambda_L, r.lambda_M)
        elif fn is backward_eigenvalues:
            vals = (r.lambda_G, r.lambda_L, r.lambda_M)
        else:
            vals = (r.c_star, r.rate)
        need = max(n0 * (r.stderr[i] / (TARGET * abs(vals[i]))) ** 2 for i in fields)
        total += dt / n0 * need
    print(f"  {label} at B={b}: bnlab's reduced sphere Monte Carlo to {TARGET:g}: {total:.2f} s")
    return total


def bench_scaling(quick=False):
    from bnlab.theory import analyze

    print("\nB-scaling, general φ (tanh, method=auto):")
    for b in (4, 16, 64, 256, 1024) if not quick else (4, 64, 1024):
        t = median_time(lambda: analyze("tanh", b), 3, warmup=True)
        r = analyze("tanh", b)
        print(f"  B={b:5d}  {t * 1e3:8.1f} ms   λ_G↓={r.grad_explosion_rate:.8f}  16ξ={r.max_trainable_depth:.2f}")
    print("B-scaling, closed forms (relu, method=closed):")
    for b in (10, 10**3, 10**6):
        t = median_time(lambda: analyze("relu", b, method="closed"), 3, warmup=True)
        r = analyze("relu", b, method="closed")
        print(f"  B={b:8d}  {t * 1e3:8.2f} ms   λ_G↓={r.grad_explosion_rate:.10f}  (π/(π−1) = 1.4669422069)")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer samples, cases and batch sizes (smoke test)")
    p.add_argument("--case", action="append", choices=sorted({c[0] for c in CASES}), metavar="LABEL",
                   help="run only the case(s) with this label (repeatable): " + ", ".join(sorted({c[0] for c in CASES})))
    args = p.parse_args()
    import torch

    torch.set_num_threads(1)
    n0 = 1_000 if args.quick else 16_000
    repeat = 3 if args.quick else 15
    cases = CASES[:2] if args.quick else CASES
    if args.case:
        cases = [c for c in CASES if c[0] in args.case]
    out = [bench_case(label, spec, b, n0, repeat) for label, spec, b in cases]
    print("\nSIDE BY SIDE  CPU time; analyze(auto) cold (median), direct Monte Carlo warm, every quantity to 1e-3 "
          "(autograd / analytic Jacobians)")
    t_tanh = next((r["t_auto"] for r in out if r["label"] == "tanh"), out[0]["t_auto"])
    print(f"  {'φ':18s} {'B':>3s} {'analyze':>10s} {'÷ tanh':>7s} {'MC autograd':>12s} {'ratio':>8s} "
          f"{'MC analytic':>12s} {'ratio':>8s}")
    for r in out:
        cells = []
        for jac in ("autograd", "analytic"):
            t = r["t_mc"].get(jac)
            cells += ["—", "—"] if t is None else [f"{t:.2f} s", f"{t / r['t_auto']:,.0f}x"]
        mark = "  (≥: infinite variance)" if r.get("infinite_variance") else ""
        print(f"  {r['label']:18s} {r['b']:3d} {r['t_auto'] * 1e3:7.2f} ms {r['t_auto'] / t_tanh:6.2f}x "
              f"{cells[0]:>12s} {cells[1]:>8s} {cells[2]:>12s} {cells[3]:>8s}{mark}")
    if not args.quick and not args.case:
        print("\nFor the record: bnlab's reduced Monte Carlo (sphere samples of the reduced integrals, not the network):")
        for label, spec, b in CASES[:2]:
            bench_reduced_montecarlo(label, spec, b, 20_000)
        bench_scaling(False)


if __name__ == "__main__":
    main()
