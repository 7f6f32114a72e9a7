"""Optional compiled CPU kernels of BNP's dense layers (``BNPreconditioner(native=True)``).

Two kernels: a one-pass statistics kernel for Algorithm 2 step 1 (``shifted_moments``,
``shifted_mean_var``), and ``dense_step``, Algorithm 2 steps 1-5 for every dense layer of a step
in one call (one read of each layer input, one read-and-write of each weight gradient).

No eager PyTorch operator forms the column sums Σ(x - c) and Σ(x - c)² of an N × n_in input in one
read: ``torch.batch_norm_update_stats`` reads it twice (sum, then squared deviations), and
``torch.compile`` of the two sums generated code no faster than it (measured on CPU, one thread,
512 × 3072 float32: 0.45 ms both, against 0.21 ms for one read ``x.sum(0)``).  The kernel below
reads each entry once and updates both sums (the 4 operations per entry of Lange et al., Prop. 6:
subtract, add, square, add); rows are streamed in order and the per-column accumulators (2·n_in
values of the tile) stay in the L1 cache, so it runs at the speed of one read (0.22 ms there).

``dense_step`` exists because at small mini-batches an eager step is dominated by per-operator
overhead, not arithmetic: on the Table 1 network at N = 16 the eager ``step()`` issues about 20
operator calls (3-20 µs each) and three passes over each n_out × n_in gradient (a rank-1 update, a
scaling and a matrix-vector product, Algorithm 2 steps 4-5), where the whole step is ~0.5 MFLOP.
The kernel does steps 1-3 (moments about the running mean, the ρ-update, σ̃² and the factor
1/(q²σ̃²)) and then steps 4-5 row by row of G_w — G_w(i, j) ← (G_w(i, j) − μ_j G_b(i))/(q²σ̃²_j)
and G_b(i) ← G_b(i)/q² − Σ_j G_w(i, j) μ_j with the updated row, accumulated in the same pass — for
all layers, with the layer inputs kept by the forward hooks (no arithmetic in the hooks).
Its operation count per dense layer (Lange et al., Prop. 6: 4·n_in·N + 6·n_in·n_out + 2·n_out +
8·n_in) is 4·n_in·N (subtract, add, square, add per input entry) + 5·n_in·n_out (step 4: multiply,
subtract, multiply; step 5's sum: multiply, add — 1/q² folded into 1/σ̃² as in bnlab.optim.bnp's
Errata) + 2·n_out (G_b/q² − Σ) + 13·n_in + 2 (per column: μ_H − c, σ_H², the two running
updates, the maximum, σ̃², q²σ̃², the reciprocal), the same leading terms as the eager route whose
count ``tests/optim/test_bnp_flops.py`` pins.

The kernels are built on first use with ``torch.utils.cpp_extension.load_inline`` (a C++ compiler and ninja
are needed; ~20 s once, then cached by PyTorch in its extensions directory, ``TORCH_EXTENSIONS_DIR``).
They are compiled with ``-march=native`` for the machine that builds them; the extension's name
carries a hash of the CPU's model and feature flags, so a cache directory shared by machines with
different CPUs builds one copy per CPU instead of loading code the CPU cannot run.  If the build
fails, :func:`kernels` returns ``None`` and BNP keeps the eager route (a warning says why).

Accuracy: the sums are accumulated in the input's dtype, row after row, so each column's sum of
N terms carries a relative error ≤ N·u (u the unit roundoff; Higham, *Accuracy and Stability of
Numerical Algorithms*, §4.2) — for s2, a sum of non-negative terms, that bound is relative to s2
itself.  The variance s2/N - (s1/N)² about the shift c (the running mean) then loses a further
factor 1 + (μ_H - c)²/σ_H² to cancellation, as the moments route of ``_layers._shifted_moments``
does on other devices.  ``dense_step``'s steps 4-5 accumulate Σ_j G_w(i, j) μ_j in the gradient's
dtype (≤ n_in·u relative to Σ_j |G_w(i, j) μ_j|, as a BLAS matrix-vector product does).
"""
from __future__ import annotations

import warnings

import torch

from bnlab import _kernel_cache

__all__ = ["kernels", "can_use"]

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#include <limits>

template <typename T>
static void column_moments_rows(const T* x, const T* c, T* s1, T* s2, int64_t n, int64_t m,
                                int64_t begin, int64_t end) {
  for (int64_t j = begin; j < end; ++j) { s1[j] = T(0); s2[j] = T(0); }
  for (int64_t i = 0; i < n; ++i) {
    const T* row = x + i * m;
    #pragma omp simd
    for (int64_t j = begin; j < end; ++j) {
      const T d = row[j] - c[j];
      s1[j] += d;
      s2[j] += d * d;
    }
  }
}

// Column sums of x - c over the rows for columns [begin, end): tiles of 64 columns walk down the
// rows with their 2 x 64 accumulators in registers, so each entry of x is read once and nothing
// else goes to memory per row (row by row over all columns, the accumulators are loaded and stored
// at every row: 6.1 against 2.4 us at 16 x 3072, 122 against 89 us at 256 x 3072).
template <typename T>
static void column_moments(const T* x, const T* c, T* s1, T* s2, int64_t n, int64_t m,
                           int64_t begin, int64_t end) {
  constexpr int W = 64;
  int64_t j0 = begin;
  for (; j0 + W <= end; j0 += W) {
    T a1[W], a2[W], cc[W];
    #pragma omp simd
    for (int k = 0; k < W; ++k) { a1[k] = T(0); a2[k] = T(0); cc[k] = c[j0 + k]; }
    for (int64_t i = 0; i < n; ++i) {
      const T* row = x + i * m + j0;
      #pragma omp simd
      for (int k = 0; k < W; ++k) {
        const T d = row[k] - cc[k];
        a1[k] += d;
        a2[k] += d * d;
      }
    }
    #pragma omp simd
    for (int k = 0; k < W; ++k) { s1[j0 + k] = a1[k]; s2[j0 + k] = a2[k]; }
  }
  if (j0 < end) column_moments_rows<T>(x, c, s1, s2, n, m, j0, end);
}

std::vector<torch::Tensor> shifted_moments(torch::Tensor x, torch::Tensor c) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && c.dim() == 1 && c.is_contiguous() &&
              c.size(0) == x.size(1) && x.scalar_type() == c.scalar_type() &&
              x.device().is_cpu() && c.device().is_cpu(),
              "shifted_moments: expected a contiguous CPU (N, m) input and an (m,) shift of its dtype");
  const int64_t n = x.size(0), m = x.size(1);
  auto s1 = torch::empty({m}, x.options());
  auto s2 = torch::empty({m}, x.options());
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "shifted_moments", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* cp = c.data_ptr<scalar_t>();
    scalar_t* a = s1.data_ptr<scalar_t>();
    scalar_t* b = s2.data_ptr<scalar_t>();
    // Column tiles across threads; one thread takes all columns in one sweep over the rows.
    at::parallel_for(0, m, 512, [&](int64_t begin, int64_t end) {
      column_moments<scalar_t>(xp, cp, a, b, n, m, begin, end);
    });
  });
  return {s1, s2};
}

// The mean and biased variance of the columns (Eq. 13) from the sums about c, finished per column
// in place: mu = c + s1/n, var = max(s2/n - (s1/n)^2, 0).
std::vector<torch::Tensor> shifted_mean_var(torch::Tensor x, torch::Tensor c) {
  auto sums = shifted_moments(x, c);
  auto s1 = sums[0], s2 = sums[1];
  const int64_t n = x.size(0), m = x.size(1);
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "shifted_mean_var", [&] {
    const scalar_t* cp = c.data_ptr<scalar_t>();
    scalar_t* a = s1.data_ptr<scalar_t>();
    scalar_t* b = s2.data_ptr<scalar_t>();
    const scalar_t inv_n = scalar_t(1) / scalar_t(n);
    for (int64_t j = 0; j < m; ++j) {
      const scalar_t d = a[j] * inv_n;
      const scalar_t v = b[j] * inv_n - d * d;
      a[j] = cp[j] + d;
      b[j] = v < scalar_t(0) ? scalar_t(0) : v;  // NaN stays NaN (the caller keeps such columns back)
    }
  });
  return {s1, s2};
}

// Algorithm 2 steps 1-5 (Lange et al., §3.3, Eq. 15) for every dense layer of one step, in place:
// the running mean/variance (means, vars), the weight gradients (gws, n_out x n_in) and the bias
// gradients (gbs; an empty tensor for a layer without bias: only G_w <- G_w / (q^2 s~^2)).
// Steps 1-3 run for every layer first; when a layer's 1/(q^2 s~^2) has an entry that is not finite
// (s~^2 = 0 or subnormal: zero variances with eps2 = 0 or tiny) the index of the first such layer
// is returned and no gradient is touched (the caller raises); otherwise steps 4-5 follow and -1 is
// returned, or -2 when some column's new running mean or variance was not finite: such a column
// keeps its old statistics (the number of them per layer goes to `skipped`, if given).
template <typename T>
static bool statistics_and_inverse(const torch::Tensor& x, torch::Tensor& mean, torch::Tensor& var,
                                   T* inv, double rho, double eps1, double eps2, double q2,
                                   int64_t* skipped) {
  const int64_t n = x.size(0), m = x.size(1);
  std::vector<T> s1(m), s2(m);
  const T* xp = x.data_ptr<T>();
  T* mu = mean.data_ptr<T>();
  T* v = var.data_ptr<T>();
  at::parallel_for(0, m, 512, [&](int64_t begin, int64_t end) {
    column_moments<T>(xp, mu, s1.data(), s2.data(), n, m, begin, end);
  });
  // Steps 1-2 from the moments about c = mu_old: mu_H - c = s1/n, sigma_H^2 = s2/n - (s1/n)^2
  // (biased, Eq. 13; at n = 1 the variance about the running mean, (h - mu_old)^2 = s2, §3.3);
  // mu <- mu + (1 - rho)(mu_H - mu), sigma^2 <- sigma^2 + (1 - rho)(sigma_H^2 - sigma^2).
  const T a = T(1.0 - rho), inv_n = T(1) / T(n);
  T* p1 = s1.data();
  T* p2 = s2.data();
  // Branch-free loops (the n > 1 test hoisted, the maximum and the sign test as reductions in the
  // same loops) so the compiler vectorizes them: a scalar loop, or the maximum as a loop of its
  // own, cost 4-10 us for 3 072 columns, more than the read of a 16 x 3 072 input.
  // A column whose new mean or variance is not finite (a NaN/inf input, or a square that
  // overflows) keeps its old values: x - x == 0 exactly when x is finite (branch-free, vectorized).
  T vmax = T(0);
  int64_t bad = 0;
  if (n > 1) {
    #pragma omp simd reduction(max:vmax) reduction(+:bad)
    for (int64_t j = 0; j < m; ++j) {
      const T d = p1[j] * inv_n;
      const T var_h = std::max(p2[j] * inv_n - d * d, T(0));
      const T mj = mu[j] + a * d;
      const T vn = v[j] + a * (var_h - v[j]);
      const bool ok = (mj - mj == T(0)) & (vn - vn == T(0));
      mu[j] = ok ? mj : mu[j];
      const T vj = ok ? vn : v[j];
      v[j] = vj;
      vmax = std::max(vmax, vj);
      bad += ok ? 0 : 1;
    }
  } else {
    #pragma omp simd reduction(max:vmax) reduction(+:bad)
    for (int64_t j = 0; j < m; ++j) {
      const T mj = mu[j] + a * p1[j];
      const T vn = v[j] + a * (p2[j] - v[j]);
      const bool ok = (mj - mj == T(0)) & (vn - vn == T(0));
      mu[j] = ok ? mj : mu[j];
      const T vj = ok ? vn : v[j];
      v[j] = vj;
      vmax = std::max(vmax, vj);
      bad += ok ? 0 : 1;
    }
  }
  *skipped = bad;
  // Step 3 and the factor of steps 4-5: 1/(q^2 s~^2) = (1/q^2)/s~^2 (no overflow of q^2 s~^2),
  // s~^2 = sigma^2 + eps1 max sigma^2 + eps2.
  const T shift = T(eps1) * vmax + T(eps2), inv_q = T(1.0 / q2);
  T vt_min = std::numeric_limits<T>::infinity();
  #pragma omp simd reduction(min:vt_min)
  for (int64_t j = 0; j < m; ++j) {
    const T vt = v[j] + shift;
    vt_min = std::min(vt_min, vt);
    inv[j] = inv_q / vt;
  }
  // a usable inverse everywhere: s~^2 > 0 and (1/q^2)/s~^2 finite (a subnormal s~^2 overflows it)
  return vt_min > T(0) && inv_q / vt_min <= std::numeric_limits<T>::max();
}

template <typename T>
static void transform_gradient(torch::Tensor& gw, torch::Tensor& gb, const torch::Tensor& mean,
                               const T* inv, double q2) {
  const int64_t rows = gw.size(0), m = gw.size(1);
  T* g = gw.data_ptr<T>();
  const T* mu = mean.data_ptr<T>();
  const bool has_bias = gb.numel() > 0;
  T* b = has_bias ? gb.data_ptr<T>() : nullptr;
  const T inv_q2 = T(1.0 / q2);
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(m, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      T* row = g + i * m;
      if (has_bias) {
        const T gbi = b[i];
        T acc = T(0);
        #pragma omp simd reduction(+:acc)
        for (int64_t j = 0; j < m; ++j) {
          const T w = (row[j] - mu[j] * gbi) * inv[j];   // step 4
          row[j] = w;
          acc += w * mu[j];
        }
        b[i] = gbi * inv_q2 - acc;                        // step 5, with the updated G_w
      } else {
        #pragma omp simd
        for (int64_t j = 0; j < m; ++j) row[j] *= inv[j];
      }
    }
  });
}

int64_t dense_step(std::vector<torch::Tensor> xs, std::vector<torch::Tensor> means,
                   std::vector<torch::Tensor> vars, std::vector<torch::Tensor> gws,
                   std::vector<torch::Tensor> gbs, double rho, double eps1, double eps2,
                   std::vector<double> q2s, std::optional<torch::Tensor> skipped) {
  const size_t layers = xs.size();
  TORCH_CHECK(means.size() == layers && vars.size() == layers && gws.size() == layers &&
              gbs.size() == layers && q2s.size() == layers, "dense_step: lists of unequal length");
  if (skipped.has_value())
    TORCH_CHECK(skipped->dim() == 1 && skipped->numel() >= static_cast<int64_t>(layers) &&
                skipped->is_contiguous() && skipped->device().is_cpu() &&
                skipped->scalar_type() == torch::kInt64, "dense_step: skipped must be an int64 CPU vector");
  if (layers == 0) return -1;
  const auto dtype = xs[0].scalar_type();
  for (size_t l = 0; l < layers; ++l) {
    const auto& x = xs[l];
    const int64_t m = x.dim() == 2 ? x.size(1) : -1;
    TORCH_CHECK(x.dim() == 2 && x.size(0) > 0 && x.is_contiguous() && x.device().is_cpu() &&
                x.scalar_type() == dtype, "dense_step: layer ", l, ": expected a contiguous 2-D CPU input");
    for (const auto* t : {&means[l], &vars[l]})
      TORCH_CHECK(t->dim() == 1 && t->size(0) == m && t->is_contiguous() && t->device().is_cpu() &&
                  t->scalar_type() == dtype, "dense_step: layer ", l, ": statistics of the wrong shape/dtype");
    const auto& gw = gws[l];
    TORCH_CHECK(gw.dim() == 2 && gw.size(1) == m && gw.is_contiguous() && gw.device().is_cpu() &&
                gw.scalar_type() == dtype, "dense_step: layer ", l, ": expected a contiguous (n_out, n_in) gradient");
    const auto& gb = gbs[l];
    TORCH_CHECK(gb.numel() == 0 || (gb.dim() == 1 && gb.size(0) == gw.size(0) && gb.is_contiguous() &&
                gb.device().is_cpu() && gb.scalar_type() == dtype),
                "dense_step: layer ", l, ": expected an (n_out,) bias gradient or an empty tensor");
  }
  int64_t bad = -1;
  std::vector<int64_t> kept_back(layers, 0);
  AT_DISPATCH_FLOATING_TYPES(dtype, "dense_step", [&] {
    std::vector<std::vector<scalar_t>> invs(layers);
    for (size_t l = 0; l < layers; ++l) {
      invs[l].resize(xs[l].size(1));
      const bool ok = statistics_and_inverse<scalar_t>(xs[l], means[l], vars[l], invs[l].data(),
                                                       rho, eps1, eps2, q2s[l], &kept_back[l]);
      if (!ok && bad < 0) bad = static_cast<int64_t>(l);
    }
    if (bad >= 0) return;
    for (size_t l = 0; l < layers; ++l)
      transform_gradient<scalar_t>(gws[l], gbs[l], means[l], invs[l].data(), q2s[l]);
  });
  if (skipped.has_value()) {
    int64_t* out = skipped->data_ptr<int64_t>();
    for (size_t l = 0; l < layers; ++l) out[l] = kept_back[l];
  }
  if (bad >= 0) return bad;
  for (size_t l = 0; l < layers; ++l)
    if (kept_back[l]) return -2;
  return -1;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("shifted_moments", &shifted_moments, "(sum(x - c), sum((x - c)^2)) over the rows");
  m.def("shifted_mean_var", &shifted_mean_var, "column mean and biased variance about a shift");
  m.def("dense_step", &dense_step, "Algorithm 2 steps 1-5 of every dense layer, in place",
        py::arg("xs"), py::arg("means"), py::arg("vars"), py::arg("gws"), py::arg("gbs"), py::arg("rho"),
        py::arg("eps1"), py::arg("eps2"), py::arg("q2s"), py::arg("skipped") = py::none());
}
"""

_STATE: dict[str, object] = {}


def kernels():
    """The compiled module, or ``None`` if it cannot be built here (built once per process, on the
    first call; see the module docstring).  Its functions, over contiguous CPU float32/float64
    tensors of one dtype:

    * ``shifted_moments(x, c)`` -> ``(Σ(x - c), Σ(x - c)²)`` over the rows of an (N, m) input x and
      an (m,) shift c;
    * ``shifted_mean_var(x, c)`` -> ``(μ_H, σ_H²)`` (Lange et al. Eq. 13, biased variance) =
      ``(c + s1/N, max(s2/N - (s1/N)², 0))``;
    * ``dense_step(xs, means, vars, gws, gbs, rho, eps1, eps2, q2s, skipped=None)`` -> ``int``:
      Algorithm 2 steps 1-5 for each layer l in place (running ``means[l]``, ``vars[l]``; weight
      gradient ``gws[l]`` (n_out, n_in); bias gradient ``gbs[l]`` or an empty tensor), returning
      -1; or, when some layer's 1/(q²σ̃²) has an entry that is not finite (σ̃² = 0 or subnormal:
      zero variances with ε₂ = 0 or tiny), that layer's index
      before any gradient is changed; or -2 when columns with a non-finite new mean or variance
      kept their old statistics (their number per layer written to the int64 CPU vector
      ``skipped`` if given).

    Built and loaded through :mod:`bnlab._kernel_cache`: only from a folder of this user's
    that nobody else can write, after checking the folder against the SHA-256 manifest recorded at
    the last build (a mismatch rebuilds, with a warning), under a build lock whose stale copies are
    removed and whose wait is bounded (then ``None``: the eager route, with a warning).
    """
    if "kernel" not in _STATE:
        _STATE["kernel"] = _build()
    return _STATE["kernel"]


def _build():
    name = f"bnlab_bnp_native_v4_{_kernel_cache.cpu_tag()}"
    try:
        from torch.utils import cpp_extension

        folder = _kernel_cache.build_directory(name)
        with _kernel_cache.build_lock(folder):
            _kernel_cache.remove_torch_lock(folder)
            problem = _kernel_cache.check_manifest(folder, name)
            if problem is not None:
                if problem != "empty":
                    warnings.warn(f"bnlab: the native BNP kernels' build folder {folder} is not as it was built "
                                  f"({problem}); rebuilding it from the sources", RuntimeWarning, stacklevel=4)
                _kernel_cache.clear_directory(folder)
            module = cpp_extension.load_inline(
                name,
                cpp_sources=_SOURCE,
                extra_cflags=["-O3", "-march=native", "-fopenmp-simd"],
                build_directory=str(folder),
                verbose=False,
            )
            _kernel_cache.write_manifest(folder, name)
        return module
    except Exception as exc:  # no compiler / ninja / headers, an unsafe folder, a lock held too long
        warnings.warn(
            f"bnlab: could not build the native BNP kernels ({type(exc).__name__}: {exc}); "
            "using the eager route (native=True has no effect)",
            RuntimeWarning,
            stacklevel=4,
        )
        return None


def can_use(x: torch.Tensor, shift: torch.Tensor) -> bool:
    """Whether the kernel applies to this input (else the eager route is taken)."""
    return (x.device.type == "cpu" and x.dim() == 2 and x.dtype in (torch.float32, torch.float64)
            and x.dtype == shift.dtype and x.is_contiguous() and shift.is_contiguous())
