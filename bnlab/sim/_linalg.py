"""Structured batched matrix products for the simulator: symmetric Gram matrices and products
with a lower-triangular factor, at 3/4 (one level of blocking) to 2/3 (many levels) of the work
of a plain ``torch.bmm``; and a blocked Cholesky factorization.

torch exposes no batched ``syrk`` (x xᵀ) or ``trmm`` (L·Z), and a plain bmm spends half its
FLOPs on the known upper triangle.  Splitting the rows in halves,

    x xᵀ = [x₁x₁ᵀ  ·  ]        L Z = [L₁₁ Z₁           ]
           [x₂x₁ᵀ x₂x₂ᵀ],            [L₂₁ Z₁ + L₂₂ Z₂],

the bottom block row is one bmm over all columns and the top-left block recurses, down to
``_MIN_BLOCK`` rows, where a bmm of the whole block is cheaper than more, smaller calls (the
CPU's bmm loses efficiency below ≈ 64 rows).  Measured at 8 × (256 × 1000), float32, one
thread: L·Z 7.1 → 5.1 ms, x xᵀ 7.0 → 5.8 ms (benchmarks/bench_sim.py shows the effect on the
whole simulator).  Results equal the plain products up to the rounding of a different
summation order.  The Gram matrix is exactly symmetric by construction: every upper triangle
(of the off-diagonal blocks and of the base-case blocks alike) is a copy of the lower one, because
a plain bmm of x xᵀ is *not* bit-for-bit symmetric on every BLAS (measured on an AMD EPYC: the two
triangles differ in the last bits), and the Cholesky factorizations downstream read one triangle.
"""
from __future__ import annotations

import functools

import torch

#: Row blocks at or below this size are multiplied with one plain bmm.
_MIN_BLOCK = 64


def gram(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x xᵀ for ``x`` of shape (..., m, n): shape (..., m, m), exactly symmetric.

    ``out``: a contiguous tensor of that shape and x's dtype to write into (the simulator's per-layer
    buffers), instead of a new one; not with a differentiable ``x``."""
    if x.requires_grad and torch.is_grad_enabled():
        if out is not None:
            raise ValueError("gram(out=...) computes no gradient: detach x first")
        # the blocked products write into slices (out=), so the differentiable route is a plain
        # product, made symmetric out of place: lower triangle plus its mirror
        full = torch.matmul(x, x.transpose(-1, -2))
        return full.tril() + full.tril(-1).transpose(-1, -2)
    lead = x.shape[:-2]
    m, n = x.shape[-2:]
    x3 = x.reshape(-1, m, n)
    if out is None:
        out = x3.new_empty((x3.shape[0], m, m))
    elif tuple(out.shape) != (*lead, m, m) or not out.is_contiguous() or out.dtype != x.dtype:
        raise ValueError(f"out is not allowed: expected a contiguous {x.dtype} tensor of shape {(*lead, m, m)}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    _gram_into(x3, out.view(-1, m, m))
    return out.view(*lead, m, m)


def _gram_into(x: torch.Tensor, out: torch.Tensor) -> None:
    m = x.shape[1]
    if m <= _MIN_BLOCK:
        torch.bmm(x, x.transpose(1, 2), out=out)
        _mirror_lower_into_upper(out)
        return
    h = m // 2
    # bottom block row x₂ xᵀ in one product, the top-left block recursively, the top-right by symmetry
    torch.bmm(x[:, h:], x.transpose(1, 2), out=out[:, h:])
    _mirror_lower_into_upper(out[:, h:, h:])  # x₂x₂ᵀ came from a full product: symmetrize it too
    _gram_into(x[:, :h], out[:, :h, :h])
    out[:, :h, h:] = out[:, h:, :h].transpose(1, 2)


def _mirror_lower_into_upper(square: torch.Tensor) -> None:
    """Overwrite the strict upper triangle of each (m, m) matrix of ``square`` (possibly a view)
    with the transpose of its strict lower triangle, in place."""
    m = square.shape[-1]
    if m > 1:
        rows, cols = _upper_indices(m, square.device)
        square[:, rows, cols] = square[:, cols, rows]


@functools.lru_cache(maxsize=64)
def _upper_indices(m: int, device: torch.device) -> torch.Tensor:
    """The strict upper triangle's (rows, cols) indices of an m × m matrix, made once per (m, device)
    rather than at every Gram matrix (on a GPU each torch.triu_indices is an allocation and a launch)."""
    return torch.triu_indices(m, m, 1, device=device)


def lower_triangular_matmul(lower: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """L Z for a batch of lower-triangular ``lower`` (b, m, m), whose upper triangle must be zero
    (as torch.linalg.cholesky returns it), and ``z`` (b, m, n)."""
    if (lower.requires_grad or z.requires_grad) and torch.is_grad_enabled():
        return torch.bmm(lower, z)
    out = z.new_empty((z.shape[0], lower.shape[1], z.shape[2]))
    _lower_into(lower, z, out)
    return out


def _lower_into(lower: torch.Tensor, z: torch.Tensor, out: torch.Tensor) -> None:
    m = lower.shape[1]
    if m <= _MIN_BLOCK:
        torch.bmm(lower, z, out=out)
        return
    h = m // 2
    # bottom rows [L₂₁ L₂₂] Z in one product, the top rows L₁₁ Z₁ recursively (L₁₂ = 0 is skipped)
    torch.bmm(lower[:, h:], z, out=out[:, h:])
    _lower_into(lower[:, :h, :h], z[:, :h], out[:, :h])


def cholesky(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(L, info)`` like ``torch.linalg.cholesky_ex`` for a batch (b, m, m): L lower triangular
    with zero upper triangle, info ≠ 0 for the matrices where the factorization failed (their L is
    then meaningless).

    Right-looking block Cholesky: L₁₁ = chol(G₁₁), L₂₁ = G₂₁ L₁₁⁻ᵀ, L₂₂ = chol(G₂₂ − L₂₁L₂₁ᵀ), with
    the halves recursing down to ``_MIN_BLOCK``; as backward stable as the unblocked algorithm
    (Higham 2002, §10.1 and §13), and on the CPU faster, because the batched LAPACK call is slow
    for mid-size matrices (8 × 256², float32, one thread: 3.2 ms for cholesky_ex, ≈ 1.7 ms blocked).
    """
    m = g.shape[1]
    if m <= _MIN_BLOCK:
        return torch.linalg.cholesky_ex(g)
    h = m // 2
    out = torch.empty_like(g)
    out[:, :h, h:] = 0.0
    l11, info11 = cholesky(g[:, :h, :h])
    l21 = torch.linalg.solve_triangular(l11.transpose(1, 2), g[:, h:, :h], upper=True, left=False)
    l22, info22 = cholesky(torch.baddbmm(g[:, h:, h:], l21, l21.transpose(1, 2), alpha=-1.0))
    out[:, :h, :h] = l11
    out[:, h:, :h] = l21
    out[:, h:, h:] = l22
    return out, torch.where(info11 != 0, info11, info22)
