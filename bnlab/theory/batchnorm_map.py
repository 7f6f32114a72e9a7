"""The batchnorm transform V_Bφ(Σ) = E[B_φ(h) B_φ(h)ᵀ], h ~ N(0, Σ) (Yang et al. 2019, Eq. 8).

B_φ(h) = φ(√B G h / √(‖Gh‖² + Bε)) = φ((h − mean(h)) / √(var_B(h) + ε)),
G = I − 11ᵀ/B, var_B the biased batch variance (Eq. 7; ε = 0 in Eq. 8).

Methods (:data:`TRANSFORM_METHODS`), each an independent route:

``"laplace"``   Thm 3.2 / E.5 (:mod:`.laplace`): positive-homogeneous φ only
                (anything else is a ValueError, never a fallback); any Σ,
                ε ≥ 0; ≲ 1e-12 relative.
``"sphere"``    Thm 3.3 / App. E.3 (:mod:`.spherical`): any φ.  When
                GΣG = μG (every BSB1 Σ) it reduces to 1-D/2-D angular
                integrals accurate to ≈1e-13 (B up to 10⁶); otherwise a
                randomized quasi-Monte Carlo spherical cubature (error
                ~1e-5–1e-6, ``n_samples`` points per replicate, default 2^16).
``"fourier"``   App. E.2, Thm E.25, Eq. 32 (:mod:`.fourier`), any PSD Σ.
                GΣG = μG: closed λ-integral (Gamma density), any φ, ≈1e-13.
                Otherwise: positive-homogeneous φ, ε ≥ 0, closed s-integral and
                a real-axis λ-quadrature, ≲1e-13 (B = 128: 0.3–4 s); other φ,
                ε = 0, rank(GΣG) ≥ 3, Fourier-inverted pair density, ≲1e-7
                (meant for small B; ≈2.4 s at B = 8); non-homogeneous φ with
                ε > 0 at such Σ is a ValueError (use sphere/montecarlo).
``"montecarlo"`` direct sampling of h (the reference); standard errors from
                :func:`batchnorm_transform_montecarlo`.
``"auto"``      the most accurate applicable route: fourier/sphere (exact
                reduction) for GΣG ∝ G, else laplace for positive-homogeneous
                φ, else the spherical QMC cubature.

The result depends on Σ only through GΣG (and, when ε > 0, on its scale).
"""
from __future__ import annotations

import numpy as np

from bnlab._validation import check_choice, check_int, check_psd_matrix, check_real
from bnlab.activations import get_activation
from bnlab.theory._checks import check_batch_size
from bnlab.theory._linalg import bsb1, centering_matrix, isotropic_g_scale, psd_sqrt_factor
from bnlab.theory.fourier import fourier_transform
from bnlab.theory.laplace import laplace_transform, require_homogeneous
from bnlab.theory.spherical import isotropic_transform_entries, qmc_transform

__all__ = ["TRANSFORM_METHODS", "batchnorm_transform", "batchnorm_transform_montecarlo"]

TRANSFORM_METHODS = ("laplace", "sphere", "fourier", "montecarlo")

_DEFAULT_MC_SAMPLES = 200_000
_DEFAULT_QMC_POINTS = 2**16


def _checked_sigma(Sigma, eps) -> tuple[np.ndarray, int, float]:
    """Σ as a symmetric PSD float64 matrix, its batch size B and ε, or a ``ValueError`` naming what is wrong."""
    sigma = check_psd_matrix("Sigma", Sigma)
    b = check_batch_size(sigma.shape[0], name="Sigma.shape[0] (the batch size B)")
    eps = check_real("eps", eps, minimum=0.0)
    if eps == 0.0:
        g = centering_matrix(b)
        if float(np.trace(g @ sigma @ g)) <= 1e-300:
            raise ValueError(
                "Sigma is not allowed with eps=0: G Sigma G = 0 (every batch is constant almost surely), "
                "so batchnorm divides by a zero batch variance; use eps > 0"
            )
    return sigma, b, eps


def batchnorm_transform_montecarlo(phi, Sigma, *, n_samples, seed, eps: float = 0.0):
    """Monte Carlo estimate of V_Bφ(Σ) with per-entry standard errors.

    Draws h = L z, z ~ N(0, I), L Lᵀ = Σ (any PSD Σ), and averages
    B_φ(h)B_φ(h)ᵀ in chunks.  Accuracy: the returned standard errors
    (std of the per-sample products / √n).

    Returns
    -------
    (mean, standard_error) : two (B, B) arrays
    """
    act = get_activation(phi)
    sigma, b, eps = _checked_sigma(Sigma, eps)
    n = check_int("n_samples", n_samples, minimum=2)
    return _montecarlo(act, sigma, b, eps, n, seed)


def _montecarlo(act, sigma, b, eps, n, seed):
    rng = np.random.default_rng(seed)
    lmat = psd_sqrt_factor(sigma)
    s1 = np.zeros((b, b))
    s2 = np.zeros((b, b))
    chunk = max(1, min(n, int(4e6 // b)))
    done = 0
    while done < n:
        m = min(chunk, n - done)
        z = rng.standard_normal((m, b))
        h = z @ lmat.T
        x = h - h.mean(axis=1, keepdims=True)
        denom = np.sqrt(np.einsum("nb,nb->n", x, x) / b + eps)
        y = act(x / denom[:, None])
        # Σ_n y_i y_j and Σ_n (y_i y_j)² = Σ_n y_i² y_j² as two BLAS products (no (n, B, B) array)
        s1 += y.T @ y
        y2 = y * y
        s2 += y2.T @ y2
        done += m
    mean = s1 / n
    var = np.clip(s2 / n - mean * mean, 0.0, None) * n / (n - 1)
    return mean, np.sqrt(var / n)


def batchnorm_transform(phi, Sigma, *, method: str = "auto", eps: float = 0.0, n_samples=None, seed=None):
    """V_Bφ(Σ) = E[B_φ(h)B_φ(h)ᵀ], h ~ N(0, Σ) (Yang et al. 2019, Eq. 8; Eq. 7 for ε > 0).

    Parameters
    ----------
    phi : activation spec (name, expression, Activation or callable)
    Sigma : (B, B) array_like, symmetric PSD, B ≥ 3 (B = 2 is an explanatory ValueError)
    method : {"auto", "laplace", "sphere", "fourier", "montecarlo"}
    eps : float ≥ 0
        Batchnorm's ε; with ε > 0 the scale of Σ matters.
    n_samples : int, optional
        Samples for "montecarlo" (default 200 000) or points per QMC replicate
        for the general-Σ spherical cubature (default 2^16).
    seed : int or numpy Generator, optional
        For the random routes; same seed, same result.

    Returns
    -------
    ndarray (B, B)

    Accuracy
    --------
    See the module docstring (laplace ≲ 1e-12, sphere/fourier for GΣG ∝ G
    ≈ 1e-13, fourier at general Σ ≲ 1e-13 for homogeneous φ and ≲ 1e-7
    otherwise, spherical QMC ~1e-5, Monte Carlo O(n^{-1/2})).

    References
    ----------
    Yang et al. 2019, Eq. 8, Thm 3.2, Thm 3.3, Thm E.25, Thm F.5.
    """
    method = check_choice("method", method, ("auto",) + TRANSFORM_METHODS)
    act = get_activation(phi)
    sigma, b, eps = _checked_sigma(Sigma, eps)
    if n_samples is not None:
        n_samples = check_int("n_samples", n_samples, minimum=2)
    return _transform(act, sigma, b, eps, method, n_samples, seed)


def _transform(act, sigma: np.ndarray, b: int, eps: float, method: str, n_samples, seed) -> np.ndarray:
    """The kernel of :func:`batchnorm_transform`: φ resolved, Σ, B, ε, the method and n_samples checked."""
    mu = isotropic_g_scale(sigma)
    if method == "auto":
        if mu is not None and mu > 0:
            method = "sphere"
        elif act.homogeneity is not None and act.homogeneous_coeffs is not None and act.homogeneity > 0:
            method = "laplace"
        else:
            method = "sphere"
    if method == "montecarlo":
        return _montecarlo(act, sigma, b, eps, n_samples or _DEFAULT_MC_SAMPLES, seed)[0]
    if method == "laplace":
        require_homogeneous(act)
        return laplace_transform(act, sigma, eps=eps)[0]
    if method == "fourier":
        return fourier_transform(act, sigma, eps=eps)[0]
    # sphere
    if mu is not None and mu > 0:
        d, o, _err = isotropic_transform_entries(act, b, mu=mu, eps=eps)
        return bsb1(b, d, o)
    return qmc_transform(act, sigma, eps=eps, n_points=n_samples or _DEFAULT_QMC_POINTS, seed=seed)[0]
