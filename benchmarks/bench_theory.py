"""Theory engine benchmark: ``analyze`` vs Monte Carlo, and scaling in the batch size B.

Run:  python benchmarks/bench_theory.py [--quick]

1. Full ``analyze("tanh", 32)`` (method="auto": fixed point, forward, backward
   and cross-batch eigenvalues) against a Monte Carlo estimate of the same
   eigenvalues to 1e-3 relative standard error.  The Monte Carlo cost is
   measured honestly: bnlab's own Monte Carlo routes (forward, backward,
   cross-batch; vectorized NumPy over samples) are timed on N₀ samples, their
   standard errors give the sample size needed for 1e-3 relative error on the
   worst quantity, N = N₀ (se/(1e-3 |value|))², and the cost is
   time(N₀)·N/N₀ (the routes are linear in N).
2. Scaling: analyze for a general φ (tanh) at B = 4 … 1024 and the closed
   forms (relu) up to B = 10⁶.

Prints timings and ratios; asserts nothing (performance claims live here, not in tests).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _timing import median_time  # noqa: E402


def _timeit(fn, repeat=5):
    return median_time(fn, repeat, warmup=True)  # warm-up: imports, quadrature caches


def bench_vs_montecarlo(b=32, n0=20_000):
    from bnlab.theory import analyze, backward_eigenvalues, forward_eigenvalues
    from bnlab.theory.cross_batch import cross_batch_analysis

    def full():
        from bnlab.theory.forward import _sphere_grid

        _sphere_grid.cache_clear()  # no credit for cached quadrature nodes
        return analyze("tanh", b)

    t_auto = _timeit(full)
    res = analyze("tanh", b)
    print(f"analyze('tanh', B={b}) by auto: {t_auto * 1e3:.1f} ms  (methods: {res.methods_used})")

    rows = []
    t0 = time.perf_counter()
    fw = forward_eigenvalues("tanh", b, method="montecarlo", n_samples=n0, seed=1)
    t_fw = time.perf_counter() - t0
    t0 = time.perf_counter()
    bw = backward_eigenvalues("tanh", b, method="montecarlo", n_samples=n0, seed=1)
    t_bw = time.perf_counter() - t0
    t0 = time.perf_counter()
    cb = cross_batch_analysis("tanh", b, method="montecarlo", n_samples=n0, seed=1)
    t_cb = time.perf_counter() - t0
    rows += [("forward λ_L", fw.lambda_L, fw.stderr[0], t_fw), ("forward λ_M", fw.lambda_M, fw.stderr[1], t_fw)]
    rows += [(f"backward {k}", v, s, t_bw) for k, v, s in zip(("λ_G", "λ_L", "λ_M"), (bw.lambda_G, bw.lambda_L, bw.lambda_M), bw.stderr)]
    rows += [("cross-batch rate", cb.rate, cb.stderr[1], t_cb)]
    need = {}
    for name, val, se, t in rows:
        n_req = n0 * (se / (1e-3 * abs(val))) ** 2
        need[t] = max(need.get(t, 0.0), n_req / n0 * t)  # seconds for this route at the worst quantity
        print(f"  MC {name:18s} = {val:.6f} ± {se:.2e} with {n0} samples; 1e-3 relative needs {n_req:,.0f} samples")
    t_mc = sum(need.values())
    print(f"Monte Carlo cost for 1e-3 relative on every quantity: {t_mc:.1f} s (measured per-sample time × samples needed)")
    ratio = t_mc / t_auto
    print(f"RATIO  reduced Monte Carlo (bnlab's sphere MC) / analyze(auto) = {ratio:,.0f}x  (target >= 1000x)")
    t_direct, n_direct = _direct_autograd_cost(b, res.grad_explosion_rate)
    print(
        f"direct Monte Carlo of the network's backward map (h ~ N(0, Σ*), J = dB_φ/dh by torch autograd): "
        f"{n_direct:,.0f} samples for 1e-3 relative on λ_G↓ alone → {t_direct:.1f} s"
    )
    print(f"RATIO  direct Monte Carlo (λ_G↓ only) / analyze(auto, everything) = {t_direct / t_auto:,.0f}x")
    # accuracy of auto against Gegenbauer (independent route) for the record
    geg = analyze("tanh", b, method="gegenbauer")
    print(f"  auto vs gegenbauer |Δλ_G↓|/λ_G↓ = {abs(geg.grad_explosion_rate - res.grad_explosion_rate) / res.grad_explosion_rate:.1e}")
    return ratio


def _direct_autograd_cost(b, rate, n0=4000):
    """Time per sample × samples needed for 1e-3 relative standard error on λ_G↓ = E tr(G Jᵀ G J)/(B−1)."""
    import math

    import numpy as np
    import torch
    from torch.func import jacrev, vmap

    from bnlab.activations import get_activation
    from bnlab.theory import bsb1_fixed_point

    act = get_activation("tanh")
    fp = bsb1_fixed_point(act, b)
    s0 = fp.q_star * ((1 - fp.c_star) * np.eye(b) + (fp.c_star + 1.0) * np.ones((b, b)))
    ch = torch.tensor(np.linalg.cholesky(s0))
    g = torch.eye(b, dtype=torch.float64) - 1.0 / b

    def bphi(h):
        gh = h - h.mean()
        return act.torch(math.sqrt(b) * gh / torch.linalg.norm(gh))

    gen = torch.Generator().manual_seed(0)
    t = time.perf_counter()
    h = torch.randn(n0, b, generator=gen, dtype=torch.float64) @ ch.T
    jac = vmap(jacrev(bphi))(h)
    # tr(G Jᵀ G J) = Σ G_ab J_cb G_cd J_da
    vals = torch.einsum("ab,ncb,cd,nda->n", g, jac, g, jac) / (b - 1)
    dt = time.perf_counter() - t
    se = float(vals.std()) / math.sqrt(n0)
    print(f"  direct MC: λ_G↓ ≈ {float(vals.mean()):.4f} ± {se:.1e} from {n0} samples (analyze: {rate:.6f})")
    n_req = n0 * (se / (1e-3 * rate)) ** 2
    return dt / n0 * n_req, n_req


def bench_scaling(quick=False):
    from bnlab.theory import analyze

    print("\nB-scaling, general φ (tanh, method=auto):")
    for b in (4, 16, 64, 256, 1024) if not quick else (4, 64, 1024):
        t = _timeit(lambda: analyze("tanh", b), repeat=3)
        r = analyze("tanh", b)
        print(f"  B={b:5d}  {t * 1e3:8.1f} ms   λ_G↓={r.grad_explosion_rate:.8f}  16ξ={r.max_trainable_depth:.2f}")
    print("B-scaling, closed forms (relu, method=closed):")
    for b in (10, 10**3, 10**6):
        t = _timeit(lambda: analyze("relu", b, method="closed"), repeat=3)
        r = analyze("relu", b, method="closed")
        print(f"  B={b:8d}  {t * 1e3:8.2f} ms   λ_G↓={r.grad_explosion_rate:.10f}  (π/(π−1) = 1.4669422069)")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer batch sizes")
    args = p.parse_args()
    bench_vs_montecarlo()
    bench_scaling(args.quick)


if __name__ == "__main__":
    main()
