"""The preconditioned layers of :class:`bnlab.optim.BNPreconditioner`: one object per layer, by kind.

kfac-pytorch keeps one layer object per registered module (``KFACBaseLayer``) beside a module
helper that knows the module type's shapes; here the helper is the :class:`~bnlab.optim.LayerHandler`
of ``_layers`` (statistics of the input, q², the weight-gradient view) and the layer object holds
what changes from step to step:

* :class:`BNPLayer` (every kind): the running mean and variance (Algorithm 2 step 2), the step
  count, the statistics of the forwards since the last step (μ_H, σ_H² of a single forward, or
  moments about the running mean pooled over several), and the transform of steps 4-5 on the
  layer's ``.grad`` (:meth:`BNPLayer.precondition`);
* :class:`DenseLayer` (``nn.Linear``): besides, the state of the two routes only a dense layer
  can take — the **fused** route (``gradient="fused"``: the forward's input and output gradient
  kept, G_w' = δᵀĤ formed in ``step()``) and the **kept-input** routes (``native=True`` on CPU,
  the compiled route on CUDA: the hook keeps the input and ``step()`` does steps 1-5 in one call);
* :class:`ConvLayer` (``nn.Conv1d``, ``nn.Conv2d``): the eager route only (Algorithm 3).

Which route a forward takes is decided in one place, ``BNPreconditioner``'s route chooser; the
layer objects carry the route's state out.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from bnlab.optim import _functional as F
from bnlab.optim._layers import LayerHandler, _layer_label, block_rows

__all__ = ["BNPLayer", "DenseLayer", "ConvLayer", "stats_dtype"]

#: The "no bias gradient" placeholder of the native dense_step's list of bias gradients.
_EMPTY = torch.empty(0)


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """The statistics' dtype for a layer of ``dtype``: float32 for half/bfloat16 layers (mixed
    precision), float64 kept for theory."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class BNPLayer:
    """One preconditioned module: running statistics, pending statistics, steps 4-5 on its ``.grad``."""

    # The routes only a dense layer takes (see DenseLayer): never pending here.
    kept_x: torch.Tensor | None = None
    kept_route: str | None = None
    fused: Any = None

    def __init__(self, name: str, module: nn.Module, handler: LayerHandler):
        self.name, self.module, self.handler = name, module, handler
        weight = module.weight
        cols = handler.num_columns()
        dtype = stats_dtype(weight.dtype)
        # Algorithm 2, "initialization": μ = 0, σ² = 1.
        self.mean = torch.zeros(cols, dtype=dtype, device=weight.device)
        self.var = torch.ones(cols, dtype=dtype, device=weight.device)
        self.steps = 0
        # Steps whose batch statistics had non-finite columns (kept back): counted on the host,
        # or, for routes that do not synchronize with the device, in a device tensor.
        self.nonfinite = 0
        self.nonfinite_device: torch.Tensor | None = None
        self.hook: Any = None
        self.scratch: Any = None
        self.last_q2: Any = None
        # The statistics of the forwards since the last step: μ_H and σ_H² of the only one where
        # the handler gives them directly, else moments (s1, s2) about the running mean, pooled.
        self.samples: Any = 0
        self.rows: Any = 0
        self.s1: torch.Tensor | None = None
        self.s2: torch.Tensor | None = None
        self.batch_mean: torch.Tensor | None = None
        self.batch_var: torch.Tensor | None = None
        # forwards recorded outside a backward pass since the last step that a checkpoint's recomputation
        # inside backward has not replayed yet (see BNPreconditioner's hook)
        self.unreplayed = 0

    # --- pending statistics -----------------------------------------------------------------
    @property
    def has_statistics(self) -> bool:
        return self.s1 is not None or self.batch_mean is not None

    @property
    def pending(self) -> bool:
        """Whether a forward recorded anything since the last step."""
        return self.has_statistics

    def clear_pending(self) -> None:
        self.samples = self.rows = 0
        self.s1 = self.s2 = self.batch_mean = self.batch_var = None
        self.unreplayed = 0

    def has_grad(self) -> bool:
        module = self.module
        return any(p.grad is not None for p in (module.weight, getattr(module, "bias", None)) if p is not None)

    def zero_grad_only(self) -> bool:
        """Whether every gradient this layer has is all zeros (zeroed, then not used by the step)."""
        module = self.module
        return all(not bool(p.grad.any()) for p in (module.weight, getattr(module, "bias", None))
                   if p is not None and p.grad is not None)

    def record(self, x: torch.Tensor, workspace: dict) -> None:
        """Algorithm 2 / 3 step 1 for one forward's input on the eager route (pooled with the
        forwards before it since the last step)."""
        # Detached operands record no autograd graph, so no no_grad() context is needed; autocast
        # leaves sub/sum/mul_ of float32 tensors alone.
        x = x.detach()
        mean = self.mean
        if x.dtype == mean.dtype and x.device == mean.device:
            # The common case, checked first to keep the per-call Python overhead small.
            out = self.scratch_for(x, workspace)
        else:
            dtype = stats_dtype(self.module.weight.dtype)
            if mean.device != x.device or mean.dtype != dtype:
                self.mean = self.mean.to(device=x.device, dtype=dtype)
                self.var = self.var.to(device=x.device, dtype=dtype)
            if x.dtype != dtype:
                x = x.to(dtype)  # a private copy (mixed precision): it can be its own scratch
                out = None
            else:
                out = self.scratch_for(x, workspace)
        if not self.has_statistics:
            stats = self.handler.batch_statistics_about(x, self.mean)
            if stats is not None:  # the first forward since the last step: μ_H and σ_H² directly
                self.batch_mean, self.batch_var = stats
                self.samples = self.rows = x.shape[0]
                return
        self.add_moments(x, out)

    def add_moments(self, x: torch.Tensor, scratch) -> None:
        """Pool the moments of input ``x`` (about the running mean) into the pending ones, after
        turning any pending μ_H, σ_H² into moments first."""
        self.batch_to_moments()
        samples, rows, s1, s2 = self.handler.moments(x, self.mean, scratch)
        if self.s1 is None:
            self.samples, self.rows, self.s1, self.s2 = samples, rows, s1, s2
        else:
            self.samples += samples
            self.rows += rows
            self.s1 = self.s1 + s1
            self.s2 = self.s2 + s2

    def batch_to_moments(self) -> None:
        """Turn pending μ_H, σ_H² into moments about c = μ (exact: with d = μ_H - c, s1 = N d,
        s2 = N (σ_H² + d²)), to pool them with other forwards or all-reduce them."""
        if self.batch_mean is None:
            return
        n = self.samples
        d = self.batch_mean.sub_(self.mean)
        self.s1, self.s2 = d * n, torch.addcmul(self.batch_var, d, d).mul_(n)
        self.batch_mean = self.batch_var = None

    def scratch_for(self, x: torch.Tensor, workspace: dict) -> torch.Tensor:
        # One buffer per (device, dtype) shared by the layers, grown to the largest block of layer
        # input the handlers use (``block_rows`` samples; hooks run one at a time); each layer
        # caches its view of it while the shape and the buffer stay the same.
        cached = self.scratch
        if (cached is not None and cached[2] == x.shape and cached[3] == (x.device, x.dtype)
                and cached[0] is workspace.get(cached[3])):
            return cached[1]
        key = (x.device, x.dtype)
        shape = (block_rows(x),) + tuple(x.shape[1:])
        numel = math.prod(shape)
        buf = workspace.get(key)
        if buf is None or buf.numel() < numel:
            buf = torch.empty(numel, dtype=x.dtype, device=x.device)
            workspace[key] = buf
        view = buf[:numel].view(shape)
        self.scratch = (buf, view, x.shape, key)
        return view

    # --- steps 4-5 ----------------------------------------------------------------------------
    def precondition(self, inv: torch.Tensor) -> None:
        """Algorithm 2 / 3 steps 4-5 on the layer's ``.grad`` given ``inv`` = 1/(q² σ̃²)."""
        module = self.module
        gw = module.weight.grad
        bias = getattr(module, "bias", None)
        gb = bias.grad if bias is not None else None
        if gw is None and gb is None:
            return
        q2 = self.last_q2
        if gw is None:
            # A frozen weight: only the bias block of PPᵀ/q² applies (G_b/q², the w-part is zero).
            gb.div_(q2)
            return
        handler = self.handler
        gmat = handler.weight_matrix(gw)
        if (gmat.dtype == inv.dtype and (gb is None or gb.dtype == inv.dtype)
                and (gmat is gw or _is_view_of(gmat, gw))):
            # The common case (gradients in the statistics' dtype, G_w a view): in place, no copies.
            F.precondition_(gmat, gb, handler.expand(self.mean), handler.expand(inv), q2)
            return
        compute = torch.float32 if gw.dtype in (torch.float16, torch.bfloat16) else gw.dtype
        copy_back_w = gmat.dtype != compute or not _is_view_of(gmat, gw)
        gmat_c = gmat.to(compute) if gmat.dtype != compute else gmat
        gb_c = None
        if gb is not None:
            gb_c = gb.to(compute) if gb.dtype != compute else gb
        mean = handler.expand(self.mean)
        inv = handler.expand(inv)
        if mean.dtype != compute:
            mean, inv = mean.to(compute), inv.to(compute)
        F.precondition_(gmat_c, gb_c, mean, inv, q2)
        if copy_back_w:
            gw.copy_(gmat_c.reshape(gw.shape))
        if gb is not None and gb_c is not gb:
            gb.copy_(gb_c)


class ConvLayer(BNPLayer):
    """``nn.Conv1d`` / ``nn.Conv2d`` (Algorithm 3): the eager route only."""


@dataclass
class FusedForward:
    """A forward taken on the fused route: its input H (with its version counter), the output
    gradient δ captured in backward (summed over backward passes), and whether the bias had no
    gradient and no gradient hooks at the forward (then G_b after backward() is δᵀe, this
    forward's, which the lean route relies on)."""

    x: torch.Tensor
    version: int
    clean: bool
    delta: torch.Tensor | None = None


class DenseLayer(BNPLayer):
    """``nn.Linear`` (Algorithm 2): the eager route, the fused route and the kept-input routes.

    ``fuse`` says whether the layer can take the fused route at all (a plain ``nn.Linear`` with a
    bias and ``gradient`` not ``"transform"``); ``kept_route`` is ``"native"``, ``"compiled"`` or
    ``None`` (which kept-input route the route chooser gave the layer's device).
    """

    def __init__(self, name, module, handler, *, fuse: bool = False, kept_route: str | None = None):
        super().__init__(name, module, handler)
        self.fuse = fuse
        self.kept_route = kept_route
        self.kept_device = module.weight.device  # the device kept_route was chosen for
        self.fused: FusedForward | None = None
        self.toggled = False  # the weight's requires_grad is switched off for the running forward
        self.post_hook: Any = None
        self.post_fn = self._make_post_hook() if fuse else None
        self.fused_buffer: torch.Tensor | None = None
        # A kept input (kept-input routes) with its version counter, and the (N, q²(N)) of the last
        # such step (q² is computed once per batch size).
        self.kept_x: torch.Tensor | None = None
        self.kept_version = 0
        self.kept_q2: tuple = (0, 1.0)

    @property
    def pending(self) -> bool:
        return self.has_statistics or self.fused is not None or self.kept_x is not None

    @property
    def idle(self) -> bool:
        """Nothing recorded since the last step (a forward may take the fused or a kept route)."""
        return self.s1 is None and self.batch_mean is None and self.fused is None and self.kept_x is None

    def clear_pending(self) -> None:
        super().clear_pending()
        self.fused = None
        self.kept_x = None
        if self.post_hook is not None:
            self.post_hook.remove()
            self.post_hook = None

    def record(self, x, workspace) -> None:
        if self.kept_x is not None:
            self.flush_kept(workspace)  # a second forward: pool the kept input's moments first
        super().record(x, workspace)

    # --- kept-input routes (native, compiled) ---------------------------------------------------
    def keep(self, x: torch.Tensor) -> None:
        """Keep the input of this forward; ``step()`` takes its statistics (one call for the step)."""
        x = x.detach()
        self.kept_x = x
        self.kept_version = x._version

    def check_kept_version(self, x: torch.Tensor) -> None:
        if x._version != self.kept_version:
            raise RuntimeError(
                f"BNP layer {_layer_label(self.name)}: its input was modified in place after the forward pass; "
                f"with the {self.kept_route} route BNP keeps the input to take its statistics in step() (use "
                "native=False / compiled=False, or avoid the in-place operation)"
            )

    def flush_kept(self, workspace: dict) -> None:
        """Turn the kept input into pending moments (the layer then takes the eager route this step)."""
        x = self.kept_x
        self.kept_x = None
        self.check_kept_version(x)
        if x.dtype != self.mean.dtype:
            x = x.to(self.mean.dtype)
            self.add_moments(x, None)
        else:
            self.add_moments(x, self.scratch_for(x, workspace))

    def kept_q2_for(self, n: int) -> float:
        if self.kept_q2[0] != n:
            self.kept_q2 = (n, float(self.handler.q2(n)))
        return self.kept_q2[1]

    def native_args(self) -> tuple | None:
        """``(x, G_w, G_b, q²)`` for the native ``dense_step``, or ``None`` if the gradients do not
        qualify: G_w (and G_b, if any) contiguous CPU tensors of the input's dtype (``G_b`` an empty
        tensor for a layer without one)."""
        x = self.kept_x
        # The parameters dict directly: nn.Module.__getattr__ costs ~0.4 µs a lookup, and this runs
        # for every layer at every step.
        params = self.module._parameters
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
        return x, gw, gb, self.kept_q2_for(x.shape[0])

    def compiled_args(self) -> tuple | None:
        """``(x, G_w, G_b or None, q²)`` for the compiled dense step, or ``None`` if the gradients do
        not qualify (a missing or parametrized weight gradient, or gradients on another device)."""
        x = self.kept_x
        params = self.module._parameters
        weight = params.get("weight")
        gw = weight.grad if weight is not None else None
        device = self.mean.device
        if gw is None or gw.device != device or gw.layout != torch.strided:
            return None
        bias = params.get("bias")
        gb = bias.grad if bias is not None else None
        if gb is not None and (gb.device != device or gb.layout != torch.strided):
            return None
        return x, gw, gb, self.kept_q2_for(x.shape[0])

    # --- fused route ------------------------------------------------------------------------------
    def start_fused(self, x: torch.Tensor) -> None:
        """Take this forward on the fused route: autograd skips the weight gradient, a pre-hook on
        the output's grad_fn keeps δ (see :meth:`_make_post_hook`)."""
        module = self.module
        if self.post_hook is None:
            # Registered while a fused forward is pending (removed by step()), so layers that do
            # not fuse pay nothing; always_call restores requires_grad even if the forward raises.
            self.post_hook = module.register_forward_hook(self.post_fn, always_call=True)
        bias = module.bias
        module.weight.requires_grad_(False)
        self.toggled = True
        x = x.detach()
        self.fused = FusedForward(x, x._version, bias.grad is None and not bias._backward_hooks
                                  and not getattr(bias, "_post_accumulate_grad_hooks", None))

    def _make_post_hook(self):
        def capture(grad_outputs):
            # δ = ∂L/∂(output) of this forward (G_w = δᵀH, Lange et al. Eq. 9); summed over repeated
            # backward passes through the same graph, as autograd sums gradients.
            delta = grad_outputs[0]
            fused = self.fused
            if delta is not None and fused is not None:
                fused.delta = delta if fused.delta is None else fused.delta + delta

        def post_hook(module, args, output):
            if not self.toggled:
                return None
            self.toggled = False
            module.weight.requires_grad_(True)
            grad_fn = getattr(output, "grad_fn", None)
            if grad_fn is None:  # the forward raised, or its output is not differentiable
                self.fused = None
            else:
                grad_fn.register_prehook(capture)
            return None

        return post_hook

    def check_fused_version(self) -> None:
        if self.fused.x._version != self.fused.version:
            raise RuntimeError(
                f"BNP layer {_layer_label(self.name)}: its input was modified in place after the forward "
                "pass; with gradient='fused' BNP keeps the input to form the weight gradient in step() "
                "(use gradient='transform', or avoid the in-place operation)"
            )

    def is_lean(self) -> bool:
        """A fused forward that the lean route can finish: the only forward since the last step,
        reached by backward(), no weight gradient present, the bias gradient this forward's alone."""
        m, f = self.module, self.fused
        gb = m.bias.grad
        return (self.s1 is None and self.batch_mean is None and f.delta is not None and f.clean
                and m.weight.grad is None and gb is not None and gb.dtype == self.mean.dtype)

    def pool_fused_moments(self, workspace: dict) -> None:
        """Add the moments of the fused forward's kept input to the pending ones."""
        x = self.fused.x
        self.add_moments(x, self.scratch_for(x, workspace))

    def lean_statistics(self) -> None:
        """Step 1 of a lean fused forward: μ_H, σ_H² of the kept input (Eq. 13)."""
        x = self.fused.x
        self.batch_mean, self.batch_var = F.batch_mean_var(x)
        self.samples = self.rows = x.shape[0]

    def lean_transform(self, inv: torch.Tensor) -> None:
        """Steps 4-5 of a lean fused forward given v = 1/(q²σ̃²): with Ĥ = (H - eμᵀ)·diag(v),

            G_w' = δᵀĤ                       (step 4: (δᵀH - G_b μᵀ)·diag(v) with G_b = δᵀe)
            G_b' = G_b/q² - δᵀ(Ĥμ)           (step 5: G_b/q² - G_w'μ)

        one N × n_in pass for Ĥ, the matrix product autograd skipped, and two matrix-vector
        products of N × n_in and n_out × N — no pass over the n_out × n_in gradient.
        """
        x, delta = self.fused.x, self.fused.delta
        h_hat = torch.sub(x, self.mean, out=self._fused_buffer(x)).mul_(inv)
        dt = delta.t()
        self.module.weight.grad = torch.mm(dt, h_hat)
        F.bias_step_(self.module.bias.grad, dt, torch.mv(h_hat, self.mean), self.last_q2)

    def _fused_buffer(self, x: torch.Tensor) -> torch.Tensor:
        # Ĥ is written into a buffer kept by the layer (the size of its input, as autograd would
        # keep H itself) instead of a fresh N × n_in tensor per step, whose allocation can come with
        # page faults; the difference was within the noise of the benchmark at N = 16.
        buf = self.fused_buffer
        if buf is None or buf.shape != x.shape or buf.dtype != x.dtype or buf.device != x.device:
            buf = self.fused_buffer = torch.empty_like(x, memory_format=torch.contiguous_format)
        return buf

    def fused_transform(self, inv: torch.Tensor) -> None:
        """Algorithm 2 steps 4-5 for a forward taken on the fused route, off its lean path.

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
        x, delta = self.fused.x, self.fused.delta
        module = self.module
        weight, bias = module.weight, module.bias
        gb = bias.grad
        if delta is None or gb is None or gb.dtype != inv.dtype:
            # No backward pass reached this forward (no weight-gradient contribution), or the bias
            # gradient was dropped or changed dtype: fall back to the transform route.
            if delta is not None:
                raw = torch.mm(delta.t(), x)
                weight.grad = raw if weight.grad is None else weight.grad.add_(raw)
            self.precondition(inv)
            return
        n, q2, mean = x.shape[0], self.last_q2, self.mean
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
            F.bias_step_(gb, dt, torch.mv(h_ext, mean), q2)
        else:
            old.mul_(inv)
            old.addmm_(dt, h_ext)
            F.bias_step_(gb, old, mean, q2)


def _is_view_of(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.is_contiguous() and b.is_contiguous()
