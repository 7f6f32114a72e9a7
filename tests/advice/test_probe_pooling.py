"""Global average pooling written as a mean over the positions is pooling to the structure probe, as
``nn.AdaptiveAvgPool2d`` and ``F.adaptive_avg_pool2d`` are (the audit's D2: a false rank collapse and a mean
field bound for the wrong architecture followed from missing it)."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from bnlab.advice import advise
from bnlab.advice.structure import FISHER


class _Net(nn.Module):
    def __init__(self, pool):
        super().__init__()
        torch.manual_seed(0)
        self.pool = pool
        self.body = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.head = nn.Linear(8, 10)

    def forward(self, x):
        h = self.body(x)
        if self.pool == "functional":
            h = F.adaptive_avg_pool2d(h, 1).flatten(1)
        elif self.pool == "mean":
            h = h.mean((2, 3))
        elif self.pool == "mean_negative_keepdim":
            h = torch.mean(h, dim=[-1, -2], keepdim=True).flatten(1)
        return self.head(h)


@pytest.mark.parametrize("pool", ["mean", "mean_negative_keepdim"])
def test_a_spatial_mean_of_a_conv_feature_map_is_global_average_pooling(pool):
    x = torch.randn(16, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    ref = advise(_Net("functional"), x, draws=2, skip=("gradients", "batch_size"))
    got = advise(_Net(pool), x, draws=2, skip=("gradients", "batch_size"))
    s = got.structure
    assert s.pooling == ref.structure.pooling == 1 and s.layers[-1].input_source == "global_pool"
    assert s.theorem[FISHER] is False and got.learning_rate.bound is None
    assert not got.rank.collapsed and got.rank.verdict == ref.rank.verdict


def test_a_mean_over_the_last_dim_of_a_conv1d_feature_map_is_pooling():
    class Seq1d(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.c = nn.Conv1d(1, 8, 5, padding=2)
            self.b = nn.BatchNorm1d(8)
            self.head = nn.Linear(8, 10)

        def forward(self, x):
            return self.head(F.relu(self.b(self.c(x))).mean(-1))

    s = advise(Seq1d(), torch.randn(16, 1, 32), skip=("gradients", "learning_rate", "rank", "batch_size")).structure
    assert s.pooling == 1 and s.layers[-1].input_source == "global_pool"


def test_a_mean_without_convolutions_or_over_other_dims_is_not_pooling():
    class Tokens(nn.Module):  # the mean over the tokens of an MLP's input: no feature map, no pooling
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 3)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)).mean(1))

    s = advise(Tokens(), torch.randn(16, 5, 6), skip=("gradients", "learning_rate", "rank", "batch_size")).structure
    assert s.pooling == 0

    class ChannelMean(_Net):  # a mean over channels is not over the positions
        def forward(self, x):
            return self.head(self.body(x).mean(1).flatten(1)[:, :8])

    s = advise(ChannelMean("none"), torch.randn(16, 1, 8, 8),
               skip=("gradients", "learning_rate", "rank", "batch_size")).structure
    assert s.pooling == 0
