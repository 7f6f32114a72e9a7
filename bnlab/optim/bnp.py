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
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

import torch
from torch import nn

from bnlab._validation import check_choice, check_real
from bnlab.optim import _native
from bnlab.optim._layers import (
    CONV_STATISTICS,
    Conv1dHandler,
    Conv2dHandler,
    LayerHandler,
    LinearHandler,
    _layer_label,
    block_rows,
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
#: The same threshold when ``native=True`` gives the transform route its one-call compiled step on
#: CPU: a single bandwidth-bound pass over G_w, which the fused route beats only for large layers
#: (measured at N = 16, × SGD, fused against native: 1.42 vs 1.16 with 3072 × 100, 1.23 vs 1.17
#: with 1024 × 1024, 1.29 vs 1.16 with 2048 × 512, 1.05 vs 1.17 with 4096 × 1024; docs/optim.md).
_AUTO_FUSED_MIN_WEIGHTS_NATIVE = 1 << 21

#: The "no bias gradient" placeholder of the native dense_step's list of bias gradients.
_EMPTY = torch.empty(0)

_HANDLERS: dict[type, type[LayerHandler]] = {
    nn.Linear: LinearHandler,
    nn.Conv1d: Conv1dHandler,
    nn.Conv2d: Conv2dHandler,
}


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


# --------------------------------------------------------------------------------------------------
# Functional core
# --------------------------------------------------------------------------------------------------


def regularized_variance(var: torch.Tensor, eps1: float, eps2: float) -> torch.Tensor:
    """σ̃² = σ² + ε₁·max(σ²) + ε₂ (Lange et al., Algorithm 2 step 3; Algorithm 3 step 3)."""
    return var + (var.max() * eps1 + eps2)


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
    _precondition_with_inverse_(grad_weight, grad_bias, mean, torch.reciprocal(var_tilde * q2), q2)


def _precondition_with_inverse_(grad_weight, grad_bias, mean, inv, q2) -> None:
    """:func:`bnp_precondition_` given ``inv`` = 1/(q² σ̃²) (Lange et al., Algorithm 2 steps 4-5)."""
    if grad_bias is None:
        grad_weight.mul_(inv)
        return
    grad_weight.addr_(grad_bias, mean, alpha=-1.0)
    grad_weight.mul_(inv)
    _bias_step_(grad_bias, grad_weight, mean, q2)


def _bias_step_(grad_bias, mat, vec, q2) -> None:
    """Algorithm 2 step 5 in place: G_b ← G_b/q² - mat·vec (one ``addmv_``, 1/q² as its β)."""
    if isinstance(q2, torch.Tensor):
        grad_bias.div_(q2)
        grad_bias.addmv_(mat, vec, alpha=-1.0)
    else:
        grad_bias.addmv_(mat, vec, beta=1.0 / q2, alpha=-1.0)


# --------------------------------------------------------------------------------------------------
# The preconditioner
# --------------------------------------------------------------------------------------------------


def _stats_dtype(dtype: torch.dtype) -> torch.dtype:
    # Statistics in float32 for half/bfloat16 layers (mixed precision), float64 kept for theory.
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class _LayerState:
    name: str
    module: nn.Module
    handler: LayerHandler
    mean: torch.Tensor
    var: torch.Tensor
    steps: int = 0
    # Moments of the inputs seen since the last step (summed over forward calls).
    samples: Any = 0
    rows: Any = 0
    s1: torch.Tensor | None = None
    s2: torch.Tensor | None = None
    # The mean μ_H and biased variance σ_H² of the only forward since the last step, where the
    # handler gives them directly (LayerHandler.batch_statistics); a second forward turns them
    # into moments (s1, s2) to pool.
    batch_mean: torch.Tensor | None = None
    batch_var: torch.Tensor | None = None
    hook: Any = field(default=None, repr=False)
    post_hook: Any = field(default=None, repr=False)
    post_fn: Any = field(default=None, repr=False)
    scratch: Any = field(default=None, repr=False)
    last_q2: Any = None
    # gradient="fused"/"auto": whether the layer can take the fused route at all (a plain
    # nn.Linear with a bias), the weight's requires_grad switched off for the running forward,
    # and the fused forward's input H (with its version counter) and output gradient δ.
    can_fuse: bool = False
    toggled: bool = False
    fused_x: torch.Tensor | None = None
    fused_version: int = 0
    fused_delta: torch.Tensor | None = None
    # The bias had no gradient and no gradient hooks when the fused forward ran: its gradient
    # after backward() is then δᵀe (this forward's), which the lean route of step() relies on.
    fused_clean: bool = False
    fused_buffer: torch.Tensor | None = field(default=None, repr=False)
    # native=True: whether the layer can take the compiled one-call step at all (a dense layer and
    # the kernels built), and the input of the only forward since the last step, kept by the hook
    # (with its version counter) for that step to take its statistics from.
    native_ok: bool = False
    native_x: torch.Tensor | None = None
    native_version: int = 0
    native_q2: tuple = (0, 1.0)  # (N, q²(N)) of the last native step

    def clear_pending(self) -> None:
        self.samples = 0
        self.rows = 0
        self.s1 = None
        self.s2 = None
        self.batch_mean = None
        self.batch_var = None
        self.fused_x = None
        self.fused_delta = None
        self.native_x = None


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
        Layers not to precondition: qualified module names (``fnmatch`` patterns allowed, e.g.
        ``"head.*"``) or module types.  A name pattern that matches no module is an error.
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

    Statistics are recorded by forward pre-hooks when the module is in training mode and gradients
    are enabled; several forward passes before one :meth:`step` (gradient accumulation) are pooled.
    Running statistics start at μ = 0, σ² = 1 (Algorithm 2, "initialization").
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
        self.native = native
        kernel = _native.kernels() if native else None
        self._native_kernel = kernel
        self._recording = True
        self._auto_fused: bool | None = None
        self._workspace: dict[tuple, torch.Tensor] = {}
        self._layers: dict[str, _LayerState] = {}
        self.steps = 0

        skip = tuple(skip) if not isinstance(skip, (str, type)) else (skip,)
        names, types = [], []
        for item in skip:
            if isinstance(item, str):
                names.append(item)
            elif isinstance(item, type) and issubclass(item, nn.Module):
                types.append(item)
            else:
                raise ValueError(f"skip entry {item!r} is not allowed: expected a module name (str) or an nn.Module type")
        all_names = [n for n, _ in model.named_modules()]
        for pattern in names:
            if not any(n == pattern or fnmatch.fnmatchcase(n, pattern) for n in all_names):
                raise ValueError(
                    f"skip entry {pattern!r} matches no module of the model (module names: "
                    f"{', '.join(repr(n) for n in all_names[1:21])}{' …' if len(all_names) > 21 else ''})"
                )

        skipped = []
        for name, module in model.named_modules():
            handler_cls = _handler_for(module)
            if handler_cls is None:
                continue
            if isinstance(module, tuple(types)) or any(
                name == p or fnmatch.fnmatchcase(name, p) for p in names
            ):
                skipped.append(name)
                continue
            handler_cls.check(module, name, conv_statistics=self.conv_statistics)
            options = {"conv_statistics": self.conv_statistics}
            if kernel is not None and handler_cls is LinearHandler:
                options["moments_kernel"] = kernel
            handler = handler_cls(module, name, **options)
            weight = module.weight
            dtype = _stats_dtype(weight.dtype)
            cols = handler.num_columns()
            state = _LayerState(
                name=name,
                module=module,
                handler=handler,
                mean=torch.zeros(cols, dtype=dtype, device=weight.device),
                var=torch.ones(cols, dtype=dtype, device=weight.device),
                can_fuse=(self.gradient != "transform" and type(module) is nn.Linear
                          and module.bias is not None),
                native_ok=kernel is not None and handler_cls is LinearHandler,
            )
            self._layers[name] = state
        if not self._layers:
            supported = ", ".join(sorted(t.__name__ for t in _HANDLERS))
            extra = f" ({len(skipped)} skipped: {', '.join(map(repr, skipped))})" if skipped else ""
            raise ValueError(
                f"model={type(model).__name__} has no layer BNP can precondition{extra}; supported types: {supported}"
            )
        self._layer_list = list(self._layers.values())
        for state in self._layers.values():
            state.hook = state.module.register_forward_pre_hook(self._make_hook(state), with_kwargs=True)
            if state.can_fuse:
                state.post_fn = self._make_post_hook(state)

    # ------------------------------------------------------------------------------------------
    @staticmethod
    def _check_hyper(rho, eps1, eps2) -> tuple[float, float, float]:
        rho = check_real("rho", rho, minimum=0.0)
        if rho >= 1.0:
            raise ValueError(f"rho={rho!r} is not allowed: expected a number in [0, 1)")
        eps1 = check_real("eps1", eps1, minimum=0.0)
        eps2 = check_real("eps2", eps2, minimum=0.0)
        return rho, eps1, eps2

    @property
    def layers(self) -> dict[str, nn.Module]:
        """The preconditioned modules by qualified name."""
        return {name: s.module for name, s in self._layers.items()}

    def statistics(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The running mean μ and variance σ² (not σ̃²) of layer ``name``'s input (copies)."""
        if name not in self._layers:
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
            if s.post_hook is not None:
                s.post_hook.remove()
                s.post_hook = None

    # ------------------------------------------------------------------------------------------
    def _make_hook(self, state: _LayerState):
        def hook(module, args, kwargs):
            if not (self._recording and module.training and torch.is_grad_enabled()):
                return None
            if args:
                x = args[0]
            elif "input" in kwargs:
                x = kwargs["input"]
            else:
                return None
            if not isinstance(x, torch.Tensor):
                return None
            handler = state.handler
            if x.dim() != handler.expected_input_ndim:
                handler.check_input(x)  # raises, naming the layer
            if (state.can_fuse and self._auto_fused is not False and state.fused_x is None and state.s1 is None
                    and state.batch_mean is None and self._start_fused(state, module, x)):
                return None  # the statistics of a fused forward are taken in step(), from the kept input
            if (state.native_ok and state.native_x is None and state.s1 is None and state.batch_mean is None
                    and state.fused_x is None and x.is_cpu and x.dtype == state.mean.dtype
                    and state.mean.is_cpu and x.is_contiguous()):
                # native=True: keep the input; step() takes its statistics in the one-call kernel.
                x = x.detach()
                state.native_x = x
                state.native_version = x._version
                return None
            self._record(state, x)
            return None

        return hook

    def _start_fused(self, state: _LayerState, module: nn.Module, x: torch.Tensor) -> bool:
        """Take this forward of ``module`` on the fused route if it qualifies (see ``gradient``)."""
        weight, bias = module.weight, module.bias
        if not (weight.requires_grad and bias.requires_grad and x.dtype == weight.dtype == state.mean.dtype
                and x.device == state.mean.device):
            return False
        if self.gradient == "auto":
            if self._auto_fused is None:  # decided once per step, by the first dense layer that runs
                native = state.native_ok and x.is_cpu
                minimum = _AUTO_FUSED_MIN_WEIGHTS_NATIVE if native else _AUTO_FUSED_MIN_WEIGHTS
                self._auto_fused = x.shape[0] <= module.out_features and weight.numel() >= minimum
            if not self._auto_fused:
                return False
        if weight._backward_hooks or getattr(weight, "_post_accumulate_grad_hooks", None):
            return False  # hooks on the weight's gradient would not run: keep autograd's route
        if torch.is_autocast_enabled(x.device.type):
            return False  # the output and δ would be in the autocast dtype (mixed precision)
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return False
        if state.post_hook is None:
            # Registered while a fused forward is pending (removed by step()), so layers that do
            # not fuse pay nothing; always_call restores requires_grad even if the forward raises.
            state.post_hook = module.register_forward_hook(state.post_fn, always_call=True)
        weight.requires_grad_(False)
        state.toggled = True
        state.fused_x = x.detach()
        state.fused_version = x._version
        state.fused_clean = (bias.grad is None and not bias._backward_hooks
                             and not getattr(bias, "_post_accumulate_grad_hooks", None))
        return True

    def _make_post_hook(self, state: _LayerState):
        def capture(grad_outputs):
            # δ = ∂L/∂(output) of this forward (G_w = δᵀH, Lange et al. Eq. 9); summed over repeated backward
            # passes through the same graph, as autograd sums gradients.
            delta = grad_outputs[0]
            if delta is not None:
                state.fused_delta = delta if state.fused_delta is None else state.fused_delta + delta

        def post_hook(module, args, output):
            if not state.toggled:
                return None
            state.toggled = False
            module.weight.requires_grad_(True)
            grad_fn = getattr(output, "grad_fn", None)
            if grad_fn is None:  # the forward raised, or its output is not differentiable
                state.fused_x = None
            else:
                grad_fn.register_prehook(capture)
            return None

        return post_hook

    def _record(self, state: _LayerState, x: torch.Tensor) -> None:
        # Detached operands record no autograd graph, so no no_grad() context is needed; autocast
        # leaves sub/sum/mul_ of float32 tensors alone.
        if state.native_x is not None:
            self._flush_native(state)  # a second forward: pool the kept input's moments first
        x = x.detach()
        mean = state.mean
        if x.dtype == mean.dtype and x.device == mean.device:
            # The common case, checked first to keep the per-call Python overhead small: the
            # statistics' dtype is the input's (an input of another dtype than the statistics
            # either is converted below or, if the weight's dtype changed, moves them).
            out = self._scratch(state, x)
        else:
            dtype = _stats_dtype(state.module.weight.dtype)
            if mean.device != x.device or mean.dtype != dtype:
                state.mean = state.mean.to(device=x.device, dtype=dtype)
                state.var = state.var.to(device=x.device, dtype=dtype)
            if x.dtype != dtype:
                x = x.to(dtype)  # a private copy (mixed precision): it can be its own scratch
                out = None
            else:
                out = self._scratch(state, x)
        if state.s1 is None and state.batch_mean is None and state.fused_x is None:
            stats = state.handler.batch_statistics_about(x, state.mean)
            if stats is not None:  # the first forward since the last step: μ_H and σ_H² directly
                state.batch_mean, state.batch_var = stats
                state.samples = state.rows = x.shape[0]
                return
        self._add_moments(state, x, out)

    def _add_moments(self, state: _LayerState, x: torch.Tensor, scratch) -> None:
        """Pool the moments of input ``x`` (about the running mean) into the layer's pending ones, after
        turning any pending μ_H, σ_H² into moments first."""
        self._batch_to_moments(state)
        samples, rows, s1, s2 = state.handler.moments(x, state.mean, scratch)
        if state.s1 is None:
            state.samples, state.rows, state.s1, state.s2 = samples, rows, s1, s2
        else:
            state.samples += samples
            state.rows += rows
            state.s1 = state.s1 + s1
            state.s2 = state.s2 + s2

    def _flush_native(self, state: _LayerState) -> None:
        """Turn the input a hook kept for the one-call native step into pending moments (the
        layer then takes the eager route this step)."""
        x = state.native_x
        state.native_x = None
        self._check_native_version(state, x)
        self._add_moments(state, x, self._scratch(state, x))

    @staticmethod
    def _check_native_version(state: _LayerState, x: torch.Tensor) -> None:
        if x._version != state.native_version:
            raise RuntimeError(
                f"BNP layer {_layer_label(state.name)}: its input was modified in place after the forward pass; "
                "with native=True BNP keeps the input to take its statistics in step() (use native=False, or "
                "avoid the in-place operation)"
            )

    @staticmethod
    def _batch_to_moments(state: _LayerState) -> None:
        """Turn a layer's pending μ_H, σ_H² into moments about c = μ (exact: with d = μ_H - c,
        s1 = N d, s2 = N (σ_H² + d²)), to pool them with other forwards or all-reduce them."""
        if state.batch_mean is None:
            return
        n = state.samples
        d = state.batch_mean.sub_(state.mean)
        state.s1, state.s2 = d * n, torch.addcmul(state.batch_var, d, d).mul_(n)
        state.batch_mean = state.batch_var = None

    def _scratch(self, state: _LayerState, x: torch.Tensor) -> torch.Tensor:
        # One buffer per (device, dtype), grown to the largest block of layer input the handlers
        # use (``block_rows`` samples; hooks run one at a time); each layer caches its view of it
        # while the shape and the buffer stay the same.
        cached = state.scratch
        if (cached is not None and cached[2] == x.shape and cached[3] == (x.device, x.dtype)
                and cached[0] is self._workspace.get(cached[3])):
            return cached[1]
        key = (x.device, x.dtype)
        shape = (block_rows(x),) + tuple(x.shape[1:])
        numel = math.prod(shape)
        buf = self._workspace.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=x.dtype, device=x.device)
            self._workspace[key] = buf
        view = buf[:numel].view(shape)
        state.scratch = (buf, view, x.shape, key)
        return view

    def _all_reduce(self, pending: list[_LayerState]) -> None:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
        if dist.get_world_size(self.process_group) == 1:
            return
        for s in pending:
            self._batch_to_moments(s)
        # One flat buffer per (device, dtype): [samples, rows, s1, s2] of every layer, summed.
        groups: dict[tuple, list[_LayerState]] = {}
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

    def step(self) -> None:
        """Precondition the ``.grad`` of every layer's weight and bias (Algorithm 2 / 3, steps 1-5).

        Call after ``loss.backward()`` and before ``optimizer.step()``.  Raises ``RuntimeError`` if
        no statistics were recorded since the last step (no forward pass in training mode), or if
        a layer has a gradient but its forward hook never saw an input.
        """
        if self._native_kernel is not None and self._native_only_step():
            return
        with torch.no_grad():
            self._step()

    def _native_only_step(self) -> bool:
        """The common case of ``native=True``: every layer ran exactly one forward on the native
        route since the last step and its gradients qualify (see :meth:`_native_args`).  Then one
        kernel call does the whole step and this returns ``True``; otherwise nothing is changed and
        it returns ``False`` for the general route.  (No autograd mode switch: the kernel records
        nothing; one pass over the layers: at N = 16 on Table 1's network the Python around the
        kernel is still ~0.025 ms of ``step()``'s ~0.09 ms.)"""
        states = self._layer_list
        args = []
        for s in states:
            if s.native_x is None:
                return False
            a = self._native_args(s)
            if a is None or (args and a[0].dtype != args[0][0].dtype):
                return False  # not eligible, or a second dtype (the kernel takes one per call)
            args.append(a)
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return False
        self._dense_step(states, args)
        for s in states:
            s.native_x = None
            s.steps += 1
        self.steps += 1
        return True

    def _step(self) -> None:
        pending = [s for s in self._layers.values()
                   if s.s1 is not None or s.batch_mean is not None or s.fused_x is not None
                   or s.native_x is not None]
        if not pending:
            raise RuntimeError(
                "BNPreconditioner.step() was called before any forward pass recorded statistics: run the "
                "model forward in training mode with gradients enabled between steps"
            )
        for s in self._layers.values():
            if (s.s1 is None and s.batch_mean is None and s.fused_x is None and s.native_x is None
                    and self._has_grad(s.module)):
                raise RuntimeError(
                    f"BNP layer {_layer_label(s.name)} has a gradient but its forward hook recorded no input "
                    "since the last step (was it called through its forward()?); skip it with "
                    f"skip=[{s.name!r}]"
                )
        self._auto_fused = None
        lean, standard, native = [], [], []
        distributed = None
        for s in pending:
            if s.native_x is not None:
                if distributed is None:
                    dist = torch.distributed
                    distributed = dist.is_available() and dist.is_initialized()
                args = None if distributed else self._native_args(s)
                if args is not None:
                    native.append((s, args))
                    continue
                self._flush_native(s)  # the statistics are all-reduced, or the gradients do not qualify
            elif s.fused_x is not None:
                if s.fused_x._version != s.fused_version:
                    raise RuntimeError(
                        f"BNP layer {_layer_label(s.name)}: its input was modified in place after the forward "
                        "pass; with gradient='fused' BNP keeps the input to form the weight gradient in step() "
                        "(use gradient='transform', or avoid the in-place operation)"
                    )
                if self._is_lean(s):
                    lean.append(s)
                    continue
                self._pool_fused_moments(s)
            standard.append(s)
        if standard:
            self._all_reduce(standard)
            inverses = self._update_statistics(standard)
            for s, inv in zip(standard, inverses):
                if s.fused_x is not None:
                    self._fused_layer(s, inv)
                else:
                    self._precondition_layer(s, inv)
        if lean:
            self._lean_step(lean)
        if native:
            self._native_step(native)
        for s in pending:
            s.clear_pending()
            s.steps += 1
            if s.post_hook is not None:
                s.post_hook.remove()
                s.post_hook = None
        self.steps += 1

    @staticmethod
    def _native_args(s: _LayerState) -> tuple | None:
        """``(x, G_w, G_b, q²)`` of a layer whose hook kept its input, for the native ``dense_step``,
        or ``None`` if its gradients do not qualify: G_w (and G_b, if any) must be contiguous CPU
        tensors of the input's dtype (``G_b`` is an empty tensor for a layer without one)."""
        x = s.native_x
        # The parameters dict directly: nn.Module.__getattr__ costs ~0.4 µs a lookup, and this runs
        # for every layer at every step.
        params = s.module._parameters
        weight = params.get("weight")  # absent when parametrized (torch.nn.utils.parametrize)
        gw = weight.grad if weight is not None else None
        if gw is None or gw.dtype != x.dtype or not gw.is_cpu or not gw.is_contiguous():
            return None
        bias = params.get("bias")
        gb = bias.grad if bias is not None else None
        if gb is None:
            gb = _EMPTY
        elif gb.dtype != x.dtype or not gb.is_cpu or not gb.is_contiguous():
            return None
        n = x.shape[0]
        if s.native_q2[0] != n:
            s.native_q2 = (n, float(s.handler.q2(n)))
        return x, gw, gb, s.native_q2[1]

    def _native_step(self, pairs: list[tuple[_LayerState, tuple]]) -> None:
        """The general route's share for the dense layers that qualify: ``(state, _native_args)``
        pairs, one ``dense_step`` call per dtype."""
        by_dtype: dict[torch.dtype, list] = {}
        for pair in pairs:
            by_dtype.setdefault(pair[1][0].dtype, []).append(pair)
        for group in by_dtype.values():
            self._dense_step([p[0] for p in group], [p[1] for p in group])

    def _dense_step(self, states: list[_LayerState], args: list[tuple]) -> None:
        """Algorithm 2 steps 1-5 of ``states`` in one call of the compiled ``dense_step`` (see
        ``bnlab.optim._native``) given their :meth:`_native_args` (one dtype)."""
        for s, a in zip(states, args):
            if a[0]._version != s.native_version:
                self._check_native_version(s, a[0])  # raises
        xs, gws, gbs, q2s = (list(column) for column in zip(*args))
        bad = self._native_kernel.dense_step(xs, [s.mean for s in states], [s.var for s in states], gws, gbs,
                                             self.rho, self.eps1, self.eps2, q2s)
        if bad >= 0:
            raise RuntimeError(
                f"BNP layer {_layer_label(states[bad].name)}: an input feature has zero variance and eps1 = "
                "eps2 = 0, so σ̃² = 0 and Eq. 15 divides by zero; use eps1 > 0 or eps2 > 0"
            )
        for s, a in zip(states, args):
            s.samples = s.rows = a[0].shape[0]
            s.last_q2 = a[3]

    @staticmethod
    def _is_lean(s: _LayerState) -> bool:
        """A fused forward that :meth:`_lean_step` can finish: the only forward since the last step,
        reached by backward(), no weight gradient present, the bias gradient this forward's alone."""
        m = s.module
        gb = m.bias.grad
        return (s.s1 is None and s.batch_mean is None and s.fused_delta is not None and s.fused_clean
                and m.weight.grad is None and gb is not None and gb.dtype == s.mean.dtype)

    def _pool_fused_moments(self, s: _LayerState) -> None:
        """Add the moments of the fused forward's kept input to the layer's pending ones."""
        self._add_moments(s, s.fused_x, self._scratch(s, s.fused_x))

    def _lean_step(self, states: list[_LayerState]) -> None:
        """Algorithm 2 steps 1-5 for fused forwards with nothing else pending (the common case).

        Step 1 from the kept input H (mean μ_H and biased variance σ_H², Eq. 13; at N = 1 the
        variance about the running mean, (h - μ)², §3.3); step 2 as μ ← μ + (1-ρ)(μ_H - μ),
        σ² ← σ² + (1-ρ)(σ_H² - σ²) (``lerp``, batched over the layers with ``torch._foreach_*``);
        step 3 and the factor of steps 4-5, v = 1/(q²σ̃²); then, with Ĥ = (H - eμᵀ)·diag(v),

            G_w' = δᵀĤ                       (step 4: (δᵀH - G_b μᵀ)·diag(v) with G_b = δᵀe)
            G_b' = G_b/q² - δᵀ(Ĥμ)           (step 5: G_b/q² - G_w'μ)

        one N × n_in pass for Ĥ, the matrix product autograd skipped, and two matrix-vector
        products of N × n_in and n_out × N — no pass over the n_out × n_in gradient.
        """
        groups: dict[tuple, list[_LayerState]] = {}
        for s in states:
            groups.setdefault((s.mean.device, s.mean.dtype), []).append(s)
        for group in groups.values():
            for s in group:
                s.batch_mean, s.batch_var = _mean_var(s.fused_x)
                s.samples = s.rows = s.fused_x.shape[0]
            self._lerp_update(group)
            for s, v in zip(group, self._inverse_scales(group, [s.var for s in group])):
                x, delta = s.fused_x, s.fused_delta
                h_hat = torch.sub(x, s.mean, out=self._fused_buffer(s, x)).mul_(v)
                dt = delta.t()
                s.module.weight.grad = torch.mm(dt, h_hat)
                _bias_step_(s.module.bias.grad, dt, torch.mv(h_hat, s.mean), s.last_q2)

    @staticmethod
    def _fused_buffer(s: _LayerState, x: torch.Tensor) -> torch.Tensor:
        # Ĥ is written into a buffer kept by the layer (the size of its input, as autograd would
        # keep H itself) instead of a fresh N × n_in tensor per step, whose allocation can come with
        # page faults; the difference was within the noise of the benchmark at N = 16.
        buf = s.fused_buffer
        if buf is None or buf.shape != x.shape or buf.dtype != x.dtype or buf.device != x.device:
            buf = s.fused_buffer = torch.empty_like(x, memory_format=torch.contiguous_format)
        return buf

    def _lerp_update(self, states: list[_LayerState]) -> None:
        """Algorithm 2 step 2 from each layer's μ_H, σ_H² (same device and dtype): μ ← μ + (1-ρ)(μ_H - μ),
        σ² ← σ² + (1-ρ)(σ_H² - σ²), two batched ``lerp`` calls; at N = 1 σ_H² is the variance about
        the running mean before the update, (h - μ)² (§3.3)."""
        a = 1.0 - self.rho
        batch_vars = []
        for s in states:
            var_h = s.batch_var
            if s.rows == 1:
                var_h = s.batch_mean.sub(s.mean).square_()
            batch_vars.append(var_h)
        torch._foreach_lerp_([s.mean for s in states], [s.batch_mean for s in states], a)
        torch._foreach_lerp_([s.var for s in states], batch_vars, a)

    def _inverse_scales(self, states: list[_LayerState], variances: list[torch.Tensor]) -> list[torch.Tensor]:
        """Step 3 and the factor of steps 4-5: 1/(q² σ̃²) = 1/(q²·σ² + q²·(ε₁·max σ² + ε₂)) per layer
        (σ̃² as in :func:`regularized_variance`, 1/q² folded in: Errata), batched over ``states``."""
        q2s = []
        for s in states:
            s.last_q2 = s.handler.q2(s.samples)
            q2s.append(float(s.last_q2))
        if variances[0].device.type == "cpu":
            # On CPU the maxima are read back once (no device to wait for) and the shifts are
            # Python floats: the batched calls with lists of scalars convert every scalar to a
            # tensor (43 µs of the step's 93 µs here, measured right after backward()).
            maxes = torch.stack(torch._foreach_max(variances)).tolist()
            var_tilde = []
            for v, m, q in zip(variances, maxes, q2s):
                vt = torch.add(v, self.eps1 * m + self.eps2)
                var_tilde.append(vt.mul_(q) if q != 1.0 else vt)
        else:
            shifts = torch._foreach_mul(torch._foreach_max(variances), [self.eps1 * q for q in q2s])
            torch._foreach_add_(shifts, [self.eps2 * q for q in q2s])
            var_tilde = torch._foreach_mul(variances, q2s)  # q²·σ̃² once the shifts are added
            torch._foreach_add_(var_tilde, shifts)
        if self.eps1 == 0.0 and self.eps2 == 0.0:
            for s, vt in zip(states, var_tilde):
                if bool((vt <= 0).any()):
                    raise RuntimeError(
                        f"BNP layer {_layer_label(s.name)}: an input feature has zero variance and eps1 = "
                        "eps2 = 0, so σ̃² = 0 and Eq. 15 divides by zero; use eps1 > 0 or eps2 > 0"
                    )
        torch._foreach_reciprocal_(var_tilde)
        return var_tilde

    @staticmethod
    def _has_grad(module: nn.Module) -> bool:
        return any(p.grad is not None for p in (module.weight, getattr(module, "bias", None)) if p is not None)

    def _update_statistics(self, pending: list[_LayerState]) -> list[torch.Tensor]:
        """Algorithm 2 / 3 steps 1-3 for every pending layer; returns each layer's 1/(q² σ̃²).

        The per-layer vector operations are batched with ``torch._foreach_*`` (as ``torch.optim``
        does) over the layers that share device, dtype and row count, so a step costs a fixed
        number of operator calls per group instead of a dozen per layer.
        """
        rho, a = self.rho, 1.0 - self.rho
        groups: dict[tuple, list[int]] = {}
        direct: dict[tuple, list[int]] = {}
        for i, s in enumerate(pending):
            if s.batch_mean is not None:
                direct.setdefault((s.mean.device, s.mean.dtype), []).append(i)
            else:
                groups.setdefault((s.mean.device, s.mean.dtype, s.rows), []).append(i)
        inverses: list[Any] = [None] * len(pending)
        for index in direct.values():  # layers with μ_H, σ_H² of one forward (see _lerp_update)
            states = [pending[i] for i in index]
            self._lerp_update(states)
            for i, inv in zip(index, self._inverse_scales(states, [s.var for s in states])):
                inverses[i] = inv
        for (_, _, rows), index in groups.items():
            states = [pending[i] for i in index]
            means = [s.mean for s in states]
            variances = [s.var for s in states]
            s1s = [s.s1 for s in states]
            s2s = [s.s2 for s in states]
            # Steps 1-2 from the moments about c = μ_old (s1 = Σ(x - c), s2 = Σ(x - c)²):
            #   μ_H = c + s1/n,  σ_H² = s2/n - (s1/n)²  (biased, Eq. 13; at n = 1 just s2: the
            #   variance about the running mean, §3.3), then μ ← ρμ + (1-ρ)μ_H = μ + (1-ρ)s1/n and
            #   σ² ← ρσ² + (1-ρ)σ_H², each fused into in-place updates.
            torch._foreach_mul_(variances, rho)
            torch._foreach_add_(means + variances, s1s + s2s, alpha=a / rows)  # one call for both
            if rows > 1:
                torch._foreach_addcmul_(variances, s1s, s1s, value=-a / (rows * rows))
                if rho == 0.0:  # the mini-batch variance itself: no rounding below zero
                    torch._foreach_clamp_min_(variances, 0.0)
            # Step 3 and the factor of steps 4-5 (see _inverse_scales).
            for i, inv in zip(index, self._inverse_scales(states, variances)):
                inverses[i] = inv
        return inverses

    def _fused_layer(self, s: _LayerState, inv: torch.Tensor) -> None:
        """Algorithm 2 steps 4-5 for a forward taken on the fused route (``gradient="fused"``).

        Autograd left the weight gradient out; with G_w = δᵀH (Lange et al. Eq. 9: a_i = ŵᵀĥ per
        neuron, so ∂L/∂ŵ_i = Ĥᵀδ_i with Ĥ = [e, H]) and G_b the bias gradient autograd did form,
        Eq. 15 / step 4 is

            G_w' = (G_old + δᵀH - G_b μᵀ)·diag(v) = G_old·diag(v) + δᵀĤ - R (μ∘v)ᵀ,

        with v = 1/(q²σ̃²), Ĥ = (H - eμᵀ)·diag(v) and R = G_b - δᵀe (zero up to rounding unless
        the bias gradient holds more than this forward's, e.g. an accumulation), G_old the
        weight's ``.grad`` before the step (usually ``None``).  Appending the row -(μ∘v)ᵀ to Ĥ and
        R to δ makes δᵀĤ - R(μ∘v)ᵀ one matrix product Δᵀ Ĥ_ext; step 5 is
        G_b' = G_b/q² - G_w'μ, and G_w'μ = Δᵀ(Ĥ_ext μ) (+ G_old's part) needs no pass over G_w'.
        """
        x, delta = s.fused_x, s.fused_delta
        module = s.module
        weight, bias = module.weight, module.bias
        gb = bias.grad
        if delta is None or gb is None or gb.dtype != inv.dtype:
            # No backward pass reached this forward (no weight-gradient contribution), or the bias
            # gradient was dropped or changed dtype: fall back to the transform route.
            if delta is not None:
                raw = torch.mm(delta.t(), x)
                weight.grad = raw if weight.grad is None else weight.grad.add_(raw)
            self._precondition_layer(s, inv)
            return
        n, q2, mean = x.shape[0], s.last_q2, s.mean
        h_ext = torch.empty((n + 1, x.shape[1]), dtype=x.dtype, device=x.device)
        d_ext = torch.empty((n + 1, delta.shape[1]), dtype=x.dtype, device=x.device)
        neg_mv = h_ext[n]
        torch.mul(mean, inv, out=neg_mv).neg_()  # -(μ∘v)
        torch.addcmul(neg_mv, x, inv, out=h_ext[:n])  # Ĥ = H·diag(v) - e(μ∘v)ᵀ, one pass over H
        d_ext[:n].copy_(delta)
        torch.sub(gb, delta.sum(0), out=d_ext[n])  # R
        dt = d_ext.t()
        old = weight.grad
        if old is None:
            weight.grad = torch.mm(dt, h_ext)
            _bias_step_(gb, dt, torch.mv(h_ext, mean), q2)
        else:
            old.mul_(inv)
            old.addmm_(dt, h_ext)
            _bias_step_(gb, old, mean, q2)

    def _precondition_layer(self, s: _LayerState, inv: torch.Tensor) -> None:
        """Algorithm 2 / 3 steps 4-5 on the layer's ``.grad`` given ``inv`` = 1/(q² σ̃²)."""
        module = s.module
        gw = module.weight.grad
        bias = getattr(module, "bias", None)
        gb = bias.grad if bias is not None else None
        if gw is None and gb is None:
            return
        q2 = s.last_q2
        if gw is None:
            # A frozen weight: only the bias block of PPᵀ/q² applies (G_b/q², the w-part is zero).
            gb.div_(q2)
            return
        handler = s.handler
        gmat = handler.weight_matrix(gw)
        if (gmat.dtype == inv.dtype and (gb is None or gb.dtype == inv.dtype)
                and (gmat is gw or _is_view_of(gmat, gw))):
            # The common case (gradients in the statistics' dtype, G_w a view): in place, no copies.
            _precondition_with_inverse_(gmat, gb, handler.expand(s.mean), handler.expand(inv), q2)
            return
        compute = torch.float32 if gw.dtype in (torch.float16, torch.bfloat16) else gw.dtype
        copy_back_w = gmat.dtype != compute or not _is_view_of(gmat, gw)
        gmat_c = gmat.to(compute) if gmat.dtype != compute else gmat
        gb_c = None
        if gb is not None:
            gb_c = gb.to(compute) if gb.dtype != compute else gb
        mean = handler.expand(s.mean)
        inv = handler.expand(inv)
        if mean.dtype != compute:
            mean, inv = mean.to(compute), inv.to(compute)
        _precondition_with_inverse_(gmat_c, gb_c, mean, inv, q2)
        if copy_back_w:
            gw.copy_(gmat_c.reshape(gw.shape))
        if gb is not None and gb_c is not gb:
            gb.copy_(gb_c)

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
        Pending (not yet stepped) statistics are discarded.
        """
        if not isinstance(state_dict, Mapping) or not {"hyperparameters", "steps", "layers"} <= set(state_dict):
            raise ValueError(
                "state_dict is not allowed: expected the mapping returned by BNPreconditioner.state_dict() "
                "(keys 'hyperparameters', 'steps', 'layers')"
            )
        hyper = state_dict["hyperparameters"]
        rho, eps1, eps2 = self._check_hyper(hyper["rho"], hyper["eps1"], hyper["eps2"])
        conv = hyper.get("conv_statistics", "channel")
        if conv != self.conv_statistics:
            raise ValueError(
                f"state_dict has conv_statistics={conv!r} but this preconditioner uses {self.conv_statistics!r}"
            )
        layers = state_dict["layers"]
        missing = sorted(set(self._layers) - set(layers))
        unexpected = sorted(set(layers) - set(self._layers))
        if missing or unexpected:
            raise ValueError(
                f"state_dict layers do not match this preconditioner's: missing {missing}, unexpected {unexpected}"
            )
        new = {}
        for name, s in self._layers.items():
            entry = layers[name]
            mean, var = entry["mean"], entry["var"]
            cols = s.handler.num_columns()
            if tuple(mean.shape) != (cols,) or tuple(var.shape) != (cols,):
                raise ValueError(
                    f"state_dict layer {name!r} has statistics of shape {tuple(mean.shape)}, expected ({cols},)"
                )
            weight = s.module.weight
            dtype = _stats_dtype(weight.dtype)
            new[name] = (mean.to(device=weight.device, dtype=dtype).clone(),
                         var.to(device=weight.device, dtype=dtype).clone(), int(entry["steps"]))
        self.rho, self.eps1, self.eps2 = rho, eps1, eps2
        self.steps = int(state_dict["steps"])
        for name, (mean, var, steps) in new.items():
            s = self._layers[name]
            s.mean, s.var, s.steps = mean, var, steps
            s.clear_pending()

    def __repr__(self) -> str:
        return (
            f"BNPreconditioner(layers={len(self._layers)}, rho={self.rho}, eps1={self.eps1}, eps2={self.eps2}, "
            f"conv_statistics={self.conv_statistics!r}, gradient={self.gradient!r}, native={self.native}, "
            f"steps={self.steps})"
        )


def _mean_var(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Column mean and biased variance of a 2-D input (Lange et al. Eq. 13), in two passes.

    On CPU the batch-norm statistics kernel (no temporary; see ``_layers._moments_two_pass``),
    elsewhere ``torch.var_mean``.
    """
    if x.device.type == "cpu":
        return torch.batch_norm_update_stats(x, None, None, 0.0)
    var, mean = torch.var_mean(x, 0, correction=0)
    return mean, var


def _offsets(states: list[_LayerState]) -> list[tuple[int, int]]:
    out, offset = [], 0
    for s in states:
        out.append((offset, offset + 1))
        offset += 2 + 2 * s.s1.numel()
    return out


def _is_view_of(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.is_contiguous() and b.is_contiguous()
