"""Where φ is not smooth, and where the rules must therefore be cut (private; the floor of :mod:`bnlab.theory`).

Every rule of the theory ends its panels at the kinks of x ↦ φ(γx + β) (Yang et al. 2019, Thm 3.3,
App. F.3): a panel whose integrand is analytic inside converges at the rule's full rate.  The kinks
come from :attr:`bnlab.activations.Activation.kinks` (declared by the registry, traced from an
expression, or passed with a callable, moved by the affine map x ↦ γx + β); this module only reads that
attribute, the homogeneity and the name of a resolved Activation, so it imports nothing.
"""
from __future__ import annotations

import ast
import math
from dataclasses import dataclass
from functools import lru_cache

__all__ = ["single_kink_off_zero", "theta_cuts", "needs_kink_rule", "piecewise_analytic", "analytic", "Smoothness",
           "smoothness"]


#: registry families whose base function has a kink (or a jump of a derivative) at 0
_KINKED_FAMILIES = frozenset({"relu", "alpha_relu", "leaky_relu", "abs", "elu", "selu"})


def single_kink_off_zero(act):
    """The argument x where φ(γx + β) has its kink, if it has exactly one and not at 0 (at 0 the rules' own
    cuts handle it), else None; for the pair rule of :mod:`.sphere`, which is aligned with one kink only.

    From :attr:`bnlab.activations.Activation.kinks` (registry families, traced expressions, declared
    callables) when φ has exactly one kink off 0; else −β/γ for a shifted kinked registry family."""
    off = [k for k in act.kinks if k != 0.0]
    if len(off) == 1:
        return off[0]
    if act.name not in _KINKED_FAMILIES or act.beta == 0.0:
        return None
    return -act.beta / act.gamma


def theta_cuts(act, amplitude: float) -> list[float]:
    """Angles θ ∈ (0, π) where φ(amplitude · cos θ) has a kink: θ = arccos(k/amplitude) for each
    kink k of φ with |k| < amplitude.  Used to split the 1-D angular rules (Gegenbauer
    coefficients, Thm 3.4; the sphere fixed point, Thm F.5)."""
    out = []
    for k in act.kinks:
        c = k / amplitude
        if -1.0 < c < 1.0 and k != 0.0:
            out.append(math.acos(c))
    return out


def needs_kink_rule(act, radial_power: float | None = None) -> bool:
    """Whether the spherical integrals of ``act`` need the kink-split rule of :mod:`.sphere`.

    Yes for a non-homogeneous φ with a kink anywhere (selu, elu, relu(γx + β), expressions with
    relu/abs/...), and for a positive-homogeneous φ whose integrand is singular at its kink
    (``radial_power`` < 0: φ' of relu^α with α < 1).  Smooth φ and relu-like φ with a bounded
    integrand keep the (s, θ) rule, which is exact for them.
    """
    if act.homogeneity is not None:
        return radial_power is not None and radial_power < 0.0
    return bool(act.kinks)


@dataclass(frozen=True)
class Smoothness:
    """What the choice of a spherical rule needs to know of φ's integrand, asked once (:func:`smoothness`).

    kink_rule: the kink-split rule is needed (:func:`needs_kink_rule`); singular: the integrand is singular at
    its kink (φ' of relu^α, α < 1); piecewise_analytic, analytic: as :func:`piecewise_analytic`,
    :func:`analytic`."""

    kink_rule: bool
    singular: bool
    piecewise_analytic: bool
    analytic: bool


def smoothness(act, radial_power: float | None = None) -> Smoothness:
    """The :class:`Smoothness` of the integrand φ·|s|^radial_power (the radial power matters only for a
    positive-homogeneous φ, see :func:`needs_kink_rule`)."""
    singular = act.homogeneity is not None and radial_power is not None and radial_power < 0.0
    return Smoothness(needs_kink_rule(act, radial_power), singular, piecewise_analytic(act), analytic(act))


#: registered families that are analytic on either side of each kink (so a panel ending at a kink has an
#: integrand analytic up to that end: Gauss–Legendre converges fast); alpha_relu only for integer α
_PIECEWISE_ANALYTIC_FAMILIES = frozenset({"identity", "relu", "leaky_relu", "abs", "elu", "selu"})


def piecewise_analytic(act) -> bool:
    """Whether φ is analytic on either side of each of its kinks (relu, leaky relu, abs, elu, selu, integer
    powers of relu, expressions built from them without fractional powers or sqrt), so that Gauss–Legendre
    panels ending at the kinks converge fast.  False for callables (opaque) and for anything with a
    non-integer power or sqrt (|x − k|^p, p ∉ ℤ: algebraic at the kink, where only tanh-sinh keeps its
    rate — Gauss–Legendre there would return a wrong number, e.g. λ_G↓ of |x − 0.5|^0.6 off by 23 %)."""
    if act.name in _PIECEWISE_ANALYTIC_FAMILIES:
        return True
    if act.name == "alpha_relu":
        alpha = float(act.params.get("alpha", 1.0))
        return alpha == int(alpha)
    if act.name != "expr" or act.expression is None:
        return False
    return _expression_piecewise_analytic(act.expression)


#: registered families analytic on the whole real line
_ANALYTIC_FAMILIES = frozenset({"identity", "tanh", "sigmoid", "erf", "sin", "gelu", "silu", "softplus"})


def analytic(act) -> bool:
    """Whether x ↦ φ(γx + β) is analytic on the whole line: a registered smooth family (tanh, gelu, sin, ...) or
    an expression without kinks, fractional powers or sqrt.  Then the rules need no cut anywhere and Gauss rules
    converge geometrically; a callable is opaque (it may hide a kink at 0, which the cut rules resolve) and is
    never taken for analytic."""
    if act.kinks:
        return False
    if act.name in _ANALYTIC_FAMILIES:
        return True
    return act.name == "expr" and act.expression is not None and _expression_piecewise_analytic(act.expression)


@lru_cache(maxsize=256)
def _expression_piecewise_analytic(expr: str) -> bool:
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError:
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "sqrt":
            return False
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            base_has_x = any(isinstance(n, ast.Name) and n.id == "x" for n in ast.walk(node.left))
            if not base_has_x:
                continue  # c**f(x): analytic wherever f is
            exp = node.right
            if isinstance(exp, ast.UnaryOp) and isinstance(exp.op, (ast.USub, ast.UAdd)):
                exp = exp.operand
            if not (isinstance(exp, ast.Constant) and isinstance(exp.value, (int, float))
                    and float(exp.value) == int(exp.value)):
                return False
    return True
