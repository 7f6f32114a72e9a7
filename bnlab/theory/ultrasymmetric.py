"""Ultrasymmetric operators and their G-projected eigenvalues (Yang et al. 2019, App. E.5).

A linear operator T on B×B matrices is *ultrasymmetric* (Defn E.53) when its
entries ``[kl|ij] := T{δ_i δ_jᵀ}_{kl}`` are invariant under simultaneous
permutation of all four indices and under ``[ij|kl] = [ji|lk]``.  Such an
operator is described by a handful of numbers, one per equality pattern of
(k, l, i, j); the ten that matter after projection by ``G = I − 11ᵀ/B`` are

    [11|11], [11|22], [11|12], [11|23], [12|11], [12|33], [12|12], [12|21], [12|13], [12|34]

(left: output index pair, right: input index pair).  Thm E.62 then gives the
three eigenvalues of ``G^{⊗2} ∘ T`` restricted to ``H_B^G = {Σ symmetric : GΣG = Σ}``:

* on ``RG``  : λ_G = B⁻¹((B−1)(α11 − α21) − (α12 − α22)),
* on ``L``   : λ_L = B⁻¹((B−2)β11 + β12 + 2(B−2)β21 + 2β22),
* on ``M``   : λ_M = [12|12] + [12|21] − 4[12|13] + 2[12|34],

with α_ij, β_ij the linear combinations of Thm E.61.  The eigenspaces are
``RG``, ``L = {D^G : D diagonal, tr D = 0}`` (dimension B−1) and
``M = {Σ : Σ^G = Σ, Diag Σ = 0}`` (dimension B(B−3)/2).

Every eigenvalue of the mean field dynamics in :mod:`bnlab.theory.forward`,
:mod:`bnlab.theory.backward` is obtained by computing those ten brackets
(by spherical integration or Monte Carlo) and applying :func:`projected_eigenvalues`.

Accuracy: the map from brackets to eigenvalues is a fixed linear combination
(exact up to rounding, a few ulp times the largest bracket times B²).

Validation: ``tests/theory/test_ultrasymmetric.py`` builds dense B²×B²
ultrasymmetric operators from random bracket values, diagonalizes
``G^{⊗2}∘T`` on H_B^G numerically and compares.

Errata (checked numerically in ``tests/theory/test_ultrasymmetric.py``)
----------------------------------------------------------------------
* Thms E.61/E.62 use the single bracket ``[12|13]`` for two different
  equivalence classes of Defn E.53: ``[12|13] = [12|32]`` and
  ``[12|31] = [12|23]`` are related by the symmetry [ij|kl] = [ji|lk] only
  within each pair.  They coincide when T{X} depends on X only through
  X + Xᵀ (the forward Jacobian), but not for the backward operator
  F{Π} = E[P D Π D P] (there [12|13] = −E g_1g_3(1−u_1²)u_2u_3 and
  [12|31] = E g_1g_3 u_1²u_2u_3).  Since the BSB1, L and M eigenmatrices are
  symmetric, the printed formulas are right with [12|13] replaced by
  ([12|13] + [12|31])/2; with the printed formula the backward eigenvalues
  are wrong (e.g. λ_G↓ = 2.25 instead of (B−2)/(B−3) = 2 for the identity at B = 4).
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import product

import numpy as np

from bnlab._validation import check_int

__all__ = [
    "BRACKETS",
    "ProjectedEigenvalues",
    "projected_eigenvalues",
    "dense_ultrasymmetric_operator",
    "bracket_pattern",
    "eigenvalues_on_projected_space",
]

#: The eleven brackets [kl|ij] that determine G^{⊗2}∘T on H_B^G, in a fixed order
#: (the paper uses ten: it identifies [12|31] with [12|13], see the errata).
BRACKETS = ("11|11", "11|22", "11|12", "11|23", "12|11", "12|33", "12|12", "12|21", "12|13", "12|34", "12|31")


@dataclass(frozen=True)
class ProjectedEigenvalues:
    """Eigenvalues of G^{⊗2}∘T on H_B^G (Thm E.62): on RG, on L and on M."""

    lambda_G: float
    lambda_L: float
    lambda_M: float


def projected_eigenvalues(brackets, batch_size: int) -> ProjectedEigenvalues:
    """Eigenvalues of ``G^{⊗2} ∘ T`` on H_B^G from the brackets of T (Yang et al. 2019, Thm E.62).

    Parameters
    ----------
    brackets : mapping or array_like
        Either a mapping from the names in :data:`BRACKETS` to values, or an
        array whose last axis has length 11 in the order of :data:`BRACKETS`
        (vectorized: leading axes are broadcast).  ``"12|31"`` may be omitted
        (mapping) or the last axis may have length 10: it then defaults to
        ``[12|13]`` (true for operators on symmetric inputs, e.g. the forward Ĵ).
    batch_size : int
        B ≥ 3 (for B = 3 the M-eigenspace is empty and λ_M is returned but
        meaningless).

    Returns
    -------
    ProjectedEigenvalues
        Fields are floats, or arrays with the leading shape of ``brackets``.
    """
    b = check_int("batch_size", batch_size, minimum=3)
    if isinstance(brackets, dict):
        brackets = dict(brackets)
        brackets.setdefault("12|31", brackets.get("12|13"))
        missing = [k for k in BRACKETS if brackets.get(k) is None]
        if missing:
            raise ValueError(f"brackets is missing the entries {missing}; expected all of {BRACKETS}")
        arr = np.array([brackets[k] for k in BRACKETS], dtype=np.float64)
    else:
        arr = np.asarray(brackets, dtype=np.float64)
        if arr.shape[-1:] == (10,):
            arr = np.concatenate([arr, arr[..., 8:9]], axis=-1)
        if arr.shape[-1:] != (11,):
            raise ValueError(f"brackets has shape {arr.shape}: expected a last axis of length 11 ({BRACKETS})")
    t1111, t1122, t1112, t1123, t1211, t1233, t1212, t1221, t1213, t1234, t1231 = np.moveaxis(arr, -1, 0)
    # Erratum: Thms E.61/E.62 merge [12|13] and [12|31]; they are different classes of
    # Defn E.53 (equal only when T{X} depends on X through X + Xᵀ).  On the symmetric
    # inputs of the BSB1, L and M eigenmatrices both enter with the same count, so the
    # printed formulas hold with [12|13] replaced by the average of the two.
    t1213 = 0.5 * (t1213 + t1231)
    # Thm E.61, item 1 (BSB1 block) and item 2 (L block)
    a11 = t1111 + t1122 * (b - 1)
    a12 = 2 * (b - 1) * t1112 + (b - 2) * (b - 1) * t1123
    a21 = 2 * t1211 + (b - 2) * t1233
    a22 = t1212 + 4 * (b - 2) * t1213 + t1221 + (b - 2) * (b - 3) * t1234
    b11 = t1111 - t1122
    b12 = 2 * (b - 2) * (t1123 - t1112)
    b21 = -t1211 + t1233
    b22 = t1221 + t1212 + 2 * (b - 4) * t1213 - 2 * (b - 3) * t1234
    # Thm E.62
    lam_g = ((b - 1) * (a11 - a21) - (a12 - a22)) / b
    lam_l = ((b - 2) * b11 + b12 + 2 * (b - 2) * b21 + 2 * b22) / b
    lam_m = t1212 + t1221 - 4 * t1213 + 2 * t1234

    def out(x):
        return float(x) if np.ndim(x) == 0 else x

    return ProjectedEigenvalues(out(lam_g), out(lam_l), out(lam_m))


def bracket_pattern(k: int, l: int, i: int, j: int) -> tuple[int, int, int, int]:
    """Canonical equality pattern of (k, l, i, j): indices relabelled in order of first appearance."""
    seen: dict[int, int] = {}
    return tuple(seen.setdefault(x, len(seen)) for x in (k, l, i, j))  # type: ignore[return-value]


def dense_ultrasymmetric_operator(values: dict, batch_size: int) -> np.ndarray:
    """Dense B×B×B×B array ``T[k, l, i, j] = [kl|ij]`` of an ultrasymmetric operator.

    ``values`` maps every equality pattern (as returned by :func:`bracket_pattern`)
    to a number; ``[ij|kl] = [ji|lk]`` must already hold for the given values
    (patterns related by that swap must map to equal numbers).  Used to check
    :func:`projected_eigenvalues` by brute force; O(B⁴) memory.
    """
    b = check_int("batch_size", batch_size, minimum=2, maximum=64)
    t = np.empty((b, b, b, b))
    for k, l, i, j in product(range(b), repeat=4):
        t[k, l, i, j] = values[bracket_pattern(k, l, i, j)]
    return t


def eigenvalues_on_projected_space(t: np.ndarray) -> np.ndarray:
    """All eigenvalues of ``Σ ↦ G T{Σ} G`` restricted to H_B^G, by dense linear algebra.

    ``t[k, l, i, j] = T{δ_i δ_jᵀ}_{kl}``.  Returns the sorted real parts of the
    (B−1)B/2 eigenvalues (the restriction is self-adjoint by Thm 3.6, so they
    are real up to rounding).  Brute-force reference for tests; O(B⁶) time.
    """
    t = np.asarray(t, dtype=np.float64)
    b = t.shape[0]
    g = np.eye(b) - 1.0 / b
    # orthonormal basis of H_B^G: symmetrized outer products of an orthonormal basis of 1^⊥
    e = np.linalg.svd(g)[0][:, : b - 1]
    basis = []
    for p in range(b - 1):
        for q in range(p, b - 1):
            m = np.outer(e[:, p], e[:, q])
            m = m + m.T
            basis.append(m / np.linalg.norm(m))
    basis = np.array(basis)  # (d, B, B), orthonormal under the trace inner product
    images = np.einsum("klij,nij->nkl", t, basis)
    images = np.einsum("ab,nbc,cd->nad", g, images, g)
    mat = np.einsum("mkl,nkl->mn", basis, images)  # mat[m, n] = <basis_m, G T{basis_n} G>
    return np.sort(np.linalg.eigvals(mat).real)
