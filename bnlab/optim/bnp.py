"""Batch normalization preconditioning (BNP) of Lange, Helfrich & Ye as a PyTorch gradient preconditioner.

BNP keeps running statistics of each supported layer's *input* and uses them to precondition that
layer's gradient, ``G ← (1/q²) P Pᵀ G`` (Lange et al., Eq. 15; Eq. 23 for convolutions), which is
gradient descent on the reparametrized weights ``ŵ = P z`` whose Hessian is built from the
normalized inputs (Theorem 3) and is better conditioned (Theorem 4).  The network itself is not
changed, so BNP works at mini-batch size 1 and in online learning, where BN cannot train.

Usage follows kfac-pytorch's convention: the preconditioner sits beside any ``torch.optim``
optimizer and rewrites ``.grad`` in place::

    pre = BNPreconditioner(model)                 # forward pre-hooks on Linear / Conv1d / Conv2d
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        pre.step()                                # Algorithm 2 / 3 steps 1-5 on every layer
        opt.step()

How the code is laid out (kfac-pytorch's and torch.optim's shape):

* **registration** (:class:`BNPreconditioner`'s constructor): the layers are found through the
  handler registry (:func:`register_layer_handler`; ``_layers`` holds a handler per module type)
  and each gets a forward pre-hook and a layer object (``_bnp_layers``: :class:`DenseLayer` for
  ``nn.Linear``, :class:`ConvLayer` for convolutions) that holds its own state;
* **one route chooser** (:func:`_default_kept_route` at registration, :meth:`BNPreconditioner._route`
  for each forward), in the style of ``torch.optim``'s ``_default_to_fused_or_foreach``: *eager*
  (``torch._foreach_*`` over the layers), *fused* (``gradient="fused"``/``"auto"``), *native*
  (``native=True``, compiled C++ on CPU) or *compiled* (``torch.compile`` of the functional core,
  the default on CUDA, where it is also replayed from a CUDA graph: ``cuda_graph=True``);
* :meth:`BNPreconditioner.step` only orchestrates: it sorts the pending layers by route and hands
  each group to the functional core (``_functional``: statistics update, inverse scales, gradient
  transform — pure functions of tensors that the eager, fused and compiled routes share, and
  that the native kernel implements in C++).

Non-finite batches: the columns of a layer whose batch statistics are NaN or infinite (a NaN or
inf input, or a float32 input whose square overflows) keep their running mean and variance for
that step; a ``RuntimeWarning`` names the layer and :attr:`BNPreconditioner.nonfinite_batches`
counts such steps.  The gradients themselves are the caller's: a NaN loss still gives NaN
gradients, but the running statistics — and so every later step — stay finite.

Errata and interpretations (Lange et al., JMLR version in ../shared/papers):

* Algorithm 2 step 5 (and Algorithm 3 step 5) must use the *updated* G_w of step 4, which already
  carries the factor 1/q²: only then do steps 4-5 equal ``(1/q²) P Pᵀ`` of Eq. 15
  (``PPᵀ = [[1 + Σ μ²/σ̃², -(μ/σ̃²)ᵀ], [-μ/σ̃², diag(1/σ̃²)]]``; expanding gives
  ``G_b ← G_b/q² - Σ_j μ_j (G_w,j - μ_j G_b)/(q² σ̃_j²)``).  Read with the old G_w, step 5 is not
  Eq. 15.  This module uses the updated one; the Prop. 7 test pins it.
* At mini-batch size 1 the paper estimates the variance "using the running mean" as
  ``(h - μ)²`` without saying whether μ is the running mean before or after step 2's update.  We
  use the value before the update (step 1 precedes step 2), which is also what the moments about
  the running mean give for a single row (see ``_layers``).
* Algorithm 3 uses the per-channel statistics of Eqs. 21-22 (the authors' approximation), while
  Prop. 9 / Eqs. 19-20 define them per column of the unfolded input with zero padding counted.
  Both are available (``conv_statistics="channel"`` is the default, as in the paper's experiments;
  ``"unfold"`` is the exact version).  With stride or dilation, "rs" in q² = max(c k²/N, √(rs)) is
  taken as the number of output positions (the rows of 𝓗 per sample), which equals the map size
  r·s for the 'same' convolution the paper treats.
* Layers without a bias have no first column e in Ĥ = [e, H], so the centering U of Eq. 12 has no
  coordinate to act on; for them only the scaling part, ``G_w ← G_w / (q² σ̃²)``, is applied.
* Prop. 6 counts ``6 n_in n_out`` operations for steps 4-5 because it applies 1/q² and 1/σ̃²
  separately; folding them into one vector gives ``5 n_in n_out`` (the test counts them).
"""
from __future__ import annotations

import contextlib
import fnmatch
import math
import warnings
from typing import Any, Iterable, Iterator, Mapping

import torch
from torch import nn

from bnlab._validation import check_choice, check_int, check_real
from bnlab.optim import _bnp_checks as _checks
from bnlab.optim import _compiled, _native
from bnlab.optim import _functional as F
from bnlab.optim._bnp_layers import BNPLayer, ConvLayer, DenseLayer, stats_dtype
from bnlab.optim._functional import regularized_variance
from bnlab.optim._layers import (
    CONV_STATISTICS,
    Conv1dHandler,
    Conv2dHandler,
    LayerHandler,
    LinearHandler,
    _layer_label,
)

__all__ = [
    "GRADIENT_MODES",
    "BNPreconditioner",
    "bnp_precondition_",
    "regularized_variance",
    "register_layer_handler",
    "layer_handlers",
]

#: How the preconditioned weight gradient of a dense layer is formed (see :class:`BNPreconditioner`).
GRADIENT_MODES = ("transform", "fused", "auto")
#: ``gradient="auto"`` fuses only when the first dense layer has at least this many weights: below,
#: the fused route's extra per-call work is not repaid by the three passes over G_w it saves
#: (measured on CPU at N = 16, × SGD, fused against transform: 1.42 vs 1.45 with a 3072 × 100
#: first layer, 1.08 vs 1.43 with 4096 × 1024, 1.87 vs 1.68 with 784 × 100; docs/optim.md).
_AUTO_FUSED_MIN_WEIGHTS = 1 << 17
#: The same threshold when the layer takes a kept-input route (``native=True`` on CPU, the compiled
#: route): a single bandwidth-bound pass over G_w, which the fused route beats only for large
#: layers (measured at N = 16, × SGD, fused against native: 1.42 vs 1.16 with 3072 × 100, 1.23 vs
#: 1.17 with 1024 × 1024, 1.29 vs 1.16 with 2048 × 512, 1.05 vs 1.17 with 4096 × 1024; docs/optim.md).
_AUTO_FUSED_MIN_WEIGHTS_NATIVE = 1 << 21
#: ε₁ and ε₂ above these make 1/(q²σ̃²) underflow float32 (q² ≤ 10⁶ and σ̃² ≤ 10³² keep it a
#: normal number) — BNP would then zero the gradient silently.
_EPS1_MAX = 1e6
_EPS2_MAX = 1e30
#: ε₂ from which 1/(q²σ̃²) ≤ 1/(q²ε₂) cannot overflow float32 statistics (the smallest dtype they are
#: kept in): below it, a layer of zero (or subnormal) variances is checked for and refused
_EPS2_SAFE = 1e-30
#: Routes that do not synchronize with the device count non-finite batches in a device tensor,
#: read (one synchronization) every this many steps and whenever ``nonfinite_batches`` is read.
_NONFINITE_CHECK_EVERY = 100

_HANDLERS: dict[type, type[LayerHandler]] = {
    nn.Linear: LinearHandler,
    nn.Conv1d: Conv1dHandler,
    nn.Conv2d: Conv2dHandler,
}


def _in_backward() -> bool:
    """Whether this thread is running a backward pass (autograd's graph task): a forward run there is the
    recomputation of activation checkpointing (``torch.utils.checkpoint``)."""
    return torch._C._current_graph_task_id() != -1


def register_layer_handler(module_type: type, handler: type[LayerHandler]) -> None:
    """Register (or replace) the :class:`LayerHandler` subclass BNP uses for ``module_type``.

    Subclasses of a registered type use its handler unless they are registered themselves.
    """
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise ValueError(f"module_type={module_type!r} is not allowed: expected a subclass of torch.nn.Module")
    if not (isinstance(handler, type) and issubclass(handler, LayerHandler)):
        raise ValueError(f"handler={handler!r} is not allowed: expected a subclass of bnlab.optim.LayerHandler")
    _HANDLERS[module_type] = handler


def layer_handlers() -> dict[type, type[LayerHandler]]:
    """A copy of the registry module type -> handler class."""
    return dict(_HANDLERS)


def _handler_for(module: nn.Module) -> type[LayerHandler] | None:
    for klass in type(module).__mro__:
        if klass in _HANDLERS:
            return _HANDLERS[klass]
    return None


def bnp_precondition_(
    grad_weight: torch.Tensor,
    grad_bias: torch.Tensor | None,
    mean: torch.Tensor,
    var_tilde: torch.Tensor,
    q2: float | torch.Tensor,
) -> None:
    """Apply ``(1/q²) P Pᵀ`` to one layer's gradients in place (Lange et al., Eq. 15, Algorithm 2 steps 4-5).

    ``grad_weight`` is the (n_out, n_in) matrix G_w (for a convolution the kernel gradient reshaped
    to (c_out, c_in·k²), Eq. 23), ``grad_bias`` the (n_out,) vector G_b or ``None``, ``mean`` and
    ``var_tilde`` the (n_in,) vectors μ and σ̃², ``q2`` the scale q².  With P = [[1, -μᵀ], [0, I]]
    · diag(1, 1/σ̃):

        G_w(i, j) ← (G_w(i, j) - μ(j) G_b(i)) / (q² σ̃²(j))            (step 4)
        G_b(i)    ← G_b(i) / q² - Σ_j G_w(i, j) μ(j)   (updated G_w)    (step 5)

    Without a bias only the scaling ``G_w ← G_w / (q² σ̃²)`` is applied (see the module's Errata).
    Vectorized: one rank-1 update, one scaling, one matrix-vector product (5·n_in·n_out operations).
    """
    F.precondition_(grad_weight, grad_bias, mean, torch.reciprocal(var_tilde * q2), q2)


# --------------------------------------------------------------------------------------------------
# The route chooser
# --------------------------------------------------------------------------------------------------


def _default_kept_route(device: torch.device, *, native_kernel: Any, compiled: bool | None) -> str | None:
    """The kept-input route of the dense layers on ``device``, or ``None`` (eager / fused only).

    As ``torch.optim``'s ``_default_to_fused_or_foreach`` picks an implementation by device:
    ``"native"`` on CPU when ``native=True`` built its kernels; ``"compiled"`` when ``compiled=True``,
    or by default (``compiled=None``) on CUDA where ``torch.compile`` can work (Triton installed) —
    there the eager step is launch-bound; on CPU the default stays eager (the compiled step's
    call overhead is not repaid at these sizes: docs/optim.md).
    """
    if native_kernel is not None and device.type == "cpu":
        return "native"
    if compiled is True:
        return "compiled"
    if compiled is None and device.type == "cuda" and _compiled.available(device):
        return "compiled"
    return None


def _reads_back(device: torch.device) -> bool:
    """Whether a step may read values back from ``device`` (free on CPU; a synchronization that stalls
    the launch queue on a GPU, so there non-finite batches are counted on the device instead)."""
    return device.type == "cpu"


def _kept_group(route: str, layer: BNPLayer, args: tuple) -> tuple:
    """Layers of one call of a kept-input route: the native kernel takes one input dtype per call, the
    compiled step one statistics device and dtype."""
    return (args[0].dtype,) if route == "native" else (layer.mean.device, layer.mean.dtype)


def _distributed() -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


# --------------------------------------------------------------------------------------------------
# The preconditioner
# --------------------------------------------------------------------------------------------------


class BNPreconditioner:
    """Batch normalization preconditioning of a model's Linear / Conv1d / Conv2d gradients (Lange et al.).

    Parameters
    ----------
    model:
        The network.  Every submodule whose type has a registered handler (``nn.Linear``,
        ``nn.Conv1d``, ``nn.Conv2d`` and their subclasses) and is not skipped is preconditioned;
        normalization layers (BN, GroupNorm, LayerNorm) and everything else are left alone, so
        BNP + GN (Lange et al. §5) is ``BNPreconditioner(model_with_groupnorm)``.
    rho:
        Running-average factor ρ ∈ [0, 1) of the input mean and variance (Algorithm 2 step 2);
        ρ = 0 uses the mini-batch statistics.
    eps1, eps2:
        ε₁, ε₂ ≥ 0 of σ̃² = σ² + ε₁·max σ² + ε₂ (Algorithm 2 step 3).
    skip:
        Layers not to precondition: qualified module names (a container's name skips every layer in it;
        ``fnmatch`` patterns allowed, e.g. ``"head.*"``) or module types.  A name pattern that matches no
        module is an error.
    conv_statistics:
        ``"channel"`` (Algorithm 3, Eqs. 21-22) or ``"unfold"`` (per kernel column with zero
        padding counted, Eqs. 19-20).
    process_group:
        Under ``torch.distributed`` (when a default process group is initialized) the statistics of
        all ranks are summed with one all-reduce per step, over this group (default: the world).
    gradient:
        How the preconditioned gradient of an ``nn.Linear`` layer (with bias) is formed.
        ``"transform"`` (default): autograd forms G_w = δᵀH in ``backward()`` and :meth:`step`
        rewrites it in place with Eq. 15 (a rank-1 update, a scaling and a matrix-vector product,
        three passes over the n_out × n_in matrix).  ``"fused"``: the layer's forward runs with
        the weight's ``requires_grad`` switched off, so autograd skips the weight gradient;
        :meth:`step` forms the preconditioned one directly as δᵀĤ with the centered and scaled
        input Ĥ = (H - eμᵀ)·diag(1/(q²σ̃²)) — one N × n_in pass and one matrix product, the one
        autograd would have done (exact, same Eq. 15).  After ``backward()`` and before
        :meth:`step` the weight's ``.grad`` then does not hold the raw gradient (it is ``None`` or
        what it was), and ``torch.autograd.grad`` with respect to the weight sees no dependence;
        not used under ``torch.distributed`` (DDP expects autograd to produce every gradient), for
        other layer types, subclasses of ``nn.Linear``, layers without bias, mixed precision, or a
        second forward of the layer before :meth:`step` (those take the transform route).
        ``"auto"``: decided once per step by the first dense layer that runs: fused when its
        mini-batch has at most n_out rows (then its N × n_in pass costs less than the passes over
        its G_w; the first layer is usually the widest) and it has at least 2¹⁷ weights (below,
        the fused route's extra hook overhead outweighs three passes over G_w; 2²¹ with
        ``native=True`` on CPU, whose transform route makes one pass), transform otherwise, for
        all layers of the step alike (a step mixing both routes pays both routes' fixed costs:
        measured slower than either).

    native:
        ``True``: the ``nn.Linear`` layers on CPU (float32/float64, transform route) take compiled
        kernels (``bnlab.optim._native``, built with a C++ compiler on first use: ~20 s once, then
        cached; if the build fails, a warning and the eager route).  When each such layer ran one
        forward since the last step, its hook only keeps the input, and :meth:`step` does
        Algorithm 2 steps 1-5 for all of them in **one** call: one read of each input (the column
        sums Σ(x - c), Σ(x - c)² about the running mean c) and one pass over each weight gradient
        (step 4 with step 5's sum in the same pass), instead of ~20 eager operator calls and three
        passes over G_w.  Otherwise (several forwards per step, ``torch.distributed``, a gradient
        of another dtype or layout) the layer's statistics still come from the one-pass kernel and
        the rest of the step is eager.  The variance about c cancels by the factor
        1 + (μ_H - c)²/σ_H² (as the moments route on other devices does), where the default eager
        batch-norm kernel's two-pass variance does not.  Default ``False``.
    native_statistics:
        Deprecated alias of ``native`` (the name of the statistics-only kernel it replaced).

    compiled:
        The compiled route of the dense layers: the hook keeps the layer input and :meth:`step`
        runs Algorithm 2 steps 1-5 of all of them as one ``torch.compile``-d function of the
        functional core (``bnlab.optim._functional.dense_steps``), whose elementwise work inductor
        fuses into a few kernels.  ``None`` (default): on CUDA (where the eager step is bound by
        kernel launches) when Triton is installed, not on CPU; ``True``: on every device (CPU
        included: inductor's C++ backend); ``False``: never.  The first step compiles (seconds to a
        minute; again when the batch size changes); a failed compilation warns and runs the same
        functional core uncompiled.  Not taken with ``eps2 < 1e-30`` (then σ̃² of a zero-variance feature can
        be 0 whatever ``eps1``, and that error must be raised before any gradient changes) nor for layers
        ``native=True`` covers.
    cuda_graph:
        On CUDA, the compiled route's step is also captured into a CUDA graph (default ``True``):
        a step is then three launches (the inputs and gradients copied into the graph's buffers,
        the replay, the gradients copied back) instead of the compiled call's Python and one
        launch per fused kernel (``bnlab.optim._compiled``; 0.9-1.3 ms per step of Table 1's
        network on an H200, issue #27).  The first step of each batch size runs uncaptured and is
        captured after it; loading a :meth:`state_dict` captures again.  ``False``: compiled only.
        No effect on other devices or routes.

    Statistics are recorded by forward pre-hooks when the module is in training mode and gradients
    are enabled; several forward passes before one :meth:`step` (gradient accumulation) are pooled.
    Running statistics start at μ = 0, σ² = 1 (Algorithm 2, "initialization").  A batch whose
    statistics are not finite is kept out of them column by column (see the module docstring and
    :attr:`nonfinite_batches`).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        rho: float = 0.99,
        eps1: float = 1e-2,
        eps2: float = 1e-4,
        skip: Iterable[str | type] = (),
        conv_statistics: str = "channel",
        process_group: Any = None,
        gradient: str = "transform",
        native: bool = False,
        native_statistics: bool | None = None,
        compiled: bool | None = None,
        cuda_graph: bool = True,
    ):
        if not isinstance(model, nn.Module):
            raise ValueError(f"model={type(model).__name__} is not allowed: expected a torch.nn.Module")
        self.rho, self.eps1, self.eps2 = self._check_hyper(rho, eps1, eps2)
        self.conv_statistics = check_choice("conv_statistics", conv_statistics, CONV_STATISTICS)
        self.gradient = check_choice("gradient", gradient, GRADIENT_MODES)
        self.process_group = process_group
        if native_statistics is not None:
            if not isinstance(native_statistics, bool):
                raise ValueError(f"native_statistics={native_statistics!r} is not allowed: expected True or False")
            warnings.warn("BNPreconditioner(native_statistics=...) is deprecated: use native=...",
                          DeprecationWarning, stacklevel=2)
            native = native or native_statistics
        if not isinstance(native, bool):
            raise ValueError(f"native={native!r} is not allowed: expected True or False")
        if compiled is not None and not isinstance(compiled, bool):
            raise ValueError(f"compiled={compiled!r} is not allowed: expected None, True or False")
        if not isinstance(cuda_graph, bool):
            raise ValueError(f"cuda_graph={cuda_graph!r} is not allowed: expected True or False")
        self.native = native
        self.compiled = compiled
        self.cuda_graph = cuda_graph
        self._recording = True
        self._auto_fused: bool | None = None
        self._workspace: dict[tuple, torch.Tensor] = {}
        self._skipped: torch.Tensor | None = None
        self._device_counters: dict[tuple, torch.Tensor] = {}
        self.steps = 0
        self._layers: dict[str, BNPLayer] = self._register(model, skip, _native.kernels() if native else None)
        self._layer_list = list(self._layers.values())

    # ------------------------------------------------------------------------------------------
    # Registration
    # ------------------------------------------------------------------------------------------
    def _register(self, model: nn.Module, skip, kernel) -> dict[str, BNPLayer]:
        """Find the layers (handler registry), validate them, build a layer object per layer with
        its kept-input route (the route chooser) and hook it."""
        names, types = _checks.skip_entries(skip, model)
        self._native_kernel = kernel
        layers: dict[str, BNPLayer] = {}
        skipped = []
        for name, module in model.named_modules():
            handler_cls = _handler_for(module)
            if handler_cls is None:
                continue
            # a name skips its module and everything inside it: skip=["head"] of a Sequential head skips its layers
            if isinstance(module, tuple(types)) or any(name == p or fnmatch.fnmatchcase(name, p)
                                                       or name.startswith(p + ".") for p in names):
                skipped.append(name)
                continue
            handler_cls.check(module, name, conv_statistics=self.conv_statistics)
            _checks.check_layer(module, name)
            options = {"conv_statistics": self.conv_statistics}
            if kernel is not None and handler_cls is LinearHandler:
                options["moments_kernel"] = kernel
            handler = handler_cls(module, name, **options)
            if handler.num_columns() == 0:
                raise ValueError(
                    f"BNP cannot precondition layer {_layer_label(name)} ({type(module).__name__}): it has no "
                    f"input features, so there are no statistics to keep; skip it with skip=[{name!r}]"
                )
            if handler_cls is LinearHandler:
                kept = _default_kept_route(module.weight.device, native_kernel=kernel, compiled=self.compiled)
                fuse = self.gradient != "transform" and type(module) is nn.Linear and module.bias is not None
                layer: BNPLayer = DenseLayer(name, module, handler, fuse=fuse, kept_route=kept)
            else:
                layer = ConvLayer(name, module, handler)
            layers[name] = layer
        if not layers:
            supported = ", ".join(sorted(t.__name__ for t in _HANDLERS))
            extra = f" ({len(skipped)} skipped: {', '.join(map(repr, skipped))})" if skipped else ""
            raise ValueError(
                f"model={type(model).__name__} has no layer BNP can precondition{extra}; supported types: {supported}"
            )
        if kernel is not None and not any(getattr(s, "kept_route", None) == "native" for s in layers.values()):
            warnings.warn("BNPreconditioner(native=True): no dense layer is on the CPU, so the compiled CPU kernels "
                          "are not used", RuntimeWarning, stacklevel=3)
        for layer in layers.values():
            layer.hook = layer.module.register_forward_pre_hook(self._make_hook(layer), with_kwargs=True)
        return layers

    @staticmethod
    def _check_hyper(rho, eps1, eps2) -> tuple[float, float, float]:
        rho = check_real("rho", rho, minimum=0.0)
        if rho >= 1.0:
            raise ValueError(f"rho={rho!r} is not allowed: expected a number in [0, 1)")
        eps1 = check_real("eps1", eps1, minimum=0.0, maximum=_EPS1_MAX)
        eps2 = check_real("eps2", eps2, minimum=0.0, maximum=_EPS2_MAX)
        return rho, eps1, eps2

    @property
    def _sigma_tilde_may_vanish(self) -> bool:
        """σ̃² = σ² + ε₁·max σ² + ε₂ is bounded below by ε₂ only: below ``_EPS2_SAFE`` a layer whose
        variances are all 0 (or subnormal: float32 inputs of ~1e-21) can have 1/(q²σ̃²) = inf whatever ε₁,
        so the steps check the inverses then (and the routes that cannot check before the gradients
        change, compiled and native, are not taken)."""
        return self.eps2 < _EPS2_SAFE

    def _vanishing_error(self, layer: BNPLayer) -> RuntimeError:
        return RuntimeError(
            f"BNP layer {_layer_label(layer.name)}: an input feature has zero variance (or one too small for "
            f"its reciprocal in {layer.var.dtype}) and σ̃² = σ² + eps1·max σ² + eps2 with eps1={self.eps1:g}, "
            f"eps2={self.eps2:g} does not keep it from 0, so Eq. 15 divides by zero; use eps2 > 0 (default 1e-4)")

    @property
    def layers(self) -> dict[str, nn.Module]:
        """The preconditioned modules by qualified name."""
        return {name: s.module for name, s in self._layers.items()}

    @property
    def routes(self) -> dict[str, str]:
        """Per layer, the route its forwards take when nothing else is pending: ``"native"``,
        ``"compiled"``, ``"fused"`` (``gradient="fused"``; ``"auto"`` decides per step) or ``"eager"``."""
        out = {}
        for name, s in self._layers.items():
            kept = getattr(s, "kept_route", None)
            out[name] = ("fused" if getattr(s, "fuse", False) and self.gradient == "fused"
                         else kept or "eager")
        return out

    @property
    def nonfinite_batches(self) -> dict[str, int]:
        """Per layer, the steps whose batch statistics had non-finite columns, kept out of the running
        statistics (reads device counters: one synchronization on a GPU)."""
        self._collect_device_flags()
        return {name: s.nonfinite for name, s in self._layers.items()}

    def statistics(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The running mean μ and variance σ² (not σ̃²) of layer ``name``'s input (copies)."""
        if not isinstance(name, str) or name not in self._layers:
            raise ValueError(f"name={name!r} is not allowed: expected one of {', '.join(map(repr, self._layers))}")
        s = self._layers[name]
        return s.mean.clone(), s.var.clone()

    def preconditioner_vectors(self, name: str) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """μ, σ̃² expanded to the columns of the weight matrix, and the last q² of layer ``name``."""
        mean, var = self.statistics(name)
        s = self._layers[name]
        vt = regularized_variance(var, self.eps1, self.eps2)
        return s.handler.expand(mean), s.handler.expand(vt), s.last_q2

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Within this context forward passes record no statistics (e.g. probes, evaluation in train mode)."""
        previous = self._recording
        self._recording = False
        try:
            yield
        finally:
            self._recording = previous

    def remove(self) -> None:
        """Remove the forward hooks (the preconditioner can no longer record statistics)."""
        for s in self._layers.values():
            if s.hook is not None:
                s.hook.remove()
                s.hook = None
            if getattr(s, "post_hook", None) is not None:
                s.post_hook.remove()
                s.post_hook = None

    # ------------------------------------------------------------------------------------------
    # Forward hooks and the route of each forward
    # ------------------------------------------------------------------------------------------
    def _make_hook(self, layer: BNPLayer):
        def hook(module, args, kwargs):
            if not (self._recording and module.training and torch.is_grad_enabled()):
                return None
            if module is not layer.module:  # a deepcopy of the model carries this hook: its forwards are not ours
                return None
            if args:
                x = args[0]
            elif "input" in kwargs:
                x = kwargs["input"]
            else:
                return None
            if not isinstance(x, torch.Tensor):
                return None
            handler = layer.handler
            if not handler.fits(x):
                handler.check_input(x)  # raises, naming the layer, before anything is recorded
            if not x.is_floating_point() or x.shape[0] == 0:
                _checks.bad_input(layer, x)
            if _in_backward():
                # a recomputation inside backward (activation checkpointing): a forward recorded before is
                # replayed and must not count twice; one that was not recorded (the reentrant checkpoint's
                # first pass runs under no_grad) is recorded now
                if layer.unreplayed:
                    layer.unreplayed -= 1
                    return None
            else:
                layer.unreplayed += 1
            route = self._route(layer, x)
            if route == "eager":
                layer.record(x, self._workspace)
            elif route == "kept":
                layer.keep(x)  # step() takes the statistics, in one call for all kept layers
            else:
                layer.start_fused(x)  # step() takes the statistics from the kept input
            return None

        return hook

    def _route(self, layer: BNPLayer, x: torch.Tensor) -> str:
        """The route chooser for one forward of ``layer``: ``"fused"``, ``"kept"`` (the layer's
        kept-input route: native or compiled) or ``"eager"``.

        Only a dense layer's first forward since the last step can take the fused or a kept route
        (a second forward pools moments on the eager route).  ``gradient="auto"`` is decided once
        per step by the first dense layer that runs (see the class docstring)."""
        if not isinstance(layer, DenseLayer) or not layer.idle:
            return "eager"
        if x.device != layer.kept_device:  # the model moved since registration: choose for its new device
            layer.kept_device = x.device
            layer.kept_route = _default_kept_route(x.device, native_kernel=self._native_kernel,
                                                   compiled=self.compiled)
        keeps = layer.kept_route is not None and self._keeps(layer, x)
        if layer.fuse and self._auto_fused is not False and self._fuses(layer, x, keeps):
            return "fused"
        return "kept" if keeps else "eager"

    def _keeps(self, layer: DenseLayer, x: torch.Tensor) -> bool:
        mean = layer.mean
        if layer.kept_route == "native":
            return x.is_cpu and x.dtype == mean.dtype and mean.is_cpu and x.is_contiguous()
        # compiled: any floating input on the statistics' device (upcast inside the compiled step)
        return x.device == mean.device and not self._sigma_tilde_may_vanish

    def _fuses(self, layer: DenseLayer, x: torch.Tensor, one_pass: bool) -> bool:
        module = layer.module
        weight, bias = module.weight, module.bias
        if not (weight.requires_grad and bias.requires_grad and x.dtype == weight.dtype == layer.mean.dtype
                and x.device == layer.mean.device):
            return False
        if self.gradient == "auto":
            if self._auto_fused is None:  # decided once per step, by the first dense layer that runs
                minimum = _AUTO_FUSED_MIN_WEIGHTS_NATIVE if one_pass else _AUTO_FUSED_MIN_WEIGHTS
                self._auto_fused = x.shape[0] <= module.out_features and weight.numel() >= minimum
            if not self._auto_fused:
                return False
        if weight._backward_hooks or getattr(weight, "_post_accumulate_grad_hooks", None):
            return False  # hooks on the weight's gradient would not run: keep autograd's route
        if torch.is_autocast_enabled(x.device.type):
            return False  # the output and δ would be in the autocast dtype (mixed precision)
        return not _distributed()

    # ------------------------------------------------------------------------------------------
    # step(): orchestration
    # ------------------------------------------------------------------------------------------
    def step(self) -> None:
        """Precondition the ``.grad`` of every layer's weight and bias (Algorithm 2 / 3, steps 1-5).

        Call after ``loss.backward()`` and before ``optimizer.step()``.  Raises ``RuntimeError`` if
        no statistics were recorded since the last step (no forward pass in training mode), or if
        a layer has a gradient but its forward hook never saw an input.
        """
        # the native kernel records nothing: no autograd mode switch for it
        if self._native_kernel is not None and self._kept_only_step("native"):
            return
        with torch.no_grad():
            if not self._kept_only_step("compiled"):
                self._step()
        if self.steps % _NONFINITE_CHECK_EVERY == 0:
            self._collect_device_flags()

    def _kept_only_step(self, route: str) -> bool:
        """The common case of a kept-input route (``"native"``: ``native=True`` on CPU; ``"compiled"``: the
        CUDA default): every layer ran exactly one forward on ``route`` since the last step, its gradients
        qualify (:meth:`DenseLayer.native_args` / :meth:`DenseLayer.compiled_args`) and all fall in one
        call's group (:func:`_kept_group`).  Then one call does the whole step — one kernel call, or one
        graph replay on CUDA — without :meth:`_step`'s sorting by route, and this returns ``True``;
        otherwise nothing is changed and it returns ``False``.  (One pass over the layers: at N = 16 on
        Table 1's network the Python around the native kernel is still ~0.025 ms of ``step()``'s
        ~0.09 ms; on an H100 the Python around the replay was most of ``step()`` through :meth:`_step`,
        0.24-0.28 ms per step, 2026-11-28.)"""
        native = route == "native"
        layers = self._layer_list
        args, group = [], None
        for s in layers:
            if s.kept_x is None or s.kept_route != route:
                return False
            a = s.native_args() if native else s.compiled_args()
            if a is None:
                return False
            key = _kept_group(route, s, a)
            if group is not None and key != group:
                return False  # a second dtype or device: one call per group, through _step
            group = key
            args.append(a)
        if not args or _distributed():
            return False
        (self._native_step if native else self._compiled_step)(layers, args)
        for s in layers:
            s.kept_x = None  # nothing else was pending: a kept input is a layer's only record of a step
            s.steps += 1
        self.steps += 1
        return True

    def _step(self) -> None:
        layers = self._layer_list
        pending = [s for s in layers if s.pending]
        if not pending:
            raise RuntimeError(
                "BNPreconditioner.step() was called before any forward pass recorded statistics: run the "
                "model forward in training mode with gradients enabled between steps"
            )
        for s in layers:
            # a layer this step did not use, its gradient zeroed in place (zero_grad(set_to_none=False)), has
            # nothing to precondition: left alone (the check syncs with the device, on this rare path only)
            if not s.pending and s.has_grad() and not s.zero_grad_only():
                raise RuntimeError(
                    f"BNP layer {_layer_label(s.name)} has a gradient but its forward hook recorded no input "
                    "since the last step (was it called through its forward()?); skip it with "
                    f"skip=[{s.name!r}]"
                )
        self._auto_fused = None
        eager: list[BNPLayer] = []
        lean: list[DenseLayer] = []
        kept: dict[str, list[tuple[DenseLayer, tuple]]] = {}
        distributed = None
        for s in pending:
            if s.kept_x is not None:
                if distributed is None:
                    distributed = _distributed()
                args = None if distributed else (s.native_args() if s.kept_route == "native"
                                                 else s.compiled_args())
                if args is not None:
                    kept.setdefault(s.kept_route, []).append((s, args))
                    continue
                s.flush_kept(self._workspace)  # the statistics are all-reduced, or the gradients do not qualify
            elif s.fused is not None:
                s.check_fused_version()
                if s.is_lean():
                    lean.append(s)
                    continue
                s.pool_fused_moments(self._workspace)
            eager.append(s)
        if eager:
            self._eager_step(eager)
        if lean:
            self._lean_step(lean)
        for route, pairs in kept.items():
            by_dtype: dict[tuple, list] = {}
            for pair in pairs:  # one call per input dtype (native) / statistics device and dtype (compiled)
                by_dtype.setdefault(_kept_group(route, *pair), []).append(pair)
            for group in by_dtype.values():
                step = self._native_step if route == "native" else self._compiled_step
                step([p[0] for p in group], [p[1] for p in group])
        for s in pending:
            s.clear_pending()
            s.steps += 1
        self.steps += 1

    # ------------------------------------------------------------------------------------------
    # The routes' steps
    # ------------------------------------------------------------------------------------------
    def _eager_step(self, layers: list[BNPLayer]) -> None:
        """Steps 1-5 on the eager route (and the fused forwards off their lean path): statistics
        all-reduced under torch.distributed, updated in groups with ``torch._foreach_*``, then each
        layer's gradients transformed."""
        self._all_reduce(layers)
        inverses = self._update_statistics(layers)
        for s, inv in zip(layers, inverses):
            if s.fused is not None:
                s.fused_transform(inv)
            else:
                s.precondition(inv)

    def _update_statistics(self, layers: list[BNPLayer]) -> list[torch.Tensor]:
        """Algorithm 2 / 3 steps 1-3 for the layers; returns each layer's 1/(q² σ̃²).

        Batched with ``torch._foreach_*`` (as ``torch.optim`` does) over the layers that share
        device, dtype (and, for pooled moments, row count), so a step costs a fixed number of
        operator calls per group instead of a dozen per layer.
        """
        direct: dict[tuple, list[int]] = {}
        moments: dict[tuple, list[int]] = {}
        for i, s in enumerate(layers):
            if s.batch_mean is not None:
                direct.setdefault((s.mean.device, s.mean.dtype), []).append(i)
            else:
                moments.setdefault((s.mean.device, s.mean.dtype, s.rows), []).append(i)
        inverses: list[Any] = [None] * len(layers)
        for index in direct.values():  # layers with μ_H, σ_H² of one forward
            group = [layers[i] for i in index]
            for i, inv in zip(index, self._direct_update(group)):
                inverses[i] = inv
        for (_, _, rows), index in moments.items():
            group = [layers[i] for i in index]
            new_means, new_vars = F.moments_running_average(
                [s.mean for s in group], [s.var for s in group], [s.s1 for s in group], [s.s2 for s in group],
                rows, self.rho)
            for i, inv in zip(index, self._commit(group, new_means, new_vars)):
                inverses[i] = inv
        return inverses

    def _direct_update(self, group: list[BNPLayer]) -> list[torch.Tensor]:
        """Step 2 from each layer's μ_H, σ_H² (one device and dtype; at N = 1 σ_H² is the variance
        about the running mean before the update, (h - μ)², §3.3), then :meth:`_commit`."""
        batch_vars = [s.batch_mean.sub(s.mean).square_() if s.rows == 1 else s.batch_var for s in group]
        new_means, new_vars = F.running_average([s.mean for s in group], [s.var for s in group],
                                                [s.batch_mean for s in group], batch_vars, self.rho)
        return self._commit(group, new_means, new_vars)

    def _commit(self, group: list[BNPLayer], new_means, new_vars) -> list[torch.Tensor]:
        """Keep non-finite columns out of the new statistics, store them, and return step 3's
        1/(q²σ̃²) per layer (:func:`bnlab.optim._functional.inverse_scales`)."""
        q2s = []
        for s in group:
            s.last_q2 = s.handler.q2(s.samples)
            q2s.append(float(s.last_q2))
        maxes = None
        if _reads_back(new_vars[0].device):
            # The maxima are read back once (no device to wait for): σ̃²'s shifts as Python floats,
            # and a non-finite batch seen for free (the maximum of a column with NaN/inf is).
            maxes = torch.stack(torch._foreach_max(new_vars)).tolist()
            for i, m in enumerate(maxes):
                if not math.isfinite(m):
                    s = group[i]
                    new_means[i], new_vars[i], bad = F.keep_finite(new_means[i], new_vars[i], s.mean, s.var)
                    self._flag_nonfinite(s, int(bad))
                    maxes[i] = float(new_vars[i].max())
        else:
            for i, s in enumerate(group):  # no host synchronization: counted on the device
                new_means[i], new_vars[i], bad = F.keep_finite(new_means[i], new_vars[i], s.mean, s.var)
                self._flag_device(s, bad)
        inverses = F.inverse_scales(new_vars, q2s, self.eps1, self.eps2, maxes)
        if self._sigma_tilde_may_vanish:  # checked before the statistics are stored or a gradient changes
            for s, inv in zip(group, inverses):
                if not bool(torch.isfinite(inv).all()):
                    raise self._vanishing_error(s)
        for s, mean, var in zip(group, new_means, new_vars):
            s.mean, s.var = mean, var
        return inverses

    def _lean_step(self, layers: list[DenseLayer]) -> None:
        """Algorithm 2 steps 1-5 for fused forwards with nothing else pending (the common case of
        the fused route): μ_H, σ_H² of the kept input (Eq. 13), the running update and
        1/(q²σ̃²) batched over the layers, then G_w' = δᵀĤ per layer (:meth:`DenseLayer.lean_transform`)."""
        groups: dict[tuple, list[DenseLayer]] = {}
        for s in layers:
            groups.setdefault((s.mean.device, s.mean.dtype), []).append(s)
        for group in groups.values():
            for s in group:
                s.lean_statistics()
            for s, inv in zip(group, self._direct_update(group)):
                s.lean_transform(inv)

    def _native_step(self, layers: list[DenseLayer], args: list[tuple]) -> None:
        """Algorithm 2 steps 1-5 of ``layers`` in one call of the compiled ``dense_step`` (see
        ``bnlab.optim._native``) given their :meth:`DenseLayer.native_args` (one dtype)."""
        for s, a in zip(layers, args):
            if a[0]._version != s.kept_version:
                s.check_kept_version(a[0])  # raises
        xs, gws, gbs, q2s = (list(column) for column in zip(*args))
        skipped = self._skipped
        if skipped is None or skipped.numel() < len(layers):
            skipped = self._skipped = torch.zeros(len(self._layer_list), dtype=torch.int64)
        bad = self._native_kernel.dense_step(xs, [s.mean for s in layers], [s.var for s in layers], gws, gbs,
                                             self.rho, self.eps1, self.eps2, q2s, skipped)
        if bad >= 0:
            raise self._vanishing_error(layers[bad])
        if bad == -2:  # non-finite statistics were kept back (see _native)
            for s, count in zip(layers, skipped.tolist()):
                if count:
                    self._flag_nonfinite(s, count)
        for s, a in zip(layers, args):
            s.samples = s.rows = a[0].shape[0]
            s.last_q2 = a[3]

    def _compiled_step(self, layers: list[DenseLayer], args: list[tuple]) -> None:
        """Algorithm 2 steps 1-5 of ``layers`` (one statistics device and dtype) in one call of the
        compiled functional core (``bnlab.optim._compiled``) given their :meth:`DenseLayer.compiled_args`."""
        for s, a in zip(layers, args):
            if a[0]._version != s.kept_version:
                s.check_kept_version(a[0])  # raises
        xs, gws, gbs, q2s = (list(column) for column in zip(*args))
        device = layers[0].mean.device
        counter = None
        if not _reads_back(device):  # counted inside the compiled call, read every few steps
            key = tuple(s.name for s in layers)
            counter = self._device_counters.get(key)
            if counter is None:
                counter = self._device_counters[key] = torch.zeros(len(layers), dtype=torch.int64, device=device)
        step = (_compiled.captured_dense_steps_ if self.cuda_graph and _compiled.capturable(device)
                else _compiled.dense_steps_)
        skipped = step(xs, [s.mean for s in layers], [s.var for s in layers], gws, gbs, q2s,
                       self.rho, self.eps1, self.eps2, counter)
        if counter is None:
            for s, count in zip(layers, skipped.tolist()):
                if count:
                    self._flag_nonfinite(s, count)
        for s, a in zip(layers, args):
            s.samples = s.rows = a[0].shape[0]
            s.last_q2 = a[3]

    # ------------------------------------------------------------------------------------------
    # Non-finite batches
    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _flag_nonfinite(s: BNPLayer, columns: int | None, steps: int = 1) -> None:
        s.nonfinite += steps
        what = (f"{columns} of {s.mean.numel()} input features had" if columns is not None
                else f"{steps} step(s) since the last check had input features with")
        warnings.warn(
            f"BNP layer {_layer_label(s.name)}: {what} non-finite batch statistics (NaN or infinite inputs, or a "
            f"variance that overflows {s.mean.dtype}); they kept their running mean and variance (counted in "
            "BNPreconditioner.nonfinite_batches)",
            RuntimeWarning,
            stacklevel=4,
        )

    @staticmethod
    def _flag_device(s: BNPLayer, skipped_columns: torch.Tensor) -> None:
        hit = (skipped_columns > 0).to(torch.int64)
        s.nonfinite_device = hit if s.nonfinite_device is None else s.nonfinite_device.add_(hit)

    def _collect_device_flags(self) -> None:
        """Move the device counters of non-finite batches to the host (one synchronization) and warn."""
        for key, counter in list(self._device_counters.items()):
            counts = counter.tolist()
            del self._device_counters[key]
            for name, steps in zip(key, counts):
                if steps:
                    self._flag_nonfinite(self._layers[name], None, steps)
        for s in self._layer_list:
            if s.nonfinite_device is not None:
                steps = int(s.nonfinite_device)
                s.nonfinite_device = None
                if steps:
                    self._flag_nonfinite(s, None, steps)

    # ------------------------------------------------------------------------------------------
    # torch.distributed
    # ------------------------------------------------------------------------------------------
    def _all_reduce(self, pending: list[BNPLayer]) -> None:
        if not _distributed():
            return
        import torch.distributed as dist

        if dist.get_world_size(self.process_group) == 1:
            return
        for s in pending:
            s.batch_to_moments()
        # One flat buffer per (device, dtype): [samples, rows, s1, s2] of every layer, summed.
        groups: dict[tuple, list[BNPLayer]] = {}
        for s in pending:
            groups.setdefault((s.s1.device, s.s1.dtype), []).append(s)
        for (device, dtype), states in groups.items():
            parts = []
            for s in states:
                head = torch.tensor([float(s.samples), float(s.rows)], dtype=dtype, device=device)
                parts += [head, s.s1, s.s2]
            flat = torch.cat(parts)
            dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=self.process_group)
            offset = 0
            counts = flat[[i for st in _offsets(states) for i in st]].tolist()  # one host sync
            for j, s in enumerate(states):
                k = s.s1.numel()
                s.samples, s.rows = counts[2 * j], counts[2 * j + 1]
                s.s1 = flat[offset + 2: offset + 2 + k]
                s.s2 = flat[offset + 2 + k: offset + 2 + 2 * k]
                offset += 2 + 2 * k

    # ------------------------------------------------------------------------------------------
    # State
    # ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Hyperparameters, step counts and the running statistics of every layer (tensors cloned)."""
        return {
            "hyperparameters": {
                "rho": self.rho,
                "eps1": self.eps1,
                "eps2": self.eps2,
                "conv_statistics": self.conv_statistics,
            },
            "steps": self.steps,
            "layers": {
                name: {"mean": s.mean.detach().clone(), "var": s.var.detach().clone(), "steps": s.steps}
                for name, s in self._layers.items()
            },
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; tensors move to each layer's device (any map_location works).

        As in ``torch.optim``, the saved hyperparameters (ρ, ε₁, ε₂) replace the constructor's.
        Pending (not yet stepped) statistics are discarded.  Everything is checked before anything
        changes (keys, types, shapes, dtypes, finiteness in the statistics' dtype, variances ≥ 0,
        integer step counts ≥ 0): on a ``ValueError`` the preconditioner is left as it was.
        """
        if not isinstance(state_dict, Mapping) or not {"hyperparameters", "steps", "layers"} <= set(state_dict):
            raise ValueError(
                "state_dict is not allowed: expected the mapping returned by BNPreconditioner.state_dict() "
                "(keys 'hyperparameters', 'steps', 'layers')"
            )
        hyper = _checks.entry_mapping(state_dict["hyperparameters"], "state_dict['hyperparameters']",
                               ("rho", "eps1", "eps2"))
        rho, eps1, eps2 = self._check_hyper(hyper["rho"], hyper["eps1"], hyper["eps2"])
        conv = hyper.get("conv_statistics", "channel")
        if conv != self.conv_statistics:
            raise ValueError(
                f"state_dict has conv_statistics={conv!r} but this preconditioner uses {self.conv_statistics!r}"
            )
        steps = check_int("state_dict['steps']", state_dict["steps"], minimum=0)
        layers = state_dict["layers"]
        if not isinstance(layers, Mapping):
            raise ValueError(f"state_dict['layers']={type(layers).__name__} is not allowed: expected a mapping "
                             "layer name -> {'mean', 'var', 'steps'}")
        missing = sorted(set(self._layers) - set(layers))
        unexpected = sorted(set(layers) - set(self._layers), key=repr)
        if missing or unexpected:
            raise ValueError(
                f"state_dict layers do not match this preconditioner's: missing {missing}, unexpected {unexpected}"
            )
        new = {}
        for name, s in self._layers.items():
            where = f"state_dict layer {name!r}"
            entry = _checks.entry_mapping(layers[name], where, ("mean", "var", "steps"))
            cols = s.handler.num_columns()
            weight = s.module.weight
            dtype = stats_dtype(weight.dtype)
            mean = _checks.state_tensor(entry["mean"], f"{where} 'mean'", cols, dtype, weight.device)
            var = _checks.state_tensor(entry["var"], f"{where} 'var'", cols, dtype, weight.device)
            if bool((var < 0).any()):
                raise ValueError(f"{where} 'var' is not allowed: it has negative entries (minimum "
                                 f"{float(var.min()):.6g}); a variance is >= 0")
            new[name] = (mean, var, check_int(f"{where} 'steps'", entry["steps"], minimum=0))
        self.rho, self.eps1, self.eps2 = rho, eps1, eps2
        self.steps = steps
        for name, (mean, var, layer_steps) in new.items():
            s = self._layers[name]
            s.mean, s.var, s.steps = mean, var, layer_steps
            s.clear_pending()

    def __repr__(self) -> str:
        return (
            f"BNPreconditioner(layers={len(self._layers)}, rho={self.rho}, eps1={self.eps1}, eps2={self.eps2}, "
            f"conv_statistics={self.conv_statistics!r}, gradient={self.gradient!r}, native={self.native}, "
            f"compiled={self.compiled}, cuda_graph={self.cuda_graph}, steps={self.steps})"
        )


def _offsets(states: list[BNPLayer]) -> list[tuple[int, int]]:
    out, offset = [], 0
    for s in states:
        out.append((offset, offset + 1))
        offset += 2 + 2 * s.s1.numel()
    return out
