"""Matrix-free curvature spectra of a real ``nn.Module`` on a fixed batch: Fisher, GGN, Hessian, empirical Fisher.

What is measured (B = batch size, f = the module's output on the batch, ℓ_b the per-sample loss,
L = (1/B) Σ_b ℓ_b; J = ∂f/∂θ of the whole batch output):

* ``"fisher"``: I = (1/B) Jᵀ J, the Fisher information of Eq. 10 of the Fisher paper (Gaussian
  conditional model, i.e. the GGN of ½‖f − y‖²); needs no targets.
* ``"ggn"``: (1/B) Jᵀ H_ℓ J with H_ℓ the per-sample Hessian of the loss in the outputs (identity for
  ``loss="mse"`` = ½‖f − y‖², softmax Hessian diag(p) − ppᵀ for ``"cross_entropy"``, where it is the
  exact Fisher of the categorical model).
* ``"hessian"``: ∇²_θ L.
* ``"empirical_fisher"``: (1/B) Σ_b g_b g_bᵀ, g_b = ∇_θ ℓ_b (through the whole batch in BN train mode).

BatchNorm: ``bn_mode="train"`` uses the statistics of the batch itself (the samples are coupled as in
a training step; J is the Jacobian of the coupled batch output), ``"eval"`` the running statistics.
bnlab's own batch-statistics layers (the BN-MLP of Yang et al., BN without mean, ghost BN, Batch
Renorm) run in train mode too, each product on fresh copies of their running statistics (they cannot drop
them as ``nn.BatchNorm`` can).  Every other module is put in eval mode (dropout off), so the measured
function is deterministic.
The measurement runs on a deep copy of the module: the caller's parameters, buffers (running
statistics, ``num_batches_tracked``) and train/eval flags are never changed; in the copy, BN
layers in train mode stop tracking running statistics, which also avoids torch.func's in-place
error on BN buffers (functorch issue #986; ANCHORS.md).

Products: forward mode (``torch.func.jvp``) for J v and reverse mode (``torch.func.vjp``, the
pullback built once per operator and reused) for Jᵀ u; Hessian-vector products by reverse-over-reverse
through a gradient graph built once and retained (one backward pass per product).
Eigenvalues: by default Lanczos in torch (for k = 1 without eigenvectors the three-term recurrence
with its two vectors in the products' dtype; otherwise a float64 basis with full
reorthogonalization; the tridiagonal matrix always float64) stopped at the
first step where every requested Ritz pair has residual ‖C y − θ y‖ ≤ tol·λmax — the a-posteriori
bound that places an eigenvalue of C within tol·λmax of each reported value (and, for the top one,
typically within (tol·λmax)²/gap) — plus the products' own rounding (float32 models: ≈1e-6
relative; use ``dtype=torch.float64`` for ≲1e-12). ``method="arpack"`` uses ARPACK
(``scipy.sparse.linalg.eigsh`` on a ``LinearOperator``, ``which="LA"``, same tolerance meaning),
which always spends at least ncv = max(2k + 1, 20) products per restart. Very small operators
(fewer than max(2k + 1, 16) parameters) are assembled densely and solved with eigh.

Why not curvlinops: it provides the same products (also via torch.func) and eigsh, but (ANCHORS.md)
its determinism check fails for BN in train mode with shuffled data and it updates the running
statistics as a side effect; the products needed here are a few lines of torch.func, so bnlab owns
them and the benchmark compares against curvlinops when it is installed.
"""
from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Mapping

import numpy as np

from bnlab._validation import DEFAULT_MAX_MEMORY_BYTES, check_choice, check_int, check_memory, check_real, check_seed

__all__ = ["CURVATURES", "BN_MODES", "LOSSES", "SpectrumResult", "curvature_operator", "curvature_spectrum",
           "CurvatureOverflowError", "LanczosNotConvergedError"]

CURVATURES = ("fisher", "ggn", "hessian", "empirical_fisher")
BN_MODES = ("train", "eval")
LOSSES = ("mse", "cross_entropy")
STOPS = ("residual", "change", "gap", "maxiter")
STARTS = ("random", "gradient")
# weight of the seeded random direction added to the normalized gradient start (see _start_vector)
_GRADIENT_START_NOISE = 0.3


class CurvatureOverflowError(ValueError):
    """The measurement overflows its dtype: a curvature product, a BN batch variance or the model's output on
    the batch is not finite.  A ``ValueError`` (the inputs or parameters are too large for the dtype); measuring
    in float64 (``dtype=torch.float64``) may succeed where float32 does not."""


class LanczosNotConvergedError(RuntimeError):
    """Lanczos did not reach ``tol`` within its products (``maxiter``, else min(P, 300)): a tol below what the
    dtype's rounding lets the residual reach, or a spectrum whose top is not separated."""


@dataclass(frozen=True)
class SpectrumResult:
    """Top eigenvalues (descending) of a curvature matrix, with how they were obtained.

    ``blocks`` maps a block name (a module's qualified name) to that diagonal block's top
    eigenvalues when per-layer blocks were requested. ``ritz_history`` (Lanczos only): the largest
    Ritz value after each product, for convergence studies.
    """

    curvature: str
    bn_mode: str
    loss: str
    eigenvalues: tuple
    num_params: int
    batch_size: int
    matvecs: int
    tol: float
    method: str
    dtype: str
    seconds: float
    blocks: dict = field(default_factory=dict)
    eigenvectors: Any = field(default=None, repr=False, compare=False)
    ritz_history: tuple = field(default=(), repr=False, compare=False)

    @property
    def lambda_max(self) -> float:
        return float(self.eigenvalues[0])

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("eigenvectors")
        d.pop("ritz_history")
        d["eigenvalues"] = [float(x) for x in self.eigenvalues]
        d["lambda_max"] = self.lambda_max
        d["blocks"] = {k: [float(x) for x in v] for k, v in self.blocks.items()}
        return d


def _torch():
    import torch

    return torch


def _is_batchnorm(module) -> bool:
    torch = _torch()
    return isinstance(module, torch.nn.modules.batchnorm._BatchNorm)


def _is_batch_statistics_module(module) -> bool:
    """bnlab's own layers that normalize with batch statistics in train mode: the BN-MLP of Yang et al.
    (its BN is inside the module) and the batch-statistics layers of :mod:`bnlab.nets.norms` (BN without
    mean, ghost BN, Batch Renorm).  Unlike ``nn.BatchNorm`` they cannot drop their running statistics,
    so their buffers are passed to each functional call as fresh copies (see ``forward`` below)."""
    from bnlab.nets import (BNMLP, BatchNormNoMean1d, BatchNormNoMean2d, BatchRenorm1d, BatchRenorm2d,
                            GhostBatchNorm1d, GhostBatchNorm2d)

    return isinstance(module, (BNMLP, BatchNormNoMean1d, BatchNormNoMean2d, GhostBatchNorm1d, GhostBatchNorm2d,
                               BatchRenorm1d, BatchRenorm2d))


def _check_model_and_inputs(model, inputs, bn_mode) -> int:
    """The module (trainable, finite) and the batch (finite, B >= 1; B >= 2 for BN in train mode); returns B."""
    torch = _torch()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model={type(model).__name__} is not allowed: expected a torch.nn.Module")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"model={type(model).__name__} is not allowed: it has no parameters that require grad"
        )
    if not isinstance(inputs, torch.Tensor) or inputs.ndim < 1 or inputs.shape[0] < 1:
        raise ValueError("inputs is not allowed: expected a tensor with a leading batch dimension >= 1")
    if inputs.is_floating_point() and not bool(torch.isfinite(inputs).all()):
        raise ValueError("inputs is not allowed: it contains NaN or infinite entries")
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(
                f"model is not allowed: its parameter or buffer {name!r} contains NaN or infinite entries"
            )
    has_bn = any(_is_batchnorm(m) or _is_batch_statistics_module(m) for m in model.modules())
    batch = int(inputs.shape[0])
    if has_bn and bn_mode == "train" and batch < 2:
        raise ValueError(
            f"bn_mode='train' with a batch of {batch} is not allowed: BatchNorm's batch variance is "
            "undefined for one sample; use a batch of >= 2 or bn_mode='eval'"
        )
    return batch


def _functional_copy(model, dtype, bn_mode):
    """A deep copy in ``dtype`` in eval mode, its BN layers in train mode for ``bn_mode="train"``.

    Returns the copy and the running-statistics buffers of bnlab's batch-statistics layers (by
    qualified name) that each functional call must receive as fresh copies.
    """
    work = copy.deepcopy(model).to(dtype=dtype)
    work.eval()
    stat_buffers = {}
    if bn_mode == "train":
        for m in work.modules():
            if _is_batchnorm(m):
                m.train()
                # batch statistics only, no running-statistics update in the copy
                m.track_running_stats = False
                m.running_mean = None
                m.running_var = None
                m.num_batches_tracked = None
        # bnlab's batch-statistics layers update their running statistics in place in train mode, which
        # torch.func refuses for a captured tensor; each call gets fresh copies of those buffers, made inside
        # the transformed function (the copy's own buffers are never changed, and every call sees the same)
        for prefix, m in work.named_modules():
            if _is_batch_statistics_module(m):
                m.train()
                for n, b in m.named_buffers(prefix=prefix):
                    stat_buffers[n] = b
    return work, stat_buffers


class _CurvatureOperator:
    """The products v ↦ C v of one curvature matrix C on a fixed batch (torch tensors in, out).

    The shared setup of every curvature: validation, the functional copy of the module with its BN
    layers in the requested mode, the flat <-> dict parameter maps and the target checks. One subclass
    per curvature (as curvlinops has one ``LinearOperator`` per curvature) keeps the forward pass it
    needs (:meth:`_linearize`), the quantities it precomputes (:meth:`_prepare`) and its product
    (:meth:`_product`, checked finite by :meth:`matvec`); :func:`_operator_class` picks it once from the
    ``curvature`` and ``loss`` names.
    """

    curvature: str = ""
    # the Fisher of Eq. 10 and the MSE GGN do not depend on the targets (ignored if given)
    needs_targets: bool = True

    def __init__(self, model, inputs, targets, loss, bn_mode, dtype):
        torch = _torch()
        from torch.func import functional_call

        self.loss = check_choice("loss", loss, LOSSES)
        self.bn_mode = check_choice("bn_mode", bn_mode, BN_MODES)
        batch = _check_model_and_inputs(model, inputs, self.bn_mode)
        if self.needs_targets and targets is None:
            raise ValueError(f"curvature={self.curvature!r} with loss={self.loss!r} needs targets; got None")

        ref = next(model.parameters())
        self.dtype = dtype if dtype is not None else ref.dtype
        work, stat_buffers = _functional_copy(model, self.dtype, self.bn_mode)
        self.module = work
        self.names = [n for n, p in work.named_parameters() if p.requires_grad]
        # the copy's own parameters, detached: ``work`` is private to this operator, so no second copy
        # (a clone of every parameter was ≈ 15 % of the Hessian setup for a 1e6-parameter MLP)
        self.primals = {n: p.detach() for n, p in work.named_parameters() if p.requires_grad}
        self.frozen = {n: p.detach() for n, p in work.named_parameters() if not p.requires_grad}
        self.shapes = [self.primals[n].shape for n in self.names]
        self.sizes = [int(self.primals[n].numel()) for n in self.names]
        self.num_params = int(sum(self.sizes))
        self.device = ref.device
        x = inputs.detach().to(device=self.device)
        if torch.is_floating_point(x):
            x = x.to(self.dtype)
        self.inputs = x
        self.batch_size = batch
        self.matvecs = 0

        def forward(params):
            fresh = {n: b.clone() for n, b in stat_buffers.items()}
            out = functional_call(work, {**params, **self.frozen, **fresh}, (x,))
            return out.reshape(batch, -1)

        self._forward = forward
        self._check_forward(work, x, batch)
        # one forward pass, kept: the pullback (Fisher/GGN/EF) or the gradient graph (Hessian) reuse it
        out = self._linearize()
        self.num_outputs = int(out.shape[1])
        self.targets = self._check_targets(targets, out) if targets is not None and self.needs_targets else None
        self._prepare(out)

    # -- per-curvature hooks -------------------------------------------------------
    def _linearize(self):
        """The batch output (B, outputs) of the one forward pass the products reuse."""
        raise NotImplementedError

    def _prepare(self, out) -> None:
        """What the products precompute from that output (after the targets are checked)."""
        raise NotImplementedError

    def matvec(self, flat):
        """C v for a flat torch vector v (length num_params); ValueError where it is not finite."""
        self.matvecs += 1
        out = self._product(flat)
        # An overflow inside the product (inputs or weights too large for the dtype: float32 inputs of
        # 1e30 square to inf) would reach Lanczos/ARPACK as NaN, and LAPACK's "Eigenvalues did not converge"
        # would be all the caller saw.  One reduction per product, beside a forward and a backward pass.
        if not bool(_torch().isfinite(out).all()):
            raise CurvatureOverflowError(
                f"the {self.curvature} matrix-vector product is not finite in {self.dtype}: it overflows (inputs, "
                "targets or parameters too large for this dtype); rescale the inputs, or measure in float64 "
                "(curvature_spectrum's dtype=torch.float64, or a float64 model)")
        return out

    def _product(self, flat):
        """C v, the curvature's own product."""
        raise NotImplementedError

    # -- validation ------------------------------------------------------------------
    def _check_targets(self, targets, out):
        """The targets as float (B, outputs) for MSE or as B class indices for cross-entropy."""
        torch = _torch()
        batch = self.batch_size
        t = targets.detach().to(self.device)
        if self.loss == "mse":
            t = t.to(self.dtype).reshape(batch, -1)
            if t.shape != out.shape:
                raise ValueError(f"targets shape {tuple(targets.shape)} does not match outputs {tuple(out.shape)}")
            if not bool(torch.isfinite(t).all()):
                raise ValueError("targets are not allowed: they contain NaN or infinite entries")
            return t
        t = t.reshape(-1)
        if t.is_floating_point() and not bool((torch.isfinite(t) & (t == t.round())).all()):
            # .long() would truncate 2.55 to class 2 silently
            raise ValueError("targets are not allowed: class indices must be integers (got fractional "
                             "or non-finite floats)")
        t = t.long()
        if t.shape[0] != batch or int(t.min()) < 0 or int(t.max()) >= self.num_outputs:
            raise ValueError(
                f"targets are not allowed: expected {batch} class indices in [0, {self.num_outputs})"
            )
        return t

    def _check_forward(self, work, x, batch) -> None:
        """One plain forward pass: the output is a finite (B, ...) tensor and no BN variance overflows.

        A tuple, dict or scalar output would fail deep inside torch.func; an overflowing BN variance
        (σ_w² = 1e308) gives finite but meaningless outputs (every unit 0) and a λmax of nonsense.
        """
        torch = _torch()
        problems: list[str] = []

        def check_bn(module, args):
            (z,) = args[:1]
            dims = [d for d in range(z.ndim) if d != 1]
            if not bool(torch.isfinite(z.var(dim=dims, unbiased=False)).all()):
                problems.append(module._bnlab_name)

        handles = []
        for name, m in work.named_modules():
            if _is_batchnorm(m) and m.training:
                m._bnlab_name = name
                handles.append(m.register_forward_pre_hook(check_bn))
        try:
            with torch.no_grad():
                out = work(x)
        finally:
            for h in handles:
                h.remove()
        if problems:
            raise CurvatureOverflowError(
                f"the batch variance of BatchNorm layer(s) {', '.join(map(repr, problems))} overflows {self.dtype} "
                "on these inputs (the pre-activations are too large: reduce sigma_w2 or the inputs' scale, or use "
                "dtype=torch.float64)"
            )
        if not isinstance(out, torch.Tensor):
            raise ValueError(
                f"model is not allowed: its output is a {type(out).__name__}; expected one tensor of shape "
                "(batch, outputs...)"
            )
        if out.ndim < 1 or out.shape[0] != batch:
            raise ValueError(
                f"model is not allowed: its output has shape {tuple(out.shape)}; expected a leading batch "
                f"dimension of {batch}"
            )
        if not out.is_floating_point():
            raise ValueError(f"model is not allowed: its output has dtype {out.dtype}; expected a floating tensor")
        if not bool(torch.isfinite(out).all()):
            raise CurvatureOverflowError(
                "model is not allowed: its output on these inputs is not finite (an overflow: reduce the inputs' "
                "or the weights' scale, or use dtype=torch.float64)"
            )

    # -- loss pieces ---------------------------------------------------------
    def _loss_value(self, out):
        torch = _torch()
        if self.loss == "mse":
            return 0.5 * ((out - self.targets) ** 2).sum() / self.batch_size
        return torch.nn.functional.cross_entropy(out, self.targets, reduction="mean")

    def _loss_output_grad(self, out):
        """∂ℓ_b/∂f_b per sample (not divided by B)."""
        torch = _torch()
        if self.loss == "mse":
            return out - self.targets
        p = torch.softmax(out, dim=1)
        return p - torch.nn.functional.one_hot(self.targets, self.num_outputs).to(out.dtype)

    # -- flat <-> dict -------------------------------------------------------
    def unflatten(self, flat):
        chunks = flat.split(self.sizes)
        return {n: c.reshape(s) for n, c, s in zip(self.names, chunks, self.shapes)}

    def flatten(self, tree):
        torch = _torch()
        return torch.cat([tree[n].reshape(-1) for n in self.names])

    def param_blocks(self, blocks) -> dict[str, np.ndarray]:
        """Flat index arrays per block: ``"module"`` groups parameters by their owning module."""
        offsets = np.concatenate([[0], np.cumsum(self.sizes)])
        index = {n: np.arange(offsets[i], offsets[i + 1]) for i, n in enumerate(self.names)}
        if blocks == "module":
            groups: dict[str, list[str]] = {}
            for n in self.names:
                groups.setdefault(n.rsplit(".", 1)[0] if "." in n else "", []).append(n)
        elif isinstance(blocks, Mapping):
            groups = {}
            for key, names in blocks.items():
                unknown = [n for n in names if n not in index]
                if unknown:
                    raise ValueError(f"blocks[{key!r}] names unknown parameters {unknown}; known: {self.names}")
                groups[str(key)] = list(names)
        else:
            raise ValueError(
                f"blocks={blocks!r} is not allowed: expected None, 'module' or a dict name -> [param names]"
            )
        return {k: np.concatenate([index[n] for n in v]) for k, v in groups.items()}


class _JacobianCurvature(_CurvatureOperator):
    """C = (1/B) Jᵀ M J: J v by forward mode, M applied per sample in output space, Jᵀ u by the pullback."""

    def _linearize(self):
        out, self._pullback = _torch().func.vjp(self._forward, self.primals)
        return out

    def _prepare(self, out) -> None:
        pass

    def _output_product(self, jv):
        """M (J v), (B, outputs) -> (B, outputs)."""
        raise NotImplementedError

    def _product(self, flat):
        torch = _torch()
        tangent = self.unflatten(flat.to(device=self.device, dtype=self.dtype))
        _, jv = torch.func.jvp(self._forward, (self.primals,), (tangent,))
        (g,) = self._pullback(self._output_product(jv))
        return self.flatten(g) / self.batch_size


class _FisherOperator(_JacobianCurvature):
    """The Fisher I = (1/B) Jᵀ J of Eq. 10 of the Fisher paper (Gaussian conditional model): M = I."""

    curvature = "fisher"
    needs_targets = False

    def _output_product(self, jv):
        return jv


class _MSEGGNOperator(_JacobianCurvature):
    """The GGN of ℓ = ½‖f − y‖²: H_ℓ = I, so the same matrix as the Fisher of Eq. 10."""

    curvature = "ggn"
    needs_targets = False

    def _output_product(self, jv):
        return jv


class _CrossEntropyGGNOperator(_JacobianCurvature):
    """The GGN of softmax cross-entropy: M = diag(p) − ppᵀ per sample (the categorical model's Fisher)."""

    curvature = "ggn"

    def _prepare(self, out) -> None:
        self._probs = _torch().softmax(out.detach(), dim=1)

    def _output_product(self, jv):
        p = self._probs
        return p * jv - p * (p * jv).sum(dim=1, keepdim=True)


class _EmpiricalFisherOperator(_JacobianCurvature):
    """(1/B) Σ_b g_b g_bᵀ = (1/B) Jᵀ (c_b ∇_f ℓ_b), c_b = ⟨∇_f ℓ_b, (J v)_b⟩ (g_b through the coupled batch)."""

    curvature = "empirical_fisher"

    def _prepare(self, out) -> None:
        self._dloss = self._loss_output_grad(out.detach())

    def _output_product(self, jv):
        c = (self._dloss * jv).sum(dim=1, keepdim=True)
        return c * self._dloss


class _HessianOperator(_CurvatureOperator):
    """∇²_θ L by reverse-over-reverse through a gradient graph built once and retained."""

    curvature = "hessian"

    def _linearize(self):
        torch = _torch()
        leaves = {n: p.detach().requires_grad_(True) for n, p in self.primals.items()}
        self._leaves = [leaves[n] for n in self.names]
        with torch.enable_grad():
            return self._forward(leaves)

    def _prepare(self, out) -> None:
        # each Hessian-vector product is then one backward pass through this graph (no new forward pass)
        torch = _torch()
        with torch.enable_grad():
            loss = self._loss_value(out)
            self._grads = torch.autograd.grad(loss, self._leaves, create_graph=True)

    def _product(self, flat):
        torch = _torch()
        tangent = self.unflatten(flat.to(device=self.device, dtype=self.dtype))
        hv = torch.autograd.grad(
            self._grads, self._leaves, grad_outputs=[tangent[n] for n in self.names], retain_graph=True
        )
        return torch.cat([h.reshape(-1) for h in hv])


# the one route from the names to the operator: (curvature, loss) -> class
_OPERATOR_CLASSES = {
    ("fisher", "mse"): _FisherOperator,
    ("fisher", "cross_entropy"): _FisherOperator,
    ("ggn", "mse"): _MSEGGNOperator,
    ("ggn", "cross_entropy"): _CrossEntropyGGNOperator,
    ("hessian", "mse"): _HessianOperator,
    ("hessian", "cross_entropy"): _HessianOperator,
    ("empirical_fisher", "mse"): _EmpiricalFisherOperator,
    ("empirical_fisher", "cross_entropy"): _EmpiricalFisherOperator,
}


def _operator_class(curvature, loss):
    """The :class:`_CurvatureOperator` subclass for ``curvature`` and ``loss`` (``ValueError`` for others)."""
    curvature = check_choice("curvature", curvature, CURVATURES)
    loss = check_choice("loss", loss, LOSSES)
    return _OPERATOR_CLASSES[(curvature, loss)]


def _make_curvature_operator(model, inputs, targets, curvature, loss, bn_mode, dtype):
    return _operator_class(curvature, loss)(model, inputs, targets, loss, bn_mode, dtype)


def _check_spectrum_memory(model, dtype, k, maxiter, method, want_vectors, max_memory_bytes) -> None:
    """The deep copy plus the Krylov vectors, from the parameter count, against ``max_memory_bytes``."""
    torch = _torch()
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model={type(model).__name__} is not allowed: expected a torch.nn.Module")
    tensors = list(model.parameters()) + list(model.buffers())
    n_all = sum(t.numel() for t in tensors)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    ref = tensors[0] if tensors else torch.empty(())
    itemsize = torch.empty((), dtype=dtype if dtype is not None else ref.dtype).element_size()
    if method == "arpack" or (method == "auto" and k > 1):
        basis = max(2 * k + 1, 20) * 8  # ARPACK's ncv float64 vectors
    elif k == 1 and not want_vectors:
        basis = 0  # the three-term recurrence: counted with the working vectors below
    else:
        basis = min(n, maxiter or 300) * 8  # full reorthogonalization keeps every float64 Lanczos vector
    # copy of every tensor + ~6 working vectors (recurrence, tangent, product, gradient) + the basis
    need = n_all * itemsize + n * (6 * itemsize + basis)
    check_memory(f"curvature_spectrum of a model with {n:.3g} parameters", need, max_memory_bytes,
                 hint="measure a smaller model or diagonal blocks, or raise the bound")


def curvature_operator(
    model,
    inputs,
    targets=None,
    *,
    curvature: str = "fisher",
    loss: str = "mse",
    bn_mode: str = "train",
    dtype=None,
):
    """A ``scipy.sparse.linalg.LinearOperator`` (float64 NumPy products) for the chosen curvature.

    The module is deep-copied first (see the module docstring); ``op.torch_matvec`` is the
    underlying torch product and ``op.curvature_info`` the :class:`_CurvatureOperator`.
    """
    from scipy.sparse.linalg import LinearOperator

    torch = _torch()
    core = _make_curvature_operator(model, inputs, targets, curvature, loss, bn_mode, dtype)

    def mv(v):
        t = torch.as_tensor(np.asarray(v, dtype=np.float64).reshape(-1))
        return core.matvec(t).detach().to("cpu", torch.float64).numpy()

    op = LinearOperator((core.num_params, core.num_params), matvec=mv, rmatvec=mv, dtype=np.float64)
    op.curvature_info = core
    op.torch_matvec = core.matvec
    return op


def _lanczos(matvec, n, *, k, tol, seed, want_vectors, max_steps, device, stop="residual", vec_dtype=None,
             start=None):
    """Top-k eigenpairs of a symmetric operator by Lanczos with full reorthogonalization (float64 torch).

    Stops after the first step at which each of the top-k Ritz pairs (θ_i, y_i) has residual
    ‖A y_i − θ_i y_i‖ = β_j |s_{j,i}| ≤ tol·|θ_1| (the standard a-posteriori bound: an eigenvalue of A
    lies within that distance of θ_i), or when the Krylov space becomes invariant, or after
    ``max_steps`` products (``converged`` False). Stores one n-vector per step (none for k = 1
    without eigenvectors). ``stop="change"`` instead stops when the top-k Ritz values changed by less
    than tol relative since the previous step (the rule power-iteration tools use; no error bound);
    ``stop="gap"`` when the estimated error min(r, r²/δ) ≤ tol·|θ_1| (δ: distance to the nearest other
    Ritz value); ``stop="maxiter"`` runs exactly ``max_steps`` steps (convergence studies, benchmarks).
    ``start``: an n-vector to start from (normalized here) instead of the seeded Gaussian one.
    """
    torch = _torch()
    # k = 1 without eigenvectors: the plain three-term recurrence (no stored basis). Loss of
    # orthogonality (Paige) only creates spurious copies of already converged Ritz values, so the
    # largest Ritz value and its residual bound stay valid; otherwise full reorthogonalization.
    full = k > 1 or want_vectors
    # The three-term recurrence keeps its two vectors in the products' dtype (``vec_dtype``, e.g.
    # float32) with float64 inner products and a float64 tridiagonal matrix: the vectors' rounding is
    # then that of the products themselves, and no per-step float64 <-> float32 copies of P-vectors
    # are made (measured ≈ 25 % of a step's time for a 1e6-parameter MLP on CPU). The stored basis of
    # full reorthogonalization stays float64 (its orthogonality is what it is for).
    vdt = torch.float64 if (full or vec_dtype is None) else vec_dtype
    q = _lanczos_start(n, seed, start, vdt, device)
    basis = _KrylovBasis(n, max_steps, device) if full else None
    rule = _RitzStoppingRule(stop, k, tol)
    alphas, betas = [], []
    converged = False
    theta = s_vecs = None
    steps = 0
    q_prev = None
    history = []  # the largest Ritz value after each product
    for j in range(max_steps):
        if full:
            basis.append(q)
        steps = j + 1
        w = matvec(q).to(vdt)
        alpha = _dot(q, w)
        alphas.append(alpha)
        if full:
            w, beta = basis.orthogonalize(w)
        else:
            w, beta = _three_term_residual(w, q, alpha, q_prev, betas)
        T = np.diag(alphas) + np.diag(betas, 1) + np.diag(betas, -1)
        theta, s_vecs = np.linalg.eigh(T)
        top = np.argsort(theta)[::-1][: min(k, j + 1)]
        history.append(float(theta[top[0]]))
        scale = max(abs(theta[top[0]]), np.finfo(np.float64).tiny)
        done = rule.done(j, theta, s_vecs, beta, top, scale)
        if j + 1 >= k and done:
            converged = True
            break
        if beta <= 1e-13 * scale:  # invariant subspace: the Ritz values are exact eigenvalues
            if j + 1 >= k or not full or j + 1 >= n:
                converged = j + 1 >= k
                break
            # fewer than k of them (C of rank < k, or C = 0): go on from a seeded Gaussian vector orthogonal
            # to the basis, coupled to it by β = 0, so T is block diagonal and the found values stay exact
            w, beta = basis.orthogonalize(_lanczos_start(n, seed + j + 1, None, torch.float64, device))
            betas.append(0.0)
            q_prev, q = None, w.div_(beta)
            continue
        betas.append(beta)
        q_prev, q = q, w.div_(beta)
    if stop == "maxiter":
        converged = steps >= k
    top = np.argsort(theta)[::-1][:k]
    vecs = basis.ritz_vectors(steps, s_vecs[:, top]) if want_vectors else None
    return theta[top], vecs, converged, history


# inner products by BLAS dot (blocked accumulation: ≈1e-7 relative in float32 for P ≈ 1e6,
# measured, below the products' own rounding); the norm as sqrt(dot) because torch's float32
# vector_norm was measured 60× less accurate (8e-6) at that size
def _dot(a, b) -> float:
    return float(_torch().dot(a, b))


def _norm(a) -> float:
    return float(_torch().dot(a, a)) ** 0.5


def _lanczos_start(n, seed, start, dtype, device):
    """Lanczos' unit start vector: ``start`` normalized, or a Gaussian drawn from a generator seeded ``seed``."""
    torch = _torch()
    gen = torch.Generator().manual_seed(seed)
    if start is None:
        q = torch.randn(n, generator=gen, dtype=dtype).to(device)
    else:
        q = start.detach().to(device=device, dtype=dtype).clone()
    q /= float(torch.dot(q, q)) ** 0.5
    return q


def _three_term_residual(w, q, alpha, q_prev, betas):
    """w − α q − β_{j−1} q_{j−1} in place (the plain Lanczos recurrence) and its norm β_j."""
    w.add_(q, alpha=-alpha)
    if q_prev is not None:
        w.add_(q_prev, alpha=-betas[-1])
    return w, _norm(w)


class _KrylovBasis:
    """Lanczos vectors q_0..q_j, one float64 row each, grown by doubling up to ``max_steps`` rows."""

    def __init__(self, n, max_steps, device):
        torch = _torch()
        self.n, self.max_steps, self.device = n, max_steps, device
        self.capacity = min(max_steps, 16)
        self.rows = torch.empty((self.capacity, n), dtype=torch.float64, device=device)  # one vector per row
        self.size = 0

    def append(self, q) -> None:
        torch = _torch()
        j = self.size
        if j == self.capacity:
            self.capacity = min(self.max_steps, 2 * self.capacity)
            grown = torch.empty((self.capacity, self.n), dtype=torch.float64, device=self.device)
            grown[:j] = self.rows[:j]
            self.rows = grown
        self.rows[j] = q
        self.size = j + 1

    def orthogonalize(self, w):
        """w minus its projection on the basis (classical Gram–Schmidt, repeated once after strong
        cancellation: Kahan–Parlett "twice is enough") and its norm β_j."""
        torch = _torch()
        basis = self.rows[: self.size]
        before = float(torch.linalg.norm(w))
        w = torch.addmv(w, basis.T, basis @ w, alpha=-1.0)
        beta = float(torch.linalg.norm(w))
        if beta < 0.7 * before:
            w = torch.addmv(w, basis.T, basis @ w, alpha=-1.0)
            beta = float(torch.linalg.norm(w))
        return w, beta

    def ritz_vectors(self, steps, coefficients):
        """The Ritz vectors Q s_i of the first ``steps`` basis vectors (an n × k NumPy array)."""
        torch = _torch()
        Q = self.rows[:steps].T
        return (Q @ torch.as_tensor(coefficients, dtype=torch.float64, device=Q.device)).cpu().numpy()


class _RitzStoppingRule:
    """Lanczos' stopping rules (``stop`` of :func:`curvature_spectrum`) on the top-k Ritz pairs of a step."""

    def __init__(self, stop, k, tol):
        self.stop, self.k, self.tol = stop, k, tol
        self.prev_top = None  # the "change" rule's top-k Ritz values of the previous step

    def done(self, j, theta, s_vecs, beta, top, scale) -> bool:
        resid = np.abs(beta * s_vecs[-1, top])
        if self.stop == "residual":
            return np.all(resid <= self.tol * scale)
        if self.stop == "gap":
            # Kato–Temple-type estimate: a Ritz value with residual r is within r²/δ of an eigenvalue,
            # δ its distance to the rest of the spectrum, estimated by the distance to the other Ritz
            # values (an estimate, not a bound: a Ritz value may not yet resolve an eigenvalue between)
            if j == 0:
                return False
            gaps = np.array([np.min(np.abs(np.delete(theta, i) - theta[i])) for i in top])
            est = np.minimum(resid, resid**2 / np.maximum(gaps, np.finfo(np.float64).tiny))
            return np.all(est <= self.tol * scale)
        if self.stop == "maxiter":
            return False
        current = theta[top]
        prev, self.prev_top = self.prev_top, current
        return prev is not None and len(prev) == len(current) and np.all(np.abs(current - prev) <= self.tol * scale)


def _start_vector(core, seed):
    """Gradient start for the Hessian: ∇L/‖∇L‖ + 0.3·r/‖r‖, r a seeded Gaussian (see ``start``).

    Falls back to r alone when the gradient vanishes or is not finite.
    """
    torch = _torch()
    gen = torch.Generator().manual_seed(seed)
    r = torch.randn(core.num_params, generator=gen, dtype=core.dtype).to(core.device)
    r /= float(torch.dot(r, r)) ** 0.5
    g = torch.cat([t.detach().reshape(-1) for t in core._grads])
    gnorm = float(torch.dot(g, g)) ** 0.5
    if not np.isfinite(gnorm) or gnorm == 0.0:
        return r
    return g / gnorm + _GRADIENT_START_NOISE * r


def _top_eigenvalues(
    op, n, k, *, tol, seed, want_vectors, maxiter, method="arpack", torch_matvec=None, device=None, stop="residual",
    vec_dtype=None, start=None,
):
    """The top-k eigenvalues (and eigenvectors) of ``op`` (n × n) and Lanczos' Ritz history (empty otherwise):
    dense for small n, else ``method`` ("lanczos" on ``torch_matvec``, or ARPACK on ``op``)."""
    from scipy.sparse.linalg import eigsh

    if n < max(2 * k + 1, 16):
        return _dense_top_eigenpairs(op, n, k, want_vectors)
    if method == "lanczos":
        vals, vecs, converged, history = _lanczos(
            torch_matvec, n, k=k, tol=tol, seed=seed, want_vectors=want_vectors, max_steps=maxiter or min(n, 300),
            device=device, stop=stop, vec_dtype=vec_dtype, start=start,
        )
        if not converged:
            raise LanczosNotConvergedError(
                f"Lanczos did not reach tol={tol:g} in {maxiter or min(n, 300)} products; raise maxiter or tol, "
                "or use method='arpack'"
            )
        return vals, vecs, history
    from scipy.sparse.linalg import ArpackError

    v0 = np.random.default_rng(seed).standard_normal(n) if start is None else start.detach().cpu().double().numpy()
    try:
        out = eigsh(op, k=k, which="LA", tol=tol, v0=v0, maxiter=maxiter, return_eigenvectors=want_vectors)
    except ArpackError as exc:
        # ARPACK stops with "starting vector is zero" (info -9) when C v0 = 0: for the seeded Gaussian v0
        # that means C = 0 (a cross-entropy GGN whose softmax is saturated to exactly one-hot, say), whose
        # top eigenvalues are 0 — Lanczos, dense and eigh say so; ARPACK cannot
        if "error -9:" not in str(exc) or np.any(op.matvec(v0)):
            raise
        vecs = np.linalg.qr(np.random.default_rng(seed).standard_normal((n, k)))[0] if want_vectors else None
        return np.zeros(k), vecs, ()
    if want_vectors:
        w, v = out
        order = np.argsort(w)[::-1]
        return w[order], v[:, order], ()
    return np.sort(out)[::-1], None, ()


def _dense_top_eigenpairs(op, n, k, want_vectors):
    """The top k of a small operator from its dense matrix (n products; symmetrized against rounding)."""
    dense = np.column_stack([op.matvec(e) for e in np.eye(n)])
    dense = 0.5 * (dense + dense.T)
    w, v = np.linalg.eigh(dense)
    order = np.argsort(w)[::-1][:k]
    return w[order], (v[:, order] if want_vectors else None), ()


def _block_eigenvalues(op, core, blocks, *, k, tol, seed, maxiter, method, stop) -> dict[str, tuple]:
    """The top-k eigenvalues of each diagonal block of the curvature (``blocks`` of :func:`curvature_spectrum`):
    the block's products are the full products of vectors zero outside it, restricted to it."""
    from scipy.sparse.linalg import LinearOperator

    torch = _torch()
    n = core.num_params
    block_eigs: dict[str, tuple] = {}
    for name, idx in core.param_blocks(blocks).items():
        nb = len(idx)

        def mv(v, idx=idx):
            full = np.zeros(n)
            full[idx] = np.asarray(v, dtype=np.float64).reshape(-1)
            return op.matvec(full)[idx]

        bop = LinearOperator((nb, nb), matvec=mv, rmatvec=mv, dtype=np.float64)
        idx_t = torch.as_tensor(idx, device=core.device)

        def tmv(v, idx_t=idx_t):
            full = torch.zeros(n, dtype=torch.float64, device=core.device)
            full[idx_t] = v
            return core.matvec(full).detach().to(torch.float64)[idx_t]

        kb = min(k, nb - 1) if nb > 1 else 1
        bmethod = method if kb == 1 or method == "arpack" else "arpack"
        if nb == 1:
            bw = np.array([float(mv(np.ones(1))[0])])
        else:
            bw, _, _ = _top_eigenvalues(bop, nb, kb, tol=tol, seed=seed, want_vectors=False, maxiter=maxiter,
                                        method=bmethod, torch_matvec=tmv, device=core.device, stop=stop)
        block_eigs[name] = tuple(float(x) for x in bw)
    return block_eigs


def curvature_spectrum(
    model,
    inputs,
    targets=None,
    *,
    curvature: str = "fisher",
    loss: str = "mse",
    bn_mode: str = "train",
    k: int = 1,
    tol: float = 1e-6,
    dtype=None,
    blocks=None,
    return_eigenvectors: bool = False,
    seed: int = 0,
    maxiter: int | None = None,
    method: str = "auto",
    stop: str = "residual",
    start: str = "random",
    max_memory_bytes: int = DEFAULT_MAX_MEMORY_BYTES,
) -> SpectrumResult:
    """Top-``k`` eigenvalues of the Fisher (Eq. 10 of the Fisher paper), GGN, Hessian or empirical Fisher.

    Parameters
    ----------
    model : nn.Module (never modified; a deep copy is measured)
    inputs : tensor (B, ...) — the fixed batch; targets : class indices or float tensor (B, outputs)
    curvature : {"fisher", "ggn", "hessian", "empirical_fisher"}
    loss : {"mse", "cross_entropy"} (ℓ = ½‖f − y‖² or softmax cross-entropy; batch mean)
    bn_mode : {"train", "eval"} — BN with the batch's own statistics or with the running statistics
    k : number of top eigenvalues; tol : ARPACK relative residual tolerance (module docstring)
    dtype : e.g. ``torch.float64`` for double-precision products (default: the model's dtype)
    blocks : None, ``"module"`` (each module's parameters) or {name: [parameter names]} — adds the
        top-k eigenvalues of each diagonal block
    seed : seeds Lanczos' start vector (results are deterministic)
    method : {"auto", "lanczos", "arpack"}
        ``"auto"`` (default): ``"lanczos"`` for k = 1, ``"arpack"`` for k > 1 (single-vector Lanczos
        without restarts cannot resolve a repeated eigenvalue's multiplicity). ``"lanczos"``: Lanczos
        in torch (full reorthogonalization unless k = 1 without eigenvectors), stopped at the first
        step where the top-k residuals are ≤ tol·λmax (fewest products; one stored vector per step,
        at most ``maxiter`` = min(P, 300) steps); ``"arpack"``: ``scipy.sparse.linalg.eigsh`` on the
        LinearOperator (implicitly restarted; ``maxiter`` = ARPACK restarts), for many eigenvalues.
    stop : {"residual", "change"}
        Lanczos only. ``"residual"`` (default): the a-posteriori residual bound ≤ tol·λmax (an error
        guarantee). ``"change"``: the top-k Ritz values changed by < tol relative in one step — the
        stopping rule of PyHessian-style power iteration, without a guarantee. ``"gap"``: the
        estimated eigenvalue error min(r, r²/δ) ≤ tol·λmax, r the residual and δ the distance of the
        Ritz value to the nearest other one (Kato–Temple: λ − θ ≤ r²/δ with δ the true gap; the Ritz
        distance estimates δ, so this is an estimate, cheaper than the residual rule by a few products
        when the top eigenvalue is separated). ``"maxiter"``: exactly ``maxiter`` products, no test
        (convergence studies and benchmarks; Lanczos only).
    start : {"random", "gradient"}
        The start vector. ``"random"`` (default): a seeded Gaussian. ``"gradient"`` (Hessian only):
        the loss gradient ∇L/‖∇L‖ plus 0.3 × a seeded unit Gaussian — the gradient lies mostly in the
        top Hessian eigenspace (Gur-Ari, Roberts & Dyer 2018, "Gradient descent happens in a tiny
        subspace") and is already computed for the products (free); the random part keeps every
        eigendirection in the Krylov space (a pure gradient start fails where ∇L = 0) and keeps
        ``seed`` meaningful. Measured (benchmarks/bench_fisher.py, top eigenvalue to 1e-3): 5 products
        instead of 6–10 at initialization (FC and conv), 6 instead of 7 on the trained conv net, but
        14 instead of 9–11 on the trained FC net (its gradient lies along slowly converging
        directions) — not a reliable gain, so not the default. Only the start differs; the stopping
        rules and their error bound are unchanged.
    max_memory_bytes : int
        Bound on the memory of the measurement's own copies (the module's deep copy and the Lanczos or
        ARPACK vectors, estimated from the parameter count before anything is copied; default 1 GiB).
        The activations of the forward pass are the caller's batch and are not counted.

    Non-finite parameters, buffers, inputs or targets, an output that is not one finite tensor with a
    leading batch dimension, and a BN batch variance that overflows the dtype are ``ValueError``.
    """
    k = check_int("k", k, minimum=1)
    tol = check_real("tol", tol, minimum=0.0, maximum=0.5)  # a relative error; ≥ 1 stops at once (wrong λmax)
    seed = check_seed("seed", seed)
    method = check_choice("method", method, ("auto", "lanczos", "arpack"))
    stop = check_choice("stop", stop, STOPS)
    start = check_choice("start", start, STARTS)
    if start == "gradient" and curvature != "hessian":
        raise ValueError(
            f"start='gradient' is not allowed with curvature={curvature!r}: the gradient start is for "
            "curvature='hessian'; use start='random'"
        )
    if method == "auto":
        method = "lanczos" if k == 1 else "arpack"
    if maxiter is not None:
        maxiter = check_int("maxiter", maxiter, minimum=1)
    if stop == "maxiter" and (maxiter is None or method == "arpack"):
        raise ValueError(
            f"stop='maxiter' is not allowed with maxiter={maxiter!r}, method={method!r}: it needs an integer "
            "maxiter and Lanczos (method='auto' with k = 1, or 'lanczos')"
        )
    _check_spectrum_memory(model, dtype, k, maxiter, method, return_eigenvectors, max_memory_bytes)
    t0 = time.perf_counter()
    op = curvature_operator(model, inputs, targets, curvature=curvature, loss=loss, bn_mode=bn_mode, dtype=dtype)
    core = op.curvature_info
    n = core.num_params
    if k >= n:
        raise ValueError(f"k={k} is not allowed: expected k < number of parameters ({n})")
    def torch_mv(v):
        return core.matvec(v).detach()

    use_gradient = start == "gradient"
    w, vecs, history = _top_eigenvalues(
        op, n, k, tol=tol, seed=seed, want_vectors=return_eigenvectors, maxiter=maxiter, method=method,
        torch_matvec=torch_mv, device=core.device, stop=stop, vec_dtype=core.dtype,
        start=_start_vector(core, seed) if use_gradient else None,
    )
    block_eigs = {} if blocks is None else _block_eigenvalues(
        op, core, blocks, k=k, tol=tol, seed=seed, maxiter=maxiter, method=method, stop=stop
    )
    return SpectrumResult(
        curvature=core.curvature,
        bn_mode=core.bn_mode,
        loss=core.loss,
        eigenvalues=tuple(float(x) for x in w),
        num_params=n,
        batch_size=core.batch_size,
        matvecs=core.matvecs,
        tol=tol,
        method=method,
        dtype=str(core.dtype).replace("torch.", ""),
        seconds=time.perf_counter() - t0,
        blocks=block_eigs,
        eigenvectors=vecs,
        ritz_history=tuple(history),
    )
