"""The rank part's verdict where the collapse criterion r(H) < 2 cannot be read the usual way: two samples, and
representations that only follow a global average pooling (the audit's D6, D7)."""
import torch
from torch import nn

from bnlab.advice import advise
from bnlab.advice.collapse import NOT_JUDGED
from bnlab.nets import MLP

SKIP = ("gradients", "learning_rate", "batch_size")


def test_two_samples_at_full_rank_are_not_judged_as_collapse():
    # r(H) ≤ min(d, N) = 2: a full-rank batch of two used to be called a collapse
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 64, generator=g), torch.randint(0, 10, (2,), generator=g)
    r = advise(MLP(64, [32, 32, 32], 10, norm="bn", seed=0), (x, y), skip=SKIP).rank
    assert list(r.numerical_rank) == [2, 2, 2]  # full rank
    assert not r.collapsed and not r.remedies and set(r.status) == {NOT_JUDGED}
    assert "cannot be judged at this batch size" in r.verdict and "collapse —" not in r.verdict


def test_three_samples_are_judged():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 64, generator=g)
    r = advise(MLP(64, [32, 32], 10, norm="bn", seed=0), x, skip=SKIP).rank
    assert NOT_JUDGED not in r.status and "cannot be judged" not in r.verdict


def test_one_conv_layer_then_global_pooling_is_not_judged_and_does_not_contradict_itself():
    # the audit's D7: the only measured representation (the head's input) follows the pooling; the verdict called
    # it a collapse and, in the same sentence, "what pooling does, not judged as collapse"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                          nn.Flatten(), nn.Linear(8, 10))
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    r = advise(model, x, skip=SKIP).rank
    assert len(r.layers) == 1 and r.r_bound[0] < 2  # pooled: the features' common mean dominates
    assert not r.collapsed and not r.remedies
    assert r.verdict.startswith("rank collapse not judged") and "rank collapse —" not in r.verdict
