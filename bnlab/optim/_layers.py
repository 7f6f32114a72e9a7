"""Layer handlers of the BN preconditioner: one class per supported module type.

A handler knows, for its module, (a) which statistics of the layer input BNP keeps (one mean and
one variance per column of the layer's extended hidden-variable matrix Ĥ = [e, H] of Lange et al.,
Eqs. 10-11, or of the unfolded matrix 𝓗̂ of Eq. 18 for convolutions), (b) how to reduce one
mini-batch of layer input to the moments of those columns, (c) the norm-balancing scale q² of the
layer (Prop. 5 for dense layers, §4 for convolutions), and (d) how to view the weight gradient as
the (out, columns) matrix that Eq. 15 / Eq. 23 transform.  ``bnlab.optim.bnp`` keeps a registry
type -> handler (in the style of kfac-pytorch's layer helpers) instead of branching on types.

Moments are taken about a *shift* c (the layer's running mean): ``s1 = Σ (x - c)`` and
``s2 = Σ (x - c)²`` over the rows.  Three reasons: moments about a common shift add across
micro-batches and across processes (one all-reduce), the variance ``s2/n - (s1/n)²`` does not
cancel catastrophically when the shift is near the mean, and with a single row (mini-batch size 1
of a dense layer) ``s2`` *is* the variance about the running mean that Lange et al. prescribe for
that case (§3.3, after Algorithm 2).
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bnlab.optim import _native

__all__ = ["LayerHandler", "LinearHandler", "Conv1dHandler", "Conv2dHandler", "CONV_STATISTICS"]

#: How a convolution's input statistics are taken (see :class:`_ConvHandler`).
CONV_STATISTICS = ("channel", "unfold")

#: Elements of layer input per block of :func:`_shifted_moments` (1 MiB of float32): the
#: subtract-square-sum passes then run on a block that stays in the L2 cache, so the input is read
#: from memory once instead of the temporary being written and re-read (measured at N = 512 ×
#: 3072: 0.70 ms blocked against 1.2 ms in one piece, the single read ``x.sum(0)`` being 0.21 ms).
_BLOCK_ELEMENTS = 1 << 18


def block_rows(x: torch.Tensor) -> int:
    """Samples per block of :func:`_shifted_moments` for an input shaped like ``x``."""
    per_sample = max(1, math.prod(x.shape[1:]))
    return max(1, min(x.shape[0], _BLOCK_ELEMENTS // per_sample))


def _shifted_moments(x: torch.Tensor, shift: torch.Tensor, scratch: torch.Tensor | None, dims):
    """``(Σ (x - c), Σ (x - c)²)`` over ``dims`` (which include the sample dimension 0).

    ``shift`` broadcasts against ``x``; ``scratch`` holds at least :func:`block_rows` samples of
    ``x``'s trailing shape, or is ``None`` when ``x`` is a private copy that may be overwritten.
    The samples are taken in cache-sized blocks (a loop over blocks, not over samples); each block
    costs the 4 operations per entry that Prop. 6 counts (subtract, sum, square, sum), plus two
    additions per column to accumulate the blocks when there is more than one.
    """
    n = x.shape[0]
    step = block_rows(x)
    if step >= n:  # one block (no slicing: a view per call costs ~1 µs of the hook's overhead)
        d = x.sub_(shift) if scratch is None else torch.sub(x, shift, out=scratch)
        return d.sum(dims), d.mul_(d).sum(dims)
    s1 = s2 = None
    for start in range(0, n, step):
        xb = x[start:start + step]
        d = xb.sub_(shift) if scratch is None else torch.sub(xb, shift, out=scratch[: xb.shape[0]])
        b1 = d.sum(dims)
        b2 = d.mul_(d).sum(dims)
        if s1 is None:
            s1, s2 = b1, b2
        else:
            s1.add_(b1)
            s2.add_(b2)
    return s1, s2


def _moments_two_pass(x: torch.Tensor, shift: torch.Tensor):
    """``(Σ (x - c), Σ (x - c)²)`` over the rows of a 2-D CPU input, from its mean and variance.

    The mean μ_H and the biased variance σ_H² of the columns come from the batch-norm statistics
    kernel (``torch.batch_norm_update_stats`` with no running buffers: a sum pass, then a pass
    summing squared deviations from μ_H; no N × n_in temporary is written, and the two-pass
    variance does not cancel).  Measured on a 512 × 3072 float32 input, one thread: 0.46 ms,
    against 0.70 ms for the blocked subtract-sum-square-sum of :func:`_shifted_moments` and
    0.21 ms for the single read ``x.sum(0)``; ``torch.var_mean`` takes 11 ms (it reduces the
    columns one at a time).  The moments about c then follow exactly (no cancellation: a sum of
    non-negative terms): with d = μ_H - c, ``s1 = N d`` and ``s2 = N (σ_H² + d²)``.
    """
    n = x.shape[0]
    mean, var = torch.batch_norm_update_stats(x, None, None, 0.0)
    d = mean.sub_(shift)
    return d * n, torch.addcmul(var, d, d).mul_(n)


def _layer_label(name: str) -> str:
    return repr(name) if name else "'<root module>'"


class LayerHandler:
    """Base class: the statistics and gradient views BNP needs for one module.

    Subclasses set ``expected_input_ndim`` and implement :meth:`num_columns`, :meth:`moments`,
    :meth:`q2`, :meth:`expand` and (if the weight is not already ``(out, in)``) :meth:`weight_matrix`.
    """

    expected_input_ndim: int = 2
    #: The input's axis that holds the features the statistics are kept for (Linear: the last; conv: channels).
    width_axis: int = -1

    def __init__(self, module: nn.Module, name: str, **options):
        self.module = module
        self.name = name

    # --- construction-time validation -------------------------------------------------------
    @classmethod
    def check(cls, module: nn.Module, name: str, **options) -> None:
        """Raise ``ValueError`` naming the layer if BNP cannot precondition this configuration."""

    # --- statistics ---------------------------------------------------------------------------
    def num_columns(self) -> int:
        """Length of the mean/variance vectors kept for this layer."""
        raise NotImplementedError

    def input_width(self) -> int:
        """The size the input must have along :attr:`width_axis` (the module's own would refuse another)."""
        raise NotImplementedError

    def fits(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is an input this module accepts: checked before anything is recorded, so that an input
        the module then refuses leaves no statistics of the wrong width behind."""
        return x.dim() == self.expected_input_ndim and x.shape[self.width_axis] == self.input_width()

    def check_input(self, x: torch.Tensor) -> None:
        if x.dim() != self.expected_input_ndim:
            raise ValueError(
                f"BNP layer {_layer_label(self.name)} ({type(self.module).__name__}) got an input of shape "
                f"{tuple(x.shape)}: expected a {self.expected_input_ndim}-D batched input"
                f"{self._input_hint()}; skip the layer with skip=[{self.name!r}] if it cannot be given one"
            )
        if x.shape[self.width_axis] != self.input_width():
            raise ValueError(
                f"BNP layer {_layer_label(self.name)} ({type(self.module).__name__}) got an input of shape "
                f"{tuple(x.shape)}: expected {self.input_width()} features along dimension {self.width_axis}"
                f"{self._input_hint()}, as the layer itself does"
            )

    def _input_hint(self) -> str:
        return ""

    def moments(
        self, x: torch.Tensor, shift: torch.Tensor, out: torch.Tensor
    ) -> tuple[int, int, torch.Tensor, torch.Tensor]:
        """Return ``(samples, rows, s1, s2)`` of one mini-batch input ``x`` about ``shift``.

        ``out`` is scratch memory of ``x``'s dtype holding :func:`block_rows` samples of ``x``'s
        trailing shape, or ``None`` when ``x`` is a private copy (mixed precision) that may be
        overwritten; reusing it avoids allocating (and page-faulting) a temporary on every forward
        pass.

        ``samples`` is the mini-batch size N, ``rows`` the number of rows of Ĥ (or 𝓗̂) each column
        has (N for a dense layer), ``s1 = Σ_rows (x - c)`` and ``s2 = Σ_rows (x - c)²`` per column.
        """
        raise NotImplementedError

    def q2(self, samples):
        """The norm-balancing scale q² of Lange et al. (Prop. 5 / §4) for ``samples`` inputs."""
        raise NotImplementedError

    def batch_statistics(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(μ_H, σ_H²)`` of one mini-batch input (mean and biased variance per column, Eq. 13)
        when the handler computes them directly, else ``None`` (then :meth:`moments` is used)."""
        return None

    def batch_statistics_about(self, x: torch.Tensor, shift: torch.Tensor):
        """:meth:`batch_statistics` where the handler may use the running mean ``shift`` (e.g. as
        the shift of a one-pass kernel); by default :meth:`batch_statistics` itself."""
        return self.batch_statistics(x)

    def expand(self, vec: torch.Tensor) -> torch.Tensor:
        """Map a per-column vector to one entry per column of :meth:`weight_matrix`."""
        return vec

    # --- gradients ----------------------------------------------------------------------------
    def weight_matrix(self, grad: torch.Tensor) -> torch.Tensor:
        """The weight gradient as the (out, in) matrix G_w of Algorithm 2 / 3 (a view if possible)."""
        return grad


class LinearHandler(LayerHandler):
    """``nn.Linear``: Algorithm 2 of Lange et al. (§3.3, Eq. 15) on a 2-D input (N, n_in)."""

    expected_input_ndim = 2

    def num_columns(self) -> int:
        return self.module.in_features

    def input_width(self) -> int:
        return self.module.in_features

    def _input_hint(self) -> str:
        return " (N, in_features)"

    def __init__(self, module, name, *, moments_kernel=None, **options):
        super().__init__(module, name)
        # The compiled kernels of ``_native`` (BNPreconditioner(native=True)), or None.
        self.moments_kernel = moments_kernel

    def batch_statistics(self, x):
        # Algorithm 2 step 1 on CPU: the batch-norm statistics kernel (see _moments_two_pass).
        if x.device.type == "cpu":
            return torch.batch_norm_update_stats(x, None, None, 0.0)
        return None

    def batch_statistics_about(self, x, shift):
        # With native=True: μ_H, σ_H² from one read of x about the running mean
        # (bnlab.optim._native).
        if self.moments_kernel is not None and _native.can_use(x, shift):
            return self.moments_kernel.shifted_mean_var(x, shift)
        return self.batch_statistics(x)

    def moments(self, x, shift, out):
        # Lange et al., Algorithm 2 step 1: the mean/variance of the N rows of H (the 4·n_in·N
        # operations of Prop. 6: sum; subtract, square, sum).
        n = x.shape[0]
        if self.moments_kernel is not None and _native.can_use(x, shift):
            s1, s2 = self.moments_kernel.shifted_moments(x, shift)  # one read of x (see _native)
        elif x.device.type == "cpu":
            s1, s2 = _moments_two_pass(x, shift)
        else:
            s1, s2 = _shifted_moments(x, shift, out, 0)
        return n, n, s1, s2

    def q2(self, samples):
        # Prop. 5: q² = max(n_{l-1}/N, 1).
        n_in = self.module.in_features
        if isinstance(samples, torch.Tensor):
            return torch.clamp(n_in / samples, min=1.0)
        return max(n_in / samples, 1.0)


def _pairs(value, nd: int) -> tuple[int, ...]:
    if isinstance(value, int):
        return (value,) * nd
    return tuple(int(v) for v in value)


class _ConvHandler(LayerHandler):
    """Shared logic of ``nn.Conv1d`` / ``nn.Conv2d`` (Lange et al. §4, Algorithm 3).

    ``statistics="channel"`` is Algorithm 3 as printed: one mean and variance per input channel
    over the mini-batch and the spatial positions of the (unpadded) feature map, Eqs. 21-22, the
    approximation the authors use.  ``statistics="unfold"`` keeps one mean and variance per
    column of the unfolded matrix 𝓗 of Eq. 18 (per kernel entry and input channel, Eqs. 19-20),
    the zeros of the padding counted as entries, exactly as Prop. 9 derives them; stride and
    dilation enter through which input entries each column contains.
    """

    nd: int = 2
    width_axis = 1

    def __init__(self, module, name, *, conv_statistics: str = "channel", **options):
        super().__init__(module, name)
        self.statistics = conv_statistics
        self.kernel = _pairs(module.kernel_size, self.nd)
        self.stride = _pairs(module.stride, self.nd)
        self.dilation = _pairs(module.dilation, self.nd)
        self.kernel_numel = math.prod(self.kernel)
        self.in_channels = module.in_channels
        self.positions = 1

    @classmethod
    def check(cls, module, name, *, conv_statistics: str = "channel", **options):
        kind = type(module).__name__
        if module.groups != 1:
            raise ValueError(
                f"BNP cannot precondition layer {_layer_label(name)} ({kind} with groups={module.groups}): "
                "only groups=1 convolutions are supported (Lange et al. §4 derive BNP for a dense kernel); "
                f"skip it with skip=[{name!r}]"
            )
        if conv_statistics == "unfold" and module.padding_mode != "zeros":
            raise ValueError(
                f"BNP cannot precondition layer {_layer_label(name)} ({kind} with "
                f"padding_mode={module.padding_mode!r}) with conv_statistics='unfold': Eqs. 19-20 count zero "
                "padding; use conv_statistics='channel' (Eqs. 21-22) or skip the layer"
            )

    def num_columns(self) -> int:
        if self.statistics == "channel":
            return self.in_channels
        return self.in_channels * self.kernel_numel

    def input_width(self) -> int:
        return self.in_channels

    def _input_hint(self) -> str:
        return " (N, C, L)" if self.nd == 1 else " (N, C, H, W)"

    def _pad_amounts(self, spatial: Sequence[int]) -> list[tuple[int, int]]:
        """(before, after) zero padding per spatial dimension, as the module applies it."""
        padding = self.module.padding
        if isinstance(padding, str):
            if padding == "valid":
                return [(0, 0)] * self.nd
            # 'same': PyTorch pads dilation·(k-1) in total, the extra one (if odd) after.
            out = []
            for k, d in zip(self.kernel, self.dilation):
                total = d * (k - 1)
                out.append((total // 2, total - total // 2))
            return out
        return [(p, p) for p in _pairs(padding, self.nd)]

    def output_positions(self, spatial: Sequence[int]) -> int:
        """Number of output positions L (the rows of 𝓗 per sample; r·s for a 'same' 2-D conv)."""
        total = 1
        for size, (lo, hi), k, s, d in zip(spatial, self._pad_amounts(spatial), self.kernel, self.stride,
                                           self.dilation):
            total *= (size + lo + hi - d * (k - 1) - 1) // s + 1
        return total

    def moments(self, x, shift, out):
        n_samples = x.shape[0]
        spatial = x.shape[2:]
        self.positions = self.output_positions(spatial)
        if self.statistics == "channel":
            # Eqs. 21-22: per input channel over the mini-batch and all positions of the map.
            view = (-1,) + (1,) * self.nd
            dims = (0,) + tuple(range(2, 2 + self.nd))
            s1, s2 = _shifted_moments(x, shift.view(view), out, dims)
            return n_samples, n_samples * math.prod(spatial), s1, s2
        # Eqs. 19-20: per column of the unfolded matrix; unfolding is a linear copy of entries, so
        # the column sums of x and x² over the batch are the unfolds of the batch-summed maps (no
        # N·C·k²·L unfold).  The moments about c then follow from the raw ones; their rounding
        # error is ~eps·(σ² + μ² + c²) absolute, harmless beside σ̃²'s floor ε₁·max σ² unless a
        # column's |μ| exceeds ~300× the largest σ of the layer.
        rows = n_samples * self.positions
        s_x = x.sum(0, keepdim=True)
        s_xx = None
        step = block_rows(x)
        for start in range(0, n_samples, step):  # cache-sized blocks, as in _shifted_moments
            xb = x[start:start + step]
            sq = xb.mul_(xb) if out is None else torch.mul(xb, xb, out=out[: xb.shape[0]])
            part = sq.sum(0, keepdim=True)
            s_xx = part if s_xx is None else s_xx.add_(part)
        col_x = self._unfold_sum(s_x)
        col_xx = self._unfold_sum(s_xx)
        s1 = col_x - rows * shift
        s2 = col_xx - 2.0 * shift * col_x + rows * shift * shift
        return n_samples, rows, s1, s2

    def _unfold_sum(self, m: torch.Tensor) -> torch.Tensor:
        """Column sums of the unfolded (zero-padded) map m of shape (1, C, *spatial)."""
        pads = self._pad_amounts(m.shape[2:])
        if self.nd == 1:
            m = m.unsqueeze(2)
            pads = [(0, 0)] + pads
            kernel, stride, dilation = (1,) + self.kernel, (1,) + self.stride, (1,) + self.dilation
        else:
            kernel, stride, dilation = self.kernel, self.stride, self.dilation
        flat_pad = []
        for lo, hi in reversed(pads):  # F.pad takes the last dimension first
            flat_pad += [lo, hi]
        m = F.pad(m, flat_pad)
        cols = F.unfold(m, kernel_size=kernel, dilation=dilation, stride=stride)  # (1, C·k, L)
        return cols.sum(-1).squeeze(0)

    def q2(self, samples):
        # §4 (before Algorithm 3): q² = max(c·k²/N, √(rs)), with r·s the number of output positions
        # of the last input seen (the rows of 𝓗 per sample; the map size for a 'same' convolution).
        ck = self.in_channels * self.kernel_numel
        root = math.sqrt(self.positions)
        if isinstance(samples, torch.Tensor):
            return torch.clamp(ck / samples, min=root)
        return max(ck / samples, root)

    def expand(self, vec):
        if self.statistics == "channel":
            # μ ⊗ e and σ̃ ⊗ e of Eq. 23: each channel's value for its k² kernel entries.
            return vec.repeat_interleave(self.kernel_numel)
        return vec

    def weight_matrix(self, grad):
        return grad.reshape(grad.shape[0], -1)


class Conv1dHandler(_ConvHandler):
    """``nn.Conv1d``: Algorithm 3 of Lange et al. with one spatial dimension (input (N, C, L))."""

    nd = 1
    expected_input_ndim = 3


class Conv2dHandler(_ConvHandler):
    """``nn.Conv2d``: Algorithm 3 of Lange et al. (§4, Eqs. 16-23; input (N, C, H, W))."""

    nd = 2
    expected_input_ndim = 4
