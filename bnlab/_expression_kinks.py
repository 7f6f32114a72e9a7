"""Where an expression φ(x) is not smooth: traced from its syntax tree (private to bnlab.activations).

A kink of an expression built from the whitelisted functions can only sit where the argument of a
non-smooth function crosses its own kink: relu, abs, sign, elu, selu (kinked at 0), sqrt (φ'
singular at 0), max/min/maximum/minimum (kinked where their two arguments are equal).  So the
kinks are the zeros of those arguments (and, as singular points, the zeros of denominators, of
log's argument and of bases raised to negative or fractional powers) (of a − b for max/min), which this module finds by
evaluating each argument on a grid in x and refining every sign change by bisection, all at once, to
two adjacent floats (the one where |argument| is smaller is the kink; :func:`_refine`); an argument
that vanishes on a whole interval (relu(relu(x) ...)) contributes the ends of that interval.

Grid: 16385 points on [−64, 64] (spacing 0.0078, which covers |√B u| ≤ 45 for every B the
quadrature routes accept, up to 2048) plus 200 geometric points out to ±1e6 on each side
(kinks far out matter once φ(γx + β) moves them in).  Two sign changes closer together than the
grid spacing (abs(x² − 1e-6)) and zeros where the argument touches 0 without changing sign are
not seen; the former can be declared with ``Activation(..., kinks=)`` through
:func:`bnlab.activations.activation_from_callable`, the latter are not kinks of relu/abs/max (the
composite is smooth there) but are of sqrt — declare them.
"""

from __future__ import annotations

import ast
from typing import Callable

import numpy as np

__all__: list[str] = []

#: Whitelisted functions that are not smooth where their (single) argument vanishes.
KINKED_AT_ZERO = frozenset({"relu", "abs", "sign", "elu", "selu", "sqrt"})
#: Two-argument functions kinked where their arguments are equal.
KINKED_AT_TIE = frozenset({"max", "min", "maximum", "minimum"})


def _grid() -> np.ndarray:
    inner = np.linspace(-64.0, 64.0, 16385)
    outer = np.geomspace(64.0, 1e6, 201)[1:]
    return np.concatenate([-outer[::-1], inner, outer])


def _ordered(x: np.ndarray) -> np.ndarray:
    """float64 → int64 keys in the order of the floats (−0.0 and 0.0 share the key 0): adjacent floats
    have adjacent keys, so a bisection on the keys ends at adjacent floats within 64 halvings."""
    bits = x.view(np.int64)
    return np.where(bits < 0, -(bits & np.int64(0x7FFFFFFFFFFFFFFF)), bits)


def _unordered(k: np.ndarray) -> np.ndarray:
    bits = np.where(k < 0, (-k) | np.int64(-0x8000000000000000), k)
    return bits.view(np.float64)


def _refine(g: Callable[[np.ndarray], np.ndarray], lo: np.ndarray, hi: np.ndarray, s_lo: np.ndarray) -> np.ndarray:
    """Roots of ``g`` in the brackets [lo, hi] (g(lo) has the sign ``s_lo``, g(hi) the other), all at once.

    Bisection on the floats' order (:func:`_ordered`) rather than on their values: every bracket ends
    at two adjacent floats (or at an exact zero) after at most 64 vectorized evaluations of ``g``, however
    many brackets there are and whatever their magnitude.  (The former loop of one ``brentq`` per
    bracket, to 1e-15 relative, cost up to 200 Python-level evaluations per bracket: 4.5 s for the
    3 854 brackets of ``x/sin(pi**x)``.)  Of the two final floats the one with the smaller |g| is the
    root; a bracket where g turns non-finite keeps its midpoint, as the loop did when brentq failed."""
    a, b = _ordered(lo), _ordered(hi)
    root = np.full(lo.shape, np.nan)
    active = np.ones(lo.shape, dtype=bool)
    for _ in range(70):  # 64 halvings end every bracket; a few more for safety
        active &= (b - a) > 1
        if not active.any():
            break
        i = np.nonzero(active)[0]
        m = a[i] + (b[i] - a[i]) // 2
        with np.errstate(all="ignore"):
            v = np.asarray(g(_unordered(m)), dtype=np.float64)
        s = np.sign(v)
        same = s == s_lo[i]
        other = s == -s_lo[i]
        a[i[same]] = m[same]
        b[i[other]] = m[other]
        hit = v == 0.0
        root[i[hit]] = _unordered(m[hit])
        lost = ~(same | other | hit)  # NaN: give up on this bracket, as brentq's failure did
        root[i[lost]] = 0.5 * (_unordered(a[i[lost]]) + _unordered(b[i[lost]]))
        active[i[hit | lost]] = False
    rest = np.isnan(root)
    if rest.any():
        xa, xb = _unordered(a[rest]), _unordered(b[rest])
        with np.errstate(all="ignore"):
            va = np.abs(np.asarray(g(xa), dtype=np.float64))
            vb = np.abs(np.asarray(g(xb), dtype=np.float64))
        root[rest] = np.where(vb < va, xb, xa)
    return root


def _zeros(g: Callable[[np.ndarray], np.ndarray], grid: np.ndarray) -> set[float]:
    with np.errstate(all="ignore"):
        v = np.asarray(g(grid), dtype=np.float64)
    if v.shape != grid.shape:
        return set()  # an argument that does not depend on x
    finite = np.isfinite(v)
    zero = finite & (v == 0.0)
    s = np.sign(np.where(finite, v, np.nan))
    change = np.nonzero(finite[:-1] & finite[1:] & (s[:-1] * s[1:] < 0))[0]
    out = {float(r) for r in _refine(g, grid[change], grid[change + 1], s[change])} if change.size else set()
    # exact zeros at grid points: isolated ones, or the ends of a run of zeros
    idx = np.nonzero(zero)[0]
    for i in idx:
        left = i > 0 and zero[i - 1]
        right = i + 1 < zero.size and zero[i + 1]
        if not (left and right):
            out.add(float(grid[i]))
    return out


def expression_kinks(tree: ast.Expression, evaluate: Callable[[str, np.ndarray], np.ndarray]) -> tuple[float, ...]:
    """Sorted kinks of the expression ``tree``; ``evaluate(src, x)`` evaluates a sub-expression
    (source text) elementwise on a float64 array x."""
    grid = _grid()
    found: set[float] = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        name = node.func.id
        if name in KINKED_AT_ZERO and len(node.args) == 1:
            src = ast.unparse(node.args[0])
        elif name in KINKED_AT_TIE and len(node.args) == 2:
            src = f"({ast.unparse(node.args[0])}) - ({ast.unparse(node.args[1])})"
        else:
            continue
        found |= _zeros(lambda x, src=src: evaluate(src, x), grid)
    for node in ast.walk(tree):
        # singular points: zeros of a denominator, of a log's argument, of a base raised to a negative or
        # fractional power (the theory's admissibility check measures how singular φ is there)
        src = None
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            src = ast.unparse(node.right)
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.Pow):
            expo = node.right
            if not (isinstance(expo, ast.Constant) and float(expo.value).is_integer() and expo.value >= 0):
                src = ast.unparse(node.left)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("log", "log1p"):
            src = ast.unparse(node.args[0]) if node.func.id == "log" else f"1 + ({ast.unparse(node.args[0])})"
        if src is not None:
            found |= _zeros(lambda x, src=src: evaluate(src, x), grid)
    return tuple(sorted(found))
