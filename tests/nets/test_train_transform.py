"""train(transform=...): every training batch passes through the transform, test batches do not."""
import pytest
import torch
from torch import nn

from bnlab.nets import train


def test_transform_sees_every_training_batch_and_changes_what_the_model_learns():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 3, generator=g)
    y = (x[:, 0] > 0).long()
    calls = []

    def flip_sign(xb):
        calls.append(xb.shape)
        return -xb

    def run(transform):
        model = nn.Linear(3, 2)
        with torch.no_grad():
            model.weight.copy_(torch.randn(2, 3, generator=g) * 0.01)
            model.bias.zero_()
        return train(model, (x, y), optimizer=lambda p: torch.optim.SGD(p, lr=0.5), batch_size=8, steps=40,
                     test_data=(x, y), transform=transform)

    plain, flipped = run(None), run(flip_sign)
    assert calls == [torch.Size([8, 3])] * 40
    # trained on −x, evaluated on x untransformed: the learned sign is backwards
    assert plain.test_accuracy > 0.9 and flipped.test_accuracy < 0.1


def test_transform_must_be_callable():
    with pytest.raises(ValueError, match="transform"):
        train(nn.Linear(3, 2), (torch.randn(8, 3), torch.zeros(8, dtype=torch.long)),
              optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=4, steps=1, transform=3)
