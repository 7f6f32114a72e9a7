"""BNP on convolutions (Lange et al. §4, Eqs. 18-23, Algorithm 3) against a dense reimplementation.

The reference builds the unfolded matrix 𝓗 of Eq. 18 with ``torch.nn.functional.unfold`` (rows:
sample × output position; columns: input channel × kernel entry, zero padding included), checks
that the layer's weight gradient is 𝓗ᵀδ in that column order (so the reference's columns are the
kernel's), takes the statistics with torch's mean/var — over the columns of 𝓗 for
``conv_statistics="unfold"`` (Eqs. 19-20) and over the feature map per channel for "channel"
(Eqs. 21-22) — and applies the explicit matrix (1/q²)·P·Pᵀ of Eq. 23 with q² = max(c k²/N, √L).
float64; each side is a few hundred O(1) operations (~1e-14 relative), tolerance 1e-10.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn
import torch.nn.functional as F

from bnlab.optim import BNPreconditioner

RTOL = 1e-10


def unfold_rows(conv, x):
    """𝓗 of Eq. 18: (N·L, C·k) for a Conv2d, or a Conv1d seen as a 1×k Conv2d."""
    if isinstance(conv, nn.Conv1d):
        x4 = x.unsqueeze(2)
        k, d, s = (1, conv.kernel_size[0]), (1, conv.dilation[0]), (1, conv.stride[0])
        pad = conv.padding
        if pad == "valid":
            pad = (0,)
        if isinstance(pad, str):
            total = conv.dilation[0] * (conv.kernel_size[0] - 1)
            x4 = F.pad(x4, (total // 2, total - total // 2))
            p = (0, 0)
        else:
            p = (0, pad[0])
        cols = F.unfold(x4, k, dilation=d, padding=p, stride=s)
    else:
        pad = conv.padding
        if pad == "valid":
            pad = 0
        if isinstance(pad, str):
            pads = []
            for kk, dd in zip(reversed(conv.kernel_size), reversed(conv.dilation)):
                total = dd * (kk - 1)
                pads += [total // 2, total - total // 2]
            x = F.pad(x, pads)
            pad = 0
        cols = F.unfold(x, conv.kernel_size, dilation=conv.dilation, padding=pad, stride=conv.stride)
    n, ck, l = cols.shape
    return cols.permute(0, 2, 1).reshape(n * l, ck), l


def dense_pp_t(mean, var_tilde):
    n = mean.numel()
    u = torch.eye(n + 1, dtype=torch.float64)
    u[0, 1:] = -mean
    p = u @ torch.diag(torch.cat([torch.ones(1, dtype=torch.float64), 1.0 / torch.sqrt(var_tilde)]))
    return p @ p.T


CASES = [
    # (conv factory, input shape)
    (lambda: nn.Conv2d(3, 4, 3, padding=1), (5, 3, 6, 7)),
    (lambda: nn.Conv2d(3, 2, (3, 2), stride=2, padding=(1, 2), dilation=(1, 2)), (4, 3, 9, 8)),
    (lambda: nn.Conv2d(2, 3, 3, stride=1, padding="same", dilation=2), (3, 2, 7, 7)),
    (lambda: nn.Conv2d(2, 3, 2, padding="same"), (3, 2, 5, 6)),  # even kernel: asymmetric 'same' padding
    (lambda: nn.Conv2d(2, 3, 3, padding="valid", bias=False), (2, 2, 6, 5)),
    (lambda: nn.Conv1d(3, 4, 3, stride=2, padding=2, dilation=2), (4, 3, 11)),
    (lambda: nn.Conv1d(2, 2, 4, padding="same"), (1, 2, 9)),
]


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel")
@pytest.mark.parametrize("mode", ["channel", "unfold"])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("block", [None, 1])
def test_algorithm3_against_dense_unfold(case, mode, block, monkeypatch):
    # block = 1: the hooks take one sample per cache block, so the moments are accumulated over
    # blocks (the default block holds these small inputs whole).
    if block is not None:
        monkeypatch.setattr("bnlab.optim._layers._BLOCK_ELEMENTS", block)
    factory, shape = CASES[case]
    torch.manual_seed(case)
    conv = factory().double()
    rho, eps1, eps2 = 0.8, 0.02, 1e-3
    pre = BNPreconditioner(conv, rho=rho, eps1=eps1, eps2=eps2, conv_statistics=mode)
    cols_per_channel = math.prod(conv.kernel_size)
    c_in = conv.in_channels
    mean_ref = torch.zeros(c_in if mode == "channel" else c_in * cols_per_channel, dtype=torch.float64)
    var_ref = torch.ones_like(mean_ref)
    g = torch.Generator().manual_seed(100 + case)
    for _ in range(2):
        x = 1.5 + torch.randn(*shape, generator=g, dtype=torch.float64) * torch.linspace(
            0.2, 3.0, shape[1], dtype=torch.float64).view(1, -1, *([1] * (len(shape) - 2)))
        conv.zero_grad()
        out = conv(x)
        r = torch.randn(out.shape, generator=g, dtype=torch.float64)
        (out * r).sum().backward()
        rows, n_pos = unfold_rows(conv, x)
        delta = r.reshape(r.shape[0], r.shape[1], -1).permute(0, 2, 1).reshape(-1, r.shape[1])  # (N·L, out)
        gw_raw = conv.weight.grad.reshape(conv.out_channels, -1).clone()
        # The reference's column order is the kernel's: ∂L/∂W = δᵀ 𝓗 (Lemma 8).
        torch.testing.assert_close(gw_raw, delta.T @ rows, rtol=RTOL, atol=RTOL)
        gb_raw = conv.bias.grad.clone() if conv.bias is not None else None
        pre.step()

        if mode == "unfold":
            mu_b, var_b = rows.mean(0), rows.var(0, unbiased=False)  # Eqs. 19-20, padding zeros counted
        else:
            dims = (0,) + tuple(range(2, x.dim()))
            mu_b, var_b = x.mean(dims), x.var(dims, unbiased=False)  # Eqs. 21-22
        mean_ref = rho * mean_ref + (1 - rho) * mu_b
        var_ref = rho * var_ref + (1 - rho) * var_b
        vt = var_ref + eps1 * var_ref.max() + eps2
        mu_cols, vt_cols = mean_ref, vt
        if mode == "channel":  # μ ⊗ e, σ̃ ⊗ e of Eq. 23
            mu_cols = mean_ref.repeat_interleave(cols_per_channel)
            vt_cols = vt.repeat_interleave(cols_per_channel)
        q2 = max(c_in * cols_per_channel / shape[0], math.sqrt(n_pos))
        got_w = conv.weight.grad.reshape(conv.out_channels, -1)
        if gb_raw is None:
            torch.testing.assert_close(got_w, gw_raw / (q2 * vt_cols), rtol=RTOL, atol=RTOL)
            continue
        ghat = torch.cat([gb_raw[:, None], gw_raw], 1) @ dense_pp_t(mu_cols, vt_cols) / q2
        torch.testing.assert_close(got_w, ghat[:, 1:], rtol=RTOL, atol=RTOL)
        torch.testing.assert_close(conv.bias.grad, ghat[:, 0], rtol=RTOL, atol=RTOL)
    got_mu, got_var = pre.statistics("")
    torch.testing.assert_close(got_mu, mean_ref, rtol=RTOL, atol=RTOL)
    torch.testing.assert_close(got_var, var_ref, rtol=RTOL, atol=RTOL)


def test_unfold_and_channel_statistics_differ_by_the_border():
    """Prop. 10: the per-column means differ from the channel mean by at most (k-1)(1/2r+1/2s-(k-1)/4rs)·max|h|."""
    torch.manual_seed(0)
    conv = nn.Conv2d(2, 1, 3, padding=1).double()
    x = torch.rand(3, 2, 8, 10, dtype=torch.float64) + 1.0
    pu = BNPreconditioner(conv, rho=0.0, conv_statistics="unfold")
    conv(x).sum().backward()
    pu.step()
    pu.remove()
    mu_cols, _ = pu.statistics("")
    mu_chan = x.mean((0, 2, 3))
    k, r, s = 3, 8, 10
    bound = (k - 1) * (1 / (2 * r) + 1 / (2 * s) - (k - 1) / (4 * r * s)) * x.abs().amax((0, 2, 3))
    err = (mu_cols.view(2, 9) - mu_chan[:, None]).abs().amax(1)
    assert bool((err <= bound + 1e-12).all())
    assert float(err.max()) > 0.01  # the border really changes the statistics


def test_conv_without_bias_and_groups_rejected():
    with pytest.raises(ValueError, match=r"'1'.*groups=2"):
        BNPreconditioner(nn.Sequential(nn.Conv2d(4, 4, 3), nn.Conv2d(4, 4, 3, groups=2)))
    with pytest.raises(ValueError, match="padding_mode='reflect'"):
        BNPreconditioner(nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), conv_statistics="unfold")
    # channel statistics do not depend on the padding: accepted
    BNPreconditioner(nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"))
    # skipped by name: accepted
    BNPreconditioner(nn.Sequential(nn.Conv2d(4, 4, 3), nn.Conv2d(4, 4, 3, groups=2)), skip=["1"])


def test_conv_input_dimension_checked():
    pre = BNPreconditioner(nn.Sequential(nn.Conv2d(2, 2, 3)))
    with pytest.raises(ValueError, match=r"'0'.*\(2, 5, 5\).*4-D"):
        pre.layers["0"](torch.randn(2, 5, 5))
    pre1 = BNPreconditioner(nn.Conv1d(2, 2, 3))
    with pytest.raises(ValueError, match="3-D"):
        pre1.layers[""](torch.randn(2, 5))


def test_channels_last_gradients():
    """A channels_last kernel gradient (not viewable as (out, in)) is written back correctly."""
    torch.manual_seed(1)
    conv = nn.Conv2d(3, 4, 3, padding=1).double()
    ref = nn.Conv2d(3, 4, 3, padding=1).double()
    ref.load_state_dict(conv.state_dict())
    conv = conv.to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 5, 5, dtype=torch.float64)
    p1, p2 = BNPreconditioner(conv), BNPreconditioner(ref)
    conv(x.to(memory_format=torch.channels_last)).square().sum().backward()
    ref(x).square().sum().backward()
    p1.step()
    p2.step()
    torch.testing.assert_close(conv.weight.grad, ref.weight.grad, rtol=RTOL, atol=RTOL)
