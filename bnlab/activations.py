"""Nonlinearities φ for every part of bnlab.

An :class:`Activation` bundles what the theories need of a coordinatewise
nonlinearity φ:

* ``φ`` itself, as a NumPy function (float64, for the theory engine) and as a
  torch function (for the finite-width simulator, autograd-compatible);
* its derivative ``φ'`` (backward dynamics, Yang et al. 2019 App. G);
* its positive-homogeneity degree α when it has one, together with the
  coefficients (a, b) of the decomposition ``φ(x) = a ρ_α(x) − b ρ_α(−x)`` with
  ``ρ_α(x) = relu(x)^α`` (Yang et al. 2019, Thm I.3 and App. E.1), which the
  Laplace method and the closed forms need;
* the pre-activation scale and shift ``φ(γx + β)`` (Yang et al. 2019 §3.1.2,
  Fig. 5), kept as ``gamma`` and ``beta``.

Activations come from three places:

* the registry of named nonlinearities (:func:`list_activations`), e.g.
  ``get_activation("alpha_relu", alpha=2)``;
* an expression in ``x`` such as ``"tanh(2*x) + 0.1*x"``, parsed by the
  ``simpleeval`` library after a whitelist check of the syntax tree (numbers,
  ``x``, ``pi``, ``e``, ``+ - * / **``, and calls of the functions in
  :data:`EXPRESSION_FUNCTIONS`); Python ``eval`` is never used, and anything
  else (attribute access, subscripts, imports, unknown names, lambdas) is a
  ``ValueError``.  The derivative of an expression is exact (torch autograd);
* any Python callable, via :func:`activation_from_callable`; without an
  explicit derivative a central finite difference is used (relative error
  ≈ 1e-9 for smooth φ, documented in that function).
"""
from __future__ import annotations

import ast
import math
import numbers
import operator
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

import numpy as np
from scipy import special

__all__ = [
    "Activation",
    "get_activation",
    "list_activations",
    "activation_from_expression",
    "activation_from_callable",
    "EXPRESSION_FUNCTIONS",
]

ArrayFn = Callable[[np.ndarray], np.ndarray]

_SELU_LAMBDA = 1.0507009873554804934193349852946
_SELU_ALPHA = 1.6732632423543772848170429916717
_SQRT_2 = math.sqrt(2.0)
_SQRT_2PI = math.sqrt(2.0 * math.pi)


def _torch():
    # torch is imported on first use only: the theory engine is pure NumPy/SciPy and should not pay
    # torch's multi-second import for `import bnlab` or `bnlab theory`.
    import torch

    return torch


def _lazy_torch(path: str, **kwargs):
    """A function x ↦ torch.<path>(x, **kwargs), resolving torch at call time."""

    def fn(x):
        obj = _torch()
        for part in path.split("."):
            obj = getattr(obj, part)
        return obj(x, **kwargs)

    fn.__name__ = f"torch_{path.replace('.', '_')}"
    return fn


@dataclass(frozen=True, eq=False)
class Activation:
    """A coordinatewise nonlinearity x ↦ φ(γx + β) with its derivative.

    Attributes
    ----------
    name:
        Registry name (``"relu"``), ``"expr"`` for expressions or
        ``"callable"`` for user functions.
    params:
        Parameters of the named family (e.g. ``{"alpha": 2.0}``).
    gamma, beta:
        Pre-activation scale and shift: the activation computes φ(γx + β).
    homogeneity:
        Degree α if x ↦ φ(γx + β) is positive-homogeneous
        (φ(cx) = c^α φ(x) for c > 0), else ``None``.
    homogeneous_coeffs:
        (a, b) with φ(γx) = a ρ_α(x) − b ρ_α(−x), ρ_α = relu^α (Yang et al.
        2019, Thm I.3), when ``homogeneity`` is not ``None``.
    expression:
        The source expression, for activations parsed from text.
    """

    name: str
    _base: ArrayFn = field(repr=False)
    _base_deriv: ArrayFn | None = field(repr=False)
    _base_torch: Callable[[Any], Any] | None = field(repr=False, default=None)
    params: Mapping[str, float] = field(default_factory=dict)
    gamma: float = 1.0
    beta: float = 0.0
    base_homogeneity: float | None = None
    base_homogeneous_coeffs: tuple[float, float] | None = None
    expression: str | None = None
    deriv_is_exact: bool = True
    base_kinks: tuple[float, ...] = ()

    @property
    def kinks(self) -> tuple[float, ...]:
        """Points x where x ↦ φ(γx + β) is not smooth (φ or a derivative jumps or is singular), sorted.

        The kinks u_k of the base φ (declared by the registry, traced from an expression, or passed
        to :func:`activation_from_callable`) moved by the affine map: x_k = (u_k − β)/γ.  The theory's
        quadrature rules split their panels there (``bnlab.theory``; Yang et al. 2019, Thm 3.3).
        """
        return tuple(sorted((u - self.beta) / self.gamma for u in self.base_kinks))

    # -- evaluation -------------------------------------------------------
    def __call__(self, x: np.ndarray | float) -> np.ndarray:
        """φ(γx + β), elementwise, in float64."""
        x = np.asarray(x, dtype=np.float64)
        return self._base(self.gamma * x + self.beta)

    def derivative(self, x: np.ndarray | float) -> np.ndarray:
        """d/dx φ(γx + β) = γ φ'(γx + β), elementwise."""
        x = np.asarray(x, dtype=np.float64)
        u = self.gamma * x + self.beta
        if self._base_deriv is None:
            return self.gamma * _central_difference(self._base, u)
        return self.gamma * self._base_deriv(u)

    def torch(self, x):
        """φ(γx + β) on a torch tensor (autograd-compatible; used by ``bnlab.sim``)."""
        if self._base_torch is None:
            raise ValueError(
                f"activation {self.spec!r} has no torch implementation; pass "
                "torch_fn= to activation_from_callable to use it in simulations"
            )
        return self._base_torch(self.gamma * x + self.beta if (self.gamma != 1.0 or self.beta != 0.0) else x)

    # -- structure ----------------------------------------------------------
    @property
    def homogeneity(self) -> float | None:
        """Positive-homogeneity degree α of x ↦ φ(γx + β), or None."""
        if self.base_homogeneity is None or self.beta != 0.0:
            return None
        return self.base_homogeneity

    @property
    def is_positive_homogeneous(self) -> bool:
        return self.homogeneity is not None

    @property
    def homogeneous_coeffs(self) -> tuple[float, float] | None:
        """(a, b) such that φ(γx) = a ρ_α(x) − b ρ_α(−x) (Yang et al. 2019, Thm I.3)."""
        if self.homogeneity is None or self.base_homogeneous_coeffs is None:
            return None
        a, b = self.base_homogeneous_coeffs
        alpha = self.base_homogeneity
        g = abs(self.gamma) ** alpha
        if self.gamma > 0:
            return (a * g, b * g)
        # φ(−|γ|x) = a ρ(−|γ|x) − b ρ(|γ|x) = −b|γ|^α ρ(x) − (−a|γ|^α) ρ(−x)
        return (-b * g, -a * g)

    @property
    def spec(self) -> str:
        """A short, human- and JSON-friendly description, e.g. ``alpha_relu(alpha=2)``."""
        if self.expression is not None:
            core = self.expression
        else:
            core = self.name
            if self.params:
                core += "(" + ", ".join(f"{k}={v:g}" for k, v in self.params.items()) + ")"
        if self.gamma != 1.0 or self.beta != 0.0:
            core += f" [gamma={self.gamma:g}, beta={self.beta:g}]"
        return core

    def with_affine(self, gamma: float = 1.0, beta: float = 0.0) -> "Activation":
        """The activation x ↦ φ(γx + β), composing with any existing γ, β."""
        gamma = _check_real("gamma", gamma)
        beta = _check_real("beta", beta)
        if gamma == 0.0:
            raise ValueError("gamma=0.0 is not allowed: φ(0·x + β) is constant; use gamma != 0")
        if gamma == 1.0 and beta == 0.0:
            # the same object back: resolving an Activation is free and keeps its identity, so the
            # per-(φ, B) caches of the theory (keyed on the Activation) are shared by every caller
            return self
        # φ(γ1(γ2 x + β2) + β1) = φ(γ1γ2 x + γ1β2 + β1)
        return replace(self, gamma=self.gamma * gamma, beta=self.gamma * beta + self.beta)

    def to_config(self) -> dict:
        """A JSON-serializable description that :func:`get_activation` accepts back."""
        if self.name == "callable":
            raise ValueError("activations built from Python callables have no JSON config")
        cfg: dict[str, Any] = {"phi": self.expression if self.expression is not None else self.name}
        cfg.update(self.params)
        if self.gamma != 1.0:
            cfg["gamma"] = self.gamma
        if self.beta != 0.0:
            cfg["beta"] = self.beta
        return cfg

    def __reduce__(self):
        # Named and expression activations are rebuilt from their config so that
        # they pickle with plain pickle (Dask, multiprocessing); callables rely on
        # cloudpickle pickling the dataclass fields.
        if self.name == "callable":
            return object.__reduce__(self)
        return (_from_config, (self.to_config(),))

    def __repr__(self) -> str:
        return f"Activation({self.spec})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Activation):
            return NotImplemented
        if self.name == "callable" or other.name == "callable":
            return self is other
        return self.to_config() == other.to_config()

    def __hash__(self) -> int:
        if self.name == "callable":
            return id(self)
        return hash(tuple(sorted(self.to_config().items())))


def _from_config(cfg: dict) -> Activation:
    cfg = dict(cfg)
    return get_activation(cfg.pop("phi"), **cfg)


def _central_difference(f: ArrayFn, u: np.ndarray) -> np.ndarray:
    # Step h = ε^(1/3)·max(1, |u|) balances truncation O(h²) and rounding O(ε/h):
    # relative error ≈ ε^(2/3) ≈ 4e-11 · |f'''|/|f'| for smooth f.
    h = np.cbrt(np.finfo(np.float64).eps) * np.maximum(1.0, np.abs(u))
    return (f(u + h) - f(u - h)) / (2.0 * h)


def _check_real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name}={value!r} is not allowed: expected a real number")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name}={value!r} is not allowed: expected a finite real number")
    return value


# ---------------------------------------------------------------------------
# Named activations
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class _Family:
    make: Callable[..., dict]
    params: Mapping[str, float]  # parameter names with defaults
    doc: str


def _relu(x):
    return np.maximum(x, 0.0)


def _heaviside(x):
    return (x > 0).astype(np.float64)


def _sigmoid(x):
    return special.expit(x)


def _make_identity():
    return dict(fn=lambda x: x, deriv=np.ones_like, torch_fn=lambda x: x, alpha=1.0, coeffs=(1.0, 1.0))


def _make_relu():
    return dict(fn=_relu, deriv=_heaviside, torch_fn=_lazy_torch("relu"), alpha=1.0, coeffs=(1.0, 0.0))


def _make_alpha_relu(alpha: float):
    alpha = _check_real("alpha", alpha)
    if alpha <= 0:
        raise ValueError(f"alpha={alpha!r} is not allowed: alpha_relu needs alpha > 0")

    def fn(x):
        return np.where(x > 0, np.abs(x) ** alpha, 0.0)

    def deriv(x):
        with np.errstate(divide="ignore"):
            return np.where(x > 0, alpha * np.abs(x) ** (alpha - 1.0), 0.0)

    return dict(fn=fn, deriv=deriv, torch_fn=lambda x: _torch().relu(x) ** alpha, alpha=alpha, coeffs=(1.0, 0.0))


def _make_leaky_relu(slope: float):
    slope = _check_real("slope", slope)
    return dict(
        fn=lambda x: np.where(x > 0, x, slope * x),
        deriv=lambda x: np.where(x > 0, 1.0, slope),
        torch_fn=_lazy_torch("nn.functional.leaky_relu", negative_slope=slope),
        alpha=1.0,
        coeffs=(1.0, slope),  # x⁺ − slope·(−x)⁺
    )


def _make_abs():
    return dict(fn=np.abs, deriv=np.sign, torch_fn=_lazy_torch("abs"), alpha=1.0, coeffs=(1.0, -1.0))


def _make_tanh():
    return dict(fn=np.tanh, deriv=lambda x: 1.0 / np.cosh(x) ** 2, torch_fn=_lazy_torch("tanh"))


def _make_sigmoid():

    def deriv(x):
        s = _sigmoid(x)
        return s * (1.0 - s)

    return dict(fn=_sigmoid, deriv=deriv, torch_fn=_lazy_torch("sigmoid"))


def _make_erf():
    return dict(fn=special.erf, deriv=lambda x: (2.0 / math.sqrt(math.pi)) * np.exp(-x * x), torch_fn=_lazy_torch("erf"))


def _make_sin():
    return dict(fn=np.sin, deriv=np.cos, torch_fn=_lazy_torch("sin"))


def _make_gelu():

    def fn(x):
        return 0.5 * x * special.erfc(-x / _SQRT_2)

    def deriv(x):
        return 0.5 * special.erfc(-x / _SQRT_2) + x * np.exp(-0.5 * x * x) / _SQRT_2PI

    return dict(fn=fn, deriv=deriv, torch_fn=_lazy_torch("nn.functional.gelu"))


def _make_silu():

    def deriv(x):
        s = _sigmoid(x)
        return s * (1.0 + x * (1.0 - s))

    return dict(fn=lambda x: x * _sigmoid(x), deriv=deriv, torch_fn=_lazy_torch("nn.functional.silu"))


def _make_elu(alpha: float):
    alpha = _check_real("alpha", alpha)
    return dict(
        fn=lambda x: np.where(x > 0, x, alpha * np.expm1(np.minimum(x, 0.0))),
        deriv=lambda x: np.where(x > 0, 1.0, alpha * np.exp(np.minimum(x, 0.0))),
        torch_fn=_lazy_torch("nn.functional.elu", alpha=alpha),
    )


def _make_selu():
    lam, a = _SELU_LAMBDA, _SELU_ALPHA
    return dict(
        fn=lambda x: lam * np.where(x > 0, x, a * np.expm1(np.minimum(x, 0.0))),
        deriv=lambda x: lam * np.where(x > 0, 1.0, a * np.exp(np.minimum(x, 0.0))),
        torch_fn=_lazy_torch("nn.functional.selu"),
    )


def _make_softplus():
    return dict(fn=lambda x: np.logaddexp(0.0, x), deriv=_sigmoid, torch_fn=_lazy_torch("nn.functional.softplus"))


_REGISTRY: dict[str, _Family] = {
    "identity": _Family(_make_identity, {}, "φ(x) = x (positive-homogeneous, α = 1)"),
    "relu": _Family(_make_relu, {}, "φ(x) = max(x, 0) (positive-homogeneous, α = 1)"),
    "alpha_relu": _Family(
        _make_alpha_relu, {"alpha": 1.0}, "φ(x) = relu(x)^α (positive-homogeneous of degree α; Yang et al. 2019 Fig. 1c)"
    ),
    "leaky_relu": _Family(_make_leaky_relu, {"slope": 0.01}, "φ(x) = x if x > 0 else slope·x (α = 1)"),
    "abs": _Family(_make_abs, {}, "φ(x) = |x| (positive-homogeneous, α = 1)"),
    "tanh": _Family(_make_tanh, {}, "φ(x) = tanh(x)"),
    "sigmoid": _Family(_make_sigmoid, {}, "φ(x) = 1 / (1 + e^−x)"),
    "erf": _Family(_make_erf, {}, "φ(x) = erf(x)"),
    "sin": _Family(_make_sin, {}, "φ(x) = sin(x)"),
    "gelu": _Family(_make_gelu, {}, "φ(x) = x Φ(x), Φ the standard normal CDF (exact, not the tanh approximation)"),
    "silu": _Family(_make_silu, {}, "φ(x) = x σ(x) (swish)"),
    "elu": _Family(_make_elu, {"alpha": 1.0}, "φ(x) = x if x > 0 else α(e^x − 1)"),
    "selu": _Family(_make_selu, {}, "φ(x) = λ·elu_α(x), λ ≈ 1.0507, α ≈ 1.6733"),
    "softplus": _Family(_make_softplus, {}, "φ(x) = log(1 + e^x)"),
}


#: Registered families that are not smooth, with their kinks (φ or φ' or a higher derivative jumps at 0;
#: alpha_relu with α < 1 has a singular φ' there).
_KINKED_FAMILIES: dict[str, tuple[float, ...]] = {
    "relu": (0.0,), "alpha_relu": (0.0,), "leaky_relu": (0.0,), "abs": (0.0,), "elu": (0.0,), "selu": (0.0,),
}


def list_activations() -> dict[str, str]:
    """Names of the registered nonlinearities with a one-line description each."""
    out = {}
    for name, fam in _REGISTRY.items():
        extra = ", ".join(f"{k}={v:g}" for k, v in fam.params.items())
        out[name] = fam.doc + (f" [parameters: {extra}]" if extra else "")
    return out


def get_activation(
    phi: "str | Activation | Callable[[np.ndarray], np.ndarray]",
    *,
    gamma: float = 1.0,
    beta: float = 0.0,
    **params: float,
) -> Activation:
    """Resolve ``phi`` to an :class:`Activation` computing φ(γx + β).

    This is bnlab's one resolution of φ: every public function that accepts a
    nonlinearity calls it once at its entry and hands the :class:`Activation`
    down; internal functions take an :class:`Activation` and never resolve
    again.  An :class:`Activation` with γ = 1, β = 0 and no parameters comes
    back as the same object.

    Parameters
    ----------
    phi:
        A registered name (see :func:`list_activations`), an expression in
        ``x`` (e.g. ``"tanh(2*x)+0.1*x"``), an :class:`Activation`, or a
        Python callable acting elementwise on float64 arrays.
    gamma, beta:
        Pre-activation scale and shift (Yang et al. 2019 §3.1.2).
    **params:
        Parameters of a named family: ``alpha`` for ``alpha_relu`` and
        ``elu``, ``slope`` for ``leaky_relu``.

    Raises
    ------
    ValueError
        For an unknown name, an unsafe or malformed expression, an unknown or
        invalid parameter, or gamma = 0.
    """
    if isinstance(phi, Activation):
        if params:
            raise ValueError(f"parameters {sorted(params)} cannot be applied to an existing Activation {phi.spec!r}")
        return phi.with_affine(gamma, beta)
    if callable(phi):
        if params:
            raise ValueError(f"parameters {sorted(params)} are not allowed with a callable phi")
        return activation_from_callable(phi).with_affine(gamma, beta)
    if not isinstance(phi, str):
        raise ValueError(f"phi={phi!r} is not allowed: expected a name, an expression in x, an Activation or a callable")
    key = phi.strip().lower().replace("-", "_")
    if key in _REGISTRY:
        fam = _REGISTRY[key]
        unknown = set(params) - set(fam.params)
        if unknown:
            allowed = sorted(fam.params) or "none"
            raise ValueError(f"parameter(s) {sorted(unknown)} not allowed for phi={key!r}; allowed: {allowed}")
        full = {**fam.params, **params}
        made = fam.make(**full)
        act = Activation(
            name=key,
            _base=made["fn"],
            _base_deriv=made["deriv"],
            _base_torch=made["torch_fn"],
            params={k: float(v) for k, v in full.items()},
            base_homogeneity=made.get("alpha"),
            base_homogeneous_coeffs=made.get("coeffs"),
            base_kinks=_KINKED_FAMILIES.get(key, ()),
        )
        return act.with_affine(gamma, beta)
    if params:
        raise ValueError(
            f"phi={phi!r} is not a registered name (known: {', '.join(_REGISTRY)}); "
            f"parameters {sorted(params)} only apply to named activations"
        )
    if key.isidentifier() and key != "x":
        # A bare word is almost surely a mistyped name, not an expression: say that.
        raise ValueError(
            f"phi={phi!r} is not allowed: not a registered activation (known: {', '.join(_REGISTRY)}) "
            "and not an expression in x (e.g. 'tanh(2*x)+0.1*x')"
        )
    return activation_from_expression(phi).with_affine(gamma, beta)


def activation_from_callable(
    fn: Callable[[np.ndarray], np.ndarray],
    derivative: Callable[[np.ndarray], np.ndarray] | None = None,
    *,
    torch_fn: Callable[[Any], Any] | None = None,
    homogeneity: float | None = None,
    homogeneous_coeffs: tuple[float, float] | None = None,
    kinks: "tuple[float, ...] | list[float] | None" = None,
) -> Activation:
    """Wrap a user callable acting elementwise, written for NumPy or for torch.

    What is accepted: ``fn`` is called with a float64 NumPy array and must return an array (or
    anything ``np.asarray`` takes) of the same shape, e.g. ``lambda x: np.tanh(x)``; if that
    fails or returns a torch tensor, it is called with a float64 torch tensor instead and must
    return a tensor of the same shape, e.g. ``lambda x: torch.tanh(x)``.  A function that works
    on neither (e.g. one using ``math.tanh``, which takes scalars only) is a ``ValueError`` that
    says how to adapt it (``np.vectorize(f)`` or the NumPy/torch version of each call).  φ must be real:
    a complex result is a ``ValueError``; an integer or boolean torch result (a step, a rounding) is taken in
    the input's floating dtype.

    Derivative: ``derivative`` when given; otherwise, for a torch callable, exact by autograd
    (``fn`` is also the torch implementation for ``bnlab.sim``); for a NumPy callable, a central
    finite difference with step ε^(1/3)·max(1, |x|) (relative error ≈ 1e-10 for smooth φ; O(1) at
    kinks, so pass the derivative for piecewise functions).

    ``kinks``: the points where φ is not smooth (φ or a derivative jumps, or φ' is singular).
    A callable is opaque, so they cannot be traced as for expressions; declaring them lets the
    theory's quadrature rules split there (1e-6 → 1e-12 for relu(x − 0.3)-like φ; see
    docs/theory-methods.md).  ``homogeneity`` and ``homogeneous_coeffs`` (a, b with
    φ = a ρ_α(x) − b ρ_α(−x)) enable the Laplace method and closed forms; they are the caller's
    claim and are spot-checked here (a positive-homogeneous φ is kinked at 0 at most).
    """
    if not callable(fn):
        raise ValueError(f"fn={fn!r} is not callable")
    probe = np.linspace(-3.0, 3.0, 7)
    base, base_deriv, base_torch, exact = _wrap_callable(fn, probe)
    if torch_fn is None:
        torch_fn = base_torch
    if derivative is not None:
        base_deriv = lambda x: np.asarray(derivative(x), dtype=np.float64)  # noqa: E731
        exact = True
    out = base(probe)
    if (homogeneity is None) != (homogeneous_coeffs is None):
        raise ValueError("homogeneity and homogeneous_coeffs must be given together")
    if homogeneity is not None:
        homogeneity = _check_real("homogeneity", homogeneity)
        a, b = (float(c) for c in homogeneous_coeffs)
        expected = a * np.maximum(probe, 0) ** homogeneity - b * np.maximum(-probe, 0) ** homogeneity
        if not np.allclose(out, expected, rtol=1e-9, atol=1e-12):
            raise ValueError("phi callable is not a ρ_α(x) − b ρ_α(−x) with the given homogeneity and coefficients")
        homogeneous_coeffs = (a, b)
    if kinks is None:
        # a positive-homogeneous φ = aρ_α(x) − bρ_α(−x) is kinked at 0 unless it is linear (α = 1, a = b)
        linear = homogeneity == 1.0 and homogeneous_coeffs is not None and homogeneous_coeffs[0] == homogeneous_coeffs[1]
        kinks_t: tuple[float, ...] = (0.0,) if homogeneity is not None and not linear else ()
    else:
        try:
            kinks_t = tuple(sorted({_check_real("kinks", k) for k in kinks}))
        except TypeError:
            raise ValueError(f"kinks={kinks!r} is not allowed: expected a sequence of finite real numbers") from None
    return Activation(
        name="callable",
        _base=base,
        _base_deriv=base_deriv,
        _base_torch=torch_fn,
        base_homogeneity=homogeneity,
        base_homogeneous_coeffs=homogeneous_coeffs,
        deriv_is_exact=exact,
        base_kinks=kinks_t,
    )


class _NotElementwise(ValueError):
    """A callable φ whose output shape differs from its input's (refused; not a reason to try torch)."""


def _wrap_callable(fn, probe: np.ndarray):
    """(φ on float64 arrays, φ' or None, torch φ or None, whether φ' is exact) for a NumPy or torch callable."""
    numpy_error: Exception | None = None
    try:
        out = fn(probe)
        if type(out).__module__.split(".")[0] != "torch":
            _refuse_complex(np.iscomplexobj(out), getattr(out, "dtype", type(out).__name__))
            arr = np.asarray(out, dtype=np.float64)
            if arr.shape != probe.shape:
                raise _NotElementwise(
                    f"phi callable must act elementwise: input shape {probe.shape} gave output shape {arr.shape}"
                )
            return (lambda x: np.asarray(fn(x), dtype=np.float64)), None, None, False
    except (_NotElementwise, _ComplexPhi):
        raise
    except Exception as exc:  # the user's function failed on an array: try torch next
        numpy_error = exc
    t = _torch()
    try:
        out_t = fn(t.as_tensor(probe))
        if not t.is_tensor(out_t):
            raise TypeError(f"returned {type(out_t).__name__}, not a tensor")
        if tuple(out_t.shape) != probe.shape:
            raise ValueError(f"input shape {probe.shape} gave output shape {tuple(out_t.shape)}")
        _refuse_complex(out_t.is_complex(), out_t.dtype)
    except _ComplexPhi:
        raise
    except Exception as exc:
        raise ValueError(
            "phi callable must act elementwise on a float64 NumPy array (e.g. lambda x: np.tanh(x)) or on a "
            f"float64 torch tensor (e.g. lambda x: torch.tanh(x)); it failed on both (NumPy: {numpy_error!r}; "
            f"torch: {exc!r}).  A function of one float (math.tanh) can be adapted with np.vectorize(f) or by "
            "using the NumPy/torch version of each call"
        ) from None

    def base(x):
        with t.no_grad():
            return fn(t.as_tensor(np.asarray(x, dtype=np.float64))).detach().cpu().numpy().astype(np.float64)

    def deriv(x):
        xt = t.as_tensor(np.asarray(x, dtype=np.float64)).clone().requires_grad_(True)
        y = fn(xt)
        if not y.requires_grad:  # constant in x
            return np.zeros(xt.shape)
        (g,) = t.autograd.grad(y.sum(), xt, allow_unused=True)
        return np.zeros(xt.shape) if g is None else g.detach().numpy()

    if out_t.is_floating_point():
        return base, deriv, fn, True

    # an integer or boolean φ (a step, a rounding) is real-valued: the simulator gets it in the input's dtype,
    # with its derivative, 0 almost everywhere, in the graph (as torch.sign has), so gradients flow as zeros
    def as_real(x):
        return fn(x).to(x.dtype) + 0.0 * x

    return base, deriv, as_real, True


class _ComplexPhi(ValueError):
    """A callable φ that returns complex values (refused: φ must be real)."""


def _refuse_complex(is_complex: bool, dtype) -> None:
    if is_complex:
        raise _ComplexPhi(f"phi callable returned complex values ({dtype}): phi must be real-valued (take .real "
                          "or abs() yourself if that is what you mean)")


# ---------------------------------------------------------------------------
# Expressions
# ---------------------------------------------------------------------------
def _expression_functions() -> dict[str, Callable]:
    t = _torch()
    F = t.nn.functional
    return {
        "tanh": t.tanh, "sin": t.sin, "cos": t.cos, "exp": t.exp, "log": t.log, "sqrt": t.sqrt,
        "abs": t.abs, "erf": t.erf, "sigmoid": t.sigmoid, "relu": t.relu, "softplus": F.softplus,
        "gelu": F.gelu, "silu": F.silu, "elu": F.elu, "selu": F.selu, "sinh": t.sinh, "cosh": t.cosh,
        "atan": t.atan, "arctan": t.atan, "sign": t.sign, "log1p": t.log1p, "expm1": t.expm1,
        "min": t.minimum, "max": t.maximum, "minimum": t.minimum, "maximum": t.maximum,
    }


#: Functions an expression may call (all elementwise).
EXPRESSION_FUNCTIONS: tuple[str, ...] = (
    "tanh", "sin", "cos", "exp", "log", "sqrt", "abs", "erf", "sigmoid", "relu", "softplus", "gelu",
    "silu", "elu", "selu", "sinh", "cosh", "atan", "arctan", "sign", "log1p", "expm1",
    "min", "max", "minimum", "maximum",
)
_EXPRESSION_CONSTANTS = {"pi": math.pi, "e": math.e}
_ALLOWED_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.Div, ast.Pow)
_ALLOWED_UNARY = (ast.UAdd, ast.USub)
_MAX_EXPRESSION_LENGTH = 500


def _validate_expression(expr: str) -> ast.Expression:
    """Whitelist the syntax tree: the only gate between user text and evaluation."""
    if len(expr) > _MAX_EXPRESSION_LENGTH:
        raise ValueError(f"phi expression is {len(expr)} characters long; at most {_MAX_EXPRESSION_LENGTH} are allowed")
    try:
        tree = ast.parse(expr, mode="eval")
    except SyntaxError as exc:
        raise ValueError(f"phi={expr!r} is neither a registered activation nor a valid expression in x: {exc.msg}") from None
    uses_x = False
    for node in ast.walk(tree):
        if isinstance(node, (ast.Expression, ast.Load)) or isinstance(node, _ALLOWED_BINOPS + _ALLOWED_UNARY):
            continue
        if isinstance(node, ast.BinOp):
            if not isinstance(node.op, _ALLOWED_BINOPS):
                raise ValueError(f"operator {type(node.op).__name__} is not allowed in phi={expr!r}; allowed: + - * / **")
            continue
        if isinstance(node, ast.UnaryOp):
            if not isinstance(node.op, _ALLOWED_UNARY):
                raise ValueError(f"operator {type(node.op).__name__} is not allowed in phi={expr!r}")
            continue
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
                raise ValueError(f"constant {node.value!r} is not allowed in phi={expr!r}; only numbers")
            continue
        if isinstance(node, ast.Name):
            if node.id == "x":
                uses_x = True
            elif node.id not in _EXPRESSION_CONSTANTS and node.id not in EXPRESSION_FUNCTIONS:
                raise ValueError(
                    f"unknown name {node.id!r} in phi={expr!r}; allowed: x, pi, e and the functions "
                    + ", ".join(EXPRESSION_FUNCTIONS)
                )
            continue
        if isinstance(node, ast.Call):
            if not isinstance(node.func, ast.Name) or node.func.id not in EXPRESSION_FUNCTIONS:
                called = node.func.id if isinstance(node.func, ast.Name) else type(node.func).__name__
                raise ValueError(
                    f"call of {called!r} is not allowed in phi={expr!r}; allowed functions: {', '.join(EXPRESSION_FUNCTIONS)}"
                )
            if node.keywords or not 1 <= len(node.args) <= 2:
                raise ValueError(f"function calls in phi={expr!r} take one or two positional arguments")
            continue
        raise ValueError(f"{type(node).__name__} syntax is not allowed in phi={expr!r} (only arithmetic in x and function calls)")
    if not uses_x:
        raise ValueError(f"phi={expr!r} does not use the variable x")
    return tree


class _ExpressionCost(ValueError):
    """An expression whose constant part would overflow, hang or leave the reals."""


def _number(expr: str, value: Any) -> float:
    """A Python number as a float64, refusing ones that overflow it or are complex."""
    if isinstance(value, complex):
        raise _ExpressionCost(f"phi={expr!r} has a complex value ({value!r}); phi must be real")
    try:
        out = float(value)
    except OverflowError:
        raise _ExpressionCost(
            f"phi={expr!r} has a constant too large for a float64 (about 10^{len(str(abs(int(value)))) - 1})"
        ) from None
    if not math.isfinite(out):
        raise _ExpressionCost(f"phi={expr!r} has a non-finite constant ({out!r})")
    return out


def _bounded_operators(expr: str) -> dict:
    """Arithmetic for the evaluator with a cost bound: constants are float64, never big integers.

    ``operator.pow`` on Python ints builds numbers of any size (``9**9**9**9`` never
    finishes; ``2**2**40`` needs 140 GB), and simpleeval's own ``safe_power`` cannot be
    kept because it compares tensors with ``abs(a) > limit``.  Here an operation on two
    numbers is done in float64 (constant time; an overflow is an error, as is a complex
    result like ``(-8)**0.5``); an operation involving a tensor is elementwise, so the
    cost of evaluating an expression is (number of operations, at most the 500-character
    length) × (array size).
    """
    t = _torch()

    def both_numbers(a, b) -> bool:
        return not t.is_tensor(a) and not t.is_tensor(b)

    def binary(op, symbol):
        def fn(a, b):
            if both_numbers(a, b):
                a, b = _number(expr, a), _number(expr, b)
                try:
                    out = op(a, b)
                except OverflowError:
                    raise _ExpressionCost(f"phi={expr!r}: the constant {a!r} {symbol} {b!r} overflows a float64") from None
                except ZeroDivisionError:
                    raise _ExpressionCost(f"phi={expr!r}: the constant {a!r} {symbol} {b!r} divides by zero") from None
                return _number(expr, out)
            if not t.is_tensor(a):
                a = _number(expr, a)
            if not t.is_tensor(b):
                b = _number(expr, b)
            return op(a, b)

        return fn

    def unary(op):
        def fn(a):
            return op(a) if t.is_tensor(a) else op(_number(expr, a))

        return fn

    return {
        ast.Add: binary(operator.add, "+"), ast.Sub: binary(operator.sub, "-"),
        ast.Mult: binary(operator.mul, "*"), ast.Div: binary(operator.truediv, "/"),
        ast.Pow: binary(operator.pow, "**"), ast.USub: unary(operator.neg), ast.UAdd: unary(operator.pos),
    }


def _tensor_functions(expr: str) -> dict[str, Callable]:
    """The expression functions, accepting numbers too (a constant argument becomes a float64 tensor)."""
    t = _torch()

    def wrap(fn):
        def call(*args):
            like = next((a for a in args if t.is_tensor(a)), None)
            conv = [a if t.is_tensor(a) else t.tensor(_number(expr, a), dtype=t.float64 if like is None else like.dtype)
                    for a in args]
            return fn(*conv)

        return call

    return {name: wrap(fn) for name, fn in _expression_functions().items()}


#: Points where an expression is probed when parsed: it must be real and finite there.
_PROBE = np.array([-3.0, -2.0, -1.0, -0.5, 0.0, 0.5, 1.0, 2.0, 3.0])


def activation_from_expression(expr: str) -> Activation:
    """Parse an expression in ``x`` into an :class:`Activation` (safe: see module docstring).

    The expression is evaluated with torch float64 tensors through
    ``simpleeval`` so that φ' is exact (autograd), not a finite difference.

    Cost and range bounds: at most 500 characters; arithmetic between constants is
    done in float64 (never with unbounded integers, so ``9**9**9**9`` or
    ``2**2**40`` is an immediate error, not a hang or an exhausted memory); complex
    constants (``(-8)**0.5``) are refused; and φ must be real and finite at the probe
    points x ∈ {0, ±0.5, ±1, ±2, ±3} (``log(x)``, ``1/x``, ``x**0.5`` are refused: φ
    must be defined on all of ℝ).
    """
    if not isinstance(expr, str) or not expr.strip():
        raise ValueError(f"phi={expr!r} is not allowed: expected a non-empty expression in x")
    expr = expr.strip()
    tree = _validate_expression(expr)
    from simpleeval import SimpleEval

    t = _torch()  # expressions are evaluated with torch so that φ' is exact (autograd)
    evaluator = SimpleEval(
        functions=_tensor_functions(expr),
        names=dict(_EXPRESSION_CONSTANTS),
        operators=_bounded_operators(expr),
    )

    def torch_fn(x):
        evaluator.names = {**_EXPRESSION_CONSTANTS, "x": x}
        out = evaluator.eval(expr)
        if not t.is_tensor(out):
            out = t.full_like(x, _number(expr, out))
        if out.is_complex():
            raise ValueError(f"phi={expr!r} has complex values; phi must be real")
        return out

    def fn(x):
        xt = t.as_tensor(np.asarray(x, dtype=np.float64))
        with t.no_grad():
            return torch_fn(xt).numpy()

    def deriv(x):
        xt = t.as_tensor(np.asarray(x, dtype=np.float64)).clone().requires_grad_(True)
        y = torch_fn(xt)
        (g,) = t.autograd.grad(y.sum(), xt, allow_unused=True)
        if g is None:
            return np.zeros_like(xt.detach().numpy())
        return g.numpy()

    try:
        probe = fn(_PROBE)
    except _ExpressionCost as exc:
        raise ValueError(str(exc)) from None
    except Exception as exc:
        raise ValueError(f"phi={expr!r} could not be evaluated: {exc}") from None
    if probe.shape != _PROBE.shape:
        raise ValueError(f"phi={expr!r} is not elementwise in x")
    bad = ~np.isfinite(probe)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"phi={expr!r} is not allowed: phi({_PROBE[i]:g}) = {float(probe[i])!r}; phi must be real and finite "
            "for every real x (e.g. log(x), 1/x and x**0.5 are not)"
        )

    def evaluate_sub(src, x):  # a sub-expression on a float64 array, for the kink tracer
        evaluator.names = {**_EXPRESSION_CONSTANTS, "x": t.as_tensor(np.asarray(x, dtype=np.float64))}
        with t.no_grad():
            out = evaluator.eval(src)
        return out.numpy() if t.is_tensor(out) else np.asarray(out, dtype=np.float64)

    from bnlab._expression_kinks import expression_kinks

    kinks = expression_kinks(tree, evaluate_sub)
    return Activation(name="expr", _base=fn, _base_deriv=deriv, _base_torch=torch_fn, expression=expr,
                      base_kinks=kinks)
