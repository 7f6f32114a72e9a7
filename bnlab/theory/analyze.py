"""Everything the mean field theory of batchnorm says about (φ, B, ε) in one call (Yang et al. 2019).

:func:`analyze` returns a :class:`TheoryResult`: the BSB1 fixed point (q*, c*),
the forward eigenvalues λ_G↑ = 0, λ_L↑, λ_M↑ (§3.1.1), the backward eigenvalues
λ_G↓ (gradient explosion rate), λ_L↓, λ_M↓ (§3.1.2), the cross-batch fixed
point c_CB* and rate λ_M̃ (§3.2), the depth scale ξ = 1/log λ_G↓ and the
maximum trainable depth 16ξ (§4), and whether the BSB1 fixed point is the
attractor at all (``fixed_point_kind``; App. J, K).

Methods (``method``):

* ``"auto"``: the most accurate available route for each quantity (closed
  forms for relu/identity, the Laplace closed forms for other positive-homogeneous
  φ, spherical integration otherwise — split at every kink; the fixed point closed
  for homogeneous φ, from the forward route's moments E f_1², E f_1 f_2 for other
  φ (kinked: on the kink-split rule; smooth: for B ≤ 256), Gegenbauer otherwise).  BSB1 vs BSB2 is read off
  the forward eigenvalues when they are more than 1e-6 from 1 (else, and for
  B > 2048 or ε > 0, by :func:`bnlab.theory.symmetry.fixed_point_kind`);
* ``"closed"``: closed forms only (relu, identity; else ``ValueError``);
* ``"laplace"``: the Laplace method for positive-homogeneous φ: fixed point
  by :mod:`bnlab.theory.laplace`, dynamics by the closed forms of Thms F.33,
  G.12, H.6, H.14 (any degree α with (B−1)/2 > α); ``ValueError`` for other φ;
* ``"fourier"``: fixed point by the Fourier method (App. E.2); the paper
  develops no Fourier form of the dynamics, so they come from spherical
  integration — recorded in ``methods_used`` and in ``warnings``;
* ``"sphere"``, ``"gegenbauer"``, ``"montecarlo"``: that route everywhere
  (Gegenbauer has no form of λ_L↓, λ_M↓: those come from the sphere, recorded).

``methods_used`` maps each group of quantities to the route that produced it.

ε > 0: the fixed point and λ_G↓ come from :func:`bnlab.theory.epsilon_analysis`
(which depends on σ_w²); the other eigenvalues are only developed for ε = 0
and are returned as None with a warning.

Symmetry breaking: when the BSB1 fixed point is not attracting
(:func:`bnlab.theory.fixed_point_kind` says ``"BSB2"``, e.g. relu^α with α = 2
at B = 8), no BSB1 quantity is returned (all None) and ``warnings`` says why.
"""
from __future__ import annotations

import math
import numbers
import warnings as _warnings
from dataclasses import asdict, dataclass, field, replace

from bnlab._validation import check_choice, check_real
from bnlab.activations import get_activation
from bnlab.theory._admissible import admissible
from bnlab.theory._checks import SmallBatchWarning, check_batch_size
from bnlab.theory._routes import MAX_MONTECARLO_SECONDS, montecarlo_seconds, relu_or_identity
from bnlab.theory._sphere_route import _forward_moments_sphere
from bnlab.theory.backward import _backward_eigenvalues
from bnlab.theory.cross_batch import _cross_batch_analysis
from bnlab.theory.epsilon import _epsilon_analysis
from bnlab.theory.fixed_point import BSB1FixedPoint, _bsb1_fixed_point
from bnlab.theory.forward import _forward_eigenvalues
from bnlab.theory.symmetry import _resolved_stability

__all__ = ["METHODS", "TheoryResult", "analyze", "depth_scale", "max_trainable_depth", "TRAINABLE_DEPTH_FACTOR"]

METHODS = ("auto", "closed", "laplace", "fourier", "sphere", "gegenbauer", "montecarlo")

#: Yang et al. 2019 §4 overlays 16ξ on the measured trainability (Figs. 3, 5): an
#: empirical constant (not derived in the paper).  Over 16ξ layers the gradient
#: norm squared grows by e^16 ≈ 8.9e6, beyond which training failed in their runs.
TRAINABLE_DEPTH_FACTOR = 16.0


def depth_scale(rate: float) -> float:
    """ξ = 1/log(λ): number of layers over which the gradient norm squared grows by e (Yang et al. 2019, §4).

    Parameters
    ----------
    rate : float
        Per-layer growth factor λ_G↓ > 0 of the gradient norm squared.

    Returns
    -------
    float
        1/log(rate) for rate > 1.  For 0 < rate ≤ 1 gradients do not explode
        and there is no depth limit from gradient explosion: ``math.inf`` is
        returned (:func:`analyze` adds a warning saying so).  rate ≤ 0, NaN or
        inf raise ``ValueError``.
    """
    if isinstance(rate, numbers.Integral) and not isinstance(rate, bool) and rate > 1:
        # math.log takes a Python int of any size exactly, where float(rate) (check_real) overflows beyond 1.8e308
        return 1.0 / math.log(int(rate))
    r = check_real("rate", rate, minimum=0.0, strict_minimum=True)
    if r <= 1.0:
        return math.inf
    return 1.0 / math.log(r)


def max_trainable_depth(rate: float) -> float:
    """16ξ = 16/log(λ_G↓): the maximum trainable depth predicted in Yang et al. 2019, §4 (Figs. 3, 5).

    The factor 16 is the paper's empirical constant (:data:`TRAINABLE_DEPTH_FACTOR`).
    Returns ``math.inf`` when rate ≤ 1 (see :func:`depth_scale`).
    """
    return TRAINABLE_DEPTH_FACTOR * depth_scale(rate)


@dataclass(frozen=True)
class TheoryResult:
    """What the mean field theory says about (φ, B, ε).  None marks a quantity that does not apply (see ``warnings``)."""

    phi: str
    batch_size: int
    eps: float
    sigma_w2: float
    method: str
    methods_used: dict = field(default_factory=dict)
    fixed_point_kind: str | None = None
    q_star: float | None = None
    c_star: float | None = None
    forward_lambda_G: float | None = None
    forward_lambda_L: float | None = None
    forward_lambda_M: float | None = None
    grad_explosion_rate: float | None = None
    backward_lambda_L: float | None = None
    backward_lambda_M: float | None = None
    cross_batch_c_star: float | None = None
    cross_batch_rate: float | None = None
    depth_scale: float | None = None
    max_trainable_depth: float | None = None
    warnings: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        """Plain dict (JSON-ready apart from non-finite floats, which callers map to null)."""
        d = asdict(self)
        d["warnings"] = list(self.warnings)
        d["methods_used"] = dict(self.methods_used)
        return d


def _route(method: str, act) -> tuple[dict, list[str]]:
    """Method per group of quantities (fixed point, forward, backward, cross-batch) and notes."""
    notes = []
    if method == "auto":
        # each dynamics chooses its own route (bnlab.theory._routes.plan_route)
        return {"fixed_point": "auto", "forward": "auto", "backward": "auto", "cross_batch": "auto"}, notes
    if method == "closed":
        if relu_or_identity(act) is None:
            raise ValueError(
                f"method='closed' does not apply to phi={act.spec!r}: closed forms of the dynamics exist for relu and "
                "identity (Thms 3.7, 3.10, G.12, H.6); use method='laplace' (positive-homogeneous φ), 'sphere', "
                "'gegenbauer' or 'auto'"
            )
        return {"fixed_point": method, "forward": "closed", "backward": "closed", "cross_batch": "closed"}, notes
    if method == "laplace":
        if act.homogeneity is None or act.homogeneous_coeffs is None:
            raise ValueError(
                f"method='laplace' does not apply to phi={act.spec!r}: the Laplace method needs a positive-homogeneous "
                "φ (Thms F.33, G.12, H.14); use method='sphere', 'gegenbauer' or 'auto'"
            )
        return {"fixed_point": "laplace", "forward": "laplace", "backward": "laplace", "cross_batch": "laplace"}, notes
    if method == "fourier":
        notes.append(
            "method='fourier': the paper develops the Fourier method for the fixed point only (App. E.2); "
            "the eigenvalues and cross-batch quantities come from spherical integration"
        )
        return {"fixed_point": "fourier", "forward": "sphere", "backward": "sphere", "cross_batch": "sphere"}, notes
    if method == "gegenbauer":
        notes.append("method='gegenbauer': λ_L↓ and λ_M↓ have no Gegenbauer form in the paper; they come from spherical integration")
        return {"fixed_point": "gegenbauer", "forward": "gegenbauer", "backward": "gegenbauer", "cross_batch": "gegenbauer"}, notes
    return {"fixed_point": method, "forward": method, "backward": method, "cross_batch": method}, notes


def _check_analyze_montecarlo_cost(b: int, n_samples: int = 200_000) -> None:
    """Refuse ``method="montecarlo"`` up front when its four routes together would take minutes."""
    secs = 3 * montecarlo_seconds(n_samples, b, 1) + montecarlo_seconds(n_samples, b, 2)
    if secs > MAX_MONTECARLO_SECONDS:
        raise ValueError(
            f"batch_size={b} is not allowed with method='montecarlo': its {n_samples} samples per route would take "
            f"about {secs:.0f} s (> {MAX_MONTECARLO_SECONDS:.0f} s); use a deterministic method ('auto', 'sphere', "
            "'gegenbauer'), or the single quantities (forward_eigenvalues, backward_eigenvalues, ...) with fewer "
            "n_samples"
        )


def analyze(
    phi,
    batch_size: int,
    *,
    eps: float = 0.0,
    sigma_w2: float = 1.0,
    gamma: float = 1.0,
    beta: float = 0.0,
    method: str = "auto",
    **phi_params,
) -> TheoryResult:
    """Everything the mean field theory of batchnorm says about (φ, B, ε) (Yang et al. 2019).

    Parameters
    ----------
    phi : str, callable or Activation
        A registered name, an expression in x, a callable or an Activation.
    batch_size : int
        B ≥ 3 (B = 2: ``ValueError`` explaining why; B = 3: ``SmallBatchWarning``
        and the backward quantities are None because the mean field backward map diverges).
    eps : float
        Batchnorm ε ≥ 0.
    sigma_w2 : float
        Weight variance > 0 (matters only for ε > 0).
    gamma, beta : float
        The nonlinearity is x ↦ φ(γx + β) (§3.1.2, Fig. 5).
    method : one of :data:`METHODS`
    **phi_params :
        Parameters of a named family (``alpha=2`` for alpha_relu, ``slope`` for leaky_relu).

    Returns
    -------
    TheoryResult

    Accuracy
    --------
    That of the routes in ``methods_used`` (see :mod:`bnlab.theory.forward`,
    :mod:`bnlab.theory.backward`, :mod:`bnlab.theory.cross_batch`): rounding
    for closed forms (Laplace ≈1e-13), ≈1e-10 for spherical integration of smooth
    φ, ≤ 1.2e-12 on the kink-split rule for kinked φ (B = 4: ≈3e-9; docs/theory-methods.md),
    Monte Carlo standard errors for ``"montecarlo"``.
    """
    method = check_choice("method", method, METHODS)
    eps = check_real("eps", eps, minimum=0.0)
    sigma_w2 = check_real("sigma_w2", sigma_w2, minimum=0.0, strict_minimum=True)
    gamma = check_real("gamma", gamma)
    beta = check_real("beta", beta)
    act = get_activation(phi, gamma=gamma, beta=beta, **phi_params)  # φ resolved once, here
    notes: list[str] = []
    with _warnings.catch_warnings(record=True) as caught:
        _warnings.simplefilter("always", SmallBatchWarning)
        b = check_batch_size(batch_size)
    for w in caught:
        notes.append(str(w.message))
        _warnings.warn(w.message, w.category, stacklevel=2)
    # overflow, poles, constant φ, jumps, non-L² φ': an error or an exact reformulation, never a number
    # that cannot be right (issue 13); |γ| of homogeneous φ and huge/tiny output scales drop out (ε = 0)
    act, adm_notes, undefined = admissible(act, b, eps)
    routes, route_notes = _route(method, act)
    if method == "montecarlo":
        # every route's time at once, before any runs (fixed point, forward and cross-batch are O(B) per
        # sample, backward O(B²)): a run refused only at its last route would have cost minutes first
        _check_analyze_montecarlo_cost(b)
    case = _Case(eps, sigma_w2, method, routes, notes + adm_notes + route_notes,
                 undefined.get("backward"), undefined.get("cross_batch"))
    with _warnings.catch_warnings(record=True) as inner:
        # the building blocks' warnings (e.g. slow series convergence) go into the result;
        # B = 3 was reported once above and is not repeated
        _warnings.simplefilter("always")
        res = _analyze(act, b, case)
    extra = [str(w.message) for w in inner if not issubclass(w.category, (SmallBatchWarning, DeprecationWarning))]
    extra = [m for m in dict.fromkeys(extra) if m not in res.warnings]
    if extra:
        res = replace(res, warnings=res.warnings + tuple(extra))
    return res


#: B up to which the auto forward route's eigenvalues decide BSB1/BSB2 (the quadrature routes' range)
_MAX_SHARED_FORWARD_BATCH = 2048
#: |max(λ_L↑, λ_M↑) − 1| below which the dedicated stability route decides instead
_KIND_MARGIN = 1e-6
#: methods_used["fixed_point"] when q*, c* come from the forward route's moments (kinked / smooth φ)
_SHARED_FIXED_POINT = "sphere (kink-split 2-D rule, moments shared with the forward route)"
_SHARED_SMOOTH_FIXED_POINT = "sphere (2-D rule, moments shared with the forward route)"
#: B up to which a smooth φ takes q*, c* from the forward route's moments: there they are ≤ 1.3e-13 relative
#: from the Gegenbauer fixed point (tanh, sin, erf, gelu, softplus, sigmoid at 4 ≤ B ≤ 256; the Gegenbauer q*
#: of tanh is within 3e-16 of a 30-digit mpmath quadrature at B = 256 and 1024); at B = 1024 the 2-D rule's
#: E f_1² is off by 8e-13, so larger B keep the Gegenbauer series
_SHARED_SMOOTH_MAX_BATCH = 256


@dataclass
class _Case:
    """One call of :func:`analyze` besides (φ, B): the checked ε and σ_w², the method and its routes, and what the
    answer will carry (``notes``: its warnings; ``used``: ``methods_used``; ``out``: the quantities).
    ``gradient_reason``/``cross_reason``: why the backward / cross-batch rates are undefined, if they are."""

    eps: float
    sigma_w2: float
    method: str
    routes: dict
    notes: list
    gradient_reason: str | None = None
    cross_reason: str | None = None
    used: dict = field(default_factory=dict)
    out: dict = field(default_factory=dict)

    def result(self, spec: str, b: int, kind: str) -> TheoryResult:
        base = dict(phi=spec, batch_size=b, eps=self.eps, sigma_w2=self.sigma_w2, method=self.method)
        return TheoryResult(**base, methods_used=self.used, fixed_point_kind=kind, warnings=tuple(self.notes), **self.out)


def _analyze(act, b: int, case: _Case) -> TheoryResult:
    kind, fw = _bsb1_or_bsb2(act, b, case)
    case.used["fixed_point_kind"] = "bsb1_stability (max(λ_L↑, λ_M↑) < 1)"
    if kind == "BSB2":
        case.notes.append(
            f"the BSB1 fixed point of phi={act.spec!r} at batch_size={b} is not attracting (symmetry "
            "breaking, Yang et al. 2019 App. J, K): the covariance converges to a BSB2 fixed point, so the BSB1 "
            "quantities (fixed point, eigenvalues, rates, depth scale) do not describe the network and are not returned"
        )
        return case.result(act.spec, b, kind)
    if case.eps > 0.0:
        _with_epsilon(act, b, case)
    else:
        _fixed_point(act, b, case, fw)
        _forward(act, b, case, fw)
        _backward(act, b, case)
        _cross_batch(act, b, case)
    _depth(act, b, case)
    return case.result(act.spec, b, kind)


def _bsb1_or_bsb2(act, b: int, case: _Case):
    """("BSB1" or "BSB2", the forward eigenvalues when they were computed for the verdict, else None).

    Is BSB1 the attractor (App. J, K)?  The criterion is max(λ_L↑, λ_M↑) < 1.  With ε = 0 and the auto routes
    the forward eigenvalues are needed anyway, so they decide it when they are clearly away from 1: their routes
    are accurate to ≤ 1e-9 for 4 ≤ B ≤ 2048 (closed/Laplace: rounding), far inside the 1e-6 margin.  Near 1,
    at larger B (where 1 − λ_L↑ ~ 2/B meets the cancellation of the quadrature) or when they cannot be
    computed, the stability route of :mod:`bnlab.theory.symmetry` (1 − λ without cancellation) decides.
    """
    fw = None
    if case.eps == 0.0 and case.routes["forward"] == "auto" and 4 <= b <= _MAX_SHARED_FORWARD_BATCH:
        try:
            fw = _forward_eigenvalues(act, b, "auto")
        except ValueError:
            fw = None
        if fw is not None and fw.lambda_M is not None:
            lam = max(fw.lambda_L, fw.lambda_M)
            if math.isfinite(lam) and abs(lam - 1.0) > _KIND_MARGIN:
                return ("BSB1" if lam < 1.0 else "BSB2"), fw
    # BSB1 iff the BSB1 fixed point is locally attracting: max(λ_L↑, λ_M↑) < 1 (Thm 3.8 discussion),
    # as bnlab.theory.fixed_point_kind(φ, B, depth=None) says
    return ("BSB1" if _resolved_stability(act, b).attracting else "BSB2"), fw


def _with_epsilon(act, b: int, case: _Case) -> None:
    """ε > 0: the fixed point and λ_G↓ from :func:`bnlab.theory.epsilon_analysis` (which depends on σ_w²)."""
    er = _epsilon_analysis(act, b, case.eps, case.sigma_w2)
    case.out.update(q_star=er.q_star, c_star=er.c_star)
    if case.gradient_reason is None:
        case.out["grad_explosion_rate"] = er.grad_explosion_rate
    else:
        case.notes.append(case.gradient_reason)
    case.used["fixed_point"] = case.used["backward"] = f"epsilon_analysis ({er.method})"
    case.notes.append(
        f"eps={case.eps:g} > 0: the fixed point and the gradient explosion rate include ε (bnlab.theory.epsilon); "
        "the other eigenvalues and the cross-batch quantities are developed for ε = 0 only and are not returned"
    )


def _fixed_point(act, b: int, case: _Case, fw) -> None:
    fp_method = case.routes["fixed_point"]
    if fp_method == "gegenbauer" and b < 4:
        fp_method = "sphere"
    shared = fp_method == "auto" and fw is not None and fw.method == "sphere" and act.homogeneity is None
    if shared and (act.kinks or b <= _SHARED_SMOOTH_MAX_BATCH):
        # non-homogeneous φ: q* = E f_1², q*c* = E f_1 f_2 (Thm 3.3) are the first two moments the forward route
        # already integrated on its 2-D rule (memoized per (φ, B)), so no second quadrature of φ.  Kinked φ (on
        # the kink-split rule): ≤ 1.2e-12 for B ≥ 5, ≈ 3e-9 at B = 4, where the Gegenbauer fixed point that auto
        # took before is ≤ 7e-7 at B = 4, ≤ 1e-9 for B ≥ 5 (tests/theory/test_kinks.py).  Smooth φ: as accurate
        # as the Gegenbauer series up to _SHARED_SMOOTH_MAX_BATCH (tests/theory/test_analyze.py), and it was
        # 30% of analyze's time for tanh at B = 32 (issue 25)
        mom = _forward_moments_sphere(act, b)
        label = _SHARED_FIXED_POINT if act.kinks else _SHARED_SMOOTH_FIXED_POINT
        fp = BSB1FixedPoint.from_entries(b, mom[0], mom[1], label, 1e-12 * abs(float(mom[0])))
    else:
        fp = _bsb1_fixed_point(act, b, fp_method)
    case.out.update(q_star=fp.q_star, c_star=fp.c_star)
    case.used["fixed_point"] = fp.method


def _forward(act, b: int, case: _Case, fw) -> None:
    if fw is None:
        fw = _forward_eigenvalues(act, b, case.routes["forward"])
    case.out.update(forward_lambda_G=fw.lambda_G, forward_lambda_L=fw.lambda_L, forward_lambda_M=fw.lambda_M)
    case.used["forward"] = fw.method


def _backward(act, b: int, case: _Case) -> None:
    if case.gradient_reason is not None:
        case.notes.append(case.gradient_reason)
        return
    if b < 4:
        case.notes.append("batch_size=3: E|Gh|⁻² diverges, so the mean field backward quantities are infinite (App. J); not returned")
        return
    try:
        bw = _backward_eigenvalues(act, b, case.routes["backward"])
    except ValueError as exc:
        if "not square integrable" not in str(exc):
            raise
        case.notes.append(str(exc))
        return
    lam_l, lam_m = bw.lambda_L, bw.lambda_M
    case.used["backward"] = bw.method
    if lam_l is None:  # the Gegenbauer route has no λ_L↓, λ_M↓: from the sphere
        sb = _backward_eigenvalues(act, b, "sphere")
        lam_l, lam_m = sb.lambda_L, sb.lambda_M
        case.used["backward_L_M"] = "sphere"
    case.out.update(grad_explosion_rate=bw.lambda_G, backward_lambda_L=lam_l, backward_lambda_M=lam_m)


def _cross_batch(act, b: int, case: _Case) -> None:
    cb = _cross_batch_analysis(act, b, case.routes["cross_batch"])
    case.out.update(cross_batch_c_star=cb.c_star, cross_batch_rate=None if case.cross_reason is not None else cb.rate)
    if case.cross_reason is not None and case.cross_reason != case.gradient_reason:
        case.notes.append(case.cross_reason)
    case.used["cross_batch"] = cb.method


def _depth(act, b: int, case: _Case) -> None:
    """The depth scale and the maximum trainable depth from λ_G↓, after the last guard on every quantity."""
    out = case.out
    for key, val in out.items():
        # every route checks its own result; this is the last guard that no overflow reaches the user
        if isinstance(val, float) and not math.isfinite(val):
            raise ValueError(
                f"{key}={val!r} for phi={act.spec!r}, batch_size={b}, eps={case.eps!r}: a non-finite result (overflow "
                "in the theory's integrals); the theory cannot be evaluated for this input"
            )
    rate = out.get("grad_explosion_rate")
    if rate is None:
        return
    if rate < 0:
        raise ValueError(f"grad_explosion_rate={rate!r} < 0 for phi={act.spec!r}, batch_size={b}: not a rate (numerical failure)")
    if rate > 0:
        out["depth_scale"] = depth_scale(rate)
        out["max_trainable_depth"] = max_trainable_depth(rate)
    else:
        out["depth_scale"] = out["max_trainable_depth"] = math.inf
    if rate <= 1.0:
        case.notes.append(f"grad_explosion_rate={rate:.6g} ≤ 1: gradients do not explode (they vanish); depth_scale is infinite")
