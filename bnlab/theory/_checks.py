"""Boundary checks specific to the mean field theory (batch size regimes)."""
from __future__ import annotations

import warnings

from bnlab._validation import check_int

__all__ = ["check_batch_size", "SmallBatchWarning", "MAX_BATCH_SIZE"]

#: The largest B the theory takes.  Its closed forms (Thms 3.5, 3.10, G.12, H.6) evaluate polynomials of degree
#: ≤ 3 in B in float64; B ≤ 1e100 keeps B³ ≤ 1e300 below float64's 1.8e308, where a larger int made them raise
#: OverflowError ("int too large to convert to float") from inside (10**400; 10**150 in λ_G↓'s cubic).  Far
#: beyond the scale where any quantity differs from its B → ∞ limit in float64 (B ≈ 1e16), so nothing is lost.
MAX_BATCH_SIZE = 10**100


class SmallBatchWarning(UserWarning):
    """B = 3 lies in an uncommon regime of the theory (Yang et al. 2019, App. J)."""


def check_batch_size(batch_size, *, name: str = "batch_size", allow_small: bool = False) -> int:
    """Validate B for the mean field theory of BN.

    * B < 2: batch normalization is undefined (a batch of one has zero variance).
    * B > :data:`MAX_BATCH_SIZE` (1e100): beyond float64's reach of the closed forms (see there).
    * B = 2: the normalized batch is (±1, ∓1) whatever the input, so V_Bφ is
      constant, the forward map has no dynamics and every backpropagated
      gradient vanishes (Yang et al. 2019, App. J): an explanatory ValueError.
    * B = 3: the sphere S^{B-2} is a circle, the Gegenbauer index (B−3)/2 is 0
      and the expansions become Chebyshev ones; several general-B formulas
      degenerate (App. J), so a :class:`SmallBatchWarning` is issued.

    ``allow_small=True`` skips the B = 2 error (for code that handles it itself).
    """
    b = check_int(name, batch_size)
    if b > MAX_BATCH_SIZE:
        shown = str(b) if b < 10**30 else f"{str(b)[0]}.{str(b)[1:4]}e{len(str(b)) - 1} (an int of {len(str(b))} digits)"
        raise ValueError(
            f"{name}={shown} is not allowed: expected {name} <= 1e100 (the theory's closed forms evaluate powers of "
            f"B up to B³ in float64, which overflow beyond; its quantities reach their B → ∞ limits to float64 "
            f"precision by B ≈ 1e16)"
        )
    if b < 2:
        raise ValueError(f"{name}={b} is not allowed: batch normalization needs a batch of at least 2 samples")
    if b == 2 and not allow_small:
        raise ValueError(
            f"{name}=2 is not allowed here: with two samples batchnorm maps every batch to (1, -1) or (-1, 1), "
            "so the covariance dynamics are constant and all gradients through the batch statistics vanish "
            "(Yang et al. 2019, App. J); the eigenvalues and rates of the theory are undefined. Use batch_size >= 3 (B = 3 with a warning; B >= 4 is the regular regime)."
        )
    if b == 3:
        warnings.warn(
            f"{name}=3 is an uncommon regime (Yang et al. 2019, App. J): the batch lives on a circle and "
            "several general-B formulas degenerate; results come from the numerical routes and may differ "
            "qualitatively from B >= 4.",
            SmallBatchWarning,
            stacklevel=3,
        )
    return b
