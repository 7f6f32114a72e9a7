"""Random weight initializations for ensembles of networks, batched over networks.

Weights are returned as one tensor of shape ``(networks, fan_in, fan_out)``
so that a layer of the whole ensemble is a single ``torch.bmm(A, W)`` with
``A`` of shape ``(networks, batch, fan_in)``.

Schemes (``σ_w²`` = ``sigma_w2``, ``d`` = ``fan_in``):

``"gaussian"``
    iid N(0, σ_w²/d) (Yang et al. 2019, §2 and Eq. 7).
``"orthogonal"``
    σ_w·sqrt(max(d, d_out)/d)·Q with Q Haar-distributed semi-orthogonal
    (the Q factor with positive diag(R) of a Gaussian matrix, Mezzadri 2007,
    computed by CholeskyQR2 in float64),
    so that every entry has variance σ_w²/d as for ``"gaussian"``
    (Yang et al. 2019, Fig. 2: "random orthogonal initialization").
``"uniform"``
    iid U[−a, a] with a = sqrt(3σ_w²/d) (variance σ_w²/d).
``"asymmetric_uniform"``
    iid U[0, 2σ_w/sqrt(d)]; with σ_w = 1 this is exactly the
    U[0, 2/sqrt(d_l)] initialization of Daneshmand et al. 2020, §5
    ("Breaking batchnorm"), whose variance 1/(3d) equals that of PyTorch's
    default U[−1/sqrt(d), 1/sqrt(d)] but whose mean is not zero.

Random numbers are always drawn in float32 from the given
``torch.Generator`` and then cast to the requested dtype, so a float64 and a
float32 simulation with the same seed use exactly the same networks (the
float32 rounding of the weights, relative 2^-24, is irrelevant to the
statistics).  Same generator state → same weights.
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import torch

from bnlab._validation import check_choice, check_int, check_real
from bnlab._vocabulary import INIT_ALIASES, canonical_value

__all__ = ["INITS", "init_weights"]

#: The weight initialization schemes :func:`init_weights` accepts.
INITS = ("gaussian", "orthogonal", "uniform", "asymmetric_uniform")


def init_weights(
    init: str,
    networks: int,
    fan_in: int,
    fan_out: int,
    *,
    sigma_w2: float = 1.0,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> torch.Tensor:
    """Draw the weights of one layer of ``networks`` independent networks.

    Parameters
    ----------
    init : str
        One of :data:`INITS`.
    networks, fan_in, fan_out : int
        Shape ``(networks, fan_in, fan_out)`` of the result (≥ 1 each).
    sigma_w2 : float
        Weight variance scale σ_w² > 0 (entry variance σ_w²/fan_in, except
        ``"asymmetric_uniform"``: see the module docstring).
    generator : torch.Generator or sequence of them, optional
        Source of randomness (on ``device``); same state → same weights.  A
        sequence gives one generator per network (network i is drawn from
        ``generator[i]`` only, so it does not depend on the other networks).
    dtype, device
        Of the returned tensor.

    Returns
    -------
    torch.Tensor
        Weights ``W`` with ``h = a @ W`` computing a layer for row vectors ``a``.
    """
    init = check_choice("init", canonical_value("init", init, INIT_ALIASES), INITS)
    networks = check_int("networks", networks, minimum=1)
    fan_in = check_int("fan_in", fan_in, minimum=1)
    fan_out = check_int("fan_out", fan_out, minimum=1)
    sigma_w2 = check_real("sigma_w2", sigma_w2, minimum=0.0, strict_minimum=True)
    return _draw(init, networks, fan_in, fan_out, sigma_w2, generator, dtype, device)


_POOLS: dict[tuple[str, int], ThreadPoolExecutor] = {}


def fill_(w: torch.Tensor, generator, kind: str, a: float = 0.0, b: float = 1.0) -> torch.Tensor:
    """Fill ``w`` in place with N(a, b²) (``kind="normal"``) or U[a, b) numbers.

    ``generator`` is one torch.Generator for the whole tensor or one per entry of
    the leading dimension.  Per-network generators on the CPU run in a thread
    pool (torch releases the GIL while filling), because the scalar CPU random
    number generator, not the matmul, is the bottleneck of a wide simulation.
    """
    def one(t, g):
        return t.normal_(a, b, generator=g) if kind == "normal" else t.uniform_(a, b, generator=g)

    if generator is None or isinstance(generator, torch.Generator):
        return one(w, generator)
    gens = list(generator)
    if len(gens) != w.shape[0]:
        raise ValueError(f"generator is not allowed: {len(gens)} generators for {w.shape[0]} networks")
    threads = torch.get_num_threads()
    if w.device.type == "cpu" and threads > 1 and len(gens) > 1:
        list(_thread_pool(threads).map(lambda i: one(w[i], gens[i]), range(len(gens))))
    else:
        for i, g in enumerate(gens):
            one(w[i], g)
    return w


def _thread_pool(threads: int, purpose: str = "kernels") -> ThreadPoolExecutor:
    """A cached pool of ``threads`` worker threads (torch releases the GIL in its kernels).

    One pool per ``purpose``: work submitted from inside a pool's task must go to another
    pool, or a full pool would wait on itself (networks.py runs chunks in "chunks", whose
    work may use "kernels")."""
    key = (purpose, threads)
    if key not in _POOLS:
        _POOLS[key] = ThreadPoolExecutor(max_workers=threads)
    return _POOLS[key]


def _draw(init, networks, fan_in, fan_out, sigma_w2, generator, dtype, device) -> torch.Tensor:
    shape = (networks, fan_in, fan_out)
    w = torch.empty(shape, dtype=torch.float32, device=device)
    sigma_w = math.sqrt(sigma_w2)
    if init == "gaussian":
        fill_(w, generator, "normal", 0.0, sigma_w / math.sqrt(fan_in))
        return w.to(dtype)
    if init == "uniform":
        a = math.sqrt(3.0 * sigma_w2 / fan_in)
        fill_(w, generator, "uniform", -a, a)
        return w.to(dtype)
    if init == "asymmetric_uniform":
        fill_(w, generator, "uniform", 0.0, 2.0 * sigma_w / math.sqrt(fan_in))
        return w.to(dtype)
    # orthogonal: the Q factor (positive diag R) of a tall Gaussian matrix is exactly Haar
    # (Mezzadri 2007).  It is computed by CholeskyQR2 in float64 — Q = G R⁻¹ with RᵀR = GᵀG,
    # done twice — which is orthogonal to ~1e-15 for cond(G) < 1e7 and, being matmuls and a
    # Cholesky, is much faster than batched Householder QR on a CPU; if a Cholesky fails
    # (cond(G) ≳ 1e8, probability ~1e-7 per matrix at d = 1000) Householder QR is used.
    fill_(w, generator, "normal")
    tall = fan_in >= fan_out
    g = (w if tall else w.transpose(1, 2)).to(torch.float64)
    q = _cholesky_qr(_cholesky_qr(g))
    if not tall:
        q = q.transpose(1, 2)
    # entries of a Haar semi-orthogonal matrix have variance 1/max(d_in, d_out)
    return (q * (sigma_w * math.sqrt(max(fan_in, fan_out) / fan_in))).to(dtype)


def _cholesky_qr(g: torch.Tensor) -> torch.Tensor:
    """Q of g = QR with diag(R) > 0, for tall (…, m, n), m ≥ n, float64."""
    chol, info = torch.linalg.cholesky_ex(g.transpose(-1, -2) @ g)
    if bool((info != 0).any()):
        q, r = torch.linalg.qr(g, mode="reduced")
        signs = torch.sign(torch.diagonal(r, dim1=-2, dim2=-1))
        signs = torch.where(signs == 0, torch.ones_like(signs), signs)
        return q * signs.unsqueeze(-2)
    # Q = g L^{-T}: solve X Lᵀ = g with Lᵀ upper triangular
    return torch.linalg.solve_triangular(chol.transpose(-1, -2), g, upper=True, left=False)
