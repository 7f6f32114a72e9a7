"""Gaussian layers sampled from their conditional law: a width-N layer without its N² weights.

For a layer h = a W with W iid N(0, s²) entries (s² = σ_w²/d, ``init="gaussian"``)
and inputs a of shape (rows, d), the simulator needs two products with the same W:
h = a W in the forward pass and ∂L/∂a = δ Wᵀ in the backward pass (δ = ∂L/∂h).
Neither needs W itself, only its law given what has been computed so far
(the Gaussian conditioning technique, Bolthausen 2014; Bayati & Montanari 2011,
Lemma 11):

* **Forward.**  Factor aᵀ = Q R (reduced QR: Q of shape (d, m) with orthonormal
  columns, R of shape (m, rows), m = min(d, rows)).  Then h = a W = Rᵀ (Qᵀ W),
  and Z = Qᵀ W / s is an (m, N) matrix of iid N(0, 1) numbers because the
  columns of Q are orthonormal and W is independent of a.  So h = s·Rᵀ Z
  needs m·N Gaussian numbers instead of d·N — exactly the law of a W given a.
* **Backward.**  Split W = Q Qᵀ W + (I − Q Qᵀ) W = s·Q Z + (I − QQᵀ) W̃, where
  W̃ is a fresh iid N(0, s²) matrix: the two projections of a Gaussian matrix on
  orthogonal subspaces are independent, and nothing computed downstream of this
  layer depends on (I − QQᵀ) W (the forward only sees a W = s·RᵀZ).  Hence W̃
  is independent of δ, which is a function of h and of the later layers, and

      δ Wᵀ = s·(δ Zᵀ) Qᵀ + U (I − Q Qᵀ),     U = δ W̃ᵀ.

  Given δ, U is a (rows, d) Gaussian matrix whose columns are iid N(0, s²·δδᵀ);
  with δᵀ = Q_δ R_δ (reduced QR, m' = min(N, rows) columns), U = s·R_δᵀ Z' with
  Z' an (m', d) matrix of fresh iid N(0, 1) numbers.

The joint law of every forward quantity (h^l, Σ^l, cross-batch blocks) and
every backward quantity (δ^l, ∂L/∂W^l = aᵀδ through its Gram matrices) is
therefore *exactly* that of the explicit network with iid Gaussian weights —
not an approximation, and valid at any width, rows and depth — while each layer
costs O(rows·(d + N)·rows) operations and (d + N)·rows random numbers instead of
O(rows·d·N) and d·N.  It does not apply to orthogonal or uniform weights (whose
projections are not independent Gaussians) or to anything that needs W itself
(training, weight norms): use explicit weights there.

The backward pass draws its random numbers when autograd calls it (layers in
reverse order), from the same per-network generators, so results stay
reproducible and independent of the chunking of networks.  A second backward
pass through the same graph would draw a *different* W̃ — inconsistent with the
first — so the saved tensors are freed after one backward pass (autograd's
default) and a second pass is an error.
"""
from __future__ import annotations

import math

import torch

from bnlab.sim.init import _thread_pool, fill_

__all__ = ["conditional_gaussian_layer"]


class _ConditionalGaussianLinear(torch.autograd.Function):
    """h = a W for W iid N(0, scale²), W sampled only through its conditional law (module docstring)."""

    @staticmethod
    def forward(ctx, a, fan_out, scale, generators):
        n, rows, d = a.shape
        # Householder QR: exact aᵀ = QR also when a is rank deficient (BN outputs of φ = id have
        # rank ≤ rows − k), where a Cholesky of a aᵀ would fail.
        q, r = _batched_qr(a.transpose(1, 2), "reduced")  # q (n, d, m), r (n, m, rows)
        z = _standard_normal((n, q.shape[-1], fan_out), generators, a)
        h = torch.bmm(r.transpose(1, 2), z).mul_(scale)
        ctx.save_for_backward(q, z)
        ctx.scale, ctx.generators = scale, generators
        return h

    @staticmethod
    def backward(ctx, delta):
        q, z = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None
        # δ Wᵀ = s·[(δ Zᵀ) Qᵀ + U (I − QQᵀ)] = s·[(δ Zᵀ − U Q) Qᵀ + U],  U = R_δᵀ Z' (unscaled):
        # four products of O(rows²·(d + N)) instead of five.  Only R_δ is needed (mode="r",
        # half the cost of forming Q_δ).
        r_delta = _batched_qr(delta.transpose(1, 2), "r")[1]  # (n, m', rows)
        z_fresh = _standard_normal((delta.shape[0], r_delta.shape[1], q.shape[1]), ctx.generators, delta)
        u = torch.bmm(r_delta.transpose(1, 2), z_fresh)
        inner = torch.bmm(delta, z.transpose(1, 2)).sub_(torch.bmm(u, q))
        return torch.baddbmm(u, inner, q.transpose(1, 2)).mul_(ctx.scale), None, None, None


def _batched_qr(x: torch.Tensor, mode: str):
    """torch.linalg.qr of a batch, on the CPU with one LAPACK call per thread.

    Measured on 2 cores (8 × (1000 × 128), float32): torch.linalg.qr with 2 intra-op threads
    takes 21 ms, with 1 thread 10.5 ms, and the batch split over 2 Python threads running 1
    intra-op thread each 5.6 ms.  So the intra-op thread count is set to 1 for the duration
    (it is process-wide: other threads' torch work is slowed, not changed, in that window).
    """
    threads = torch.get_num_threads()
    n = x.shape[0]
    if x.device.type != "cpu" or threads < 2 or n < 2:
        return torch.linalg.qr(x, mode=mode)
    rows, cols = x.shape[-2:]
    m = min(rows, cols)
    q = x.new_empty((n, rows, m) if mode == "reduced" else (0,))
    r = x.new_empty((n, m, cols))
    parts = min(threads, n)
    bounds = [(i * n // parts, (i + 1) * n // parts) for i in range(parts)]

    x = x.detach()  # grad mode is thread-local: the pool threads must not record a graph

    def one(lo_hi):
        lo, hi = lo_hi
        with torch.no_grad():
            qs, rs = torch.linalg.qr(x[lo:hi], mode=mode)
        r[lo:hi] = rs
        if mode == "reduced":
            q[lo:hi] = qs

    torch.set_num_threads(1)
    try:
        list(_thread_pool(threads).map(one, bounds))
    finally:
        torch.set_num_threads(threads)
    return q, r


def _standard_normal(shape, generators, like: torch.Tensor) -> torch.Tensor:
    # drawn in float32 and cast, as bnlab.sim.init does for explicit weights
    out = fill_(torch.empty(shape, dtype=torch.float32, device=like.device), generators, "normal")
    return out.to(like.dtype)


def conditional_gaussian_layer(a: torch.Tensor, fan_out: int, sigma_w2: float, generators) -> torch.Tensor:
    """h = a W for a Gaussian layer W ~ iid N(0, σ_w²/d), sampled from its conditional law.

    Parameters
    ----------
    a : torch.Tensor, shape (networks, rows, d)
        Inputs of the layer (may require grad; the backward pass returns δ Wᵀ with
        the same W, in law — see the module docstring).
    fan_out : int
        N, the number of output neurons.
    sigma_w2 : float
        Weight variance scale σ_w² > 0 (entry variance σ_w²/d).
    generators : sequence of torch.Generator
        One per network (network i draws only from ``generators[i]``), on ``a.device``.

    Returns
    -------
    torch.Tensor, shape (networks, rows, fan_out)
        Exactly distributed as a W with W independent of a (Gaussian conditioning).

    Cost: O(rows²·(d + N)) operations and rows·(d + N) random numbers per network
    (forward and backward together), against O(rows·d·N) and d·N for explicit weights.
    """
    if a.ndim != 3:
        raise ValueError(f"a is not allowed: expected shape (networks, rows, d), got {tuple(a.shape)}")
    if not (isinstance(fan_out, int) and fan_out >= 1):
        raise ValueError(f"fan_out={fan_out!r} is not allowed: expected an integer >= 1")
    if not (math.isfinite(sigma_w2) and sigma_w2 > 0):
        raise ValueError(f"sigma_w2={sigma_w2!r} is not allowed: expected a finite number > 0")
    scale = math.sqrt(sigma_w2 / a.shape[-1])
    return _ConditionalGaussianLinear.apply(a, fan_out, scale, list(generators))
