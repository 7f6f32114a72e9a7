"""A compiled CPU kernel for the batch normalization (with its frozen affine map and ReLU) of the BN-MLP
ensemble's eager float32 step.

:func:`bnlab.nets.train_ensemble` trains a stack of BN-MLPs (Yang et al. 2019, Eq. 7) layer by layer;
at the small scale's B = 8 and width 128 a layer's BN is ~8 000 numbers, and its cost is per-operator
overhead, not arithmetic.  The eager route (:class:`bnlab.nets.ensemble._BatchNormEager`) runs about
twelve ATen operators forward (the float32 mean, the float64 two-pass variance, ``rsqrt``, the
normalization) and six backward, then the frozen γ·x̂ + β and φ and their backward nodes; this kernel
does each direction in one call over the whole stack, ``φ(γ·x̂ + β)`` included when φ is ReLU (another φ
runs after it, as an ATen operator).
``python benchmarks/bench_ensemble.py --bn-ab`` times the step both ways (docs/nets.md has a run's numbers).

**The same floats forward.** Each column's mean is the float32 sum of its ``b`` entries in sample
order times the float32 1/b (as ATen's CPU mean of the contiguous (k, groups, b, width) stack over
dim 2 accumulates it); the variance is the float64 two-pass formula (mean, then the mean of squared
deviations) rounded once to float32, exactly :func:`bnlab.nets.ensemble._two_pass_variance`; then
``r = 1/sqrt(var + ε)`` and ``x̂ = (h − mean)·r`` in float32, then ``γ·x̂ + β`` (one product, one sum) and
``max(·, 0)`` with NaN passed through (as ``torch.relu``).  The build disables floating-point
contraction (``-ffp-contract=off``), so no step is fused into an FMA that ATen's would not be.  The
backward masks the incoming gradient where ``y ≤ 0`` (ReLU, as ATen's ``threshold_backward``), scales it by
γ, then takes the closed form of :class:`~bnlab.nets.ensemble._BatchNormEager`,
``r·((g − mean(g)) − x̂·mean(g·x̂))``, with the float32 means accumulated in sample order: equal to the
eager one up to float32 rounding of the reductions (≤ b·2⁻²⁴ relative to Σ|g|, Σ|g·x̂|;
``tests/nets/test_native_bn.py`` bounds it).

**Built on first use** with the C compiler (``$CC``, else ``cc``; plain C, no PyTorch headers: ~1 s)
with ``-O3 -march=native`` and loaded with :mod:`ctypes`, through :mod:`bnlab._kernel_cache`: only from
a folder of this user's that nobody else can write, checked against the SHA-256 manifest written when
it was built, under a build lock whose stale copies are removed.  The library's name carries a hash of
the source and of the CPU's model and flags.  Without a compiler (or with a folder that cannot be
trusted and no private one) :func:`kernel` returns ``None`` with one warning, and the eager route runs.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import warnings

import torch

from bnlab import _kernel_cache

__all__ = ["kernel", "can_use", "batch_norm_stack", "ACTIVATIONS", "SERIAL_MAX_ELEMENTS"]

#: Stacks up to this many entries use the kernel at any thread count: ATen's elementwise and reduction
#: kernels split work in grains of 32 768 entries, so below that the eager route is single-threaded
#: too.  Larger stacks use it only when torch runs one thread (the kernel is serial).
SERIAL_MAX_ELEMENTS = 32_768

#: How long to wait for another process building the same kernel (a build takes ~1 s).
BUILD_WAIT_S = 60.0

_WHAT = "the native BN-stack kernel"

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

/* h, xhat, y: (k, groups, b, w) float32 contiguous; eps, gamma, beta: (k,) (gamma, beta NULL: no affine);
   act 0: identity, 1: ReLU (NaN passes, as torch.relu); mean, var, r: (k, groups, 1, w).
   xhat = (h - mean) r;  y = act(gamma xhat + beta) (y may be xhat when there is neither).
   Returns 0, or -1 if the scratch could not be allocated. */
int bn_stack_forward(const float* h, const float* eps, const float* gamma, const float* beta, int act,
                     float* xhat, float* y, float* mean, float* var, float* r,
                     int64_t k, int64_t groups, int64_t b, int64_t w) {
  double* md = (double*)malloc(sizeof(double) * (size_t)(2 * w));
  if (!md) return -1;
  double* acc = md + w;
  const float inv_b = 1.0f / (float)b;
  for (int64_t i = 0; i < k; ++i) {
    const float e = eps[i];
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t block = i * groups + g;
      const float* x = h + block * b * w;
      float* o = xhat + block * b * w;
      float* m = mean + block * w;
      float* v = var + block * w;
      float* rr = r + block * w;
      for (int64_t j = 0; j < w; ++j) { m[j] = 0.0f; md[j] = 0.0; acc[j] = 0.0; }
      for (int64_t s = 0; s < b; ++s) {
        const float* row = x + s * w;
        for (int64_t j = 0; j < w; ++j) { m[j] += row[j]; md[j] += (double)row[j]; }
      }
      for (int64_t j = 0; j < w; ++j) { m[j] = m[j] * inv_b; md[j] = md[j] / (double)b; }
      for (int64_t s = 0; s < b; ++s) {
        const float* row = x + s * w;
        for (int64_t j = 0; j < w; ++j) { const double d = (double)row[j] - md[j]; acc[j] += d * d; }
      }
      for (int64_t j = 0; j < w; ++j) {
        v[j] = (float)(acc[j] / (double)b);
        rr[j] = 1.0f / sqrtf(v[j] + e);
      }
      for (int64_t s = 0; s < b; ++s) {
        const float* row = x + s * w;
        float* orow = o + s * w;
        for (int64_t j = 0; j < w; ++j) orow[j] = (row[j] - m[j]) * rr[j];
      }
      if (gamma || act) {
        const float ga = gamma ? gamma[i] : 1.0f, be = gamma ? beta[i] : 0.0f;
        float* yb = y + block * b * w;
        for (int64_t t = 0; t < b * w; ++t) {
          float z = gamma ? ga * o[t] + be : o[t];
          yb[t] = (act == 1 && z < 0.0f) ? 0.0f : z;
        }
      }
    }
  }
  free(md);
  return 0;
}

/* grad, xhat, y, gin: (k, groups, b, w) float32 contiguous; r: (k, groups, 1, w); gamma (k,) or NULL; act as
   above (y: the forward's output, read for ReLU's mask only).
   gz = grad masked by ReLU (y <= 0: 0, as torch's threshold_backward); gx = gamma gz;
   gin = r ((gx - mean gx) - xhat mean(gx xhat)). */
int bn_stack_backward(const float* grad, const float* xhat, const float* y, const float* r, const float* gamma,
                      int act, float* gin, int64_t k, int64_t groups, int64_t b, int64_t w) {
  float* gm = (float*)malloc(sizeof(float) * (size_t)(2 * w + b * w));
  if (!gm) return -1;
  float* pm = gm + w;
  float* gx = pm + w;
  const float inv_b = 1.0f / (float)b;
  for (int64_t i = 0; i < k; ++i) {
    const float ga = gamma ? gamma[i] : 1.0f;
    for (int64_t grp = 0; grp < groups; ++grp) {
      const int64_t blk = i * groups + grp;
      const float* g = grad + blk * b * w;
      const float* o = xhat + blk * b * w;
      const float* yb = y + blk * b * w;
      const float* rr = r + blk * w;
      float* gi = gin + blk * b * w;
      for (int64_t t = 0; t < b * w; ++t) {
        const float gz = (act == 1 && yb[t] <= 0.0f) ? 0.0f : g[t];
        gx[t] = gamma ? gz * ga : gz;
      }
      for (int64_t j = 0; j < w; ++j) { gm[j] = 0.0f; pm[j] = 0.0f; }
      for (int64_t s = 0; s < b; ++s)
        for (int64_t j = 0; j < w; ++j) { gm[j] += gx[s * w + j]; pm[j] += gx[s * w + j] * o[s * w + j]; }
      for (int64_t j = 0; j < w; ++j) { gm[j] *= inv_b; pm[j] *= inv_b; }
      for (int64_t s = 0; s < b; ++s)
        for (int64_t j = 0; j < w; ++j)
          gi[s * w + j] = ((gx[s * w + j] - gm[j]) - o[s * w + j] * pm[j]) * rr[j];
    }
  }
  free(gm);
  return 0;
}
"""

_STATE: dict[str, object] = {}


def kernel():
    """The loaded library (:class:`ctypes.CDLL`), or ``None`` where it cannot be built (built or
    loaded once per process, on the first call; see the module docstring)."""
    if "kernel" not in _STATE:
        _STATE["kernel"] = _load()
    return _STATE["kernel"]


def _compiler() -> str | None:
    cc = os.environ.get("CC")
    return shutil.which(cc) if cc else (shutil.which("cc") or shutil.which("gcc"))


def _load():
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:8]
    name = f"bnlab_bn_stack_{digest}_{_kernel_cache.cpu_tag()}"
    try:
        folder = _kernel_cache.build_directory(name, what=_WHAT)
        library = folder / f"{name}.so"
        with _kernel_cache.build_lock(folder, wait_s=BUILD_WAIT_S, what=_WHAT, quiet_s=10.0):
            problem = _kernel_cache.check_manifest(folder, name)
            if problem is None and not library.is_file():
                problem = f"no {library.name}"
            if problem is not None:
                if problem != "empty":
                    warnings.warn(f"bnlab: the build folder {folder} of {_WHAT} is not as it was built ({problem}); "
                                  "rebuilding it from the source", RuntimeWarning, stacklevel=4)
                _kernel_cache.clear_directory(folder)
                cc = _compiler()
                if cc is None:
                    raise RuntimeError("no C compiler (set CC, or install cc)")
                source = folder / "bn_stack.c"
                source.write_text(_SOURCE, encoding="utf-8")
                done = subprocess.run([cc, "-O3", "-march=native", "-ffp-contract=off", "-fPIC", "-shared",
                                       "-o", str(library), str(source), "-lm"],
                                      capture_output=True, text=True, timeout=120)
                if done.returncode != 0:
                    raise RuntimeError(f"{cc} failed: {done.stderr.strip()[-400:]}")
                _kernel_cache.write_manifest(folder, name)
            lib = ctypes.CDLL(str(library))
        i64, ptr = ctypes.c_int64, ctypes.c_void_p
        lib.bn_stack_forward.argtypes = [ptr] * 4 + [ctypes.c_int] + [ptr] * 5 + [i64] * 4
        lib.bn_stack_backward.argtypes = [ptr] * 5 + [ctypes.c_int, ptr] + [i64] * 4
        lib.bn_stack_forward.restype = lib.bn_stack_backward.restype = ctypes.c_int
        return lib
    except Exception as exc:  # no compiler, an unsafe folder and no private one, a lock held too long
        warnings.warn(f"bnlab: could not build {_WHAT} ({type(exc).__name__}: {exc}); "
                      "the ensemble's eager step uses ATen operators instead", RuntimeWarning, stacklevel=4)
        return None


def can_use(h: torch.Tensor) -> bool:
    """Whether :func:`batch_norm_stack` applies to the (k, groups, b, width) stack ``h``: float32 on the
    CPU, outside torch.func transforms (its autograd node is opaque to them), small enough or on one
    thread (:data:`SERIAL_MAX_ELEMENTS`), and the kernel built."""
    return (h.dtype == torch.float32 and h.device.type == "cpu" and h.dim() == 4
            and not torch._C._are_functorch_transforms_active()
            and (h.numel() <= SERIAL_MAX_ELEMENTS or torch.get_num_threads() == 1)
            and kernel() is not None)


#: the activations the kernel applies itself (``phi`` of :func:`batch_norm_stack`); any other φ runs after it
ACTIVATIONS = {None: 0, "relu": 1}


class _BatchNormStack(torch.autograd.Function):
    # the classic form (forward(ctx, ...)): with setup_context, apply binds the arguments by
    # inspect.signature on every call (see bnlab.nets.ensemble._BatchNormEager)

    @staticmethod
    def forward(ctx, h: torch.Tensor, eps: torch.Tensor, gamma, beta, act: int):
        h = h.contiguous()
        k, groups, b, width = h.shape
        xhat = torch.empty_like(h)
        y = torch.empty_like(h) if (gamma is not None or act) else xhat
        stats = h.new_empty((3, k, groups, 1, width))
        mean, var, r = stats.unbind(0)
        ga, be = (None, None) if gamma is None else (gamma.data_ptr(), beta.data_ptr())
        if kernel().bn_stack_forward(h.data_ptr(), eps.data_ptr(), ga, be, act, xhat.data_ptr(),
                                     y.data_ptr(), mean.data_ptr(), var.data_ptr(), r.data_ptr(),
                                     k, groups, b, width) != 0:
            raise MemoryError("bn_stack_forward could not allocate its scratch")
        ctx.act = act
        ctx.gamma = gamma
        ctx.save_for_backward(xhat, y, r)
        ctx.mark_non_differentiable(mean, var)
        return y, mean, var

    @staticmethod
    def backward(ctx, grad: torch.Tensor, _grad_mean, _grad_var):
        xhat, y, r = ctx.saved_tensors
        grad = grad.contiguous()
        k, groups, b, width = xhat.shape
        grad_h = torch.empty_like(xhat)
        gamma = ctx.gamma
        if kernel().bn_stack_backward(grad.data_ptr(), xhat.data_ptr(), y.data_ptr(), r.data_ptr(),
                                      None if gamma is None else gamma.data_ptr(), ctx.act, grad_h.data_ptr(),
                                      k, groups, b, width) != 0:
            raise MemoryError("bn_stack_backward could not allocate its scratch")
        return grad_h, None, None, None, None


def batch_norm_stack(h: torch.Tensor, eps: torch.Tensor, gamma: torch.Tensor | None = None,
                     beta: torch.Tensor | None = None, phi: str | None = None):
    """``(y, mean, var)``: batch normalization over dim 2 of the float32 CPU stack ``h`` (k, groups, b,
    width) with the per-network ``eps`` (k,), ``x̂ = (h − mean)·(var + ε)^(−1/2)``, then the frozen
    per-network affine map and φ: ``y = φ(γ·x̂ + β)`` (``gamma``, ``beta`` (k,) constants or both ``None``;
    ``phi`` ``None`` or ``"relu"``, :data:`ACTIVATIONS`); ``mean`` and the biased ``var`` (k, groups, 1,
    width) without gradient.  The same float operations as ATen's ``γ * x̂ + β`` and ``relu`` after the
    normalization.  Check :func:`can_use` first."""
    # the kernel reads raw pointers: every shape and dtype is checked here, where a mismatch would otherwise
    # read past a buffer
    if phi not in ACTIVATIONS:
        raise ValueError(f"phi={phi!r} is not allowed: the kernel applies {sorted(map(repr, ACTIVATIONS))}")
    if not (isinstance(h, torch.Tensor) and h.dtype == torch.float32 and h.device.type == "cpu" and h.dim() == 4
            and h.shape[2] >= 1):
        raise ValueError(f"h of {getattr(h, 'dtype', type(h))} {tuple(getattr(h, 'shape', ()))} is not allowed: "
                         "expected a float32 CPU stack (k, groups, b, width) with b ≥ 1")
    if (gamma is None) != (beta is None):
        raise ValueError("gamma and beta are not allowed apart: pass both or neither")
    k = h.shape[0]
    flat = {}
    for name, t in (("eps", eps), ("gamma", gamma), ("beta", beta)):
        if t is None:
            flat[name] = None
            continue
        if not (isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.device.type == "cpu"
                and t.numel() == k and not t.requires_grad):
            raise ValueError(f"{name} of {getattr(t, 'dtype', type(t))} {tuple(getattr(t, 'shape', ()))} is not "
                             f"allowed: expected {k} float32 CPU values, one per network of h, constants (the "
                             "kernel gives them no gradient)")
        flat[name] = t.reshape(-1).contiguous()
    return _BatchNormStack.apply(h, flat["eps"], flat["gamma"], flat["beta"], ACTIVATIONS[phi])
