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

  Given δ, U is a (rows, d) Gaussian matrix whose columns are iid N(0, s²·δδᵀ),
  so U = s·C Z' for any factor C Cᵀ = δδᵀ and an (m', d) matrix Z' of fresh iid N(0, 1)
  numbers: C is the Cholesky factor of δδᵀ (after removing the batch-mean null space of BN
  gradients, m' = rows − k), or R_δᵀ from Householder QR of δᵀ where that fails
  (``_fresh_gaussian_product``).

The joint law of every forward quantity (h^l, Σ^l, cross-batch blocks) and
every backward quantity (δ^l, ∂L/∂W^l = aᵀδ through its Gram matrices) is
therefore *exactly* that of the explicit network with iid Gaussian weights —
not an approximation, and valid at any width, rows and depth — while each layer
costs O(rows·(d + N)·rows) operations and (d + N)·rows random numbers instead of
O(rows·d·N) and d·N.  It does not apply to orthogonal or uniform weights (whose
projections are not independent Gaussians) or to anything that needs W itself
(training, weight norms): use explicit weights there.

**Two ways to factor aᵀ** (same draws, same network up to rounding: both use the QR factors
with diag(R) ≥ 0, which are unique when a has full row rank):

* *Cholesky route* (rows ≤ d, a aᵀ positive definite and well conditioned): G = a aᵀ = L Lᵀ,
  so Rᵀ = L and Q = aᵀ L⁻ᵀ.  The forward pass is h = s·L Z (two matrix products and an
  rows × rows Cholesky), and the backward pass substitutes Q:

      δ Wᵀ = s·[U + (δ Zᵀ − U aᵀ L⁻ᵀ) L⁻¹ a],

  products and rows × rows triangular solves only — about half the time of Householder QR
  on a CPU.  Its rounding errors are amplified by up to κ(a)² (through the Gram matrix), so it
  is used only where the estimated u·κ² ≤ ``CHOLESKY_MAX_ROUNDOFF_KAPPA2``.
* *Householder route* (otherwise: rows > d, rank-deficient a such as the BN outputs of
  φ = identity, or ill-conditioned a as in deep vanilla networks): torch.linalg.qr, backward
  stable at any κ.

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

from bnlab.sim._linalg import cholesky, gram as gram_matrix, lower_triangular_matmul
from bnlab.sim.init import _thread_pool, fill_

__all__ = ["conditional_gaussian_layer"]


class _ConditionalGaussianLinear(torch.autograd.Function):
    """h = a W for W iid N(0, scale²), W sampled only through its conditional law (module docstring)."""

    @staticmethod
    def forward(ctx, a, fan_out, scale, generators, grams, mean_free_batch):
        n, rows, d = a.shape
        ctx.scale, ctx.generators, ctx.grams, ctx.fan_in = scale, generators, grams, d
        ctx.mean_free_batch = mean_free_batch
        gram, chol = _gram_cholesky(a)
        if grams is not None:
            grams["input"] = gram
        if chol is not None:
            # h = s·L Z with L Lᵀ = a aᵀ: Q = aᵀL⁻ᵀ and R = Lᵀ are the QR factors with diag(R) > 0,
            # never formed (module docstring, "Cholesky route")
            z = _standard_normal((n, rows, fan_out), generators, a)
            ctx.route = "cholesky"
            ctx.save_for_backward(a, chol, z)
            return lower_triangular_matmul(chol * scale, z)
        # Householder QR: exact aᵀ = QR also when a is rank deficient (BN outputs of φ = id have
        # rank ≤ rows − k) or too ill-conditioned for the Cholesky route.  Signs normalized to
        # diag(R) ≥ 0, so that both routes realize the same network from the same draws.
        q, r = _batched_qr(a.transpose(1, 2), "reduced")  # q (n, d, m), r (n, m, rows)
        signs = torch.diagonal(r, dim1=-2, dim2=-1).sign()
        signs = torch.where(signs == 0, torch.ones_like(signs), signs)
        q.mul_(signs.unsqueeze(1))
        r.mul_(signs.unsqueeze(2))
        if grams is not None and gram is None:
            grams["input"] = torch.bmm(r.transpose(1, 2), r)  # a aᵀ = RᵀR, O(rows²·m)
        z = _standard_normal((n, q.shape[-1], fan_out), generators, a)
        ctx.route = "householder"
        ctx.save_for_backward(q, z)
        r_t = r.transpose(1, 2) * scale  # (rows, m): lower triangular if square (rows ≤ d)
        return lower_triangular_matmul(r_t, z) if r_t.shape[1] == r_t.shape[2] else torch.bmm(r_t, z)

    @staticmethod
    def backward(ctx, delta):
        saved = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None
        # U = δ W̃ᵀ = s·C Z' for any C with C Cᵀ = δδᵀ (module docstring, "Backward")
        u = _fresh_gaussian_product(delta, ctx.fan_in, ctx.scale, ctx.generators, ctx.grams,
                                    ctx.mean_free_batch)
        if ctx.route == "cholesky":
            # δ Wᵀ = s·[U₀ + (δ Zᵀ − U₀ aᵀ L⁻ᵀ) L⁻¹ a] = U + (s·δ Zᵀ − U aᵀ L⁻ᵀ) L⁻¹ a with U = s·U₀
            # (Q = aᵀ L⁻ᵀ substituted)
            a, chol, z = saved
            inner = torch.linalg.solve_triangular(
                chol.transpose(1, 2), torch.bmm(u, a.transpose(1, 2)), upper=True, left=False
            )
            inner = torch.bmm(delta, z.transpose(1, 2)).mul_(ctx.scale).sub_(inner)
            inner = torch.linalg.solve_triangular(chol, inner, upper=False, left=False)
            return u.baddbmm_(inner, a), None, None, None, None, None
        # δ Wᵀ = s·[(δ Zᵀ) Qᵀ + U₀ (I − QQᵀ)] = (s·δ Zᵀ − U Q) Qᵀ + U: four products of
        # O(rows²·(d + N)) instead of five.
        q, z = saved
        inner = torch.bmm(delta, z.transpose(1, 2)).mul_(ctx.scale).sub_(torch.bmm(u, q))
        return u.baddbmm_(inner, q.transpose(1, 2)), None, None, None, None, None


def _fresh_gaussian_product(delta, fan_in, scale, generators, grams, mean_free_batch):
    """U = δ W̃ᵀ for a fresh W̃ with iid N(0, s²) entries, (n, rows, fan_in), given δ (n, rows, N).

    The columns of U are iid N(0, s²·δδᵀ), so U = s·C Z' for any factor C Cᵀ = δδᵀ and fresh iid
    N(0, 1) numbers Z'.  C is the Cholesky factor of the Gram matrix δδᵀ (a product and an
    rows × rows Cholesky: about a third of the time of Householder QR of δᵀ on a CPU).

    Accuracy: Cholesky is backward stable whenever it completes — the computed C satisfies
    C Cᵀ = δδᵀ + E with ‖E‖ ≤ c·rows·u·‖δδᵀ‖ (Higham 2002, Thm 10.3), whatever the condition of δ
    — so the law of U is exact up to a relative O(rows·u) perturbation of its covariance, the
    size of the rounding of U itself.  (This differs from the forward pass, where L⁻¹ is applied
    and errors grow with κ².)

    Null space: if the layer's output feeds only mean-subtracting batch normalization over
    blocks of ``mean_free_batch`` rows, the rows of δ sum to zero in each block, δδᵀ is singular
    and the Cholesky factorization would break down (or, completing on rounding noise, give U a
    √u-size component along the null vectors).  So δ = T D, where D drops the last row of each
    block and T restores it as minus the sum of the others; the factor is C = T·chol(D Dᵀ), and
    U = T·(s·chol(DDᵀ) Z') needs Z' of (rows − k) rows.  This is the caller's structural
    guarantee, not a numerical test: the computed δ's block sums are rounding errors of the
    batch-normalization backward pass (relative to its input gradient, which can be much larger
    than δ at small B), and replacing them by exact zeros changes δ by no more than its own
    rounding error.

    Where the Cholesky factorization fails (δ rank deficient: rows − k > N, φ = identity, …) the
    network's factor is the sign-normalized R_Dᵀ of Householder QR of Dᵀ, the same matrix as the
    Cholesky factor whenever both exist; the choice is made per network, so results do not depend
    on which networks share a chunk.
    """
    n, rows, width = delta.shape
    gram_delta = gram_matrix(delta)
    if grams is not None:
        grams["delta"] = gram_delta
    b = mean_free_batch
    deflate = b is not None and b >= 2
    if deflate:
        k = rows // b
        keep = rows - k
        gram_kept = gram_delta.view(n, k, b, k, b)[:, :, : b - 1, :, : b - 1].reshape(n, keep, keep)
        kept = delta.view(n, k, b, width)[:, :, : b - 1]  # D, as a view: copied only for a fallback
    else:
        keep, gram_kept, kept = rows, gram_delta, delta
    factor, info = cholesky(gram_kept) if keep <= width else (None, None)
    if factor is None:
        failed = torch.arange(n, device=delta.device)
        factor = gram_kept.new_zeros((n, keep, keep))
    else:
        failed = info.nonzero().flatten()
    if failed.numel():
        # Householder fallback for these networks (one batched call); diag(R) ≥ 0 makes Rᵀ the
        # Cholesky factor wherever that exists, so the route does not change the network
        sub = kept[failed].reshape(failed.numel(), keep, width)
        r = _batched_qr(sub.transpose(1, 2), "r")[1]  # (f, min(N, keep), keep)
        signs = torch.diagonal(r, dim1=-2, dim2=-1).sign()
        r = r * torch.where(signs == 0, torch.ones_like(signs), signs).unsqueeze(2)
        fallback = factor.new_zeros((failed.numel(), keep, keep))
        fallback[:, :, : r.shape[1]] = r.transpose(1, 2)
        factor[failed] = fallback
    z_fresh = _standard_normal((n, keep, fan_in), generators, delta)
    v = lower_triangular_matmul(factor.mul_(scale), z_fresh)
    if not deflate:
        return v
    u = delta.new_empty((n, k, b, fan_in))
    v = v.view(n, k, b - 1, fan_in)
    u[:, :, : b - 1] = v
    torch.sum(v, 2, out=u[:, :, b - 1]).neg_()
    return u.view(n, rows, fan_in)


#: Largest estimated u·κ(a)² (u the unit roundoff of the dtype, κ the condition number of the
#: layer's inputs) for which a layer takes the Cholesky route.  Its backward pass applies the
#: projector aᵀ(aaᵀ)⁻¹a through the Gram matrix, whose rounding errors can be amplified by up to κ²
#: (the Householder route's by O(1)); so ≈ 1e-3 is the worst-case relative error of δWᵀ this
#: admits in float32 (κ ≲ 100), and κ ≲ 3e6 in float64.  Measured errors are far below the bound:
#: against a float64 computation with the same draws, float32 δWᵀ is off by 2.6e-6 at
#: u·κ² = 3e-4 (Householder route 6e-7), by ≤ 6e-7 at u·κ² ≤ 1e-5 (relu/tanh BN networks,
#: rows 32–128, width 1000).
CHOLESKY_MAX_ROUNDOFF_KAPPA2 = 2.0**-10


def _gram_cholesky(a: torch.Tensor):
    """``(G, L)``: the Gram matrix G = a aᵀ and L with L Lᵀ = G (lower triangular, per network),
    L = None where the Cholesky route is not accurate (G = None too if it was not formed): rows > d
    (a aᵀ singular), a failed factorization, or an estimated u·κ(a)² above
    ``CHOLESKY_MAX_ROUNDOFF_KAPPA2``.

    κ(a)² = λ_max/λ_min of G = a aᵀ.  λ_max ≤ ‖G‖_∞ (max absolute row sum: an upper bound);
    λ_min is estimated by six steps of inverse iteration from a fixed start (its Rayleigh
    quotient is an upper bound of λ_min: measured within a factor 1.22 of λ_min in BN networks
    at rows 8–128), and a safety factor 1.5 covers that.  The estimate costs O(rows²) per step:
    negligible next to the Gram matrix (O(rows²·d)).
    """
    n, rows, d = a.shape
    if rows > d or rows < 2:
        return None, None
    gram = gram_matrix(a)
    chol, info = cholesky(gram)
    if bool((info != 0).any()):
        return gram, None
    lam_max = gram.abs().sum(-1).amax(-1)
    # fixed, non-symmetric start vector: no dependence on the random streams
    x = torch.linspace(1.0, 2.0, rows, dtype=a.dtype, device=a.device).expand(n, rows).unsqueeze(-1)
    for _ in range(6):
        # G⁻¹x by two triangular solves (3× faster than torch.cholesky_solve for one right-hand side)
        x = torch.linalg.solve_triangular(chol, x, upper=False)
        x = torch.linalg.solve_triangular(chol.transpose(1, 2), x, upper=True)
        x = x / torch.linalg.vector_norm(x, dim=1, keepdim=True)
    lam_min = (x * torch.bmm(gram, x)).sum((1, 2))
    kappa2 = 1.5 * lam_max / lam_min
    roundoff = torch.finfo(a.dtype).eps / 2
    if not bool(torch.all((lam_min > 0) & (roundoff * kappa2 <= CHOLESKY_MAX_ROUNDOFF_KAPPA2))):
        return gram, None
    return gram, chol


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


def conditional_gaussian_layer(
    a: torch.Tensor,
    fan_out: int,
    sigma_w2: float,
    generators,
    *,
    grams: dict | None = None,
    mean_free_batch: int | None = None,
) -> torch.Tensor:
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
    grams : dict, optional
        If given, the forward pass stores ``grams["input"]`` = a aᵀ and the backward pass
        ``grams["delta"]`` = δ δᵀ, each of shape (networks, rows, rows): the Gram matrices the
        layer forms anyway for its factorizations (or RᵀR from a Householder factor), so the
        simulator's weight-gradient measurement ‖aᵀδ‖² = ⟨a aᵀ, δ δᵀ⟩ needs no further product.
    mean_free_batch : int, optional
        B, if the output feeds only mean-subtracting batch normalization over consecutive
        blocks of B rows, so that the rows of δ = ∂L/∂h sum to zero in each block (in exact
        arithmetic): the backward pass then factors δδᵀ without this known null space.  A
        promise of the caller, not checked: with it, U has exactly zero block sums, as in exact
        arithmetic; giving it for a δ without that structure would change the law.

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
    if grams is not None and not isinstance(grams, dict):
        raise ValueError(f"grams={grams!r} is not allowed: expected None or a dict to store the Gram matrices in")
    if mean_free_batch is not None and not (
        isinstance(mean_free_batch, int) and mean_free_batch >= 1 and a.shape[1] % mean_free_batch == 0
    ):
        raise ValueError(
            f"mean_free_batch={mean_free_batch!r} is not allowed: expected None or a positive integer "
            f"dividing the number of rows ({a.shape[1]})"
        )
    scale = math.sqrt(sigma_w2 / a.shape[-1])
    return _ConditionalGaussianLinear.apply(a, fan_out, scale, list(generators), grams, mean_free_batch)
