"""Pre-activation ResNet (He et al. 2016b, Fig. 4e) against a functional re-implementation."""
import pytest
import torch
from torch.nn import functional as F

from bnlab.nets import PreActBlock, resnet


def _n_params(m):
    return sum(p.numel() for p in m.parameters())


def test_preact_resnet110_size_and_layout():
    m = resnet(110, 10, preact=True)
    assert _n_params(m) == 1_727_962  # He et al. 2016b: "1.7M"
    assert isinstance(m[0], torch.nn.Conv2d) and isinstance(m[1], PreActBlock)  # bare stem conv
    assert isinstance(m[-5], torch.nn.BatchNorm2d)  # final Norm → φ before the pooling
    assert len(m.norms) == 2 * 54 + 1


@pytest.mark.parametrize("shortcut_stage", [0, 1])
def test_preact_block_matches_functional_forward(shortcut_stage):
    # norm="bn" in eval mode with non-trivial running statistics and affine parameters, float64:
    # both sides compute the same expression, so they agree to float64 rounding (1e-12 relative).
    torch.manual_seed(0)
    m = resnet(20, 10, preact=True, dtype=torch.float64, seed=1).eval()
    for nrm in m.norms:
        nrm.running_mean.normal_()
        nrm.running_var.uniform_(0.5, 2.0)
        nrm.weight.data.normal_()
        nrm.bias.data.normal_()
    blocks = [b for b in m if isinstance(b, PreActBlock)]
    block = blocks[0] if shortcut_stage == 0 else blocks[3]  # blocks[3]: first of stage 2 (stride 2, 16→32)
    x = torch.randn(3, block.conv1.in_channels, 8, 8, dtype=torch.float64)

    def bn(t, layer):
        return F.batch_norm(t, layer.running_mean, layer.running_var, layer.weight, layer.bias, False, 0.0, layer.eps)

    pre = F.relu(bn(x, block.norm1))
    out = F.conv2d(pre, block.conv1.weight, stride=block.conv1.stride, padding=1)
    out = F.conv2d(F.relu(bn(out, block.norm2)), block.conv2.weight, padding=1)
    short = x
    if shortcut_stage:
        short = x[:, :, ::2, ::2]
        short = torch.cat([torch.zeros_like(short[:, :8]), short, torch.zeros_like(short[:, :8])], dim=1)
    torch.testing.assert_close(block(x), out + short, rtol=1e-12, atol=1e-12)


def test_preact_projection_shortcut_and_gn():
    m = resnet(18, 10, preact=True, norm="gn", norm_kwargs={"num_groups": 32})
    blocks = [b for b in m if isinstance(b, PreActBlock)]
    assert blocks[2].projection is not None and isinstance(blocks[2].projection, torch.nn.Conv2d)
    y = m(torch.randn(2, 3, 32, 32))
    assert y.shape == (2, 10) and torch.isfinite(y).all()
    with pytest.raises(ValueError, match="preact"):
        resnet(20, preact="yes")


def test_preact_bottleneck_is_refused_with_the_depths_that_work():
    # the pre-activation bottleneck block does not exist here: the error must say so, not build a
    # post-activation ResNet-50 behind the caller's back
    import pytest as _pytest

    from bnlab.nets import resnet as _resnet

    with _pytest.raises(ValueError, match="preact=True with depth=50"):
        _resnet(50, preact=True)
